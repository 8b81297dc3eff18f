"""cpu_math: the numpy softmax, activations and log-sum-exp compute what MLX and
mlx-lm do, values and gradients (attention under every mask mlx-lm passes, whole
prefills of every supported architecture, a stage-2 loss), and only inside
numpy_passes."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask
from tiny import CONFIGS, tiny_model

from mlx_kvlingo import cpu_math
from mlx_kvlingo.models.cache import prefill, read_layer


def _close(a, b, atol, what="", rtol=0):
    np.testing.assert_allclose(np.array(a), np.array(b), atol=atol, rtol=rtol, err_msg=what)


def _qkv(B, H, Hk, L, S, D, seed=0):
    k = mx.random.split(mx.random.key(seed), 3)
    return (mx.random.normal((B, H, L, D), key=k[0]), mx.random.normal((B, Hk, S, D), key=k[1]),
            mx.random.normal((B, Hk, S, D), key=k[2]))


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("L,S", [(37, 37), (20, 53), (1, 9)])
@pytest.mark.parametrize("mask", ["causal", "window", "additive", None])
def test_attention_equals_mlx(heads, L, S, mask):
    """Grouped-query heads, queries after earlier tokens (L < S), several blocks."""
    H, Hk = heads
    q, k, v = _qkv(2, H, Hk, L, S, 16)
    if mask == "window":  # a sliding layer's boolean mask, as mlx-lm builds it
        m = create_causal_mask(L, S - L, window_size=8)
    elif mask == "additive":
        m = mx.random.normal((L, S)) * 3
    else:
        m = mask
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=m)
    out = cpu_math.attention(q, k, v, 0.25, m, block=8)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    _close(out, ref, 1e-5, f"{heads} {L}x{S} {mask}")


@pytest.mark.parametrize("additive", [False, True])
def test_masked_blocks_skip_the_keys_their_queries_cannot_see(additive, monkeypatch):
    """A recompute pass's mask: queries at scattered positions in order, each seeing
    the keys up to its own; blocks read only the keys up to their last query's
    (fewer scores), and the result is mlx's."""
    monkeypatch.setattr(cpu_math, "MASKED_BLOCK", 4)
    monkeypatch.setattr(cpu_math, "MASKED_SCORES", 4 * 6 * 64)  # 4 queries of 6 heads
    S = 64
    positions = mx.array([3, 5, 6, 17, 18, 30, 41, 42, 43, 60, 61, 62, 63])
    allowed = mx.arange(S)[None] <= positions[:, None]
    mask = mx.where(allowed, 0.0, -mx.inf) if additive else allowed
    q, k, v = _qkv(1, 6, 2, positions.size, S, 16, seed=5)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    widths, softmax = [], cpu_math._softmax
    monkeypatch.setattr(cpu_math, "_softmax",
                        lambda s, n: widths.append(s.shape[-1]) or softmax(s, n))
    out = cpu_math.attention(q, k, v, 0.25, mask)
    _close(out, ref, 1e-5, f"additive={additive}")
    assert widths == [18, 43, 63, 64]  # blocks of 4 queries: up to 17, 42, 62, 63
    # Where the scores fit, the queries go in one block: one round trip to numpy.
    monkeypatch.setattr(cpu_math, "MASKED_SCORES", 13 * 6 * 64)
    widths.clear()
    _close(cpu_math.attention(q, k, v, 0.25, mask), ref, 1e-5, "one block")
    assert widths == [64]


def test_activations_and_log_softmax_equal_mlx():
    x = mx.random.normal((3, 70, 400)) * 4
    g = mx.random.normal((3, 70, 400)) * 4
    _close(cpu_math.gelu_approx(x), nn.gelu_approx(x), 1e-5)
    _close(cpu_math.swiglu(g, x), nn.silu(g) * x, 1e-4)
    logits = mx.random.normal((2, 64, 3000)) * 10
    _close(cpu_math.log_softmax(logits), logits - mx.logsumexp(logits, -1, keepdims=True), 1e-5)
    np.testing.assert_allclose(np.array(cpu_math.exp(x)), np.array(mx.exp(x)), rtol=1e-6)


def _grads(f, *xs):
    w = mx.random.normal(f(*xs).shape, key=mx.random.key(7))
    return mx.grad(lambda *a: (f(*a) * w).sum(), argnums=tuple(range(len(xs))))(*xs)


def test_gradients_equal_mlx():
    """The written-out VJPs: activations, and attention under each kind of mask."""
    x, g = mx.random.normal((2, 9, 50)) * 3, mx.random.normal((2, 9, 50)) * 3
    _close(_grads(cpu_math.gelu_approx, x)[0], _grads(nn.gelu_approx, x)[0], 1e-5)
    for a, b in zip(_grads(cpu_math.swiglu, g, x), _grads(lambda g, x: nn.silu(g) * x, g, x)):
        _close(a, b, 1e-5, rtol=1e-5)
    q, k, v = _qkv(2, 6, 2, 20, 53, 16)
    for mask in ("causal", create_causal_mask(20, 33, window_size=8), None):
        fast = _grads(lambda q, k, v: cpu_math.attention(q, k, v, 0.25, mask, block=8), q, k, v)
        ref = _grads(lambda q, k, v: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=0.25, mask=mask), q, k, v)
        for name, a, b in zip("qkv", fast, ref):
            _close(a, b, 1e-5, f"d{name}, mask {type(mask).__name__}")


@pytest.fixture
def every_pass(monkeypatch):
    """The numpy paths for every query and activation size, in blocks of 4, counted."""
    monkeypatch.setattr(cpu_math, "MIN_SCORES", 1)
    monkeypatch.setattr(cpu_math, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(cpu_math, "BLOCK", 4)
    calls = {"attention": 0, "activation": 0}
    attention, swiglu, gelu = cpu_math.attention, cpu_math.swiglu, cpu_math.gelu_approx

    def counted(name, f):
        def g(*a, **kw):
            calls[name] += 1
            return f(*a, **kw)
        return g

    monkeypatch.setattr(cpu_math, "attention",
                        counted("attention", lambda q, k, v, s, m: attention(q, k, v, s, m, 4)))
    monkeypatch.setattr(cpu_math, "swiglu", counted("activation", swiglu))
    monkeypatch.setattr(cpu_math, "gelu_approx", counted("activation", gelu))
    return calls


def _prefill_off(model, tokens, cache=None, monkeypatch=None):
    monkeypatch.setenv(cpu_math.ENV, "0")
    try:
        return prefill(model, tokens, cache)
    finally:
        monkeypatch.delenv(cpu_math.ENV)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_prefill_equals_mlx_lm_for_every_architecture(arch, every_pass, monkeypatch):
    """The cache (every layer, sliding ones included) and the next-token logits of
    a prefill in two chunks, with and without the numpy paths."""
    model = tiny_model(arch, seed=1)
    tokens = mx.array(np.random.default_rng(0).integers(0, 97, (2, 30)))
    fast = prefill(model, tokens[:, 19:], prefill(model, tokens[:, :19]))
    assert every_pass["attention"] > 0 and every_pass["activation"] > 0
    ref = _prefill_off(model, tokens[:, 19:], _prefill_off(model, tokens[:, :19],
                                                           monkeypatch=monkeypatch),
                       monkeypatch)
    for i, (a, b) in enumerate(zip(fast, ref)):
        for x, y in zip(read_layer(a)[:2], read_layer(b)[:2]):
            _close(x, y, 5e-5, f"{arch} layer {i}", rtol=1e-4)  # float32 rounding, layer on layer
    nxt = tokens[:, -1:]
    _close(model(nxt, cache=fast), model(nxt, cache=ref), 1e-4, f"{arch} logits", rtol=1e-4)


def test_only_numpy_passes_take_the_numpy_paths(every_pass):
    """Outside numpy_passes (e.g. under mx.compile) the model runs mlx's own
    functions; inside, the numpy ones, with the same gradients."""
    model = tiny_model("gemma3_text", seed=2)
    tokens = mx.array([[3, 5, 7, 11, 13, 17, 19, 23, 29, 31]])
    prefill(model, tokens[:, :3])  # installs the dispatchers
    every_pass.update(attention=0, activation=0)
    h = model.model.embed_tokens(tokens)
    # A random projection of the normed hidden states: their mean square alone is
    # constant (the final norm fixes it), so its gradient would be rounding noise.
    w = mx.random.normal((*tokens.shape, model.args.hidden_size), key=mx.random.key(3))

    def loss(h):
        return (model.model(tokens, input_embeddings=h) * w).mean()

    ref = mx.value_and_grad(loss)(h)
    mx.eval(ref)
    assert every_pass == {"attention": 0, "activation": 0}
    with cpu_math.numpy_passes():
        fast = mx.value_and_grad(loss)(h)
        mx.eval(fast)
    assert every_pass["attention"] > 0 and every_pass["activation"] > 0
    _close(fast[0], ref[0], 1e-6)
    _close(fast[1], ref[1], 1e-5, rtol=1e-4)  # entries up to ~1.4: float32 rounding


def test_few_queries_over_a_long_cache_take_the_numpy_attention(monkeypatch):
    """What decides is the attention's scores (heads x queries x keys), not its
    queries: a switch's short first step over a long cache is most of its softmax."""
    monkeypatch.setattr(cpu_math, "MIN_SCORES", 4 * 4 * 600)
    q = mx.zeros((1, 4, 4, 8))
    short, long = mx.zeros((1, 2, 60, 8)), mx.zeros((1, 2, 600, 8))
    assert cpu_math._long_attention(q, long, long)
    assert not cpu_math._long_attention(q, short, short)
    assert not cpu_math._long_attention(q[:, :, :1], long, long)
    assert not cpu_math._long_attention(q, long, long, sinks=mx.zeros((4,)))


def test_off_switch_and_the_attention_recorder(every_pass, monkeypatch):
    """MLX_KVLINGO_CPU_MATH=0 leaves every pass to mlx; a recorder swapped into
    the module in place of mlx-lm's function is left alone, not wrapped."""
    from mlx_kvlingo.models.features import attention_weights

    model = tiny_model("qwen3", seed=2)
    tokens = mx.array([[3, 5, 7, 11, 13, 17, 19, 23]])
    monkeypatch.setenv(cpu_math.ENV, "0")
    prefill(model, tokens)
    assert every_pass == {"attention": 0, "activation": 0}
    monkeypatch.delenv(cpu_math.ENV)
    cache, weights = attention_weights(model, tokens)
    assert len(weights) == len(model.layers)  # the recorder saw every layer
    _close(mx.sum(weights[0], -1), mx.ones((1, 8)), 1e-5)


def test_logsumexp_and_its_gradient_equal_mlx():
    x = mx.random.normal((2, 7, 5000)) * 5
    w = mx.random.normal((2, 7, 1))

    def loss(f):
        return lambda x: (f(x) * w).sum()

    v1, g1 = mx.value_and_grad(loss(cpu_math.logsumexp))(x)
    v2, g2 = mx.value_and_grad(loss(lambda x: mx.logsumexp(x, -1, keepdims=True)))(x)
    _close(v1, v2, 1e-3)
    _close(g1, g2, 1e-7, rtol=1e-4)


def test_stage2_loss_and_gradients_are_mlx_s(every_pass, monkeypatch):
    """The KL loss of a stage-2 step and its gradients in the maps, with the
    vocabulary's log-sum-exp in numpy and in MLX."""
    from mlx_kvlingo.train.distill import LowRankMaps, kl_loss, make_batch
    from mlx_kvlingo.translator.maps import Translator

    src, tgt = tiny_model("qwen3", seed=1), tiny_model("gemma3_text", seed=2)
    tokens = mx.array(np.random.default_rng(1).integers(0, 97, (2, 40)))
    t = Translator.for_models(src, tgt, None, None)
    maps = LowRankMaps(t, rank=4)
    for b in maps.b_k + maps.b_v:  # a correction that is not zero
        b += 0.01
    batch = make_batch(src, tgt, t, tokens[:, :30], tokens[:, 30:])
    grad = nn.value_and_grad(maps, lambda m, b: kl_loss(m, tgt, b))
    every_pass.update(attention=0, activation=0)
    fast = grad(maps, batch)
    assert every_pass["attention"] > 0 and every_pass["activation"] > 0
    monkeypatch.setenv(cpu_math.ENV, "0")
    ref = grad(maps, batch)
    _close(fast[0], ref[0], 1e-6)
    flat = lambda g: dict(__import__("mlx.utils", fromlist=["x"]).tree_flatten(g))  # noqa: E731
    for name, g in flat(fast[1]).items():
        _close(g, flat(ref[1])[name], 1e-6, name, rtol=1e-4)


def test_a_first_pass_without_recompute_takes_the_numpy_paths(every_pass):
    """A switch whose first pass recomputes nothing (a long native tail, a long new
    message) is a short prefill too: the numpy paths, as a re-prefill's, and the
    logits mlx's own functions give."""
    from mlx_kvlingo.models.cache import copy_cache, last_logits
    from mlx_kvlingo.switching.recompute import recompute_and_read

    model = tiny_model("gemma3_text", seed=4)
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 97, 40)]
    cache = prefill(model, mx.array([tokens[:24]]))
    ref = last_logits(model, mx.array([tokens[24:]]), copy_cache(cache), keep=3)
    mx.eval(ref)
    every_pass.update(attention=0, activation=0)
    fast = recompute_and_read(model, cache, tokens, [], tokens[24:], keep=3)
    assert every_pass["attention"] > 0 and every_pass["activation"] > 0
    _close(fast, ref, 1e-4, rtol=1e-4)
    assert min(c.offset for c in cache) == 40

"""Model adapters: rope in/out, cache reading, geometry, and identity round trips
through a translated cache on every tiny architecture."""

import functools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import rope_utils
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.utils import _get_classes
from tiny import CONFIGS, identity_translator, tiny_model

from mlx_kvlingo import models as kv_models
from mlx_kvlingo.errors import KvlingoError, UnsupportedModel
from mlx_kvlingo.models.cache import prefill, read_layer
from mlx_kvlingo.models.geometry import cache_geometry, check_supported
from mlx_kvlingo.models.rope import rerope, unrope
from mlx_kvlingo.switching.api import translate_cache, translate_context
from mlx_kvlingo.translator.maps import Translator

ARCHS = list(CONFIGS)

# Un-rotated K/V features of a cache.
content_features = kv_models.cache_features


@functools.lru_cache(maxsize=None)
def model(name):
    """One shared tiny model per architecture (tests never modify models)."""
    return tiny_model(name)


def tokens(n, seed, vocab=97):
    return mx.array(np.random.default_rng(seed).integers(0, vocab, size=n), dtype=mx.int32)


def max_diff(a, b):
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


# ---------------------------------------------------------------------------
# unrope / rerope

HEAD_DIM = 24


def _rope_modules():
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    longrope = {
        "rope_type": "longrope",
        "original_max_position_embeddings": 64,
        "short_factor": [1.0] * (HEAD_DIM // 2),
        "long_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
    }
    init = rope_utils.initialize_rope
    return {
        "rope": nn.RoPE(HEAD_DIM),
        "rope_traditional": nn.RoPE(HEAD_DIM, traditional=True, base=500.0),
        "rope_partial": nn.RoPE(16),
        "rope_partial_traditional": nn.RoPE(8, traditional=True),
        "rope_linear": init(HEAD_DIM, 10000.0, False, {"rope_type": "linear", "factor": 2.0}),
        "llama3": init(HEAD_DIM, 500000.0, False, llama3, 4096),
        "llama3_traditional": rope_utils.Llama3RoPE(
            HEAD_DIM, 4096, traditional=True, base=10000.0, scaling_config=llama3
        ),
        "yarn": init(HEAD_DIM, 10000.0, False, yarn, 4096),
        "yarn_partial_traditional": rope_utils.YarnRoPE(
            16, traditional=True, scaling_factor=4.0, original_max_position_embeddings=64
        ),
        "longrope": init(HEAD_DIM, 10000.0, False, longrope, 4096),
        "suscaled_partial": rope_utils.SuScaledRoPE(
            16, max_position_embeddings=4096, original_max_position_embeddings=64,
            long_factor=2.0,
        ),
    }


ROPES = _rope_modules()
OFFSETS = [0, 1, 7, 300, 5000]


def test_scaled_ropes_really_scale():
    """The yarn / longrope cases above exercise input scaling (mscale != 1)."""
    assert ROPES["yarn"].mscale != pytest.approx(1.0)
    assert ROPES["yarn_partial_traditional"].mscale != pytest.approx(1.0)
    assert ROPES["longrope"]._scale != pytest.approx(1.0)
    assert ROPES["suscaled_partial"]._scale != pytest.approx(1.0)
    assert isinstance(ROPES["llama3"], rope_utils.Llama3RoPE)
    assert isinstance(ROPES["yarn"], rope_utils.YarnRoPE)
    assert isinstance(ROPES["longrope"], rope_utils.SuScaledRoPE)


@pytest.mark.parametrize("name", list(ROPES))
@pytest.mark.parametrize("offset", OFFSETS)
def test_unrope_inverts_rope(name, offset):
    rope = ROPES[name]
    mx.random.seed(1)
    x = mx.random.normal((2, 3, 5, HEAD_DIM))
    y = rope(x, offset=offset)
    assert max_diff(y, x) > 0.1  # rope really changed the keys
    assert max_diff(unrope(rope, y, offset), x) < 1e-5
    # The inverse is position-specific: un-rotating at another offset is wrong.
    assert max_diff(unrope(rope, y, offset + 3), x) > 1e-2


@pytest.mark.parametrize("name", list(ROPES))
def test_unrope_of_a_suffix(name):
    """Keys of positions s..T-1 from a rope over 0..T-1 un-rotate with start s
    (how sliding-window layers are read)."""
    rope = ROPES[name]
    mx.random.seed(2)
    x = mx.random.normal((1, 2, 12, HEAD_DIM))
    y = rope(x, offset=0)
    assert max_diff(unrope(rope, y[:, :, 7:], 7), x[:, :, 7:]) < 1e-5


@pytest.mark.parametrize("name", list(ROPES))
@pytest.mark.parametrize("a,b", [(0, 9), (13, 0), (40, 1234), (5, 5)])
def test_rerope_moves_keys_to_another_position(name, a, b):
    rope = ROPES[name]
    mx.random.seed(3)
    x = mx.random.normal((1, 2, 6, HEAD_DIM))
    moved = rerope(rope, unrope(rope, rope(x, offset=a), a), b)
    assert max_diff(moved, rope(x, offset=b)) < 2e-5
    assert max_diff(rerope(rope, x, b), rope(x, offset=b)) < 1e-5  # tables vs the module


def test_unrope_keeps_dtype():
    rope = ROPES["yarn"]
    x = mx.random.normal((1, 2, 4, HEAD_DIM)).astype(mx.float16)
    out = unrope(rope, rope(x, offset=3), 3)
    assert out.dtype == mx.float16
    assert max_diff(out, x) < 1e-2


# ---------------------------------------------------------------------------
# Identity translation reproduces the native model


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("native_prefix", [0, 1, 3])
@pytest.mark.parametrize("ctx_len,cont_len", [(20, 4), (6, 3), (3, 1)])
def test_identity_translation_matches_native_logits(arch, native_prefix, ctx_len, cont_len):
    m = model(arch)
    t = identity_translator(m)
    t.spec.native_prefix = native_prefix
    ctx, cont = tokens(ctx_len, seed=ctx_len), tokens(cont_len, seed=100 + cont_len)

    full = mx.concatenate([ctx, cont])[None]
    native = m(full)[:, ctx_len - 1 : ctx_len - 1 + cont_len]

    cache = translate_context(m, m, t, ctx)
    expected_types = [type(c) for c in make_prompt_cache(m)]
    assert [type(c) for c in cache] == expected_types
    assert all(c.offset == ctx_len - 1 for c in cache)
    for c in cache:
        k, v, start = read_layer(c)
        if isinstance(c, RotatingKVCache):
            assert k.shape[2] == min(ctx_len - 1, c.max_size)
            assert start == ctx_len - 1 - k.shape[2]
        else:
            assert k.shape[2] == ctx_len - 1 and start == 0
        assert k.dtype == v.dtype == mx.float32

    inputs = mx.concatenate([ctx[-1:], cont[:-1]])[None]
    translated = m(inputs, cache=cache)
    assert translated.shape == native.shape
    assert max_diff(translated, native) <= 1e-4
    assert all(c.offset == ctx_len - 1 + cont_len for c in cache)


def test_gemma3_rotating_layers_are_exercised():
    """A context longer than the window leaves exactly `window` positions in the
    translated sliding layers, and everything in the full layers."""
    m = model("gemma3_text")
    cache = translate_context(m, m, identity_translator(m), tokens(20, seed=5))
    sizes = [read_layer(c)[0].shape[2] for c in cache]
    assert sizes == [8, 8, 19, 8, 8, 19]
    assert [read_layer(c)[2] for c in cache] == [11, 11, 0, 11, 11, 0]


@pytest.mark.parametrize("native_prefix", [0, 1, 3])
def test_native_prefix_tokens_come_from_the_target(native_prefix):
    """With all-zero maps, exactly the first native_prefix positions hold the
    target's own K/V; the translated rest is zero."""
    m = model("qwen3")
    t = identity_translator(m)
    for lin in t.k_maps + t.v_maps:
        lin.weight = mx.zeros_like(lin.weight)
    t.spec.native_prefix = native_prefix
    ctx = tokens(10, seed=3)
    cache = translate_context(m, m, t, ctx)
    native = prefill(m, ctx[:-1])
    for c, ref in zip(cache, native):
        k, v, start = read_layer(c)
        rk, rv, _ = read_layer(ref)
        assert start == 0 and k.shape[2] == 9
        n = native_prefix
        if n:
            assert max_diff(k[..., :n, :], rk[..., :n, :]) < 1e-5
            assert max_diff(v[..., :n, :], rv[..., :n, :]) < 1e-5
        assert mx.abs(k[..., n:, :]).max().item() == 0.0
        assert mx.abs(v[..., n:, :]).max().item() == 0.0


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_non_identity_translation_changes_logits(arch):
    """Control: the comparison above can fail. Scaling the translated values changes
    the continuation logits."""
    m = model(arch)
    t = identity_translator(m)
    for lin in t.v_maps:
        lin.weight = 0.5 * lin.weight
    ctx, cont = tokens(20, seed=1), tokens(3, seed=2)
    native = m(mx.concatenate([ctx, cont])[None])[:, 19:22]
    cache = translate_context(m, m, t, ctx)
    translated = m(mx.concatenate([ctx[-1:], cont[:-1]])[None], cache=cache)
    assert max_diff(translated, native) > 1e-3


# Untied LM heads (and these seeds) make greedy generation vary from step to step
# instead of echoing one token.
GENERATION_SEEDS = {"qwen2": 1, "qwen3": 1, "llama": 0, "llama_traditional": 0,
                    "mistral": 0, "gemma3_text": 0}


@functools.lru_cache(maxsize=None)
def untied_model(arch):
    return tiny_model(arch, seed=GENERATION_SEEDS[arch], tie_word_embeddings=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_generation_from_translated_cache_matches_full_prefill(arch):
    m = untied_model(arch)
    t = identity_translator(m)
    ctx = tokens(20, seed=7)

    ref = list(generate_step(ctx, m, max_tokens=10))
    cache = translate_context(m, m, t, ctx)
    got = list(generate_step(ctx[-1:], m, max_tokens=10, prompt_cache=cache))

    ref_ids = [int(tok) for tok, _ in ref]
    got_ids = [int(tok) for tok, _ in got]
    assert len(ref_ids) == 10
    assert got_ids == ref_ids
    for (_, lp_ref), (_, lp_got) in zip(ref, got):
        assert max_diff(lp_ref, lp_got) <= 1e-4
    # generate_step computes one token ahead: the cache has seen all 10 yielded tokens.
    assert cache[0].offset >= 20 + 9

    # Control: the translated cache matters. Another context's cache, same last token,
    # gives other log-probabilities.
    other = mx.concatenate([tokens(19, seed=8), ctx[-1:]])
    wrong = translate_context(m, m, t, other)
    _, lp_wrong = next(generate_step(ctx[-1:], m, max_tokens=1, prompt_cache=wrong))
    assert max_diff(lp_wrong, ref[0][1]) > 1e-3


# ---------------------------------------------------------------------------
# read_layer


def test_read_layer_plain_kv_cache():
    m = model("qwen3")
    ctx = tokens(10, seed=3)
    cache = prefill(m, ctx)
    assert isinstance(cache[0], KVCache)
    assert cache[0].keys.shape[2] > 10  # pre-allocated buffer; read_layer must slice
    k, v, start = read_layer(cache[0])
    assert k.shape == (1, 2, 10, 24) and v.shape == (1, 2, 10, 24) and start == 0
    assert read_layer(KVCache()) == (None, None, 0)


def test_read_layer_dequantizes_quantized_cache():
    m = tiny_model("qwen3", head_dim=32)
    ctx = tokens(10, seed=4)
    cache = prefill(m, ctx)
    originals = [read_layer(c) for c in cache]
    qcache = [c.to_quantized(bits=8, group_size=32) for c in cache]
    assert all(isinstance(c, QuantizedKVCache) for c in qcache)
    for (k0, v0, _), qc in zip(originals, qcache):
        k, v, start = read_layer(qc)
        assert start == 0
        assert k.shape == k0.shape == (1, 2, 10, 32) and v.shape == v0.shape
        for a, b in ((k, k0), (v, v0)):
            # 8-bit affine quantization over groups of 32 (= one head row):
            # error at most about one quantization step of that row.
            step = (b.max(axis=-1, keepdims=True) - b.min(axis=-1, keepdims=True)) / 255
            err = mx.abs(a - b)
            assert mx.all(err <= step + 1e-6).item()
            assert 0 < err.max().item()

    # The quantized cache keeps working; read_layer follows its offset.
    nxt = tokens(1, seed=44)
    m(nxt[None], cache=qcache)
    k, v, start = read_layer(qcache[0])
    assert k.shape[2] == 11 and start == 0
    # Layer 0 keys depend on the token only: compare with a fresh prefill.
    ref_k, _, _ = read_layer(prefill(m, mx.concatenate([ctx, nxt]))[0])
    assert max_diff(k[..., 10:, :], ref_k[..., 10:, :]) < 0.05
    assert read_layer(QuantizedKVCache(group_size=32, bits=8)) == (None, None, 0)


@pytest.mark.parametrize("prefill_len,steps", [(12, 5), (5, 6), (3, 12), (8, 9)])
def test_read_layer_rotating_cache_after_wrapping(prefill_len, steps):
    m = model("gemma3_text")
    toks = tokens(prefill_len + steps, seed=prefill_len)
    cache = prefill(m, toks[:prefill_len])
    for i in range(prefill_len, prefill_len + steps):
        m(toks[None, i : i + 1], cache=cache)
    total = prefill_len + steps
    reference = prefill(m, toks)  # one pass: every position readable

    wrapped = False
    for layer, (c, ref) in enumerate(zip(cache, reference)):
        k, v, start = read_layer(c)
        rk, rv, rstart = read_layer(ref)
        assert rstart == 0 and rk.shape[2] == total
        if isinstance(c, RotatingKVCache):
            assert c.max_size == 8
            assert k.shape[2] == 8 and v.shape[2] == 8
            assert start == total - 8
            wrapped |= 0 < c._idx < c.keys.shape[2]
        else:
            assert k.shape[2] == total and start == 0
        assert max_diff(k, rk[..., start:, :]) < 1e-4, layer
        assert max_diff(v, rv[..., start:, :]) < 1e-4, layer
    # The ring buffer really wrapped: its raw storage is not in temporal order.
    assert wrapped


def test_read_layer_rotating_cache_before_it_fills():
    m = model("gemma3_text")
    toks = tokens(6, seed=9)
    cache = prefill(m, toks[:4])
    m(toks[None, 4:5], cache=cache)
    m(toks[None, 5:6], cache=cache)
    k, v, start = read_layer(cache[0])
    assert cache[0].keys.shape[2] == 8  # grown buffer with unwritten slots
    assert k.shape[2] == 6 and start == 0
    rk, _, _ = read_layer(prefill(m, toks)[0])
    assert max_diff(k, rk) < 1e-4


# ---------------------------------------------------------------------------
# Geometry

EXPECTED_GEOMETRY = {
    # arch: (layers, kv heads, head_dim, rope class)
    "qwen2": (4, 2, 16, "RoPE"),
    "qwen3": (4, 2, 24, "RoPE"),
    "llama": (4, 2, 16, "Llama3RoPE"),
    "llama_traditional": (4, 2, 16, "RoPE"),
    "mistral": (4, 1, 16, "RoPE"),
    "gemma3_text": (6, 1, 32, "RoPE"),
}


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_geometry(arch):
    g = cache_geometry(model(arch))
    n_layers, n_kv, head_dim, rope_cls = EXPECTED_GEOMETRY[arch]
    assert g.model_type == CONFIGS[arch]["model_type"]
    assert g.dtype == "float32"
    assert g.n_layers == n_layers
    for lg in g.layers:
        assert lg.n_kv_heads == n_kv
        assert lg.head_dim == head_dim
        assert lg.width == n_kv * head_dim
        assert lg.rope["class"] == rope_cls
    if arch == "gemma3_text":
        assert [lg.window for lg in g.layers] == [8, 8, None, 8, 8, None]
        local, glob = g.layers[0].rope, g.layers[2].rope
        assert local != glob  # gemma3 uses another rope base for its local layers
        assert g.layers[1].rope == local and g.layers[5].rope == glob
    else:
        assert all(lg.window is None for lg in g.layers)
    if arch == "llama_traditional":
        assert g.layers[0].rope["traditional"] is True
    if arch == "qwen2":
        assert g.layers[0].rope["traditional"] is False


def test_cache_geometry_round_trips_and_fingerprints():
    g = cache_geometry(model("qwen3"))
    assert type(g).from_dict(g.to_dict()) == g
    # Weights and dtype do not change the fingerprint; the rope and the shapes do.
    other_seed = tiny_model("qwen3", seed=5)
    assert cache_geometry(other_seed).fingerprint() == g.fingerprint()
    other_seed.set_dtype(mx.float16)
    g16 = cache_geometry(other_seed)
    assert g16.dtype == "float16" and g16.fingerprint() == g.fingerprint()
    assert cache_geometry(tiny_model("qwen3", rope_theta=1e4)).fingerprint() != g.fingerprint()
    assert cache_geometry(tiny_model("qwen3", head_dim=16)).fingerprint() != g.fingerprint()
    assert cache_geometry(model("llama")).fingerprint() != cache_geometry(
        model("llama_traditional")).fingerprint()


MAMBA = dict(
    model_type="mamba", vocab_size=97, hidden_size=32, intermediate_size=64, state_size=8,
    num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=4,
)


def test_ssm_model_is_unsupported():
    model_cls, args_cls = _get_classes(MAMBA)
    m = model_cls(args_cls.from_dict(MAMBA))
    assert type(make_prompt_cache(m)[0]).__name__ == "ArraysCache"
    for fn in (check_supported, cache_geometry, lambda x: Translator.for_models(x, x)):
        with pytest.raises(UnsupportedModel) as e:
            fn(m)
        msg = str(e.value)
        assert "ArraysCache" in msg and "layer 0" in msg
        assert isinstance(e.value, KvlingoError)


# ---------------------------------------------------------------------------
# content_features


def _chunked_gemma_cache(m, toks, chunk=4):
    cache = make_prompt_cache(m)
    for i in range(0, toks.shape[0], chunk):
        m(toks[None, i : i + chunk], cache=cache)
    return cache


def test_content_features_refuses_layers_that_dropped_tokens():
    m = model("gemma3_text")
    toks = tokens(12, seed=11)
    cache = _chunked_gemma_cache(m, toks)
    starts = [read_layer(c)[2] for c in cache]
    assert starts[2] == 0 and starts[0] > 0  # the layers really disagree
    with pytest.raises(KvlingoError) as e:
        content_features(m, cache)
    msg = str(e.value)
    assert "dropped early tokens" in msg and "one pass" in msg
    assert "Layer 2" in msg and "0..11" in msg

    # Translating positions the cache no longer holds is refused with the same error
    # type (native_prefix 0: position 0 must come from the source). A sliding target
    # layer needs only the positions its window keeps, so a global target layer
    # (2) reads a sliding source layer (0) here.
    t = identity_translator(m)
    t.spec.native_prefix = 0
    t.spec.layer_map[2] = [0]
    with pytest.raises(KvlingoError, match="dropped early tokens"):
        translate_cache(m, m, t, cache, mx.concatenate([toks, toks[:1]]))


def test_content_features_consistent_subsets_of_a_chunked_cache():
    m = model("gemma3_text")
    toks = tokens(12, seed=11)
    cache = _chunked_gemma_cache(m, toks)
    ref_k, ref_v, ref_start = content_features(m, prefill(m, toks))
    assert ref_start == 0 and ref_k[0].shape == (1, 12, 32)

    ks, vs, start = content_features(m, cache, layers=[2, 5])
    assert start == 0 and ks[0] is None and ks[2].shape == (1, 12, 32)
    assert max_diff(ks[2], ref_k[2]) < 1e-4 and max_diff(vs[5], ref_v[5]) < 1e-4

    ks, vs, start = content_features(m, cache, layers=[0, 1, 3, 4])
    n = ks[0].shape[1]
    assert start == 12 - n and n < 12
    # Un-rotated at the right positions: equal to the one-pass features there.
    for i in (0, 1, 3, 4):
        assert max_diff(ks[i], ref_k[i][:, start:]) < 1e-4
        assert max_diff(vs[i], ref_v[i][:, start:]) < 1e-4


def test_content_features_of_empty_cache():
    m = model("qwen3")
    with pytest.raises(KvlingoError, match="empty"):
        content_features(m, make_prompt_cache(m))


@pytest.mark.parametrize("arch", ["qwen2", "gemma3_text"])
def test_copy_cache_is_independent(arch):
    """Steps on a copy (evaluate scores a translated cache twice, once on a copy)
    leave the original as it was, rotating layers included, and the copy reads the
    same as the original."""
    model = tiny_model(arch)
    tokens = mx.array([[5, 9, 3, 17, 2, 44, 8, 1, 30, 12, 7, 6]])
    cache = kv_models.prefill(model, tokens[:, :-1])
    before = [(c.offset, np.array(c.keys), np.array(c.values)) for c in cache]
    copy = kv_models.copy_cache(cache)
    for _ in range(3):
        copied_logits = model(tokens[:, -1:], cache=copy)
    after = [(c.offset, np.array(c.keys), np.array(c.values)) for c in cache]
    for (o1, k1, v1), (o2, k2, v2) in zip(before, after):
        assert o1 == o2
        np.testing.assert_array_equal(k1, k2)
        np.testing.assert_array_equal(v1, v2)
    assert [c.offset for c in copy] == [c.offset + 3 for c in cache]
    # The original still scores the next token as a fresh copy does.
    first = model(tokens[:, -1:], cache=kv_models.copy_cache(cache))
    again = model(tokens[:, -1:], cache=cache)
    np.testing.assert_allclose(np.array(first), np.array(again), atol=1e-6)
    assert copied_logits.shape == again.shape

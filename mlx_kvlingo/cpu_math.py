"""MLX's slow CPU transcendentals, done in numpy where it is safe.

On the CPU MLX computes transcendental functions one element at a time: ``mx.exp``
runs at about 30 M elements/s on this project's 2-core x86 machine, numpy's at
about 400 M/s. The work that needs them:

- a prefill's attention softmax, one exponential per (head, query, key) — 9.4 M
  per layer for SmolLM2-135M over 1,024 tokens — and its MLP activation (SiLU,
  Gemma's tanh GELU), one per hidden unit per token. Together they were most of a
  CPU prefill (``benchmarks/cpu_math.py``);
- a log-softmax over a vocabulary: Gemma's 262k entries make it ~0.5 s per 64
  tokens, in the teacher, in every evaluation pass and, forward and backward, in
  every stage-2 step.

The model functions keep the matmuls in MLX (BLAS) and do the elementwise
transcendental work in numpy; the attention runs in blocks of queries that skip
the keys a causal mask hides (half of a full prefill's scores). Each is an
``mx.custom_function`` whose VJP is written out, so gradients flow through it (a
stage-2 step differentiates the target). numpy needs values, so none of this may
run under ``mx.compile``: a thread opts in with :func:`numpy_passes`, as
``models.prefill``, the teacher, the evaluation and the stage-2 loss do. The
functions are installed by replacing what the model's code looks up at call time
with dispatchers (:func:`install`): ``scaled_dot_product_attention`` and ``swiglu``
in the model's mlx-lm module, and ``mlx.nn.gelu_approx``. A dispatcher calls the
function it replaced unless this thread is inside :func:`numpy_passes`; on a GPU,
with quantized caches and for small attentions mlx's and mlx-lm's own functions run.
``MLX_KVLINGO_CPU_MATH=0`` turns it all off.
"""

import math
import os
import sys
import threading
from contextlib import contextmanager

import mlx.core as mx
import numpy as np

ENV = "MLX_KVLINGO_CPU_MATH"
# Below these sizes MLX's own functions are as quick (numpy's round trip costs a
# sync and a copy). An attention's cost is its scores, heads x queries x keys: a
# switch's 17-token first step over 1,100 cached positions (168 k scores a layer
# for SmolLM2) took 0.20 s with MLX's softmax, 0.14 s with numpy's.
MIN_SCORES = 1 << 15
MIN_ELEMENTS = 1 << 13  # activations (a 17-token pass of SmolLM2: 26 k a layer)
BLOCK = 256  # queries per block: bounds the scores held at once
# With a mask array a block reads the keys up to the last one any of its queries
# may see: a recompute pass's queries (positions in order, spread over the
# context) skip the keys after them in smaller blocks, of at least MASKED_BLOCK
# queries and at most MASKED_SCORES scores. Each block is one round trip to numpy
# (a sync): a switch's first pass at ~550 tokens (~100 queries) in blocks of 32
# took 6-11 % longer than in one block.
MASKED_BLOCK = 32
MASKED_SCORES = 1 << 21

_state = threading.local()


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0" and mx.default_device() == mx.cpu


@contextmanager
def numpy_passes():
    """Inside: this thread's model calls run eagerly (not under ``mx.compile``), so
    long ones may take the numpy functions. Gradients still flow."""
    before = getattr(_state, "on", False)
    _state.on = True
    try:
        yield
    finally:
        _state.on = before


def _on() -> bool:
    return getattr(_state, "on", False) and enabled()


def install(model) -> bool:
    """Put the dispatchers in place for ``model`` (idempotent). False when its
    module does not call mlx-lm's ``scaled_dot_product_attention``, or calls
    something else in its place (e.g. models.attention_weights' recorder)."""
    import mlx.nn as nn
    from mlx_lm.models import activations, base

    layers = getattr(model, "layers", None) or getattr(getattr(model, "model", None), "layers", None)
    if not layers or not hasattr(layers[0], "self_attn"):
        return False
    module = sys.modules[type(layers[0].self_attn).__module__]
    if getattr(module, "swiglu", None) is activations.swiglu:
        module.swiglu = _dispatch(activations.swiglu, _swiglu, _large)
    if not _is_dispatcher(nn.gelu_approx):
        nn.gelu_approx = _dispatch(nn.gelu_approx, _gelu_approx, _large)
    current = getattr(module, "scaled_dot_product_attention", None)
    if _is_dispatcher(current):
        return True
    if current is not base.scaled_dot_product_attention:
        return False
    module.scaled_dot_product_attention = _dispatch(current, _sdpa, _long_attention)
    return True


def _is_dispatcher(f) -> bool:
    return getattr(f, "_kvlingo_dispatcher", False)


def _dispatch(original, fast, applies):
    """``fast`` inside numpy_passes on the CPU where ``applies(*args, **kwargs)``,
    ``original`` otherwise."""
    def dispatcher(*args, **kwargs):
        if _on() and applies(*args, **kwargs):
            return fast(*args, **kwargs)
        return original(*args, **kwargs)

    dispatcher._kvlingo_dispatcher = True
    dispatcher.original = original
    dispatcher.__doc__ = original.__doc__
    return dispatcher


def _large(x, *rest) -> bool:
    return x.size >= MIN_ELEMENTS


def _long_attention(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
    B, H, L, _ = queries.shape
    return (sinks is None and not hasattr(cache, "bits")
            and B * H * L * keys.shape[2] >= MIN_SCORES)


# The dispatchers call these, which look the fast functions up at call time.
def _sdpa(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
    return attention(queries, keys, values, scale, mask)


def _swiglu(gate, x):
    return swiglu(gate, x)


def _gelu_approx(x):
    return gelu_approx(x)


def _first(primals):
    """A one-input custom function's VJP gets its primal alone or in a sequence."""
    return primals[0] if isinstance(primals, (list, tuple)) else primals


def _numpy(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32))  # a writable copy


def _sigmoid(x: np.ndarray) -> np.ndarray:
    s = np.negative(x)
    np.exp(s, out=s)
    s += 1
    np.reciprocal(s, out=s)
    return s


@mx.custom_function
def _swiglu_fn(gate, x):
    g = _numpy(gate)
    g *= _sigmoid(g)
    return mx.array(g) * x.astype(mx.float32)


@_swiglu_fn.vjp
def _swiglu_vjp(primals, cotangent, output):
    gate, x = primals
    g = _numpy(gate)
    s = _sigmoid(g)
    d = 1 - s  # silu'(g) = s (1 + g (1 - s))
    d *= g
    d += 1
    d *= s
    g *= s  # silu(g)
    return cotangent * x * mx.array(d), cotangent * mx.array(g)


def swiglu(gate, x):
    """silu(gate) * x, as mlx-lm's ``swiglu``, the sigmoid in numpy."""
    return _swiglu_fn(gate, x).astype(x.dtype)


_C = np.float32(math.sqrt(2 / math.pi))


def _gelu_tanh(a: np.ndarray) -> np.ndarray:
    t = a * a
    t *= 0.044715 * a
    t += a
    t *= _C
    np.tanh(t, out=t)
    return t


@mx.custom_function
def _gelu_fn(x):
    a = _numpy(x)
    t = _gelu_tanh(a)
    t += 1
    t *= a
    t *= 0.5
    return mx.array(t)


@_gelu_fn.vjp
def _gelu_vjp(primals, cotangent, output):
    x = _first(primals)
    a = _numpy(x)
    t = _gelu_tanh(a)
    # d/dx: 0.5 (1 + t) + 0.5 x (1 - t²) c (1 + 3 · 0.044715 x²)
    inner = a * a
    inner *= 3 * 0.044715
    inner += 1
    inner *= _C * 0.5
    inner *= a
    inner *= 1 - t * t
    inner += 0.5 * (1 + t)
    return cotangent * mx.array(inner)


def gelu_approx(x):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x³))), as ``mlx.nn.gelu_approx``,
    the tanh in numpy."""
    return _gelu_fn(x).astype(x.dtype)


def log_softmax(logits: mx.array) -> mx.array:
    """log-softmax over the last axis, the exponentials in numpy on the CPU (a
    vocabulary of 262k makes it 0.5 s per 64 tokens in MLX there)."""
    return logits - logsumexp(logits)


@mx.custom_function
def _numpy_logsumexp(x):
    a = _numpy(x)
    m = a.max(axis=-1, keepdims=True)
    a -= m
    np.exp(a, out=a)
    return mx.array(np.log(a.sum(axis=-1, keepdims=True)) + m)


@_numpy_logsumexp.vjp
def _numpy_logsumexp_vjp(primals, cotangent, output):
    x = _first(primals)
    a = _numpy(x)
    a -= np.array(output)
    np.exp(a, out=a)  # the softmax: d lse / dx
    return cotangent * mx.array(a)


def logsumexp(x: mx.array) -> mx.array:
    """``mx.logsumexp(x, axis=-1, keepdims=True)``, differentiable, with the
    exponentials in numpy on the CPU. Not for ``mx.compile`` (numpy needs values)."""
    if not (enabled() and x.size >= MIN_ELEMENTS):
        return mx.logsumexp(x, axis=-1, keepdims=True)
    return _numpy_logsumexp(x.astype(mx.float32))


def exp(x: mx.array) -> mx.array:
    """exp of frozen values (no gradient), in numpy on the CPU."""
    if not (enabled() and x.size >= MIN_ELEMENTS):
        return mx.exp(x)
    return mx.array(np.exp(_numpy(x)))


def attention(queries, keys, values, scale: float, mask, block: int = BLOCK) -> mx.array:
    """softmax(q kᵀ · scale + mask) v, as ``mx.fast.scaled_dot_product_attention``
    computes it (grouped-query heads; ``mask`` None, "causal" — query i is position
    S - L + i — or an array, boolean or additive, broadcastable to [B, H, L, S])."""
    B, H, L, D = queries.shape
    Hk, S = keys.shape[1], keys.shape[2]
    rep = H // Hk
    dtype = queries.dtype
    q = (queries.astype(mx.float32) * scale).reshape(B, Hk, rep, L, D)
    k, v = keys.astype(mx.float32), values.astype(mx.float32)
    causal = isinstance(mask, str)
    masked = mask is not None and not causal
    if masked:
        block = max(MASKED_BLOCK, min(block, MASKED_SCORES // (H * S)))
        last = _last_seen(mask, S)
    out = []
    for a in range(0, L, block):
        b = min(a + block, L)
        n = b - a
        # Keys past the block's last query (causal) or past the last key any of its
        # queries may see (a mask) are hidden: not computed.
        hi = S - L + b if causal else int(last[a:b].max()) if masked else S
        qb = q[..., a:b, :].reshape(B, Hk, rep * n, D)
        s = (qb @ k[:, :, :hi].swapaxes(-1, -2)).reshape(B, Hk, rep, n, hi)
        if masked:
            m = _block_mask(mask, a, b, H, Hk, rep)[..., :hi]
            s = mx.where(m, s, -mx.inf) if m.dtype == mx.bool_ else s + m.astype(mx.float32)
        p = _softmax(s, n if causal else 0).reshape(B, Hk, rep * n, hi)
        out.append((p @ v[:, :, :hi]).reshape(B, Hk, rep, n, -1))
    return mx.concatenate(out, axis=3).reshape(B, H, L, -1).astype(dtype)


def _last_seen(mask: mx.array, S: int) -> np.ndarray:
    """Per query row of a mask broadcastable to [B, H, L, S]: one past the last key
    any batch row or head may see (boolean: True; additive: not -inf), at least 1."""
    m = mask if mask.dtype == mx.bool_ else mask > -mx.inf
    m = mx.broadcast_to(m, (*m.shape[:-1], S))
    while m.ndim > 2:
        m = m.any(axis=0)
    seen = np.array(m)  # [L, S]
    last = S - np.argmax(seen[:, ::-1], axis=1)
    return np.where(seen.any(axis=1), last, 1)


def _block_mask(mask: mx.array, a: int, b: int, H: int, Hk: int, rep: int) -> mx.array:
    """Rows a..b-1 of a mask broadcastable to [B, H, L, S], as [B|1, Hk|1, rep|1, n, S]."""
    m = mask[..., a:b, :]
    while m.ndim < 4:
        m = m[None]
    if m.shape[1] == 1:
        return m[:, :, None]
    return m.reshape(m.shape[0], Hk, rep, m.shape[2], m.shape[3])


_SOFTMAX = {}


def _softmax(scores: mx.array, causal_block: int) -> mx.array:
    """Softmax over the last axis, in numpy; ``causal_block`` > 0: the last n columns
    are the block's diagonal square, whose upper triangle is hidden."""
    if causal_block not in _SOFTMAX:
        _SOFTMAX[causal_block] = _softmax_function(causal_block)
    return _SOFTMAX[causal_block](scores.astype(mx.float32))


def _softmax_function(n: int):
    hidden = np.triu(np.full((n, n), -np.inf, np.float32), 1) if n else None

    @mx.custom_function
    def softmax(scores):
        x = np.array(scores)  # a writable copy
        if n:
            x[..., -n:] += hidden
        x -= x.max(axis=-1, keepdims=True)
        np.exp(x, out=x)
        x /= x.sum(axis=-1, keepdims=True)
        return mx.array(x)

    @softmax.vjp
    def softmax_vjp(primals, cotangent, output):
        # The probabilities are the output: no exponential to recompute.
        return output * (cotangent - (cotangent * output).sum(axis=-1, keepdims=True))

    return softmax

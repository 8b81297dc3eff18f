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

The prefill functions keep the matmuls in MLX (BLAS) and do the elementwise
transcendental work in numpy; the attention runs in blocks of queries that skip
the keys a causal mask hides (half of a full prefill's scores). They are for frozen
passes only (numpy is not differentiable): :func:`frozen_passes` turns them on for
the calling thread, and ``models.prefill`` uses it. They are installed by
replacing functions the model's code looks up at call time with dispatchers
(:func:`install`): ``scaled_dot_product_attention`` and ``swiglu`` in the model's
mlx-lm module, and ``mlx.nn.gelu_approx``. A dispatcher calls the function it
replaced unless this thread is inside :func:`frozen_passes`; on a GPU, with
quantized caches and for short passes mlx's and mlx-lm's own functions run.
:func:`logsumexp` is differentiable (a custom VJP, numpy both ways), for the
stage-2 loss. ``MLX_KVLINGO_CPU_MATH=0`` turns it all off.
"""

import math
import os
import sys
import threading
from contextlib import contextmanager

import mlx.core as mx
import numpy as np

ENV = "MLX_KVLINGO_CPU_MATH"
MIN_QUERIES = 32  # shorter passes (decoding, short tails) gain nothing
MIN_ELEMENTS = 1 << 16  # smaller activations stay in MLX
BLOCK = 256  # queries per block: bounds the scores held at once

_state = threading.local()


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0" and mx.default_device() == mx.cpu


@contextmanager
def frozen_passes():
    """Inside: this thread's model calls are frozen (no gradients), so long ones may
    take the numpy path."""
    before = getattr(_state, "frozen", False)
    _state.frozen = True
    try:
        yield
    finally:
        _state.frozen = before


def _frozen() -> bool:
    return getattr(_state, "frozen", False) and enabled()


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
    """``fast`` in frozen passes on the CPU where ``applies(*args, **kwargs)``,
    ``original`` otherwise."""
    def dispatcher(*args, **kwargs):
        if _frozen() and applies(*args, **kwargs):
            return fast(*args, **kwargs)
        return original(*args, **kwargs)

    dispatcher._kvlingo_dispatcher = True
    dispatcher.original = original
    dispatcher.__doc__ = original.__doc__
    return dispatcher


def _large(x, *rest) -> bool:
    return x.size >= MIN_ELEMENTS


def _long_attention(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
    return sinks is None and not hasattr(cache, "bits") and queries.shape[2] >= MIN_QUERIES


# The dispatchers call these, which look the fast functions up at call time.
def _sdpa(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
    return attention(queries, keys, values, scale, mask)


def _swiglu(gate, x):
    return swiglu(gate, x)


def _gelu_approx(x):
    return gelu_approx(x)


def _numpy(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32))  # a writable copy


def swiglu(gate, x):
    """silu(gate) * x, as mlx-lm's ``swiglu``, the sigmoid in numpy."""
    g = _numpy(gate)
    s = np.negative(g)
    np.exp(s, out=s)
    s += 1
    np.divide(g, s, out=g)
    return (mx.array(g) * x).astype(x.dtype)


def gelu_approx(x):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x³))), as ``mlx.nn.gelu_approx``,
    the tanh in numpy."""
    a = _numpy(x)
    t = a * a
    t *= 0.044715 * a
    t += a
    t *= np.float32(math.sqrt(2 / math.pi))
    np.tanh(t, out=t)
    t += 1
    t *= a
    t *= 0.5
    return mx.array(t).astype(x.dtype)


def log_softmax(logits: mx.array) -> mx.array:
    """log-softmax over the last axis of frozen values (no gradient): in numpy on
    the CPU (a vocabulary of 262k makes it 0.5 s per 64 tokens in MLX there)."""
    if not (enabled() and logits.size >= MIN_ELEMENTS):
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    x = _numpy(logits)
    x -= x.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(x).sum(axis=-1, keepdims=True))
    x -= lse
    return mx.array(x)


@mx.custom_function
def _numpy_logsumexp(x):
    a = _numpy(x)
    m = a.max(axis=-1, keepdims=True)
    a -= m
    np.exp(a, out=a)
    return mx.array(np.log(a.sum(axis=-1, keepdims=True)) + m)


@_numpy_logsumexp.vjp
def _numpy_logsumexp_vjp(primals, cotangent, output):
    x = primals[0] if isinstance(primals, (list, tuple)) else primals
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
    out = []
    for a in range(0, L, block):
        b = min(a + block, L)
        n = b - a
        hi = S - L + b if causal else S  # keys past the block's last query are hidden
        qb = q[..., a:b, :].reshape(B, Hk, rep * n, D)
        s = (qb @ k[:, :, :hi].swapaxes(-1, -2)).reshape(B, Hk, rep, n, hi)
        if mask is not None and not causal:
            m = _block_mask(mask, a, b, H, Hk, rep)
            s = mx.where(m, s, -mx.inf) if m.dtype == mx.bool_ else s + m.astype(mx.float32)
        p = _softmax(s, n if causal else 0).reshape(B, Hk, rep * n, hi)
        out.append((p @ v[:, :, :hi]).reshape(B, Hk, rep, n, -1))
    return mx.concatenate(out, axis=3).reshape(B, H, L, -1).astype(dtype)


def _block_mask(mask: mx.array, a: int, b: int, H: int, Hk: int, rep: int) -> mx.array:
    """Rows a..b-1 of a mask broadcastable to [B, H, L, S], as [B|1, Hk|1, rep|1, n, S]."""
    m = mask[..., a:b, :]
    while m.ndim < 4:
        m = m[None]
    if m.shape[1] == 1:
        return m[:, :, None]
    return m.reshape(m.shape[0], Hk, rep, m.shape[2], m.shape[3])


def _softmax(scores: mx.array, causal_block: int) -> mx.array:
    """Softmax over the last axis in numpy; ``causal_block`` > 0: the last n columns
    are the block's diagonal square, whose upper triangle is hidden."""
    x = np.array(scores, dtype=np.float32)  # a writable copy
    if causal_block:
        n = causal_block
        x[..., -n:] += np.triu(np.full((n, n), -np.inf, np.float32), 1)
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return mx.array(x)

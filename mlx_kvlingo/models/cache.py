"""Reading and writing mlx-lm prompt caches: free functions over the list of
layer caches that ``make_prompt_cache`` returns (plain, rotating or quantized).

Features are read flattened per token ([B, T, heads*head_dim]) with keys in
content space (rope undone); writing rotates keys with the target layer's rope
and keeps only what a sliding-window layer would keep.
"""

import copy
from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from .. import cpu_math
from ..errors import KvlingoError, UnsupportedModel
from .geometry import cache_dtype, cache_geometry
from .rope import RopeTables, rerope, unrope


def read_layer(c) -> Tuple[mx.array, mx.array, int]:
    """Live keys and values of one layer cache in temporal order, and the position
    of their first token. Quantized caches are dequantized."""
    if isinstance(c, QuantizedKVCache):
        if c.keys is None:
            return None, None, 0
        keys = mx.dequantize(*c.keys, group_size=c.group_size, bits=c.bits)
        values = mx.dequantize(*c.values, group_size=c.group_size, bits=c.bits)
        keys, values = keys[..., : c.offset, :], values[..., : c.offset, :]
        return keys, values, 0
    if isinstance(c, RotatingKVCache):
        if c.keys is None:
            return None, None, 0
        keys = c._temporal_order(c.keys)
        values = c._temporal_order(c.values)
        n = min(keys.shape[2], c.offset)  # slots past `offset` were never written
        return keys[..., -n:, :], values[..., -n:, :], c.offset - n
    if isinstance(c, KVCache):
        if c.keys is None:
            return None, None, 0
        return c.keys[..., : c.offset, :], c.values[..., : c.offset, :], 0
    raise UnsupportedModel(f"Cannot read keys and values from a {type(c).__name__}.")


def cache_length(cache: List) -> int:
    """Number of tokens every layer of a prompt cache has processed.

    Layers agree except after a forward pass interrupted half way (Ctrl-C lands
    between two layers' cache updates): then the earlier layers hold one token
    more, and only the shortest length is readable in every layer."""
    return min(c.offset for c in cache)


def trim_cache_to(cache: List, length: int) -> bool:
    """Trim every layer of ``cache`` in place to its first ``length`` tokens (each
    by its own amount, so layers that disagreed agree again). False, and nothing
    trimmed, when a layer cannot be trimmed (a full sliding window)."""
    if any(c.offset > length and not c.is_trimmable() for c in cache):
        return False
    for c in cache:
        if c.offset > length:
            c.trim(c.offset - length)
    return True


def cache_features(
    model: nn.Module,
    cache: List,
    layers: Optional[List[int]] = None,
    span: Optional[Tuple[int, int]] = None,
) -> Tuple[List[mx.array], List[mx.array], int]:
    """Keys (un-rotated) and values of a cache, flattened per token.

    Returns (keys, values, start): lists over layers of [B, T, heads*head_dim] and
    the position of the first token. Layers not in ``layers`` are None.

    ``span=(lo, hi)`` reads positions lo..hi-1 only; every requested layer must
    still hold them (a sliding layer keeps only its last ``window`` positions).
    Without a span every requested layer must hold the same positions.
    """
    layers = range(len(cache)) if layers is None else layers
    ks, vs = [None] * len(cache), [None] * len(cache)
    must_match = span is None  # without a span, all layers must hold the same positions
    tables = RopeTables(model)
    for i in layers:
        k, v, s = read_layer(cache[i])
        if k is None:
            raise KvlingoError("The cache is empty: process some tokens first.")
        held = (s, s + k.shape[2])
        span = held if span is None else span
        lo, hi = span
        if not (held[0] <= lo and hi <= held[1]) or (must_match and held != span):
            raise KvlingoError(
                f"Layer {i} of the cache holds positions {held[0]}..{held[1] - 1}, but "
                f"positions {lo}..{hi - 1} are needed: a sliding-window layer has dropped "
                "early tokens. Prefill the source in one pass (mlx_kvlingo.models.prefill) "
                "to get complete features."
            )
        k, v = k[..., lo - s : hi - s, :], v[..., lo - s : hi - s, :]
        rope = model.layers[i].self_attn.rope
        k = unrope(rope, k, lo, tables(i, lo, k.shape[-2], k.shape[-1]))
        ks[i], vs[i] = flatten_heads(k), flatten_heads(v)
    return ks, vs, span[0]


def flatten_heads(x: mx.array) -> mx.array:
    """[B, H, T, D] -> [B, T, H*D]."""
    B, H, T, D = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, H * D)


def split_heads(x: mx.array, n_heads: int) -> mx.array:
    """[B, T, H*D] -> [B, H, T, D]."""
    B, T, F = x.shape
    return x.reshape(B, T, n_heads, F // n_heads).transpose(0, 2, 1, 3)


def prefill(model: nn.Module, tokens: mx.array, cache: Optional[List] = None) -> List:
    """Run ``tokens`` ([B, T] or [T]) through the model in one pass; return the cache.

    One pass matters for sliding-window layers: mlx-lm's RotatingKVCache keeps every
    token of its first multi-token update, so all positions stay readable.
    """
    if tokens.ndim == 1:
        tokens = tokens[None]
    cache = make_prompt_cache(model) if cache is None else cache
    body = getattr(model, "model", None)
    # On the CPU its softmax and MLP activation run in numpy (cpu_math: MLX's exp is
    # the slowest part of a CPU prefill); so never call prefill under mx.compile.
    cpu_math.install(model)
    with cpu_math.numpy_passes():
        # The inner model skips the LM head, which dominates cost for large vocabularies.
        (body if body is not None else model)(tokens, cache=cache)
    return cache


def copy_cache(cache: List) -> List:
    """An independent copy of a prompt cache: new array objects, so that writes into
    one (a decoding step, a scored continuation) leave the other as it was."""
    out = []
    for c in cache:
        n = copy.copy(c)
        n.keys, n.values = mx.array(c.keys), mx.array(c.values)
        out.append(n)
    mx.eval([(c.keys, c.values) for c in out])
    return out


# Model types whose __call__ is `body, then the LM head` (mlx-lm: the inner model,
# then `lm_head` or the tied embedding), so the head can run on the last positions.
BODY_THEN_HEAD = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


def last_logits(model: nn.Module, inputs: mx.array, cache, keep: int = 1) -> mx.array:
    """The model's logits [B, keep, vocab] for the last ``keep`` of ``inputs`` ([B, T])
    read on ``cache``.

    The LM head is the largest matmul of a small model over a large vocabulary
    (Gemma 3: 262k rows); positions whose predictions are not needed (the pending
    tokens of a switch but the last, a native tail read before a scored
    continuation) skip it. Models of other shapes run whole.
    """
    body = getattr(model, "model", None)
    if (getattr(model, "model_type", None) not in BODY_THEN_HEAD or body is None
            or not hasattr(body, "embed_tokens")):
        return model(inputs, cache=cache)[:, -keep:]
    hidden = body(inputs, cache)[:, -keep:]
    if "lm_head" in model:  # an untied head (nn.Module children are dict keys)
        return model.lm_head(hidden)
    return body.embed_tokens.as_linear(hidden)


def build_cache(
    model: nn.Module,
    keys: List[mx.array],
    values: List[mx.array],
    start: int = 0,
    cache: Optional[List] = None,
    length: Optional[int] = None,
) -> List:
    """Write content-space K/V ([B, T, heads*head_dim] per layer) into a target cache.

    Keys are rotated with each layer's own rope at positions start .. start+T-1 and
    everything is cast to the model's dtype. With ``cache`` given, the tokens are
    appended to it (its length must equal ``start``); otherwise a fresh cache of the
    types ``make_prompt_cache`` makes is filled. Sliding-window layers keep only
    the last ``window`` positions, in temporal order. ``length``: the T positions
    written (default: each layer's rows); a sliding-window layer may then hold only
    the last rows of them, at least as many as it keeps.
    """
    geometry = cache_geometry(model)
    dtype = cache_dtype(model)
    tables = RopeTables(model)
    if cache is None:
        cache = make_prompt_cache(model)
    for i, (c, lg) in enumerate(zip(cache, geometry.layers)):
        k, v = keys[i], values[i]
        T = k.shape[1] if length is None else length
        if k.shape[1] != T and (lg.window is None or k.shape[1] < min(T, lg.window)):
            raise KvlingoError(f"Layer {i} has {k.shape[1]} rows for {T} positions.")
        if lg.window is not None and k.shape[1] > lg.window:
            # Positions before the last `window` are never attended to again.
            k, v = k[:, -lg.window :], v[:, -lg.window :]
        k, v = cache_rows(model, i, k, v, start + T - k.shape[1], tables, dtype)
        append_layer(c, k, v, start, start + T)
    return cache


def cache_rows(model: nn.Module, layer: int, keys: mx.array, values: mx.array, start: int,
               tables: Optional[RopeTables] = None, dtype=None) -> Tuple[mx.array, mx.array]:
    """Content-space K/V ([B, T, heads*head_dim]) of positions start.. of one layer
    in its cache's layout ([B, heads, T, head_dim]): keys rotated with the layer's
    own rope at their positions, both cast to the model's cache dtype."""
    lg = cache_geometry(model).layers[layer]
    tables = RopeTables(model) if tables is None else tables
    dtype = cache_dtype(model) if dtype is None else dtype
    k = split_heads(keys, lg.n_kv_heads)
    rope = model.layers[layer].self_attn.rope
    k = rerope(rope, k, start, tables(layer, start, k.shape[-2], k.shape[-1]))
    return k.astype(dtype), split_heads(values, lg.n_kv_heads).astype(dtype)


def set_layer(c, keys: mx.array, values: mx.array, end: int, length: int):
    """Give an empty layer cache the buffers ``keys``/``values`` ([B, heads, rows,
    head_dim]) whose first ``length`` rows hold the positions ending at ``end``, in
    temporal order; rows past ``length`` are free space that the next tokens are
    written into in place (as mlx-lm's own preallocated steps)."""
    if c.keys is not None:
        raise KvlingoError("set_layer needs an empty layer cache.")
    if isinstance(c, RotatingKVCache):
        if keys.shape[2] > c.max_size:
            raise KvlingoError(f"{keys.shape[2]} rows do not fit a {c.max_size}-position window.")
        c._idx = length
    c.keys, c.values, c.offset = keys, values, end


def append_layer(c, keys: mx.array, values: mx.array, start: int, end: int):
    """Append K/V for positions ending at ``end`` to a cache that holds ``start`` tokens."""
    if c.offset != start:
        raise KvlingoError(f"Cache holds {c.offset} tokens, cannot append at {start}.")
    if c.keys is not None:
        old_k, old_v, _ = read_layer(c)
        keys = mx.concatenate([old_k, keys], axis=2)
        values = mx.concatenate([old_v, values], axis=2)
    if isinstance(c, RotatingKVCache):
        keys, values = keys[..., -c.max_size :, :], values[..., -c.max_size :, :]
        c._idx = keys.shape[2]
    c.keys, c.values, c.offset = keys, values, end

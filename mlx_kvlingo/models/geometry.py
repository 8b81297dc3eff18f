"""What a model's KV cache looks like: per layer, heads, head size, sliding window
and rope; and checks that a model's cache is one a translator can read and write."""

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from ..errors import UnsupportedModel


def model_name(model: nn.Module) -> str:
    """The path or repo id a model was loaded from, or its type for built models."""
    return getattr(model, "name_or_path", None) or getattr(model, "model_type", "model")


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

"""Features computed from a model's own weights and passes: layer 0's K/V and the
token embeddings (exact and cheap, no context needed), K/V features of a fresh
prefill, and attention weights read off a pass."""

import sys
from typing import List, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModel
from .cache import cache_features, flatten_heads, prefill
from .geometry import model_name

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
    return flatten_heads(keys), flatten_heads(values)


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
    embeddings say it exactly, and cost a lookup.
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

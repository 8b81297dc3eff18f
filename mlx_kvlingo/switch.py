"""Switching a context from one model to another: translate the cache, then decode.

A switch replaces the target's prefill of the context with (1) a map over the
source's cache and (2) one decoding step of the target on the context's last
token, which ``stream_generate`` performs as its "prompt".
"""

import time
from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import stream_generate

from .errors import KvlingoError
from .models import build_cache, cache_length, cache_features, prefill
from .translator import Translator


def _as_batch(tokens) -> mx.array:
    """Token ids as [B, T]; a context needs at least 2 tokens (one to translate, one
    for the target's own step)."""
    tokens = mx.array(tokens) if not isinstance(tokens, mx.array) else tokens
    tokens = tokens[None] if tokens.ndim == 1 else tokens
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise KvlingoError(
            f"A context needs at least 2 tokens to switch; got shape {tuple(tokens.shape)}."
        )
    return tokens


def translate_cache(
    source: nn.Module,
    target: nn.Module,
    translator: Translator,
    source_cache: List,
    tokens,
    length: Optional[int] = None,
) -> List:
    """A target prompt cache for ``tokens[:length]`` from a source cache that has
    processed at least ``length`` tokens (``length`` defaults to ``len(tokens) - 1``,
    leaving the last token for the target's own decoding step).

    The first ``translator.spec.native_prefix`` tokens (the attention sink) are
    computed by the target itself; the rest are translated.
    """
    tokens = _as_batch(tokens)
    length = tokens.shape[1] - 1 if length is None else length
    if not 1 <= length <= tokens.shape[1]:
        raise KvlingoError(f"Cannot translate {length} of {tokens.shape[1]} tokens.")
    if cache_length(source_cache) < length:
        raise KvlingoError(
            f"The source cache holds {cache_length(source_cache)} tokens; "
            f"{length} are needed."
        )
    n_native = min(translator.spec.native_prefix, length)
    cache = prefill(target, tokens[:, :n_native]) if n_native else None
    if n_native == length:
        return cache
    keys, values, start = cache_features(source, source_cache, translator.source_layers)
    # Source positions start at `start` (0 unless a sliding layer dropped tokens).
    lo, hi = n_native - start, length - start
    if lo < 0:
        raise KvlingoError("The source cache no longer holds the start of the context.")
    keys = [k[:, lo:hi] if k is not None else None for k in keys]
    values = [v[:, lo:hi] if v is not None else None for v in values]
    tk, tv = translator(keys, values)
    return build_cache(target, tk, tv, start=n_native, cache=cache)


def translate_context(
    source: nn.Module, target: nn.Module, translator: Translator, tokens
) -> List:
    """Prefill the source on ``tokens[:-1]`` and translate its cache for the target."""
    tokens = _as_batch(tokens)
    source_cache = prefill(source, tokens[:, :-1])
    return translate_cache(source, target, translator, source_cache, tokens)


@dataclass
class SwitchResult:
    cache: List  # target prompt cache holding all context tokens but the last
    last_token: mx.array  # the context's last token: the target's first input
    translate_s: float  # time spent translating (source cache already given)


def switch(
    source: nn.Module,
    target: nn.Module,
    translator: Translator,
    tokens,
    source_cache: Optional[List] = None,
) -> SwitchResult:
    """Hand a context over to the target model.

    ``source_cache``: the source's live cache of the context (what it has after its
    turn). Without it the source prefills the context first (not timed).
    """
    tokens = _as_batch(tokens)
    if tokens.shape[0] != 1:
        raise KvlingoError("switch() takes one sequence at a time.")
    if source_cache is None:
        source_cache = prefill(source, tokens[:, :-1])
        mx.eval([(c.keys, c.values) for c in source_cache])
    t0 = time.perf_counter()
    cache = translate_cache(source, target, translator, source_cache, tokens)
    mx.eval([(c.keys, c.values) for c in cache])
    return SwitchResult(cache, tokens[0, -1:], time.perf_counter() - t0)


def generate_after_switch(target, tokenizer, result: SwitchResult, **kwargs):
    """Stream the target's answer from a switched cache (mlx-lm ``GenerationResponse``s).

    The first response arrives after exactly one decoding step over the last token.
    """
    return stream_generate(
        target, tokenizer, result.last_token, prompt_cache=result.cache, **kwargs
    )

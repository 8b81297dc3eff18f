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
from mlx_lm.models.cache import make_prompt_cache

from .align import Alignment, align_text, identity_alignment
from .errors import KvlingoError
from .models import (
    append_layer,
    build_cache,
    cache_features,
    cache_length,
    max_positions,
    prefill,
    read_layer,
)
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


def translate_span(
    source: nn.Module,
    target: nn.Module,
    translator: Translator,
    source_cache: List,
    target_cache: Optional[List],
    tokens,
    end: int,
) -> List:
    """Extend ``target_cache`` (holding ``tokens[:start]``, or None for start = 0) to
    ``tokens[:end]`` with positions start..end-1 translated from ``source_cache``,
    which must hold them. Returns the extended target cache.

    This is the whole of a multi-turn switch ("retained span", DESIGN §2): each
    model keeps its own cache and only the span the other model wrote since is
    translated. Positions below ``translator.spec.native_prefix`` (the attention
    sink) are computed by the target itself. Both models share the tokenizer; see
    :func:`translate_aligned` for other pairs.
    """
    tokens = _as_batch(tokens)
    alignment = identity_alignment(tokens[0].tolist(), translator.spec.native_prefix)
    return translate_aligned(
        source, target, translator, source_cache, target_cache, alignment, end, tokens
    )


def translate_aligned(
    source: nn.Module,
    target: nn.Module,
    translator: Translator,
    source_cache: List,
    target_cache: Optional[List],
    alignment: Alignment,
    end: int,
    target_tokens: Optional[mx.array] = None,
) -> List:
    """Extend ``target_cache`` to target positions ..end-1 of ``alignment``: native
    positions are computed by the target, in order; the others are translated from
    the source positions they are aligned to (which ``source_cache`` must hold).

    ``target_tokens``: [B, T] ids when B > 1 (default: ``alignment.target_tokens``).
    """
    alignment = alignment.with_native_prefix(translator.spec.native_prefix)
    if target_tokens is None:
        target_tokens = mx.array(alignment.target_tokens)[None]
    start = 0 if target_cache is None else cache_length(target_cache)
    if not start < end <= len(alignment.source_index):
        raise KvlingoError(
            f"Cannot translate positions {start}..{end - 1} of a "
            f"{len(alignment.source_index)}-token context."
        )
    limit = max_positions(target)
    if limit and len(alignment.target_tokens) > limit:
        raise KvlingoError(
            f"The context has {len(alignment.target_tokens)} target tokens; the target "
            f"model handles at most {limit} positions."
        )
    for native, lo, hi in alignment.runs(start, end):
        if native:
            target_cache = _native_run(target, target_tokens, lo, hi, target_cache)
            continue
        idx = alignment.source_index[lo:hi]
        first, last = min(idx), max(idx)
        if cache_length(source_cache) <= last:
            raise KvlingoError(
                f"The source cache holds {cache_length(source_cache)} tokens; "
                f"position {last} is needed."
            )
        keys, values, _ = cache_features(
            source, source_cache, translator.source_layers, span=(first, last + 1)
        )
        if idx != list(range(first, last + 1)):  # cross-tokenizer: gather per target token
            rows = mx.array([i - first for i in idx])
            keys = [k[:, rows] if k is not None else None for k in keys]
            values = [v[:, rows] if v is not None else None for v in values]
        tk, tv = translator(keys, values)
        target_cache = build_cache(target, tk, tv, start=lo, cache=target_cache)
    return target_cache


def _native_run(target, tokens, lo: int, hi: int, cache):
    """Positions lo..hi-1 computed by the target itself. A run from position 0 (BOS,
    the attention sink) depends only on its token ids, so it is memoized per model:
    a switch then costs no extra forward pass for it."""
    if lo or tokens.shape[0] != 1:
        return prefill(target, tokens[:, lo:hi], cache)
    memo = target.__dict__.get("_kvlingo_prefix_kv")
    if memo is None:  # object.__setattr__: a dict set through nn.Module becomes a child
        memo = {}
        object.__setattr__(target, "_kvlingo_prefix_kv", memo)
    key = tuple(tokens[0, :hi].tolist())
    if key not in memo:
        if len(memo) >= 16:
            memo.clear()
        memo[key] = [read_layer(c)[:2] for c in prefill(target, tokens[:, :hi])]
        mx.eval(memo[key])
    cache = make_prompt_cache(target) if cache is None else cache
    for c, (k, v) in zip(cache, memo[key]):
        append_layer(c, k, v, 0, hi)
    return cache


def translate_cache(
    source: nn.Module,
    target: nn.Module,
    translator: Translator,
    source_cache: List,
    tokens,
    length: Optional[int] = None,
) -> List:
    """A fresh target prompt cache for ``tokens[:length]`` from a source cache that has
    processed at least ``length`` tokens (``length`` defaults to ``len(tokens) - 1``,
    leaving the last token for the target's own decoding step)."""
    tokens = _as_batch(tokens)
    length = tokens.shape[1] - 1 if length is None else length
    return translate_span(source, target, translator, source_cache, None, tokens, length)


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


def switch_text(
    source: nn.Module,
    source_tokenizer,
    target: nn.Module,
    target_tokenizer,
    translator: Translator,
    text: str,
    source_cache: Optional[List] = None,
) -> SwitchResult:
    """Hand a plain-text context over to the target, whatever the two tokenizers.

    Both models tokenize ``text`` (special tokens included); with a cross-tokenizer
    translator the target's tokens are aligned to the source's by characters.
    ``source_cache``: the source's live cache of its tokenization of ``text``.
    """
    if not translator.cross_tokenizer:
        tokens = mx.array(source_tokenizer.encode(text))
        return switch(source, target, translator, tokens, source_cache=source_cache)
    alignment = align_text(source_tokenizer, target_tokenizer, text, translator.spec.native_prefix)
    if len(alignment.target_tokens) < 2:
        raise KvlingoError("A context needs at least 2 target tokens to switch.")
    if source_cache is None:
        source_cache = prefill(source, mx.array(alignment.source_tokens)[None])
        mx.eval([(c.keys, c.values) for c in source_cache])
    t0 = time.perf_counter()
    end = len(alignment.target_tokens) - 1
    cache = translate_aligned(source, target, translator, source_cache, None, alignment, end)
    mx.eval([(c.keys, c.values) for c in cache])
    last = mx.array(alignment.target_tokens[-1:])
    return SwitchResult(cache, last, time.perf_counter() - t0)

"""Switching a context from one model to another: translate the cache, then decode.

A switch replaces the target's prefill of the context with (1) a map over the
source's cache (:mod:`.kernel`) and (2) one decoding step of the target on the
context's last token (:func:`.generate.first_step`; with a native tail, on its
last m + 1 tokens).
"""

import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..errors import KvlingoError
from ..models.cache import copy_cache, prefill
from ..translator.align import Alignment, align_text, identity_alignment, tokenize_with_offsets
from ..translator.maps import Translator
from .kernel import EarlyLayer, History, map_early_layer, translate_into
from .choice import (  # noqa: F401  (LEXICAL_SHARE, SELECTIONS: re-exported)
    LEXICAL_SHARE,
    SELECTIONS,
    RecomputeBudget,
    REACH_STEPS,
    RecomputePlan,
    long_tail_for,
    resolve_select,
)
from .query import MIN_QUESTION, source_reading, source_scores
from .recompute import Span, recompute_and_read, recompute_spans, token_offsets


def as_batch(tokens) -> mx.array:
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
    history: Optional[History] = None,
) -> List:
    """Extend ``target_cache`` (holding ``tokens[:start]``, or None for start = 0) to
    ``tokens[:end]`` with positions start..end-1 translated from ``source_cache``,
    which must hold them. Returns the extended target cache.

    This is the whole of a multi-turn switch (the "retained span" rule, docs/design.md): each
    model keeps its own cache and only the span the other model wrote since is
    translated. Positions below ``translator.spec.native_prefix`` (the attention
    sink) are computed by the target itself. Both models share the tokenizer; see
    :func:`translate_aligned` for other pairs. ``history``: as in
    :func:`translate_aligned`.
    """
    tokens = as_batch(tokens)
    alignment = identity_alignment(tokens[0].tolist(), translator.spec.native_prefix)
    return translate_aligned(
        source, target, translator, source_cache, target_cache, alignment, end, tokens,
        history=history,
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
    native_tail: Optional[int] = 0,
    history: Optional[History] = None,
) -> List:
    """Extend ``target_cache`` to target positions ..end-1 of ``alignment``: native
    positions are computed by the target, in order; the others are translated from
    the source positions they are aligned to (which ``source_cache`` must hold).

    ``target_tokens``: [B, T] ids when B > 1 (default: ``alignment.target_tokens``).
    ``native_tail``: the last m positions before ``end`` are computed by the target
    itself on top of the translated ones (None: the translator's default,
    ``spec.native_tail``). Spans of a conversation (Session, training) pass 0.
    With ``spec.native_layer0`` the target computes layer 0 of every position
    itself (models.layer0_kv) instead of translating it. ``history``: a recompute
    from ``history.since`` will follow; the rows of the new positions it reads that
    sliding-window layers drop are kept in it (kernel.History).
    """
    m = resolve_native_tail(translator, native_tail)
    alignment = alignment.with_native_prefix(translator.spec.native_prefix)
    alignment = alignment.with_native_tail(m, end)
    return translate_into(source, target, translator, source_cache, target_cache, alignment,
                      end, target_tokens, room=1, history=history)


def resolve_native_tail(translator: Translator, native_tail: Optional[int]) -> int:
    m = getattr(translator.spec, "native_tail", 0) if native_tail is None else native_tail
    if not isinstance(m, int) or m < 0:
        raise KvlingoError(f"native_tail must be a count >= 0, got {m!r}.")
    return m


def translate_cache(
    source: nn.Module,
    target: nn.Module,
    translator: Translator,
    source_cache: List,
    tokens=None,
    length: Optional[int] = None,
    native_tail: Optional[int] = None,
    recompute: Optional[float] = None,
    recompute_max: Optional[int] = None,
    select: Optional[str] = None,
    tokenizer=None,
    alignment: Optional[Alignment] = None,
    text: Optional[Tuple[str, Sequence[Tuple[int, int]]]] = None,
) -> List:
    """A complete target prompt cache for ``tokens[:length]`` from a source cache
    that holds at least those (``length`` defaults to ``len(tokens) - 1``, leaving
    the last token for the target's first step, as mlx-lm's ``generate`` expects):
    the switch :func:`switch` makes, with the same defaults (native tail and
    recompute), its prompt read but for the tokens from ``length`` on.
    ``alignment``: the target's tokens aligned to the source's (another
    tokenizer; ``tokens`` are then its target tokens). ``text``: (text, each
    token's characters), or ``tokenizer`` to decode them: the fact-like words."""
    if alignment is not None:
        tokens = alignment.target_tokens
    tokens = as_batch(tokens)
    length = tokens.shape[1] - 1 if length is None else length
    if not 1 <= length <= tokens.shape[1]:
        raise KvlingoError(f"length must be in 1..{tokens.shape[1]}, not {length}.")
    if length < 2:  # nothing to translate: the target reads it itself
        return prefill(target, tokens[:, :length])
    # The switch of tokens[:length + 1] leaves its last m + 1 positions to the target;
    # this cache ends one token earlier, so its last m are the target's own.
    m = resolve_native_tail(translator, native_tail)
    ids = tokens[0, :length].tolist()
    select = resolve_select([translator.spec], select)
    budget = RecomputeBudget.of(translator, recompute, recompute_max)
    if text is None and tokenizer is not None:
        text = token_offsets(tokenizer, ids)
    t0 = time.perf_counter()
    if alignment is None:
        alignment = identity_alignment(ids, translator.spec.native_prefix)
    result = _switch(source, target, translator, source_cache, alignment, tokens[:, :length],
                     m - 1, t0, budget, select, text,
                     own=native_tail is not None or recompute is not None)
    return result.read_all()


def translate_context(
    source: nn.Module, target: nn.Module, translator: Translator, tokens,
    native_tail: Optional[int] = None, tokenizer=None,
) -> List:
    """Prefill the source on ``tokens[:-1]`` and switch its cache to the target: a
    complete target prompt cache of ``tokens[:-1]`` (:func:`translate_cache`), to
    be continued with ``tokens[-1:]``."""
    tokens = as_batch(tokens)
    source_cache = prefill(source, tokens[:, :-1])
    return translate_cache(source, target, translator, source_cache, tokens,
                           native_tail=native_tail, tokenizer=tokenizer)


@dataclass
class SwitchResult:
    """A context handed over to the target, before the target has read all of it.

    Use it as mlx-lm uses a prompt cache: ``prompt`` are the tokens the target still
    reads (the native tail, if any, and the context's last token), ``prompt_cache``
    the cache of everything before them, complete (the recompute the switch chose
    is done on first access). So ::

        mlx_lm.stream_generate(target, tokenizer, result.prompt,
                               prompt_cache=result.prompt_cache)

    generates what :func:`~.generate.generate_after_switch` generates (which reads
    ``prompt`` and does the recompute in one pass: the faster way). A result is
    read once: after ``prompt_cache`` or :meth:`read` it refuses a second read
    (:meth:`copy` first to read it twice); after :meth:`read`, ``cache`` holds the
    whole context and what was read."""

    _cache: List
    # What the target reads in its first step: the native tail (if any), then the
    # context's last token. Cache + pending = the whole context.
    pending: mx.array
    translate_s: float  # building the cache (source cache given; alignment, choice included)
    target: Optional[nn.Module] = None
    # Positions of the cache the target recomputes itself, not done yet: the
    # target's first pass over ``pending`` does them too (read), one pass over its
    # weights instead of two. ``context``: the target's tokens of the whole context,
    # which those positions are read from.
    deferred: List[Span] = field(default_factory=list)
    context: Optional[List[int]] = None
    # The context's text and each target token's characters in it, where known.
    text: Optional[Tuple[str, Sequence[Tuple[int, int]]]] = None
    # Rows older than a sliding-window layer keeps that the deferred recompute reads
    # (kernel.History.layers: layer -> (first position, keys, values)).
    history: dict = field(default_factory=dict)
    _state: str = "fresh"  # "fresh", then "read" or "handed over"

    @property
    def prompt(self) -> mx.array:
        """The tokens the target still reads, after ``prompt_cache``."""
        return self.pending

    @property
    def prompt_cache(self) -> List:
        """The target's cache of the context but ``prompt``, with the switch's
        recompute done: hand both to mlx-lm. Once only (see the class)."""
        self._take("prompt_cache")
        if self.deferred:
            recompute_spans(self._target(None), self._cache, self.context, self.deferred,
                            self.history)
        self.deferred, self.history = [], {}
        self._state = "handed over"
        return self._cache

    @property
    def cache(self) -> List:
        """The target's cache after :meth:`read` (the whole context, and what was
        read). Before it, the cache lacks ``prompt``: use ``prompt_cache``."""
        if self._state != "read":
            raise KvlingoError(
                "SwitchResult.cache is not the whole context until the target has read "
                "its prompt: pass result.prompt with prompt_cache=result.prompt_cache to "
                "mlx-lm, or use generate_after_switch.")
        return self._cache

    @property
    def context_length(self) -> int:
        """Positions of the whole context: the cache's and the prompt's."""
        return min(c.offset for c in self._cache) + self.pending.size

    def read(self, target: Optional[nn.Module] = None, extra: Sequence[int] = (),
             keep: int = 1) -> mx.array:
        """The target's first pass: it reads ``prompt`` (then ``extra``), the
        recompute folded in. Returns the logits [1, keep, vocab] of the last
        ``keep`` tokens read; ``cache`` then holds them all. Once only."""
        self._take("read")
        inputs = self.pending.tolist() + list(extra)
        logits = recompute_and_read(self._target(target), self._cache, self.context or [],
                                    self.deferred, inputs, keep, self.history)
        self.deferred, self.history, self._state = [], {}, "read"
        return logits

    def read_all(self, target: Optional[nn.Module] = None) -> List:
        """The target reads its whole prompt (recompute folded in): returns the
        complete cache of the context (no logits). Once only."""
        self._take("read")
        self._state = "read"
        if self.pending.size:
            recompute_and_read(self._target(target), self._cache, self.context or [],
                               self.deferred, self.pending.tolist(), keep=1,
                               history=self.history)
        elif self.deferred:
            recompute_spans(self._target(target), self._cache, self.context, self.deferred,
                            self.history)
        self.deferred, self.history = [], {}
        return self._cache

    def copy(self) -> "SwitchResult":
        """An independent copy (the cache's arrays copied): reading one leaves the
        other as it was. Only of a result not read yet."""
        self._take("copy")
        return SwitchResult(copy_cache(self._cache), self.pending, self.translate_s,
                            self.target, deferred=list(self.deferred), context=self.context,
                            text=self.text, history=dict(self.history))

    def _take(self, what: str):
        if self._state != "fresh":
            raise KvlingoError(
                f"This switch result was already {self._state}: its prompt would be fed "
                f"twice. Call result.copy() before reading a result twice ({what}).")

    def _target(self, target: Optional[nn.Module]) -> nn.Module:
        target = target if target is not None else self.target
        if target is None:
            raise KvlingoError("This switch result does not know its target model: pass it.")
        return target


def switch(
    source: nn.Module,
    target: nn.Module,
    translator: Translator,
    tokens,
    source_cache: Optional[List] = None,
    native_tail: Optional[int] = None,
    recompute: Optional[float] = None,
    text: Optional[Tuple[str, Sequence[Tuple[int, int]]]] = None,
    recompute_max: Optional[int] = None,
    select: Optional[str] = None,
    tokenizer=None,
) -> SwitchResult:
    """Hand a context over to the target model.

    ``source_cache``: the source's live cache of the context (what it has after its
    turn). Without it the source prefills the context first (not timed).
    ``native_tail``: the target computes the last m context tokens before the last
    one itself (default: the translator's ``spec.native_tail``). They are left in
    the result's ``prompt``: the target reads them with the last token in its first
    step, one pass over its weights.
    ``recompute``: a share of the context's positions (0.1 = 10 %) the target
    recomputes itself after the translation, at most ``recompute_max`` positions (0:
    no limit); None: the translator's defaults (:class:`RecomputeBudget`).
    ``select``: how they are chosen (:data:`SELECTIONS`; None: the translator's
    default). The fact-like words need the context's text: ``text`` = (text, each
    token's character offsets), or ``tokenizer`` to decode the ids; without either
    only the question chooses. The recompute is left to the target's first pass.
    """
    tokens = as_batch(tokens)
    if tokens.shape[0] != 1:
        raise KvlingoError("switch() takes one sequence at a time.")
    ids = tokens[0].tolist()
    select = resolve_select([translator.spec], select)
    if text is None and tokenizer is not None:
        text = token_offsets(tokenizer, ids)
    budget = RecomputeBudget.of(translator, recompute, recompute_max)
    if budget.share and select == "lexical" and text is None:
        raise KvlingoError("A lexical recompute needs the context's text: use switch_text, "
                           "or pass text=(text, offsets) or tokenizer=.")
    if source_cache is None:
        source_cache = prefill(source, tokens[:, :-1])
        mx.eval([(c.keys, c.values) for c in source_cache])
    t0 = time.perf_counter()
    alignment = identity_alignment(ids, translator.spec.native_prefix)
    m = resolve_native_tail(translator, native_tail)
    return _switch(source, target, translator, source_cache, alignment, tokens, m, t0,
                   budget, select, text, own=native_tail is not None or recompute is not None)


def _switch(source, target, translator, source_cache, alignment, tokens, m: int, t0: float,
            budget: RecomputeBudget, select: str, text, early=None,
            own: bool = False) -> SwitchResult:
    """The switch every entry point makes: translate all but the last m + 1
    positions, then choose what the target recomputes (switching.choice), left for
    its first pass. The question is the context's last tokens: the pending ones, at
    least the last MIN_QUESTION. With the source's reading (select "source") the
    source reads first, and where the file has a long tail and the caller set
    neither the tail nor the budget (``own``), a context whose next token reaches
    little takes the long tail without a recompute (:func:`.choice.long_tail_for`)."""
    ids = tokens[0].tolist()
    n, lo = len(ids), max(translator.spec.native_prefix, 1)
    reading = None
    if select == "source" and budget.positions(n):
        near = 0 if own else translator.spec.long_tail
        reading = source_reading(source, source_cache, alignment, near, steps=REACH_STEPS,
                                 enough=translator.spec.long_tail_reach)
        long_tail = long_tail_for(translator.spec, reading[1]) if near else None
        if long_tail is not None:
            m, budget, reading = long_tail, RecomputeBudget(), None
    end = _translated_end(n, m)
    plan = RecomputePlan.make(budget, n, lo, end, select, text, question=end > lo + 1)
    result = switch_aligned(source, target, translator, source_cache, alignment, tokens, m, t0,
                            early=early, history=plan.history())
    result.target = target
    start = min(end, max(n - MIN_QUESTION, lo + 1))
    # The question is read again after the recompute, in its pass: keeping the
    # probe's reading of the tail and reading only the last token again saved 0.04
    # of a re-prefill's time and lost a fifth of the plain-word facts (Gemma 3 ->
    # SmolLM2, ~550 tokens, 82 positions: 0.50 against 0.65 of 48). The probe reads
    # the tail natively too: the last token alone, on the tail translated, cost
    # half as much and chose the answer's tokens as often, but its choice answered
    # fewer relations (Gemma 3 -> SmolLM2, ~1,100 tokens: 4 of 8 against 6 of 8;
    # plain-word facts 0.44 against 0.50 of 48).
    by_source = None
    if reading is not None:
        def by_source(lo: int, hi: int):
            return source_scores(source, source_cache, alignment, lo, hi, reading[0])
    spans = plan.choose(target, result._cache, ids, start, result.history,
                        read_by_source=by_source)
    result.translate_s = time.perf_counter() - t0  # the choice is part of the switch
    return _defer(result, spans, ids, text)


def _translated_end(n: int, m: int) -> int:
    """Positions 0..end-1 of an n-token context a switch with native tail m
    translates: the last m + 1 are read by the target's first step (m = -1: a
    prompt cache of all n, read by nothing yet: translate_cache)."""
    return max(n - 1 - m, 0)


def _defer(result: SwitchResult, spans: List[Span], tokens: Sequence[int],
           text=None) -> SwitchResult:
    """Leave ``spans`` to the target's first pass (``result.deferred``)."""
    result.deferred, result.context, result.text = list(spans), list(tokens), text
    return result


def switch_aligned(source, target, translator, source_cache, alignment, tokens, m: int,
                    t0: float, phases: Optional[dict] = None,
                    early: Optional["EarlyLayer"] = None,
                    history: Optional[History] = None) -> SwitchResult:
    """Translate all target positions but the last m + 1, which are left pending.
    ``phases``: profile the translation into it (see :func:`_phase`); ``early``: see
    :func:`map_early_layer`; ``history``: see kernel.History (its rows end up in
    ``SwitchResult.history``)."""
    n = tokens.shape[1]
    end = _translated_end(n, m)
    if end:
        alignment = alignment.with_native_prefix(translator.spec.native_prefix)
        if phases is not None:
            phases["_mark"] = time.perf_counter()
        cache = translate_into(source, target, translator, source_cache, None, alignment, end,
                           tokens, room=n - end, phases=phases, early=early, history=history)
        if phases is not None:
            phases.pop("_mark", None)
        mx.eval([(c.keys, c.values) for c in cache])
    else:
        cache = make_prompt_cache(target)
    layers = history.layers if history is not None else {}
    mx.eval(list(layers.values()))
    return SwitchResult(cache, tokens[0, end:], time.perf_counter() - t0, history=layers)


def switch_text(
    source: nn.Module,
    source_tokenizer,
    target: nn.Module,
    target_tokenizer,
    translator: Translator,
    text: str,
    source_cache: Optional[List] = None,
    native_tail: Optional[int] = None,
    source_tokens: Optional[tuple] = None,
    recompute: Optional[float] = None,
    recompute_max: Optional[int] = None,
    select: Optional[str] = None,
) -> SwitchResult:
    """Hand a plain-text context over to the target, whatever the two tokenizers.

    Both models tokenize ``text`` (special tokens included); with a cross-tokenizer
    translator the target's tokens are aligned to the source's by characters (part
    of the timed switch). ``source_cache``: the source's live cache of its
    tokenization of ``text``. ``native_tail``: as in :func:`switch`, in target
    tokens. ``source_tokens``: the source's (ids, offsets) of ``text``
    (align.tokenize_with_offsets), which a caller that prefilled the source has
    already: the switch then tokenizes only for the target (~7 ms less for 4,000
    SmolLM2 tokens here). ``recompute``, ``recompute_max``, ``select``: as in
    :func:`switch`.
    """
    if not translator.cross_tokenizer:
        ids, offsets = source_tokens or tokenize_with_offsets(source_tokenizer, text)
        return switch(source, target, translator, mx.array(ids), source_cache=source_cache,
                      native_tail=native_tail, recompute=recompute, text=(text, offsets),
                      recompute_max=recompute_max, select=select)
    select = resolve_select([translator.spec], select)
    budget = RecomputeBudget.of(translator, recompute, recompute_max)
    m = resolve_native_tail(translator, native_tail)
    if source_cache is None:
        source_tokens = source_tokens or tokenize_with_offsets(source_tokenizer, text)
        source_cache = prefill(source, mx.array(source_tokens[0])[None])
        mx.eval([(c.keys, c.values) for c in source_cache])
    t0 = time.perf_counter()
    early = map_early_layer(source, target, translator, source_cache)
    alignment = align_text(source_tokenizer, target_tokenizer, text,
                           translator.spec.native_prefix, source_tokens)
    if len(alignment.target_tokens) < 2:
        raise KvlingoError("A context needs at least 2 target tokens to switch.")
    tokens = mx.array(alignment.target_tokens)[None]
    return _switch(source, target, translator, source_cache, alignment, tokens, m, t0, budget,
                   select, (text, alignment.target_offsets), early,
                   own=native_tail is not None or recompute is not None)

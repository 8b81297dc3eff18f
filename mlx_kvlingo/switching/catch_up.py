"""A switch onto a live cache: bringing a conversation's reader up to date.

In a conversation each model keeps its own cache. Before a model takes a turn it
catches up on what was written since it last ran: each run of positions another
model wrote is translated from that model's cache (one translator per run, never
a chain: no position passes through two translators), the others are computed by
the reader itself. Then, as in a one-shot switch (:func:`.api.switch`), the
reader computes the last ``m`` positions natively (the translators' native
tail), recomputes the translated positions the question reads
(:mod:`.choice`: those it translates now and those earlier catch-ups translated
that are still translated), and reads the question — the turn's new messages — in the same
first pass. The result is a :class:`~.api.SwitchResult`: ``prompt`` and
``prompt_cache`` for mlx-lm, or :func:`~.generate.generate_after_switch`.

The caller (a chat session) says which runs there are and where their rows come
from (:class:`Run`); this module builds the cache and reports what it did
(:class:`CatchUp`). It holds no conversation state.

A quality gate (``judge``) may look at the translated cache before the answer:
it computes the last positions itself and scores them; when it predicts a bad
translation, everything the catch-up translated is re-prefilled instead.
"""

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..errors import KvlingoError
from ..models.cache import prefill, trim_cache_to
from ..translator.align import NATIVE, Alignment
from ..translator.maps import Translator
from .api import SwitchResult, translate_aligned, translate_span
from .choice import RecomputeBudget, RecomputePlan, resolve_select, whole_context_from
from .kernel import History
from .query import question_scores, scores_from
from .recompute import Span, recompute_spans, token_offsets


@dataclass
class Run:
    """Positions lo..hi-1 of the reader's context and where their rows come from.
    ``translator`` None: the reader computes them itself. Otherwise they are
    translated from ``source_cache`` (of model ``source``, named ``writer``):
    position for position when ``alignment`` is None (a shared tokenizer: the
    source's cache holds the same positions), else as ``alignment`` maps the
    reader's tokens to the source's (its NATIVE positions are the reader's own)."""

    lo: int
    hi: int
    writer: Optional[str] = None
    source: Optional[nn.Module] = None
    source_cache: Optional[List] = None
    translator: Optional[Translator] = None
    alignment: Optional[Alignment] = None


# A judge looks at the translated cache before the answer: (model, cache, the
# tail's tokens it computes itself on top of it, translators involved) -> a
# decision with ``fallback`` (bool), ``reason`` and ``to_dict()``; it leaves the
# tail in the cache.
Judge = Callable[[nn.Module, List, Sequence[int], Sequence[Translator]], object]


@dataclass
class CatchUp:
    """What a catch-up did. ``result``: the switch it leaves for the reader's first
    pass (its ``prompt``: the native tail, if any, then the question); ``cache``:
    the reader's cache (the same list as ``result``'s; a new one when the old one
    could not be trimmed); ``held``: the positions the cache holds before the
    first pass."""

    result: SwitchResult
    cache: List
    held: int
    translated: Dict[str, int] = field(default_factory=dict)  # writer -> positions
    prefilled: int = 0  # context positions the reader computed (tail and gate included)
    native_tail: int = 0
    recomputed: int = 0
    warnings: List[str] = field(default_factory=list)
    # Positions this catch-up translated (its native tail and the reader's own
    # positions left out) and those the reader recomputes in its first pass, which
    # may lie in earlier turns (``earlier``).
    translated_spans: List[Span] = field(default_factory=list)
    recomputed_spans: List[Span] = field(default_factory=list)
    gate: Optional[dict] = None
    fallback: Optional[str] = None
    seconds: float = 0.0

    @property
    def translated_total(self) -> int:
        return sum(self.translated.values())


def catch_up(model: nn.Module, cache: List, tokens: Sequence[int], start: int,
             runs: Sequence[Run], question: Sequence[int] = (), tokenizer=None,
             recompute: Optional[float] = None, recompute_max: Optional[int] = None,
             select: Optional[str] = None, judge: Optional[Judge] = None,
             judge_tokens: int = 0, break_even: int = 0, earlier: Sequence[Span] = (),
             earlier_translators: Sequence[Translator] = (),
             kept: Optional[History] = None) -> CatchUp:
    """Extend ``cache`` (holding ``tokens[:start]``) over ``runs`` (consecutive,
    from ``start`` to ``end``, the last run's ``hi``), then leave the native tail
    and ``question`` (the tokens read next, not in ``tokens``) to the reader's first
    pass, with the recompute the question chooses (see the module's docstring).

    ``recompute``, ``recompute_max``, ``select``: the budget and the choice (None:
    the defaults of the translators involved, counted on the whole context as a
    switch counts it). ``tokenizer``: decodes the translated positions for the
    fact-like words. ``judge`` / ``judge_tokens``: the quality gate and how many
    of the last positions it scores (at least 2 to judge). ``break_even``: when
    the runs to translate hold fewer positions, the reader computes them itself
    instead (a shorter switch costs more than it saves: switching.break_even).

    ``earlier``: ranges of positions before ``start`` that hold rows translated by
    earlier catch-ups (by ``earlier_translators``) and not recomputed since: the
    question chooses its recompute among them too (the fact it asks about may have
    been translated turns ago), also when this catch-up translates nothing (the
    whole budget is then theirs; a turn whose cache holds no translated position
    recomputes nothing). ``kept``: the reader's
    rows its sliding-window layers no longer hold, kept across turns (a
    :class:`~.kernel.History` from position 0, extended here as runs are written)
    so that the recompute may reach positions older than a window."""
    t0 = time.perf_counter()
    end = runs[-1].hi if runs else start
    _check_runs(runs, start, end)
    reason = None
    translatable = sum(r.hi - r.lo for r in runs if r.translator is not None)
    if 0 < translatable < break_even:
        runs = [Run(start, end)]
        reason = f"break-even: {translatable} positions to translate, fewer than {break_even}"
    translators = [r.translator for r in runs if r.translator is not None]
    specs = [t.spec for t in translators]
    g = judge_tokens if judge is not None else 0
    m = min(max([g] + [s.native_tail for s in specs]), end - start) if translators else 0
    g = min(g, m) if g >= 2 else 0
    earlier = [(a, min(b, start)) for a, b in earlier if a < min(b, start)]
    plan = _plan(tokens, start, end - m, specs + [t.spec for t in earlier_translators],
                 recompute, recompute_max, select, tokenizer,
                 question=bool(question) or m > 0, earlier=earlier,
                 translating=bool(translators))
    history = kept if kept is not None else plan.history()
    if history is not None:  # rows held from earlier turns, before new runs push them out
        history.record(model, cache, 0, start)
    out = CatchUp(SwitchResult(cache, mx.array([], mx.int32), 0.0, model), cache, start,
                  fallback=reason)
    for run in _clip(runs, end - m):
        _add_run(model, tokens, run, history, out)
    if out.cache and out.cache[0].keys is not None:
        mx.eval([(c.keys, c.values) for c in out.cache])
    if not out.translated_total:  # nothing translated: the reader computes the rest too
        _prefill(model, out, tokens, out.held, end)
        # The question may still need what an earlier turn translated.
        spans = _choose(model, out.cache, tokens, plan, history, question) if earlier else []
        out.recomputed = sum(b - a for a, b in spans)
        out.recomputed_spans = list(spans)
        out.result = _pending(out, model, question, tokens, end, spans,
                              history.layers if history is not None else {})
    else:
        out.native_tail = m
        tail = list(tokens[end - m:end])
        by_source = (_source_reading(runs, list(tokens[:end]) + list(question))
                     if specs and resolve_select(specs, select) == "source" else None)
        spans = _choose(model, out.cache, tokens, plan, history, tail + list(question),
                        by_source)
        out.recomputed = sum(b - a for a, b in spans)
        out.recomputed_spans = list(spans)
        layers = history.layers if history is not None else {}
        if g:  # the gate reads the tail first: recompute now, then judge
            recompute_spans(model, out.cache, tokens, spans, layers)
            _prefill(model, out, tokens, end - m, end - g)
            _judge(model, tokens, start, end, g, judge, translators, out)
            out.result = _pending(out, model, question, tokens, end)
        else:
            out.prefilled += m
            out.result = _pending(out, model, tail + list(question), tokens, end - m,
                                  spans, layers)
    out.seconds = time.perf_counter() - t0
    out.result.translate_s = out.seconds
    return out


def _check_runs(runs: Sequence[Run], start: int, end: int):
    at = start
    for r in runs:
        if r.lo != at or r.hi < r.lo:
            raise KvlingoError(f"Catch-up runs must follow each other from {start}: "
                               f"got {r.lo}..{r.hi} after {at}.")
        at = r.hi
    if at != end:
        raise KvlingoError("Catch-up runs must end where the catch-up ends.")


def _plan(tokens, lo: int, hi: int, specs, recompute, recompute_max, select, tokenizer,
          question: bool, earlier: Sequence[Span] = (),
          translating: bool = True) -> RecomputePlan:
    """What to recompute of the positions lo..hi-1 about to be translated
    (``translating``; else the reader computes them), and of ``earlier`` translated
    ones the question may choose (made before the translation: it keeps the rows
    the recompute reads that sliding-window layers drop). The fact-like words are
    looked for in lo..hi-1 only: earlier turns' were chosen when they were
    translated."""
    budget = RecomputeBudget.of(specs, recompute, recompute_max)
    first = min([lo] + [a for a, _ in earlier])
    if (not specs or not budget.positions(hi) or hi - first < 2
            or not (translating or earlier)):
        return RecomputePlan()
    text = (token_offsets(tokenizer, tokens[lo:hi])
            if tokenizer is not None and translating else None)
    plan = RecomputePlan.make(budget, hi, max(first, 1), hi, resolve_select(specs, select),
                              text, text_from=lo, question=question)
    if earlier and plan.by_question:
        plan.allowed = list(earlier) + ([(lo, hi)] if translating else [])
    return plan


def _clip(runs: Sequence[Run], end: int) -> List[Run]:
    """The runs up to ``end`` (the native tail after it is the reader's own)."""
    out = []
    for r in runs:
        if r.lo >= end:
            break
        out.append(Run(r.lo, min(r.hi, end), r.writer, r.source, r.source_cache,
                       r.translator, r.alignment))
    return out


def _add_run(model, tokens, run: Run, history: Optional[History], out: CatchUp):
    """Translate ``run`` (or compute it, without a translator) into ``out.cache``."""
    if run.translator is None:
        _prefill(model, out, tokens, run.lo, run.hi, history)
        return
    try:
        if run.alignment is None:
            out.cache = translate_span(run.source, model, run.translator, run.source_cache,
                                       out.cache, mx.array(list(tokens[:run.hi]))[None],
                                       run.hi, history)
            native = min(max(run.translator.spec.native_prefix, run.lo), run.hi) - run.lo
        else:
            out.cache = translate_aligned(run.source, model, run.translator, run.source_cache,
                                          out.cache, run.alignment, run.hi, history=history)
            index = run.alignment.with_native_prefix(run.translator.spec.native_prefix)
            native = sum(1 for i in index.source_index[run.lo:run.hi] if i == NATIVE)
    except KvlingoError as e:  # e.g. a sliding-window source no longer holds the run
        _start_over_at(model, out, tokens, run.lo)
        out.warnings.append(f"could not translate positions {run.lo}..{run.hi - 1} from "
                            f"{run.writer} ({e}); the model computed them itself.")
        _prefill(model, out, tokens, run.lo, run.hi, history)
        return
    out.held = run.hi
    out.prefilled += native
    out.translated[run.writer] = out.translated.get(run.writer, 0) + run.hi - run.lo - native
    out.translated_spans += _translated_positions(run)


def _translated_positions(run: Run) -> List[Span]:
    """The ranges of ``run`` its translator wrote (not the reader's own positions:
    the native prefix, template tokens an alignment leaves to the reader)."""
    prefix = run.translator.spec.native_prefix
    if run.alignment is None:
        lo = min(max(prefix, run.lo), run.hi)
        return [(lo, run.hi)] if run.hi > lo else []
    index = run.alignment.with_native_prefix(prefix).source_index
    spans: List[Span] = []
    for p in range(run.lo, run.hi):
        if index[p] == NATIVE:
            continue
        if spans and spans[-1][1] == p:
            spans[-1] = (spans[-1][0], p + 1)
        else:
            spans.append((p, p + 1))
    return spans


def _start_over_at(model, out: CatchUp, tokens, length: int):
    """Trim the cache back to ``length`` positions, or (a cache that cannot be
    trimmed, e.g. a full sliding window) compute them afresh."""
    if not trim_cache_to(out.cache, length):
        out.cache = make_prompt_cache(model)
        out.held = 0
        _prefill(model, out, tokens, 0, length)
    out.held = length


def _prefill(model, out: CatchUp, tokens, lo: int, hi: int,
             history: Optional[History] = None):
    """The reader computes positions lo..hi-1 itself."""
    if hi <= lo:
        return
    prefill(model, mx.array(list(tokens[lo:hi])), out.cache)
    if history is not None:
        history.record(model, out.cache, lo, hi)
    mx.eval([(c.keys, c.values) for c in out.cache])
    out.prefilled += hi - lo
    out.held = hi


def _choose(model, cache, tokens, plan: RecomputePlan, history: Optional[History],
            question: Sequence[int], by_source=None):
    """The spans to recompute: the plan's choice, with ``question`` read on the
    translated cache (a probe that writes nothing), or by the writer
    (``by_source``: :func:`_source_reading`)."""
    if not plan.count:
        return []
    if not question:
        return plan.lexical
    layers = history.layers if history is not None else None
    end = min(c.offset for c in cache)
    return plan.choose(model, cache, list(tokens[:end]) + list(question), end, layers,
                       floor=whole_context_from(model, cache, layers or {}),
                       read_by_source=by_source)


def _source_reading(runs: Sequence[Run], full: Sequence[int]):
    """The question's choice read by the writer of the translated runs, on its own
    cache (select "source"): it reads what its cache lacks of ``full`` (the
    context, then the question) natively, as a probe that writes nothing, and its
    last token's attention scores the positions (query.question_scores). None,
    and the reader reads the question itself, where that is not one writer with
    the reader's tokenizer."""
    writers = {id(r.source_cache): r for r in runs if r.translator is not None}
    if len(writers) != 1:
        return None
    run = next(iter(writers.values()))
    held = min(c.offset for c in run.source_cache)
    if run.alignment is not None or held > len(full) - 1:
        return None

    def read(lo: int, hi: int) -> np.ndarray:
        scores = question_scores(run.source, run.source_cache, full, held, 1)  # 1..held-1
        return scores_from(scores, lo, hi)

    return read


def _judge(model, tokens, start: int, end: int, g: int, judge: Judge, translators,
           out: CatchUp):
    """The gate computes the last ``g`` positions and scores them; on a bad score
    the catch-up's positions are re-prefilled."""
    decision = judge(model, out.cache, list(tokens[end - g:end]), translators)
    out.prefilled += g
    out.held = end
    out.gate = decision.to_dict()
    if decision.fallback:
        out.fallback = decision.reason
        out.prefilled, out.translated = 0, {}  # all of them are counted again below
        out.translated_spans, out.recomputed_spans = [], []
        _start_over_at(model, out, tokens, start)
        _prefill(model, out, tokens, start, end)


def _pending(out: CatchUp, model, prompt: Sequence[int], tokens, held: int,
             spans=(), layers=None) -> SwitchResult:
    """The switch left for the reader's first pass: ``prompt`` read after the
    cache's ``held`` positions, ``spans`` recomputed in the same pass."""
    out.held = held
    return SwitchResult(out.cache, mx.array(list(prompt), dtype=mx.int32), 0.0, model,
                        deferred=list(spans), context=list(tokens[:held]),
                        history=dict(layers or {}))

"""Bringing one model of a Session up to date with the conversation.

Before a model takes a turn it catches up on what the others wrote since it last
ran: each such span is translated from the cache of the model that wrote it (one
translator per span, never a chain: the "retained span" rule, so no position
passes through two translators), everything else is prefilled. The last positions
may be computed natively on top (the translators' native tail) and judged by the
session's quality gate, which re-prefills the turn's catch-up when it predicts a
bad translation.
"""

import time
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..errors import KvlingoError
from ..models.cache import prefill, trim_cache_to
from ..switching.api import translate_aligned, translate_span
from ..switching.choice import RecomputeBudget, RecomputePlan, recompute_live, resolve_select
from ..switching.kernel import History
from ..switching.recompute import token_offsets
from ..translator.align import NATIVE, Alignment
from .transcript import align_pieces, leading_specials
from .turns import TurnReport


def catch_up_gated(session, name: str, end: int, report: TurnReport,
                   question: Sequence[int] = ()) -> int:
    """:func:`catch_up`, with the translators' native tail and the quality gate.
    ``question``: the tokens the model reads next (the turn's new messages), which
    choose what it recomputes (switching.query) and, where no tail is read after
    the recompute, are read in the recompute's pass but for the last one. Returns
    how many of them the cache holds now.

    When the catch-up translates, its last ``m`` positions are computed by the
    model itself on top of the translated cache instead (m = the largest
    ``native_tail`` of the translators involved, at least the gate's tokens):
    the most attended recent positions become exact. The gate then scores its
    last ``gate.tokens`` of them, and on a bad score everything this turn
    translated is re-prefilled instead."""
    view, entry = session.transcript_of(name), session.entry(name)
    start = view.processed[name]
    pending = [session.translator(s.writer, name) for s in view.pending(name, end)
               if s.writer not in (None, name) and session.has_translator(s.writer, name)]
    g = session.gate.tokens if session.gate is not None else 0
    m = min(max([g] + [t.spec.native_tail for t in pending]), end - start)
    g = min(g, m)
    if m < 1 or not pending:
        facts = FactRecompute.choose(session, name, start, end, pending, bool(question))
        catch_up(session, name, end, report, facts.history)
        if report.translated:
            return facts.run(session, name, report, question, read=True)
        return 0
    facts = FactRecompute.choose(session, name, start, end - m, pending)
    catch_up(session, name, end - m, report, facts.history)
    if not report.translated:
        catch_up(session, name, end, report)
        return 0
    facts.run(session, name, report, list(view.tokens[end - m:end]) + list(question))
    report.native_tail = m
    if g < 2:  # no gate (a 1-token gate cannot score): the whole tail is prefilled
        g = 0
    if g < m:  # the part of the tail the gate does not score
        prefill(entry.model, mx.array(view.tokens[end - m:end - g]), entry.cache)
        mx.eval([(c.keys, c.values) for c in entry.cache])
        view.processed[name] = end - g
        report.prefilled += m - g
    if not g:
        return 0
    translators = [session.translator(w, name) for w in report.translated_from]
    decision = session.gate.judge(entry.model, entry.cache, view.tokens[end - g:end],
                               view.tokens[:leading_specials(view)], translators)
    view.processed[name] = end
    report.prefilled += g
    report.gate = decision.to_dict()
    if decision.fallback:
        fall_back(session, name, start, end, decision.reason, report)
    return 0

def fall_back(session, name: str, start: int, end: int, reason: str, report: TurnReport):
    """Replace positions start..end-1 (this turn's catch-up) by a native prefill."""
    t0 = time.perf_counter()
    view, entry = session.transcript_of(name), session.entry(name)
    counted = end - start - report.translated  # positions already counted as prefilled
    if not trim_cache_to(entry.cache, start):
        entry.cache = make_prompt_cache(entry.model)  # e.g. a full sliding window
        start = 0
    view.translated[name] = max(view.translated[name] - report.translated, 0)
    if start == 0:
        view.translated[name] = 0
    prefill(entry.model, mx.array(view.tokens[start:end]), entry.cache)
    mx.eval([(c.keys, c.values) for c in entry.cache])
    view.processed[name] = end
    report.prefilled += end - start - counted
    report.translated, report.translated_from = 0, {}
    report.fallback = reason
    report.translate_s += time.perf_counter() - t0

def catch_up(session, name: str, end: int, report: TurnReport,
             history: Optional[History] = None):
    """Bring model ``name``'s cache to ``end`` tokens: spans other models wrote are
    translated from the writer's cache, everything else is prefilled. ``history``:
    keep the rows a recompute will read that sliding-window layers drop
    (kernel.History)."""
    try:
        _catch_up_spans(session, name, end, report, history)
    except BaseException:
        # Interrupted (Ctrl-C) or failed half-way: layers may disagree. Start this
        # model's cache afresh; its next turn catches up from the beginning.
        entry, view = session.entry(name), session.transcript_of(name)
        entry.cache = make_prompt_cache(entry.model)
        view.processed[name] = 0
        view.translated[name] = 0
        raise

def _catch_up_spans(session, name: str, end: int, report: TurnReport,
                    history: Optional[History]):
    entry, view = session.entry(name), session.transcript_of(name)
    t0 = time.perf_counter()
    missing: Dict[str, int] = {}
    if history is not None:  # rows held from earlier turns, before new ones push them out
        history.record(entry.model, entry.cache, 0, view.processed[name])
    for span in view.pending(name, end):
        lo, hi, writer = span.start, span.end, span.writer
        if writer is not None and writer != name:
            translator = session.translator(writer, name)
            if translator is None:
                missing[writer] = missing.get(writer, 0) + hi - lo
            elif session.transcript_of(writer) is view:
                lo = _translate_shared(session, name, writer, translator, lo, hi, report,
                                       history)
            else:
                lo = _translate_aligned(session, name, writer, translator, lo, hi, report,
                                        history)
        if lo < hi:
            prefill(entry.model, mx.array(view.tokens[lo:hi]), entry.cache)
            if history is not None:
                history.record(entry.model, entry.cache, lo, hi)
            report.prefilled += hi - lo
            view.processed[name] = hi
    for writer, n in missing.items():
        report.warnings.append(
            f"no translator {writer} -> {name}: {name} prefilled the {n} tokens "
            f"{writer} wrote."
        )
    if entry.cache and entry.cache[0].keys is not None:
        mx.eval([(c.keys, c.values) for c in entry.cache])
    report.translate_s += time.perf_counter() - t0

def _translate_shared(session, name, writer, translator, lo, hi, report, history) -> int:
    """Positions lo.. that ``writer``'s cache holds, translated position for
    position (shared tokenizer); returns the first position not translated."""
    entry, view = session.entry(name), session.transcript_of(name)
    held = min(hi, view.processed.get(writer, 0))
    if held <= lo:
        return lo
    n_native = min(max(translator.spec.native_prefix, lo), held) - lo
    tokens = mx.array(view.tokens)[None]
    try:
        entry.cache = translate_span(
            session.model(writer), entry.model, translator,
            session.cache(writer), entry.cache, tokens, held, history,
        )
    except KvlingoError as e:  # e.g. a sliding-window source dropped the span
        return _translation_failed(session, name, writer, lo, held, e, report)
    _count_translated(session, name, writer, lo, held, held - lo - n_native, report)
    return held

def _translate_aligned(session, name, writer, translator, lo, hi, report, history) -> int:
    """Positions lo.. whose text ``writer`` wrote in its own tokenization: each
    reads the writer's token holding its last character; template tokens are
    computed natively. Returns the first position not handled."""
    entry, view = session.entry(name), session.transcript_of(name)
    source_view = session.transcript_of(writer)
    index = align_pieces(source_view, view, lo, hi)
    held = source_view.processed.get(writer, 0)
    h = lo
    while h < hi and index[h - lo] < held:  # NATIVE (-1) is always "held"
        h += 1
    if h == lo:
        return lo
    alignment = Alignment(source_view.tokens, view.tokens[:h], [NATIVE] * lo + index[:h - lo])
    native = alignment.with_native_prefix(translator.spec.native_prefix).source_index[lo:h]
    try:
        entry.cache = translate_aligned(
            session.model(writer), entry.model, translator,
            session.cache(writer), entry.cache, alignment, h, history=history,
        )
    except KvlingoError as e:
        return _translation_failed(session, name, writer, lo, h, e, report)
    n_native = sum(1 for i in native if i == NATIVE)
    report.prefilled += n_native
    _count_translated(session, name, writer, lo, h, h - lo - n_native, report)
    return h

def _count_translated(session, name, writer, lo, hi, n, report):
    view = session.transcript_of(name)
    report.translated += n
    report.prefilled += hi - lo - n if session.transcript_of(writer) is view else 0
    report.translated_from[writer] = report.translated_from.get(writer, 0) + n
    view.translated[name] += n
    view.processed[name] = hi

def _translation_failed(session, name, writer, lo, hi, error, report) -> int:
    restore(session, name, lo)
    report.warnings.append(
        f"could not translate positions {lo}..{hi - 1} from {writer} ({error}); "
        f"{name} prefilled them."
    )
    return lo

def restore(session, name: str, length: int):
    """Trim model ``name``'s cache back to ``length`` tokens (after a failure)."""
    entry, view = session.entry(name), session.transcript_of(name)
    if not trim_cache_to(entry.cache, length):
        entry.cache = make_prompt_cache(entry.model)
        view.processed[name] = 0
        view.translated[name] = 0
        catch_up(session, name, length, TurnReport(-1, name))
    view.processed[name] = length


@dataclass
class FactRecompute:
    """What a catch-up recomputes of the positions lo..hi-1 it is about to
    translate: the switch's own plan (switching.choice.RecomputePlan), with the
    session's budget (its own, or the translators' defaults, counted on the whole
    conversation as a switch counts its context). Made before the translation so
    that the catch-up keeps the rows the recompute reads that its sliding-window
    layers drop (``history``: None when nothing will be recomputed)."""

    plan: RecomputePlan = field(default_factory=RecomputePlan)
    history: Optional[History] = None
    choose_s: float = 0.0

    @classmethod
    def choose(cls, session, name: str, lo: int, hi: int, translators=(),
               question: bool = True) -> "FactRecompute":
        """``question``: whether :meth:`run` will have a question to choose with."""
        budget = _recompute_budget(session, translators)
        if not budget.positions(hi) or hi - lo < 2:
            return cls()
        t0 = time.perf_counter()
        entry, view = session.entry(name), session.transcript_of(name)
        text = token_offsets(entry.tokenizer, view.tokens[lo:hi])
        select = resolve_select([t.spec for t in translators], None)
        plan = RecomputePlan.make(budget, hi, max(lo, 1), hi, select, text, text_from=lo,
                                  question=question)
        return cls(plan, plan.history(), time.perf_counter() - t0)

    def run(self, session, name: str, report: TurnReport, question: Sequence[int] = (),
            read: bool = False) -> int:
        """Recompute the chosen positions (after the catch-up translated them),
        choosing with ``question`` (the tokens read next). ``read``: the pass also
        reads the question but for its last token (the cache ends where it starts).
        Returns how many question tokens the cache holds now."""
        if not self.plan.count:
            return 0
        t0 = time.perf_counter()
        entry, view = session.entry(name), session.transcript_of(name)
        spans, read_now = recompute_live(entry.model, entry.cache, view.tokens, self.plan,
                                         self.history, question, read)
        self.history = None
        report.recomputed += sum(b - a for a, b in spans)
        report.translate_s += self.choose_s + time.perf_counter() - t0
        return read_now


def _recompute_budget(session, translators) -> RecomputeBudget:
    """The session's recompute share and cap; what it leaves unset (None), the
    defaults of the translators that wrote the catch-up's spans."""
    return RecomputeBudget.of([t.spec for t in translators], session.recompute,
                              session.recompute_max)

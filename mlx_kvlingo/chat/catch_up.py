"""Bringing one model of a Session up to date with the conversation.

Before a model takes a turn it catches up on what the others wrote since it last
ran. This module says, from the session's transcripts, which runs of positions
there are and where their rows come from (the writer's cache, position for
position with a shared tokenizer, else aligned by characters; template tokens
and spans without a translator are the reader's own); switching.catch_up builds
the cache (translation, native tail, recompute, the quality gate) and returns the
switch the reader's first pass completes. The session's bookkeeping is updated
here from what it reports.
"""

from typing import List, Sequence

from mlx_lm.models.cache import make_prompt_cache

from ..models.cache import trim_cache_to
from ..switching.api import SwitchResult
from ..switching.break_even import break_even_for
from ..switching.catch_up import CatchUp, Run, catch_up
from ..translator.align import NATIVE, Alignment
from .transcript import align_pieces, leading_specials
from .turns import TurnReport


def catch_up_turn(session, name: str, end: int, report: TurnReport,
                  question: Sequence[int] = ()) -> SwitchResult:
    """Bring model ``name`` up to position ``end`` of its view, ``question`` (the
    turn's new messages: they choose what it recomputes) left for its first pass
    with the native tail and the recompute. Returns that switch: read it with
    ``generate_after_switch`` (or ``read_all()`` when nothing follows)."""
    view, entry = session.transcript_of(name), session.entry(name)
    start = view.processed[name]
    runs = _runs(session, name, start, end, report)
    gate = session.gate
    specials = view.tokens[:leading_specials(view)]

    def judge(model, cache, tail, translators):
        return gate.judge(model, cache, tail, specials, translators)

    try:
        done = catch_up(entry.model, entry.cache, view.tokens, start, runs, question,
                        tokenizer=entry.tokenizer, recompute=session.recompute,
                        recompute_max=session.recompute_max,
                        judge=judge if gate is not None else None,
                        judge_tokens=gate.tokens if gate is not None else 0,
                        break_even=_break_even(session, runs, entry.model),
                        earlier=view.still_translated[name],
                        earlier_translators=_translators_to(session, name),
                        kept=entry.kept)
    except BaseException:
        # Interrupted (Ctrl-C) or failed half-way: layers may disagree. Start this
        # model's cache afresh; its next turn catches up from the beginning.
        entry.cache = make_prompt_cache(entry.model)
        view.processed[name] = 0
        view.translated[name] = 0
        view.still_translated[name] = []
        raise
    _record(session, name, start, end, done, report)
    return done.result


def _break_even(session, runs: List[Run], model) -> int:
    """The session's break-even, else the largest of the translators of ``runs``
    (each measured on this machine, else its file's: switching.break_even)."""
    if session.break_even is not None:
        return session.break_even
    return max([break_even_for(r.translator, model)[0] for r in runs
                if r.translator is not None], default=0)


def _translators_to(session, name: str) -> list:
    """The translators into ``name`` (those that may have written its translated
    positions of earlier turns)."""
    return [t for w in session.model_names if w != name
            for t in [session.translator(w, name)] if t is not None]


def _runs(session, name: str, start: int, end: int, report: TurnReport) -> List[Run]:
    """The runs start..end-1 of ``name``'s view: spans others wrote, translated
    where a translator exists and the writer's cache holds them; the rest native."""
    view = session.transcript_of(name)
    runs, missing = [], {}
    for span in view.pending(name, end):
        lo, hi, writer = span.start, span.end, span.writer
        if writer is not None and writer != name:
            translator = session.translator(writer, name)
            if translator is None:
                missing[writer] = missing.get(writer, 0) + hi - lo
            else:
                lo = _translated_run(session, name, writer, translator, lo, hi, runs)
        if lo < hi:
            runs.append(Run(lo, hi))
    for writer, n in missing.items():
        report.warnings.append(
            f"no translator {writer} -> {name}: {name} prefilled the {n} tokens "
            f"{writer} wrote."
        )
    return runs


def _translated_run(session, name, writer, translator, lo: int, hi: int,
                    runs: List[Run]) -> int:
    """Append the run of lo..hi-1 that ``writer``'s cache holds, translated; returns
    the first position it does not cover."""
    view, source_view = session.transcript_of(name), session.transcript_of(writer)
    held = source_view.processed.get(writer, 0)
    source = (session.model(writer), session.cache(writer))
    if source_view is view:  # a shared tokenizer: position for position
        h = min(hi, held)
        if h > lo:
            runs.append(Run(lo, h, writer, *source, translator))
        return max(h, lo)
    index = align_pieces(source_view, view, lo, hi)
    h = lo
    while h < hi and index[h - lo] < held:  # NATIVE (-1) is always "held"
        h += 1
    if h > lo:
        alignment = Alignment(source_view.tokens, view.tokens[:h],
                              [NATIVE] * lo + index[:h - lo])
        runs.append(Run(lo, h, writer, *source, translator, alignment))
    return h


def _record(session, name: str, start: int, end: int, done: CatchUp, report: TurnReport):
    """The session's bookkeeping and the turn's report, from what the catch-up did."""
    view, entry = session.transcript_of(name), session.entry(name)
    entry.cache = done.cache
    view.processed[name] = done.held
    view.translated[name] += done.translated_total
    if done.translated_total:
        view.mark_foreign(name, start, end)
    view.still_translated[name] = _without(view.still_translated[name] + done.translated_spans,
                                           done.recomputed_spans)
    report.translated += done.translated_total
    for writer, n in done.translated.items():
        report.translated_from[writer] = report.translated_from.get(writer, 0) + n
    report.prefilled += done.prefilled
    report.recomputed += done.recomputed
    report.native_tail = max(report.native_tail, done.native_tail)
    report.warnings += done.warnings
    report.translate_s += done.seconds
    if done.gate is not None:
        report.gate = done.gate
    if done.fallback:
        report.fallback = done.fallback


def _without(ranges, removed) -> list:
    """``ranges`` less the positions of ``removed`` (both lists of (lo, hi))."""
    out = []
    for a, b in ranges:
        pieces = [(a, b)]
        for c, d in removed:
            pieces = [q for x, y in pieces
                      for q in ((x, min(y, c)), (max(x, d), y)) if q[1] > q[0]]
        out += pieces
    return sorted(out)


def restore(session, name: str, length: int):
    """Trim model ``name``'s cache back to ``length`` tokens (after a failure), or
    catch it up afresh to there when it cannot be trimmed."""
    entry, view = session.entry(name), session.transcript_of(name)
    if not trim_cache_to(entry.cache, length):
        entry.cache = make_prompt_cache(entry.model)
        view.processed[name] = 0
        view.translated[name] = 0
        catch_up_turn(session, name, length, TurnReport(-1, name)).read_all()
    view.processed[name] = length

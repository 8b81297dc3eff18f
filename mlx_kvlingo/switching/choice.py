"""What the target recomputes after a translation: one budget rule and one choice,
for a one-shot switch and for a conversation's catch-up alike.

A budget (:class:`RecomputeBudget`) says how many positions: a share of the
context less a reserve, up to a cap, the translator file's defaults unless asked
otherwise. A plan (:class:`RecomputePlan`) says which: before the translation,
the context's fact-like words (switching.recompute.salient_spans), which need only
the text; after it, with the default selection, the positions the question reads
(switching.query), which fill the rest of the budget.
"""

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import KvlingoError
from ..models.geometry import cache_geometry
from .kernel import History
from .query import question_scores, question_spans
from .recompute import Span, salient_spans, word_spans

# How the positions are chosen (``spec.recompute_select``, or ``select=``):
# "question" (the default): the positions the question reads, with the fact-like
# words; "question-words": the same, each chosen position widened to the whole word
# it is part of (a number a tokenizer splits digit by digit is recomputed whole);
# "source": as "question", the question read by the source on its own cache
# instead of by the target on the translated one (query.source_scores: in a
# one-shot switch one token's pass of the source; in a catch-up with one
# tokenizer, what the writer's cache lacks and the new messages);
# "lexical": the fact-like words only.
SELECTIONS = ("question", "question-words", "source", "lexical")
BY_QUESTION = ("question", "question-words", "source")
# With "question", the fact-like words may take at most this share of the budget;
# the question's choice fills the rest.
LEXICAL_SHARE = 0.5


def resolve_select(specs: Sequence, select: Optional[str]) -> str:
    """The selection asked for, or the translators' own ("question" if any of them
    says so)."""
    if select is None:
        ways = [getattr(s, "recompute_select", "question") for s in specs] or ["question"]
        select = next((w for w in ways if w in BY_QUESTION), "lexical")
    if select not in SELECTIONS:
        raise KvlingoError(f"select is one of {', '.join(SELECTIONS)}, not {select!r}.")
    return select


@dataclass(frozen=True)
class RecomputeBudget:
    """How many context positions the target recomputes: ``share`` of them (0.1 =
    10 %) less ``reserve``, at most ``most`` (0: no limit).

    Why a reserve: a switch costs a fixed part (its first pass, which reads the
    pending tokens anyway) and parts that grow with the context (the maps; each
    recomputed position about a re-prefilled one), so for its time to stay one
    share of a re-prefill's, the positions it may recompute are a share of the
    context less a fixed number."""

    share: float = 0.0
    most: int = 0
    reserve: int = 0

    @classmethod
    def of(cls, specs, share: Optional[float] = None,
           most: Optional[int] = None) -> "RecomputeBudget":
        """The budget asked for; what is not given (None) is the translators'
        default (``spec.recompute``, ``spec.recompute_max``; with several, the
        largest, and the smallest reserve). ``specs``: a translator, its spec, or
        several specs. The files' reserve comes with their share: a share asked for
        is that share of the context."""
        specs = _specs(specs)
        reserve = min([getattr(s, "recompute_reserve", 0) for s in specs] or [0]) \
            if share is None else 0
        share = max([getattr(s, "recompute", 0.0) for s in specs] or [0.0]) \
            if share is None else share
        most = max([getattr(s, "recompute_max", 0) for s in specs] or [0]) \
            if most is None else most
        cls.check(share, most)
        return cls(float(share), most, reserve)

    @staticmethod
    def check(share: Optional[float], most: Optional[int]) -> None:
        """Refuse a share outside [0, 1] or a negative cap (None: not given)."""
        if share is not None and not (isinstance(share, (int, float))
                                      and not isinstance(share, bool) and 0 <= share <= 1):
            raise KvlingoError(f"recompute is a share of the context in [0, 1], not {share!r}.")
        if most is not None and not (isinstance(most, int) and not isinstance(most, bool)
                                     and most >= 0):
            raise KvlingoError(f"recompute_max is a number of positions >= 0, not {most!r}.")

    def positions(self, n: int) -> int:
        """The positions it allows in an n-token context."""
        count = max(int(self.share * n) - self.reserve, 0)
        return min(count, self.most) if self.most else count


# Tokens the reach looks on (query.last_token_reading): the answer to "The PIN of
# the account is" starts with a space that any reading predicts; its first digit,
# one token on, is what needs the distant context.
REACH_STEPS = 2


def long_tail_for(spec, reach: float) -> Optional[int]:
    """The long native tail a one-shot switch takes instead of its defaults when the
    source's next token reaches little beyond it (``reach`` <= the file's
    ``long_tail_reach``, nats: text that goes on), or None (the defaults: a question
    may need a distant fact). On held-out quotations and verse at 512 tokens the
    SmolLM2 <-> Gemma 3 switches that choose so kept 91.9-93.7 % of the context's
    benefit where the defaults kept 82.7-87.4 % (docs/benchmarks.md); a question
    about a fact stated far back reaches further (above 0.3 nats for 82-85 of 88
    that are not yes/no)."""
    tail = getattr(spec, "long_tail", 0)
    if not tail or reach > getattr(spec, "long_tail_reach", 0.0):
        return None
    return tail


def _specs(specs) -> list:
    if hasattr(specs, "spec"):  # a Translator
        return [specs.spec]
    if hasattr(specs, "recompute"):  # one spec
        return [specs]
    return [getattr(s, "spec", s) for s in specs]


@dataclass
class RecomputePlan:
    """Which positions of lo..hi-1 (the translated ones) the target recomputes, up
    to ``count``: ``lexical`` (the fact-like words, chosen from the text before the
    translation), then, ``by_question``, those the question attends to
    (:meth:`choose`, after the translation). Made before the translation so that
    it keeps the rows the recompute reads that sliding-window layers drop
    (:meth:`history`)."""

    count: int = 0
    lo: int = 1
    hi: int = 1
    lexical: List[Span] = field(default_factory=list)
    by_question: bool = False
    words: List[Span] = field(default_factory=list)  # multi-token words, to widen to
    # The positions the question may choose (None: all of lo..hi-1): a catch-up's
    # translated ones, those of earlier turns included, not the reader's own.
    allowed: Optional[List[Span]] = None

    @classmethod
    def make(cls, budget: RecomputeBudget, n: int, lo: int, hi: int, select: str,
             text: Optional[Tuple[str, Sequence[Tuple[int, int]]]] = None,
             text_from: int = 0, question: bool = True) -> "RecomputePlan":
        """The plan for an n-token context whose positions lo..hi-1 are translated.
        ``text``: (text, each token's characters) of positions text_from.. (None:
        no fact-like words); ``question``: whether a question will be read after
        the translation (without one the fact-like words take the whole budget).
        The fact-like words are chosen among the positions ``text`` covers."""
        count = min(budget.positions(n), max(hi - lo, 0))
        if not count:
            return cls()
        by_question = question and select in BY_QUESTION
        lexical, words = [], []
        if text is not None:
            share = int(count * LEXICAL_SHARE) if by_question else count
            first = max(lo, text_from) - text_from
            lexical = [(a + text_from, b + text_from) for a, b in salient_spans(
                text[0], text[1], share, first, hi - text_from)]
            if by_question and select == "question-words":
                words = [(a + text_from, b + text_from) for a, b in word_spans(
                    text[0], text[1], first, hi - text_from)]
        return cls(count, lo, hi, lexical, by_question, words)

    def history(self) -> Optional[History]:
        """The rows to keep for the recompute (None: nothing will be recomputed)."""
        if self.by_question:
            return History(since=self.lo)
        return History(since=self.lexical[0][0]) if self.lexical else None

    def choose(self, target, cache: List, tokens: Sequence[int], question_start: int,
               history: Optional[dict] = None, floor: int = 0,
               read_by_source: Optional[Callable[[int, int], np.ndarray]] = None
               ) -> List[Span]:
        """The spans to recompute, once ``cache`` holds the translation:
        ``tokens[question_start:]`` is the question (positions the cache holds are
        read again, the others after them; nothing is written). ``floor``: the
        first position the question's choice may take. ``read_by_source(lo, hi)``:
        the scores of positions lo..hi-1 as the source reads the question
        (query.source_scores), used instead of the target's reading."""
        if not self.by_question or not self.count:
            return self.lexical
        lo = max(self.lo, floor)
        hi = min(self.hi, question_start)
        if hi - lo < 1:
            return self.lexical
        if read_by_source is not None:
            scores = read_by_source(lo, hi)
        else:
            scores = question_scores(target, cache, tokens, question_start, self.lo,
                                     history)[lo - self.lo:]
        scores = self._only_allowed(np.asarray(scores, np.float32), lo, hi)
        return question_spans(scores, self.count, lo, hi, keep=self.lexical,
                              words=self.words)

    def _only_allowed(self, scores: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """``scores`` of positions lo..hi-1, those outside ``allowed`` made -inf (never
        chosen, though a chosen position's neighbour may be one of them)."""
        if self.allowed is None:
            return scores
        keep = np.zeros(len(scores), bool)
        for a, b in self.allowed:
            keep[max(a - lo, 0):max(b - lo, 0)] = True
        return np.where(keep, scores, -np.inf)


def whole_context_from(model, cache: List, history: dict) -> int:
    """The first position whose recompute reads every row before it that its
    sliding-window layers attend to: a live cache's prefill of a run longer than a
    window drops rows before they can be kept (kernel.History.record)."""
    floor = 0
    for i, (c, lg) in enumerate(zip(cache, cache_geometry(model).layers)):
        if not lg.window:
            continue
        held = history[i][0] if i in history else c.offset - min(c.offset, c.keys.shape[2])
        if held > 0:
            floor = max(floor, held + lg.window - 1)
    return floor

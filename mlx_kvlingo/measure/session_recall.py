"""Recall of a fact across the turns of a conversation that changes models.

Each recall item (``data.recall``) is cut into three pieces at word boundaries, the
fact in the first, with a third of the text after it (never in the catch-up's native
tail). Model A reads piece 1 (the fact), model B piece 2, A piece 3,
and B then reads the cue and the answer (``Session.read``, teacher-forced, plain
text). So B holds the fact only through its first catch-up's translation, and its
cache has been extended by translation again since (A's piece 3): a fact stated
early, asked for after the conversation went back and forth.

Settings, on the same items: ``session switch`` (translators; each catch-up
translates), ``session switch + recompute B`` (``Session(recompute=B)``: each
catch-up also recomputes the fact-like words it translated), ``session
re-prefill`` (no translators: each catch-up prefills the other model's text), and
``none`` (B reads only the cue). Score per item: exact match (every answer token
is B's greedy choice given the ones before it, which is what greedy decoding
would produce), the answer's NLL per token, and the seconds of B's last turn
(catch-up included).
"""

import re
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import mlx.core as mx

from ..chat.session import Session
from ..data.recall import RecallItem
from ..errors import KvlingoError
from ..metrics import nll
from .recall import NONE, RecallResult, RecallScore

SWITCHED, REPREFILL = "session switch", "session re-prefill"


def pieces(item: RecallItem) -> Tuple[str, str, str]:
    """The item's context in three pieces at word boundaries: the text after the
    (last) fact sentence is cut in thirds, and piece 1 is everything up to the end of the
    first third. So the fact is followed, in its own piece, by a third of what comes
    after it: a catch-up computes its last tokens natively (the translators' native
    tail), and a fact at the very end of its piece would never be translated."""
    text, end = item.context, max(b for _, b in item.facts)  # every fact sentence
    cuts = [m.start() for m in re.finditer(r"\s+\S", text)]
    after = [c for c in cuts if c > end]
    if len(after) < 3:
        raise KvlingoError("Too little text after the fact to cut into pieces.")
    first, second = after[len(after) // 3], after[2 * len(after) // 3]
    return text[:first], text[first:second], text[second:]


def answer_split(tokenizer, cue: str, answer: str) -> Tuple[List[int], int]:
    """(ids of cue + answer as the model reads them, how many of them are the cue)."""
    whole = tokenizer.encode(cue + answer, add_special_tokens=False)
    head = tokenizer.encode(cue, add_special_tokens=False)
    if whole[:len(head)] != head or len(whole) == len(head):
        head_len = len(whole) - len(tokenizer.encode(answer, add_special_tokens=False))
        return whole, max(head_len, 1)
    return whole, len(head)


def score_answer(answer_lp: mx.array, answer_ids: Sequence[int], tokenizer, seconds: float,
                 read: int) -> RecallScore:
    """A teacher-forced answer (``answer_lp``: the log-probabilities [n, vocab] that
    predicted its n tokens): exact when every answer token is the argmax (what greedy
    decoding would produce), with the answer's mean NLL and the argmax text."""
    guess = mx.argmax(answer_lp, axis=-1)
    target = mx.array(list(answer_ids))
    exact = bool(mx.all(guess == target).item())
    answer_nll = nll(answer_lp[None], target[None]).mean().item()
    return RecallScore(exact, answer_nll, seconds, tokenizer.decode(guess.tolist()), read)


def _timed_read(session: Session, model: str, ids: Sequence[int]):
    t0 = time.perf_counter()
    logprobs = session.read(model, ids)
    return logprobs, time.perf_counter() - t0


def run_item(make: Callable[[], Session], a: str, b: str, item: RecallItem) -> RecallScore:
    """One item through a fresh session: A, B, A read the pieces, B reads the cue and
    the answer."""
    session = make()
    p1, p2, p3 = pieces(item)
    session.read(a, p1)
    session.read(b, p2)
    session.read(a, p3)
    tokenizer = session.tokenizer_of(b)
    ids, cue_len = answer_split(tokenizer, item.cue, item.answer)
    logprobs, seconds = _timed_read(session, b, ids)  # one row per token read
    return score_answer(logprobs[cue_len:], ids[cue_len:], tokenizer, seconds,
                        session.reports[-1].context_tokens)


def cue_only(session: Session, b: str, item: RecallItem) -> RecallScore:
    """B reads nothing but the cue and the answer (its leading special tokens kept)."""
    tokenizer = session.tokenizer_of(b)
    ids, cue_len = answer_split(tokenizer, item.cue, item.answer)
    specials = tokenizer.encode("", add_special_tokens=True)
    logprobs, seconds = _timed_read(session, b, specials + ids)
    # The conversation's first read has no row for its first token (nothing precedes it).
    offset = len(specials) + cue_len - 1
    return score_answer(logprobs[offset:], ids[cue_len:], tokenizer, seconds, len(specials))


def measure_session_recall(models: Mapping[str, tuple], translators: Mapping, a: str, b: str,
                           items: Sequence[RecallItem],
                           recompute: Sequence[Optional[float]] = (),
                           break_even: Optional[int] = None,
                           log: Callable[[str], None] = print) -> RecallResult:
    """Score ``items`` (see the module docstring): ``models`` name -> (model,
    tokenizer), ``translators`` (source, target) -> Translator for both directions
    between ``a`` and ``b``. ``break_even``: also the files' defaults in a session
    whose catch-ups prefill when they would translate fewer positions
    (``Session(break_even=...)``); the other settings use none (the machine's stored
    break-even is not read, so runs compare on any machine)."""
    for pair in ((a, b), (b, a)):
        if pair not in translators:
            raise KvlingoError(f"A translator {pair[0]} -> {pair[1]} is needed.")
    settings: Dict[str, Callable[[], Session]] = {
        REPREFILL: lambda: Session(models),
        # not the files' default recompute
        SWITCHED: lambda: Session(models, translators, recompute=0.0, break_even=0),
    }
    for share in recompute:  # None: the files' own budget and selection
        if share is None:
            settings[f"{SWITCHED} + default recompute"] = (
                lambda: Session(models, translators, break_even=0))
            continue
        settings[f"{SWITCHED} + recompute {share:.0%}"] = (
            lambda share=share: Session(models, translators, recompute=share, recompute_max=0,
                                        break_even=0))
    if break_even is not None:
        settings[f"{SWITCHED} + default recompute, break-even {break_even}"] = (
            lambda: Session(models, translators, break_even=break_even))
    scores: Dict[str, List[RecallScore]] = {name: [] for name in settings}
    scores[NONE] = []
    for i, item in enumerate(items):
        for name, make in settings.items():
            scores[name].append(run_item(make, a, b, item))
        scores[NONE].append(cue_only(Session(models), b, item))
        log(f"  item {i + 1}/{len(items)} ({item.kind}): "
            + ", ".join(f"{k} {'+' if v[-1].exact else '-'}" for k, v in scores.items()))
    return RecallResult(a, b, list(items), scores, None,
                        {"protocol": "A reads the fact's piece, B the next, A the next, B the "
                                     "cue and the answer (teacher-forced)"})

"""Multi-turn fidelity: how much context a model keeps over alternating turns.

A conversation is a list of segments: token ids (models that share a tokenizer)
or text (any pair; each model reads its own tokenization). Segment 0 is written by
one model; then the two models take turns, each *reading* the next segment as its
own turn (teacher forcing, through :meth:`Session.read`): before reading, the
model translates the segments the other model wrote since its last turn and
appends them to its own cache (the "retained span" rule). At every turn the
model's log-probabilities for its segment are compared with those it gives from
a native prefill of the identical transcript, and with no context at all (only
the previous token): NLLs, context benefit retained (CBR), KL(native ‖ session)
and top-1 agreement, per turn.
"""

from dataclasses import asdict, dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from ..chat.session import Session
from ..chat.transcript import leading_specials
from ..metrics import cbr, kl, nll
from ..models.cache import prefill
from ..translator.maps import Translator
from .evaluate import MIN_CONTEXT_BENEFIT, continuation_logprobs


@dataclass
class TurnFidelity:
    turn: int
    model: str
    context_tokens: float = 0.0  # mean transcript length before the turn
    translated_tokens: float = 0.0  # mean positions of the model's cache that were translated
    tokens: int = 0  # segment tokens scored (all conversations)
    nll_native: float = 0.0
    nll_session: float = 0.0
    nll_none: float = 0.0
    kl: float = 0.0
    top1: float = 0.0
    conversations: int = 0
    fallbacks: int = 0  # conversations where the quality gate re-prefilled this turn

    @property
    def context_benefit(self) -> float:
        return self.nll_none - self.nll_native

    @property
    def cbr(self) -> float:
        return cbr(self.nll_none, self.nll_session, self.nll_native)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(cbr=self.cbr, context_benefit=self.context_benefit,
                 cbr_meaningful=self.context_benefit >= MIN_CONTEXT_BENEFIT)
        return d


@dataclass
class _Sums:
    context: float = 0.0
    translated: float = 0.0
    native: float = 0.0
    session: float = 0.0
    none: float = 0.0
    kl: float = 0.0
    top1: float = 0.0
    fallbacks: int = 0
    tokens: int = 0
    conversations: int = 0


def run_conversation(
    models: Mapping[str, Tuple[nn.Module, object]],
    translators: Mapping[Tuple[str, str], Translator],
    segments: Sequence[Union[str, Sequence[int]]],
    order: Sequence[str],
    gate=None,
) -> List[dict]:
    """Play one conversation: segment 0 read by ``order[0]``, segment i by
    ``order[i]``. Returns per-turn sums (turns 1..) comparing the session's
    log-probs with a native prefill of the model's own view of the transcript and
    with no context (the view's leading special tokens, e.g. BOS, kept)."""
    # The translation alone, as calibrated and reported: not the files' default recompute.
    # Every catch-up translated, whatever its length: the translation is what is measured.
    session = Session(models, translators, chat_template=False, gate=gate, recompute=0.0,
                      break_even=0)
    session.read(order[0], segments[0])
    out = []
    for i in range(1, len(segments)):
        name = order[i]
        model = models[name][0]
        view = session.transcript_of(name)
        before = len(view)
        got = session.read(name, segments[i])[None]
        report = session.reports[-1]
        context = mx.array(view.tokens[:before])[None]
        seg = mx.array(view.tokens[before:])[None]
        specials = leading_specials(view)
        native = continuation_logprobs(model, context, seg, prefill(model, context[:, :-1]))
        none_cache = prefill(model, context[:, :specials]) if specials else None
        none = continuation_logprobs(model, context, seg, none_cache)
        step = dict(
            native=nll(native, seg).sum(), session=nll(got, seg).sum(),
            none=nll(none, seg).sum(),
            kl=kl(native, got).sum(),
            top1=(native.argmax(-1) == got.argmax(-1)).sum(),
        )
        mx.eval(step)
        d = {k: v.item() for k, v in step.items()}
        d.update(turn=i, model=name, context=context.shape[1], tokens=seg.size,
                 translated=view.translated[name], gate=report.gate,
                 fallback=report.fallback)
        out.append(d)
    return out


def multiturn_fidelity(
    models: Mapping[str, Tuple[nn.Module, object]],
    translators: Mapping[Tuple[str, str], Translator],
    conversations: Sequence[Sequence[Union[str, Sequence[int]]]],
    starts: Optional[Sequence[str]] = None,
    gate=None,
) -> Dict[str, List[TurnFidelity]]:
    """For each starting model (default: each of two models), play every
    conversation with the two models alternating, the starting model taking turn
    1 (segment 0 is written by the other one); average per turn."""
    names = list(models)
    if len(names) != 2:
        raise ValueError("multiturn_fidelity alternates exactly two models.")
    results = {}
    for start in starts or names:
        other = names[1] if start == names[0] else names[0]
        sums: Dict[int, _Sums] = {}
        who: Dict[int, str] = {}
        for segments in conversations:
            order = [other if i % 2 == 0 else start for i in range(len(segments))]
            for d in run_conversation(models, translators, segments, order, gate):
                s = sums.setdefault(d["turn"], _Sums())
                who[d["turn"]] = d["model"]
                s.context += d["context"]
                s.translated += d["translated"]
                s.native += d["native"]
                s.session += d["session"]
                s.none += d["none"]
                s.kl += d["kl"]
                s.top1 += d["top1"]
                s.fallbacks += d["fallback"] is not None
                s.tokens += d["tokens"]
                s.conversations += 1
        rows = []
        for turn in sorted(sums):
            s = sums[turn]
            n, c = s.tokens, s.conversations
            rows.append(TurnFidelity(
                turn=turn, model=who[turn], context_tokens=s.context / c,
                translated_tokens=s.translated / c, tokens=n,
                nll_native=s.native / n, nll_session=s.session / n, nll_none=s.none / n,
                kl=s.kl / n, top1=s.top1 / n, conversations=c, fallbacks=s.fallbacks,
            ))
        results[start] = rows
    return results


def conversations_from_stream(
    documents: Sequence[Sequence[int]], turns: int, segment_len: int, count: int
) -> List[List[List[int]]]:
    """Up to ``count`` conversations of ``turns + 1`` consecutive segments of
    ``segment_len`` tokens, each from one document long enough for it."""
    need = (turns + 1) * segment_len
    out = []
    for doc in documents:
        if len(doc) >= need:
            out.append([list(doc[i * segment_len:(i + 1) * segment_len]) for i in range(turns + 1)])
            if len(out) == count:
                break
    return out


def text_conversations(
    documents: Sequence[str], turns: int, segment_chars: int, count: int
) -> List[List[str]]:
    """Up to ``count`` conversations of ``turns + 1`` consecutive text segments of
    about ``segment_chars`` characters (cut at spaces), each from one document
    long enough for it: segments any pair of models can read."""
    out = []
    for doc in documents:
        segments, at = [], 0
        while len(segments) < turns + 1:
            cut = doc.find(" ", at + segment_chars)
            if cut < 0:
                break
            segments.append(doc[at:cut])
            at = cut
        if len(segments) == turns + 1:
            out.append(segments)
            if len(out) == count:
                break
    return out


def format_markdown(results: Dict[str, List[TurnFidelity]], title: str = "") -> str:
    """Markdown tables, one per starting model."""
    lines = [f"# {title}", ""] if title else []
    for start, rows in results.items():
        lines += [f"## {start} takes turn 1", "",
                  "| turn | model | context | translated in its cache | NLL native | NLL session "
                  "| NLL none | CBR | KL | top-1 |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            flag = "" if r.context_benefit >= MIN_CONTEXT_BENEFIT else "*"
            lines.append(
                f"| {r.turn} | {r.model} | {r.context_tokens:.0f} | {r.translated_tokens:.0f} "
                f"| {r.nll_native:.3f} | {r.nll_session:.3f} | {r.nll_none:.3f} "
                f"| {r.cbr:.1%}{flag} | {r.kl:.3f} | {r.top1:.1%} |"
            )
        lines.append("")
    if any(r.context_benefit < MIN_CONTEXT_BENEFIT for rows in results.values() for r in rows):
        lines.append(f"\\* context benefit below {MIN_CONTEXT_BENEFIT} nats/token: CBR is noisy there.")
    return "\n".join(lines)

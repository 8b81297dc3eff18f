"""Stateless chat requests onto stateful conversations: the store and the router
behind ``mlx-kvlingo serve`` (no sockets here; ``cli/serve_cmd.py`` is the HTTP
layer).

Chat clients resend the whole message list with every request. The store keeps
one :class:`~mlx_kvlingo.chat.session.Session` per conversation, each model with its
own cache of it, and recognises a request's conversation by the longest stored
message prefix:

- the request extends a stored conversation: only the new messages are read;
- it diverges inside one (an edited or regenerated message): that conversation
  is truncated there (:meth:`Session.truncate`) and continues from it;
- nothing matches: a new conversation.

Conversations are evicted least recently used first, beyond a count and a byte
budget (the bytes their caches hold).

Routing: a request names a model, or ``auto``. When the named model is not the
one that wrote the conversation's latest spans, its session translates them
instead of re-prefilling (that is what a Session does). ``auto`` starts every
turn on the small model; after its first ``probe_tokens`` answer tokens (not yet
sent to the client) it escalates to the large model when their mean entropy
exceeds ``max_entropy`` nats — the small model is unsure — discarding the
small model's probe; the large model then reads the new messages itself and the
conversation before them translated (:func:`escalate`).
"""

import itertools
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..chat.session import Session
from ..errors import KvlingoError

Message = Dict[str, str]
AUTO = "auto"


class UnknownModel(KvlingoError):
    """The request names a model the server was not started with."""


@dataclass
class AutoRoute:
    """``auto``: answer with ``small`` unless the mean entropy of its first
    ``probe_tokens`` answer tokens exceeds ``max_entropy`` (nats); then ``large``."""

    small: str
    large: str
    probe_tokens: int = 8
    max_entropy: float = 2.5


@dataclass
class TurnRequest:
    model: str  # a configured name or "auto"
    messages: List[Message]
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: Sequence[str] = ()


@dataclass
class TurnStats:
    """What one request cost; goes into the reply's ``kvlingo`` field."""

    conversation: int
    model: str
    route: dict = field(default_factory=dict)
    context_tokens: int = 0  # the model's tokens before its answer (prompt_tokens)
    cached_tokens: int = 0  # of them, already in the model's own cache
    translated_tokens: int = 0
    prefilled_tokens: int = 0
    native_tail: int = 0  # of the prefilled: the last context positions computed over the translation
    generated_tokens: int = 0
    translate_ms: float = 0.0
    ttft_ms: Optional[float] = None
    total_ms: float = 0.0
    finish_reason: Optional[str] = None
    truncated_messages: int = 0  # stored messages dropped (edit / regenerate)
    fallback: Optional[str] = None
    gate: Optional[dict] = None
    warnings: List[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.context_tokens,
            "completion_tokens": self.generated_tokens,
            "total_tokens": self.context_tokens + self.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass
class _Conversation:
    id: int
    session: Session


def common_prefix(stored: Sequence[Message], request: Sequence[Message]) -> int:
    """How many leading messages agree (role, and content up to surrounding
    whitespace, which some clients strip)."""
    n = 0
    for a, b in zip(stored, request):
        if a["role"] != b["role"] or a["content"].strip() != b["content"].strip():
            break
        n += 1
    return n


class ConversationStore:
    """Conversations over ``base``'s models and translators (``base`` itself is
    never used for a conversation; each one is ``base.fresh()``).

    Not thread-safe: one worker thread calls :meth:`run` (the server's engine).
    """

    def __init__(self, base: Session, max_conversations: int = 32,
                 max_bytes: int = 4 << 30, auto: Optional[AutoRoute] = None):
        if max_conversations < 1:
            raise KvlingoError("max_conversations must be at least 1.")
        if auto is not None:
            for name in (auto.small, auto.large):
                base.model(name)
        self.base = base
        self.max_conversations = max_conversations
        self.max_bytes = max_bytes
        self.auto = auto
        self._conversations: "OrderedDict[int, _Conversation]" = OrderedDict()
        self._ids = itertools.count(1)
        self.evicted = 0

    @property
    def model_names(self) -> List[str]:
        return self.base.model_names + ([AUTO] if self.auto else [])

    def __len__(self) -> int:
        return len(self._conversations)

    def nbytes(self) -> int:
        return sum(c.session.nbytes() for c in self._conversations.values())

    def check_model(self, name: str):
        if name not in self.model_names:
            raise UnknownModel(
                f"The model {name!r} does not exist; models: {', '.join(self.model_names)}."
            )

    # -- finding the conversation -------------------------------------------

    def match(self, messages: Sequence[Message]) -> Tuple[Optional[_Conversation], int]:
        """The stored conversation sharing the longest message prefix with
        ``messages`` (most recently used first among equals), and that length."""
        best, best_n = None, 0
        for conv in reversed(self._conversations.values()):
            n = common_prefix(conv.session.messages, messages)
            if n > best_n:
                best, best_n = conv, n
        return best, best_n

    def _open(self, messages: Sequence[Message]) -> Tuple[_Conversation, int]:
        conv, n = self.match(messages)
        if conv is None:
            conv = _Conversation(next(self._ids), self.base.fresh())
            self._conversations[conv.id] = conv
            return conv, 0
        dropped = len(conv.session.messages) - n
        if dropped > 0:
            conv.session.truncate(n)
        self._conversations.move_to_end(conv.id)
        return conv, dropped

    def _evict(self, keep: int):
        while len(self._conversations) > self.max_conversations or (
            len(self._conversations) > 1 and self.nbytes() > self.max_bytes
        ):
            oldest = next(iter(self._conversations))
            if oldest == keep:
                break
            del self._conversations[oldest]
            self.evicted += 1

    def conversation_messages(self, conversation: int) -> List[Message]:
        """The stored messages of a conversation (for tests and inspection)."""
        return [dict(m) for m in self._conversations[conversation].session.messages]

    # -- a turn ----------------------------------------------------------------

    def run(self, request: TurnRequest,
            cancelled: Callable[[], bool] = lambda: False) -> Iterator[tuple]:
        """Answer ``request``: yields ``("start", TurnStats)`` once the answering model
        is settled (before its first text), ``("delta", text)`` pieces, and finally
        ``("done", TurnStats)``. Stops early when ``cancelled()`` turns true (the
        tokens so far stay in the conversation)."""
        self.check_model(request.model)
        if not request.messages:
            raise KvlingoError("messages must not be empty.")
        t0 = time.perf_counter()
        conv, dropped = self._open(request.messages)
        session = conv.session
        new = [dict(m) for m in request.messages[len(session.messages):]]
        kwargs = _sampling(request)
        route = {"requested": request.model}
        if request.model == AUTO:
            name, stream, buffered, probe = self._auto(session, new, request, kwargs)
            route.update(probe)
        else:
            name, buffered = request.model, []
            cached = session.transcript_of(name).processed[name]
            stream = session.generate(name, new or None, request.max_tokens, stream=True,
                                      **kwargs)
        route["model"] = name
        if request.model != AUTO:
            route["cached"] = cached
        stats = TurnStats(conversation=conv.id, model=name, route=route,
                          truncated_messages=dropped)
        hold = max((len(x) for x in request.stop if x), default=1) - 1
        text, sent, first = "", 0, True
        try:
            for piece in _responses(buffered, stream):
                if first:
                    self._fill(stats, stream.report, route)
                    yield "start", stats
                    first = False
                text += piece
                cut = _stop_at(text, request.stop)
                # Hold back what could be the start of a stop string.
                end = cut if cut is not None else max(sent, len(text) - hold)
                if end > sent:
                    if stats.ttft_ms is None:
                        stats.ttft_ms = round((time.perf_counter() - t0) * 1e3, 2)
                    yield "delta", text[sent:end]
                    sent = end
                if cut is not None:
                    stats.finish_reason = "stop"
                    break
                if cancelled():
                    stats.finish_reason = "cancelled"
                    break
            else:
                if len(text) > sent:
                    yield "delta", text[sent:]
        finally:
            stream.close()
        report = stream.report
        self._fill(stats, report, route)
        if first:
            yield "start", stats
        stats.finish_reason = stats.finish_reason or report.finish_reason or "length"
        stats.total_ms = (time.perf_counter() - t0) * 1e3
        self._evict(keep=conv.id)
        yield "done", stats

    @staticmethod
    def _fill(stats: TurnStats, report, route: dict):
        stats.context_tokens = report.context_tokens
        stats.cached_tokens = route.get("cached", 0)
        stats.translated_tokens = report.translated
        stats.prefilled_tokens = report.prefilled
        stats.native_tail = report.native_tail
        stats.generated_tokens = report.generated
        stats.translate_ms = round(report.translate_s * 1e3, 2)
        stats.fallback = report.fallback
        stats.gate = report.gate
        stats.warnings = list(report.warnings)

    def _auto(self, session: Session, new, request: TurnRequest, kwargs):
        """The small model answers; after ``probe_tokens`` tokens, escalate when it is
        unsure. Returns (model, stream, buffered texts, route info)."""
        rule = self.auto
        small, large = rule.small, rule.large
        cached = session.transcript_of(small).processed[small]
        stream = session.generate(small, new or None, request.max_tokens, stream=True,
                                  **kwargs)
        buffered, entropies = [], []
        t0 = time.perf_counter()
        for r in stream:
            buffered.append(r.text)
            lp = r.logprobs.astype(mx.float32)
            entropies.append(-(mx.exp(lp) * lp).sum().item())
            if len(entropies) >= rule.probe_tokens or r.finish_reason:
                break
        entropy = sum(entropies) / max(len(entropies), 1)
        info = {"rule": f"mean entropy of the first {rule.probe_tokens} tokens of {small} "
                        f"> {rule.max_entropy} nats -> {large}",
                "entropy": round(entropy, 3), "probe_tokens": len(entropies),
                "probe_ms": round((time.perf_counter() - t0) * 1e3, 2)}
        done = stream.report.finish_reason is not None and len(entropies) < rule.probe_tokens
        if entropy <= rule.max_entropy or done:
            info.update(escalated=False, cached=cached)
            return small, stream, buffered, info
        stream.close()
        info.update(escalated=True)
        stream = escalate(session, large, new, request.max_tokens, kwargs, info)
        return large, stream, [], info


def escalate(session: Session, large: str, new: list, max_tokens: int, kwargs: dict,
             info: Optional[dict] = None):
    """Hand a turn the small model began over to ``large``: the small model's answer
    (its probe) and the turn's new messages are dropped, and ``large`` answers them,
    reading the new messages itself (a stream). What a hard turn asks is read
    exactly; the conversation before it is translated from the small model's cache.
    A translated question loses its small facts (a list's values, a name: Qwen2.5-Coder
    0.5B -> 1.5B on coding questions, 2 of 36 right against 11 when the 1.5B read the
    question), and a message costs little to read next to the conversation before it.
    ``info``: gets ``cached``, the positions ``large`` already held."""
    session.truncate(len(session.messages) - 1 - len(new))
    if info is not None:
        info["cached"] = session.transcript_of(large).processed[large]
    return session.generate(large, new or None, max_tokens, stream=True, **kwargs)


def _responses(buffered: List[str], stream) -> Iterator[str]:
    yield from buffered
    for r in stream:
        yield r.text


def _stop_at(text: str, stops: Sequence[str]) -> Optional[int]:
    cuts = [text.find(s) for s in stops if s]
    cuts = [c for c in cuts if c >= 0]
    return min(cuts) if cuts else None


def _sampling(request: TurnRequest) -> dict:
    if request.temperature and request.temperature > 0:
        from mlx_lm.sample_utils import make_sampler

        if request.seed is not None:
            mx.random.seed(request.seed)
        top_p = request.top_p if 0 < request.top_p < 1 else 0.0
        return {"sampler": make_sampler(request.temperature, top_p)}
    return {}

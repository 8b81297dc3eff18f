"""Stateless chat requests onto stateful conversations: the store and the router
behind ``mlx-kvlingo serve`` (no sockets here; :mod:`.server` is the HTTP layer).

Chat clients resend the whole message list with every request. The store keeps
one :class:`~mlx_kvlingo.chat.session.Session` per conversation, each model with its
own cache of it, and finds a request's conversation in a trie over message
prefixes (:class:`MessageTrie`, as mlx-lm's server keeps prompt caches in a trie
over token prefixes):

- the request extends a stored conversation: only the new messages are read;
- it shares only a prefix with one (an edited or regenerated message, or another
  chat with the same system prompt): it continues from a copy of that prefix
  (:meth:`Session.branch`); the stored conversation stays whole, so a chat that
  comes back to it reuses its whole cache;
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

Cache accounting: ``cached_tokens`` (the reply's ``usage``) counts only positions
of the answering model's cache that it computed itself; positions it holds
translated are ``cached_translated_tokens`` in the reply's ``kvlingo`` stats.
"""

import itertools
import json
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import mlx.core as mx

from ..chat.session import Session
from ..errors import KvlingoError

Message = Dict[str, object]
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
class Sampling:
    """How tokens are picked: mlx-lm's ``make_sampler`` and ``make_logits_processors``
    arguments, as ``mlx_lm.server`` takes them from a request."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    repetition_penalty: Optional[float] = None
    repetition_context_size: int = 20
    presence_penalty: Optional[float] = None
    presence_context_size: int = 20
    frequency_penalty: Optional[float] = None
    frequency_context_size: int = 20
    logit_bias: Optional[Dict[int, float]] = None
    seed: Optional[int] = None

    def generate_kwargs(self, tokenizer) -> dict:
        """``sampler`` and ``logits_processors`` for ``stream_generate``."""
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        if self.seed is not None:
            mx.random.seed(self.seed)
        sampler = make_sampler(
            self.temperature, top_p=self.top_p if 0 < self.top_p < 1 else 0.0,
            min_p=self.min_p, top_k=self.top_k, xtc_probability=self.xtc_probability,
            xtc_threshold=self.xtc_threshold,
            xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids))
        processors = make_logits_processors(
            self.logit_bias, self.repetition_penalty, self.repetition_context_size,
            self.presence_penalty, self.presence_context_size, self.frequency_penalty,
            self.frequency_context_size)
        return {"sampler": sampler, "logits_processors": processors}


@dataclass
class TurnRequest:
    model: str  # a configured name or "auto"
    messages: List[Message]
    max_tokens: int = 256
    sampling: Sampling = field(default_factory=Sampling)
    stop: Sequence[str] = ()
    logprobs: bool = False
    top_logprobs: int = 0  # > 0: that many most likely tokens per position
    tools: Optional[list] = None  # OpenAI function specs, for the chat template


@dataclass
class CompletionRequest:
    """A ``/v1/completions`` request: a plain prompt, no conversation."""

    model: str
    prompt: str
    max_tokens: int = 256
    sampling: Sampling = field(default_factory=Sampling)
    stop: Sequence[str] = ()
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass
class TurnStats:
    """What one request cost; goes into the reply's ``kvlingo`` field."""

    conversation: int
    model: str
    route: dict = field(default_factory=dict)
    context_tokens: int = 0  # the model's tokens before its answer (prompt_tokens)
    cached_tokens: int = 0  # of them, in the model's cache and computed by it (exact)
    cached_translated_tokens: int = 0  # of them, in the model's cache but translated
    translated_tokens: int = 0  # translated by this request
    prefilled_tokens: int = 0
    native_tail: int = 0  # of the prefilled: the last context positions computed over the translation
    generated_tokens: int = 0
    translate_ms: float = 0.0
    ttft_ms: Optional[float] = None
    total_ms: float = 0.0
    finish_reason: Optional[str] = None
    branched_from: Optional[int] = None  # the stored conversation this one copied a prefix of
    shared_messages: int = 0  # messages of the request found stored
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


def message_key(m: Message) -> tuple:
    """What makes two messages the same: role, content up to surrounding
    whitespace (some clients strip it), and any other fields (tool calls)."""
    rest = {k: v for k, v in m.items() if k not in ("role", "content")}
    content = m.get("content") or ""
    return (m["role"], content.strip() if isinstance(content, str) else json.dumps(content),
            json.dumps(rest, sort_keys=True, default=str) if rest else "")


def conversation_keys(tools: Optional[list], messages: Sequence[Message]) -> List[tuple]:
    """A conversation's path in the trie: its tools (they come first in a chat
    template's rendering), then its messages."""
    return [("tools", json.dumps(tools or None, sort_keys=True))] + [message_key(m) for m in messages]


def common_prefix(stored: Sequence[Message], request: Sequence[Message]) -> int:
    """How many leading messages agree (:func:`message_key`)."""
    n = 0
    for a, b in zip(stored, request):
        if message_key(a) != message_key(b):
            break
        n += 1
    return n


class _Node:
    __slots__ = ("children", "through")

    def __init__(self):
        self.children: Dict[tuple, "_Node"] = {}
        self.through: Set[int] = set()  # conversations whose path passes here


class MessageTrie:
    """Conversation ids by their paths (:func:`conversation_keys`): the
    conversations sharing the longest prefix with a request are one walk away."""

    def __init__(self):
        self._root = _Node()
        self._paths: Dict[int, List[tuple]] = {}

    def put(self, conversation: int, keys: Sequence[tuple]):
        self.remove(conversation)
        node = self._root
        for k in keys:
            node = node.children.setdefault(k, _Node())
            node.through.add(conversation)
        self._paths[conversation] = list(keys)

    def remove(self, conversation: int):
        keys = self._paths.pop(conversation, None)
        node = self._root
        for k in keys or ():
            child = node.children[k]
            child.through.discard(conversation)
            if not child.through:
                del node.children[k]  # nothing else below: drop the branch
                return
            node = child

    def longest(self, keys: Sequence[tuple]) -> Tuple[Set[int], int]:
        """The conversations sharing the longest prefix of ``keys``, and its length
        (0 and none when not even the first key matches)."""
        node, depth = self._root, 0
        for k in keys:
            child = node.children.get(k)
            if child is None:
                break
            node, depth = child, depth + 1
        return (set(node.through) if depth else set()), depth


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
        self._trie = MessageTrie()
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

    def tools_supported(self) -> bool:
        """Whether every model renders with a chat template (tools need one)."""
        return all(self.base.transcript_of(n).uses_template() for n in self.base.model_names)

    # -- finding the conversation -------------------------------------------

    def match(self, messages: Sequence[Message],
              tools: Optional[list] = None) -> Tuple[Optional[_Conversation], int]:
        """The stored conversation sharing the longest message prefix with
        ``messages`` (the most recently used among equals), and that length."""
        ids, depth = self._trie.longest(conversation_keys(tools, messages))
        if depth <= 1:  # at most the tools agree
            return None, 0
        for conv in reversed(self._conversations.values()):
            if conv.id in ids:
                return conv, depth - 1
        return None, 0

    def _open(self, request: TurnRequest) -> Tuple[_Conversation, Optional[int], int]:
        """(conversation, the one it branched from or None, messages shared)."""
        conv, n = self.match(request.messages, request.tools)
        if conv is not None and n == len(conv.session.messages):
            self._conversations.move_to_end(conv.id)
            return conv, None, n
        if conv is None:
            session = self.base.fresh()
            session.set_tools(request.tools)
        else:
            session = conv.session.branch(n)
        new = _Conversation(next(self._ids), session)
        self._conversations[new.id] = new
        return new, (conv.id if conv is not None else None), n

    def _remember(self, conv: _Conversation):
        tools = conv.session.transcript.template_kwargs.get("tools")
        self._trie.put(conv.id, conversation_keys(tools, conv.session.messages))

    def _evict(self, keep: int):
        while len(self._conversations) > self.max_conversations or (
            len(self._conversations) > 1 and self.nbytes() > self.max_bytes
        ):
            oldest = next(iter(self._conversations))
            if oldest == keep:
                break
            del self._conversations[oldest]
            self._trie.remove(oldest)
            self.evicted += 1

    def conversation_messages(self, conversation: int) -> List[Message]:
        """The stored messages of a conversation (for tests and inspection)."""
        return [dict(m) for m in self._conversations[conversation].session.messages]

    def session_of(self, conversation: int) -> Session:
        """A stored conversation's session (for tests and inspection)."""
        return self._conversations[conversation].session

    # -- a turn ----------------------------------------------------------------

    def run(self, request: TurnRequest,
            cancelled: Callable[[], bool] = lambda: False) -> Iterator[tuple]:
        """Answer ``request``. Yields ``("start", TurnStats)`` once the answering model
        is settled (before its first text), ``("delta", text)`` pieces, then
        ``("tool_calls", [...])`` and ``("logprobs", [...])`` when there are any, and
        finally ``("done", TurnStats)``. Stops early when ``cancelled()`` turns true
        (the tokens so far stay in the conversation)."""
        self.check_model(request.model)
        if not request.messages:
            raise KvlingoError("messages must not be empty.")
        if request.tools and not self.tools_supported():
            raise KvlingoError("tools need a chat template, and a model here has none.")
        t0 = time.perf_counter()
        conv, branched_from, shared = self._open(request)
        session = conv.session
        new = [dict(m) for m in request.messages[len(session.messages):]]
        route = {"requested": request.model}
        if request.model == AUTO:
            name, stream, buffered, probe = self._auto(session, new, request)
            route.update(probe)
        else:
            name, buffered = request.model, []
            route.update(_cache_split(session, name))
            stream = session.generate(name, new or None, request.max_tokens, stream=True,
                                      **_kwargs(session, name, request))
        route["model"] = name
        stats = TurnStats(conversation=conv.id, model=name, route=route,
                          branched_from=branched_from, shared_messages=shared)
        tokenizer = session.tokenizer_of(name)
        answer = _Answer(request, tokenizer)
        try:
            for event in _answer_events(answer, _responses(buffered, stream), stats,
                                        lambda: self._fill(stats, stream.report, route),
                                        cancelled, t0):
                yield event
        finally:
            stream.close()
            self._fill(stats, stream.report, route)
            if answer.stopped_at is not None and session.messages[-1]["role"] == "assistant":
                session.cut_answer(answer.text[:answer.stopped_at])
            self._remember(conv)
            self._evict(keep=conv.id)
        stats.finish_reason = stats.finish_reason or stream.report.finish_reason or "length"
        yield from answer.closing_events(stats)
        stats.total_ms = (time.perf_counter() - t0) * 1e3
        yield "done", stats

    def complete(self, request: CompletionRequest,
                 cancelled: Callable[[], bool] = lambda: False) -> Iterator[tuple]:
        """A plain-prompt completion (``/v1/completions``) on a fresh cache: the same
        events as :meth:`run`. No conversation is stored; nothing is translated."""
        from mlx_lm.generate import stream_generate
        from mlx_lm.models.cache import make_prompt_cache

        if request.model not in self.base.model_names:
            raise UnknownModel(f"The model {request.model!r} does not exist; models: "
                               f"{', '.join(self.base.model_names)}.")
        t0 = time.perf_counter()
        model, tokenizer = self.base.model(request.model), self.base.tokenizer_of(request.model)
        prompt = tokenizer.encode(request.prompt)
        if not prompt:
            raise KvlingoError("The prompt is empty.")
        stats = TurnStats(conversation=0, model=request.model,
                          route={"requested": request.model, "model": request.model},
                          context_tokens=len(prompt), prefilled_tokens=len(prompt))
        responses = stream_generate(
            model, tokenizer, mx.array(prompt), max_tokens=request.max_tokens,
            prompt_cache=make_prompt_cache(model),
            **request.sampling.generate_kwargs(tokenizer))
        answer = _Answer(request, tokenizer)

        def counted():
            for r in responses:
                stats.generated_tokens += 1
                stats.finish_reason = r.finish_reason
                yield r

        try:
            yield from _answer_events(answer, counted(), stats, lambda: None, cancelled, t0)
        finally:
            responses.close()
        stats.finish_reason = stats.finish_reason or "length"
        yield from answer.closing_events(stats)
        stats.total_ms = (time.perf_counter() - t0) * 1e3
        yield "done", stats

    @staticmethod
    def _fill(stats: TurnStats, report, route: dict):
        stats.context_tokens = report.context_tokens
        stats.cached_tokens = route.get("cached", 0)
        stats.cached_translated_tokens = route.get("cached_translated", 0)
        stats.translated_tokens = report.translated
        stats.prefilled_tokens = report.prefilled
        stats.native_tail = report.native_tail
        stats.generated_tokens = report.generated
        stats.translate_ms = round(report.translate_s * 1e3, 2)
        stats.fallback = report.fallback
        stats.gate = report.gate
        stats.warnings = list(report.warnings)

    def _auto(self, session: Session, new, request: TurnRequest):
        """The small model answers; after ``probe_tokens`` tokens, escalate when it is
        unsure. Returns (model, stream, buffered responses, route info)."""
        rule = self.auto
        small, large = rule.small, rule.large
        cached = _cache_split(session, small)
        stream = session.generate(small, new or None, request.max_tokens, stream=True,
                                  **_kwargs(session, small, request))
        buffered, entropies = [], []
        t0 = time.perf_counter()
        for r in stream:
            buffered.append(r)
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
            info.update(escalated=False, **cached)
            return small, stream, buffered, info
        stream.close()
        info.update(escalated=True)
        stream = escalate(session, large, new, request.max_tokens,
                          _kwargs(session, large, request), info)
        return large, stream, [], info


def _cache_split(session: Session, name: str) -> dict:
    """Positions ``name``'s cache holds now: computed by it, and translated."""
    view = session.transcript_of(name)
    own = view.own_positions(name)
    return {"cached": own, "cached_translated": view.processed[name] - own}


def _kwargs(session: Session, name: str, request: TurnRequest) -> dict:
    return request.sampling.generate_kwargs(session.tokenizer_of(name))


def escalate(session: Session, large: str, new: list, max_tokens: int, kwargs: dict,
             info: Optional[dict] = None):
    """Hand a turn the small model began over to ``large``: the small model's answer
    (its probe) and the turn's new messages are dropped, and ``large`` answers them,
    reading the new messages itself (a stream). What a hard turn asks is read
    exactly; the conversation before it is translated from the small model's cache.
    A translated question loses its small facts (a list's values, a name: Qwen2.5-Coder
    0.5B -> 1.5B on coding questions, 2 of 36 right against 11 when the 1.5B read the
    question), and a message costs little to read next to the conversation before it.
    ``info``: gets ``cached`` and ``cached_translated``, the positions ``large``
    already held, computed by itself and translated."""
    session.truncate(len(session.messages) - 1 - len(new))
    if info is not None:
        info.update(_cache_split(session, large))
    return session.generate(large, new or None, max_tokens, stream=True, **kwargs)


def _responses(buffered: list, stream) -> Iterator:
    yield from buffered
    yield from stream


class _Answer:
    """An answer's text as it streams: what may be sent yet (held back: what could
    be the start of a stop string or of a tool call), where a stop string cut it,
    its tool calls, and its tokens' log-probabilities."""

    def __init__(self, request, tokenizer):
        self.stops = [s for s in request.stop if s]
        self.tokenizer = tokenizer
        self.tools = getattr(request, "tools", None)
        self.tool_start = (getattr(tokenizer, "tool_call_start", None)
                           if self.tools and getattr(tokenizer, "has_tool_calling", False)
                           else None)
        self.want_logprobs = request.logprobs or request.top_logprobs > 0
        self.top_logprobs = request.top_logprobs
        self.text, self.sent = "", 0
        self.stopped_at: Optional[int] = None
        self.logprobs: List[dict] = []

    def add(self, response):
        self.text += response.text
        if self.want_logprobs:
            self.logprobs.append(token_logprobs(response, self.top_logprobs, self.tokenizer))
        self.stopped_at = _stop_at(self.text, self.stops)

    def sendable(self, final: bool = False) -> str:
        """The text that may go to the client now (and marks it sent)."""
        end = len(self.text) if self.stopped_at is None else self.stopped_at
        if not final and self.stopped_at is None:
            hold = max([len(s) for s in self.stops] + [1]) - 1
            end = max(self.sent, end - hold)
        if self.tool_start:
            i = self.text.find(self.tool_start)
            if i >= 0:
                end = min(end, i)
            elif not final:
                end = min(end, max(self.sent, len(self.text) - len(self.tool_start) + 1))
        out = self.text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out

    def closing_events(self, stats: TurnStats) -> Iterator[tuple]:
        """After the last token: the rest of the content, tool calls, logprobs."""
        calls = []
        if self.tool_start:
            content, calls = split_tool_calls(self.text[:self.stopped_at], self.tokenizer,
                                              self.tools)
            rest = content[self.sent:] if content.startswith(self.text[:self.sent]) else ""
            if rest:
                yield "delta", rest
            if calls:
                stats.finish_reason = "tool_calls"
                yield "tool_calls", calls
        if self.want_logprobs:
            yield "logprobs", self.logprobs


def _answer_events(answer: _Answer, responses, stats: TurnStats, on_start, cancelled, t0):
    first = True
    for r in responses:
        if first:
            on_start()
            yield "start", stats
            first = False
        answer.add(r)
        piece = answer.sendable()
        if piece:
            if stats.ttft_ms is None:
                stats.ttft_ms = round((time.perf_counter() - t0) * 1e3, 2)
            yield "delta", piece
        if answer.stopped_at is not None:
            stats.finish_reason = "stop"
            break
        if cancelled():
            stats.finish_reason = "cancelled"
            break
    if first:
        on_start()
        yield "start", stats
    if stats.finish_reason != "cancelled":
        piece = answer.sendable(final=True)
        if piece:
            yield "delta", piece


def token_logprobs(response, top: int, tokenizer) -> dict:
    """One generated token's log-probability (and its ``top`` most likely
    alternatives), in OpenAI's shape with mlx-lm's ``id`` too."""
    lp = response.logprobs.astype(mx.float32)
    out = _token_entry(response.token, lp[response.token].item(), tokenizer)
    if top > 0:
        ids = mx.argpartition(-lp, kth=top - 1)[:top]
        values = lp[ids].tolist()
        ranked = sorted(zip(ids.tolist(), values), key=lambda x: -x[1])
        out["top_logprobs"] = [_token_entry(i, v, tokenizer) for i, v in ranked]
    else:
        out["top_logprobs"] = []
    return out


def _token_entry(token: int, logprob: float, tokenizer) -> dict:
    text = tokenizer.decode([token])
    return {"id": int(token), "token": text, "logprob": logprob,
            "bytes": list(text.encode("utf-8"))}


def split_tool_calls(text: str, tokenizer, tools) -> Tuple[str, List[dict]]:
    """(content, tool calls) of an answer: the sections between the tokenizer's
    tool-call markers, parsed by its mlx-lm tool parser into OpenAI ``tool_calls``
    (a section that does not parse stays in the content)."""
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    content, calls, i = "", [], 0
    while True:
        j = text.find(start, i)
        if j < 0:
            return content + text[i:], calls
        k = text.find(end, j + len(start)) if end else -1
        section = text[j + len(start):k if k >= 0 else len(text)]
        try:
            parsed = tokenizer.tool_parser(section, tools)
        except (ValueError, KeyError, TypeError):
            parsed = None
        if parsed is None:
            content += text[i:k + len(end) if k >= 0 else len(text)]
        else:
            content += text[i:j]
            calls += [_tool_call(c) for c in (parsed if isinstance(parsed, list) else [parsed])]
        if k < 0:
            return content, calls
        i = k + len(end)


def _tool_call(parsed: dict) -> dict:
    import uuid

    args = parsed.get("arguments", {})
    return {"id": parsed.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": parsed.get("name"),
                         "arguments": args if isinstance(args, str)
                         else json.dumps(args, ensure_ascii=False)}}


def _stop_at(text: str, stops: Sequence[str]) -> Optional[int]:
    cuts = [text.find(s) for s in stops if s]
    cuts = [c for c in cuts if c >= 0]
    return min(cuts) if cuts else None

"""A conversation among several loaded models, each keeping its own KV cache.

Any loaded model can take any turn. On its turn a model first catches up on what
the others wrote since it last ran — each such span is *translated* from the
cache of the model that wrote it (one translator per span, never a chain;
the "retained span" rule) — then processes the turn's new tokens itself (the
user's message and the chat template's markers) and generates::

    import mlx_kvlingo as kv
    from mlx_kvlingo import Session

    small, small_tok = kv.load("small-model")
    large, large_tok = kv.load("large-model")
    session = Session({"small": (small, small_tok), "large": (large, large_tok)},
                      {("small", "large"): kv.load_translator("s2l.safetensors"),
                       ("large", "small"): kv.load_translator("l2s.safetensors")})
    print(session.generate("small", "What does zip() do?").text)
    for r in session.generate("large", "And itertools.chain?", stream=True):
        print(r.text, end="", flush=True)
    print(session.reports[-1])  # translated / prefilled / generated, time to first token

Where no translator exists for a direction, the missing span is prefilled by the
model taking the turn and the turn's report carries a warning saying so.

Tokenizers: models that share a tokenizer read one token list (a *view*,
:class:`~mlx_kvlingo.chat.transcript.Transcript`) position for position. Models with
different tokenizers each render the conversation with their own chat template
(or the plain ``role: content`` format when their tokenizer has none) into their
own view; a span of message text one model wrote is translated for another by
aligning characters (each target token reads the writer's token that holds its
last character, ``align.py``), and template tokens with no text are computed by
the reading model itself, in order. A model's own answers keep the ids it
generated. Models with a new tokenizer join before the first turn.

Chat template: each view is rendered *incrementally*: each turn appends only the
tokens of the text the template puts after the previous turn, so a view is always
a prefix-extension of the previous one and no cache is ever invalidated.
"""

import copy
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from ..errors import KvlingoError
from ..models.cache import cache_length, trim_cache_to
from ..models.geometry import cache_geometry, tokenizer_fingerprint
from ..switching.api import RecomputeBudget, SwitchResult
from ..switching.generate import generate_after_switch
from ..switching.kernel import History
from ..translator.maps import Translator
from .catch_up import catch_up_turn, restore
from .transcript import TEMPLATE, Span, Transcript, ids_offsets
from .turns import TurnReport, TurnStream, format_reports

__all__ = ["Session", "Span", "Transcript", "TurnReport", "TurnStream", "finish_thread",
           "format_reports"]

Message = Dict[str, str]
MessageInput = Union[None, str, Sequence[Message]]


# ---------------------------------------------------------------------------
# The session


@dataclass
class _Entry:
    model: nn.Module
    tokenizer: object
    cache: List
    fingerprint: str = ""
    # A model with sliding-window layers: the rows those layers no longer hold,
    # kept across turns so that a catch-up may recompute a position translated
    # turns ago (it reads the rows of a window before it). None: no such layers.
    kept: Optional[History] = None


class Session:
    """One conversation among several loaded models (by name) and the translators
    between them.

    ``models``: name -> (model, tokenizer). ``translators``: (source name, target
    name) -> :class:`~mlx_kvlingo.translator.Translator`; checked against the
    models when added. Directions without a translator fall back to prefilling.

    ``chat_template``: None (default) uses each tokenizer's chat template when it
    has one; False always uses the plain ``role: content`` format.
    ``system_prompt``: a system message put before the first turn.
    ``gate``: a :class:`~mlx_kvlingo.switching.gate.QualityGate` that judges every turn
    that starts on translated positions and re-prefills when it predicts a bad
    translation (None: no gate).
    ``recompute``: after a catch-up translates, the model recomputes some of the
    translated positions itself, up to this share of the conversation (0.1 = 10 %;
    0: none), chosen as a switch chooses them (switching.choice: the positions the
    turn's new messages attend to, and the words that look like facts).
    ``recompute_max``: the most positions a catch-up recomputes (0: no limit). None
    (default): the translators' own defaults (``spec.recompute``,
    ``spec.recompute_max``, ``spec.recompute_reserve``).
    ``break_even``: a catch-up that would translate fewer positions computes them
    natively instead (a short switch costs more than it saves). None (default):
    what was measured for the pair on this machine
    (:func:`~mlx_kvlingo.switching.break_even.measure_break_even`, kept by
    ``mlx-kvlingo break-even``), else the translator file's (``spec.break_even``,
    measured where its defaults were set; 0 in files without one: always
    translate).

    Threads: every turn (``generate``, ``read``, ``reset``, ``truncate``) holds the
    session's lock, so a chat app may call one Session from worker threads;
    concurrent turns run one after the other, each seeing the whole conversation
    before it. A streaming turn holds the lock from its first ``next()`` until it
    is exhausted or closed; starting another turn on the same thread before then
    raises :class:`KvlingoError` instead of deadlocking. Models must not be shared
    with other code running at the same time. A worker thread that ran turns
    should call :func:`finish_thread` before it ends: MLX keeps per-thread
    streams, and a thread that leaves them behind can make the process abort at
    exit ("terminate called without an active exception").
    """

    def __init__(
        self,
        models: Optional[Mapping[str, Tuple[nn.Module, object]]] = None,
        translators: Optional[Mapping[Tuple[str, str], Translator]] = None,
        system_prompt: Optional[str] = None,
        chat_template: Optional[bool] = None,
        gate=None,
        recompute: Optional[float] = None,
        recompute_max: Optional[int] = None,
        break_even: Optional[int] = None,
    ):
        self._models: Dict[str, _Entry] = {}
        self._translators: Dict[Tuple[str, str], Translator] = {}
        self._views: Dict[str, Transcript] = {}  # tokenizer fingerprint -> view
        self._view_of: Dict[str, Transcript] = {}
        self._lock = threading.Lock()
        self._owner: Optional[int] = None
        self._use_template = chat_template
        self.system_prompt = system_prompt
        self.gate = gate
        RecomputeBudget.check(recompute, recompute_max)
        self.recompute, self.recompute_max = recompute, recompute_max
        if break_even is not None and (not isinstance(break_even, int) or break_even < 0):
            raise KvlingoError(f"break_even is a number of positions >= 0, not {break_even!r}.")
        self.break_even = break_even
        self.messages: List[Message] = []
        self._message_pieces: List[int] = []  # per message: its text piece id
        self._next_piece = 0
        self.reports: List[TurnReport] = []
        for name, (model, tokenizer) in (models or {}).items():
            self.add_model(name, model, tokenizer)
        for (src, tgt), translator in (translators or {}).items():
            self.add_translator(src, tgt, translator)

    # -- setup ----------------------------------------------------------------

    def add_model(self, name: str, model: nn.Module, tokenizer):
        """Add a model under ``name``; it joins the conversation on its first turn
        (a model whose tokenizer no other model uses: before the first turn)."""
        if not name or not isinstance(name, str):
            raise KvlingoError("A model needs a non-empty name.")
        if name in self._models:
            raise KvlingoError(f"A model named {name!r} is already in the session.")
        fp = tokenizer_fingerprint(tokenizer)
        if fp not in self._views:
            if any(len(v) for v in self._views.values()):
                raise KvlingoError(
                    f"Model {name!r} has a tokenizer no model of the session uses; such a "
                    "model joins before the first turn (or after reset())."
                )
            self._views[fp] = Transcript(tokenizer, self._use_template)
        # Weights left lazy (e.g. a dtype cast after loading) would be bound to the
        # loading thread's stream; materialize them so any thread can run turns.
        mx.eval(model.parameters())
        self._models[name] = _Entry(model, tokenizer, make_prompt_cache(model), fp,
                                    _kept_rows(model))
        self._view_of[name] = self._views[fp]
        self._views[fp].add_model(name)

    def add_translator(self, source: str, target: str, translator: Translator):
        """Use ``translator`` for spans ``source`` wrote that ``target`` must read."""
        s, t = self._entry(source), self._entry(target)
        if source == target:
            raise KvlingoError("A translator connects two different model names.")
        translator.check_models(s.model, t.model, s.tokenizer, t.tokenizer)
        mx.eval(translator.parameters())
        self._translators[source, target] = translator

    def fresh(self) -> "Session":
        """A new, empty conversation with this session's models, translators and
        settings (nothing loaded or checked again: cheap)."""
        s = Session(system_prompt=self.system_prompt, chat_template=self._use_template,
                    gate=self.gate, recompute=self.recompute, break_even=self.break_even,
                    recompute_max=self.recompute_max)
        for fp, v in self._views.items():
            s._views[fp] = Transcript(v.tokenizer, self._use_template)
        for name, e in self._models.items():
            s._models[name] = _Entry(e.model, e.tokenizer, make_prompt_cache(e.model),
                                     e.fingerprint, _kept_rows(e.model))
            s._view_of[name] = s._views[e.fingerprint]
            s._view_of[name].add_model(name)
        s._translators = dict(self._translators)
        return s

    def branch(self, messages: int) -> "Session":
        """A new conversation holding this one's first ``messages`` messages, with
        each model's cache of them: the start of a chat that diverges after them.
        This conversation is left whole (MLX arrays are values: the copy's caches
        share memory with this one's until either writes)."""
        with self._turn_lock():
            s = self.fresh()
            s._views = {fp: v.copy() for fp, v in self._views.items()}
            for name, e in self._models.items():
                s._models[name].cache = [_copy_layer(c) for c in e.cache]
                if e.kept is not None:  # values: the copy's rows stay apart
                    s._models[name].kept = History(e.kept.since, dict(e.kept.layers))
                s._view_of[name] = s._views[e.fingerprint]
            s.messages = [dict(m) for m in self.messages]
            s._message_pieces = list(self._message_pieces)
            s._next_piece = self._next_piece
            s.reports = list(self.reports)
        s.truncate(messages)
        return s

    def set_tools(self, tools: Optional[list]):
        """Tools (OpenAI function specs) every chat template renders into this
        conversation; before its first turn only (they come first in it)."""
        if tools and any(len(v) for v in self._views.values()):
            raise KvlingoError("Tools are set before the conversation's first turn.")
        if tools and not all(v.uses_template() for v in self._views.values()):
            raise KvlingoError("Tools need a chat template, and a model here has none.")
        for v in self._views.values():
            v.template_kwargs = {"tools": tools} if tools else {}

    def nbytes(self) -> int:
        """Bytes the models' caches of this conversation hold (with the rows kept
        for the sliding-window layers' recompute)."""
        held = sum(c.nbytes for e in self._models.values() for c in e.cache
                   if getattr(c, "keys", None) is not None)
        kept = sum(k.nbytes + v.nbytes for e in self._models.values() if e.kept is not None
                   for _, k, v in e.kept.layers.values())
        return held + kept

    @property
    def model_names(self) -> List[str]:
        return list(self._models)

    def has_translator(self, source: str, target: str) -> bool:
        return (source, target) in self._translators

    def translator(self, source: str, target: str) -> Optional[Translator]:
        return self._translators.get((source, target))

    def model(self, name: str) -> nn.Module:
        return self._entry(name).model

    def cache(self, name: str) -> List:
        """The prompt cache of model ``name`` (holds ``transcript_of(name).processed[name]``
        tokens). Do not modify it."""
        return self._entry(name).cache

    @property
    def cross_tokenizer(self) -> bool:
        """Whether the models use more than one tokenizer."""
        return len(self._views) > 1

    @property
    def tokenizer(self):
        """The first model's tokenizer (every model's, when they share one)."""
        return self._first().tokenizer

    def tokenizer_of(self, name: str):
        return self._entry(name).tokenizer

    @property
    def transcript(self) -> Transcript:
        """The first model's view of the conversation (every model's, when they
        share a tokenizer)."""
        return self._view_of[self._first_name()] if self._models else Transcript()

    def transcript_of(self, name: str) -> Transcript:
        self._entry(name)
        return self._view_of[name]

    @property
    def tokens(self) -> List[int]:
        return list(self.transcript.tokens)

    def tokens_of(self, name: str) -> List[int]:
        return list(self.transcript_of(name).tokens)

    def text(self, name: Optional[str] = None) -> str:
        """The transcript as text (model ``name``'s view, default the first), special
        tokens included."""
        view = self.transcript_of(name) if name else self.transcript
        return view.tokenizer.decode(view.tokens) if view.tokens else ""

    def entry(self, name: str) -> _Entry:
        """Model ``name``'s model, tokenizer and cache (the catch-up replaces
        ``entry.cache`` as it extends or resets it)."""
        return self._entry(name)

    def _entry(self, name: str) -> _Entry:
        try:
            return self._models[name]
        except KeyError:
            known = ", ".join(self._models) or "none"
            raise KvlingoError(f"No model named {name!r} in the session (models: {known}).") from None

    def _first_name(self) -> str:
        if not self._models:
            raise KvlingoError("The session has no models.")
        return next(iter(self._models))

    def _first(self) -> _Entry:
        return self._models[self._first_name()]

    # -- turns ----------------------------------------------------------------

    def generate(
        self,
        model: str,
        message: MessageInput = None,
        max_tokens: int = 256,
        stream: bool = False,
        **generate_kwargs,
    ) -> Union[TurnReport, TurnStream]:
        """Let ``model`` answer: ``message`` is the user's new text, or a list of new
        ``{"role", "content"}`` messages, or None (the model takes another turn
        after the last one).

        ``generate_kwargs`` go to mlx-lm's generation (``sampler``,
        ``logits_processors``, ``prefill_step_size``, ...; switching.generate:
        ``generate_after_switch``, which reads the turn's new tokens, the native
        tail and the catch-up's recompute in one first pass); greedy by default.

        Returns the turn's :class:`TurnReport` (with the answer's text), or with
        ``stream=True`` a :class:`TurnStream` of mlx-lm ``GenerationResponse``s.
        """
        self._entry(model)
        new_messages = _as_messages(message)
        if max_tokens == 0 or max_tokens < -1:
            raise KvlingoError("max_tokens must be positive (or -1 for no limit).")
        report = TurnReport(index=-1, model=model)
        gen = self._generate_turn(model, new_messages, max_tokens, generate_kwargs, report)
        turn = TurnStream(gen, report)
        if stream:
            return turn
        for _ in turn:
            pass
        return report

    def read(self, model: str, tokens: Union[str, Sequence[int]]) -> mx.array:
        """A teacher-forced turn: ``model`` reads ``tokens`` (ids, or text encoded
        with the model's tokenizer, special tokens such as BOS included when the
        conversation is empty) as its own contribution — a scripted reply, a
        document — instead of generating. No chat template is applied (in a
        templated conversation, pass text as messages to :meth:`generate` instead).

        Returns the model's log-probabilities [len(tokens), vocab] for each of the
        tokens given everything before it (for the conversation's very first
        tokens, [len(tokens) - 1, vocab] for tokens[1:]). The last token is left for
        the next turn to process (like the context's last token in a switch).
        """
        entry = self._entry(model)
        view = self._view_of[model]
        with self._turn_lock() as wait_s:
            L = len(view)
            if isinstance(tokens, str):
                text = tokens
                tokens = entry.tokenizer.encode(text, add_special_tokens=not L)
            else:
                tokens = [int(t) for t in tokens]
                text = entry.tokenizer.decode(tokens, skip_special_tokens=True)
            if not tokens:
                raise KvlingoError("Nothing to read: the token list is empty.")
            t0 = time.perf_counter()
            report = TurnReport(index=len(self.reports), model=model, kind="read", wait_s=wait_s)
            switched = None
            if L:
                if view.processed[model] >= L:  # it wrote the last token: re-read it
                    restore(self, model, L - 1)
                inputs = [view.tokens[-1]] + tokens[:-1]
                # What it reads chooses the recompute, as a turn's new messages do.
                switched = self._catch_up(model, L - 1, report, question=inputs)
            else:
                inputs = tokens
            piece = self._new_piece()
            offsets = ids_offsets(entry.tokenizer, tokens, text) if self.cross_tokenizer else None
            view.append(tokens, model, "read", [piece] * len(tokens), offsets)
            view.last_token_eos = False
            self._append_text_elsewhere(view, text, piece, model, "read")
            report.context_tokens = L
            report.new_tokens = len(tokens)
            report.prefilled += len(inputs)
            if switched is not None:  # the first pass: native tail, recompute, then inputs
                logits = switched.read(entry.model, keep=len(inputs))[0]
            else:
                logits = entry.model(mx.array(inputs)[None], cache=entry.cache)[0]
            logits = logits.astype(mx.float32)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            mx.eval(logprobs)
            self._settle(model)
            if not L:
                logprobs = logprobs[:-1]
            report.total_s = time.perf_counter() - t0
            self.reports.append(report)
            return logprobs

    def reset(self):
        """Forget the conversation (every model's cache too)."""
        with self._turn_lock():
            self._forget()
            self.reports = []

    def truncate(self, messages: int):
        """Forget ``messages[messages:]`` and every position after them (an edited or
        regenerated message): each model's cache is trimmed to what it still holds
        of the rest, or emptied when it cannot be trimmed (it catches up on its
        next turn). The conversation then ends right after message ``messages - 1``'s
        content; ``generate(model)`` with no message answers it again."""
        with self._turn_lock():
            if messages >= len(self.messages):
                return
            views = list(self._views.values())
            if messages <= 0 or any(len(v.message_ends) < messages for v in views):
                self._forget()
                return
            for v in views:
                cut = v.message_ends[messages - 1]
                for name in v.processed:
                    entry = self._models[name]
                    if not trim_cache_to(entry.cache, cut):
                        entry.cache = make_prompt_cache(entry.model)
                        v.processed[name] = 0
                    v.translated[name] = min(v.translated[name], v.processed[name], cut)
                v.truncate(cut)
                last = v.spans[-1] if v.spans else None
                v.last_token_eos = bool(
                    last is not None and last.kind == "generated"
                    and v.tokens[-1] in _eos_ids(v.tokenizer)
                )
            del self.messages[messages:], self._message_pieces[messages:]

    def cut_answer(self, text: str):
        """End the last answer at ``text``, a prefix of it (a stop string a client
        gave cut it there), so the conversation holds what the client saw: each
        view keeps the answer's tokens that spell a prefix of ``text`` and reads
        the rest of ``text`` on the next turn; caches are trimmed to match."""
        with self._turn_lock():
            if not self.messages or self.messages[-1]["role"] != "assistant":
                raise KvlingoError("The conversation does not end with an answer.")
            answer = self.messages[-1]
            if answer["content"] == text:
                return
            if not answer["content"].lstrip().startswith(text.lstrip()):
                raise KvlingoError("The cut answer is not a prefix of the answer.")
            piece = self._message_pieces[-1]
            writer = next((s.writer for s in reversed(self.transcript_of(
                self._first_name()).spans) if s.kind == "generated"), None)
            for v in self._views.values():
                if piece in v.piece_range:
                    self._cut_view(v, v.piece_range[piece][0], piece, text, writer)
            answer["content"] = text

    def _cut_view(self, view: Transcript, start: int, piece: int, text: str, writer):
        tok = view.tokenizer
        want = text.lstrip()
        keep, kept_text = 0, ""
        for k in range(1, len(view) - start + 1):
            got = tok.decode(view.tokens[start:start + k], skip_special_tokens=True)
            if not want.startswith(got.lstrip()):
                break
            keep, kept_text = k, got
        cut = start + keep
        for name in view.processed:
            entry = self._models[name]
            if view.processed[name] > cut and not trim_cache_to(entry.cache, cut):
                entry.cache = make_prompt_cache(entry.model)
                view.processed[name] = 0
            view.translated[name] = min(view.translated[name], view.processed[name], cut)
        view.message_ends.pop()  # the answer's end, set again below
        view.truncate(cut)
        rest = want[len(kept_text.lstrip()):]
        if rest:
            ids, pieces, offsets = view.tokenize(rest, [(piece, 0, len(rest))], False)
            shift = len(kept_text)
            offsets = [(a + shift, b + shift) for a, b in offsets]
            view.append(ids, writer, "generated", pieces, offsets)
        view.message_ends.append(len(view))
        view.last_token_eos = False

    def _forget(self):
        for fp, v in list(self._views.items()):
            fresh = Transcript(v.tokenizer, self._use_template)
            for name in v.processed:
                e = self._models[name]
                e.cache, e.kept = make_prompt_cache(e.model), _kept_rows(e.model)
                fresh.add_model(name)
                self._view_of[name] = fresh
            self._views[fp] = fresh
        self.messages, self._message_pieces = [], []

    # -- internals --------------------------------------------------------------

    class _Locked:
        def __init__(self, session):
            self.s = session

        def __enter__(self):
            s, me = self.s, threading.get_ident()
            if s._owner == me:
                raise KvlingoError(
                    "This thread is still streaming a turn of this session; exhaust or "
                    "close that stream before starting another turn."
                )
            t0 = time.perf_counter()
            s._lock.acquire()
            s._owner = me
            return time.perf_counter() - t0

        def __exit__(self, *exc):
            self.s._owner = None
            self.s._lock.release()

    def _turn_lock(self):
        return Session._Locked(self)

    def _new_piece(self) -> int:
        self._next_piece += 1
        return self._next_piece - 1

    def _generate_turn(self, name, new_messages, max_tokens, kwargs, report):
        entry = self._models[name]
        view = self._view_of[name]
        with self._turn_lock() as wait_s:
            t0 = time.perf_counter()
            report.wait_s = wait_s
            L = len(view)
            if not self.messages and self.system_prompt:
                new_messages[:0] = [{"role": "system", "content": self.system_prompt}]
            pieces = [self._new_piece() for _ in new_messages]
            chunks = {id(v): v.render_chunk(self.messages, new_messages, pieces)
                      for v in self._views.values()}
            ids = chunks[id(view)][0]
            report.index = len(self.reports)
            self.reports.append(report)
            if ids:
                # The new messages choose what the catch-up recomputes; the first
                # pass reads them with the native tail and the recompute folded in.
                switched = self._catch_up(name, L, report, question=ids)
            else:  # nothing new to say: the model re-reads the last token itself
                if not L:
                    raise KvlingoError("The conversation is empty: give a message.")
                if view.processed[name] >= L:
                    restore(self, name, L - 1)
                switched = self._catch_up(name, L - 1, report, question=view.tokens[-1:])
            for v in self._views.values():
                self._append_chunk(v, chunks[id(v)], name, v is view)
            report.new_tokens = len(ids)
            report.prefilled += len(ids) or 1
            report.context_tokens = len(view)
            self.messages.extend(new_messages)
            self._message_pieces.extend(pieces)
            answer = {"role": "assistant", "content": ""}
            piece = self._new_piece()
            self.messages.append(answer)
            self._message_pieces.append(piece)
            start = len(view)
            view.last_token_eos = False
            eos = _eos_ids(entry.tokenizer)
            responses = generate_after_switch(entry.model, entry.tokenizer, switched,
                                              max_tokens=max_tokens, **kwargs)
            try:
                for r in responses:
                    if report.ttft_s is None:
                        report.ttft_s = time.perf_counter() - t0
                        # The first pass's rows, before decoding pushes them out.
                        self._keep_rows(name)
                    view.append([r.token], name, "generated", [piece])
                    report.generated += 1
                    report.text += r.text
                    answer["content"] = report.text
                    report.finish_reason = r.finish_reason
                    view.last_token_eos = r.token in eos
                    yield r
            finally:
                responses.close()
                self._finish_answer(name, start, piece, report.text)
                self._settle(name)
                report.total_s = time.perf_counter() - t0

    def _catch_up(self, name: str, end: int, report: TurnReport,
                  question: Sequence[int] = ()) -> SwitchResult:
        """Bring ``name`` up to ``end`` (:func:`catch_up_turn`), ``question`` left for
        its first pass; the cache records which positions the model did not compute
        itself (the whole catch-up when it translated anything)."""
        self._view_of[name].clip_foreign(name)
        return catch_up_turn(self, name, end, report, question)

    def _append_chunk(self, view: Transcript, chunk, writer: str, own: bool,
                      kind: str = "prompt"):
        """Append a rendered chunk: in the writer's own view every token is its
        prompt; elsewhere template tokens are nobody's (computed by whoever reads
        them) and message text is the writer's (translated from its view)."""
        ids, pieces, offsets, ends = chunk
        start = len(view)
        if own:
            view.append(ids, writer, kind, pieces, offsets)
        else:
            j = 0
            while j < len(ids):
                k = j
                while k < len(ids) and (pieces[k] == TEMPLATE) == (pieces[j] == TEMPLATE):
                    k += 1
                who = None if pieces[j] == TEMPLATE else writer
                view.append(ids[j:k], who, "template" if who is None else kind,
                            pieces[j:k], offsets[j:k])
                j = k
        view.message_ends += [start + e for e in ends]
        if ids:
            view.last_token_eos = False

    def _append_text_elsewhere(self, own: Transcript, text: str, piece: int, writer: str,
                               kind: str):
        """Message text ``writer`` wrote, appended to every other view in that view's
        own tokenization (BOS and the like included when the view is empty)."""
        for v in self._views.values():
            if v is own:
                continue
            ids, pieces, offsets = v.tokenize(text, [(piece, 0, len(text))],
                                              add_special_tokens=not len(v))
            self._append_chunk(v, (ids, pieces, offsets, []), writer, False, kind)

    def _finish_answer(self, name: str, start: int, piece: int, text: str):
        """End of an answer: record where each generated token's text lies, and give
        the other views the answer in their own tokenization."""
        view = self._view_of[name]
        if self.cross_tokenizer:
            # The ids' own decoding, not the streamed text: mlx-lm's streaming BPE
            # detokenizer drops the answer's leading space, after which no token's
            # decoding agrees with the text (every offset came out empty) and the
            # other views would read "assistant:Return" for "assistant: Return".
            text = view.tokenizer.decode(view.tokens[start:], skip_special_tokens=True)
            view.set_offsets(start, ids_offsets(view.tokenizer, view.tokens[start:], text))
        view.message_ends.append(len(view))
        self._append_text_elsewhere(view, text, piece, name, "generated")
        for v in self._views.values():
            if v is not view:
                v.message_ends.append(len(v))

    def _settle(self, name: str):
        """End of a turn: finish pending (pipelined) work on the model's cache, so
        the next turn may run on another thread, and update the bookkeeping."""
        cache = self._models[name].cache
        mx.eval([(c.keys, c.values) for c in cache if c.keys is not None])
        # mlx-lm computes one step ahead on its own (thread-local) stream: wait for it,
        # so no work is left running when this thread ends.
        mx.synchronize(generation_stream)
        mx.synchronize()
        self._sync(name)
        self._keep_rows(name)

    def _keep_rows(self, name: str):
        """Keep the rows ``name``'s sliding-window layers hold now, before later
        positions push them out (``_Entry.kept``): after a turn, and after an
        answer's first pass (its rows are all held until decoding starts)."""
        entry = self._models[name]
        length = cache_length(entry.cache)
        if entry.kept is None or not length:
            return
        entry.kept.record(entry.model, entry.cache, 0, length)
        mx.eval([a for _, k, v in entry.kept.layers.values() for a in (k, v)])

    def _sync(self, name: str):
        """Make the bookkeeping agree with the cache (which never holds more than
        the transcript)."""
        view = self._view_of[name]
        cache = self._models[name].cache
        length = min(cache_length(cache), len(view))
        # After an interrupted forward pass the layers disagree (the first ones hold
        # a token more): trim them all to what every layer holds.
        if any(c.offset != length for c in cache):
            restore(self, name, length)
        view.processed[name] = length
        view.clip_foreign(name)


def _kept_rows(model) -> Optional[History]:
    """An empty store of rows from position 0 for a model with sliding-window
    layers (None for one without)."""
    if any(lg.window for lg in cache_geometry(model).layers):
        return History(since=1)
    return None


def _copy_layer(layer):
    """A layer cache whose arrays are new array objects over the same values
    (mlx-lm writes into a cache by rebinding its arrays, so the two stay apart)."""
    out = copy.copy(layer)
    for key, value in vars(layer).items():
        if isinstance(value, mx.array):
            setattr(out, key, value[...])
        elif isinstance(value, list):  # caches that keep a list of arrays (state-space layers)
            setattr(out, key, [v[...] if isinstance(v, mx.array) else v for v in value])
    return out


def _eos_ids(tokenizer) -> set:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        ids = {tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set()
    return set(ids)


def finish_thread():
    """Call at the end of a worker thread that ran Session turns: waits for its
    pending MLX work and releases the thread's MLX streams (``mx.clear_streams``),
    without which the process may abort when it exits."""
    mx.synchronize(generation_stream)
    mx.synchronize()
    if hasattr(mx, "clear_streams"):
        mx.clear_streams()


def _as_messages(message: MessageInput) -> List[Message]:
    if message is None:
        return []
    if isinstance(message, str):
        return [{"role": "user", "content": message}]
    out = []
    for m in message:
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise KvlingoError(
                f"A message is a {{'role': str, 'content': str}} mapping, not {m!r}."
            )
        out.append(dict(m))
    return out


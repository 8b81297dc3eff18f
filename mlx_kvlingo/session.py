"""A conversation among several models, each keeping its own KV cache.

Any loaded model can take any turn. On its turn a model first catches up on what
the others wrote since it last ran — each such span is *translated* from the
cache of the model that wrote it (one translator per span, never a chain;
DESIGN §2 "retained span") — then processes the turn's new tokens itself (the
user's message and the chat template's markers) and generates::

    import mlx_kvlingo as kv
    from mlx_kvlingo.session import Session

    small, tok = kv.load("small-model")
    large, _ = kv.load("large-model")
    session = Session({"small": (small, tok), "large": (large, tok)},
                      {("small", "large"): kv.load_translator("s2l.safetensors"),
                       ("large", "small"): kv.load_translator("l2s.safetensors")})
    print(session.generate("small", "What does zip() do?").text)
    for r in session.generate("large", "And itertools.chain?", stream=True):
        print(r.text, end="", flush=True)
    print(session.reports[-1])  # translated / prefilled / generated, time to first token

Where no translator exists for a direction, the missing span is prefilled by the
model taking the turn and the turn's report carries a warning saying so.

This version needs models that share one tokenizer, so all models read one token
list (positions are shared). The bookkeeping of who wrote which span and how far
each model has read lives in :class:`Transcript` alone.

Chat template: the transcript is rendered with the tokenizer's chat template
when it has one (else a plain ``role: content`` format), *incrementally*: each
turn appends only the tokens of the text the template puts after the previous
turn, so the transcript is always a prefix-extension of the previous one and no
cache is ever invalidated.
"""

import hashlib
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import GenerationResponse, generation_stream, stream_generate
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from .errors import KvlingoError
from .models import cache_length, model_name, prefill, tokenizer_fingerprint
from .switch import translate_span
from .translator import Translator

# Stands in for the last message's content when rendering what the template puts
# after it (see Session._render_piece).
_SENTINEL = "KVLINGO_SENTINEL_2f9c1"

Message = Dict[str, str]
MessageInput = Union[None, str, Sequence[Message]]


# ---------------------------------------------------------------------------
# Bookkeeping: one token list, who wrote each span, how far each model has read


@dataclass
class Span:
    """Positions start..end-1 of the transcript, computed natively by ``writer``."""

    start: int
    end: int
    writer: str
    kind: str  # "prompt" (template + user text), "generated", "read" (teacher-forced)


class Transcript:
    """The conversation's tokens, which model wrote each span, and how many leading
    tokens each model's cache holds.

    ``processed[name]`` always equals the length of that model's cache. Everything
    a model has not processed yet is a list of spans (:meth:`pending`) to translate
    from their writers' caches or to prefill.

    Cross-tokenizer pairs would keep one token list per model and an alignment
    between them; the spans (kept with their text positions) are the unit that
    would be re-tokenized and aligned.
    """

    def __init__(self):
        self.tokens: List[int] = []
        self.spans: List[Span] = []
        self.processed: Dict[str, int] = {}
        self.translated: Dict[str, int] = {}  # positions of each cache that were translated

    def __len__(self) -> int:
        return len(self.tokens)

    def add_model(self, name: str):
        self.processed.setdefault(name, 0)
        self.translated.setdefault(name, 0)

    def append(self, tokens: Sequence[int], writer: str, kind: str):
        """Append tokens written by ``writer`` (merged with the last span when the
        writer and kind are the same)."""
        if not tokens:
            return
        start = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens)
        last = self.spans[-1] if self.spans else None
        if last is not None and last.writer == writer and last.kind == kind and last.end == start:
            last.end = len(self.tokens)
        else:
            self.spans.append(Span(start, len(self.tokens), writer, kind))

    def pending(self, name: str, end: int) -> List[Span]:
        """The spans between what ``name`` has processed and ``end``, clipped, with
        adjacent spans of one writer merged."""
        start = self.processed[name]
        out: List[Span] = []
        for s in self.spans:
            lo, hi = max(s.start, start), min(s.end, end)
            if lo >= hi:
                continue
            if out and out[-1].writer == s.writer and out[-1].end == lo:
                out[-1].end = hi
                out[-1].kind = "mixed" if out[-1].kind != s.kind else s.kind
            else:
                out.append(Span(lo, hi, s.writer, s.kind))
        return out

    def writer_at(self, position: int) -> str:
        for s in self.spans:
            if s.start <= position < s.end:
                return s.writer
        raise IndexError(position)


# ---------------------------------------------------------------------------
# Reports


@dataclass
class TurnReport:
    """What one turn cost. ``prefilled`` counts every position the model computed
    itself before its first generated token: the turn's own new tokens
    (``new_tokens``), translators' native prefix and spans without a translator."""

    index: int
    model: str
    kind: str = "generate"  # or "read"
    translated: int = 0
    prefilled: int = 0
    generated: int = 0
    new_tokens: int = 0
    translated_from: Dict[str, int] = field(default_factory=dict)
    context_tokens: int = 0  # transcript length when the model started its own tokens
    translate_s: float = 0.0  # catching up (translation and any fallback prefill)
    ttft_s: Optional[float] = None  # start of the turn to first generated token
    total_s: float = 0.0
    wait_s: float = 0.0  # time waiting for another thread's turn to finish
    text: str = ""
    finish_reason: Optional[str] = None
    warnings: List[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        ttft = f", first token after {self.ttft_s * 1e3:.1f} ms" if self.ttft_s is not None else ""
        return (f"{self.model}: translated {self.translated}, prefilled {self.prefilled}, "
                f"generated {self.generated}{ttft}")


def format_reports(reports: Sequence[TurnReport]) -> str:
    """A plain-text table of turn reports."""
    lines = [f"{'turn':>4} {'model':<12} {'context':>7} {'translated':>10} {'prefilled':>9} "
             f"{'generated':>9} {'TTFT ms':>8} {'translate ms':>12}"]
    for r in reports:
        ttft = f"{r.ttft_s * 1e3:.1f}" if r.ttft_s is not None else "-"
        lines.append(
            f"{r.index:>4} {r.model:<12} {r.context_tokens:>7} {r.translated:>10} "
            f"{r.prefilled:>9} {r.generated:>9} {ttft:>8} {r.translate_s * 1e3:>12.1f}"
        )
        lines += [f"     ! {w}" for w in r.warnings]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# The session


@dataclass
class _Entry:
    model: nn.Module
    tokenizer: object
    cache: List


class TurnStream:
    """Iterator over one streaming turn's mlx-lm ``GenerationResponse``s.

    ``report`` is filled in as the turn runs and is final once the iterator is
    exhausted or closed. Close it (or use it as a context manager) to stop a turn
    early: the tokens generated so far stay in the conversation.
    """

    def __init__(self, gen: Iterator[GenerationResponse], report: TurnReport):
        self._gen = gen
        self.report = report

    def __iter__(self):
        return self

    def __next__(self) -> GenerationResponse:
        return next(self._gen)

    def close(self):
        self._gen.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Session:
    """One conversation among several loaded models (by name) and the translators
    between them.

    ``models``: name -> (model, tokenizer). ``translators``: (source name, target
    name) -> :class:`~mlx_kvlingo.translator.Translator`; checked against the
    models when added. Directions without a translator fall back to prefilling.

    ``chat_template``: None (default) uses the tokenizer's chat template when it
    has one; False always uses the plain ``role: content`` format.
    ``system_prompt``: a system message put before the first turn.

    Threads: every turn (``generate``, ``read``, ``reset``) holds the session's
    lock, so a chat app may call one Session from worker threads; concurrent turns
    run one after the other, each seeing the whole conversation before it. A
    streaming turn holds the lock from its first ``next()`` until it is exhausted
    or closed; starting another turn on the same thread before then raises
    :class:`KvlingoError` instead of deadlocking. Models must not be shared with
    other code running at the same time. A worker thread that ran turns should call
    :func:`finish_thread` before it ends: MLX keeps per-thread streams, and a
    thread that leaves them behind can make the process abort at exit
    ("terminate called without an active exception").
    """

    def __init__(
        self,
        models: Optional[Mapping[str, Tuple[nn.Module, object]]] = None,
        translators: Optional[Mapping[Tuple[str, str], Translator]] = None,
        system_prompt: Optional[str] = None,
        chat_template: Optional[bool] = None,
    ):
        self._models: Dict[str, _Entry] = {}
        self._translators: Dict[Tuple[str, str], Translator] = {}
        self._lock = threading.Lock()
        self._owner: Optional[int] = None
        self._use_template = chat_template
        self.system_prompt = system_prompt
        self.transcript = Transcript()
        self.messages: List[Message] = []
        self.reports: List[TurnReport] = []
        self._last_token_eos = False
        for name, (model, tokenizer) in (models or {}).items():
            self.add_model(name, model, tokenizer)
        for (src, tgt), translator in (translators or {}).items():
            self.add_translator(src, tgt, translator)

    # -- setup ----------------------------------------------------------------

    def add_model(self, name: str, model: nn.Module, tokenizer):
        """Add a model under ``name``; it joins the conversation on its first turn."""
        if not name or not isinstance(name, str):
            raise KvlingoError("A model needs a non-empty name.")
        if name in self._models:
            raise KvlingoError(f"A model named {name!r} is already in the session.")
        if self._models:
            first = next(iter(self._models.values()))
            if tokenizer_fingerprint(first.tokenizer) != tokenizer_fingerprint(tokenizer):
                raise KvlingoError(
                    f"Model {name!r} has a different tokenizer. This version of the "
                    "session needs models that share one tokenizer."
                )
        # Weights left lazy (e.g. a dtype cast after loading) would be bound to the
        # loading thread's stream; materialize them so any thread can run turns.
        mx.eval(model.parameters())
        self._models[name] = _Entry(model, tokenizer, make_prompt_cache(model))
        self.transcript.add_model(name)

    def add_translator(self, source: str, target: str, translator: Translator):
        """Use ``translator`` for spans ``source`` wrote that ``target`` must read."""
        s, t = self._entry(source), self._entry(target)
        if source == target:
            raise KvlingoError("A translator connects two different model names.")
        translator.check_models(s.model, t.model, s.tokenizer, t.tokenizer)
        mx.eval(translator.parameters())
        self._translators[source, target] = translator

    @property
    def model_names(self) -> List[str]:
        return list(self._models)

    def has_translator(self, source: str, target: str) -> bool:
        return (source, target) in self._translators

    def model(self, name: str) -> nn.Module:
        return self._entry(name).model

    def cache(self, name: str) -> List:
        """The prompt cache of model ``name`` (holds ``transcript.processed[name]``
        tokens). Do not modify it."""
        return self._entry(name).cache

    @property
    def tokenizer(self):
        """The tokenizer every model of the session shares."""
        return self._tokenizer()

    @property
    def tokens(self) -> List[int]:
        return list(self.transcript.tokens)

    def text(self) -> str:
        """The transcript as text, special tokens included."""
        tok = self._tokenizer()
        return tok.decode(self.transcript.tokens) if self.transcript.tokens else ""

    def _entry(self, name: str) -> _Entry:
        try:
            return self._models[name]
        except KeyError:
            known = ", ".join(self._models) or "none"
            raise KvlingoError(f"No model named {name!r} in the session (models: {known}).") from None

    def _tokenizer(self):
        if not self._models:
            raise KvlingoError("The session has no models.")
        return next(iter(self._models.values())).tokenizer

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

        ``generate_kwargs`` go to mlx-lm's ``stream_generate`` (``sampler``,
        ``logits_processors``, ``prefill_step_size``, ...); greedy by default.

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
        without special tokens) as its own contribution — a scripted reply, a
        document — instead of generating. No chat template is applied (in a
        templated conversation, pass text as messages to :meth:`generate` instead).

        Returns the model's log-probabilities [len(tokens), vocab] for each of the
        tokens given everything before it (for the conversation's very first
        tokens, [len(tokens) - 1, vocab] for tokens[1:]). The last token is left for
        the next turn to process (like the context's last token in a switch).
        """
        entry = self._entry(model)
        if isinstance(tokens, str):
            tokens = self._tokenizer().encode(tokens, add_special_tokens=False)
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise KvlingoError("Nothing to read: the token list is empty.")
        with self._turn_lock() as wait_s:
            t0 = time.perf_counter()
            report = TurnReport(index=len(self.reports), model=model, kind="read", wait_s=wait_s)
            L = len(self.transcript)
            if L:
                self._catch_up(model, L - 1, report)
                inputs = [self.transcript.tokens[-1]] + tokens[:-1]
            else:
                inputs = tokens
            self.transcript.append(tokens, model, "read")
            self._last_token_eos = False
            report.context_tokens = L
            report.new_tokens = len(tokens)
            report.prefilled += len(inputs)
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
            self.transcript = Transcript()
            for name, e in self._models.items():
                e.cache = make_prompt_cache(e.model)
                self.transcript.add_model(name)
            self.messages, self.reports = [], []
            self._last_token_eos = False

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

    def _generate_turn(self, name, new_messages, max_tokens, kwargs, report):
        entry = self._models[name]
        with self._turn_lock() as wait_s:
            t0 = time.perf_counter()
            report.wait_s = wait_s
            tok = self._tokenizer()
            L = len(self.transcript)
            piece = self._render_piece(new_messages)
            report.index = len(self.reports)
            self.reports.append(report)
            if piece:
                self._catch_up(name, L, report)
                prompt = piece
                self.transcript.append(piece, name, "prompt")
            else:  # nothing new to say: the model re-reads the last token itself
                if not L:
                    raise KvlingoError("The conversation is empty: give a message.")
                if self.transcript.processed[name] >= L:
                    self._restore(name, L - 1)
                self._catch_up(name, L - 1, report)
                prompt = self.transcript.tokens[-1:]
            report.new_tokens = len(piece)
            report.prefilled += len(prompt)
            report.context_tokens = len(self.transcript)
            self.messages.extend(new_messages)
            answer = {"role": "assistant", "content": ""}
            self.messages.append(answer)
            self._last_token_eos = False
            responses = stream_generate(
                entry.model, tok, mx.array(prompt), max_tokens=max_tokens,
                prompt_cache=entry.cache, **kwargs,
            )
            try:
                for r in responses:
                    if report.ttft_s is None:
                        report.ttft_s = time.perf_counter() - t0
                    self.transcript.append([r.token], name, "generated")
                    report.generated += 1
                    report.text += r.text
                    answer["content"] = report.text
                    report.finish_reason = r.finish_reason
                    self._last_token_eos = r.token in tok.eos_token_ids
                    yield r
            finally:
                responses.close()
                self._settle(name)
                report.total_s = time.perf_counter() - t0

    def _catch_up(self, name: str, end: int, report: TurnReport):
        """Bring model ``name``'s cache to ``end`` tokens: spans other models wrote are
        translated from the writer's cache, everything else is prefilled."""
        try:
            self._catch_up_spans(name, end, report)
        except BaseException:
            # Interrupted (Ctrl-C) or failed half-way: layers may disagree. Start this
            # model's cache afresh; its next turn catches up from the beginning.
            entry = self._models[name]
            entry.cache = make_prompt_cache(entry.model)
            self.transcript.processed[name] = 0
            self.transcript.translated[name] = 0
            raise

    def _catch_up_spans(self, name: str, end: int, report: TurnReport):
        entry = self._models[name]
        t0 = time.perf_counter()
        tokens = None
        missing: Dict[str, int] = {}
        for span in self.transcript.pending(name, end):
            lo, hi, writer = span.start, span.end, span.writer
            translator = self._translators.get((writer, name))
            held = min(hi, self.transcript.processed.get(writer, 0)) if writer != name else lo
            if translator is not None and held > lo:
                if tokens is None:
                    tokens = mx.array(self.transcript.tokens)[None]
                n_native = min(max(translator.spec.native_prefix, lo), held) - lo
                try:
                    entry.cache = translate_span(
                        self._models[writer].model, entry.model, translator,
                        self._models[writer].cache, entry.cache, tokens, held,
                    )
                except KvlingoError as e:  # e.g. a sliding-window source dropped the span
                    self._restore(name, lo)
                    report.warnings.append(
                        f"could not translate positions {lo}..{held - 1} from {writer} "
                        f"({e}); {name} prefilled them."
                    )
                else:
                    report.translated += held - lo - n_native
                    report.prefilled += n_native
                    report.translated_from[writer] = (
                        report.translated_from.get(writer, 0) + held - lo - n_native
                    )
                    self.transcript.translated[name] += held - lo - n_native
                    self.transcript.processed[name] = held
                    lo = held
            if lo < hi:
                if writer != name and translator is None:
                    missing[writer] = missing.get(writer, 0) + hi - lo
                prefill(entry.model, mx.array(self.transcript.tokens[lo:hi]), entry.cache)
                report.prefilled += hi - lo
                self.transcript.processed[name] = hi
        for writer, n in missing.items():
            report.warnings.append(
                f"no translator {writer} -> {name}: {name} prefilled the {n} tokens "
                f"{writer} wrote."
            )
        if entry.cache and entry.cache[0].keys is not None:
            mx.eval([(c.keys, c.values) for c in entry.cache])
        report.translate_s += time.perf_counter() - t0

    def _restore(self, name: str, length: int):
        """Trim model ``name``'s cache back to ``length`` tokens (after a failure)."""
        entry = self._models[name]
        extra = cache_length(entry.cache) - length
        if extra > 0 and not trim_prompt_cache(entry.cache, extra):
            entry.cache = make_prompt_cache(entry.model)
            self.transcript.processed[name] = 0
            self.transcript.translated[name] = 0
            self._catch_up(name, length, TurnReport(-1, name))
        self.transcript.processed[name] = length

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

    def _sync(self, name: str):
        """Make the bookkeeping agree with the cache (which never holds more than
        the transcript)."""
        length = cache_length(self._models[name].cache)
        if length > len(self.transcript):
            self._restore(name, len(self.transcript))
            length = len(self.transcript)
        self.transcript.processed[name] = length

    # -- rendering --------------------------------------------------------------

    def _uses_template(self) -> bool:
        tok = self._tokenizer()
        has = bool(getattr(tok, "chat_template", None))
        return has if self._use_template is None else (self._use_template and has)

    def _render(self, messages: List[Message]) -> str:
        if self._uses_template():
            return self._tokenizer().apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        return "".join(f"{m['role']}: {m['content']}\n\n" for m in messages) + "assistant:"

    def _render_piece(self, new_messages: List[Message]) -> List[int]:
        """Tokens to append for ``new_messages`` and the generation prompt: the text
        the template puts after the conversation so far.

        The last message already in the transcript is rendered with a sentinel as
        its content; everything after the sentinel is new (the closing of that
        message, the new messages, the generation prompt). Templates that rewrite
        earlier messages (e.g. strip reasoning) therefore cannot change tokens
        already in the caches.
        """
        tok = self._tokenizer()
        if not self.messages:
            first = ([{"role": "system", "content": self.system_prompt}]
                     if self.system_prompt else [])
            text = self._render(first + new_messages)
            new_messages[:0] = first
            return tok.encode(text, add_special_tokens=not self._uses_template())
        last = self.messages[-1]
        marked = self.messages[:-1] + [dict(last, content=_SENTINEL)]
        text = self._render(marked + new_messages)
        i = text.rfind(_SENTINEL)
        if i < 0:
            raise KvlingoError(
                "The chat template does not render the conversation's last message, so "
                "the transcript cannot be extended incrementally."
            )
        text = text[i + len(_SENTINEL):]
        if self._last_token_eos:
            # The answer ended with an end-of-turn token the template writes itself.
            eos = tok.decode(self.transcript.tokens[-1:])
            if eos and text.startswith(eos):
                text = text[len(eos):]
        return tok.encode(text, add_special_tokens=False) if text else []


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


# ---------------------------------------------------------------------------
# Translators for a session: load, or fit stage 1 once and keep it on disk


def _weights_id(model: nn.Module) -> str:
    """Identifies a model's weights cheaply: its weight files' names, sizes and
    times when it was loaded from a directory, else a sample of its parameters."""
    from mlx.utils import tree_flatten

    h = hashlib.sha256()
    path = Path(model_name(model))
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if files:
        for f in files:
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    else:
        for k, v in tree_flatten(model.parameters()):
            h.update(k.encode())
            h.update(np.array(v.reshape(-1)[:256].astype(mx.float32)).tobytes())
    return h.hexdigest()[:16]


def stage1_translator(
    source: nn.Module,
    source_tokenizer,
    target: nn.Module,
    target_tokenizer,
    cache_dir: Optional[Union[str, Path]] = None,
    tokens: int = 10_000,
    context_len: int = 256,
    log: Optional[Callable[[str], None]] = None,
) -> Translator:
    """A stage-1 translator source -> target fitted on the standard library's
    docstrings, kept in ``<cache_dir>/translators/`` and reused while both models'
    weights and the settings stay the same."""
    from .data import split_documents, stdlib_documents, token_windows
    from .fit import fit_stage1
    from .toy import default_cache_dir
    from .translator import load_translator

    if tokenizer_fingerprint(source_tokenizer) != tokenizer_fingerprint(target_tokenizer):
        raise KvlingoError("Stage-1 fitting here needs models that share a tokenizer.")
    key = hashlib.sha256(
        f"{_weights_id(source)}:{_weights_id(target)}:{tokens}:{context_len}:1".encode()
    ).hexdigest()[:16]
    path = Path(cache_dir or default_cache_dir()) / "translators" / f"stage1-{key}.safetensors"
    if path.is_file():
        try:
            return load_translator(path)
        except KvlingoError:
            pass  # damaged: fit again
    log = log or (lambda s: None)
    log(f"Fitting a stage-1 translator {model_name(source)} -> {model_name(target)} "
        f"on {tokens} positions of stdlib docstrings (once; kept in {path.parent}) ...")
    train_docs, _ = split_documents(stdlib_documents())
    stream: List[int] = []
    for _, text in train_docs:  # in name order; enough documents for `tokens` positions
        stream.extend(source_tokenizer.encode(text + "\n\n", add_special_tokens=False))
        if len(stream) >= 2 * tokens:
            break
    translator = Translator.for_models(source, target, source_tokenizer, target_tokenizer)
    windows = max(tokens // context_len, 1)
    fit_stage1(source, target, translator, token_windows(stream, context_len, 8, windows))
    translator.spec.training["corpus"] = "stdlib"
    translator.save(path)
    return translator


BUILTIN_NAMES = ("small", "large")


def builtin_session(
    cache_dir: Optional[Union[str, Path]] = None,
    fit_tokens: int = 10_000,
    log: Optional[Callable[[str], None]] = None,
    **session_kwargs,
) -> Session:
    """A session with the built-in pair: "small" (the qwen3 source) and "large" (the
    llama target), with stage-1 translators both ways (fitted once, cached)."""
    from .models import load
    from .toy import ensure_toy_pair

    src_dir, tgt_dir = ensure_toy_pair(cache_dir, log=log)
    small, small_tok = load(src_dir)
    large, large_tok = load(tgt_dir)
    session = Session({"small": (small, small_tok), "large": (large, large_tok)},
                      **session_kwargs)
    session.add_translator("small", "large", stage1_translator(
        small, small_tok, large, large_tok, cache_dir, fit_tokens, log=log))
    session.add_translator("large", "small", stage1_translator(
        large, large_tok, small, small_tok, cache_dir, fit_tokens, log=log))
    return session

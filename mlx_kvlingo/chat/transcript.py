"""A conversation's tokens as one tokenizer sees them, and who computed each span.

A :class:`~mlx_kvlingo.chat.session.Session` keeps one :class:`Transcript` per distinct
tokenizer (a *view*); models that share a tokenizer share a view and read each
other's spans position for position. Every position also records which *piece* of
message text it belongs to (or none: chat-template markers, BOS) and its character
range inside that piece, so a model with another tokenizer can find the tokens
that cover the same characters (``align.py``'s last-character rule).

Rendering is incremental: each turn appends only the text the chat template puts
after the conversation so far (the last message's content is replaced by a
sentinel and everything after it is new), so a transcript is always a
prefix-extension of the previous one and no cache is ever invalidated.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import KvlingoError
from ..translator.align import NATIVE, align_offsets, tokenize_with_offsets

TEMPLATE = -1  # piece id of positions that belong to no message text
_SENTINEL = "KVLINGO_SENTINEL_2f9c1_"

Offsets = List[Tuple[int, int]]


@dataclass
class Span:
    """Positions start..end-1, computed natively by ``writer``; ``writer`` None: by
    nobody yet (template tokens of a tokenizer the turn's model does not use:
    whoever reads them computes them itself)."""

    start: int
    end: int
    writer: Optional[str]
    kind: str  # "prompt", "generated", "read", "template"


class Transcript:
    """The conversation's tokens in one tokenization, which model wrote each span,
    and how many leading tokens each model's cache holds.

    ``processed[name]`` always equals the length of that model's cache. Everything
    a model has not processed yet is a list of spans (:meth:`pending`) to translate
    from their writers' caches or to compute natively.
    """

    def __init__(self, tokenizer=None, use_template: Optional[bool] = None):
        self.tokenizer = tokenizer
        self._use_template = use_template
        self.tokens: List[int] = []
        self.spans: List[Span] = []
        self.pieces: List[int] = []  # per position: the message-text piece, or TEMPLATE
        self.offsets: Offsets = []  # per position: characters inside its piece's text
        self.piece_range: Dict[int, Tuple[int, int]] = {}
        self.message_ends: List[int] = []  # per message: position after its content
        self.processed: Dict[str, int] = {}
        self.translated: Dict[str, int] = {}  # positions of each cache that were translated
        # Per model: ranges of its cache it did not compute itself (a catch-up that
        # translated, whole: its native tail and recomputed words included), so
        # what counts as an exact cache hit stays positional across truncations.
        self.foreign: Dict[str, List[Tuple[int, int]]] = {}
        # Per model: ranges of its cache that still hold translated rows (neither its
        # native tail nor recomputed since): what a later catch-up may recompute.
        self.still_translated: Dict[str, List[Tuple[int, int]]] = {}
        self.template_kwargs: dict = {}  # more arguments for the chat template (tools)
        self.last_token_eos = False

    def __len__(self) -> int:
        return len(self.tokens)

    def add_model(self, name: str):
        self.processed.setdefault(name, 0)
        self.translated.setdefault(name, 0)
        self.foreign.setdefault(name, [])
        self.still_translated.setdefault(name, [])

    def copy(self) -> "Transcript":
        """An independent copy (the tokenizer shared)."""
        out = Transcript(self.tokenizer, self._use_template)
        out.tokens, out.pieces, out.offsets = list(self.tokens), list(self.pieces), list(self.offsets)
        out.spans = [Span(s.start, s.end, s.writer, s.kind) for s in self.spans]
        out.piece_range = dict(self.piece_range)
        out.message_ends = list(self.message_ends)
        out.processed, out.translated = dict(self.processed), dict(self.translated)
        out.foreign = {name: list(r) for name, r in self.foreign.items()}
        out.still_translated = {name: list(r) for name, r in self.still_translated.items()}
        out.template_kwargs = dict(self.template_kwargs)
        out.last_token_eos = self.last_token_eos
        return out

    def mark_foreign(self, name: str, start: int, end: int):
        """Positions start..end-1 of ``name``'s cache were not computed by it."""
        if end > start:
            self.foreign[name].append((start, end))

    def clip_foreign(self, name: str):
        """Forget foreign (and still translated) ranges beyond what ``name``'s cache
        holds now."""
        held = self.processed[name]
        self.foreign[name] = [(a, min(b, held)) for a, b in self.foreign[name] if a < held]
        self.still_translated[name] = [(a, min(b, held)) for a, b in
                                       self.still_translated[name] if a < held]

    def own_positions(self, name: str) -> int:
        """Positions of ``name``'s cache that it computed itself (an exact cache)."""
        held = self.processed[name]
        covered, end = 0, 0
        for a, b in sorted(self.foreign[name]):
            a, b = max(a, end), min(b, held)
            if b > a:
                covered += b - a
                end = b
        return held - covered

    def append(self, tokens: Sequence[int], writer: Optional[str], kind: str,
               pieces: Optional[Sequence[int]] = None, offsets: Optional[Offsets] = None):
        """Append tokens written by ``writer`` (merged with the last span when the
        writer and kind are the same). ``pieces``/``offsets``: per token, default
        TEMPLATE / (0, 0)."""
        if not tokens:
            return
        start = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens)
        self.pieces.extend(pieces if pieces is not None else [TEMPLATE] * len(tokens))
        self.offsets.extend(offsets if offsets is not None else [(0, 0)] * len(tokens))
        for j in range(start, len(self.tokens)):
            p = self.pieces[j]
            if p != TEMPLATE:
                lo, _ = self.piece_range.get(p, (j, j))
                self.piece_range[p] = (lo, j + 1)
        last = self.spans[-1] if self.spans else None
        if last is not None and last.writer == writer and last.kind == kind and last.end == start:
            last.end = len(self.tokens)
        else:
            self.spans.append(Span(start, len(self.tokens), writer, kind))

    def set_offsets(self, start: int, offsets: Offsets):
        self.offsets[start:start + len(offsets)] = offsets

    def truncate(self, length: int):
        """Forget positions length.. (the caches are the caller's to trim)."""
        del self.tokens[length:], self.pieces[length:], self.offsets[length:]
        self.spans = [s for s in self.spans if s.start < length]
        if self.spans:
            self.spans[-1].end = min(self.spans[-1].end, length)
        self.piece_range = {p: (lo, min(hi, length)) for p, (lo, hi) in self.piece_range.items()
                            if lo < length}
        self.message_ends = [e for e in self.message_ends if e <= length]
        for name in self.processed:
            self.processed[name] = min(self.processed[name], length)
            self.clip_foreign(name)

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

    def writer_at(self, position: int) -> Optional[str]:
        for s in self.spans:
            if s.start <= position < s.end:
                return s.writer
        raise IndexError(position)

    # -- rendering ------------------------------------------------------------

    def uses_template(self) -> bool:
        has = bool(getattr(self.tokenizer, "chat_template", None))
        return has if self._use_template is None else (self._use_template and has)

    def render(self, messages: List[dict]) -> str:
        """The conversation as text, ending with the prompt for an assistant answer.
        Without a chat template: the plain format ``role: content`` + blank line per
        message, then ``assistant:``."""
        if self.uses_template():
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **self.template_kwargs
            )
        return "".join(f"{m['role']}: {m['content']}\n\n" for m in messages) + "assistant:"

    def render_new(self, old: List[dict], new: List[dict], new_pieces: Sequence[int]):
        """The text the template puts after the conversation ``old`` (whose contents
        are all in this transcript) for the messages ``new`` and the generation
        prompt: (text, [(piece, start, end) of each new message's content in it])."""
        marked = [dict(m, content=f"{_SENTINEL}{i}_") for i, m in enumerate(old + new)]
        text = self.render(marked)
        if old:
            mark = f"{_SENTINEL}{len(old) - 1}_"
            i = text.rfind(mark)
            if i < 0:
                raise KvlingoError(
                    "The chat template does not render the conversation's last message, "
                    "so the transcript cannot be extended incrementally."
                )
            text = text[i + len(mark):]
            if self.last_token_eos:
                # The answer ended with an end-of-turn token the template writes itself.
                eos = self.tokenizer.decode(self.tokens[-1:])
                if eos and text.startswith(eos):
                    text = text[len(eos):]
        out, ranges = "", []
        for k, (m, piece) in enumerate(zip(new, new_pieces)):
            mark = f"{_SENTINEL}{len(old) + k}_"
            i = text.find(mark)
            if i < 0:
                raise KvlingoError(f"The chat template dropped a {m['role']!r} message.")
            out += text[:i]
            ranges.append((piece, len(out), len(out) + len(m["content"])))
            out += m["content"]
            text = text[i + len(mark):]
        return out + text, ranges

    def render_chunk(self, old: List[dict], new: List[dict], new_pieces: Sequence[int]):
        """What to append for ``new`` messages and the generation prompt: (ids,
        pieces, offsets, ends), ``ends`` the positions (from the chunk's start) right
        after each new message's content (empty when the tokenizer gives no
        character offsets)."""
        text, ranges = self.render_new(old, new, new_pieces)
        if not text:
            return [], [], [], [0] * len(new)
        first = not old and not len(self) and not self.uses_template()
        ids, pieces, offsets, chars = self.tokenize(text, ranges, first, with_chars=True)
        ends = []
        if chars is not None:
            for _, _, hi in ranges:
                inside = [j for j, (a, b) in enumerate(chars) if a < b <= hi]
                ends.append(inside[-1] + 1 if inside else 0)
        return ids, pieces, offsets, ends

    def tokenize(self, text: str, ranges, add_special_tokens: bool, with_chars: bool = False):
        """Token ids of ``text`` and, per token, its piece and characters inside it:
        a token belongs to the message content holding its last character."""
        try:
            ids, offs = tokenize_with_offsets(self.tokenizer, text, add_special_tokens)
        except KvlingoError:  # a slow tokenizer: no offsets, so nothing to align by
            ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
            out = ids, [TEMPLATE] * len(ids), [(0, 0)] * len(ids)
            return out + (None,) if with_chars else out
        pieces, offsets = [], []
        for a, b in offs:
            for piece, lo, hi in ranges:
                if b > a and lo <= b - 1 < hi:
                    pieces.append(piece)
                    offsets.append((max(a, lo) - lo, b - lo))
                    break
            else:
                pieces.append(TEMPLATE)
                offsets.append((0, 0))
        return (ids, pieces, offsets, offs) if with_chars else (ids, pieces, offsets)


def ids_offsets(tokenizer, ids: Sequence[int], text: str) -> Offsets:
    """Character ranges inside ``text`` (the decoded ``ids``) of each token: a token
    ends where the decoding of the ids up to it stops agreeing with ``text`` (a
    partial UTF-8 character decodes to U+FFFD until its last byte arrives); tokens
    without text (end of turn) get empty ranges."""
    out, prev = [], 0
    for k in range(1, len(ids) + 1):
        t = tokenizer.decode(list(ids[:k]), skip_special_tokens=True)
        n = 0
        limit = min(len(t), len(text))
        while n < limit and t[n] == text[n]:
            n += 1
        end = max(n, prev)
        out.append((prev, end))
        prev = end
    return out


def align_pieces(source: Transcript, target: Transcript, lo: int, hi: int) -> List[int]:
    """For target positions lo..hi-1: the source position whose token holds the
    last character of the target token within the same message piece, or NATIVE
    (template tokens, pieces the source does not hold)."""
    out = []
    j = lo
    while j < hi:
        p = target.pieces[j]
        k = j
        while k < hi and target.pieces[k] == p:
            k += 1
        if p == TEMPLATE or p not in source.piece_range:
            out += [NATIVE] * (k - j)
        else:
            s_lo, s_hi = source.piece_range[p]
            t_off = target.offsets[j:k]
            idx = align_offsets(source.offsets[s_lo:s_hi], t_off, native_prefix=0)
            out += [NATIVE if i == NATIVE or b <= a else s_lo + i
                    for i, (a, b) in zip(idx, t_off)]
        j = k
    return out


def leading_specials(view: Transcript) -> int:
    """1 when the view starts with its tokenizer's BOS, else 0: a no-context
    baseline keeps it (Gemma is off distribution without its BOS)."""
    bos = getattr(view.tokenizer, "bos_token_id", None)
    return int(bos is not None and bool(view.tokens) and view.tokens[0] == bos)

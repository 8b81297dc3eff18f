"""Selected context positions recomputed by the target on top of a translated cache.

A translated cache keeps the gist of a context but loses exact facts: the
question's queries no longer find a fact's tokens through their translated keys.
Giving the target's own K/V to the few tokens that carry a fact brings the recall
back. Their own K/V depend on everything before them, so each selected *span* of
positions a..b-1 is recomputed with its queries attending to the cache before a
(translated, or recomputed by an earlier span) and to the span itself; its new K/V
replace the translated ones. All spans go through the target in one pass, as one
sequence whose tokens are each roped at their own position: n recomputed positions
of a T-token context cost about n / T of a re-prefill, plus one pass's fixed overhead.
A switch folds that pass into its first step (:func:`recompute_and_read`): the
tokens it reads after the context ride in the same sequence.

Sliding-window layers attend to the positions before a within their window. A
switch keeps only the last window's worth, so it translates the older rows a
recompute reads beside the cache (kernel.History), and the pass reads them there;
a conversation's catch-up keeps them as it writes them. Without them
(:func:`recompute_spans` without ``history``), a span older than the window sees
only itself, and the recomputed positions within its window, in those layers.
"""

import bisect
import re
import time
from contextlib import contextmanager
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache

from .. import cpu_math
from ..errors import KvlingoError
from ..models.cache import last_logits
from ..models.rope import RopeTables, apply_rope_tables

Span = Tuple[int, int]


class _PassView:
    """One layer cache as the target's layers see it during the single pass that
    recomputes every selected position at once.

    The selected positions are read as one sequence, each token roped at its own
    position (:class:`_PositionedRope`). The layer's keys and values are laid out
    by position, ``first``..end-1 (a sliding-window layer's unheld positions are
    zeros and masked); the pass's new rows are written over their positions before
    the attention, and every query attends to the positions up to its own. So a
    selected position sees the translated rows before it and the recomputed ones
    (at the same layer, from this very pass), exactly what recomputing the spans
    one after the other gives, in one pass over the weights.

    ``first``: the oldest position the layout holds. A sliding-window layer's view
    starts a window before the pass's earliest query (no query reaches further), so
    a probe of the last tokens of a long context attends over one window there, not
    over the whole context (scaled_dot_product_attention gets the view as its
    ``cache``: :attr:`first` says where its key rows start)."""

    offset = 0  # unused: _PositionedRope ropes every token at its own position

    def __init__(self, keys: mx.array, values: mx.array, held: mx.array, positions: mx.array,
                 selected: mx.array, first: int = 0):
        self.keys, self.values = keys, values  # [1, H, end - first, D], by position
        self.held = held  # [end - first] bool: positions this layer has rows for
        self.positions = positions  # [n] the selected positions, in order
        self.selected = selected  # [end - first] bool
        self.first = first
        self.new_keys = self.new_values = None  # [1, H, n, D]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.new_keys, self.new_values = keys, values
        k, v = self.keys, self.values
        rows = self.positions - self.first if self.first else self.positions
        k[:, :, rows] = keys.astype(k.dtype)
        v[:, :, rows] = values.astype(v.dtype)
        return k, v

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        query = self.positions[:, None]
        key = self.first + mx.arange(self.keys.shape[2])[None]
        allowed = (key <= query) & (self.held | self.selected)[None]
        if window_size is not None:
            allowed = allowed & (query - key < window_size)
        return allowed


def pass_views(cache: List, end: int, top: int, history: Optional[dict], positions: mx.array,
               earliest: int) -> List[_PassView]:
    """One :class:`_PassView` per layer of ``cache`` for a pass that reads
    ``positions`` (of 0..top-1; the earliest is ``earliest``) on a cache of ``end``
    positions; ``history``: rows older than a sliding layer keeps
    (kernel.History.layers)."""
    selected = mx.zeros((top,), dtype=mx.bool_)
    selected[positions] = True
    history = history or {}
    views = []
    for i, c in enumerate(cache):
        keys, values, held = _by_position(c, end, top, history.get(i))
        # A sliding-window layer: no query of the pass reaches a window before the
        # earliest one (mlx-lm sizes its rotating cache to the window).
        first = (max(earliest - c.max_size + 1, 0) if isinstance(c, RotatingKVCache)
                 and c.max_size else 0)
        views.append(_PassView(keys[..., first:, :], values[..., first:, :], held[first:],
                               positions, selected[first:], first))
    return views


class _PositionedRope(nn.Module):
    """A layer's rope applied at given positions, one per token (mlx's rope takes one
    offset per sequence): its own cos/sin tables (models.rope), gathered."""

    def __init__(self, rope: nn.Module, tables: mx.array):
        super().__init__()
        self.rope, self.tables = rope, tables

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        return apply_rope_tables(x, self.tables, self.rope)


@contextmanager
def _roped_at(target: nn.Module, positions: mx.array, end: int):
    """Within the block every attention layer of ``target`` ropes token i at
    ``positions[i]``; the layers' own ropes are put back after it."""
    layers = [layer.self_attn for layer in target.layers]
    tables = RopeTables(target)
    originals = [attn.rope for attn in layers]
    gathered = {}  # one gather per distinct table (most models: one rope for all layers)
    try:
        for i, attn in enumerate(layers):
            t = tables(i, 0, end, tables.layers[i].head_dim)
            if id(t) not in gathered:
                gathered[id(t)] = t[positions]
            attn.rope = _PositionedRope(originals[i], gathered[id(t)])
        yield
    finally:
        for attn, rope in zip(layers, originals):
            attn.rope = rope


def _rotating_rows(c, lo: int, hi: int) -> List[Tuple[int, int, int]]:
    """(position, buffer row, count) runs holding positions lo..hi-1 of a rotating
    layer cache, at most two (where the buffer wraps around). Position p sits at row
    (_idx - offset + p) mod rows, whether or not the buffer has wrapped yet."""
    rows = c.keys.shape[2]
    runs, p = [], lo
    while p < hi:
        row = (c._idx - c.offset + p) % rows
        n = min(hi - p, rows - row)
        runs.append((p, row, n))
        p += n
    return runs


def _first_held(c, end: int) -> int:
    """The oldest position layer cache ``c`` holds (0 but for a sliding window)."""
    if isinstance(c, RotatingKVCache):
        return end - min(end, c.keys.shape[2], c.max_size)
    if isinstance(c, KVCache):
        return 0
    raise KvlingoError(f"Cannot recompute positions in a {type(c).__name__}.")


def _by_position(c, end: int, top: int, older: Optional[Tuple] = None
                 ) -> Tuple[mx.array, mx.array, mx.array]:
    """Layer cache ``c``'s keys and values of positions 0..top-1 in position order
    (positions it does not hold, before a sliding window or from ``end`` on: zeros),
    and which positions it holds. ``older``: (lo, keys, values), rows of positions
    lo.. before the ones ``c`` holds (kernel.History), held too where they run on
    up to them."""
    first = _first_held(c, end)
    B, H, _, D = c.keys.shape
    Dv = c.values.shape[-1]
    if isinstance(c, RotatingKVCache):
        runs = _rotating_rows(c, first, end)
        k = [c.keys[..., r: r + n, :] for _, r, n in runs]
        v = [c.values[..., r: r + n, :] for _, r, n in runs]
    else:
        k, v = [c.keys[..., :end, :]], [c.values[..., :end, :]]
    lo = first
    if older is not None and first and older[0] < first <= older[0] + older[1].shape[2]:
        lo, ok, ov = older
        k.insert(0, ok[..., : first - lo, :].astype(c.keys.dtype))
        v.insert(0, ov[..., : first - lo, :].astype(c.values.dtype))
    if lo:
        k.insert(0, mx.zeros((B, H, lo, D), c.keys.dtype))
        v.insert(0, mx.zeros((B, H, lo, Dv), c.values.dtype))
    if top > end:
        k.append(mx.zeros((B, H, top - end, D), c.keys.dtype))
        v.append(mx.zeros((B, H, top - end, Dv), c.values.dtype))
    keys = k[0] if len(k) == 1 else mx.concatenate(k, axis=2)
    values = v[0] if len(v) == 1 else mx.concatenate(v, axis=2)
    positions = mx.arange(top)
    return keys, values, (positions >= lo) & (positions < end)


def _write_rows(c, keys: mx.array, values: mx.array, positions: Sequence[int], end: int):
    """Write new rows (in ``positions`` order) into layer cache ``c``, skipping the
    positions it does not hold (before a sliding window)."""
    first = _first_held(c, end)
    keep = [i for i, p in enumerate(positions) if p >= first]
    if not keep:
        return
    if isinstance(c, RotatingKVCache):
        rows = c.keys.shape[2]
        where = [(c._idx - c.offset + positions[i]) % rows for i in keep]
    else:
        where = [positions[i] for i in keep]
    take, where = mx.array(keep), mx.array(where)
    c.keys[..., where, :] = keys[..., take, :].astype(c.keys.dtype)
    c.values[..., where, :] = values[..., take, :].astype(c.values.dtype)


def recompute_spans(target: nn.Module, cache: List, tokens: Sequence[int],
                    spans: Sequence[Span], history: Optional[dict] = None) -> float:
    """Recompute the positions of each span [a, b) of ``cache`` (which holds
    ``tokens[:T]``, T >= every b) natively, as if span after span in position order:
    each attends to the cache before it, earlier spans already recomputed, and to
    itself. All spans go through the target in one pass. ``history``: layer ->
    (lo, keys, values), rows older than a sliding layer keeps (kernel.History).
    Returns the seconds taken."""
    t0 = time.perf_counter()
    if spans:
        _one_pass(target, cache, tokens, spans, history=history)
    return time.perf_counter() - t0


def recompute_and_read(target: nn.Module, cache: List, tokens: Sequence[int],
                       spans: Sequence[Span], inputs: Sequence[int], keep: int = 1,
                       history: Optional[dict] = None) -> mx.array:
    """:func:`recompute_spans`, and the target reading ``inputs`` (the tokens after
    the cache's end), in one pass over its weights: the inputs attend to the
    recomputed positions as if read after the recompute. Returns the logits
    [1, keep, vocab] of the last ``keep`` inputs (models.cache.last_logits); the
    cache then holds the inputs too.

    A switch's first step reads its pending tokens anyway; folding the recompute
    into it saves a pass, whose fixed cost (the weights read once more, a small
    model's LM head) is a good part of a small recompute's time."""
    if not len(inputs):
        raise KvlingoError("Nothing to read: inputs is empty.")
    if not spans:
        # A short prefill too (a long native tail, a long new message): numpy's
        # softmax and activations, as a re-prefill's. Under MLX's own, a tail of 128
        # read on ~384 translated positions took 1.31 s against the 0.95 s of
        # prefilling 128 tokens (Gemma 3 270M): 0.1 of a 512-token re-prefill.
        cpu_math.install(target)
        with cpu_math.numpy_passes():
            logits = last_logits(target, mx.array([list(inputs)]), cache, keep)
            mx.eval(logits)
        return logits
    return _one_pass(target, cache, tokens, spans, list(inputs), keep, history)


def _one_pass(target: nn.Module, cache: List, tokens: Sequence[int], spans: Sequence[Span],
              inputs: Sequence[int] = (), keep: int = 1, history: Optional[dict] = None
              ) -> Optional[mx.array]:
    """The selected positions, then ``inputs`` at the positions after the cache's
    end, as one sequence through the target (see :class:`_PassView`)."""
    spans = sorted(spans)
    end = min(c.offset for c in cache)
    for (a, b), nxt in zip(spans, spans[1:] + [(end, end)]):
        if not 0 <= a < b <= end:
            raise KvlingoError(f"Cannot recompute positions {a}..{b - 1} of a "
                               f"{end}-position cache.")
        if b > nxt[0]:
            raise KvlingoError(f"Spans to recompute overlap: {a}..{b - 1} and "
                               f"{nxt[0]}..{nxt[1] - 1}.")
    chosen = [p for a, b in spans for p in range(a, b)]
    top = end + len(inputs)
    positions = mx.array(chosen + list(range(end, top)))
    views = pass_views(cache, end, top, history, positions, (chosen or [end])[0])
    ids = mx.array([[tokens[p] for p in chosen] + list(inputs)])
    logits = None
    # The pass is a short prefill: its softmax and activations in numpy on a CPU, as
    # models.prefill's (cpu_math; a re-prefill it is compared with does the same).
    cpu_math.install(target)
    with _roped_at(target, positions, top), cpu_math.numpy_passes():
        if len(inputs):
            logits = last_logits(target, ids, views, keep)
        else:
            target.model(ids, cache=views)
    n = len(chosen)
    for c, view in zip(cache, views):
        _write_rows(c, view.new_keys[..., :n, :], view.new_values[..., :n, :], chosen, end)
        if len(inputs):  # appended as a forward pass appends them
            c.update_and_fetch(view.new_keys[..., n:, :], view.new_values[..., n:, :])
    mx.eval([(c.keys, c.values) for c in cache] + ([logits] if logits is not None else []))
    return logits


def merge_spans(positions: Sequence[int], before: int = 0, after: int = 0, gap: int = 0,
                lo: int = 1, hi: Optional[int] = None) -> List[Span]:
    """Spans covering each position widened by ``before``/``after`` tokens, within
    [lo, hi), spans at most ``gap`` apart joined (one pass each: fewer passes)."""
    spans: List[List[int]] = []
    for p in sorted(set(positions)):
        a, b = max(p - before, lo), p + after + 1
        if hi is not None:
            b = min(b, hi)
        if a >= b:
            continue
        if spans and a <= spans[-1][1] + gap:
            spans[-1][1] = max(spans[-1][1], b)
        else:
            spans.append([a, b])
    return [(a, b) for a, b in spans]


# ---------------------------------------------------------------------------
# Which positions: words that carry facts, chosen from the context alone
#
# A fact's value is what no model can guess: a number, an identifier, a name, a
# rare word. Such words stand out in the text itself (digits, underscores or inner
# capitals, a capital inside a sentence) and in the tokenizer (a word it splits
# into several pieces is one it rarely saw). The question is not known when the
# cache is switched, so nothing here looks at it.

_WORD = re.compile(r"[A-Za-z0-9_]+(?:[.'-][A-Za-z0-9_]+)*")

# The items of a list are ordinary words, but which of them came where is a fact
# no model can guess: an enumeration of three or more short items ("a, b, c and
# d"; "x, y, or z") or a bulleted line marks its words as worth keeping.
_ITEM = r"[A-Za-z][\w'-]*(?: [A-Za-z][\w'-]*){0,2}"
_LIST_END = re.compile(rf"\b{_ITEM}, {_ITEM},? (?:and|or) {_ITEM}")
_ITEM_BEFORE = re.compile(rf"\b{_ITEM}, $")
_BULLET = re.compile(r"^[ \t]*(?:[-*\u2022]|\d+[.)])[ \t]+\S.*$", re.MULTILINE)
# A number of this many digits or more (a code, a PIN, an amount) ranks above an
# identifier: a model can guess much of "CalledProcessError" from its words, nothing of
# "743293". Without it, in API documentation the class names took the fact-like words'
# share of the budget and numbers stated once were lost (Gemma 3 -> SmolLM2, ~1,100
# tokens, 96 positions: 6 of 12 numbers recalled, the re-prefill 10; with the rank 8).
LONG_NUMBER = 4
_FUNCTION_WORDS = frozenset("a an the and or of to in on at for with by from".split())
_LIST_ITEM_SCORE = 3.0  # above a capitalised or a long word, below a rare name or a number


def list_regions(text: str) -> List[Tuple[int, int]]:
    """Character ranges of the text's enumerations and bulleted lines, in order.

    An enumeration is found by its end ("x, y and z"), then extended item by item
    backwards: one regex over the whole list would try again from every word of a
    long comma-separated run with no "and" (an argument list), quadratic in it."""
    found = []
    for m in _LIST_END.finditer(text):
        a = m.start()
        while (before := _ITEM_BEFORE.search(text, max(a - 64, 0), a)) is not None:
            a = before.start()
        found.append((a, m.end()))
    found += [m.span() for m in _BULLET.finditer(text)]
    return sorted(found)


_EMPHASIS = re.compile(r"_([A-Za-z][A-Za-z'-]*)_")  # _word_: Markdown / plain-text italics


def _plain(word: str) -> str:
    """The word without emphasis markup (``_word_``: not an identifier)."""
    emphasis = _EMPHASIS.fullmatch(word)
    return emphasis.group(1) if emphasis else word


def _word_score(word: str, pieces: int, sentence_start: bool) -> float:
    score = 0.0
    digits = sum(ch.isdigit() for ch in word)
    if digits:
        score += 3
    if digits >= LONG_NUMBER:  # a code, a PIN, a port: nothing about it can be guessed
        score += 5  # above any identifier, however its tokenizer splits it
    if "_" in word or re.search(r"[a-z][A-Z]", word):
        score += 3
    if word[0].isupper() and not sentence_start:
        score += 2
    if not score:  # only rare: a long ordinary word splits too, so it ranks below a list
        return min(pieces - 1, _LIST_ITEM_SCORE - 0.5) if pieces >= 3 else 0.0
    return score + min(pieces - 1, 3)


def word_spans(text: str, offsets: Sequence[Tuple[int, int]], lo: int = 0,
               hi: Optional[int] = None) -> List[Span]:
    """Token spans [a, b) of lo..hi-1 that make one word of several tokens: each
    token starts where the one before it ends, between two letters, digits or
    underscores (a number split digit by digit, an identifier in pieces)."""
    hi = len(offsets) if hi is None else min(hi, len(offsets))
    out, start = [], lo
    for i in range(lo + 1, hi + 1):
        joined = (i < hi and offsets[i - 1][1] == offsets[i][0] > 0
                  and offsets[i][1] > offsets[i][0] and offsets[i - 1][1] > offsets[i - 1][0]
                  and _word_char(text[offsets[i][0]]) and _word_char(text[offsets[i - 1][1] - 1]))
        if not joined:
            if i - start > 1:
                out.append((start, i))
            start = i
    return out


def _word_char(c: str) -> bool:
    return c.isalnum() or c == "_"


def salient_words(text: str, offsets: Sequence[Tuple[int, int]], lo: int = 0,
                  hi: Optional[int] = None) -> List[Tuple[float, List[int]]]:
    """(score, token positions) of every fact-like word whose tokens lie in
    positions lo..hi-1, best first (ties: earlier first)."""
    hi = len(offsets) if hi is None else hi
    starts = [a for a, b in offsets]
    lists = list_regions(text)
    list_starts = [a for a, _ in lists]
    words = []
    for m in _WORD.finditer(text):
        a, b = m.span()
        first = bisect.bisect_right(starts, a) - 1
        positions, i = [], max(first, lo)
        while i < hi and offsets[i][0] < b:  # tokens start in order: stop past the word
            if offsets[i][1] > a:
                positions.append(i)
            i += 1
        if not positions:
            continue
        j = a - 1  # the character before the word's preceding spaces (no copy of the text)
        while j >= 0 and text[j].isspace():
            j -= 1
        sentence_start = j < 0 or text[j] in ".!?:\n\"'("
        word = _plain(m.group())
        score = _word_score(word, len(positions), sentence_start)
        r = bisect.bisect_right(list_starts, a) - 1
        if (not score and r >= 0 and lists[r][1] >= b
                and m.group().lower() not in _FUNCTION_WORDS):
            score = _LIST_ITEM_SCORE
        if score:
            words.append((score, positions, word.lower()))
    return _once_each(words)


_REPEAT_PENALTY = 0.5


def _once_each(words: List[Tuple[float, List[int], str]]) -> List[Tuple[float, List[int]]]:
    """Each distinct word once, at its first occurrence (where it is introduced: a
    definition, a fact stated), best first. A word said again and again (a story's
    characters, a module's common names) scores a little less for every repeat: a
    fact stated once is what a translated cache loses and nothing else restates."""
    first, count = {}, {}
    for score, positions, key in words:
        count[key] = count.get(key, 0) + 1
        first.setdefault(key, (score, positions))
    out = [(score - _REPEAT_PENALTY * (count[key] - 1), positions)
           for key, (score, positions) in first.items()]
    out.sort(key=lambda w: (-w[0], w[1][0]))
    return out


def salient_spans(text: str, offsets: Sequence[Tuple[int, int]], budget: int, lo: int = 1,
                  hi: Optional[int] = None, before: int = 6, after: int = 1) -> List[Span]:
    """Spans to recompute, at most ``budget`` positions in all: the best fact-like
    words of ``text`` (tokenized at ``offsets``), each with the ``before`` tokens
    that lead up to it (what a later mention repeats: "the code is") and
    ``after`` behind it, within positions lo..hi-1."""
    chosen: List[int] = []
    spans: List[Span] = []
    for _, positions in salient_words(text, offsets, lo, hi):
        trial = merge_spans(chosen + positions, before, after, gap=2, lo=lo, hi=hi)
        if sum(b - a for a, b in trial) > budget:
            continue
        chosen += positions
        spans = trial
    return spans


def token_offsets(tokenizer, ids: Sequence[int]) -> Tuple[str, List[Tuple[int, int]]]:
    """(text, character offsets of each token) for token ids without their text: each
    token's own decoding, concatenated (a character split over two byte-level tokens
    comes out as replacement characters, which no fact-like word needs)."""
    pieces = [tokenizer.decode([i]) for i in ids]
    offsets, at = [], 0
    for p in pieces:
        offsets.append((at, at + len(p)))
        at += len(p)
    return "".join(pieces), offsets

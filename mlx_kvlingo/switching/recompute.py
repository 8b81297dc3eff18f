"""Selected context positions recomputed by the target on top of a translated cache.

A translated cache keeps the gist of a context but loses exact facts: the
question's queries no longer find a fact's tokens through their translated keys.
Giving the target's own K/V to the few tokens that carry a fact brings the recall
back. Their own K/V depend on everything before them, so each selected *span* of
positions a..b-1 is run through the target once, its queries attending to the
cache before a (translated, or recomputed by an earlier span) and to the span
itself, in order; its new K/V replace the translated ones. A span costs about
(b - a) / T of a re-prefill of T tokens, plus one pass's fixed overhead.

Sliding-window layers attend to the positions before a that the translated cache
still holds (a switch keeps only a window's worth); a span older than that sees
only itself in those layers.
"""

import bisect
import re
import time
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..errors import KvlingoError

Span = Tuple[int, int]


class _SpanView:
    """A layer cache as the target's layers see it while one span is recomputed:
    the keys held before the span, then the span's own. Nothing is written to the
    real cache here; the span's keys and values are kept for the caller."""

    def __init__(self, keys: Optional[mx.array], values: Optional[mx.array], start: int):
        self.prefix_keys, self.prefix_values = keys, values
        self.offset = start  # the span's first position: the model ropes from here
        self.keys = self.values = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.keys, self.values = keys, values
        if self.prefix_keys is None:
            return keys, values
        return (mx.concatenate([self.prefix_keys, keys], axis=2),
                mx.concatenate([self.prefix_values, values], axis=2))

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        held = 0 if self.prefix_keys is None else self.prefix_keys.shape[2]
        queries = mx.arange(self.offset, self.offset + N)[:, None]
        keys = mx.arange(self.offset - held, self.offset + N)[None]
        allowed = keys <= queries
        if window_size is not None:
            allowed = allowed & (queries - keys < window_size)
        return allowed


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


def _held_before(c, start: int) -> Tuple[Optional[mx.array], Optional[mx.array]]:
    """Keys and values of the positions up to ``start`` that layer cache ``c`` holds,
    as a contiguous run ending at start - 1 (a sliding window's worth at most)."""
    if isinstance(c, RotatingKVCache):
        if c.keys is None:
            return None, None
        first = c.offset - min(c.offset, c.keys.shape[2], c.max_size)
        lo = max(first, start - c.max_size + 1)
        if lo >= start:
            return None, None
        runs = _rotating_rows(c, lo, start)
        k = [c.keys[..., r : r + n, :] for _, r, n in runs]
        v = [c.values[..., r : r + n, :] for _, r, n in runs]
        return mx.concatenate(k, axis=2), mx.concatenate(v, axis=2)
    if isinstance(c, KVCache):
        if c.keys is None or start == 0:
            return None, None
        return c.keys[..., :start, :], c.values[..., :start, :]
    raise KvlingoError(f"Cannot recompute positions in a {type(c).__name__}.")


def _write_span(c, keys: mx.array, values: mx.array, start: int):
    """Replace the rows of positions start.. in layer cache ``c`` (rows it does not
    hold, before a sliding window, are skipped)."""
    n = keys.shape[2]
    if isinstance(c, RotatingKVCache):
        first = c.offset - min(c.offset, c.keys.shape[2], c.max_size)
        lo = max(start, first)
        for p, row, m in _rotating_rows(c, lo, start + n):
            c.keys[..., row : row + m, :] = keys[..., p - start : p - start + m, :].astype(
                c.keys.dtype)
            c.values[..., row : row + m, :] = values[..., p - start : p - start + m, :].astype(
                c.values.dtype)
        return
    c.keys[..., start : start + n, :] = keys.astype(c.keys.dtype)
    c.values[..., start : start + n, :] = values.astype(c.values.dtype)


def recompute_spans(target: nn.Module, cache: List, tokens: Sequence[int],
                    spans: Sequence[Span]) -> float:
    """Recompute the positions of each span [a, b) of ``cache`` (which holds
    ``tokens[:T]``, T >= every b) natively, in order. Returns the seconds taken."""
    t0 = time.perf_counter()
    length = min(c.offset for c in cache)
    body = target.model
    for a, b in sorted(spans):
        if not 0 <= a < b <= length:
            raise KvlingoError(f"Cannot recompute positions {a}..{b - 1} of a "
                               f"{length}-position cache.")
        views = [_SpanView(*_held_before(c, a), a) for c in cache]
        body(mx.array([list(tokens[a:b])]), cache=views)
        for c, view in zip(cache, views):
            _write_span(c, view.keys, view.values, a)
        mx.eval([(c.keys, c.values) for c in cache])
    return time.perf_counter() - t0


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


def _word_score(word: str, pieces: int, sentence_start: bool) -> float:
    score = 0.0
    if any(ch.isdigit() for ch in word):
        score += 3
    if "_" in word or re.search(r"[a-z][A-Z]", word):
        score += 3
    if word[0].isupper() and not sentence_start:
        score += 2
    return score + min(pieces - 1, 3) if score or pieces >= 3 else 0.0


def salient_words(text: str, offsets: Sequence[Tuple[int, int]], lo: int = 0,
                  hi: Optional[int] = None) -> List[Tuple[float, List[int]]]:
    """(score, token positions) of every fact-like word whose tokens lie in
    positions lo..hi-1, best first (ties: earlier first)."""
    hi = len(offsets) if hi is None else hi
    starts = [a for a, b in offsets]
    words = []
    for m in _WORD.finditer(text):
        a, b = m.span()
        first = bisect.bisect_right(starts, a) - 1
        positions = [i for i in range(max(first, lo), hi) if offsets[i][0] < b
                     and offsets[i][1] > a]
        if not positions:
            continue
        before = text[:a].rstrip()
        sentence_start = not before or before[-1] in ".!?:\n\"'("
        score = _word_score(m.group(), len(positions), sentence_start)
        if score:
            words.append((score, positions))
    words.sort(key=lambda w: (-w[0], w[1][0]))
    return words


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

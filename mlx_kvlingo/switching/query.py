"""Which positions to recompute: the ones the question reads.

At a switch the target is about to read the question anyway: the pending tokens of
a one-shot switch (its native tail and the context's last token), or the turn's
new messages in a conversation. Read once on the translated cache, the question's
queries show where in the context it looks for its answer; those positions (and a
few neighbours on each side, the words that lead up to a fact and follow it) are
recomputed natively, and the question is read again on the repaired cache, in the
same pass as the recompute (:func:`~.recompute.recompute_and_read`). A fact in
plain words ("under the piano") looks like nothing to a word list; the question
about it ("the key was hidden under the") attends to it.

The reading is a probe: nothing is written to the cache. Its cost is one more pass
of the target over the short question. The score of a context position is, summed
over the target's layers (divided by the number of layers that see it:
``per_layer_seen``), the largest attention any head of the question's *last*
token gives it: that token predicts the answer's first word, and a head that
retrieves a fact puts its mass on the fact even when most heads look at the
recent tokens (docs/design.md compares the ways of scoring that were measured).
The attention sink (positions below ``lo``) and the question itself are not
scored.

The source's probe of a one-shot switch also says whether to recompute at all
(:func:`last_token_reading`): how far what comes next reaches back. Text that just
goes on is better served by a long native tail (switching.choice.long_tail_for).
"""

import sys
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import cpu_math
from ..errors import KvlingoError
from ..models.cache import BODY_THEN_HEAD
from ..translator.align import Alignment
from .recompute import Span, _roped_at, merge_spans, pass_views

# Neighbours recomputed with a position the question reads: the tokens that lead up
# to it and follow it (the last token attends to the answer's first token; the
# answer may run on for a word or two).
BEFORE = 2
AFTER = 2


# A question shorter than this (a one-shot switch without a native tail reads only
# the context's last token) is read with the context's tokens before it.
MIN_QUESTION = 16


def question_scores(target: nn.Module, cache: List, tokens: Sequence[int], start: int,
                    lo: int = 1, history: Optional[dict] = None,
                    per_layer_seen: bool = True) -> np.ndarray:
    """How much the target, reading ``tokens[start:]`` (the question) on ``cache``,
    attends to each position lo..start-1 (see the module's docstring): an array of
    start - lo scores. ``cache`` holds ``tokens[:end]`` for some end >= start - 1;
    question positions it holds are read again, the others after them, as in a
    recompute pass (:class:`~.recompute._PassView`): the cache is left as it was.
    ``history``: rows older than a sliding layer keeps (kernel.History.layers).
    ``per_layer_seen`` (what a switch and a catch-up use): each position's sum
    divided by the number of layers whose view holds it (a sliding-window layer does
    not see a distant position, which the sum would rank below recent ones for that
    alone); False: the plain sum."""
    return _probe(target, cache, tokens, start, lo, history, per_layer_seen)[0]


def last_token_reading(model: nn.Module, cache: List, tokens: Sequence[int], near: int,
                       lo: int = 1, vocab: Optional[Sequence[int]] = None, steps: int = 1,
                       enough: Optional[float] = None) -> Tuple[np.ndarray, float]:
    """The scores :func:`question_scores` gives positions lo..n-2 as the last of the
    n ``tokens`` reads them, and the *reach* of what comes next, from one pass (and
    one more per step after the first).

    The reach is the KL divergence (nats) of the model's next-token distribution
    when the last token attends only to the attention sink (positions below lo) and
    the ``near`` positions before it, from its distribution attending to
    everything: how much what comes next needs the distant context. Text that goes
    on needs little of it; a question about a fact stated far back needs it. The
    same token is read twice in the pass, both rows at its position: the second row
    has its own key row (:class:`_NearView`), so the weights are read once.
    ``steps`` > 1: both readings go on with the full one's likeliest token, and the
    reach is the largest of the steps' (the answer to "The PIN is" starts with a
    space any reading predicts; its digits are the next step's); ``enough``: no
    step after one whose reach is above it (the largest is above it already).
    ``vocab``: the token ids the two distributions are taken over (renormalized;
    None: the whole vocabulary). A large vocabulary's head is most of a small
    model's weights (Gemma 3 270M: 62 %): the context's own tokens, where a
    distant fact's answer lies, cost a gather instead."""
    scores, reaches = last_token_reaches(model, cache, tokens, near, lo, vocab, steps, enough)
    return scores, max(reaches, default=0.0)


def last_token_reaches(model: nn.Module, cache: List, tokens: Sequence[int], near: int,
                       lo: int = 1, vocab: Optional[Sequence[int]] = None, steps: int = 1,
                       enough: Optional[float] = None) -> Tuple[np.ndarray, List[float]]:
    """:func:`last_token_reading`'s scores and each step's reach (none for a
    context of lo tokens or fewer)."""
    scores, hidden, views = _probe(model, cache, tokens, len(tokens) - 1, lo, None, True,
                                   near=near)
    if hidden is None:
        return scores, []
    ids = None if vocab is None else mx.array(sorted(set(int(i) for i in vocab)))
    reaches, top = [], len(tokens)
    for step in range(steps):
        logits = head_logits(model, hidden, ids).astype(mx.float32)
        reaches.append(_kl(logits[1], logits[0]))
        if step + 1 == steps or (enough is not None and reaches[-1] > enough):
            break
        token = int(mx.argmax(logits[1]).item())
        token = token if ids is None else int(ids[token].item())
        position = top + step  # the next token's: the question's is top - 1
        with _roped_at(model, mx.array([position, position]), position + 1), \
                cpu_math.numpy_passes():
            hidden = model.model(mx.array([[token, token]]), cache=views)[0]
            mx.eval(hidden)
    return scores, reaches


def _kl(p_logits: mx.array, q_logits: mx.array) -> float:
    """KL(p || q) of two distributions given by their logits, nats."""
    p = p_logits - mx.logsumexp(p_logits)
    q = q_logits - mx.logsumexp(q_logits)
    return max(float(mx.sum(mx.exp(p) * (p - q))), 0.0)


def last_token_rows(model: nn.Module, cache: List, tokens: Sequence[int], near: int,
                    lo: int = 1) -> Tuple[np.ndarray, Optional[mx.array]]:
    """The scores and the final hidden states [2, d] (near, full) of
    :func:`last_token_reading`'s first pass (None for a context of lo tokens or
    fewer)."""
    return _probe(model, cache, tokens, len(tokens) - 1, lo, None, True, near=near)[:2]


def reach_of(model: nn.Module, hidden: mx.array, vocab: Optional[Sequence[int]] = None) -> float:
    """KL(full || near) of the next token from the two rows' final hidden states
    ([2, d]: near, full), over ``vocab`` (see :func:`last_token_reading`)."""
    logits = head_logits(model, hidden, vocab).astype(mx.float32)
    return _kl(logits[1], logits[0])


def head_logits(model: nn.Module, hidden: mx.array, vocab: Optional[Sequence[int]] = None
                ) -> mx.array:
    """The LM head's logits of ``hidden`` ([..., d]) for the ids of ``vocab`` only
    (all: None; an mx.array is taken as sorted distinct ids, in its order). A head tied to the embeddings (or a plain linear one) gathers the
    rows; other heads run whole and are sliced."""
    if getattr(model, "model_type", None) not in BODY_THEN_HEAD:
        raise KvlingoError(f"The head of a {getattr(model, 'model_type', '?')} model cannot "
                           "be read apart from its body.")
    body = model.model
    if vocab is not None:
        ids = vocab if isinstance(vocab, mx.array) else mx.array(sorted(set(map(int, vocab))))
        if "lm_head" not in model:
            return hidden @ body.embed_tokens(ids).astype(hidden.dtype).T
        if type(model.lm_head) is nn.Linear and "bias" not in model.lm_head:
            return hidden @ model.lm_head.weight[ids].T
    if "lm_head" in model:
        logits = model.lm_head(hidden)
    else:
        logits = body.embed_tokens.as_linear(hidden)
    return logits if vocab is None else logits[..., ids]


def _probe(target, cache, tokens, start, lo, history, per_layer_seen, near: int = 0):
    """(scores of positions lo..start-1, hidden or None, views): see
    question_scores; with ``near`` > 0 (a one-token question) the final hidden
    states [2, d] of its near and full readings and the layer views a further step
    reads on (last_token_reaches)."""
    end = min(c.offset for c in cache)
    top = len(tokens)
    if not lo <= start <= end + 1 or start >= top or end > top:
        raise KvlingoError(f"Cannot read positions {start}..{top - 1} as a question on a "
                           f"{end}-position cache.")
    if near and start != top - 1:
        raise KvlingoError("The near reading takes a question of one token.")
    if start <= lo:
        return np.zeros((0,), np.float32), None, None
    positions = mx.arange(start, top)
    views = pass_views(cache, end, top, history, positions, start)
    inputs = list(tokens[start:])
    if near:
        views = [_NearView(v, lo, near) for v in views]
        positions = mx.array([start, start])
        inputs = inputs * 2
    totals = []
    attention = _ScoringAttention(lo, start, totals)
    cpu_math.install(target)
    module = sys.modules[type(target.layers[0].self_attn).__module__]
    attention.original = getattr(module, "scaled_dot_product_attention", None)
    if attention.original is None:
        raise KvlingoError(f"{module.__name__} does not call scaled_dot_product_attention: "
                           "its attention cannot be read.")
    module.scaled_dot_product_attention = attention
    try:
        with _roped_at(target, positions, top), cpu_math.numpy_passes():
            hidden = target.model(mx.array([inputs]), cache=views)
            mx.eval(hidden, totals)
    finally:
        module.scaled_dot_product_attention = attention.original
    if not totals:
        return np.zeros((start - lo,), np.float32), hidden[0] if near else None, views
    total = np.array(sum(totals[1:], totals[0]))
    if per_layer_seen:
        seen = np.zeros(start - lo, np.float32)
        for unseen in attention.unseen:
            seen[unseen:] += 1
        total = total / np.maximum(seen, 1)
    return total, hidden[0] if near else None, views


class _NearView:
    """A probe's layer view (:class:`~.recompute._PassView`, of a one-token
    question at position q) read by two rows per pass, both at one position: the
    first (the *near* reading) sees the attention sink (positions below ``lo``),
    the ``near`` positions before q and its own rows; the second (the full
    reading) sees what the view lets it see and its own rows. The first pass reads
    the question (the full row's key goes to position q, the near row's to a row
    after the layout); each later pass reads one more token at the next position,
    each row's key after the layout, seen only by its own reading."""

    offset = 0  # unused: every row is roped at its own position (recompute._roped_at)

    def __init__(self, view, lo: int, near: int):
        self.view, self.lo, self.near, self.first = view, lo, near, view.first
        self.keys, self.values = view.keys, view.values
        self.question = int(view.positions[-1].item())
        self.extra_keys, self.extra_values, self.extra_near = [], [], []
        self.step = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.step == 0:
            row = self.question - self.first
            self.keys[:, :, row: row + 1] = keys[:, :, 1:].astype(self.keys.dtype)
            self.values[:, :, row: row + 1] = values[:, :, 1:].astype(self.values.dtype)
        else:
            self._add(keys[:, :, 1:], values[:, :, 1:], False)
        self._add(keys[:, :, :1], values[:, :, :1], True)
        self.step += 1
        return (mx.concatenate([self.keys] + self.extra_keys, axis=2),
                mx.concatenate([self.values] + self.extra_values, axis=2))

    def _add(self, keys, values, near: bool):
        self.extra_keys.append(keys.astype(self.keys.dtype))
        self.extra_values.append(values.astype(self.values.dtype))
        self.extra_near.append(near)

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        q = self.question
        key = self.first + mx.arange(self.keys.shape[2])
        full = (self.view.held | self.view.selected) & (key <= q)
        if window_size is not None:
            full = full & (q + self.step - key < window_size)
        near = full & (key < q) & ((key < self.lo) | (key >= q - self.near))
        # The extra rows after this pass writes its own: the full row's (from the
        # second pass on), then the near row's.
        kinds = self.extra_near + ([False] if self.step else []) + [True]
        mine = mx.array(kinds)
        return mx.stack([mx.concatenate([near, mine]), mx.concatenate([full, ~mine])])


def source_reading(source: nn.Module, source_cache: List, alignment: Alignment,
                   near: int = 0, steps: int = 1, enough: Optional[float] = None
                   ) -> Tuple[np.ndarray, float]:
    """The source's one-token probe of a switch: the scores of source positions
    1..n-2 as its last token reads them (:func:`source_scores` maps them to target
    positions), and with ``near`` > 0 the reach of what comes next beyond the last
    ``near`` tokens (:func:`last_token_reading`, over the context's own tokens,
    ``steps`` tokens on, stopping above ``enough``; 0.0 without). ``alignment.source_tokens``: the whole
    context in the source's tokens."""
    ids = alignment.source_tokens
    if near:
        return last_token_reading(source, source_cache, ids, near - 1, vocab=ids, steps=steps,
                                  enough=enough)
    return question_scores(source, source_cache, ids, len(ids) - 1, 1), 0.0


def source_scores(source: nn.Module, source_cache: List, alignment: Alignment, lo: int,
                  hi: int, scores: Optional[np.ndarray] = None) -> np.ndarray:
    """The question's choice read by the *source*: how much its last token attends,
    on the source's own cache, to what target positions lo..hi-1 hold (an array of
    hi - lo scores, as :func:`question_scores` scores them).

    The source wrote the cache and has read the context up to the question
    natively, so one token's pass of the source (its last) replaces the target's
    pass over the question on a translated cache: no translation error aims it,
    and a small source costs less than a large target (CacheClip, arXiv
    2510.10129, chooses with a small model's attention likewise). Each position's
    score is its sum over the layers that see it, divided by their number: a
    sliding-window source (Gemma 3 sees the last 512 tokens in 15 of its 18
    layers) would otherwise rank a distant fact below recent words (at ~1,100
    tokens its choice covered the answer 37 times of 48 summed, 44 averaged).
    ``alignment.source_tokens``: the whole context in the source's tokens, n of
    them, whose first n - 1 at least ``source_cache`` holds. Across tokenizers the
    scores go from source to target tokens by characters (a target token takes the
    largest score of the source tokens it shares a character with). ``scores``: the
    source's reading already made (:func:`source_reading`)."""
    ids = alignment.source_tokens
    if scores is None:
        scores = question_scores(source, source_cache, ids, len(ids) - 1, 1)  # positions 1..
    if alignment.source_offsets is None or alignment.target_offsets is None:
        return scores_from(scores, lo, hi)  # one tokenizer: position for position
    return scores_by_characters(scores, alignment.source_offsets[1: 1 + len(scores)],
                                alignment.target_offsets[lo:hi])


def scores_from(scores: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The scores of positions lo..hi-1 from those of positions 1.. (0 past them)."""
    out = np.zeros(max(hi - lo, 0), np.float32)
    part = scores[max(lo - 1, 0): max(hi - 1, 0)]
    out[: len(part)] = part
    return out


def scores_by_characters(scores: np.ndarray, source_offsets, target_offsets) -> np.ndarray:
    """Per target token, the largest score of the source tokens sharing a character
    with it (0 where none: a template marker)."""
    src = np.asarray(source_offsets, np.int64).reshape(-1, 2)
    tgt = np.asarray(target_offsets, np.int64).reshape(-1, 2)
    texty = src[:, 1] > src[:, 0]
    src, scores = src[texty], np.asarray(scores, np.float32)[texty]
    out = np.zeros(len(tgt), np.float32)
    if not len(src) or not len(tgt):
        return out
    # Source tokens k0..k1 overlap a target token (a, b): the first ending after a
    # to the last starting before b (both columns ascend).
    k0 = np.searchsorted(src[:, 1], tgt[:, 0], side="right")
    k1 = np.searchsorted(src[:, 0], tgt[:, 1], side="left")
    hit = (tgt[:, 1] > tgt[:, 0]) & (k1 > k0)
    if hit.any():
        # reduceat over (k0, k1) pairs: every other result is a pair's maximum.
        pairs = np.stack([k0[hit], k1[hit]], 1).reshape(-1)
        padded = np.append(scores, np.float32(0))
        out[hit] = np.maximum.reduceat(padded, pairs)[::2]
    return out


class _ScoringAttention:
    """Stands in for mlx-lm's ``scaled_dot_product_attention`` during a probe: the
    layer's own attention runs as usual, and the question's last token's attention
    over positions lo..hi-1 is computed beside it (one query row), its largest
    over heads kept."""

    def __init__(self, lo: int, hi: int, totals: list):
        self.lo, self.hi, self.totals, self.original = lo, hi, totals, None
        self.unseen = []  # per layer: how many of the first positions its view lacks

    def __call__(self, queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
        extra = {} if sinks is None else {"sinks": sinks}
        out = self.original(queries, keys, values, cache=cache, scale=scale, mask=mask, **extra)
        B, H, L, D = queries.shape
        Hk = keys.shape[1]
        q = (queries[:, :, -1:].astype(mx.float32) * scale).reshape(B, Hk, H // Hk, 1, D)
        s = q @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2)  # [B, Hk, rep, 1, S]
        if isinstance(mask, mx.array):
            row = mask[..., -1:, :]
            s = mx.where(row, s, -mx.inf) if row.dtype == mx.bool_ else s + row
        # Key row j is position first + j (a sliding layer's view starts late:
        # recompute.pass_views); positions before it get no attention here.
        first = getattr(cache, "first", 0)
        a, b = max(self.lo - first, 0), max(self.hi - first, 0)
        p = mx.softmax(s, axis=-1, precise=True)[..., a:b]
        best = p.reshape(B * H, b - a).max(axis=0) if b > a else mx.zeros((0,))
        unseen = self.hi - self.lo - (b - a)
        self.unseen.append(unseen)
        if unseen:
            best = mx.concatenate([mx.zeros((unseen,), best.dtype), best])
        self.totals.append(best)
        return out


def question_spans(scores: np.ndarray, count: int, lo: int, hi: int,
                   keep: Sequence[Span] = (), before: int = BEFORE,
                   after: int = AFTER, words: Sequence[Span] = ()) -> List[Span]:
    """Spans of at most ``count`` positions in all: those of ``keep`` (chosen
    otherwise: the fact-like words), then the best-scored positions of lo..hi-1
    (``scores[i]`` is position lo + i's), each with ``before`` / ``after``
    neighbours and, where it lies in one of ``words`` (spans of several tokens),
    the rest of that word, until the budget is spent."""
    word_of = {p: (a, b) for a, b in words for p in range(a, b)}
    chosen = [p for a, b in keep for p in range(a, b)]
    spans = merge_spans(chosen, lo=lo, hi=hi) if chosen else []
    used = sum(b - a for a, b in spans)
    if used >= count:
        return spans
    n = min(len(scores), hi - lo)
    order = np.argsort(-scores[:n], kind="stable")
    for i in order[: 4 * count]:
        if not np.isfinite(scores[i]):  # not a position to choose (RecomputePlan.allowed)
            break
        p = lo + int(i)
        # The position with its neighbours, or alone where they do not fit.
        a, b = word_of.get(p, (p, p + 1))
        near = range(max(min(p - before, a), lo), min(max(p + after + 1, b), hi))
        for window in (near, range(max(a, lo), min(b, hi)), [p]):
            trial = merge_spans(chosen + list(window), lo=lo, hi=hi, gap=1)
            size = sum(b - a for a, b in trial)
            if size <= count:
                chosen += list(window)
                spans, used = trial, size
                break
        if used >= count:
            break
    return spans

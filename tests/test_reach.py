"""The source's reach: how much its next token needs what lies before the last few
context tokens, read in its probe's own pass; and the long tail a switch takes
where it needs little."""

import mlx.core as mx
import numpy as np
import pytest
from tiny import identity_translator, tiny_model

from mlx_kvlingo.models.cache import prefill
from mlx_kvlingo.switching.api import switch
from mlx_kvlingo.switching.choice import REACH_STEPS, long_tail_for
from mlx_kvlingo.switching.query import (head_logits, last_token_reaches, last_token_reading,
                                         question_scores, reach_of)
from mlx_kvlingo.translator.maps import TranslatorSpec


class _Rows:
    """A layer cache of chosen rows of another (keys roped where they were), read by
    one token roped at ``offset``: the near reading built by hand."""

    def __init__(self, keys, values, offset):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, keys, values):
        return (mx.concatenate([self.keys, keys], axis=2),
                mx.concatenate([self.values, values], axis=2))


def _log_probs(logits):
    return logits - mx.logsumexp(logits)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("cached", [39, 40])
def test_the_reach_is_the_kl_of_reading_only_the_sink_and_the_last_tokens(arch, cached):
    """One pass, two rows: the reach equals the KL of the next token read on the
    whole cache from it read on the sink and the last ``near`` rows alone (built by
    hand), and the scores are the probe's; the cache holds the context with or
    without its last token, and is left as it was."""
    m = tiny_model(arch)
    ids = mx.random.randint(0, 97, (40,), key=mx.random.key(3)).tolist()
    n, near = len(ids), 6
    cache = prefill(m, mx.array([ids[:cached]]))
    before = [mx.array(c.keys) for c in cache]
    scores, reach = last_token_reading(m, cache, ids, near)
    assert np.abs(scores - question_scores(m, cache, ids, n - 1, 1)).max() < 1e-6
    assert all(mx.array_equal(a, c.keys) and c.offset == cached for a, c in zip(before, cache))

    rows = mx.array([0] + list(range(n - 1 - near, n - 1)))
    clean = prefill(m, mx.array([ids[:-1]]))
    kept = [_Rows(c.keys[:, :, rows], c.values[:, :, rows], n - 1) for c in clean]
    short = _log_probs(m(mx.array([ids[-1:]]), cache=kept)[0, -1])
    full = _log_probs(m(mx.array([ids[-1:]]), cache=prefill(m, mx.array([ids[:-1]])))[0, -1])
    want = mx.sum(mx.exp(full) * (full - short)).item()
    assert want > 0.01 and abs(reach - want) < 1e-4 * max(1.0, want)
    # Seeing everything, the two readings are one.
    assert last_token_reading(m, cache, ids, n)[1] < 1e-5

    # A second step: both readings go on with the full reading's likeliest token.
    _, reaches = last_token_reaches(m, cache, ids, near, steps=2)
    assert abs(reaches[0] - reach) < 1e-5
    token = int(mx.argmax(full).item())
    kept = [_Rows(c.keys[:, :, rows], c.values[:, :, rows], n - 1) for c in clean]
    short = _log_probs(m(mx.array([[ids[-1], token]]), cache=kept)[0, -1])
    full = _log_probs(m(mx.array([ids + [token]]))[0, -1])
    want = mx.sum(mx.exp(full) * (full - short)).item()
    assert want > 0.01 and abs(reaches[1] - want) < 1e-4 * max(1.0, want)
    assert last_token_reading(m, cache, ids, near, steps=2)[1] == max(reaches)
    assert all(mx.array_equal(a, c.keys) and c.offset == cached for a, c in zip(before, cache))


def test_the_head_over_some_tokens_is_the_whole_heads_slice():
    m = tiny_model("qwen3")
    hidden = mx.random.normal((2, 64), key=mx.random.key(1))
    vocab = [5, 3, 3, 90]
    whole = head_logits(m, hidden)
    assert whole.shape == (2, 97)
    assert mx.allclose(head_logits(m, hidden, vocab), whole[:, [3, 5, 90]], atol=1e-5)
    assert reach_of(m, mx.stack([hidden[0], hidden[0]])) < 1e-6
    assert reach_of(m, hidden) > 0 and reach_of(m, hidden, vocab) > 0


def _splitting(m, reach_below):
    t = identity_translator(m, scale=0.5)
    t.spec.native_tail, t.spec.recompute, t.spec.recompute_max = 3, 0.3, 0
    t.spec.recompute_select = "source"
    t.spec.long_tail, t.spec.long_tail_reach = 12, reach_below
    return t


def test_a_switch_takes_the_long_tail_where_the_next_token_reaches_little():
    """With the file's defaults, a context whose reach is at most the file's
    threshold is switched with the long tail and no recompute; above it, with the
    native tail and the recompute; a caller's own tail or budget is kept as asked."""
    m = tiny_model("qwen3")
    ids = mx.random.randint(0, 97, (40,), key=mx.random.key(11)).tolist()
    _, reach = last_token_reading(m, prefill(m, mx.array([ids[:-1]])), ids, 11, vocab=ids,
                                  steps=REACH_STEPS)
    assert reach > 0
    goes_on = switch(m, m, _splitting(m, reach * 1.01), ids)
    assert goes_on.prompt.size == 13 and not goes_on.deferred
    asks = switch(m, m, _splitting(m, reach * 0.99), ids)
    assert asks.prompt.size == 4 and asks.deferred
    for own in ({"native_tail": 3}, {"recompute": 0.3}):
        kept = switch(m, m, _splitting(m, reach * 1.01), ids, **own)
        assert kept.prompt.size == 4 and kept.deferred
    # The long tail's switch continues as a switch asked for that tail does.
    asked = switch(m, m, _splitting(m, 0.0), ids, native_tail=12, recompute=0.0)
    assert mx.allclose(goes_on.read()[0, -1], asked.read()[0, -1], atol=1e-5)


def test_long_tail_for_and_the_files_fields():
    spec = TranslatorSpec.from_json(TranslatorSpec.from_json(
        identity_translator(tiny_model("qwen3")).spec.to_json()).to_json())
    assert spec.long_tail == 0 and "long_tail" not in spec.to_json()
    assert long_tail_for(spec, 0.0) is None
    spec.long_tail, spec.long_tail_reach = 128, 0.3
    again = TranslatorSpec.from_json(spec.to_json())
    assert (again.long_tail, again.long_tail_reach) == (128, 0.3)
    assert long_tail_for(again, 0.3) == 128 and long_tail_for(again, 0.31) is None

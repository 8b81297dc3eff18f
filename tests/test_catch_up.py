"""A conversation's catch-up is a switch onto a live cache (switching.catch_up): it
translates the runs others wrote and leaves the native tail, the question and the
recompute to the reader's first pass, as a SwitchResult mlx-lm can continue."""

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from tiny import identity_translator

from mlx_kvlingo.errors import KvlingoError
from mlx_kvlingo.models.cache import prefill
from mlx_kvlingo.switching.catch_up import Run, catch_up
from mlx_kvlingo.switching.generate import generate_after_switch

CONTEXT = ("def parse(path):\n    # The parser keeps its scratch files under the piano folder.\n"
           "    with open(path) as f:\n        return [line.strip() for line in f]\n")
QUESTION = " Where does the parser keep its scratch files? Under the"


@pytest.fixture(scope="module")
def target(toy_pair):
    return toy_pair[2], toy_pair[3]


def _catch_up(m, tok, translator, own=3, **kw):
    """The reader computed the first ``own`` tokens; model "a" wrote the rest."""
    ids = tok.encode(CONTEXT)
    source_cache = prefill(m, mx.array(ids)[None])
    cache = make_prompt_cache(m)
    prefill(m, mx.array(ids[:own]), cache)
    runs = [Run(own, len(ids), "a", m, source_cache, translator)]
    return ids, catch_up(m, cache, ids, own, runs, tok.encode(QUESTION), tokenizer=tok, **kw)


def _tokens(responses):
    return [r.token for r in responses]


def test_a_catch_up_leaves_tail_question_and_recompute_to_the_first_pass(target):
    m, tok = target
    t = identity_translator(m, tok, scale=0.5)  # inexact: the recompute changes rows
    t.spec.native_tail, t.spec.recompute, t.spec.recompute_max = 4, 0.3, 0
    ids, done = _catch_up(m, tok, t)
    assert done.native_tail == 4 and done.translated == {"a": len(ids) - 3 - 4}
    assert done.recomputed > 0 and done.held == len(ids) - 4
    assert done.result.prompt.tolist() == ids[-4:] + tok.encode(QUESTION)
    fused = _tokens(generate_after_switch(m, tok, done.result, max_tokens=8))
    # mlx-lm from the same switch's prompt and prompt_cache (the recompute done on
    # first access) generates the same tokens.
    _, again = _catch_up(m, tok, t)
    plain = _tokens(stream_generate(m, tok, again.result.prompt,
                                    prompt_cache=again.result.prompt_cache, max_tokens=8))
    assert fused == plain
    # Without the recompute the rows differ: the pass did recompute something.
    _, bare = _catch_up(m, tok, t, recompute=0.0)
    assert bare.recomputed == 0
    a, b = done.result.cache, bare.result.prompt_cache
    assert any(mx.abs(x.keys[..., :done.held, :] - y.keys[..., :done.held, :]).max().item()
               > 1e-4 for x, y in zip(a, b))


def test_a_catch_up_with_nothing_to_translate_is_a_prefill(target):
    m, tok = target
    ids = tok.encode(CONTEXT)
    cache = make_prompt_cache(m)
    done = catch_up(m, cache, ids, 0, [Run(0, len(ids))], tok.encode(QUESTION))
    assert done.translated == {} and done.prefilled == len(ids) and done.held == len(ids)
    assert done.result.prompt.tolist() == tok.encode(QUESTION)
    native = prefill(m, mx.array(ids)[None])
    assert mx.abs(done.cache[0].keys[..., :len(ids), :]
                  - native[0].keys[..., :len(ids), :]).max().item() < 1e-5


def test_catch_up_runs_must_follow_each_other(target):
    m, tok = target
    ids = tok.encode(CONTEXT)
    with pytest.raises(KvlingoError, match="follow each other"):
        catch_up(m, make_prompt_cache(m), ids, 0, [Run(0, 5), Run(6, 9)])


def test_a_catch_up_chosen_by_the_writers_reading(target):
    """select='source': the writer reads the question on its own cache (a probe:
    its cache is left as it was) and its last token's best-scored position is
    recomputed; the reader's own reading of the translated cache chooses others."""
    import numpy as np

    from mlx_kvlingo.switching.query import question_scores

    m, tok = target
    t = identity_translator(m, tok, scale=0.5)
    t.spec.native_tail, t.spec.recompute, t.spec.recompute_max = 4, 0.3, 0
    ids, question = tok.encode(CONTEXT), tok.encode(QUESTION)
    source_cache = prefill(m, mx.array(ids)[None])
    scores = question_scores(m, source_cache, ids + question, len(ids), 1)
    best = 3 + int(np.argmax(scores[2:len(ids) - 5]))  # of the translated 3..len - 5
    cache = make_prompt_cache(m)
    prefill(m, mx.array(ids[:3]), cache)
    runs = [Run(3, len(ids), "a", m, source_cache, t)]
    done = catch_up(m, cache, ids, 3, runs, question, tokenizer=tok, select="source")
    assert all(c.offset == len(ids) for c in source_cache)
    assert any(a <= best < b for a, b in done.result.deferred)
    _, own = _catch_up(m, tok, t, select="question")
    assert own.result.deferred != done.result.deferred

"""A switch result hands over to mlx-lm as a prompt cache does, once; and the
question it is about to read chooses what the target recomputes."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import stream_generate
from tiny import identity_translator, tiny_model

from mlx_kvlingo import generate_after_switch
from mlx_kvlingo.errors import KvlingoError
from mlx_kvlingo.models.cache import prefill
from mlx_kvlingo.models.features import attention_weights
from mlx_kvlingo.switching.api import switch, switch_text, translate_context
from mlx_kvlingo.switching.query import question_scores, question_spans

TEXT = ("The helper parse_cfg_v2 reads the code 58213 for Pomini Gufifari. The lamp was "
        "left under the piano by the old baker, and nothing else of note happened that "
        "day. Later the baker asked where the lamp was. The lamp was under the")


def _lossy(src, stok):
    """A translator that keeps half of every key and value, with a native tail and
    a recompute by default: a switch from it has a prompt and deferred positions."""
    t = identity_translator(src, stok, scale=0.5)
    t.spec.native_tail, t.spec.recompute, t.spec.recompute_max = 3, 0.3, 0
    return t


def _tokens(responses):
    return [r.token for r in responses]


def test_mlx_lm_generation_from_prompt_and_prompt_cache_equals_generate_after_switch(toy_pair):
    src, stok, _, _ = toy_pair
    t = _lossy(src, stok)
    fused = switch_text(src, stok, src, stok, t, TEXT)
    handed = switch_text(src, stok, src, stok, t, TEXT)
    assert fused.deferred and handed.prompt.size == 4  # tail of 3 + the last token
    want = _tokens(generate_after_switch(src, stok, fused, max_tokens=12))
    got = _tokens(stream_generate(src, stok, handed.prompt, prompt_cache=handed.prompt_cache,
                                  max_tokens=12))
    assert got == want and len(want) >= 4
    # The recompute mattered: without it mlx-lm continues otherwise.
    plain = switch_text(src, stok, src, stok, t, TEXT, recompute=0.0)
    logits = src(plain.prompt[None], cache=plain.prompt_cache)[0, -1]
    first = src(fused.prompt[None], cache=switch_text(src, stok, src, stok, t,
                                                       TEXT).prompt_cache)[0, -1]
    assert mx.abs(logits - first).max().item() > 1e-3


def test_a_result_is_read_once_and_its_cache_is_fenced_until_then(toy_pair):
    src, stok, _, _ = toy_pair
    t = _lossy(src, stok)
    result = switch_text(src, stok, src, stok, t, TEXT)
    with pytest.raises(KvlingoError, match="not the whole context"):
        result.cache
    spare = result.copy()
    list(generate_after_switch(src, stok, result, max_tokens=3))
    assert result.cache[0].offset > 0  # read: the cache holds the whole context now
    with pytest.raises(KvlingoError, match="already read"):
        list(generate_after_switch(src, stok, result, max_tokens=3))
    with pytest.raises(KvlingoError, match="already read"):
        result.prompt_cache
    spare.prompt_cache
    with pytest.raises(KvlingoError, match="already handed over"):
        spare.prompt_cache
    with pytest.raises(KvlingoError, match="already handed over"):
        spare.copy()


def test_translate_context_is_the_switch_read_but_for_its_last_token(toy_pair):
    """A prompt cache from translate_context, continued by mlx-lm with the last
    token, generates what the switch of the same context does: the same native
    positions and, with a recompute chosen by the fact-like words alone, the same
    recomputed ones. (The question's choice reads the context's last tokens, which
    for a prompt cache end one token earlier.)"""
    src, stok, _, _ = toy_pair
    t = _lossy(src, stok)
    t.spec.recompute_select = "lexical"
    ids = stok.encode(TEXT)
    cache = translate_context(src, src, t, ids, tokenizer=stok)
    assert cache[0].offset == len(ids) - 1
    got = _tokens(stream_generate(src, stok, mx.array(ids[-1:]), prompt_cache=cache,
                                  max_tokens=10))
    result = switch(src, src, t, ids, tokenizer=stok)
    assert result.deferred
    want = _tokens(generate_after_switch(src, stok, result, max_tokens=10))
    assert got == want


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_question_scores_are_the_targets_attention_over_the_context(arch):
    """Read on an exact translation, the question's scores are the model's own
    attention from the question's last token: per layer, the largest over heads,
    summed over layers; the cache is left as it was."""
    m = tiny_model(arch)
    ids = mx.random.randint(0, 97, (30,), key=mx.random.key(3)).tolist()
    result = switch(m, m, identity_translator(m), ids, native_tail=4, recompute=0.0)
    cache = result.prompt_cache
    before = [mx.array(c.keys) for c in cache]
    start = 25
    scores = question_scores(m, cache, ids, start, lo=1, per_layer_seen=False)
    _, weights = attention_weights(m, mx.array([ids]), per_head=True)
    want = sum(np.array(w[0, :, -1, 1:start].max(axis=0)) for w in weights)
    assert scores.shape == (start - 1,)
    assert np.abs(scores - want).max() < 1e-3
    assert all(mx.array_equal(a, c.keys) for a, c in zip(before, cache))
    assert all(c.offset == 25 for c in cache)


def test_question_spans_take_the_best_positions_with_neighbours_within_the_budget():
    scores = np.zeros(100, np.float32)
    scores[40], scores[70], scores[10] = 3.0, 2.0, 1.0  # positions lo + i, lo = 1
    spans = question_spans(scores, 14, lo=1, hi=101, before=4, after=2)
    assert spans == [(37, 44), (67, 74)]
    kept = question_spans(scores, 14, lo=1, hi=101, keep=[(90, 95)], before=4, after=2)
    assert (90, 95) in kept and (37, 44) in kept and sum(b - a for a, b in kept) <= 14
    # A budget smaller than a neighbourhood still takes the best position itself.
    assert question_spans(scores, 1, lo=1, hi=101) == [(41, 42)]


@pytest.mark.parametrize("select", ["question", "source"])
def test_the_question_finds_a_fact_the_translation_hid(toy_pair, select):
    """A translation that carries nothing (zero maps) hides the context; with the
    question's choice (read by the target on the translated cache, or by the
    source on its own) the target recomputes positions it attends to, and its
    prediction moves toward the re-prefill's."""
    src, stok, _, _ = toy_pair
    zero = identity_translator(src, stok, scale=0.0)
    zero.spec.native_tail = 3
    ids = stok.encode(TEXT)
    native = src(mx.array([ids]))[0, -1]
    native = native - mx.logsumexp(native)

    def kl(share):
        r = switch(src, src, zero, ids, recompute=share, select=select)
        logits = r.read()[0, -1]
        lp = logits - mx.logsumexp(logits)
        return (mx.exp(native) * (native - lp)).sum().item()

    assert kl(0.3) < kl(0.0)
    # The source reads its own exact cache, not the translated one: another choice.
    other = "question" if select == "source" else "source"
    assert (switch(src, src, zero, ids, recompute=0.3, select=select).deferred
            != switch(src, src, zero, ids, recompute=0.3, select=other).deferred)


def test_a_converted_prompt_cache_continued_by_mlx_lm_is_the_switch(toy_pair):
    """convert-cache's conversion of a source prompt cache, continued by mlx-lm
    with the next token, generates what a switch of the whole context does with the
    same file's defaults (native tail, recompute of the fact-like words)."""
    from mlx_kvlingo.switching.prompt_cache import convert_prompt_cache

    src, stok, _, _ = toy_pair
    t = _lossy(src, stok)
    t.spec.recompute_select, t.spec.recompute_max = "lexical", 6
    ids = stok.encode(TEXT)
    cached = ids[:-1]
    source_cache = prefill(src, mx.array([cached]))
    converted = convert_prompt_cache(src, src, t, source_cache, cached, tokenizer=stok)
    assert converted[0].offset == len(cached)
    got = _tokens(stream_generate(src, stok, mx.array(ids[-1:]), prompt_cache=converted,
                                  max_tokens=10))
    result = switch(src, src, t, ids, tokenizer=stok)
    assert result.deferred and result.prompt.size == 4
    want = _tokens(generate_after_switch(src, stok, result, max_tokens=10))
    assert got == want
    # Not what the bare translation gives: the defaults were applied.
    bare = identity_translator(src, stok, scale=0.5)
    plain = convert_prompt_cache(src, src, bare, prefill(src, mx.array([cached])), cached)
    again = convert_prompt_cache(src, src, t, prefill(src, mx.array([cached])), cached,
                                 tokenizer=stok)
    last = mx.array([ids[-1:]])
    assert mx.abs(src(last, cache=plain) - src(last, cache=again)).max().item() > 1e-3


@pytest.mark.parametrize("select", ["question", "source"])
@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_an_exact_switch_with_the_questions_choice_is_a_re_prefill(arch, select):
    """With exact maps, a switch whose recompute the question chooses (read by the
    target or by the source; sliding windows of 8 in gemma3_text, so the recompute
    reads rows the windows dropped) continues exactly as a native prefill does."""
    m = tiny_model(arch)
    t = identity_translator(m)
    t.spec.native_tail, t.spec.recompute, t.spec.recompute_max = 5, 0.3, 0
    ids = mx.random.randint(0, 97, (40,), key=mx.random.key(11)).tolist()
    result = switch(m, m, t, ids, select=select)
    assert result.deferred and result.prompt.size == 6
    logits = result.read()[0, -1]
    native = m(mx.array([ids]))[0, -1]
    assert mx.abs(logits - native).max().item() < 1e-3
    assert all(c.offset == len(ids) for c in result.cache)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_the_sources_reading_is_its_own_attention_from_the_last_token(arch):
    """select='source': the source reads the context's last token on its own cache
    (sliding windows of 8 in gemma3_text: a rotating cache); the scores are its
    attention from that token, per layer the largest over heads, averaged over
    the layers that see each position, position for position with one
    tokenizer; its cache is left as it was."""
    from mlx_kvlingo.models.geometry import cache_geometry
    from mlx_kvlingo.switching.query import source_scores
    from mlx_kvlingo.translator.align import identity_alignment

    m = tiny_model(arch)
    ids = mx.random.randint(0, 97, (30,), key=mx.random.key(5)).tolist()
    cache = prefill(m, mx.array([ids[:-1]]))
    before = [mx.array(c.keys) for c in cache]
    got = source_scores(m, cache, identity_alignment(ids), 3, 29)
    _, weights = attention_weights(m, mx.array([ids]), per_head=True)
    positions = np.arange(3, 29)
    seen = sum((positions > 29 - (lg.window or 99)).astype(np.float32)
               for lg in cache_geometry(m).layers)
    if arch == "gemma3_text":  # distant positions are seen by the full layers alone
        assert seen.min() < seen.max()
    want = sum(np.array(w[0, :, -1, 3:29].max(axis=0)) for w in weights) / seen
    assert got.shape == (26,) and np.abs(got - want).max() < 1e-3
    assert all(mx.array_equal(a, c.keys) for a, c in zip(before, cache))


def test_source_scores_go_to_the_target_tokens_that_share_their_characters():
    from mlx_kvlingo.switching.query import scores_by_characters

    scores = np.array([1.0, 2.0, 3.0, 4.0, 9.0], np.float32)
    source = [(0, 3), (3, 5), (5, 6), (6, 10), (0, 0)]  # the last: a marker, no characters
    target = [(0, 2), (2, 4), (4, 7), (7, 10), (0, 0)]
    assert scores_by_characters(scores, source, target).tolist() == [1.0, 2.0, 4.0, 4.0, 0.0]


def test_the_targets_reading_averages_over_the_layers_that_see_a_position():
    """The plan's own reading (select='question') scores a position by its attention
    averaged over the layers whose view holds it, as the source's reading does: on
    a sliding-window target (gemma3_text, windows of 8) the sum would rank a distant
    position below recent ones for being seen by fewer layers."""
    from mlx_kvlingo.switching.choice import RecomputeBudget, RecomputePlan

    m = tiny_model("gemma3_text")
    ids = mx.random.randint(0, 97, (30,), key=mx.random.key(5)).tolist()
    result = switch(m, m, identity_translator(m), ids, native_tail=4, recompute=0.0)
    cache, start, lo = result.prompt_cache, 25, 1
    summed = question_scores(m, cache, ids, start, lo=lo, per_layer_seen=False)
    averaged = question_scores(m, cache, ids, start, lo=lo)
    want = question_spans(averaged, 6, lo, start)
    assert want != question_spans(summed, 6, lo, start)  # the two rankings differ here
    plan = RecomputePlan.make(RecomputeBudget(share=0.2), len(ids), lo, start, "question")
    assert plan.count == 6
    assert plan.choose(m, cache, ids, start) == want

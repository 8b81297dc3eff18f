"""Positions recomputed by the target on top of a translated cache (switching.recompute)."""

import mlx.core as mx
import pytest
from tiny import CONFIGS, identity_translator, tiny_model

from mlx_kvlingo import cpu_math
from mlx_kvlingo.errors import KvlingoError
from mlx_kvlingo.models.cache import read_layer
from mlx_kvlingo.switching.api import switch
from mlx_kvlingo.switching.recompute import merge_spans, recompute_and_read, recompute_spans

ARCHS = sorted(CONFIGS)


def model(arch):
    """A tiny model whose sliding windows (gemma3_text) hold the whole test context:
    recomputing is exact only where the translated cache holds what a span's
    sliding layers look back at."""
    return tiny_model(arch, sliding_window=64) if arch == "gemma3_text" else tiny_model(arch)


def tokens(n, seed=0):
    return mx.random.randint(1, 97, (n,), key=mx.random.key(seed)).tolist()


def caches_close(a, b, atol=2e-4):
    for x, y in zip(a, b):
        (ka, va, sa), (kb, vb, sb) = read_layer(x), read_layer(y)
        if sa != sb or ka.shape != kb.shape:
            return False
        if mx.abs(ka - kb).max().item() > atol or mx.abs(va - vb).max().item() > atol:
            return False
    return True


@pytest.mark.parametrize("arch", ARCHS)
def test_recomputing_a_native_cache_changes_nothing(arch):
    m = model(arch)
    ids = tokens(21, seed=1)
    exact = switch(m, m, identity_translator(m), ids, native_tail=0)
    expected = switch(m, m, identity_translator(m), ids, native_tail=0)
    recompute_spans(m, exact._cache, ids, [(3, 7), (12, 15)])
    assert caches_close(exact._cache, expected._cache)


@pytest.mark.parametrize("arch", ARCHS)
def test_recomputing_every_position_makes_a_broken_translation_native(arch):
    """Zero maps carry nothing; recomputing positions 1.. (0 is the native sink) in
    one span gives the target's own cache, so its next-token logits are a
    re-prefill's."""
    m = model(arch)
    ids = tokens(21, seed=2)
    broken = switch(m, m, identity_translator(m, scale=0.0), ids, native_tail=0)
    native = switch(m, m, identity_translator(m), ids, native_tail=0)
    assert not caches_close(broken._cache, native._cache)
    recompute_spans(m, broken._cache, ids, [(1, 20)])
    assert caches_close(broken._cache, native._cache)
    last = mx.array([ids[-1:]])
    got, want = m(last, cache=broken._cache), m(last, cache=native._cache)
    assert mx.abs(got - want).max().item() < 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_a_long_recompute_pass_takes_the_cpu_attention_and_stays_exact(arch, monkeypatch):
    """A pass whose attention has >= cpu_math.MIN_SCORES scores runs it in numpy on a
    CPU, as a prefill's does, with the pass's position mask; it still gives the
    target's own cache and logits."""
    monkeypatch.setattr(cpu_math, "MIN_SCORES", 1024)  # a tiny model's pass counts
    m = model(arch)
    ids = tokens(60, seed=7)
    broken = switch(m, m, identity_translator(m, scale=0.0), ids, native_tail=0)
    native = switch(m, m, identity_translator(m), ids, native_tail=0)
    calls = []
    attention = cpu_math.attention
    monkeypatch.setattr(cpu_math, "attention",
                        lambda *a, **k: calls.append(a[0].shape) or attention(*a, **k))
    recompute_spans(m, broken._cache, ids, [(1, 20), (20, 59)])
    assert calls and all(shape[1] * shape[2] * 60 >= 1024 for shape in calls)
    assert caches_close(broken._cache, native._cache)
    last = mx.array([ids[-1:]])
    got, want = m(last, cache=broken._cache), m(last, cache=native._cache)
    assert mx.abs(got - want).max().item() < 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_spans_recomputed_in_one_pass_equal_one_after_the_other(arch):
    """On a translation that carries little (scaled maps), every span sees the
    translated rows before it and the earlier spans' recomputed ones: one call with
    three spans (one batched pass) gives the cache of three calls in order."""
    m = model(arch)
    ids = tokens(30, seed=5)
    spans = [(2, 5), (9, 16), (20, 22)]
    together = switch(m, m, identity_translator(m, scale=0.5), ids, native_tail=0)._cache
    in_turn = switch(m, m, identity_translator(m, scale=0.5), ids, native_tail=0)._cache
    untouched = switch(m, m, identity_translator(m, scale=0.5), ids, native_tail=0)._cache
    recompute_spans(m, together, ids, spans)
    for span in spans:
        recompute_spans(m, in_turn, ids, [span])
    assert caches_close(together, in_turn)
    assert not caches_close(together, untouched)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_recompute_folded_into_the_next_read_equals_recompute_then_read(arch):
    """Recomputing spans and reading the next tokens in one pass gives the logits and
    the cache of a recompute followed by a plain forward pass over those tokens."""
    m = model(arch)
    ids = tokens(30, seed=7)
    spans = [(2, 5), (9, 16)]
    folded = switch(m, m, identity_translator(m, scale=0.5), ids, native_tail=4)
    apart = switch(m, m, identity_translator(m, scale=0.5), ids, native_tail=4)
    pending = folded.pending.tolist()
    assert len(pending) == 5
    got = recompute_and_read(m, folded._cache, ids, spans, pending, keep=3)
    recompute_spans(m, apart._cache, ids, spans)
    want = m(mx.array([pending]), cache=apart._cache)[:, -3:]
    assert got.shape == want.shape
    assert mx.abs(got - want).max().item() < 1e-3
    assert caches_close(folded._cache, apart._cache)
    assert all(c.offset == len(ids) for c in folded._cache)


def test_a_deferred_recompute_is_done_by_the_first_step_or_by_prompt_cache(toy_pair):
    """switch(recompute=...) leaves its chosen positions deferred; the first step
    does them in its pass (same token and log-probabilities as settling them
    first, then stepping), and a settled result has nothing left deferred."""
    from mlx_kvlingo.switching.api import switch_text
    from mlx_kvlingo.switching.generate import first_step

    src, stok, _, _ = toy_pair
    half = identity_translator(src, stok, scale=0.5)
    text = ("The helper parse_cfg_v2 reads the code 58213 for Pomini Gufifari. "
            "Nothing else of note happened that day, and the file was closed again.")
    runs = [switch_text(src, stok, src, stok, half, text, native_tail=3, recompute=0.4)
            for _ in range(2)]
    assert runs[0].deferred and runs[0].context
    token, logprobs = first_step(src, runs[0])
    assert not runs[0].deferred
    settled = runs[1].prompt_cache
    assert not runs[1].deferred
    logits = src(runs[1].prompt[None], cache=settled)[0, -1]
    logprobs2 = logits - mx.logsumexp(logits)
    assert token == int(mx.argmax(logprobs2).item())
    assert mx.abs(logprobs - logprobs2).max().item() < 1e-3
    assert caches_close(runs[0].cache, settled)


def test_overlapping_spans_are_refused():
    m = tiny_model("llama")
    ids = tokens(12)
    result = switch(m, m, identity_translator(m), ids, native_tail=0)
    with pytest.raises(KvlingoError, match="overlap"):
        recompute_spans(m, result._cache, ids, [(2, 6), (5, 8)])


def test_spans_are_checked():
    m = tiny_model("llama")
    ids = tokens(12)
    result = switch(m, m, identity_translator(m), ids, native_tail=0)
    with pytest.raises(KvlingoError, match="Cannot recompute"):
        recompute_spans(m, result._cache, ids, [(5, 40)])


def test_positions_become_merged_spans():
    assert merge_spans([5, 6, 20], before=2, after=1) == [(3, 8), (18, 22)]
    assert merge_spans([5, 9], before=1, after=1, gap=2) == [(4, 11)]
    assert merge_spans([0, 1], before=3, lo=1) == [(1, 2)]  # position 0: the native sink
    assert merge_spans([10], after=5, hi=12) == [(10, 12)]


def test_a_span_older_than_the_window_sees_only_itself_in_sliding_layers():
    """Gemma-style sliding layers of 8 positions: a switch keeps the last 8, so a
    span at positions 3..6 of 21 is recomputed with nothing before it in those
    layers (its rows there are never attended again and stay as they were); the
    full-attention layer's rows change. Later positions are still exact."""
    m = tiny_model("gemma3_text")
    ids = tokens(21, seed=3)
    cache = switch(m, m, identity_translator(m), ids, native_tail=0)._cache
    native = switch(m, m, identity_translator(m), ids, native_tail=0)._cache
    recompute_spans(m, cache, ids, [(3, 7)])
    for c, n, window in zip(cache, native, [8, 8, None, 8, 8, None]):
        k, _, first = read_layer(c)
        k0, _, _ = read_layer(n)
        same = mx.abs(k - k0).max().item() < 2e-4
        assert same == (window is not None), (window, first)


@pytest.mark.parametrize("layer0", ["translated", "native"])
def test_a_switch_translates_the_rows_an_old_span_reads_in_sliding_layers(layer0):
    """The same span, recomputed after a switch that was told it comes
    (kernel.History): the sliding layers read the translated rows before their
    window (layer 0's computed by the target, for a translator that does so), so
    with an exact translator every layer's rows, and the next logits, are the
    target's own. Only rows a window before the span are translated."""
    import time

    from mlx_kvlingo.switching.api import switch_aligned
    from mlx_kvlingo.switching.kernel import History
    from mlx_kvlingo.translator.align import identity_alignment

    m = tiny_model("gemma3_text")
    ids = tokens(21, seed=3)
    t = identity_translator(m).with_native_layer0(layer0 == "native")
    native = switch(m, m, t, ids, native_tail=0)
    source_cache = prefill_of(m, ids)
    result = switch_aligned(m, m, t, source_cache, identity_alignment(ids, 1), mx.array([ids]),
                            0, time.perf_counter(), history=History(since=3))
    # Sliding layers (window 8) keep positions 12..19; the span at 3 reads from 0 on.
    assert sorted(result.history) == [0, 1, 3, 4]
    assert all(lo == 0 and k.shape[2] == 12 for lo, k, _ in result.history.values())
    result.deferred, result.context = [(3, 7)], ids
    got, want = result.read(m), native.read(m)
    assert caches_close(result._cache, native._cache)
    assert result.history == {}  # read once, then dropped
    assert mx.abs(got - want).max().item() < 1e-3
    def since(p):
        return switch_aligned(m, m, t, source_cache, identity_alignment(ids, 1),
                              mx.array([ids]), 0, time.perf_counter(), history=History(p)).history

    assert {lo: k.shape[2] for lo, k, _ in since(16).values()} == {9: 3}  # 16 reads 9..16
    assert since(19) == {}  # its window is all kept


def prefill_of(m, ids):
    from mlx_kvlingo.models.cache import prefill

    cache = prefill(m, mx.array([ids[:-1]]))
    mx.eval([(c.keys, c.values) for c in cache])
    return cache


class CharTokenizer:
    """Offsets of a whitespace split, each word cut into pieces of 3 characters: a
    long word splits into several pieces, as a rare word does in BPE."""

    @staticmethod
    def offsets(text):
        import re

        out = []
        for m in re.finditer(r"\S+", text):
            a, b = m.span()
            out += [(i, min(i + 3, b)) for i in range(a, b, 3)]
        return out


TEXT = ("It was a fine day. The clerk said the locker code is 58213 and left. "
        "Then Pomini Gufifari called the helper parse_cfg_v2 twice. It rained.")


def test_fact_like_words_rank_above_ordinary_ones():
    from mlx_kvlingo.switching.recompute import salient_words

    offsets = CharTokenizer.offsets(TEXT)
    words = ["".join(TEXT[offsets[i][0]:offsets[i][1]] for i in pos)
             for _, pos in salient_words(TEXT, offsets)]
    assert words[0] == "58213"  # a long number, then an identifier with digits
    assert words[1] == "parse_cfg_v2"
    assert set(words[:4]) == {"parse_cfg_v2", "58213", "Pomini", "Gufifari"}
    assert "It" not in words and "Then" not in words  # capitals that start sentences


def test_a_long_number_ranks_above_a_class_name_and_a_short_number():
    """In API documentation the class names are fact-like too; a number of four or
    more digits, which a model cannot guess at all, still comes first."""
    from mlx_kvlingo.switching.recompute import salient_words

    text = ("Raises CalledProcessError when the exit code is 2 or 3. The storage locker "
            "is 743293. See TimeoutExpired for the rest.")
    offsets = CharTokenizer.offsets(text)
    words = ["".join(text[offsets[i][0]:offsets[i][1]] for i in pos)
             for _, pos in salient_words(text, offsets)]
    assert words[0] == "743293"
    assert words.index("CalledProcessError") < words.index("2")


def test_the_items_of_a_list_rank_above_ordinary_words():
    """An enumeration ("a, b, c and d") or a bulleted line marks its words (not its
    articles) as fact-like, above a capitalised word, below a number; the same words
    elsewhere stay ordinary."""
    from mlx_kvlingo.switching.recompute import salient_words

    text = ("Then Ann came in. We packed, in this order: a kettle, an apple, a rope "
            "and a candle. The code was 4471. A kettle boiled.\nSteps:\n- open the valve\n")
    offsets = CharTokenizer.offsets(text)
    ranked = [("".join(text[offsets[i][0]:offsets[i][1]] for i in pos).rstrip(".,"),
               offsets[pos[0]][0]) for _, pos in salient_words(text, offsets)]
    words = [w for w, _ in ranked]
    assert words[0] == "4471"
    items = {"kettle", "apple", "rope", "candle", "open", "valve"}
    assert set(words[1:7]) == items and words[7] == "Ann"
    assert not {"a", "an", "and", "the"} & set(words)
    kettles = [at for w, at in ranked if w == "kettle"]
    assert kettles == [text.index("kettle")]  # "A kettle boiled." is not a list


def test_a_long_comma_separated_run_is_scanned_in_linear_time():
    """An argument list or a CSV line has many comma-separated words and no "and":
    the enumeration scan must not try the whole run again from each of its words
    (one regex over it took 2 s on 18,000 characters)."""
    import time

    from mlx_kvlingo.switching.recompute import list_regions

    t0 = time.perf_counter()
    assert list_regions("word, " * 3000 + "end.") == []
    assert list_regions("a b c, " * 3000) == []
    run = "foo, " * 3000 + "bar and baz"
    assert list_regions(run) == [(0, len(run))]  # one list, extended back to its start
    assert time.perf_counter() - t0 < 0.5


def test_salient_spans_keep_to_the_budget_and_lead_up_to_each_word():
    from mlx_kvlingo.switching.recompute import salient_spans

    offsets = CharTokenizer.offsets(TEXT)
    spans = salient_spans(TEXT, offsets, budget=12, before=3, after=0)
    assert sum(b - a for a, b in spans) <= 12
    covered = "".join(TEXT[offsets[a][0]:offsets[b - 1][1]] for a, b in spans)
    assert "parse_cfg_v2" in covered
    assert salient_spans(TEXT, offsets, budget=0) == []
    assert all(1 <= a < b <= 20 for a, b in salient_spans(TEXT, offsets, 40, lo=1, hi=20))


def test_switch_recomputes_fact_like_words_when_asked(toy_pair):
    """switch_text(recompute=...) recomputes the words salient_spans picks: with an
    exact translator nothing changes; with one that carries nothing, the rows of
    the chosen words (and only those) become the target's own. switch() without the
    text refuses, and a share outside (0, 1] is refused."""
    from mlx_kvlingo.switching.api import switch_text
    from mlx_kvlingo.switching.recompute import salient_spans
    from mlx_kvlingo.translator.align import tokenize_with_offsets

    src, stok, tgt, ttok = toy_pair
    t = identity_translator(src, stok)
    text = ("The helper parse_cfg_v2 reads the code 58213 for Pomini Gufifari. "
            "Nothing else of note happened that day, and the file was closed again.")
    plain = switch_text(src, stok, src, stok, t, text, native_tail=0)
    fixed = switch_text(src, stok, src, stok, t, text, native_tail=0, recompute=0.5,
                        select="lexical")
    fixed.prompt_cache
    assert caches_close(plain._cache, fixed._cache)

    zero = identity_translator(src, stok, scale=0.0)
    broken = switch_text(src, stok, src, stok, zero, text, native_tail=0)
    repaired = switch_text(src, stok, src, stok, zero, text, native_tail=0,
                           recompute=0.5, select="lexical")
    repaired.prompt_cache
    ids, offsets = tokenize_with_offsets(stok, text)
    spans = salient_spans(text, offsets, int(0.5 * len(ids)), 1, len(ids) - 1)
    assert spans
    chosen = [p for a, b in spans for p in range(a, b)]
    others = [p for p in range(1, len(ids) - 1) if p not in chosen]
    # Layer 0's keys depend on nothing before them: recomputed rows are the
    # target's own exactly; the others keep the broken translation (zeros).
    k_fixed, k_native, k_broken = (read_layer(c._cache[0])[0] for c in (repaired, plain, broken))
    assert mx.abs(k_fixed[:, :, chosen] - k_native[:, :, chosen]).max().item() < 1e-4
    assert mx.abs(k_fixed[:, :, others] - k_broken[:, :, others]).max().item() < 1e-6
    assert mx.abs(k_native[:, :, chosen]).max().item() > 0.1
    ids = tokenize_with_offsets(stok, text)[0]
    with pytest.raises(KvlingoError, match="needs the context's text"):
        switch(src, src, t, ids, recompute=0.2, select="lexical")
    with pytest.raises(KvlingoError, match="share of the context"):
        switch_text(src, stok, src, stok, t, text, recompute=1.5)


def test_recomputing_in_a_wrapped_sliding_window_changes_nothing():
    """A conversation's cache after decoding steps: its sliding-window layers have
    wrapped around their buffer. Recomputing recent positions of a native cache still
    reads and writes the right rows (the result equals the untouched cache)."""
    from mlx_kvlingo.models.cache import copy_cache, prefill

    m = tiny_model("gemma3_text", sliding_window=16)
    ids = tokens(24, seed=4)
    cache = prefill(m, mx.array(ids[:12]))
    for t in ids[12:]:  # one token at a time: the rotating buffers wrap
        m(mx.array([[t]]), cache=cache)
    assert any(getattr(c, "_idx", 0) < c.keys.shape[2] for c in cache)  # wrapped
    expected = copy_cache(cache)
    # The buffer holds positions 8..23, so only position 23 has its whole window held.
    recompute_spans(m, cache, ids, [(23, 24)])
    assert caches_close(cache, expected)


def test_a_folded_read_after_a_wrapped_sliding_window_is_a_plain_read():
    """The first-step pass on a wrapped sliding-window cache: recomputing a position
    whose window is held and reading three more tokens gives the logits and the
    cache of reading them plainly on an untouched copy."""
    from mlx_kvlingo.models.cache import copy_cache, last_logits, prefill

    m = tiny_model("gemma3_text", sliding_window=16)
    ids = tokens(27, seed=6)
    cache = prefill(m, mx.array(ids[:12]))
    for t in ids[12:24]:  # one token at a time: the rotating buffers wrap
        m(mx.array([[t]]), cache=cache)
    assert any(getattr(c, "_idx", 0) < c.keys.shape[2] for c in cache)
    plain = copy_cache(cache)
    got = recompute_and_read(m, cache, ids, [(23, 24)], ids[24:], keep=3)
    want = last_logits(m, mx.array([ids[24:]]), plain, keep=3)
    assert mx.abs(got - want).max().item() < 1e-3
    assert caches_close(cache, plain)


def test_a_recompute_budget_is_a_share_up_to_a_cap_and_defaults_to_the_translators(toy_pair):
    """RecomputeBudget: a share of the context's positions, at most ``most``; a
    switch without a budget of its own recomputes the translator's default
    (spec.recompute, spec.recompute_max), one given overrides it (0: none), and a
    switch from token ids alone (no text to find words in) lets the question choose
    all of it; a lexical choice needs the text."""
    from mlx_kvlingo.switching.api import RecomputeBudget, switch_text
    from mlx_kvlingo.translator.align import tokenize_with_offsets

    assert RecomputeBudget(0.1, 128).positions(550) == 55
    assert RecomputeBudget(0.1, 128).positions(2048) == 128
    assert RecomputeBudget(0.1, 0).positions(2048) == 204
    src, stok, _, _ = toy_pair
    t = identity_translator(src, stok)
    t.spec.recompute, t.spec.recompute_max = 0.5, 4
    text = ("The helper parse_cfg_v2 reads the code 58213 for Pomini Gufifari. "
            "Nothing else of note happened that day, and the file was closed again.")

    def chosen(**kw):
        r = switch_text(src, stok, src, stok, t, text, native_tail=0, **kw)
        return sum(b - a for a, b in r.deferred)

    assert 0 < chosen() <= 4
    assert chosen(recompute_max=0) > 4
    assert chosen(recompute=0.0) == 0
    ids = tokenize_with_offsets(stok, text)[0]
    from_ids = switch(src, src, t, ids, native_tail=0).deferred
    assert 0 < sum(b - a for a, b in from_ids) <= 4
    with pytest.raises(KvlingoError, match="needs the context's text"):
        switch(src, src, t, ids, native_tail=0, select="lexical")
    with pytest.raises(KvlingoError, match="number of positions"):
        switch_text(src, stok, src, stok, t, text, recompute_max=-2)


def test_a_files_reserve_comes_off_its_default_share_only(toy_pair, tmp_path):
    """A budget's reserve: a share of the context less a fixed number of positions
    (a switch's fixed cost), so more of a long context than of a short one; a file
    carries it with its default share and keeps it through a save; a share asked
    for is that share, no reserve."""
    from mlx_kvlingo.switching.api import RecomputeBudget, switch_text
    from mlx_kvlingo.translator.maps import load_translator

    budget = RecomputeBudget(0.25, 220, 55)
    assert [budget.positions(n) for n in (100, 550, 1100, 2048)] == [0, 82, 220, 220]
    assert RecomputeBudget(0.0, 0, 55).positions(2048) == 0
    src, stok, _, _ = toy_pair
    t = identity_translator(src, stok)
    t.spec.recompute, t.spec.recompute_max, t.spec.recompute_reserve = 0.5, 0, 6
    t.save(tmp_path / "t.safetensors")
    t = load_translator(tmp_path / "t.safetensors")
    assert RecomputeBudget.of(t) == RecomputeBudget(0.5, 0, 6)
    assert RecomputeBudget.of(t, 0.5) == RecomputeBudget(0.5, 0, 0)
    text = ("The helper parse_cfg_v2 reads the code 58213 for Pomini Gufifari. "
            "Nothing else of note happened that day, and the file was closed again.")

    def chosen(**kw):
        r = switch_text(src, stok, src, stok, t, text, native_tail=0, **kw)
        return sum(b - a for a, b in r.deferred)

    n = len(stok.encode(text))
    assert 0 < chosen() <= int(0.5 * n) - 6 < chosen(recompute=0.5) <= int(0.5 * n)


def _pieces(tokens):
    offsets, at = [], 0
    for t in tokens:
        offsets.append((at, at + len(t)))
        at += len(t)
    return "".join(tokens), offsets


def test_words_of_several_tokens_are_found_by_their_characters():
    from mlx_kvlingo.switching.recompute import word_spans

    tokens = ["The", " PIN", " is", " ", "9", "1", "7", "3", "4", "3", ".", " foo", "_bar", " ok"]
    text, offsets = _pieces(tokens)
    assert word_spans(text, offsets) == [(4, 10), (11, 13)]
    assert word_spans(text, offsets, 6, 12) == [(6, 10)]  # clipped to lo..hi


def test_question_words_widen_a_chosen_position_to_its_whole_word():
    import numpy as np

    from mlx_kvlingo.switching.query import question_spans
    from mlx_kvlingo.switching.recompute import word_spans

    tokens = ["The", " PIN", " is", " ", "9", "1", "7", "3", "4", "3", ".", " It", " rained"]
    text, offsets = _pieces(tokens)
    scores = np.zeros(len(tokens) - 1)
    scores[6 - 1] = 1.0  # the question reads the third digit most
    plain = question_spans(scores, 6, 1, len(tokens))
    whole = question_spans(scores, 6, 1, len(tokens), words=word_spans(text, offsets))
    assert (4, 10) in whole  # every digit, within the same budget
    assert not any(a <= 4 and 10 <= b for a, b in plain)

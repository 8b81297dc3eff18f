"""The quality gate: scoring a translated cache, falling back, calibration."""

import mlx.core as mx
import pytest
from tiny import identity_translator

from mlx_kvlingo.switching.gate import QualityGate, calibrate_threshold
from mlx_kvlingo.chat.session import Session

QUESTIONS = ["Return the sum of the items.", "Open the file and return a stream.",
             "Close the file.", "Raise ValueError if empty."]


def translators(model, tok, scale):
    """a <-> b translators of one model: identity maps times ``scale`` (1: exact;
    0: every translated key and value is zero, a broken translation)."""
    out = {}
    for pair in (("a", "b"), ("b", "a")):
        out[pair] = identity_translator(model, tok, scale=scale)
    return out


@pytest.fixture(scope="module")
def target(toy_pair):
    return toy_pair[2], toy_pair[3]


def play(model, tok, scale, gate):
    s = Session({"a": (model, tok), "b": (model, tok)}, translators(model, tok, scale),
                gate=gate)
    return [s.generate("ab"[i % 2], q, max_tokens=8) for i, q in enumerate(QUESTIONS)], s


def test_gate_passes_an_exact_translation_and_its_tail_is_native(target):
    m, tok = target
    plain, _ = play(m, tok, 1.0, None)
    gated, s = play(m, tok, 1.0, QualityGate(tokens=6))
    assert [r.text for r in gated] == [r.text for r in plain]  # exact either way
    for r, p in zip(gated[1:], plain[1:]):
        g = r.gate
        assert g is not None and not g["fallback"] and r.fallback is None
        assert g["nll_translated"] < g["nll_none"]  # context helps when translation is exact
        assert g["tokens"] == 5 and g["computed"] == 6
        # The gate computed the last 6 context positions itself.
        assert r.translated == p.translated - 6 and r.prefilled == p.prefilled + 6
    assert gated[0].gate is None  # nothing translated on the first turn


def test_gate_scores_a_broken_translation_worse_and_falls_back_to_native(target):
    from mlx_kvlingo.models.cache import prefill

    m, tok = target
    exact, _ = play(m, tok, 1.0, QualityGate(tokens=8, threshold=99.0))
    broken, _ = play(m, tok, 0.0, QualityGate(tokens=8, threshold=99.0))
    for e, b in zip(exact[1:], broken[1:]):
        assert b.gate["score"] > e.gate["score"] + 0.2  # zeroed maps lose the context
        assert not b.fallback
    cut = max(e.gate["score"] for e in exact[1:]) + 0.1
    gated, s = play(m, tok, 0.0, QualityGate(tokens=8, threshold=cut))
    for r in gated[1:]:
        assert r.gate["fallback"] and r.fallback and "gate:" in r.fallback
        assert r.translated == 0 and r.translated_from == {}
    assert all(s.transcript.translated[n] == 0 for n in "ab")
    # After falling back the caches are native: b (which answered last) gives the
    # next-token log-probs of a native prefill.
    tokens = s.tokens
    want = m(mx.array([[tokens[-1]]]), cache=prefill(m, mx.array(tokens[:-1])[None]))[0, -1]
    want = want - mx.logsumexp(want)
    got = s.read("b", [tokens[0]])[0]
    assert mx.abs(got - want).max().item() < 1e-3


def test_threshold_from_the_translator_and_calibration(target):
    m, tok = target
    ts = translators(m, tok, 1.0)
    ts["a", "b"].spec.training["gate"] = {"threshold": -99.0}  # fires on everything
    s = Session({"a": (m, tok), "b": (m, tok)}, ts, gate=QualityGate(tokens=4))
    s.generate("a", QUESTIONS[0], max_tokens=4)
    r = s.generate("b", QUESTIONS[1], max_tokens=4)
    assert r.gate["threshold"] == -99.0 and r.fallback
    scores = [float(i) for i in range(100)]
    t = calibrate_threshold(scores, max_fire_rate=0.1)
    assert sum(x > t for x in scores) == 10
    assert sum(x > calibrate_threshold(scores, 0.0) for x in scores) == 0


def test_switch_with_gate(target):
    from mlx_lm.generate import stream_generate

    from mlx_kvlingo.switching.gate import switch_with_gate
    from mlx_kvlingo.switching.generate import generate_after_switch

    m, tok = target
    tokens = tok.encode("Return a new list containing all items from the iterable in "
                        "ascending order, and close the file when done.")
    native = [r.token for r in stream_generate(m, tok, mx.array(tokens), max_tokens=6)]
    measure = QualityGate(tokens=8, threshold=float("inf"))
    scores = [switch_with_gate(m, m, translators(m, tok, scale)["a", "b"], tokens,
                               gate=measure)[1].score for scale in (1.0, 0.0)]
    assert scores[1] > scores[0]
    for scale, fires in ((1.0, False), (0.0, True)):
        t = translators(m, tok, scale)["a", "b"]
        gate = QualityGate(tokens=8, threshold=sum(scores) / 2)
        result, decision = switch_with_gate(m, m, t, tokens, gate=gate)
        assert decision.fallback is fires and decision.computed == 8
        got = [r.token for r in generate_after_switch(m, tok, result, max_tokens=6)]
        assert got == native  # exact maps, or a native re-prefill after the fallback


PROBE_TEXT = ("It was a fine day. The clerk said the locker code is 58213 and left. "
              "Then Pomini Gufifari called the helper parse_cfg_v2 twice. It rained all "
              "afternoon and nobody came.")


def test_fact_probes_read_the_cache_without_changing_it(toy_pair):
    """The probe of an exact switch is the probe of the native cache (same words,
    same NLLs), it leaves the cache as it was, and a translation that carries
    nothing probes differently."""
    from mlx_kvlingo.switching.gate import probe_facts
    from mlx_kvlingo.models.cache import copy_cache, prefill, read_layer
    from mlx_kvlingo.switching.api import switch
    from mlx_kvlingo.translator.align import tokenize_with_offsets

    src, stok, _, _ = toy_pair
    ids, offsets = tokenize_with_offsets(stok, PROBE_TEXT)
    native = prefill(src, mx.array(ids[:-1])[None])
    want = probe_facts(src, native, ids, PROBE_TEXT, offsets)
    assert want is not None and "58213" in want.words and len(want.per_word) == 3
    exact = switch(src, src, identity_translator(src, stok), ids, native_tail=0).prompt_cache
    before = copy_cache(exact)
    got = probe_facts(src, exact, ids, PROBE_TEXT, offsets)
    assert got.words == want.words
    assert got.per_word == pytest.approx(want.per_word, abs=1e-3)
    for a, b in zip(exact, before):
        assert a.offset == b.offset
        assert mx.array_equal(read_layer(a)[0], read_layer(b)[0])
    broken = switch(src, src, identity_translator(src, stok, scale=0.0), ids,
                    native_tail=0).prompt_cache
    assert abs(probe_facts(src, broken, ids, PROBE_TEXT, offsets).nll - want.nll) > 1e-2
    plain = "it was a fine day and it rained"
    p_ids, p_off = tokenize_with_offsets(stok, plain)
    assert probe_facts(src, prefill(src, mx.array(p_ids[:-1])[None]), p_ids, plain,
                       p_off) is None


def test_the_fact_gate_keeps_a_good_cache_and_repairs_a_bad_one(toy_pair):
    """Below the threshold the switch is kept as it is; above it the cache is
    re-prefilled (the native one) or its fact-like words recomputed."""
    from mlx_kvlingo.switching.gate import guard_facts, probe_facts
    from mlx_kvlingo.models.cache import prefill, read_layer
    from mlx_kvlingo.switching.api import switch
    from mlx_kvlingo.translator.align import tokenize_with_offsets

    src, stok, _, _ = toy_pair
    ids, offsets = tokenize_with_offsets(stok, PROBE_TEXT)

    def broken():
        return switch(src, src, identity_translator(src, stok, scale=0.0), ids, native_tail=0)

    score = probe_facts(src, broken().prompt_cache, ids, PROBE_TEXT, offsets).nll
    kept, d = guard_facts(src, broken(), ids, PROBE_TEXT, offsets, threshold=score + 1)
    assert d.action == "kept" and d.probe.nll == pytest.approx(score, abs=1e-4)
    fixed, d = guard_facts(src, broken(), ids, PROBE_TEXT, offsets, threshold=score - 1)
    assert d.action == "re-prefilled"
    native = prefill(src, mx.array(ids[:-1])[None])
    for a, b in zip(fixed.prompt_cache, native):
        assert mx.abs(read_layer(a)[0] - read_layer(b)[0]).max().item() < 1e-4
    more, d = guard_facts(src, broken(), ids, PROBE_TEXT, offsets, threshold=score - 1,
                          recompute=0.5)
    assert d.action == "recomputed"
    assert abs(probe_facts(src, more.prompt_cache, ids, PROBE_TEXT, offsets).nll - score) > 1e-3

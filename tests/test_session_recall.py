"""A fact recalled across a conversation that changes models (measure.session_recall)."""

import pytest
from tiny import FILLER, identity_translator

from mlx_kvlingo.data.recall import recall_items
from mlx_kvlingo.errors import KvlingoError
from mlx_kvlingo.measure.recall import NONE
from mlx_kvlingo.measure.session_recall import (
    REPREFILL,
    SWITCHED,
    measure_session_recall,
    pieces,
)



def items(tokenizer, count=3):
    return recall_items(FILLER, count, 120, lambda t: len(tokenizer.encode(t)), seed=2)


def test_pieces_put_the_fact_in_the_first_and_keep_every_character(toy_pair):
    _, stok, _, _ = toy_pair
    for item in items(stok, 6):
        p1, p2, p3 = pieces(item)
        assert p1 + p2 + p3 == item.context
        assert item.context[item.fact[0]:item.fact[1]] in p1
        assert p2.strip() and p3.strip()
        # The fact is followed by text in its own piece: a catch-up's native tail
        # (its last tokens) does not reach it.
        after = p1[p1.index(item.context[item.fact[0]:item.fact[1]]) + item.fact[1] - item.fact[0]:]
        assert len(after.split()) >= min(len(p2.split()), len(p3.split())) // 2


def test_an_exact_translation_recalls_as_a_re_prefill(toy_pair):
    """Identity translators between two copies of one model: every catch-up is
    exact, so the switched conversation scores as the re-prefilled one; a translator
    that carries nothing does not."""
    src, stok, _, _ = toy_pair
    models = {"a": (src, stok), "b": (src, stok)}
    exact = {("a", "b"): identity_translator(src, stok), ("b", "a"): identity_translator(src, stok)}
    its = items(stok)
    result = measure_session_recall(models, exact, "a", "b", its, recompute=[0.2, None],
                                    log=lambda s: None)
    defaults = f"{SWITCHED} + default recompute"  # None: the files' own budget
    assert set(result.scores) == {REPREFILL, SWITCHED, f"{SWITCHED} + recompute 20%", defaults,
                                  NONE}
    for name in (SWITCHED, f"{SWITCHED} + recompute 20%", defaults):
        for x, y in zip(result.scores[REPREFILL], result.scores[name]):
            assert x.exact == y.exact and x.answer_nll == pytest.approx(y.answer_nll, abs=1e-3)
            assert x.read == y.read
    nothing = {("a", "b"): identity_translator(src, stok, scale=0.0),
               ("b", "a"): identity_translator(src, stok, scale=0.0)}
    broken = measure_session_recall(models, nothing, "a", "b", its, log=lambda s: None)
    assert any(abs(x.answer_nll - y.answer_nll) > 1e-2
               for x, y in zip(result.scores[REPREFILL], broken.scores[SWITCHED]))
    with pytest.raises(KvlingoError, match="b -> a"):
        measure_session_recall(models, {("a", "b"): exact[("a", "b")]}, "a", "b", its)


def test_a_session_under_its_break_even_prefills_what_it_would_translate(toy_pair):
    """With translators that carry nothing, the files' defaults lose the fact; the
    same defaults in a session whose break-even no catch-up reaches prefill every
    catch-up and recall as the re-prefilled conversation."""
    src, stok, _, _ = toy_pair
    models = {"a": (src, stok), "b": (src, stok)}
    nothing = {("a", "b"): identity_translator(src, stok, scale=0.0),
               ("b", "a"): identity_translator(src, stok, scale=0.0)}
    result = measure_session_recall(models, nothing, "a", "b", items(stok, 2), recompute=[None],
                                    break_even=10**6, log=lambda s: None)
    gated = f"{SWITCHED} + default recompute, break-even {10**6}"
    for x, y in zip(result.scores[REPREFILL], result.scores[gated]):
        assert x.exact == y.exact and x.answer_nll == pytest.approx(y.answer_nll, abs=1e-3)
    assert any(abs(x.answer_nll - y.answer_nll) > 1e-2 for x, y in
               zip(result.scores[REPREFILL], result.scores[f"{SWITCHED} + default recompute"]))

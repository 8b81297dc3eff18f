"""Fidelity measurement: native tails, attention-output cosine, bootstrap intervals
and paired differences."""

import mlx.core as mx
import numpy as np
import pytest
from tiny import identity_translator, tiny_model

from mlx_kvlingo.errors import KvlingoError
from mlx_kvlingo.measure.evaluate import cbr_difference, evaluate_translators
from mlx_kvlingo.translator.maps import Translator


def _zero(m):
    t = Translator.for_models(m, m)
    for lin in t.k_maps + t.v_maps:
        lin.weight = mx.zeros_like(lin.weight)
    return t


def _windows(n=6, length=40, seed=0):
    rng = np.random.default_rng(seed)
    return [mx.array(rng.integers(0, 97, (2, length)))  for _ in range(n // 2)]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_identity_is_native_and_zero_maps_are_not(arch):
    m = tiny_model(arch, seed=1)
    ident, zero = evaluate_translators(m, m, [identity_translator(m), _zero(m)], _windows(), 30)
    assert len(ident.windows) == 6 and ident.tokens == 60
    assert ident.kl < 1e-6 and ident.top1 == 1.0
    assert ident.attention_cosine == pytest.approx([1.0] * len(m.layers), abs=1e-4)
    assert zero.kl > 1e-3
    assert zero.attention_cosine_worst < 0.999
    assert zero.attention_cosine_mean < ident.attention_cosine_mean


def test_totals_are_the_per_token_kl_nll_and_top1_of_the_log_probs():
    """ScoreTotals against a direct numpy computation on random log-probs (a vocabulary
    wide enough for cpu_math's numpy exponentials)."""
    from mlx_kvlingo.measure.evaluate import ScoreTotals

    rng = np.random.default_rng(4)
    B, L, V = 2, 5, 9000

    def logprobs():
        x = rng.normal(size=(B, L, V)).astype(np.float32) * 3
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    nat, tr, none = logprobs(), logprobs(), logprobs()
    cont = rng.integers(0, V, (B, L))
    tot = ScoreTotals()
    tot.add(mx.array(cont), mx.array(nat), mx.array(tr), mx.array(none))
    f = tot.result(30)

    def kl(p, q):
        return (np.exp(p) * (p - q)).sum(-1)

    nll = lambda lp: -np.take_along_axis(lp, cont[..., None], -1)[..., 0]
    assert f.tokens == B * L
    assert f.kl == pytest.approx(kl(nat, tr).mean(), rel=1e-4)
    assert f.kl_none == pytest.approx(kl(nat, none).mean(), rel=1e-4)
    assert f.nll_translated == pytest.approx(nll(tr).mean(), rel=1e-5)
    assert f.top1 == pytest.approx((nat.argmax(-1) == tr.argmax(-1)).mean())
    assert [w["kl"] for w in f.windows] == pytest.approx(kl(nat, tr).sum(-1), rel=1e-4)
    assert "kl_none" not in f.windows[0]


def test_native_tail_variants_are_scored_on_the_same_windows():
    m = tiny_model("qwen3", seed=2)
    rows = evaluate_translators(m, m, [_zero(m)], _windows(), 30, native_tails=(0, 8, 28))
    assert [r.native_tail for r in rows] == [0, 8, 28]
    # Same windows: the native and no-context NLLs are identical across variants.
    for r in rows[1:]:
        assert [w["native"] for w in r.windows] == [w["native"] for w in rows[0].windows]
        assert [w["none"] for w in r.windows] == [w["none"] for w in rows[0].windows]
    # Computing more of the context natively brings the zero maps closer to native.
    assert rows[2].kl < rows[1].kl < rows[0].kl


def test_truncation_baselines_are_scored_on_the_same_windows():
    """Keeping the whole context is the native cache; keeping fewer of its last
    tokens is not (a random model uses its context in no particular order, so only
    that much is certain)."""
    m = tiny_model("llama", seed=3)
    rows = evaluate_translators(m, m, [_zero(m)], _windows(), 30, truncations=(2, 12, 29))
    assert [r.truncated for r in rows] == [0, 2, 12, 29]
    for r in rows[1:]:
        assert [w["native"] for w in r.windows] == [w["native"] for w in rows[0].windows]
    whole = rows[3]
    assert whole.kl < 1e-6 and whole.cbr == pytest.approx(1.0, abs=1e-4)
    assert min(rows[1].kl, rows[2].kl) > 1e-3
    with pytest.raises(KvlingoError, match="last 30 tokens"):
        evaluate_translators(m, m, [], _windows(2), 30, truncations=(30,))


def test_bootstrap_interval_and_paired_difference():
    m = tiny_model("qwen2", seed=3)
    a, b = evaluate_translators(m, m, [_zero(m)], _windows(8), 30, native_tails=(0, 12))
    lo, hi = a.cbr_interval()
    assert lo <= a.cbr <= hi and lo < hi
    d, (dlo, dhi) = cbr_difference(a, a)
    assert d == 0 and dlo == 0 and dhi == 0
    d, (dlo, dhi) = cbr_difference(b, a)
    assert d == pytest.approx(b.cbr - a.cbr) and dlo <= d <= dhi
    # Paired resampling: the difference's interval is narrower than the naive sum of
    # the two intervals' half-widths when the rows share their windows.
    assert (dhi - dlo) < (hi - lo) + (b.cbr_interval()[1] - b.cbr_interval()[0])
    d_json = a.to_dict()
    assert d_json["cbr_ci95"] == [lo, hi] and len(d_json["windows"]) == 8

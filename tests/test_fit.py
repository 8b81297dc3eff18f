"""Stage 1: the closed-form fit is the least-squares solution, streams, and helps."""

import mlx.core as mx
import numpy as np
import pytest
from tiny import tiny_model

from mlx_kvlingo.data import corpus as data
from mlx_kvlingo.measure.evaluate import evaluate_translator
from mlx_kvlingo.train.fit import MomentAccumulator, fit_stage1
from mlx_kvlingo.translator.maps import Translator


def _features(model, tokens):
    from mlx_kvlingo.models.features import token_features

    return token_features(model, tokens)


def test_moments_give_the_least_squares_solution_and_r2():
    src, tgt = tiny_model("qwen2", seed=1), tiny_model("llama", seed=2)
    t = Translator.for_models(src, tgt, native_prefix=0)
    tokens = mx.random.randint(0, 97, (3, 40), key=mx.random.key(0))
    acc = MomentAccumulator(t)
    sk, sv, _ = _features(src, tokens)
    tk, tv, _ = _features(tgt, tokens)
    acc.add(sk, sv, tk, tv)
    r2_k, r2_v = acc.solve(ridge=1e-9)
    for i, layers in enumerate(t.spec.layer_map):
        x = np.concatenate([np.array(sk[j]).reshape(-1, sk[j].shape[-1]) for j in layers], 1)
        y = np.array(tk[i]).reshape(-1, tk[i].shape[-1])
        w, *_ = np.linalg.lstsq(x.astype(np.float64), y.astype(np.float64), rcond=None)
        np.testing.assert_allclose(np.array(t.k_maps[i].weight), w.T, atol=2e-3, rtol=1e-3)
        pred = x @ w
        r2 = 1 - ((y - pred) ** 2).sum() / ((y - y.mean(0)) ** 2).sum()
        assert r2_k[i] == pytest.approx(r2, abs=1e-3)
    assert all(0 <= r <= 1 for r in r2_k + r2_v)


def test_moments_stream_batch_by_batch():
    """Adding batches one at a time gives the same maps as adding them at once."""
    src, tgt = tiny_model("qwen3", seed=1), tiny_model("mistral", seed=2)
    tokens = mx.random.randint(0, 97, (4, 32), key=mx.random.key(1))
    maps = []
    for chunks in ([tokens], [tokens[:1], tokens[1:3], tokens[3:]]):
        t = Translator.for_models(src, tgt, sources_per_layer=2)
        acc = MomentAccumulator(t)
        for c in chunks:
            acc.add(*_features(src, c)[:2], *_features(tgt, c)[:2], skip=1)
        acc.solve()
        maps.append([np.array(m.weight) for m in t.k_maps + t.v_maps])
    for a, b in zip(*maps):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_native_prefix_positions_are_left_out_of_the_fit():
    """Positions the target computes itself must not pull on the maps."""
    src, tgt = tiny_model("qwen2", seed=1), tiny_model("qwen3", seed=2)
    tokens = mx.random.randint(0, 97, (2, 24), key=mx.random.key(2))
    a = Translator.for_models(src, tgt, native_prefix=2)
    fit_stage1(src, tgt, a, [tokens])
    b = Translator.for_models(src, tgt, native_prefix=0)
    acc = MomentAccumulator(b)
    acc.add(*_features(src, tokens)[:2], *_features(tgt, tokens)[:2], skip=2)
    acc.solve()
    np.testing.assert_allclose(np.array(a.v_maps[1].weight), np.array(b.v_maps[1].weight), rtol=1e-5, atol=1e-6)
    assert a.spec.training["stage"] == 1 and a.spec.training["fit"]["tokens"] == 2 * 22


@pytest.mark.slow
def test_stage1_between_different_models_beats_no_context(docstring_pair):
    """On held-out text, the fitted translator's KL to the native predictions is far
    below the target's KL with no context at all. (On the first release's pair: on
    the shipped one stage 1 keeps only 1.5 % of the context benefit, KL ratio 0.83
    on docstrings, and stage 2 does the rest; test_builtin_pair checks that.)"""
    src, stok, tgt, ttok = docstring_pair
    train, heldout = data.split_documents(data.stdlib_documents())
    t = Translator.for_models(src, tgt, stok, ttok)
    fit_stage1(src, tgt, t, data.token_windows(data.token_stream(stok, train), 256, 8, 120))
    windows = list(data.token_windows(data.token_stream(stok, heldout), 192, 8, 16))
    fitted = evaluate_translator(src, tgt, t, windows, 128)
    # A translator that writes zeros (an empty, uninformative cache) for comparison.
    zero = Translator.for_models(src, tgt, stok, ttok)
    for m in zero.k_maps + zero.v_maps:
        m.weight = mx.zeros_like(m.weight)
    zeroed = evaluate_translator(src, tgt, zero, windows, 128)
    print(fitted, zeroed)
    assert fitted.kl < 0.35 * fitted.kl_none
    assert fitted.kl < 0.35 * zeroed.kl
    assert fitted.top1 > zeroed.top1
    assert fitted.nll_translated < fitted.nll_none


def test_the_shared_gram_from_its_upper_blocks_is_the_full_product():
    """The Gram accumulates only its upper block triangle; mirrored, it is XᵀX (over
    several adds, block edges that cut layers), and the fit is the same for any
    block size."""
    from mlx_kvlingo.train.fit import GramAccumulator

    src, tgt = tiny_model("llama", seed=3), tiny_model("qwen3", seed=4)
    t = Translator.for_models(src, tgt, native_prefix=1)
    geo_s = [g.width for g in t.spec.source.cache_geometry.layers]
    geo_t = [g.width for g in t.spec.target.cache_geometry.layers]
    batches = []
    for seed in (5, 6):
        tokens = mx.random.randint(0, 97, (2, 40), key=mx.random.key(seed))
        sk, sv, _ = _features(src, tokens)
        tk, tv, _ = _features(tgt, tokens)
        batches.append((sk, sv, tk, tv))
    fits = []
    for block in (24, 10_000):
        gram = GramAccumulator(geo_s, geo_t)
        gram.block = block
        for b in batches:
            gram.add(*b, skip=1)
        x = np.concatenate([np.concatenate([np.array(f[:, 1:]).reshape(-1, f.shape[-1])
                                            for f in b[1]], axis=1) for b in batches])
        np.testing.assert_allclose(gram.gram("v"), x.T @ x, rtol=1e-5, atol=1e-3)
        layer_map = [[0, len(geo_s) - 1]] * len(geo_t)
        fits.append(gram.translator(t.spec, layer_map, 1e-3)[0])
    assert sum(geo_s) > 24  # several blocks
    # Weights up to ~1, solved from Grams summed in another order: float32 rounding
    # through the solve moves entries by a few 1e-6 (2.5e-6 seen, one BLAS thread).
    for a, b in zip(fits[0].k_maps + fits[0].v_maps, fits[1].k_maps + fits[1].v_maps):
        np.testing.assert_allclose(np.array(a.weight), np.array(b.weight), rtol=1e-5, atol=2e-5)


def test_layer_selection_from_the_shared_gram_equals_a_direct_fit():
    """Every layer subset is a sub-block of one Gram matrix: the maps chosen from it
    equal maps fitted directly on the chosen layers."""
    from mlx_kvlingo.train.fit import GramAccumulator, fit_selected

    src, tgt = tiny_model("llama", seed=3), tiny_model("qwen3", seed=4)
    t = Translator.for_models(src, tgt, native_prefix=1)
    tokens = mx.random.randint(0, 97, (3, 48), key=mx.random.key(5))
    sk, sv, _ = _features(src, tokens)
    tk, tv, _ = _features(tgt, tokens)
    chosen, report, _ = fit_selected(t, [(sk, sv, tk, tv)], candidates=[2], ridge=1e-3, skip=1)
    assert all(len(m) == 2 and m == sorted(m) for m in chosen.spec.layer_map)

    direct = Translator(chosen.spec)  # same layer map, fitted the old way
    acc = MomentAccumulator(direct)
    acc.add(sk, sv, tk, tv, skip=1)
    r2_k, r2_v = acc.solve(ridge=1e-3)
    # (The shared Gram sums float32 per-batch products; the direct fit is float64.)
    for a, b in zip(chosen.k_maps + chosen.v_maps, direct.k_maps + direct.v_maps):
        np.testing.assert_allclose(np.array(a.weight), np.array(b.weight), rtol=1e-3, atol=1e-4)
    assert report.r2_keys == pytest.approx(r2_k, abs=1e-4)
    assert report.r2_values == pytest.approx(r2_v, abs=1e-4)

    # The ranking puts first the source layer that fits each target layer best alone.
    gram = GramAccumulator([g.width for g in t.spec.source.cache_geometry.layers],
                           [g.width for g in t.spec.target.cache_geometry.layers])
    gram.add(sk, sv, tk, tv, skip=1)
    for i, ranked in enumerate(gram.ranked_layers(1e-3)):
        single = gram.single_layer_r2(i, 1e-3)
        assert single[ranked[0]] == single.max()
        assert ranked[0] in chosen.spec.layer_map[i]


def test_layer_selection_keeps_the_candidate_the_chooser_picks():
    from mlx_kvlingo.train.fit import fit_selected

    src, tgt = tiny_model("qwen2", seed=1), tiny_model("llama", seed=2)
    t = Translator.for_models(src, tgt)
    tokens = mx.random.randint(0, 97, (2, 32), key=mx.random.key(6))
    feats = [(*_features(src, tokens)[:2], *_features(tgt, tokens)[:2])]
    seen = []

    def choose(candidates):
        seen.extend(len(c.spec.layer_map[0]) for c in candidates)
        return 1

    chosen, _, every = fit_selected(t, feats, candidates=[1, 3], choose=choose,
                                   extra={"adjacent": t.spec.layer_map})
    assert set(every) == {"top1", "top3", "adjacent"}
    assert every["adjacent"].spec.layer_map == t.spec.layer_map
    assert seen == [1, 3]
    assert all(len(m) == 3 for m in chosen.spec.layer_map)
    assert chosen.spec.training["sources_per_layer"] == 3

"""Token maps: target layers whose maps also read the target's own embeddings of
each position's token and the token before it (models.token_inputs)."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from tiny import tiny_model

from mlx_kvlingo.errors import KvlingoError, TranslatorFileError, TranslatorMismatch
from mlx_kvlingo.models.cache import cache_features, prefill, read_layer
from mlx_kvlingo.models.features import token_features, token_inputs
from mlx_kvlingo.switching.api import translate_aligned
from mlx_kvlingo.train.distill import LowRankMaps, kl_loss, make_batch, translated_cache
from mlx_kvlingo.translator.align import NATIVE, identity_alignment
from mlx_kvlingo.translator.maps import METADATA_KEY, Translator, load_translator


def _translator(src, tgt, token_layers, seed=0):
    mx.random.seed(seed)
    t = Translator.for_models(src, tgt, token_layers=token_layers)
    mx.eval(t.parameters())
    return t


def test_token_inputs_are_each_token_and_the_one_before_normalised():
    m = tiny_model("gemma3_text")
    tokens = mx.array([[5, 9, 9, 40, 3]])
    x = token_inputs(m, tokens, 0, 7)  # two positions past the end: free cache rows
    h = m.model.embed_tokens.weight.shape[1]
    assert x.shape == (1, 7, 2 * h) and x.dtype == mx.float32
    cur, prev = x[..., :h], x[..., h:]
    rms = mx.sqrt((cur * cur).mean(-1))
    assert mx.allclose(rms, mx.ones_like(rms), atol=1e-4)
    assert mx.array_equal(prev[:, 1:5], cur[:, :4])  # the token before
    assert mx.abs(prev[:, 0]).max().item() == 0.0  # position 0 has none
    assert mx.array_equal(cur[:, 1], cur[:, 2])  # same token, same row
    assert mx.array_equal(cur[:, 5], cur[:, 4]) and mx.array_equal(cur[:, 6], cur[:, 4])
    # Gemma scales its embeddings by sqrt(hidden): normalised away.
    e = m.model.embed_tokens(tokens)
    want = e / mx.sqrt((e * e).mean(-1, keepdims=True) + 1e-6)
    assert mx.allclose(cur[:, :5], want, atol=1e-5)
    assert mx.array_equal(token_inputs(m, tokens, 2, 4), x[:, 2:4])


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_token_maps_write_their_term_into_the_translated_cache(arch):
    """With every source map zero, a token layer's translated keys and values are
    exactly its token maps' output on the target's own token inputs, the other
    layers are zero; and the fresh-cache path (maps over source rows, gathered,
    early layer) builds the cache the general path builds."""
    from mlx_lm.models.cache import make_prompt_cache

    m = tiny_model(arch)
    full = [i for i, c in enumerate(make_prompt_cache(m)) if not hasattr(c, "max_size")]
    layers = full[-1:] + [0]
    t = _translator(m, m, layers)
    tokens = mx.random.randint(0, 97, (1, 30), key=mx.random.key(2))
    a = identity_alignment(tokens[0].tolist(), 1)
    a.source_index = [NATIVE, 1, 1, 2, 5, 4] + list(range(6, 30))  # gathered rows
    source_cache = prefill(m, tokens[:, :29])
    fast = translate_aligned(m, m, t, source_cache, None, a, 29)
    slow = translate_aligned(m, m, t, source_cache, make_prompt_cache(m), a, 29)
    for c, d in zip(fast, slow):
        (fk, fv, fs), (sk, sv, ss) = read_layer(c), read_layer(d)
        assert fs == ss and fk.shape == sk.shape
        assert mx.abs(fk - sk).max().item() < 1e-4 and mx.abs(fv - sv).max().item() < 1e-4

    for km in t.k_maps + t.v_maps:
        km.weight = mx.zeros_like(km.weight)
    cache = translate_aligned(m, m, t, source_cache, None, a, 29)
    x = token_inputs(m, tokens, 1, 29)
    for i in range(len(cache)):
        k, v, _ = cache_features(m, cache, [i], span=(max(1, 29 - _held(cache[i])), 29))
        n = k[i].shape[1]
        if i in layers:
            want_k, want_v = t.token_map(i, "k")(x[:, -n:]), t.token_map(i, "v")(x[:, -n:])
            assert mx.abs(want_k).max().item() > 0.1
            assert mx.abs(k[i] - want_k).max().item() < 1e-4
            assert mx.abs(v[i] - want_v).max().item() < 1e-4
        else:
            assert mx.abs(k[i]).max().item() < 1e-6 and mx.abs(v[i]).max().item() < 1e-6


def _held(c):
    return read_layer(c)[0].shape[2]


def test_a_translator_with_token_maps_needs_the_tokens():
    m = tiny_model("qwen2")
    t = _translator(m, m, [1])
    k, v, _ = token_features(m, mx.array([[1, 2, 3]]))
    with pytest.raises(KvlingoError, match="token embeddings"):
        t(k, v)
    assert t.token_map(0, "k") is None and t.token_map(1, "v") is t.v_tok[0]
    with pytest.raises(KvlingoError, match="token layers"):
        Translator.for_models(m, m, token_layers=[9])


def test_token_maps_round_trip_and_are_checked(tmp_path):
    src, tgt = tiny_model("llama"), tiny_model("qwen3", seed=1)
    t = _translator(src, tgt, [1, 3])
    assert t.spec.token_layers == [1, 3] and t.spec.token_width == 2 * 64
    for dtype, bits, tol in ((mx.float32, None, 0), (mx.float16, 8, 0.05)):
        path = tmp_path / f"t{bits}.safetensors"
        t.save(path, dtype=dtype, bits=bits)
        back = load_translator(path)
        assert back.spec.token_layers == [1, 3] and back.spec.format_version == 2
        for a, b in zip(t.k_tok + t.v_tok, back.k_tok + back.v_tok):
            assert mx.abs(a.weight - b.weight).max().item() <= tol
    # A target whose embeddings are another width cannot feed the token maps.
    wide = tiny_model("qwen3", seed=1, hidden_size=96)
    with pytest.raises(TranslatorMismatch, match="token maps read 128"):
        t.check_models(src, wide)
    # Metadata naming a layer the target does not have is refused by name.
    arrays = mx.load(str(tmp_path / "tNone.safetensors"))
    spec = json.loads(t.spec.to_json())
    spec["token_layers"] = [1, 7]
    bad = tmp_path / "bad.safetensors"
    mx.save_safetensors(str(bad), arrays, {METADATA_KEY: json.dumps(spec)})
    with pytest.raises(TranslatorFileError, match="token_layers"):
        load_translator(bad)


def test_stage2_trains_the_token_maps_beside_the_correction():
    src, tgt = tiny_model("qwen2", seed=1), tiny_model("gemma3_text", seed=2)
    tgt.freeze()
    t = _translator(src, tgt, [2, 5])
    w = mx.random.randint(0, 97, (2, 26), key=mx.random.key(9))
    batch = make_batch(src, tgt, t, w[:, :20], w[:, 20:])
    maps = LowRankMaps(t, rank=2, seed=3)
    for b in maps.b_k + maps.b_v:
        b[:] = mx.random.normal(b.shape, key=mx.random.key(b.shape[0])) * 0.1
    names = {k for k, _ in nn.utils.tree_flatten(maps.trainable_parameters())}
    assert {"base.k_tok.0.weight", "base.v_tok.1.weight"} <= names
    assert not any(k.startswith("base.k_maps") for k in names)
    _, grads = nn.value_and_grad(maps, lambda m, b: kl_loss(m, tgt, b))(maps, batch)
    mx.eval(grads)
    assert float(mx.abs(grads["base"]["k_tok"][1]["weight"]).max()) > 0.0
    # The merged translator carries the token maps: it builds the same cache.
    merged = maps.merged()
    for c, d in zip(translated_cache(tgt, maps, batch), translated_cache(tgt, merged, batch)):
        (ck, cv, _), (dk, dv, _) = read_layer(c), read_layer(d)
        assert mx.abs(ck - dk).max().item() < 1e-4 and mx.abs(cv - dv).max().item() < 1e-4
    # ... and the token terms are in it: without them the cache differs.
    plain = maps.merged()
    for m in plain.k_tok + plain.v_tok:
        m.weight = mx.zeros_like(m.weight)
    k5 = read_layer(translated_cache(tgt, merged, batch)[5])[0]
    assert mx.abs(k5 - read_layer(translated_cache(tgt, plain, batch)[5])[0]).max().item() > 1e-2


@pytest.mark.parametrize("rank", [0, 2])
def test_frozen_token_maps_stay_at_their_fit_while_the_rest_trains(rank):
    """``token_maps="frozen"``: a stage-2 step moves the correction (or, at rank 0,
    the source maps) and leaves every token map exactly as stage 1 fitted it; the
    default trains them."""
    from mlx_kvlingo.train.distill import DistillConfig, Distiller

    src, tgt = tiny_model("qwen2", seed=1), tiny_model("gemma3_text", seed=2)
    w = mx.random.randint(0, 97, (2, 26), key=mx.random.key(9))
    moved = {}
    for mode in ("frozen", "train"):
        t = _translator(src, tgt, [2, 5])
        batch = make_batch(src, tgt, t, w[:, :20], w[:, 20:])
        before = [mx.array(m.weight) for m in t.k_tok + t.v_tok]
        k0 = mx.array(t.k_maps[1].weight)
        d = Distiller(t, tgt, DistillConfig(steps=3, lr=1e-2, rank=rank, token_maps=mode))
        for _ in range(2):
            _, applied = d.train_step([batch])
            assert applied
        after = d.translator()
        moved[mode] = max(mx.abs(a.weight - b).max().item()
                          for a, b in zip(after.k_tok + after.v_tok, before))
        assert mx.abs(after.k_maps[1].weight - k0).max().item() > 0.0  # the rest trains
    assert moved["frozen"] == 0.0 and moved["train"] > 0.0
    with pytest.raises(KvlingoError, match="token_maps"):
        Distiller(_translator(src, tgt, [2]), tgt, DistillConfig(token_maps="thawed"))


def test_the_shared_gram_fits_token_maps_jointly_with_the_source_terms():
    """A token layer's map is the ridge fit on [chosen source layers, token inputs]:
    the same weights as a direct solve on those columns, split into the source map
    and the token map; it fits better than the source layers alone."""
    from mlx_kvlingo.train.fit import Moments, fit_selected, ridge_solve

    src, tgt = tiny_model("llama", seed=3), tiny_model("qwen3", seed=4)
    t = Translator.for_models(src, tgt, token_layers=[2])
    plain = Translator.for_models(src, tgt)
    tokens = mx.random.randint(0, 97, (3, 48), key=mx.random.key(5))
    sk, sv, _ = token_features(src, tokens)
    tk, tv, _ = token_features(tgt, tokens)
    x_tok = token_inputs(tgt, tokens, 0, 48)
    chosen, report, _ = fit_selected(t, [(sk, sv, tk, tv, x_tok)], candidates=[2], skip=1)
    base, base_report, _ = fit_selected(plain, [(sk, sv, tk, tv)], candidates=[2], skip=1)
    assert chosen.spec.token_layers == [2] and chosen.spec.layer_map == base.spec.layer_map
    assert report.r2_keys[2] > base_report.r2_keys[2] + 0.01
    assert report.r2_keys[:2] == pytest.approx(base_report.r2_keys[:2], abs=1e-6)

    rows = lambda a: np.asarray(a[:, 1:], dtype=np.float64).reshape(-1, a.shape[-1])  # noqa: E731
    x = np.concatenate([rows(sk[j]) for j in chosen.spec.layer_map[2]] + [rows(x_tok)], 1)
    y = rows(tk[2])
    m = Moments(x.T @ x, y.T @ x, y.sum(0), (y * y).sum(0), len(y))
    w, r2 = ridge_solve(m.xtx, m, 1e-3)
    n = chosen.k_maps[2].weight.shape[1]
    # (The shared Gram sums float32 per-batch products; this solve is float64.)
    np.testing.assert_allclose(np.array(chosen.k_maps[2].weight), w[:, :n], rtol=1e-2, atol=5e-4)
    np.testing.assert_allclose(np.array(chosen.k_tok[0].weight), w[:, n:], rtol=1e-2, atol=5e-4)
    assert report.r2_keys[2] == pytest.approx(r2, abs=1e-4)
    # Token maps need the shared-Gram fit; the plain fit says so.
    from mlx_kvlingo.train.fit import fit_features

    with pytest.raises(KvlingoError, match="select-layers"):
        fit_features(Translator.for_models(src, tgt, token_layers=[1]), [])

"""Compressed translators: one shared low-rank projection of the source layers
(translator.compress), switched through the same kernel."""

import mlx.core as mx
import numpy as np
import pytest
from tiny import CONFIGS, identity_translator, tiny_model

from mlx_kvlingo.errors import KvlingoError
from mlx_kvlingo.models.cache import prefill, read_layer
from mlx_kvlingo.switching.api import switch
from mlx_kvlingo.translator.compress import calibration_features, compress_translator
from mlx_kvlingo.translator.maps import METADATA_KEY, load_translator, read_safetensors_header


def windows(count, length=48, seed=0):
    return [mx.random.randint(1, 97, (length,), key=mx.random.key(seed + i)).tolist()
            for i in range(count)]


def model(arch):
    return tiny_model(arch, sliding_window=64) if arch == "gemma3_text" else tiny_model(arch)


def compressed(m, translator, key_rank, value_rank, count=6):
    feats = calibration_features(m, windows(count), translator.source_layers)
    return compress_translator(translator, feats, key_rank, value_rank)


def max_difference(a, b):
    out = 0.0
    for x, y in zip(a, b):
        (ka, va, _), (kb, vb, _) = read_layer(x), read_layer(y)
        out = max(out, mx.abs(ka - kb).max().item(), mx.abs(va - vb).max().item())
    return out


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_full_rank_compression_switches_like_the_original(arch):
    """At the rank of the union of source layers nothing is lost: the switched cache
    (an exact identity translator: the native one) is the same."""
    m = model(arch)
    t = identity_translator(m)
    width = sum(g.width for g in t.spec.source.cache_geometry.layers)
    small, report = compressed(m, t, width, width)
    assert max(report.key_error + report.value_error) < 1e-6
    ids = windows(1, length=30, seed=99)[0]
    want = switch(m, m, t, ids, native_tail=0).prompt_cache
    got = switch(m, m, small, ids, native_tail=0).prompt_cache
    assert max_difference(got, want) < 1e-3


def with_token_maps(m, scale=0.05, seed=0):
    """An identity translator whose every layer also has a (random) token map."""
    from mlx_kvlingo.translator.maps import Translator

    t = Translator.for_models(m, m, token_layers=range(len(m.layers)))
    for lin in t.k_maps + t.v_maps:
        lin.weight = mx.eye(lin.weight.shape[0])
    keys = mx.random.split(mx.random.key(seed), 2 * len(t.k_tok))
    for key, lin in zip(keys, t.k_tok + t.v_tok):
        lin.weight = scale * mx.random.normal(lin.weight.shape, key=key)
    mx.eval(t.parameters())
    return t


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_token_maps_fold_into_the_projection(arch, tmp_path):
    """With the token inputs under the projection, a full-rank compression still
    switches like the original, has no separate token maps, and round-trips."""
    m = model(arch)
    t = with_token_maps(m)
    feats = calibration_features(m, windows(8), t.source_layers, target=m)
    width = feats["k"].shape[1] + feats["tokens"].shape[1]
    small, report = compress_translator(t, feats, width, width, fold_tokens=True)
    assert small.spec.shared_tokens and not small.k_tok and not small.v_tok
    ids = windows(1, length=30, seed=99)[0]
    want = switch(m, m, t, ids, native_tail=0).prompt_cache
    got = switch(m, m, small, ids, native_tail=0).prompt_cache
    assert max_difference(got, want) < 1e-3
    small.save(tmp_path / "f.safetensors")
    back = load_translator(tmp_path / "f.safetensors")
    assert back.spec.shared_tokens
    again = switch(m, m, back, ids, native_tail=0).prompt_cache
    assert max_difference(again, got) < 1e-5
    with pytest.raises(KvlingoError, match="token inputs"):
        compress_translator(t, {k: feats[k] for k in "kv"}, 8, 8, fold_tokens=True)
    with pytest.raises(KvlingoError, match="no token maps"):
        compress_translator(identity_translator(m), feats, 8, 8, fold_tokens=True)


def test_lower_ranks_lose_more_and_cost_less():
    m = tiny_model("llama")
    t = identity_translator(m)
    errors, costs = [], []
    for rank in (4, 16, 48):
        _, report = compressed(m, t, rank, rank)
        errors.append(np.mean(report.key_error + report.value_error))
        costs.append(report.macs_after)
        assert report.macs_before == 2 * sum(
            sum(g.width for g in t.spec.source.cache_geometry.layers[j:j + 1]) * g.width
            for j, g in enumerate(t.spec.target.cache_geometry.layers))
    assert errors[0] > errors[1] > errors[2] >= 0
    assert costs[0] < costs[1] < costs[2]


@pytest.mark.parametrize("fold", [False, True])
def test_a_compressed_translator_compresses_again_to_lower_ranks(fold):
    """Compressed again, a full-rank compression gives what compressing the
    original at the lower ranks gives (same maps, same calibration), costs less,
    and reports its multiply-adds from the compressed maps it started from."""
    m = tiny_model("llama")
    t = with_token_maps(m) if fold else identity_translator(m)
    feats = calibration_features(m, windows(8), t.source_layers, target=m if fold else None)
    width = feats["k"].shape[1] + (feats["tokens"].shape[1] if fold else 0)
    full, _ = compress_translator(t, feats, width, width, fold_tokens=fold)
    direct, want = compress_translator(t, feats, 6, 4, fold_tokens=fold)
    again, got = compress_translator(full, feats, 6, 4, fold_tokens=fold)
    assert (got.key_rank, got.value_rank) == (6, 4)
    assert np.allclose(got.key_error, want.key_error, atol=1e-4)
    assert np.allclose(got.value_error, want.value_error, atol=1e-4)
    assert got.macs_after == want.macs_after < got.macs_before
    ids = windows(1, length=30, seed=99)[0]
    a = switch(m, m, direct, ids, native_tail=0).prompt_cache
    b = switch(m, m, again, ids, native_tail=0).prompt_cache
    assert max_difference(a, b) < 1e-3


def test_reported_error_is_the_switch_error_on_calibration_text():
    """The per-layer error the report gives is what the compressed maps do to the
    features of the calibration text itself."""
    m = tiny_model("llama")
    t = identity_translator(m)
    feats = calibration_features(m, windows(6), t.source_layers)
    small, report = compress_translator(t, feats, 8, 8)
    n = len(t.source_layers)
    width = feats["k"].shape[1] // n
    keys = [mx.array(feats["k"][None, :, j * width:(j + 1) * width].astype(np.float32))
            for j in range(n)]
    values = [mx.array(feats["v"][None, :, j * width:(j + 1) * width].astype(np.float32))
              for j in range(n)]
    want_k, _ = t.map_sources(keys, values)
    got_k, _ = small.map_sources(keys, values)
    for i, (g, w) in enumerate(zip(got_k, want_k)):
        rel = (mx.sum((g - w) ** 2) / mx.sum(w ** 2)).item()
        assert rel == pytest.approx(report.key_error[i], rel=1e-2, abs=1e-6)


@pytest.mark.parametrize("bits", [None, 8])
def test_compressed_file_round_trips(tmp_path, bits):
    m = tiny_model("llama")
    t = identity_translator(m)
    small, _ = compressed(m, t, 16, 24)
    path = tmp_path / "small.safetensors"
    small.save(path, bits=bits)
    back = load_translator(path)
    assert back.spec.shared_rank == {"k": 16, "v": 24}
    assert '"format_version": 3' in read_safetensors_header(path)["__metadata__"][METADATA_KEY]
    ids = windows(1, length=20, seed=5)[0]
    a = switch(m, m, small, ids, native_tail=0).prompt_cache
    b = switch(m, m, back, ids, native_tail=0).prompt_cache
    assert max_difference(a, b) < (1e-5 if bits is None else 0.05)


def test_an_uncompressed_file_keeps_its_old_format(tmp_path):
    m = tiny_model("llama")
    path = tmp_path / "t.safetensors"
    identity_translator(m).save(path)
    meta = read_safetensors_header(path)["__metadata__"][METADATA_KEY]
    assert "shared_rank" not in meta and '"format_version": 1' in meta


def test_bad_compressions_are_refused():
    m = tiny_model("llama")
    t = identity_translator(m)
    small, _ = compressed(m, t, 8, 8)
    feats = calibration_features(m, windows(1, length=6), t.source_layers)
    with pytest.raises(KvlingoError, match="as it was made"):
        compress_translator(small, {**feats, "tokens": feats["k"]}, 4, 4, fold_tokens=True)
    with pytest.raises(KvlingoError, match="calibrate on more tokens"):
        compress_translator(t, feats, 8, 8)
    with pytest.raises(KvlingoError, match="rank is a count"):
        compress_translator(t, feats, 0, 4)


def test_the_ttft_benchmark_times_and_bounds_a_compressed_translator(toy_pair):
    """measure_ttft's maps ceiling times the projections too; a compressed
    translator's maps take less memory and its bound counts its projections."""
    from mlx_kvlingo.measure.ttft import measure_ttft
    from mlx_kvlingo.translator.maps import Translator

    src, stok, tgt, ttok = toy_pair
    t = Translator.for_models(src, tgt, stok, ttok, sources_per_layer=2)
    feats = calibration_features(src, windows(4, length=64), t.source_layers)
    small, _ = compress_translator(t, feats, 16, 16)
    stream = stok.encode("Return a new list containing all items from the iterable. " * 8)
    rows = [measure_ttft(src, tgt, x, stream, contexts=(48,), repeats=2, warmup=1,
                         native_tails=(0,), rounds=2)[0] for x in (t, small)]
    full, compact = rows[0].memory, rows[1].memory
    assert rows[1].maps_s > 0 and rows[1].translate_s > 0
    assert compact["maps_mb"] < full["maps_mb"]
    assert compact["bound_mb"] == pytest.approx(
        compact["source_cache_mb"] + compact["target_cache_mb"] + compact["maps_mb"]
        + compact["layer_working_set_mb"])


def test_token_maps_fold_in_across_tokenizers():
    """Models with different tokenizers: each calibration row pairs a target token's
    token inputs with the source features of the source token it is aligned to (as a
    switch gathers them), and a full-rank fold switches like the original."""
    from test_align import TEXT, _bpe

    from mlx_kvlingo.models.cache import cache_features, prefill
    from mlx_kvlingo.models.features import token_inputs
    from mlx_kvlingo.switching.api import switch_text
    from mlx_kvlingo.translator.align import align_text
    from mlx_kvlingo.translator.compress import aligned_calibration_features
    from mlx_kvlingo.translator.maps import Translator

    stok, ttok = _bpe(300), _bpe(330, bos=True)
    src, tgt = tiny_model("llama", vocab_size=300), tiny_model("qwen3", seed=1, vocab_size=330)
    t = Translator.for_models(src, tgt, stok, ttok, sources_per_layer=2,
                              token_layers=range(len(tgt.layers)))
    keys = mx.random.split(mx.random.key(3), 2 * len(t.k_tok))
    for key, lin in zip(keys, t.k_tok + t.v_tok):
        lin.weight = 0.05 * mx.random.normal(lin.weight.shape, key=key)
    mx.eval(t.parameters())
    texts = [TEXT * 2, TEXT.upper() + TEXT, TEXT[::-1] * 2]
    feats = aligned_calibration_features(src, stok, tgt, ttok, texts, t.source_layers)
    # The rows of the first text, rebuilt by hand.
    a = align_text(stok, ttok, texts[0])
    keep = [j for j, i in enumerate(a.source_index) if i >= 0]
    ks = cache_features(src, prefill(src, mx.array(a.source_tokens)[None]),
                        list(t.source_layers))[0]
    j = keep[len(keep) // 2]  # one row in the middle
    want_k = np.concatenate([np.array(ks[layer][0][a.source_index[j]])
                             for layer in t.source_layers])
    want_tok = np.array(token_inputs(tgt, mx.array(a.target_tokens)[None], j, j + 1)[0, 0])
    row = keep.index(j)
    assert np.allclose(feats["k"][row], want_k, atol=1e-5)
    assert np.allclose(feats["tokens"][row], want_tok, atol=1e-5)
    # Full rank: the folded translator switches like the original.
    width = feats["k"].shape[1] + feats["tokens"].shape[1]
    small, _ = compress_translator(t, feats, width, width, fold_tokens=True)
    assert small.spec.shared_tokens and small.cross_tokenizer
    want = switch_text(src, stok, tgt, ttok, t, TEXT, native_tail=0).prompt_cache
    got = switch_text(src, stok, tgt, ttok, small, TEXT, native_tail=0).prompt_cache
    assert max_difference(got, want) < 1e-3


def test_a_compressed_translator_translates_the_rows_before_a_window_alike():
    """The rows a recompute reads before a sliding window (kernel.History) come from
    the shared projection for a compressed translator: at full rank, with token maps
    folded in, they are the original translator's."""
    import time

    from mlx_kvlingo.switching.api import switch_aligned
    from mlx_kvlingo.switching.kernel import History
    from mlx_kvlingo.translator.align import identity_alignment

    m = tiny_model("gemma3_text")  # sliding windows of 8
    t = with_token_maps(m)
    feats = calibration_features(m, windows(8), t.source_layers, target=m)
    width = feats["k"].shape[1] + feats["tokens"].shape[1]
    small, _ = compress_translator(t, feats, width, width, fold_tokens=True)
    ids = windows(1, length=30, seed=7)[0]
    source_cache = prefill(m, mx.array([ids[:-1]]))

    def history(translator):
        return switch_aligned(m, m, translator, source_cache, identity_alignment(ids, 1),
                              mx.array([ids]), 0, time.perf_counter(),
                              history=History(since=5)).history

    want, got = history(t), history(small)
    assert sorted(got) == sorted(want) and want
    for i, (lo, k, v) in want.items():
        assert got[i][0] == lo == 0 and k.shape[2] == 29 - 8
        assert mx.abs(got[i][1] - k).max().item() < 1e-3
        assert mx.abs(got[i][2] - v).max().item() < 1e-3

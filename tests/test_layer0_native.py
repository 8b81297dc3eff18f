"""Layer 0 computed by the target itself: its K/V equal the target's own prefill
(every supported architecture, at offset 0 and later), the switch and stage 2 use
them when the translator says so, and the translator file records the choice."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from tiny import CONFIGS, tiny_model

from mlx_kvlingo.errors import TranslatorFileError, TranslatorMismatch, UnsupportedModel
from mlx_kvlingo.models.cache import cache_features, prefill, read_layer
from mlx_kvlingo.models.features import layer0_features, layer0_kv
from mlx_kvlingo.switching.api import translate_aligned, translate_cache, translate_span
from mlx_kvlingo.train.distill import LowRankMaps, kl_loss, make_batch, translated_cache
from mlx_kvlingo.translator.align import Alignment
from mlx_kvlingo.translator.maps import METADATA_KEY, Translator, load_translator

ARCHS = list(CONFIGS)


def _tokens(length, batch=2, seed=0):
    return mx.array(np.random.default_rng(seed).integers(0, 97, (batch, length)))


def _close(a, b, what):
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5, rtol=0, err_msg=what)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("offset", [0, 12])
def test_layer0_kv_equals_the_targets_own_prefill(arch, offset):
    """The layer-0 keys and values the model's own prefill caches, for tokens at
    positions offset.. (after an earlier prefill of `offset` tokens), to 1e-5."""
    model = tiny_model(arch, seed=3)
    tokens = _tokens(offset + 7)
    cache = prefill(model, tokens[:, :offset]) if offset else None
    cache = prefill(model, tokens[:, offset:], cache)
    keys, values, start = read_layer(cache[0])
    assert start + keys.shape[2] == offset + 7
    k0, v0 = layer0_kv(model, tokens[:, start:], start)
    assert k0.shape == keys.shape and k0.dtype == keys.dtype
    _close(k0, keys, f"{arch} keys")
    _close(v0, values, f"{arch} values")
    # The chunk alone, at its own positions (no earlier tokens needed: position-local).
    k1, _ = layer0_kv(model, tokens[:, offset:], offset)
    _close(k1, keys[..., -7:, :], f"{arch} keys of the chunk alone")
    if offset:  # the rope really is applied at the offset: position 0 differs
        assert float(mx.abs(layer0_kv(model, tokens[:, offset:], 0)[0] - k1).max()) > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_layer0_features_are_the_unrotated_cache(arch):
    model = tiny_model(arch, seed=4)
    tokens = _tokens(9)
    keys, values, _ = cache_features(model, prefill(model, tokens), [0])
    k, v = layer0_features(model, tokens)
    _close(k, keys[0], f"{arch} content keys")
    _close(v, values[0], f"{arch} values")


def test_unknown_architectures_are_refused_by_name():
    model = tiny_model("llama")
    model.model_type = "phi3"
    with pytest.raises(UnsupportedModel, match="phi3"):
        layer0_kv(model, _tokens(4))
    t = Translator.for_models(tiny_model("qwen2"), tiny_model("llama")).with_native_layer0(True)
    with pytest.raises(TranslatorMismatch, match="layer 0 natively"):
        t.check_models(tiny_model("qwen2"), model)


# ---------------------------------------------------------------------------
# The switch


@pytest.fixture(scope="module")
def pair():
    src, tgt = tiny_model("qwen3", seed=1), tiny_model("gemma3_text", seed=2)
    return src, tgt, Translator.for_models(src, tgt)


def _layer_diff(cache, native, layer, skip_last=0):
    """Largest difference between the K/V two caches hold for one layer (the
    positions the first holds, but its last ``skip_last``)."""
    k, v, s = read_layer(cache[layer])
    nk, nv, ns = read_layer(native[layer])
    n = k.shape[2]
    assert s + n == ns + nk.shape[2]  # same last position
    k, v, nk, nv = (x[..., -n : x.shape[2] - skip_last, :] for x in (k, v, nk, nv))
    return max(float(mx.abs(k - nk).max()), float(mx.abs(v - nv).max()))


@pytest.mark.parametrize("tail", [0, 5])
def test_switch_uses_native_layer0_only_when_the_translator_says_so(pair, tail):
    src, tgt, t = pair
    tokens = _tokens(30, batch=1, seed=5)
    source_cache = prefill(src, tokens[:, :-1])
    native = prefill(tgt, tokens[:, :-1])
    on = translate_cache(src, tgt, t.with_native_layer0(True), source_cache, tokens, native_tail=tail)
    off = translate_cache(src, tgt, t, source_cache, tokens, native_tail=tail)
    assert _layer_diff(on, native, 0) < 1e-5
    assert _layer_diff(off, native, 0) > 1e-2  # random maps: translated layer 0 is wrong
    # The other layers are the translator's (a native tail reads layer 0, so its
    # positions differ in every layer, as they should).
    for layer in range(1, len(on)):
        assert _layer_diff(on, off, layer, skip_last=tail) < 1e-6
    if tail:
        assert _layer_diff(on, off, 1) > 1e-4
    # Room was left for the first decoding step: the target reads on.
    logits = tgt(tokens[:, -1:], cache=on)
    assert logits.shape[1] == 1 and bool(mx.all(mx.isfinite(logits)).item())


def test_conversation_spans_use_native_layer0(pair):
    """translate_span's general path (extending a live cache)."""
    src, tgt, t = pair
    tokens = _tokens(26, batch=1, seed=6)
    source_cache = prefill(src, tokens[:, :-1])
    t0 = t.with_native_layer0(True)
    cache = translate_span(src, tgt, t0, source_cache, None, tokens, 9)
    cache = translate_span(src, tgt, t0, source_cache, cache, tokens, 25)
    assert _layer_diff(cache, prefill(tgt, tokens[:, :-1]), 0) < 1e-5


def test_cross_tokenizer_switch_reads_the_target_tokens(pair):
    """Layer 0 comes from the *target's* tokens, whatever the source read."""
    src, tgt, t = pair
    target_tokens = _tokens(20, batch=1, seed=7)[0].tolist()
    source_tokens = _tokens(15, batch=1, seed=8)[0].tolist()
    index = [-1] + [min(j * 3 // 4, 14) for j in range(1, 20)]
    a = Alignment(source_tokens, target_tokens, index)
    source_cache = prefill(src, mx.array(source_tokens)[None])
    cache = translate_aligned(src, tgt, t.with_native_layer0(True), source_cache, None, a, 19)
    native = prefill(tgt, mx.array(target_tokens[:19])[None])
    assert _layer_diff(cache, native, 0) < 1e-5


# ---------------------------------------------------------------------------
# Stage 2 and the file


def test_stage2_trains_around_native_layer0(pair):
    src, tgt, t = pair
    tgt.freeze()
    w = _tokens(26, seed=9)
    batch = make_batch(src, tgt, t, w[:, :20], w[:, 20:])
    native = prefill(tgt, w[:, :19])
    maps = t.with_native_layer0(True)
    assert _layer_diff(translated_cache(tgt, maps, batch), native, 0) < 1e-5
    assert _layer_diff(translated_cache(tgt, t, batch), native, 0) > 1e-2
    _, grads = nn.value_and_grad(maps, lambda m, b: kl_loss(m, tgt, b))(maps, batch)
    mx.eval(grads)
    assert float(mx.abs(grads["k_maps"][0]["weight"]).max()) == 0.0
    assert float(mx.abs(grads["v_maps"][0]["weight"]).max()) == 0.0
    assert float(mx.abs(grads["v_maps"][1]["weight"]).max()) > 0.0
    low_rank = LowRankMaps(maps, rank=2)  # (freezes the shared maps: undone below)
    try:
        assert _layer_diff(translated_cache(tgt, low_rank, batch), native, 0) < 1e-5
    finally:
        t.unfreeze()


def test_the_file_records_native_layer0(pair, tmp_path):
    _, _, t = pair
    on = t.with_native_layer0(True)
    assert on.k_maps is t.k_maps and not t.spec.native_layer0  # shared maps, own spec
    on.save(tmp_path / "on.safetensors")
    assert load_translator(tmp_path / "on.safetensors").spec.native_layer0 is True
    # A file written before the field existed loads with it off.
    arrays = mx.load(str(tmp_path / "on.safetensors"))
    spec = json.loads(on.spec.to_json())
    del spec["native_layer0"]
    mx.save_safetensors(str(tmp_path / "old.safetensors"), arrays, {METADATA_KEY: json.dumps(spec)})
    assert load_translator(tmp_path / "old.safetensors").spec.native_layer0 is False
    spec["native_layer0"] = "yes"
    mx.save_safetensors(str(tmp_path / "bad.safetensors"), arrays, {METADATA_KEY: json.dumps(spec)})
    with pytest.raises(TranslatorFileError, match="native_layer0"):
        load_translator(tmp_path / "bad.safetensors")


def test_eval_scores_both_settings_on_the_same_windows(pair):
    from mlx_kvlingo.measure.evaluate import cbr_difference, evaluate_translators
    from mlx_kvlingo.train.heldout import layer0_settings

    src, tgt, t = pair
    assert layer0_settings("file", t) == [False]
    assert layer0_settings("off,on", t) == [False, True]
    with pytest.raises(Exception, match="native-layer0"):
        layer0_settings("maybe", t)
    variants = [t.with_native_layer0(on) for on in layer0_settings("off,on", t)]
    windows = [_tokens(24, batch=2, seed=10)]
    off, on = evaluate_translators(src, tgt, variants, windows, context_len=18)
    assert (off.native_layer0, on.native_layer0) == (False, True)
    assert off.nll_native == on.nll_native and off.nll_none == on.nll_none  # same windows
    assert off.nll_translated != on.nll_translated
    d, (lo, hi) = cbr_difference(on, off)
    assert lo <= d <= hi


def test_eval_command_reports_both_settings(toy_pair_dirs, tmp_path):
    from test_cli import run_cli

    from mlx_kvlingo.models.load import load

    (src, stok), (tgt, ttok) = load(toy_pair_dirs[0]), load(toy_pair_dirs[1])
    path = tmp_path / "t.safetensors"
    Translator.for_models(src, tgt, stok, ttok).save(path)
    report = tmp_path / "report.json"
    proc = run_cli("eval", "--source", toy_pair_dirs[0], "--target", toy_pair_dirs[1],
                   "--translator", path, "--context-lengths", "24", "--continuation-len", "8",
                   "--windows", "2", "--native-layer0", "off,on", "--json", report)
    entries = json.loads(report.read_text())["translators"]
    # Progress as each length ends: its window count and every row's CBR.
    cbrs = ", ".join(f"{e['results']['24']['cbr']:.1%}" for e in entries)
    assert f"context 24: 2 windows scored; CBR {cbrs}" in proc.stdout
    assert [e["native_layer0"] for e in entries] == [False, True]
    off, on = (e["results"]["24"] for e in entries)
    assert off["nll_native"] == on["nll_native"] and off["nll_translated"] != on["nll_translated"]
    assert on["attention_cosine"][0] == pytest.approx(1.0, abs=1e-4)  # layer 0 is the target's own


def test_prompt_cache_conversion_needs_the_ids_for_native_layer0(pair):
    from mlx_kvlingo.errors import KvlingoError
    from mlx_kvlingo.switching.prompt_cache import convert_prompt_cache

    src, tgt, _ = pair
    t = Translator.for_models(src, tgt, native_prefix=0).with_native_layer0(True)
    tokens = _tokens(12, batch=1, seed=11)
    cache = prefill(src, tokens)
    with pytest.raises(KvlingoError, match="layer 0"):
        convert_prompt_cache(src, tgt, t, cache)
    out = convert_prompt_cache(src, tgt, t, cache, tokens=tokens[0].tolist())
    assert _layer_diff(out, prefill(tgt, tokens), 0) < 1e-5

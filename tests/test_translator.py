"""The translator: layer maps, model checks, and its file (round trip, damage, atomic save)."""

import functools
import json
import os
import random
import struct

import mlx.core as mx
import numpy as np
import pytest
from tiny import tiny_model

from mlx_kvlingo.errors import KvlingoError, TranslatorFileError, TranslatorMismatch
from mlx_kvlingo.models.cache import read_layer
from mlx_kvlingo.switching.api import translate_context
from mlx_kvlingo.translator.maps import (
    FORMAT_VERSION,
    METADATA_KEY,
    Translator,
    load_translator,
    nearest_layer_map,
)


@functools.lru_cache(maxsize=None)
def model(name, **overrides):
    return tiny_model(name, **overrides)


def tokens(n, seed, vocab=97):
    return mx.array(np.random.default_rng(seed).integers(0, vocab, size=n), dtype=mx.int32)


class FakeTokenizer:
    def __init__(self, vocab):
        self._vocab = dict(vocab)

    def get_vocab(self):
        return dict(self._vocab)


VOCAB_A = {f"tok{i}": i for i in range(97)}
VOCAB_B = dict(VOCAB_A, tok5=96, tok96=5)  # two tokens swapped


# ---------------------------------------------------------------------------
# nearest_layer_map


def test_nearest_layer_map_equal_depths():
    assert nearest_layer_map(4, 4) == [[0], [1], [2], [3]]
    assert nearest_layer_map(1, 1) == [[0]]


def test_nearest_layer_map_different_depths():
    # Target deeper than source: source layers repeat, ends pinned to ends.
    assert nearest_layer_map(4, 6) == [[0], [1], [1], [2], [2], [3]]
    # Source deeper than target: source layers are skipped.
    assert nearest_layer_map(6, 4) == [[0], [2], [3], [5]]
    assert nearest_layer_map(28, 36)[0] == [0] and nearest_layer_map(28, 36)[-1] == [27]
    for n_s, n_t in [(4, 6), (6, 4), (28, 36), (36, 28), (2, 9)]:
        centres = [layers[0] for layers in nearest_layer_map(n_s, n_t)]
        assert len(centres) == n_t
        assert centres == sorted(centres)  # depth order preserved
        assert centres[0] == 0 and centres[-1] == n_s - 1


def test_nearest_layer_map_several_sources_per_layer():
    assert nearest_layer_map(4, 4, per_layer=3) == [[0, 1, 2], [0, 1, 2], [1, 2, 3], [1, 2, 3]]
    assert nearest_layer_map(6, 3, per_layer=3) == [[0, 1, 2], [1, 2, 3], [3, 4, 5]]
    assert nearest_layer_map(3, 2, per_layer=3) == [[0, 1, 2], [0, 1, 2]]
    for layers in nearest_layer_map(10, 7, per_layer=3):
        assert layers == list(range(layers[0], layers[0] + 3))
        assert 0 <= layers[0] and layers[-1] <= 9


@pytest.mark.parametrize("per_layer", [0, -1, 5])
def test_nearest_layer_map_rejects_bad_per_layer(per_layer):
    with pytest.raises(ValueError, match="per_layer"):
        nearest_layer_map(4, 4, per_layer=per_layer)


def test_translator_shapes_follow_layer_map():
    src, tgt = model("qwen2"), model("gemma3_text")  # widths 32 and 32, 4 -> 6 layers
    t = Translator.for_models(src, tgt, sources_per_layer=2)
    assert len(t.k_maps) == len(t.v_maps) == 6
    for layers, km in zip(t.spec.layer_map, t.k_maps):
        assert len(layers) == 2
        assert km.weight.shape == (1 * 32, 2 * (2 * 16))
    assert t.source_layers == sorted({j for ls in t.spec.layer_map for j in ls})
    keys = [mx.ones((1, 5, 32)) for _ in range(4)]
    out_k, out_v = t(keys, keys)
    assert len(out_k) == 6 and out_k[0].shape == (1, 5, 32)


# ---------------------------------------------------------------------------
# Checking models


def test_check_models_accepts_the_right_models():
    src, tgt = model("qwen2"), model("qwen3")
    t = Translator.for_models(src, tgt, FakeTokenizer(VOCAB_A), FakeTokenizer(VOCAB_A))
    t.check_models(src, tgt)
    t.check_models(src, tgt, FakeTokenizer(VOCAB_A), FakeTokenizer(VOCAB_A))
    # Other weights and dtype: still the same geometry.
    other = tiny_model("qwen3", seed=3)
    other.set_dtype(mx.float16)
    t.check_models(src, other)


def _mismatch(t, *args):
    with pytest.raises(TranslatorMismatch) as e:
        t.check_models(*args)
    assert isinstance(e.value, KvlingoError)
    return str(e.value)


def test_check_models_names_differing_fields():
    qwen2, qwen3 = model("qwen2"), model("qwen3")
    t = Translator.for_models(qwen3, qwen3)

    msg = _mismatch(t, qwen3, qwen2)
    assert "target model_type" in msg
    assert "target layer 0 head_dim" in msg
    assert "source" not in msg.split("\n", 1)[1]  # the source fits

    msg = _mismatch(t, qwen2, qwen3)
    assert "source model_type" in msg and "source layer 0 head_dim" in msg

    msg = _mismatch(t, qwen3, model("qwen3", num_hidden_layers=2))
    assert "target layers: translator 4, model 2" in msg

    msg = _mismatch(t, qwen3, model("qwen3", num_key_value_heads=1))
    assert "target layer 0 n_kv_heads" in msg

    msg = _mismatch(t, qwen3, model("qwen3", rope_theta=1e4))
    assert "target layer 0 rope" in msg

    g = model("gemma3_text")
    tg = Translator.for_models(g, g)
    msg = _mismatch(tg, g, model("gemma3_text", sliding_window=16))
    assert "target layer 0 window" in msg and "target layer 2" not in msg


def test_check_models_reports_tokenizer_mismatch():
    m = model("qwen3")
    t = Translator.for_models(m, m, FakeTokenizer(VOCAB_A), FakeTokenizer(VOCAB_A))
    msg = _mismatch(t, m, m, FakeTokenizer(VOCAB_A), FakeTokenizer(VOCAB_B))
    assert "target tokenizer" in msg and "source tokenizer" not in msg
    msg = _mismatch(t, m, m, FakeTokenizer(VOCAB_B), FakeTokenizer(VOCAB_A))
    assert "source tokenizer" in msg
    # The same vocabulary listed in another order is the same tokenizer.
    shuffled = dict(reversed(list(VOCAB_A.items())))
    t.check_models(m, m, FakeTokenizer(shuffled), FakeTokenizer(VOCAB_A))


# ---------------------------------------------------------------------------
# Save / load round trip


def _trained_looking_translator():
    src, tgt = model("qwen2"), model("qwen3", num_hidden_layers=3)
    t = Translator.for_models(
        src, tgt, FakeTokenizer(VOCAB_A), FakeTokenizer(VOCAB_B),
        sources_per_layer=2, native_prefix=3,
    )
    t.spec.training = {"method": "test", "steps": 7, "lr": 1e-3, "note": "ü ✓"}
    mx.random.seed(4)
    for maps in (t.k_maps, t.v_maps):
        for lin in maps:
            lin.weight = 0.2 * mx.random.normal(lin.weight.shape)
    mx.eval(t.parameters())
    return src, tgt, t


def _params(t):
    from mlx.utils import tree_flatten

    return {k: np.array(v) for k, v in tree_flatten(t.parameters())}


def test_save_load_round_trip(tmp_path):
    src, tgt, t = _trained_looking_translator()
    path = tmp_path / "t.safetensors"
    t.save(path)
    loaded = load_translator(path)

    a, b = _params(t), _params(loaded)
    assert set(a) == set(b) and len(a) == 6
    for k in a:
        assert b[k].dtype == np.float32
        assert np.array_equal(a[k], b[k]), k

    assert loaded.spec.to_json() == t.spec.to_json()
    assert loaded.spec.layer_map == t.spec.layer_map
    assert loaded.spec.native_prefix == 3
    assert loaded.spec.training == t.spec.training
    assert loaded.spec.format_version == 1  # no token maps: readable by older versions
    assert "token_layers" not in loaded.spec.to_json()
    assert loaded.spec.source.tokenizer == t.spec.source.tokenizer is not None
    assert loaded.spec.target.cache_geometry == t.spec.target.cache_geometry
    assert loaded.spec.source.fingerprint == t.spec.source.fingerprint
    loaded.check_models(src, tgt, FakeTokenizer(VOCAB_A), FakeTokenizer(VOCAB_B))

    # Translating with the loaded translator gives identical caches.
    ctx = tokens(12, seed=1)
    c1 = translate_context(src, tgt, t, ctx)
    c2 = translate_context(src, tgt, loaded, ctx)
    for x, y in zip(c1, c2):
        k1, v1, s1 = read_layer(x)
        k2, v2, s2 = read_layer(y)
        assert s1 == s2 and x.offset == y.offset == 11
        assert np.array_equal(np.array(k1), np.array(k2))
        assert np.array_equal(np.array(v1), np.array(v2))


def test_save_load_round_trip_spec_objects_equal(tmp_path):
    """The loaded spec equals the saved one as an object, not only as JSON."""
    _, _, t = _trained_looking_translator()
    t.save(tmp_path / "t.safetensors")
    loaded = load_translator(tmp_path / "t.safetensors")
    assert loaded.spec.source == t.spec.source
    assert loaded.spec.target == t.spec.target
    assert loaded.spec == t.spec


def test_save_casts_to_float32(tmp_path):
    m = model("qwen2")
    t = Translator.for_models(m, m)
    t.set_dtype(mx.float16)
    t.save(tmp_path / "h.safetensors")
    loaded = load_translator(tmp_path / "h.safetensors")
    assert all(v.dtype == np.float32 for v in _params(loaded).values())
    for k, v in _params(t).items():
        assert np.array_equal(v.astype(np.float32), _params(loaded)[k])


# ---------------------------------------------------------------------------
# Atomic save


def test_save_is_atomic_and_replaces(tmp_path):
    m = model("qwen2")
    t1 = Translator.for_models(m, m)
    t2 = Translator.for_models(m, m, native_prefix=2)
    path = tmp_path / "t.safetensors"
    path.write_bytes(b"an old, unrelated file")
    t1.save(path)
    assert os.listdir(tmp_path) == ["t.safetensors"]
    assert load_translator(path).spec.native_prefix == 1
    t2.save(path)
    assert os.listdir(tmp_path) == ["t.safetensors"]
    assert load_translator(path).spec.native_prefix == 2
    a, b = _params(t2), _params(load_translator(path))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    other = tmp_path / "second.safetensors"
    t1.save(str(other))  # a str path works too
    assert sorted(os.listdir(tmp_path)) == ["second.safetensors", "t.safetensors"]
    assert load_translator(str(other)).spec.native_prefix == 1


@pytest.mark.parametrize("name", ["translator.bin", "translator"])
def test_save_and_load_without_safetensors_suffix(tmp_path, name):
    """save accepts any file name; load must read back what save wrote."""
    m = model("qwen2")
    t = Translator.for_models(m, m, native_prefix=2)
    path = tmp_path / name
    t.save(path)
    assert os.listdir(tmp_path) == [name]
    loaded = load_translator(path)
    assert loaded.spec.native_prefix == 2
    a, b = _params(t), _params(loaded)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_failed_save_keeps_the_old_file(tmp_path, monkeypatch):
    m = model("qwen2")
    t = Translator.for_models(m, m)
    path = tmp_path / "t.safetensors"
    t.save(path)
    before = path.read_bytes()

    real_save = mx.save_safetensors

    def failing_save(file, arrays, metadata=None):
        real_save(file, arrays, metadata)
        with open(file, "r+b") as f:  # half-written, then the disk fills up
            f.truncate(100)
        raise OSError("No space left on device")

    monkeypatch.setattr(mx, "save_safetensors", failing_save)
    with pytest.raises(OSError):
        Translator.for_models(m, m, native_prefix=5).save(path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["t.safetensors"]
    assert path.read_bytes() == before


# ---------------------------------------------------------------------------
# Damaged files


@functools.lru_cache(maxsize=None)
def _good_file_bytes():
    import tempfile

    m = model("qwen2", num_hidden_layers=2)
    t = Translator.for_models(m, m)
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "good.safetensors")
        t.save(p)
        with open(p, "rb") as f:
            return f.read()


def _split(data):
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _join(header, body):
    hb = json.dumps(header).encode()
    return struct.pack("<Q", len(hb)) + hb + body


def _good_spec():
    header, _ = _split(_good_file_bytes())
    return json.loads(header["__metadata__"][METADATA_KEY])


def _with_metadata_text(text):
    header, body = _split(_good_file_bytes())
    header["__metadata__"] = {METADATA_KEY: text}
    return _join(header, body)


def _load_error(path):
    """Load a damaged file: it must fail with TranslatorFileError (and nothing else)
    whose message names the file."""
    with pytest.raises(TranslatorFileError) as e:
        load_translator(path)
    msg = str(e.value)
    assert str(path) in msg
    return msg


def test_good_file_loads(tmp_path):
    p = tmp_path / "ok.safetensors"
    p.write_bytes(_good_file_bytes())
    assert len(load_translator(p).k_maps) == 2


def test_missing_file(tmp_path):
    msg = _load_error(tmp_path / "nope.safetensors")
    assert "not found" in msg
    msg = _load_error(tmp_path)  # a directory is not a translator file
    assert "not found" in msg


def test_empty_file(tmp_path):
    p = tmp_path / "empty.safetensors"
    p.write_bytes(b"")
    assert "truncated" in _load_error(p)


def test_truncated_file(tmp_path):
    data = _good_file_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    cuts = {1, 4, 7, 8, 9, 20, 8 + n // 2, 8 + n - 1, 8 + n, 8 + n + 1, 8 + n + 100,
            (8 + n + len(data)) // 2, len(data) - 4, len(data) - 1}
    p = tmp_path / "cut.safetensors"
    for cut in sorted(cuts):
        p.write_bytes(data[:cut])
        msg = _load_error(p)
        assert any(w in msg for w in ("truncated", "header")), (cut, msg)


@pytest.mark.parametrize("seed", range(6))
def test_random_bytes(tmp_path, seed):
    rng = random.Random(seed)
    p = tmp_path / "rnd.safetensors"
    p.write_bytes(bytes(rng.getrandbits(8) for _ in range(3000)))
    _load_error(p)
    # With a plausible header length in front of the noise.
    p.write_bytes(struct.pack("<Q", 200) + bytes(rng.getrandbits(8) for _ in range(3000)))
    _load_error(p)


@pytest.mark.parametrize("header", [b"null", b"[1, 2]", b'"text"', b"{}", b'{"a": 1}'])
def test_odd_headers(tmp_path, header):
    p = tmp_path / "odd.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    _load_error(p)


def test_plain_safetensors_without_metadata(tmp_path):
    """A valid safetensors file of someone else's tensors is named as such."""
    p = tmp_path / "plain.safetensors"
    # No __metadata__ entry at all (as other writers produce).
    header = {"k_maps.0.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}
    p.write_bytes(_join(header, b"\0" * 64))
    assert "not an mlx-kvlingo translator" in _load_error(p)
    # Other metadata, not ours.
    mx.save_safetensors(str(p), {"w": mx.zeros((4, 4))}, {"format": "mlx", "model": "x"})
    assert "not an mlx-kvlingo translator" in _load_error(p)


def test_plain_mlx_safetensors_without_metadata(tmp_path):
    """mx.save_safetensors without metadata writes "__metadata__": null; that file is
    a valid safetensors file, not a damaged one."""
    p = tmp_path / "plain.safetensors"
    mx.save_safetensors(str(p), {"k_maps.0.weight": mx.zeros((4, 4))})
    msg = _load_error(p)
    assert "not an mlx-kvlingo translator" in msg, msg


def _altered_specs():
    s = _good_spec()
    src = s["source"]
    layers = src["geometry"]["layers"]

    def geometry(**kw):
        return dict(s, source=dict(src, geometry=dict(src["geometry"], **kw)))

    def layer_fields(**kw):
        return geometry(layers=[dict(layer, **kw) for layer in layers])

    without_target = {k: v for k, v in s.items() if k != "target"}
    return {
        "not_json": "{not json",
        "json_list": "[]",
        "json_number": "5",
        "json_null": "null",
        "missing_target": json.dumps(without_target),
        "unknown_field": json.dumps(dict(s, surprise=1)),
        "identity_missing_field": json.dumps(
            dict(s, target={k: v for k, v in s["target"].items() if k != "geometry"})),
        "layer_map_too_short": json.dumps(dict(s, layer_map=[[0]])),
        "layer_map_null": json.dumps(dict(s, layer_map=None)),
        "layer_map_index_too_big": json.dumps(dict(s, layer_map=[[0], [2]])),
        "layer_map_index_negative": json.dumps(dict(s, layer_map=[[0], [-1]])),
        "layer_map_index_string": json.dumps(dict(s, layer_map=[[0], ["1"]])),
        "layer_map_empty_entry": json.dumps(dict(s, layer_map=[[0], []])),
        "geometry_null": json.dumps(dict(s, source=dict(src, geometry=None))),
        "geometry_layers_int": json.dumps(geometry(layers=3)),
        "geometry_layers_empty": json.dumps(geometry(layers=[])),
        "geometry_layer_null": json.dumps(geometry(layers=[None, None])),
        "n_kv_heads_string": json.dumps(layer_fields(n_kv_heads="2")),
        "n_kv_heads_float": json.dumps(layer_fields(n_kv_heads=2.5)),
        "n_kv_heads_zero": json.dumps(layer_fields(n_kv_heads=0)),
        "head_dim_negative": json.dumps(layer_fields(head_dim=-16)),
        "format_version_string": json.dumps(dict(s, format_version="2")),
        "format_version_null": json.dumps(dict(s, format_version=None)),
        "native_prefix_string": json.dumps(dict(s, native_prefix="1")),
        "native_prefix_negative": json.dumps(dict(s, native_prefix=-3)),
        "recompute_above_one": json.dumps(dict(s, recompute=1.5, recompute_max=0)),
        "recompute_string": json.dumps(dict(s, recompute="0.1", recompute_max=0)),
        "recompute_max_negative": json.dumps(dict(s, recompute=0.1, recompute_max=-1)),
        "recompute_max_float": json.dumps(dict(s, recompute=0.1, recompute_max=1.5)),
    }


ALTERED = _altered_specs()


@pytest.mark.parametrize("case", list(ALTERED))
def test_altered_metadata(tmp_path, case):
    p = tmp_path / f"{case}.safetensors"
    p.write_bytes(_with_metadata_text(ALTERED[case]))
    msg = _load_error(p)
    assert "metadata" in msg or "tensor" in msg or "format version" in msg


def test_metadata_not_a_string(tmp_path):
    header, body = _split(_good_file_bytes())
    header["__metadata__"]["other"] = 5
    p = tmp_path / "meta.safetensors"
    p.write_bytes(_join(header, body))
    assert "metadata" in _load_error(p)


def test_future_format_version(tmp_path):
    p = tmp_path / "future.safetensors"
    p.write_bytes(_with_metadata_text(json.dumps(dict(_good_spec(), format_version=FORMAT_VERSION + 1))))
    msg = _load_error(p)
    assert f"format version {FORMAT_VERSION + 1}" in msg and "Upgrade" in msg


def _save_with_arrays(path, mutate):
    """A file written by safetensors itself, good metadata, arrays changed by ``mutate``."""
    header, _ = _split(_good_file_bytes())
    good = mx.load(_write_tmp(path, _good_file_bytes()))
    arrays = dict(good)
    mutate(arrays)
    mx.save_safetensors(str(path), arrays, header["__metadata__"])


def _write_tmp(path, data):
    tmp = path.with_name(path.name + ".src.safetensors")
    tmp.write_bytes(data)
    return str(tmp)


def test_tensor_with_wrong_shape(tmp_path):
    p = tmp_path / "shape.safetensors"

    def mutate(a):
        w = a["k_maps.1.weight"]
        a["k_maps.1.weight"] = mx.zeros((w.shape[0], w.shape[1] + 1))

    _save_with_arrays(p, mutate)
    msg = _load_error(p)
    assert "k_maps.1.weight" in msg and "expected" in msg


def test_tensor_transposed(tmp_path):
    p = tmp_path / "t.safetensors"
    m = model("qwen2")
    t = Translator.for_models(m, model("qwen3"))  # maps are 48 x 32: not square
    t.save(p)
    header, _ = _split(p.read_bytes())
    arrays = dict(mx.load(str(p)))
    arrays["v_maps.0.weight"] = arrays["v_maps.0.weight"].T
    mx.save_safetensors(str(p), arrays, header["__metadata__"])
    assert "v_maps.0.weight" in _load_error(p)


def test_tensor_with_wrong_dtype(tmp_path):
    p = tmp_path / "f16.safetensors"

    def mutate(a):
        a["v_maps.0.weight"] = a["v_maps.0.weight"].astype(mx.float16)

    _save_with_arrays(p, mutate)
    msg = _load_error(p)
    assert "v_maps.0.weight" in msg and "F16" in msg


def test_missing_and_extra_tensors(tmp_path):
    p = tmp_path / "missing.safetensors"
    _save_with_arrays(p, lambda a: a.pop("k_maps.0.weight"))
    assert "k_maps.0.weight" in _load_error(p)
    p = tmp_path / "extra.safetensors"
    _save_with_arrays(p, lambda a: a.__setitem__("k_maps.9.weight", mx.zeros((2, 2))))
    assert "k_maps.9.weight" in _load_error(p)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values(tmp_path, bad):
    p = tmp_path / "nan.safetensors"

    def mutate(a):
        w = np.array(a["v_maps.1.weight"])
        w[3, 5] = bad
        a["v_maps.1.weight"] = mx.array(w)

    _save_with_arrays(p, mutate)
    msg = _load_error(p)
    assert "v_maps.1.weight" in msg and "NaN" in msg


def test_header_offsets_outside_the_file(tmp_path):
    header, body = _split(_good_file_bytes())
    name = "k_maps.0.weight"
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + len(body), end + len(body)]
    p = tmp_path / "offsets.safetensors"
    p.write_bytes(_join(header, body))
    assert name in _load_error(p)


def test_header_byte_flips_raise_only_translator_file_errors(tmp_path):
    """Single-character edits anywhere in the header: the file either still loads or
    fails with TranslatorFileError."""
    data = _good_file_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    rng = random.Random(0)
    p = tmp_path / "flip.safetensors"
    failures = 0
    for _ in range(150):
        pos = rng.randrange(0, 8 + n)
        b = bytearray(data)
        b[pos] = rng.choice(b'0123456789"{}[],:-. abcdefxyzFNnul') if pos >= 8 else rng.getrandbits(8)
        p.write_bytes(bytes(b))
        try:
            load_translator(p)
        except TranslatorFileError:
            failures += 1
    assert failures > 50


def test_float16_translator_files_load_as_float32(tmp_path):
    """Shipped translators are float16 (half the size); they load back as float32 maps
    equal to the float16-rounded originals."""
    src, tgt = tiny_model("qwen2", seed=1), tiny_model("llama", seed=2)
    t = Translator.for_models(src, tgt)
    p = tmp_path / "half.safetensors"
    t.save(p, dtype=mx.float16)
    assert p.stat().st_size < 0.6 * _size_f32(t, tmp_path)
    loaded = load_translator(p)
    for a, b in zip(t.k_maps + t.v_maps, loaded.k_maps + loaded.v_maps):
        assert b.weight.dtype == mx.float32
        assert mx.array_equal(a.weight.astype(mx.float16).astype(mx.float32), b.weight)


def _size_f32(t, tmp_path):
    p = tmp_path / "full.safetensors"
    t.save(p)
    return p.stat().st_size


def test_quantized_translator_files_load_back_dequantized(tmp_path):
    """``save(bits=8)`` packs every map whose input width is a multiple of 64
    group-wise; the file is about a quarter of float32's and loads back as float32
    maps equal to MLX's own dequantization, close to the originals."""
    src, tgt = tiny_model("qwen2", seed=1), tiny_model("llama", seed=2)
    t = Translator.for_models(src, tgt, sources_per_layer=2)  # 2 x 32 = 64 inputs
    p = tmp_path / "q8.safetensors"
    t.save(p, dtype=mx.float16, bits=8)
    assert p.stat().st_size < 0.35 * _size_f32(t, tmp_path)
    loaded = load_translator(p)
    for a, b in zip(t.k_maps + t.v_maps, loaded.k_maps + loaded.v_maps):
        wq, s, z = mx.quantize(a.weight, group_size=64, bits=8)
        want = mx.dequantize(wq, s.astype(mx.float16).astype(mx.float32),
                             z.astype(mx.float16).astype(mx.float32), group_size=64, bits=8)
        assert b.weight.dtype == mx.float32
        assert mx.allclose(b.weight, want, atol=1e-6).item()
        err = mx.abs(b.weight - a.weight).max().item()
        assert 0 < err < 0.01 * mx.abs(a.weight).max().item()


def test_quantized_save_keeps_narrow_maps_in_float(tmp_path):
    """Maps whose input width 64 does not divide stay float in a quantized file."""
    src, tgt = tiny_model("qwen2", seed=1), tiny_model("llama", seed=2)
    t = Translator.for_models(src, tgt)  # 32 inputs per map
    p = tmp_path / "q4.safetensors"
    t.save(p, bits=4)
    loaded = load_translator(p)
    for a, b in zip(t.k_maps + t.v_maps, loaded.k_maps + loaded.v_maps):
        assert mx.array_equal(a.weight, b.weight)
    with pytest.raises(ValueError, match="8 or 4 bits"):
        t.save(p, bits=3)


def test_quantized_files_with_bad_metadata_or_tensors_are_refused(tmp_path):
    src, tgt = tiny_model("qwen2", seed=1), tiny_model("llama", seed=2)
    t = Translator.for_models(src, tgt, sources_per_layer=2)
    p = tmp_path / "q8.safetensors"
    t.save(p, dtype=mx.float16, bits=8)
    arrays, meta = mx.load(str(p), return_metadata=True)

    bad = tmp_path / "bad.safetensors"
    mx.save_safetensors(str(bad), arrays, dict(meta, **{"mlx_kvlingo.quantization":
                                                        '{"bits": 3, "group_size": 64}'}))
    with pytest.raises(TranslatorFileError, match="unsupported quantization"):
        load_translator(bad)
    no_meta = {k: v for k, v in meta.items() if k != "mlx_kvlingo.quantization"}
    mx.save_safetensors(str(bad), arrays, no_meta)  # packed tensors read as plain maps
    with pytest.raises(TranslatorFileError, match="do not match"):
        load_translator(bad)
    wrong = dict(arrays, **{"k_maps.0.weight": arrays["k_maps.0.weight"].astype(mx.float32)})
    mx.save_safetensors(str(bad), wrong, meta)
    with pytest.raises(TranslatorFileError, match="expected U32"):
        load_translator(bad)

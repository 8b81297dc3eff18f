"""Readers of untrusted files never crash or hang: they raise the package's own error."""

import json
import struct
from pathlib import Path

import mlx.core as mx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import tiny_model

from mlx_kvlingo.errors import TranslatorFileError
from mlx_kvlingo.translator.maps import Translator, load_translator

ROOT = Path(__file__).resolve().parents[1]
FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def _load_bytes(tmp_path, data: bytes):
    p = tmp_path / "fuzz.safetensors"
    p.write_bytes(data)
    try:
        load_translator(p)
    except TranslatorFileError:
        pass  # the only acceptable failure


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes(tmp_path, data):
    _load_bytes(tmp_path, data)


def _valid_file(tmp_path_factory=None):
    m = tiny_model("qwen2")
    t = Translator.for_models(m, m)
    p = Path("/tmp") / "kvlingo-fuzz-valid.safetensors"
    t.save(p)
    return p.read_bytes()


VALID = _valid_file()


@FUZZ
@given(st.integers(0, len(VALID) - 1), st.binary(min_size=1, max_size=8))
def test_corrupted_valid_file(tmp_path, at, patch):
    data = VALID[:at] + patch + VALID[at + len(patch):]
    _load_bytes(tmp_path, data)


@FUZZ
@given(
    st.dictionaries(
        st.text(max_size=12),
        st.one_of(
            st.none(), st.integers(), st.text(max_size=20),
            st.fixed_dictionaries({
                "dtype": st.sampled_from(["F32", "F16", "I64", "X"]),
                "shape": st.lists(st.integers(-2, 2**40), max_size=3),
                "data_offsets": st.lists(st.integers(-5, 2**40), max_size=3),
            }),
        ),
        max_size=4,
    ),
    st.binary(max_size=64),
)
def test_valid_looking_headers(tmp_path, header, body):
    raw = json.dumps(header).encode()
    _load_bytes(tmp_path, struct.pack("<Q", len(raw)) + raw + body)


@FUZZ
@given(st.text(max_size=200))
def test_arbitrary_translator_metadata(tmp_path, meta):
    p = tmp_path / "meta.safetensors"
    mx.save_safetensors(str(p), {"k_maps.0.weight": mx.zeros((2, 2))}, {"mlx_kvlingo": meta})
    try:
        load_translator(p)
    except TranslatorFileError:
        pass


def test_no_pickle_and_no_remote_code_anywhere():
    """Weights and translators are safetensors only; the package never unpickles or
    runs code from a model repo."""
    sources = list((ROOT / "mlx_kvlingo").rglob("*.py")) + list((ROOT / "cli").rglob("*.py"))
    for path in sources:
        text = path.read_text()
        assert "import pickle" not in text and "pickle.load" not in text, path
        assert "torch.load" not in text and "np.load(" not in text, path
        assert "trust_remote_code=True" not in text, path


def _valid_prompt_cache():
    from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

    m = tiny_model("gemma3_text")
    cache = make_prompt_cache(m)
    m(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
    p = Path("/tmp") / "kvlingo-fuzz-cache.safetensors"
    save_prompt_cache(str(p), cache, {"model": "tiny"})
    return p.read_bytes()


VALID_CACHE = _valid_prompt_cache()


@FUZZ
@given(st.one_of(
    st.binary(max_size=512),
    st.tuples(st.integers(0, len(VALID_CACHE) - 1), st.binary(min_size=1, max_size=8)).map(
        lambda t: VALID_CACHE[: t[0]] + t[1] + VALID_CACHE[t[0] + len(t[1]):]),
))
def test_prompt_cache_reader(tmp_path, data):
    from mlx_kvlingo.switching.prompt_cache import PromptCacheError, read_prompt_cache

    p = tmp_path / "cache.safetensors"
    p.write_bytes(data)
    try:
        read_prompt_cache(p)
    except PromptCacheError:
        pass

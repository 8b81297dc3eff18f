import os
import sys

# Tests never reach the hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, os.path.dirname(__file__))  # for `tiny`

import mlx_kvlingo  # noqa: E402,F401  (first: fast BLAS before mlx.core)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def toy_pair_dirs():
    """(source_dir, target_dir) of the built-in demo pair shipped with the package."""
    from mlx_kvlingo.pairs import toy

    return toy.ensure_toy_pair(log=None)


@pytest.fixture(scope="session")
def docstring_pair():
    """The first release's built-in pair (benchmarks/assets/docstring-pair: plain
    docstrings, independent embeddings), loaded in float32. Its target barely uses
    its context, but a stage-1 fit on plain docstrings already carries most of
    what it does use; the shipped pair needs stage 2 for that."""
    from pathlib import Path

    from mlx_kvlingo.models.load import load

    root = Path(__file__).resolve().parent.parent / "benchmarks" / "assets" / "docstring-pair"
    src, stok = load(root / "source")
    tgt, ttok = load(root / "target")
    return src, stok, tgt, ttok


@pytest.fixture(scope="session")
def toy_pair(toy_pair_dirs):
    """(source, source_tokenizer, target, target_tokenizer), loaded in float32."""
    from mlx_kvlingo.models.load import load

    src, stok = load(toy_pair_dirs[0])
    tgt, ttok = load(toy_pair_dirs[1])
    return src, stok, tgt, ttok


@pytest.fixture(scope="session")
def kv_cache_dir(tmp_path_factory):
    """A cache dir holding the built-in pair's stage-1 translators, fitted once per
    test run and shared by the session, CLI and example tests."""
    from mlx_kvlingo.pairs.builtin import builtin_session

    path = tmp_path_factory.getbasetemp() / "kvlingo-cache"
    builtin_session(cache_dir=path)
    return path

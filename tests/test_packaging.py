"""The wheel's package list names every package of the library."""

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_packaged():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "mlx_kvlingo").rglob("__init__.py")}
    assert found - listed == set(), "packages missing from pyproject.toml"
    assert "mlx_kvlingo_cli" in listed

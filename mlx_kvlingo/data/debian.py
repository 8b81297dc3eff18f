"""Text from Debian's package registry, offline from everything else.

A Debian or Ubuntu machine can fetch any package's .deb from its registry with
``apt-get download`` (nothing is installed, no root needed). A .deb is an ar
archive whose ``data.tar.*`` holds the package's files; they are read straight
out of it. Downloaded .debs are kept in the cache directory's ``corpora/``.
"""

import io
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Callable, Dict, Optional

from ..errors import KvlingoError
from ..files import default_cache_dir


def package_deb(package: str, corpus: str, cache_dir: Optional[Path] = None) -> bytes:
    """The bytes of ``package``'s .deb: the cached copy, else ``apt-get download``.
    ``corpus``: the corpus name, for the error message."""
    folder = Path(cache_dir if cache_dir is not None else default_cache_dir()) / "corpora"
    debs = sorted(folder.glob(f"{package}_*.deb"))
    if not debs:
        debs = [_download(package, corpus, folder)]
    return debs[-1].read_bytes()


def _download(package: str, corpus: str, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        try:
            subprocess.run(["apt-get", "download", package], cwd=tmp, check=True,
                           capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            raise KvlingoError(
                f"The {corpus!r} corpus comes from Debian's {package} package, fetched with "
                f"`apt-get download {package}`; that failed here ({detail.strip()}). "
                f"Put the .deb in {folder} by hand, or use another corpus."
            ) from e
        deb = next(Path(tmp).glob(f"{package}_*.deb"))
        final = folder / deb.name
        os.replace(deb, final)
    return final


def deb_files(deb: bytes, wanted: Callable[[str], bool], package: str = "the") -> Dict[str, bytes]:
    """The regular files of a .deb's data archive whose names ``wanted`` accepts."""
    if not deb.startswith(b"!<arch>\n"):
        raise KvlingoError(f"The {package} .deb is not an ar archive.")
    pos = 8
    while pos + 60 <= len(deb):
        name = deb[pos: pos + 16].decode().strip().rstrip("/")
        size = int(deb[pos + 48: pos + 58].decode().strip())
        body = deb[pos + 60: pos + 60 + size]
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body)) as tar:
                return {m.name: tar.extractfile(m).read() for m in tar.getmembers()
                        if m.isfile() and wanted(m.name)}
        pos += 60 + size + (size % 2)
    raise KvlingoError(f"The {package} .deb has no data archive.")

"""Short quotations, verse, jokes and dialogue, offline: the fortune cookie files.

Text unlike the training mixes (docstrings, Austen's chapters): short pieces of
many voices, verse and dialogue. Debian ships them in ``fortunes`` and
``fortunes-min`` (data.debian), one file per theme ("literature", "songs-poems",
"people", ...), pieces separated by lines holding "%". The offensive collection
(a separate package) is not read.

One document per theme, its pieces joined by blank lines, named
``fortunes/<theme>``.
"""

from pathlib import Path
from typing import List, Optional, Tuple

from .debian import deb_files, package_deb

PACKAGES = ("fortunes-min", "fortunes")
FOLDER = "./usr/share/games/fortunes/"


def fortune_documents(cache_dir: Optional[Path] = None) -> List[Tuple[str, str]]:
    """One document per theme, pieces joined by blank lines (sorted by theme)."""
    themes = {}
    for package in PACKAGES:
        files = deb_files(package_deb(package, "fortunes", cache_dir), _is_theme, package)
        for name, data in files.items():
            themes[name[len(FOLDER):]] = data.decode("utf-8", errors="replace")
    return [(f"fortunes/{theme}", _joined(text)) for theme, text in sorted(themes.items())
            if _joined(text)]


def _is_theme(name: str) -> bool:
    """A theme's text file (not its .dat index, a .u8 link or a folder's file)."""
    if not name.startswith(FOLDER):
        return False
    rest = name[len(FOLDER):]
    return bool(rest) and "/" not in rest and "." not in rest


def _joined(text: str) -> str:
    """The pieces (between lines holding only "%"), joined by blank lines."""
    pieces, piece = [], []
    for line in text.splitlines() + ["%"]:
        if line.strip() == "%":
            body = "\n".join(piece).strip("\n")
            if body.strip():
                pieces.append(body)
            piece = []
        else:
            piece.append(line)
    return "\n\n".join(pieces)

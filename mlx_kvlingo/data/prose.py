"""Ordinary English prose, offline: Jane Austen's six novels.

Translators trained on docstrings alone do not carry over to other text, and a
fidelity claim needs held-out text from another domain. Debian ships the six
novels (Project Gutenberg texts, public domain) in ``r-cran-janeaustenr``, a
1.6 MB package that any Debian or Ubuntu machine can fetch from its package
registry without installing R: ``apt-get download`` fetches the .deb, and the
novels are read straight out of it.

The text sits in R's lazy-load database (``data/Rdata.rdb``): a sequence of
records, each a 4-byte length and a zlib stream holding one R object serialized
in XDR form — here one character vector per novel, one element per printed line.
Only that shape is parsed (a version-2/3 header, then a STRSXP of CHARSXPs);
anything else is refused. Nothing is executed or unpickled.

Documents are chapters, their hard-wrapped lines joined into paragraphs, named
``austen/<novel>/<chapter>``.
"""

import re
import struct
import zlib
from pathlib import Path
from typing import List, Optional, Tuple

from ..errors import KvlingoError
from .debian import deb_files, package_deb

PACKAGE = "r-cran-janeaustenr"
NOVELS = ("emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice",
          "sensesensibility")  # the order of the objects in Rdata.rdb
_INSTALLED = Path("/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb")
_RDB_MEMBER = "./usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
_CHAPTER = re.compile(r"^(CHAPTER|Chapter)\s+[0-9IVXLC]+\.?\s*$")


def austen_documents(cache_dir: Optional[Path] = None) -> List[Tuple[str, str]]:
    """One document per chapter of the six novels."""
    docs = []
    for novel, lines in zip(NOVELS, _read_novels(_rdb_bytes(cache_dir))):
        for n, text in enumerate(_chapters(lines)):
            docs.append((f"austen/{novel}/{n}", text))
    return docs


def _rdb_bytes(cache_dir: Optional[Path]) -> bytes:
    """Rdata.rdb from an installed copy, else the package's .deb (data.debian)."""
    if _INSTALLED.is_file():
        return _INSTALLED.read_bytes()
    files = deb_files(package_deb(PACKAGE, "austen", cache_dir), lambda n: n == _RDB_MEMBER,
                      PACKAGE)
    if _RDB_MEMBER not in files:
        raise KvlingoError(f"The {PACKAGE} .deb has no {_RDB_MEMBER}.")
    return files[_RDB_MEMBER]


def _read_novels(rdb: bytes) -> List[List[str]]:
    """The character vectors stored in the lazy-load database, in order."""
    novels, pos = [], 0
    while pos < len(rdb):
        stream = zlib.decompressobj()
        try:
            obj = stream.decompress(rdb[pos + 4 :])
        except zlib.error as e:
            raise KvlingoError(f"Damaged R database ({e}).") from e
        novels.append(_character_vector(obj))
        pos = len(rdb) - len(stream.unused_data)
    if len(novels) != len(NOVELS):
        raise KvlingoError(f"Expected {len(NOVELS)} novels in the R database, found {len(novels)}.")
    return novels


def _character_vector(data: bytes) -> List[Optional[str]]:
    """Parse one XDR-serialized R character vector (and nothing else)."""
    if data[:2] != b"X\n":
        raise KvlingoError("Not an XDR-serialized R object.")
    (version,) = struct.unpack(">i", data[2:6])
    pos = 14
    if version == 3:  # native encoding name follows the header
        (n,) = struct.unpack(">i", data[14:18])
        pos = 18 + n
    elif version != 2:
        raise KvlingoError(f"Unsupported R serialization version {version}.")
    flags, length = struct.unpack(">ii", data[pos : pos + 8])
    if flags & 0xFF != 16:  # STRSXP
        raise KvlingoError("The R object is not a character vector.")
    pos += 8
    out = []
    for _ in range(length):
        flags, n = struct.unpack(">ii", data[pos : pos + 8])
        pos += 8
        if flags & 0xFF != 9:  # CHARSXP
            raise KvlingoError("Malformed character vector.")
        if n == -1:
            out.append(None)  # NA
            continue
        out.append(data[pos : pos + n].decode("utf-8", "replace"))
        pos += n
    return out


def _chapters(lines: List[Optional[str]]) -> List[str]:
    """Chapters as paragraphs of joined lines (the front matter is dropped)."""
    chapters: List[List[str]] = []
    para: List[str] = []

    def flush():
        if para and chapters:
            chapters[-1].append(" ".join(para))
        para.clear()

    for line in lines:
        line = (line or "").strip()
        if _CHAPTER.match(line):
            flush()
            chapters.append([])
        elif line:
            para.append(line)
        else:
            flush()
    flush()
    return ["\n\n".join(c) for c in chapters if sum(map(len, c)) > 500]

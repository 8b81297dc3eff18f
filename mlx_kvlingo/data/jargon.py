"""Informal prose of many kinds, offline: the Jargon File.

A third kind of text for the training mix, beside docstrings and Austen's chapters:
a dictionary of hacker slang whose entries define, tell anecdotes, quote Usenet
posts and dialogue, and whose appendices hold folklore stories and koans. Debian
ships it as plain text in ``jargon-text`` (0.65 MB .deb, fetched with
``apt-get download`` like the other Debian corpora).

The text is hard-wrapped and indented by three spaces; lines are joined into
paragraphs, and consecutive paragraphs grouped into documents of about
``DOC_CHARS`` characters named ``jargon/<n>``, so the hash split into training and
held-out documents spreads over the whole alphabet.
"""

import gzip
from pathlib import Path
from typing import List, Optional, Tuple

from ..errors import KvlingoError
from .debian import deb_files, package_deb

PACKAGE = "jargon-text"
MEMBER = "./usr/share/doc/jargon-text/jargon.txt.gz"
DOC_CHARS = 4000
_BOX = set("│┌┐└┘├┤┬┴┼")
_START = "Welcome to the Jargon File"  # its first heading after the table of contents


def jargon_documents(cache_dir: Optional[Path] = None) -> List[Tuple[str, str]]:
    """The Jargon File's body as documents of about DOC_CHARS characters."""
    files = deb_files(package_deb(PACKAGE, "jargon", cache_dir), lambda n: n == MEMBER, PACKAGE)
    if MEMBER not in files:
        raise KvlingoError(f"The {PACKAGE} .deb has no {MEMBER}.")
    text = gzip.decompress(files[MEMBER]).decode("utf-8", errors="replace")
    return grouped(paragraphs(body(text)), "jargon")


def body(text: str) -> str:
    """The text after the table of contents (which repeats every heading)."""
    first = text.find(_START)
    second = text.find(_START, first + 1)
    return text[second:] if second >= 0 else text


def paragraphs(text: str) -> List[str]:
    """Hard-wrapped, indented lines joined into paragraphs; rules and the rows of
    box-drawn tables dropped."""
    out, para = [], []
    for line in text.splitlines() + [""]:
        line = line.strip()
        if line and (set(line) <= set("═─-=*_ ") or set(line) & _BOX):
            line = ""  # a typographic rule or a drawn table, not text
        if line:
            para.append(line)
        elif para:
            out.append(" ".join(para))
            para = []
    return out


def grouped(paras: List[str], prefix: str, doc_chars: int = DOC_CHARS) -> List[Tuple[str, str]]:
    """Consecutive paragraphs in documents of about ``doc_chars`` characters."""
    docs, buf = [], []
    for para in paras:
        buf.append(para)
        if sum(map(len, buf)) >= doc_chars:
            docs.append((f"{prefix}/{len(docs)}", "\n\n".join(buf)))
            buf = []
    if buf:
        docs.append((f"{prefix}/{len(docs)}", "\n\n".join(buf)))
    return docs

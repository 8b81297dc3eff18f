"""Corpora read out of Debian packages (data.debian, data.fortunes)."""

import io
import tarfile

import pytest

from mlx_kvlingo.data.debian import deb_files
from mlx_kvlingo.data.fortunes import fortune_documents
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

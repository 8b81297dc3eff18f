"""Corpus readers: each format, and clear errors for bad input."""

import json

import pytest

from mlx_kvlingo.data import corpus as data
from mlx_kvlingo.errors import KvlingoError


class ChatTok:
    chat_template = "x"

    def apply_chat_template(self, messages, tokenize=False):
        return "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)


def test_stdlib_corpus_and_stable_split():
    docs = data.read_corpus("stdlib")
    assert len(docs) > 100
    train, held = data.split_documents(docs)
    assert held and train and not {n for n, _ in train} & {n for n, _ in held}
    assert data.split_documents(docs) == (train, held)


def test_text_file_is_grouped_into_documents(tmp_path):
    p = tmp_path / "book.txt"
    paras = [f"Paragraph {i}. " + "word " * 200 for i in range(40)]
    p.write_text("\n\n".join(paras))
    docs = data.read_corpus(str(p))
    assert len(docs) > 5
    assert "".join(t for _, t in docs).count("Paragraph") == 40


def test_jsonl_text_and_chat(tmp_path):
    p = tmp_path / "mix.jsonl"
    lines = [
        {"text": "plain document one"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    ]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    docs = data.read_corpus(str(p), ChatTok())
    assert docs[0][1] == "plain document one"
    assert docs[1][1] == "<|user|>hi<|end|><|assistant|>hello<|end|>"
    # Without a chat template, a plain rendering.
    assert data.read_corpus(str(p))[1][1] == "user: hi\nassistant: hello"


def test_directory_of_files(tmp_path):
    (tmp_path / "a.txt").write_text("alpha text")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.jsonl").write_text(json.dumps({"text": "beta"}))
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")
    texts = sorted(t for _, t in data.read_corpus(str(tmp_path)))
    assert texts == ["alpha text", "beta"]


def test_mix_weights_repeat_a_part(tmp_path):
    (tmp_path / "code.txt").write_text("def f(): pass")
    (tmp_path / "prose.txt").write_text("It was a fine day.")
    code, prose = str(tmp_path / "code.txt"), str(tmp_path / "prose.txt")
    mix = data.read_corpus(f"{code}*3+{prose}")
    assert [t for _, t in mix] == ["def f(): pass"] * 3 + ["It was a fine day."]
    # The copies share one name, so they land on the same side of the split.
    train, held = data.split_documents(mix)
    assert len({n for n, _ in train} & {n for n, _ in held}) == 0
    for bad in (f"{code}*0", f"{code}*x", "*2", f"{code}*1.5"):
        with pytest.raises(KvlingoError, match="NAME\\*N"):
            data.read_corpus(bad)


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.txt", b"", "is empty"),
        ("blank.txt", b"  \n\n ", "is empty"),
        ("binary.txt", b"\x7fELF\x00\x00\x01binary", "looks binary"),
        ("latin1.txt", "caf\xe9".encode("latin-1"), "not UTF-8"),
        ("bad.jsonl", b'{"text": "ok"}\n{"text": broken\n', r"bad.jsonl:2: malformed JSON"),
        ("schema.jsonl", b'{"content": "no text key"}\n', r"schema.jsonl:1: expected an object"),
        ("badchat.jsonl", b'{"messages": [{"role": "user"}]}\n', r"badchat.jsonl:1: expected"),
        ("list.jsonl", b'[1, 2]\n', r"list.jsonl:1: expected"),
    ],
)
def test_malformed_corpora_are_rejected_clearly(tmp_path, name, content, message):
    p = tmp_path / name
    p.write_bytes(content)
    with pytest.raises(KvlingoError, match=message):
        data.read_corpus(str(p))


def test_missing_corpus_and_offline_hub(tmp_path, monkeypatch):
    with pytest.raises(KvlingoError, match="not 'stdlib'"):
        data.read_corpus(str(tmp_path / "nope.txt"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(KvlingoError, match="No .txt or .jsonl"):
        data.read_corpus(str(tmp_path / "empty_dir"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(KvlingoError, match="Could not get dataset 'nobody/nothing'.*Offline"):
        data.read_corpus("hf:nobody/nothing")


def test_token_windows_cover_distinct_offsets():
    stream = list(range(1000))
    batches = list(data.token_windows(stream, 100, 3, 7, seed=1))
    rows = [tuple(r) for b in batches for r in b.tolist()]
    assert len(rows) == 7 and len(set(r[0] for r in rows)) == 7
    assert all(r[0] % 100 == 0 and list(r) == list(range(r[0], r[0] + 100)) for r in rows)
    with pytest.raises(KvlingoError, match="fewer than one window"):
        next(data.token_windows(list(range(50)), 100, 1, 1))

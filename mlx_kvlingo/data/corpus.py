"""Text for fitting and evaluating translators.

The built-in corpus needs no network: the docstrings of the Python standard library
that ships with the interpreter, read with ``ast`` (never imported or executed).
Documents are split into training and held-out sets by a hash of their name, so the
split is stable across runs and machines with the same Python.
"""

import ast
import hashlib
import random
import sysconfig
from pathlib import Path
from typing import Iterator, List, Sequence, Tuple

import mlx.core as mx

from ..errors import KvlingoError
from .fortunes import fortune_documents
from .jargon import jargon_documents
from .prose import austen_documents

Document = Tuple[str, str]  # (name, text)


def stdlib_documents(min_chars: int = 200) -> List[Document]:
    """One document per stdlib module: its module, class and function docstrings."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        rel = path.relative_to(root)
        if rel.parts[0].startswith("test") or rel.name.startswith("test_"):
            continue  # the test suite is mostly code and fixtures, not prose
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        parts = []
        for node in ast.walk(tree):
            if isinstance(
                node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            ):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    parts.append(doc)
        text = "\n\n".join(parts)
        if len(text) >= min_chars:
            docs.append((str(rel), text))
    if not docs:
        raise KvlingoError(f"No docstrings found in the standard library at {root}.")
    return docs


def stdlib_sources() -> List[Document]:
    """The source text of each top-level standard-library module (read, never
    imported)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.glob("*.py")):
        try:
            docs.append((path.name, path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    if not docs:
        raise KvlingoError(f"No Python sources found in the standard library at {root}.")
    return docs


def split_documents(
    docs: Sequence[Document], heldout_fraction: float = 0.1
) -> Tuple[List[Document], List[Document]]:
    """(train, held-out) by a hash of each document's name."""
    train, heldout = [], []
    for name, text in docs:
        h = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) / 16**8
        (heldout if h < heldout_fraction else train).append((name, text))
    return train, heldout


def token_stream(tokenizer, docs: Sequence[Document], seed: int = 0) -> List[int]:
    """All documents tokenized and packed into one stream, in a seeded order."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    stream: List[int] = []
    for i in order:
        stream.extend(tokenizer.encode(docs[i][1] + "\n\n", add_special_tokens=False))
    return stream


def token_windows(
    stream: Sequence[int], length: int, batch_size: int, max_windows: int, seed: int = 0
) -> Iterator[mx.array]:
    """Batches [B, length] of non-overlapping windows cut from a token stream at
    seeded random offsets; at most ``max_windows`` windows in all."""
    n = len(stream) // length
    if n == 0:
        raise KvlingoError(
            f"The corpus has {len(stream)} tokens, fewer than one window of {length}."
        )
    starts = [i * length for i in range(n)]
    random.Random(seed).shuffle(starts)
    starts = starts[:max_windows]
    for b in range(0, len(starts), batch_size):
        yield mx.array([stream[s : s + length] for s in starts[b : b + batch_size]])


# ---------------------------------------------------------------------------
# Corpora from files and the hub

CORPUS_SUFFIXES = (".txt", ".jsonl")
_DOC_CHARS = 4000  # plain text is grouped into documents of about this size


def read_corpus(spec: str, tokenizer=None) -> List[Document]:
    """Documents from ``spec``: ``stdlib`` (built in), ``austen`` (Jane Austen's
    novels, from Debian's registry; see prose.py), ``fortunes`` (quotations, verse and
    dialogue, from Debian's registry; see fortunes.py), ``jargon`` (the Jargon File's
    definitions, anecdotes and folklore, from Debian's registry; see jargon.py), a
    ``.txt`` / ``.jsonl`` file, a
    directory of them, or ``hf:OWNER/NAME`` (a dataset repo on the hub, fetched
    with huggingface-hub into its cache; honours ``HF_HUB_OFFLINE``). Join several
    with ``+`` for a mix (``stdlib+austen``); a mix samples its text by characters, so
    ``stdlib*2+austen`` weighs the docstrings twice (a part ``NAME*N`` is read N times).

    ``.jsonl`` lines hold ``{"text": ...}`` or ``{"messages": [{"role", "content"}]}``;
    chat messages are rendered with ``tokenizer``'s chat template when it has one.
    """
    if "+" in spec:  # a mix: stdlib+austen+my.txt
        return [d for part in spec.split("+") for d in read_corpus(part, tokenizer)]
    name, times = _weighted_part(spec)
    if times != 1:  # stdlib*2: the same documents twice (one split: same names)
        return read_corpus(name, tokenizer) * times
    if spec == "stdlib":
        return stdlib_documents()
    if spec == "austen":
        return austen_documents()
    if spec == "fortunes":
        return fortune_documents()
    if spec == "jargon":
        return jargon_documents()
    if spec.startswith("hf:"):
        return _read_files(_hub_dataset_files(spec[3:]), tokenizer)
    path = Path(spec)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in CORPUS_SUFFIXES)
        if not files:
            raise KvlingoError(f"No .txt or .jsonl files in {path}.")
        return _read_files(files, tokenizer)
    if path.is_file():
        return _read_files([path], tokenizer)
    raise KvlingoError(
        f"Corpus {spec!r} is not 'stdlib', 'austen', 'fortunes', 'jargon', an existing file or "
        "directory, or hf:OWNER/NAME."
    )


def _weighted_part(spec: str) -> Tuple[str, int]:
    """``NAME*N`` -> (NAME, N); anything else -> (spec, 1)."""
    name, star, times = spec.rpartition("*")
    if not star:
        return spec, 1
    if not (times.isdigit() and int(times) >= 1 and name):
        raise KvlingoError(
            f"Corpus part {spec!r}: a weight is written NAME*N with N a whole number >= 1 "
            "(stdlib*2+austen)."
        )
    return name, int(times)


def _hub_dataset_files(repo_id: str) -> List[Path]:
    from huggingface_hub import snapshot_download

    try:
        root = snapshot_download(
            repo_id, repo_type="dataset", allow_patterns=["*.txt", "*.jsonl"]
        )
    except Exception as e:
        raise KvlingoError(
            f"Could not get dataset {repo_id!r} from the hub ({type(e).__name__}: {e}). "
            "Offline (HF_HUB_OFFLINE=1) only datasets already in the hub cache work."
        ) from e
    files = sorted(p for p in Path(root).rglob("*") if p.suffix in CORPUS_SUFFIXES)
    if not files:
        raise KvlingoError(f"Dataset {repo_id!r} has no .txt or .jsonl files.")
    return files


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    if b"\x00" in raw[:8192]:
        raise KvlingoError(f"{path} looks binary (NUL bytes); expected UTF-8 text.")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KvlingoError(f"{path} is not UTF-8 text ({e}).") from e
    if not text.strip():
        raise KvlingoError(f"{path} is empty.")
    return text


def _read_files(files: Sequence[Path], tokenizer) -> List[Document]:
    docs: List[Document] = []
    for path in files:
        text = _read_text(path)
        if path.suffix == ".jsonl":
            docs += _jsonl_documents(path, text, tokenizer)
        else:
            docs += _text_documents(path, text)
    return docs


def _text_documents(path: Path, text: str) -> List[Document]:
    """Consecutive paragraphs grouped into documents of about _DOC_CHARS."""
    docs, buf = [], ""
    for para in text.split("\n\n"):
        buf = f"{buf}\n\n{para}" if buf else para
        if len(buf) >= _DOC_CHARS:
            docs.append((f"{path.name}#{len(docs)}", buf))
            buf = ""
    if buf.strip():
        docs.append((f"{path.name}#{len(docs)}", buf))
    return docs


def _jsonl_documents(path: Path, text: str, tokenizer) -> List[Document]:
    import json

    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise KvlingoError(f"{path}:{n}: malformed JSON ({e}).") from e
        if isinstance(obj, dict) and isinstance(obj.get("text"), str):
            docs.append((f"{path.name}:{n}", obj["text"]))
        elif isinstance(obj, dict) and _is_chat(obj.get("messages")):
            docs.append((f"{path.name}:{n}", render_chat(obj["messages"], tokenizer)))
        else:
            raise KvlingoError(
                f"{path}:{n}: expected an object with a 'text' string or a 'messages' "
                "list of {role, content} objects."
            )
    if not docs:
        raise KvlingoError(f"{path} holds no documents.")
    return docs


def _is_chat(messages) -> bool:
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    )


def render_chat(messages, tokenizer=None) -> str:
    """A conversation as text: the tokenizer's chat template, or a plain fallback."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)

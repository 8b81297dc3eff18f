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

from .errors import KvlingoError

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

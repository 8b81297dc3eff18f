"""Coding conversations for training on chat-formatted code (stage 2).

A chat is what a coding assistant sees when a user escalates: a user pastes a
piece of a Python module and asks for a short summary, a model answers, then the
user asks about something in the paste. The pastes are the standard library's own
sources (the *training* split of :func:`data.corpus.stdlib_sources`, so the
held-out modules the benchmarks paste stay unread); the questions are of four
kinds, each with several phrasings:

- ``line``: a detail stated once (a word in a comment, a helper's name, a
  constant's value; :func:`data.recall.recall_items` puts it in) — how does its
  line end?
- ``prints``: a short generated function put into the paste — what does calling
  it print?
- ``explain``: what one of the paste's own functions does or takes;
- ``names``: which functions or classes the paste defines.

The answers are not here: the models write them (``train.chat_samples``), the
first by the model the chat starts with, the last by the target, whose own answer
is the continuation stage 2 distils on.
"""

import random
import re
from dataclasses import dataclass
from typing import Callable, List, Sequence

from .corpus import split_documents, stdlib_sources
from .recall import recall_items

PASTES = (
    "Here is a Python module I am working on:\n\n```python\n{code}\n```\n\n"
    "Summarise what it does in one sentence.",
    "Can you look at this code?\n\n```python\n{code}\n```\n\nWhat is it for, in short?",
    "```python\n{code}\n```\n\nI found this in our code base. Give me a one-line overview.",
)
LINE_QUESTIONS = (
    "In the code I pasted, how does this line end? Answer with the missing part only.\n\n{cue}",
    "Complete this line from the module above, exactly as it was written:\n\n{cue}",
    "What comes next on this line of the pasted code?\n\n{cue}",
)
PRINTS_QUESTIONS = (
    "What does calling `{name}()` from that code print? Give the output only.",
    "If I run `{name}()` from the module above, what gets printed?",
    "Output of `{name}()` in the pasted module?",
)
EXPLAIN_QUESTIONS = (
    "What does `{name}` in the pasted code do?",
    "Which arguments does `{name}` take, and what does it return?",
    "Explain `{name}` from the module above in two sentences.",
)
NAMES_QUESTIONS = (
    "List the functions and classes the pasted code defines.",
    "Which names does that code define? Just the names.",
)
KINDS = ("line", "prints", "explain", "names")


@dataclass(frozen=True)
class CodeChat:
    """A chat before its answers: the first user message (the paste) and the
    question that follows the first answer."""

    paste: str
    question: str
    kind: str

    def to_dict(self) -> dict:
        return {"paste": self.paste, "question": self.question, "kind": self.kind}


def training_code() -> List[str]:
    """The standard-library sources of the training split (never the held-out
    modules :func:`data.recall.heldout_code_filler` pastes)."""
    return [text for _, text in split_documents(stdlib_sources())[0]]


def code_chats(count: int, count_tokens: Callable[[str], int],
               lengths: Sequence[int] = (500, 1000), seed: int = 0,
               code: Sequence[str] = ()) -> List[CodeChat]:
    """``count`` chats, the kinds in turn, pastes of about ``lengths`` tokens (as
    ``count_tokens`` measures text; in turn too) from ``code`` (default: the training
    sources). Deterministic in ``seed``."""
    code = list(code) or training_code()
    rng = random.Random(seed)
    per = {}  # (kind, length) -> items still to hand out
    out = []
    for i in range(count):
        kind = KINDS[i % len(KINDS)]
        length = lengths[(i // len(KINDS)) % len(lengths)]
        if kind in ("line", "prints"):
            key = (kind, length)
            if not per.get(key):
                n = max(count // len(KINDS) // len(lengths) + 1, 1)
                kinds = ["code", "identifier", "number"] if kind == "line" else ["prints"]
                per[key] = recall_items(code, n, length, count_tokens, kinds=kinds,
                                        depths=(0.1, 0.3, 0.5, 0.7, 0.9),
                                        seed=rng.randrange(1 << 30), code_filler=code)
            item = per[key].pop(0)
            context = item.context.rstrip()
            if kind == "line":
                question = rng.choice(LINE_QUESTIONS).format(cue=item.cue.strip())
            else:
                name = re.search(r"(\w+)\(\)", item.cue).group(1)
                question = rng.choice(PRINTS_QUESTIONS).format(name=name)
        else:
            context = _window(code, rng, length, count_tokens)
            names = re.findall(r"^\s*(?:def|class) (\w+)", context, re.M)
            if kind == "explain" and names:
                question = rng.choice(EXPLAIN_QUESTIONS).format(name=rng.choice(names))
            else:
                question = rng.choice(NAMES_QUESTIONS)
        out.append(CodeChat(rng.choice(PASTES).format(code=context), question, kind))
    return out


def _window(code: Sequence[str], rng: random.Random, tokens: int,
            count_tokens: Callable[[str], int]) -> str:
    """About ``tokens`` tokens of one source file, from a line that starts a
    definition (or the file's start), cut at a line end."""
    for _ in range(50):
        text = rng.choice(code)
        starts = [0] + [m.start() + 1 for m in re.finditer(r"\n(?=def |class |@)", text)]
        at = rng.choice(starts)
        chunk = text[at : at + 5 * tokens]
        if count_tokens(chunk) < tokens * 0.8:
            continue
        lines = chunk.split("\n")
        while len(lines) > 1 and count_tokens("\n".join(lines)) > tokens:
            lines = lines[: max(1, len(lines) - max(1, len(lines) // 10))]
        return "\n".join(lines).rstrip()
    return rng.choice(code)[: 4 * tokens]

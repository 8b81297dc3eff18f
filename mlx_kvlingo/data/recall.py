"""Long-range recall items: a fact stated once, deep in ordinary text, then asked for
at the end, so that only distant context holds the answer.

Each item is a filler text (held-out prose or documentation) with one *fact*
sentence put in at a chosen depth, followed by a *cue* that asks for it; the
answer is the text a model should continue with. Facts are of several kinds
(numbers, invented names, code identifiers, items of a list) and every kind has
several phrasings, drawn per item, so a score is not a score on one template.
The values are random (numbers, invented words), so no model can know them
without having read the fact.

Cues are completions ("... the locker code is") rather than questions, so base
models and instruction models are scored alike; a cue restates the fact's
subject, never its value.
"""

import random
import re
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Sequence, Tuple

from ..errors import KvlingoError
from .corpus import split_documents, stdlib_documents
from .prose import austen_documents

KINDS = ("number", "name", "identifier", "list")


@dataclass(frozen=True)
class RecallItem:
    """``context + cue`` is what a model reads; ``answer`` is what it should say next
    (it starts with the space that separates it from the cue)."""

    context: str
    cue: str
    answer: str
    kind: str
    fact: Tuple[int, int]  # the fact sentence's characters in the context
    template: int  # which phrasing of its kind

    @property
    def prompt(self) -> str:
        return self.context + self.cue

    @property
    def depth(self) -> float:
        """Where the fact starts, as a fraction of the context's characters."""
        return self.fact[0] / len(self.context)

    def to_dict(self) -> dict:
        return dict(asdict(self), depth=self.depth)


# ---------------------------------------------------------------------------
# Values nobody can guess


def _digits(rng: random.Random) -> str:
    return str(rng.randint(10_000, 999_999))


def _word(rng: random.Random, syllables: Tuple[int, int] = (2, 3)) -> str:
    return "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou")
                   for _ in range(rng.randint(*syllables)))


def _person(rng: random.Random) -> str:
    return f"{_word(rng).capitalize()} {_word(rng, (2, 4)).capitalize()}"


def _identifier(rng: random.Random) -> str:
    parts = [_word(rng, (1, 2)) for _ in range(rng.randint(2, 3))]
    return "_".join(parts) + (str(rng.randint(2, 9)) if rng.random() < 0.5 else "")


_THINGS = ("lantern", "compass", "kettle", "blanket", "ladder", "basket", "candle", "hammer",
           "mirror", "saddle", "violin", "teapot", "anchor", "helmet", "pillow", "trumpet")

# ---------------------------------------------------------------------------
# Phrasings: (fact, cue) with {v} the value; a list's fact names every item, its
# cue repeats the items before the one asked for.

TEMPLATES: Dict[str, List[Tuple[str, str]]] = {
    "number": [
        ("The code for the storage locker is {v}.", "The code for the storage locker is"),
        ("Please remember that the reference number of the order is {v}.",
         "The reference number of the order is"),
        ("Her room at the hotel was number {v}, on the top floor.",
         "Her room at the hotel was number"),
        ("The account was opened with the PIN {v}.", "The PIN of the account is"),
    ],
    "name": [
        ("The letter was signed by a certain {v}.", "The letter was signed by"),
        ("The new gardener, who arrived on Tuesday, was called {v}.",
         "The new gardener was called"),
        ("Everyone agreed that the prize should go to {v}.", "The prize went to"),
        ("The ship's captain was a woman named {v}.", "The ship's captain was named"),
    ],
    "identifier": [
        ("The function that parses the settings file is called {v}.",
         "The function that parses the settings file is called"),
        ("Set the environment variable {v} before you start the server.",
         "Before starting the server, set the environment variable"),
        ("The test helper lives in a module named {v}.", "The test helper's module is named"),
        ("Internally the cache key is stored under the name {v}.",
         "The cache key is stored under the name"),
    ],
    "list": [
        ("We packed, in this order: {v}.", "We packed, in this order:"),
        ("The shelves held, from left to right, {v}.", "The shelves held, from left to right,"),
        ("On the list for the market were {v}.", "On the list for the market were"),
    ],
}


def _fact(kind: str, template: int, rng: random.Random) -> Tuple[str, str, str]:
    """(fact sentence, cue, answer) for one kind and phrasing."""
    fact, cue = TEMPLATES[kind][template]
    if kind == "list":
        items = rng.sample(_THINGS, 4)
        named = [("an " if x[0] in "aeiou" else "a ") + x for x in items]
        said = f"{named[0]}, {named[1]}, {named[2]} and {named[3]}"
        k = rng.randint(1, 3)  # ask for an item after the first, given the ones before it
        return fact.format(v=said), f"{cue} {', '.join(named[:k])},", f" {named[k]}"
    value = {"number": _digits, "name": _person, "identifier": _identifier}[kind](rng)
    return fact.format(v=value), cue, f" {value}"


# ---------------------------------------------------------------------------
# Items


def _sentence_starts(text: str) -> List[int]:
    """Character offsets where a sentence or paragraph begins."""
    return [0] + [m.end() for m in re.finditer(r"(?<=[.!?])\s+(?=[A-Z\"'(])|\n\s*\n", text)]


def recall_items(
    filler: Sequence[str],
    count: int,
    context_tokens: int,
    count_tokens: Callable[[str], int],
    kinds: Sequence[str] = KINDS,
    depths: Sequence[float] = (0.05, 0.25, 0.5),
    seed: int = 0,
) -> List[RecallItem]:
    """``count`` items of about ``context_tokens`` tokens (as ``count_tokens``
    measures text), cycling through ``kinds`` and ``depths``; each item's filler is
    a run of ``filler`` texts from a random start, the fact put in at the first
    sentence start past its depth. Deterministic in ``seed``."""
    unknown = [k for k in kinds if k not in TEMPLATES]
    if unknown:
        raise KvlingoError(f"Unknown recall kinds {unknown}; choose from {', '.join(KINDS)}.")
    text = "\n\n".join(t.strip() for t in filler if t.strip())
    if count_tokens(text) < 2 * context_tokens:
        raise KvlingoError("Too little filler text for recall items of this length.")
    # Characters per token, to cut windows near the wanted length before measuring.
    chars_per_token = len(text) / count_tokens(text)
    rng = random.Random(seed)
    items = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        depth = depths[(i // len(kinds)) % len(depths)]
        template = rng.randrange(len(TEMPLATES[kind]))
        fact, cue, answer = _fact(kind, template, rng)
        window = _window(text, rng, int(context_tokens * chars_per_token))
        starts = _sentence_starts(window)
        at = next((s for s in starts if s >= depth * len(window)), starts[-1])
        context = window[:at] + fact + " " + window[at:] + "\n\n"
        # Trim the end to the token budget, keeping whole words.
        while count_tokens(context + cue) > context_tokens and len(context) > at + len(fact) + 200:
            cut = context.rstrip().rfind(" ", 0, len(context) - 40)
            context = context[:cut].rstrip() + "\n\n"
        items.append(RecallItem(context, cue, answer, kind, (at, at + len(fact)), template))
    return items


def _window(text: str, rng: random.Random, chars: int) -> str:
    """A run of ``chars`` characters of ``text`` (more, to leave room to trim),
    starting at a paragraph or sentence start."""
    chars = int(chars * 1.15)
    start = rng.randrange(0, max(len(text) - chars, 1))
    para = text.rfind("\n\n", 0, start)
    start = para + 2 if para >= 0 else 0
    return text[start : start + chars].strip() + " "


def heldout_filler() -> List[str]:
    """Held-out English prose (Austen chapters) and documentation (standard-library
    docstrings), alternating: text the shipped translators never trained on."""
    _, austen = split_documents(austen_documents())
    _, stdlib = split_documents(stdlib_documents())
    out = []
    for i in range(max(len(austen), len(stdlib))):
        out += [docs[i][1] for docs in (austen, stdlib) if i < len(docs)]
    return out

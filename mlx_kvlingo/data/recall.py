"""Long-range recall items: a fact stated once, deep in ordinary text, then asked for
at the end, so that only distant context holds the answer.

Each item is a filler text (held-out prose or documentation) with one *fact*
sentence put in at a chosen depth, followed by a *cue* that asks for it; the
answer is the text a model should continue with. Facts are of several kinds
(numbers, invented names, code identifiers, items of a list) and every kind has
several phrasings, drawn per item, so a score is not a score on one template.
The values are random (numbers, invented words), so no model can know them
without having read the fact.

The *plain* kinds (:data:`PLAIN_KINDS`) hold facts in ordinary words, which
nothing marks as a fact: a common noun or a place, who did what to whom, a yes/no
question about something said once, two facts that must be combined, a made-up
term defined in words and used later, and a helper's behaviour described in a
comment of Python code. Their answers are lowercase common words drawn at random
from large vocabularies (no digit, capital or underscore), and none of the
common words an item uses occurs in its filler.

Cues are completions ("... the locker code is") rather than questions, so base
models and instruction models are scored alike; a cue restates the fact's
subject, never its value.
"""

import random
import re
import string
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from ..errors import KvlingoError
from .code_questions import KINDS as PROGRAMS
from .code_questions import printed
from .corpus import split_documents, stdlib_documents, stdlib_sources
from .prose import austen_documents

KINDS = ("number", "name", "identifier", "list")  # facts that look like facts
PLAIN_KINDS = ("place", "relation", "yesno", "combined", "definition", "code")
# A function pasted into code that prints something: what does calling it print?
# In no group (asked for by name), so the groups' items stay as they were.
PROGRAM_KINDS = ("prints",)
# Names that stand for several kinds (``--kinds plain``).
KIND_GROUPS: Dict[str, Tuple[str, ...]] = {
    "facts": KINDS, "plain": PLAIN_KINDS, "all": KINDS + PLAIN_KINDS}


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
    # Further fact sentences the answer needs (the "combined" kind's second one).
    more: Tuple[Tuple[int, int], ...] = ()

    @property
    def prompt(self) -> str:
        return self.context + self.cue

    @property
    def depth(self) -> float:
        """Where the fact starts, as a fraction of the context's characters."""
        return self.fact[0] / len(self.context)

    @property
    def facts(self) -> List[Tuple[int, int]]:
        """Every fact sentence's characters in the context."""
        return [tuple(self.fact)] + [tuple(f) for f in self.more]

    def to_dict(self) -> dict:
        out = dict(asdict(self), depth=self.depth)
        if not self.more:
            del out["more"]  # as items without it always were (checkpoint keys)
        return out


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
# Plain kinds: facts in ordinary words. Every slot is filled from a vocabulary of
# common lowercase words (no two slots of an item alike); ``{v}`` is the answer,
# drawn from the vocabulary the template names; a yes/no cue asks about ``{q}``,
# which is ``{v}`` (answer yes) or another word of its vocabulary (answer no).

_OBJECTS = tuple("""
lantern compass kettle blanket ladder basket candle hammer mirror saddle violin teapot
anchor helmet pillow trumpet bucket shovel umbrella wallet ribbon necklace bracelet scarf
spoon saucepan bottle envelope notebook pencil paintbrush clock whistle drum flute harp
rope chain padlock brooch feather seashell pebble acorn lemon onion potato carrot loaf
cheese sausage biscuit honey towel curtain carpet cushion stool lamp torch kite puppet
marble spade rake sickle axe chisel needle thimble button thread telescope microscope
thermometer typewriter kettledrum accordion banjo cello tambourine trombone
goblet jug ladle colander funnel sieve whisk skillet cauldron anvil
horseshoe bridle lasso harpoon fishhook net oar paddle sail rudder tent hammock
backpack satchel suitcase briefcase toolbox birdcage aquarium globe atlas calendar
postcard stamp crayon chalk eraser ruler stapler magnet battery bulb
""".split())
_PLACES = tuple("""
piano sofa staircase bench bridge fountain wardrobe cupboard bed desk windowsill chimney
barrel wagon hedge well mill barn stable chapel fireplace doormat floorboards porch
bookcase dresser bathtub sink oven stove refrigerator radiator boiler attic cellar
garage shed greenhouse henhouse pigsty dovecote orchard vineyard haystack woodpile
scarecrow windmill lighthouse bandstand gazebo pier jetty boathouse signpost milestone
tombstone statue sundial birdbath wheelbarrow tractor carousel organ altar pulpit
counter mangle loom forge kiln quarry
""".split())
_ROLES = tuple("""
baker fisherman tailor miller blacksmith carpenter shepherd farmer butcher weaver potter
gardener sailor soldier teacher doctor nurse cook painter poet singer dancer merchant
banker clerk judge priest monk widow beggar hunter innkeeper shoemaker locksmith
glassblower beekeeper fiddler juggler porter coachman ferryman stonemason plumber
librarian grocer florist jeweller chemist barber goatherd milkmaid ploughman woodcutter
watchman lamplighter postman dentist pharmacist mechanic electrician architect surveyor
auctioneer chauffeur gamekeeper harpist organist cellist saddler cooper thatcher
""".split())
_CONTAINERS = tuple("""
box chest trunk crate sack drawer tin case bag hamper casket coffer pouch purse locker
cabinet safe urn vase pot canister carton barrow cart
""".split())
_VERBS = tuple("""
tidy merge sort check load save clean split join fold pack scan parse render collect
gather prune trim wrap mark flush sync patch build dump
""".split())
_CODE_NOUNS = tuple("rows records entries lines items blocks chunks pages cells fields".split())
_VOCABULARIES = {"object": _OBJECTS, "place": _PLACES, "role": _ROLES}

PLAIN_TEMPLATES: Dict[str, List[Tuple[Tuple[str, ...], str, str]]] = {
    # (fact sentences, cue, vocabulary of the answer {v})
    "place": [
        (("The {o} was hidden under the {v}.",), "The {o} was hidden under the", "place"),
        (("The {r} left the {o} beside the {v} and went out.",),
         "The {r} had left the {o} beside the", "place"),
        (("After dinner the {r} and the {r2} agreed to meet behind the {v}.",),
         "After dinner, the {r} and the {r2} were to meet behind the", "place"),
        (("In the end the {o} turned up near the {v}, where nobody had looked.",),
         "In the end the {o} turned up near the", "place"),
        (("The {r} had come to town to buy a new {v}.",),
         "The {r} had come to town to buy a new", "object"),
        (("Inside the {c} there was nothing but an old {v}.",),
         "Inside the {c} there was nothing but an old", "object"),
    ],
    "relation": [
        (("The {r} gave the {o} to the {v}.",), "The {r} gave the {o} to the", "role"),
        (("It was the {v} who sold the {o} to the {r}.",),
         "The {o} was sold to the {r} by the", "role"),
        (("The {r} lent the {r2} her {v} for the journey.",),
         "For the journey, the {r} lent the {r2} her", "object"),
        (("The {r} stole the {o} from the {v} one night.",),
         "One night the {r} stole the {o} from the", "role"),
        (("The {v} wrote a long letter to the {r} about the {o}.",),
         "The long letter to the {r} about the {o} was written by the", "role"),
    ],
    "yesno": [
        (("The {r} hid the {o} behind the {v}.",),
         "Question: Did the {r} hide the {o} behind the {q}?\nAnswer:", "place"),
        (("The {r} gave the {o} to the {v}.",),
         "Question: Did the {r} give the {o} to the {q}?\nAnswer:", "role"),
        (("At the fair the {r} sold her old {v}.",),
         "Question: At the fair, did the {r} sell her old {q}?\nAnswer:", "object"),
        (("On the way home the {r} lost the {o} near the {v}.",),
         "Question: Was the {o} lost near the {q}?\nAnswer:", "place"),
        (("The {v} was the only one who knew where the {o} was kept.",),
         "Question: Was the {q} the only one who knew where the {o} was kept?\nAnswer:",
         "role"),
    ],
    # Two sentences, put in apart: neither alone answers the cue.
    "combined": [
        (("The {o} was packed into the {c}.", "The {c} was sent to the {v}."),
         "The {o}, in its packing, was sent to the", "role"),
        (("The {o} is kept inside the {c}.", "The {c} stands behind the {v}."),
         "To find the {o}, look behind the", "place"),
        (("The {v} owns the {c}.", "Someone left the {o} in the {c}."),
         "The {o} was left in something that belongs to the", "role"),
        (("The {v} lives next door to the {r}.", "The {r} sold the {o}."),
         "The {o} was sold by the next-door neighbour of the", "role"),
        (("The {c} was buried under the {v}.", "The {o} was put inside the {c}."),
         "To dig up the {o}, dig under the", "place"),
    ],
    # {t}: a made-up lowercase term, defined once and asked about or used later.
    "definition": [
        (("In this valley a {t} means a small {v}, nothing more.",),
         "In this valley a {t} means a small", "object"),
        (("The sailors use the word {t} for any broken {v}.",),
         "Among the sailors, a {t} is any broken", "object"),
        (("What the children call a {t} is really just an old {v}.",),
         "When the children ask for a {t}, what they want is an old", "object"),
        (("A {t}, in the {r}'s own language, is a wooden {v}.",),
         "The {r} went to fetch the {t}, that is to say the wooden", "object"),
        (("Around here, to {t} someone means to send them to the {v} for the night.",),
         "To {t} the {r}, then, was to send the {r} for the night to the", "place"),
    ],
    # Python comments (or a docstring) in code; {h}: a helper's name.
    "code": [
        (("# Note: {h}() skips every row whose label mentions the word {v}.",),
         "# Reminder: {h}() skips every row whose label mentions the word", "object"),
        (('def {h}(rows):\n    """Move every {v} to the end of the rows and return '
          'them."""\n    return rows',),
         "# As its docstring says, {h}() moves to the end of the rows every", "object"),
        (("# {h}() refuses to run without a config section called {v}.",),
         "# Careful: {h}() refuses to run without the config section called", "object"),
        (("# The {h} helper writes its log into the {v} folder.",),
         "# The {h} helper writes its log into the", "object"),
        (("# {h}() keeps only the {v} entries; everything else is dropped.",),
         "# Remember that {h}() keeps only the", "object"),
    ],
}


def _fields(text: str) -> List[str]:
    return [name for _, name, _, _ in string.Formatter().parse(text) if name]


def _plain_fact(kind: str, template: int, rng: random.Random, yes: bool = True
                ) -> Tuple[List[str], str, str, List[str]]:
    """(fact sentences, cue, answer, the vocabulary words the item uses) for a plain
    kind; ``yes``: a yes/no item's answer."""
    facts, cue, vocab = PLAIN_TEMPLATES[kind][template]
    objects, places, roles = (rng.sample(v, 4) for v in (_OBJECTS, _PLACES, _ROLES))
    pools = {"object": objects, "place": places, "role": roles}
    slots = {"o": objects[0], "p": places[0], "r": roles[0], "r2": roles[1],
             "c": rng.choice(_CONTAINERS), "t": _word(rng, (2, 3)),
             "h": f"{rng.choice(_VERBS)}_{rng.choice(_CODE_NOUNS)}",
             "v": pools[vocab][2]}
    slots["q"] = slots["v"] if yes else pools[vocab][3]
    used = {f for text in facts + (cue,) for f in _fields(text)}
    words = [slots[f] for f in sorted(used) if f not in ("t", "h")]
    answer = (" yes" if yes else " no") if kind == "yesno" else " " + slots["v"]
    return [f.format(**slots) for f in facts], cue.format(**slots), answer, words


def _mentions(text: str, word: str) -> bool:
    """``word`` as a word of ``text`` (any case; inside identifiers too)."""
    return re.search(rf"(?<![A-Za-z]){re.escape(word)}(?![A-Za-z])", text, re.I) is not None


TEMPLATES.update({k: [(" ".join(f), c) for f, c, _ in v] for k, v in PLAIN_TEMPLATES.items()})
# The "prints" kind's fact is a generated function (data.code_questions); {f} its name.
TEMPLATES["prints"] = [("def {f}(): ...", "# Calling {f}() prints:"),
                       ("def {f}(): ...", "# The output of {f}() is:")]


# ---------------------------------------------------------------------------
# Items


def _sentence_starts(text: str) -> List[int]:
    """Character offsets where a sentence or paragraph begins."""
    return [0] + [m.end() for m in re.finditer(r"(?<=[.!?])\s+(?=[A-Z\"'(])|\n\s*\n", text)]


def expand_kinds(kinds: Union[str, Sequence[str]]) -> List[str]:
    """Kind names, with group names (:data:`KIND_GROUPS`: ``facts``, ``plain``,
    ``all``) spelled out, in order, each once; a string is comma-separated."""
    if isinstance(kinds, str):
        kinds = [k.strip() for k in kinds.split(",") if k.strip()]
    out: List[str] = []
    for k in kinds:
        for kind in KIND_GROUPS.get(k, (k,)):
            if kind not in out:
                out.append(kind)
    unknown = [k for k in out if k not in TEMPLATES]
    if unknown or not out:
        raise KvlingoError(f"Unknown recall kinds {unknown}; choose from "
                           f"{', '.join(KINDS + PLAIN_KINDS + PROGRAM_KINDS)} or "
                           f"{', '.join(KIND_GROUPS)}.")
    return out


def _joined(filler: Sequence[str], count_tokens: Callable[[str], int],
            context_tokens: int) -> Tuple[str, float]:
    """The filler texts as one text, and its characters per token."""
    text = "\n\n".join(t.strip() for t in filler if t.strip())
    tokens = count_tokens(text)
    if tokens < 2 * context_tokens:
        raise KvlingoError("Too little filler text for recall items of this length.")
    return text, len(text) / tokens


def recall_items(
    filler: Sequence[str],
    count: int,
    context_tokens: int,
    count_tokens: Callable[[str], int],
    kinds: Union[str, Sequence[str]] = KINDS,
    depths: Sequence[float] = (0.05, 0.25, 0.5),
    seed: int = 0,
    code_filler: Optional[Sequence[str]] = None,
) -> List[RecallItem]:
    """``count`` items of about ``context_tokens`` tokens (as ``count_tokens``
    measures text), cycling through ``kinds`` (group names spelled out,
    :func:`expand_kinds`) and ``depths``; each item's filler is a run of ``filler``
    texts from a random start, the fact put in at the first sentence start past its
    depth. The ``code`` kind's filler is ``code_filler`` (default: held-out Python
    sources, :func:`heldout_code_filler`), its fact put in at a line start; so is the
    ``prints`` kind's (a generated function, before a line that follows a blank one).
    Deterministic in ``seed``."""
    kinds = expand_kinds(kinds)
    text, chars_per_token = _joined(filler, count_tokens, context_tokens)
    code = None
    if "code" in kinds or "prints" in kinds:
        code = _joined(code_filler if code_filler is not None else heldout_code_filler(),
                       count_tokens, context_tokens)
    rng = random.Random(seed)
    items = []
    yesno = []  # yes/no answers so far: each pair holds one yes and one no
    for i in range(count):
        kind = kinds[i % len(kinds)]
        depth = depths[(i // len(kinds)) % len(depths)]
        template = rng.randrange(len(TEMPLATES[kind]))
        if kind == "prints":
            items.append(_program_item(template, depth, code, context_tokens, count_tokens, rng))
            continue
        if kind in PLAIN_TEMPLATES:
            yes = True
            if kind == "yesno":
                yes = rng.random() < 0.5 if len(yesno) % 2 == 0 else not yesno[-1]
                yesno.append(yes)
            source = code if kind == "code" else (text, chars_per_token)
            items.append(_plain_item(kind, template, depth, yes, source, context_tokens,
                                     count_tokens, rng))
            continue
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


def _line_starts(text: str) -> List[int]:
    return [0] + [m.end() for m in re.finditer(r"\n", text)]


def _plain_item(kind: str, template: int, depth: float, yes: bool,
                source: Tuple[str, float], context_tokens: int,
                count_tokens: Callable[[str], int], rng: random.Random) -> RecallItem:
    """A plain kind's item: a window of filler none of whose words is one of the
    item's vocabulary words, cut to the budget first, so that the fact lands at
    ``depth`` of the context (a second fact sentence further on)."""
    text, chars_per_token = source
    for attempt in range(400):
        if attempt % 20 == 0:
            window = _window(text, rng, int(context_tokens * chars_per_token))
        facts, cue, answer, words = _plain_fact(kind, template, rng, yes)
        if not any(_mentions(window, w) for w in words):
            break
    else:
        raise KvlingoError("No filler window leaves out a recall item's words.")
    code = kind == "code"
    sep = "\n" if code else " "
    # Room for the facts and the cue, then the fact(s) at their depths.
    room = context_tokens - count_tokens(sep.join(facts) + "\n\n" + cue) - 2 * len(facts)
    window = _trim(window.rstrip(), room, count_tokens, chars_per_token, "\n" if code else " ")
    starts = (_line_starts if code else _sentence_starts)(window)
    at = next((s for s in starts if s >= depth * len(window)), starts[-1])
    spots = [at]
    if len(facts) == 2:
        later = depth + (1 - depth) * rng.uniform(0.3, 0.7)
        at2 = next((s for s in starts if s > at and s >= later * len(window)), len(window))
        spots.append(at2)
        if rng.random() < 0.5:
            facts = facts[::-1]
    context, spans, last = "", [], 0
    for fact, spot in zip(facts, spots):
        context += window[last:spot]
        if code:  # indented as the line it goes before
            indent = re.match(r"[ \t]*", window[spot:]).group()
            fact = "\n".join(indent + line for line in fact.split("\n"))
        if spot == len(window):
            context = context.rstrip() + ("\n" if code else " ")
        spans.append((len(context), len(context) + len(fact)))
        context += fact + sep
        last = spot
    context = context + window[last:].rstrip() + "\n\n"
    while count_tokens(context + cue) > context_tokens and len(context) > spans[-1][1] + 200:
        cut = context.rstrip().rfind(sep, 0, len(context) - 40)
        context = context[:cut].rstrip() + "\n\n"
    return RecallItem(context, cue, answer, kind, spans[0], template, tuple(spans[1:]))


def _program_item(template: int, depth: float, source: Tuple[str, float],
                  context_tokens: int, count_tokens: Callable[[str], int],
                  rng: random.Random) -> RecallItem:
    """A ``prints`` item: a short generated program (list indexing, string methods,
    arithmetic, ...; :mod:`.code_questions`) made a function with an invented name
    and put into held-out code before the first line past ``depth`` that follows a
    blank line, indented as that line; the cue
    asks what calling it prints, the answer is what it prints (found by running it).
    Answering needs the function's body, read once, and a little reasoning."""
    text, chars_per_token = source
    program = PROGRAMS[rng.choice(sorted(PROGRAMS))](rng)
    name = f"{_word(rng, (2, 3))}_{_word(rng, (1, 2))}"
    fact = f"def {name}():\n" + "\n".join("    " + line for line in program.split("\n"))
    cue = TEMPLATES["prints"][template][1].format(f=name)
    answer = " " + printed(program)
    window = _window(text, rng, int(context_tokens * chars_per_token))
    room = context_tokens - count_tokens(fact + "\n\n" + cue) - 4
    window = _trim(window.rstrip(), room, count_tokens, chars_per_token, "\n")
    # A line after a blank one, between two statements or definitions: the function
    # goes there indented as that line (a method or a nested function at times).
    starts = [s for s in _line_starts(window)
              if s == 0 or (window[s:].lstrip(" \t")[:1] not in ("", "\n")
                            and window[max(0, s - 2):s] == "\n\n")]
    at = next((s for s in starts if s >= depth * len(window)), starts[-1])
    indent = re.match(r"[ \t]*", window[at:]).group()
    fact = "\n".join(indent + line for line in fact.split("\n"))
    context = window[:at] + fact + "\n\n" + window[at:].rstrip() + "\n\n"
    span = (at, at + len(fact))
    while count_tokens(context + cue) > context_tokens and len(context) > span[1] + 200:
        cut = context.rstrip().rfind("\n", 0, len(context) - 40)
        context = context[:cut].rstrip() + "\n\n"
    return RecallItem(context, cue, answer, "prints", span, template)


def _trim(text: str, tokens: int, count_tokens: Callable[[str], int], chars_per_token: float,
          sep: str) -> str:
    """``text`` cut at a ``sep`` to at most ``tokens`` tokens."""
    while count_tokens(text) > tokens:
        excess = count_tokens(text) - tokens
        cut = text.rfind(sep, 0, len(text) - max(20, int(excess * chars_per_token * 0.8)))
        if cut <= 0:
            break
        text = text[:cut].rstrip()
    return text


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


def heldout_code_filler() -> List[str]:
    """Held-out Python code: the sources of the standard-library modules whose
    documentation the translators never trained on."""
    return [text for _, text in split_documents(stdlib_sources())[1]]

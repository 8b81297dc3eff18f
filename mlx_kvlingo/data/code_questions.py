"""Coding questions with answers that can be checked: "what does this print?"

Each question is a short Python program drawn at random from a few kinds (list
indexing and slicing, string methods, integer arithmetic, dictionaries, builtins
over lists, comprehensions), with random names and values; the answer is what the
program prints, found by running it (the programs are generated here, never read
from outside). A model's answer is right when its first line, stripped of quotes
and code fences, is the printed text. Used to calibrate routing between a small
and a large coding model (``serve --auto``): how often the small one is unsure,
and whether sending those turns to the large one gets more of them right.
"""

import contextlib
import io
import random
import re
from dataclasses import dataclass
from typing import Callable, Dict, List

NAMES = ["items", "values", "data", "nums", "row", "scores", "parts", "queue", "stack",
         "counts", "ids", "weights", "buf", "acc", "seq"]
WORDS = ["alpha", "river", "copper", "lantern", "mosaic", "quartz", "harbor", "velvet",
         "signal", "meadow", "orbit", "pepper", "tundra", "violet", "ember", "falcon"]
PROMPT = ("What does this Python program print? Answer with the printed output only.\n\n"
          "```python\n{code}\n```")


@dataclass
class CodeQuestion:
    kind: str
    code: str
    answer: str  # what the program prints, without the trailing newline

    @property
    def prompt(self) -> str:
        return PROMPT.format(code=self.code)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "code": self.code, "answer": self.answer}


def _name(rng: random.Random) -> str:
    return rng.choice(NAMES)


def _ints(rng: random.Random, n: int) -> List[int]:
    return [rng.randint(-20, 60) for _ in range(n)]


def _indexing(rng):
    xs, name = _ints(rng, rng.randint(5, 8)), _name(rng)
    i = rng.randint(-3, 3)
    a, b = sorted(rng.sample(range(0, len(xs)), 2))
    expr = rng.choice([f"{name}[{i}]", f"{name}[{a}:{b}]", f"{name}[::-1][{abs(i)}]",
                       f"{name}[{a}:] + {name}[:{b - a}]"])
    return f"{name} = {xs}\nprint({expr})"


def _strings(rng):
    w, name = rng.sample(WORDS, 2), rng.choice(["s", "text", "word", "label"])
    s = rng.choice([w[0], f"{w[0]} {w[1]}", f"{w[0]}-{w[1]}"])
    expr = rng.choice([f"{name}.upper()", f"{name}.split('-')", f"{name}[{rng.randint(1, 3)}:]",
                       f"{name}.replace('{s[0]}', '{rng.choice('xyz')}')", f"len({name})",
                       f"{name}.count('{rng.choice(s)}')", f"{name}.title()",
                       f"'-'.join({name}.split())", f"{name}.find('{rng.choice(s)}')"])
    return f"{name} = {s!r}\nprint({expr})"


def _arithmetic(rng):
    a, b, c = rng.randint(2, 90), rng.randint(2, 12), rng.randint(1, 9)
    expr = rng.choice([f"{a} // {b} + {c}", f"{a} % {b} * {c}", f"({a} + {c}) // {b}",
                       f"{b} ** 2 - {a}", f"divmod({a}, {b})", f"abs({c} - {a}) % {b}",
                       f"{a} - {b} * {c}", f"max({a}, {b} * {c})"])
    return f"x = {expr}\nprint(x)"


def _dictionaries(rng):
    keys = rng.sample(WORDS, 4)
    d = {k: rng.randint(0, 40) for k in keys}
    name = rng.choice(["d", "table", "stock", "ages"])
    missing = rng.choice([w for w in WORDS if w not in keys])
    expr = rng.choice([f"{name}[{keys[1]!r}]", f"{name}.get({missing!r}, {rng.randint(-5, 5)})",
                       f"sorted({name})[0]", f"len({name})", f"sum({name}.values())",
                       f"max({name}, key={name}.get)", f"list({name})[-1]"])
    return f"{name} = {d}\nprint({expr})"


def _builtins(rng):
    xs, name = _ints(rng, rng.randint(4, 7)), _name(rng)
    expr = rng.choice([f"sum({name})", f"sorted({name})[:3]", f"min({name}) + max({name})",
                       f"len(set({name}))", f"{name}.index({rng.choice(xs)})",
                       f"sorted({name}, reverse=True)[1]", f"list(zip({name}, {name}[1:]))[0]",
                       f"any(v > 50 for v in {name})"])
    return f"{name} = {xs}\nprint({expr})"


def _comprehensions(rng):
    n, k = rng.randint(4, 9), rng.randint(2, 4)
    expr = rng.choice([f"[i * {k} for i in range({n})]", f"[i for i in range({n}) if i % {k} == 0]",
                       f"sum(i * i for i in range({n}))", f"{{i: i % {k} for i in range({n // 2 + 1})}}",
                       f"[c for c in 'abcdefgh'[:{n}] if c not in 'aeiou']",
                       f"len([i for i in range({n * 3}) if i % {k}])"])
    return f"result = {expr}\nprint(result)"


KINDS: Dict[str, Callable[[random.Random], str]] = {
    "indexing": _indexing, "strings": _strings, "arithmetic": _arithmetic,
    "dictionaries": _dictionaries, "builtins": _builtins, "comprehensions": _comprehensions,
}


def printed(code: str) -> str:
    """What one of this module's programs prints (run here: they are its own)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<question>", "exec"), {"__builtins__": __builtins__})
    return out.getvalue().rstrip("\n")


def code_questions(count: int, seed: int = 0) -> List[CodeQuestion]:
    """``count`` questions, the kinds in turn, each drawn from ``seed``."""
    rng = random.Random(seed)
    kinds = list(KINDS)
    out = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        code = KINDS[kind](rng)
        out.append(CodeQuestion(kind, code, printed(code)))
    return out


def answered(said: str, answer: str) -> bool:
    """Whether a model's reply gives the printed output: its first non-empty line
    (code fences and surrounding quotes or backticks dropped), or the whole reply,
    equals the answer up to surrounding whitespace."""
    text = re.sub(r"```[a-z]*", "", said).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return False
    candidates = {lines[0], text}
    for c in list(candidates):
        candidates.add(c.strip("`'\" "))
        if c.lower().startswith("output:"):
            candidates.add(c[len("output:"):].strip())
    return answer.strip() in candidates


def stated(said: str, answer: str) -> bool:
    """A chat reply gives the printed output: as :func:`answered` accepts it, or as
    the first fenced block, or at the end of the first line after "is", "prints" or
    a colon (``The output of `f()` is `'ember'`.``), quotes, backticks and a final
    period dropped. For replies in a conversation, which say what they answer."""
    if answered(said, answer):
        return True
    text = said.strip()
    candidates = [block.strip() for block in re.findall(r"```[a-z]*\n?(.*?)```", text, re.S)[:1]]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines:
        candidates.append(re.split(r"\b(?:is|prints|outputs)\b|:", lines[0])[-1])
    want = answer.strip()
    for c in candidates:
        c = c.strip().strip("`'\" ")
        if want in (c, c.rstrip(".").strip("`'\" ")):
            return True
    return False

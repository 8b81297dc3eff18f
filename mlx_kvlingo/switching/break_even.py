"""Below which length a switch costs more than it saves, on this machine, for one pair.

A switch has fixed costs a prefill does not: the question's probe is one more pass
of the target, and a pass costs at least one read of its weights. A short span is
cheaper to prefill. Where the two cross depends on the machine (memory bandwidth,
compute, dtype) and on the pair, so it is measured, not guessed: the catch-up of
n translated positions, and the reader's first token after a question, against
the reader prefilling the n positions and the question, for growing n. The
break-even is the shortest n from which the switch wins at every longer length
measured. Measured once per machine and pair, it is kept in the cache directory
(``break-even.json``); a conversation's catch-up (and so ``serve``'s routing)
prefills instead of translating below it.
"""

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from ..errors import KvlingoError
from ..files import default_cache_dir, written_atomically
from ..models.cache import last_logits, prefill
from ..translator.align import Alignment
from ..translator.maps import Translator
from .catch_up import Run, catch_up
from .generate import first_step

LENGTHS = (16, 32, 64, 128, 256, 512)
QUESTION = 16  # question tokens read after the context, both ways
FILE = "break-even.json"


@dataclass
class BreakEven:
    """``tokens``: the shortest translated span worth switching (a length past the
    last one measured when the switch never won); ``seconds``: per length, the
    switch's and the prefill's median time to the first token."""

    tokens: int
    seconds: Dict[int, Dict[str, float]] = field(default_factory=dict)
    machine: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def machine_key() -> str:
    """What the timing depends on: the processor, the MLX device, the cores."""
    return (f"{platform.system()} {platform.machine()} {platform.processor() or ''} "
            f"{os.cpu_count()} cores, {mx.default_device()}").strip()


def measure_break_even(source: nn.Module, target: nn.Module, translator: Translator,
                       source_tokens: Sequence[int], target_tokens: Sequence[int],
                       lengths: Sequence[int] = LENGTHS, repeats: int = 2,
                       progress=None) -> BreakEven:
    """Time, for each n in ``lengths``, a catch-up of n translated positions with
    the translator's defaults (native tail and recompute) and the reader's first
    token after a QUESTION-token question, against a prefill of the same n +
    QUESTION tokens and its first token (medians of ``repeats``). The source's
    cache of ``source_tokens`` is given (its turn made it) and not timed; target
    position i reads source position i (the cost does not depend on the
    alignment). Stops once the switch has won at two lengths in a row.
    ``progress(n, switch_s, prefill_s)``: called after each length."""
    need = max(lengths) + QUESTION
    if len(target_tokens) < min(lengths) + QUESTION or len(source_tokens) < min(lengths):
        raise KvlingoError(f"Measuring the break-even needs at least "
                           f"{min(lengths) + QUESTION} tokens of text.")
    lengths = [n for n in sorted(lengths) if n + QUESTION <= min(len(target_tokens), need)
               and n <= len(source_tokens)]
    source_cache = prefill(source, mx.array(list(source_tokens[:lengths[-1]]))[None])
    mx.eval([(c.keys, c.values) for c in source_cache])
    seconds, wins = {}, []
    for n in lengths:
        ids, question = list(target_tokens[:n]), list(target_tokens[n:n + QUESTION])
        alignment = None
        if translator.cross_tokenizer:
            alignment = Alignment(list(source_tokens[:n]), ids, list(range(n)))
        switch_s = _median(repeats, lambda: _switch(source, target, translator, source_cache,
                                                    ids, question, alignment))
        prefill_s = _median(repeats, lambda: _prefill(target, ids + question))
        seconds[n] = {"switch": switch_s, "prefill": prefill_s}
        wins.append(switch_s < prefill_s)
        if progress is not None:
            progress(n, switch_s, prefill_s)
        if len(wins) >= 2 and wins[-1] and wins[-2]:
            break
    return BreakEven(first_lasting_win(list(seconds), wins), seconds, machine_key())


def first_lasting_win(lengths: List[int], wins: List[bool]) -> int:
    """The shortest length from which the switch won at every longer one; past
    the last length when it did not win at the last."""
    if not wins or not wins[-1]:
        return lengths[-1] * 2 if lengths else 0
    i = len(wins)
    while i > 0 and wins[i - 1]:
        i -= 1
    return lengths[i]


def _switch(source, target, translator, source_cache, ids, question, alignment):
    """A catch-up of ids (translated but the first native position) onto an empty
    cache, then the first token after the question."""
    lo = min(translator.spec.native_prefix, len(ids))
    cache = make_prompt_cache(target)
    runs = ([Run(0, lo)] if lo else []) + [Run(lo, len(ids), "source", source, source_cache,
                                               translator, alignment)]
    done = catch_up(target, cache, ids, 0, runs, question)
    first_step(target, done.result)


def _prefill(target, ids):
    cache = make_prompt_cache(target)
    if len(ids) > 1:
        prefill(target, mx.array(ids[:-1]), cache)
    mx.eval(last_logits(target, mx.array([ids[-1:]]), cache))


def _median(repeats: int, run) -> float:
    times = []
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _pair_key(translator: Translator, target: nn.Module) -> str:
    """The pair (by its models' fingerprints) and the dtype the target runs in."""
    spec = translator.spec
    dtype = next((str(v.dtype) for _, v in tree_flatten(target.parameters())
                  if isinstance(v, mx.array)), "?")
    return f"{spec.source.fingerprint} -> {spec.target.fingerprint} ({dtype})"


def _file(cache_dir: Optional[Union[str, Path]]) -> Path:
    return Path(cache_dir or default_cache_dir()) / FILE


def stored_break_even(translator: Translator, target: nn.Module,
                      cache_dir: Optional[Union[str, Path]] = None) -> Optional[int]:
    """The break-even measured on this machine for this pair and dtype, if any."""
    table = _read_table(_file(cache_dir))
    if not table:
        return None
    entry = table.get(machine_key(), {}).get(_pair_key(translator, target))
    return int(entry["tokens"]) if entry else None


def break_even_for(translator: Translator, target: nn.Module,
                   cache_dir: Optional[Union[str, Path]] = None) -> Tuple[int, str]:
    """(the break-even a catch-up with ``translator`` uses, where it comes from):
    this machine's measurement ("measured here"), else the file's default, measured
    where the file's defaults were set ("the file's"; 0 in files without one). A
    faster machine breaks even sooner: the file's number then prefills a few
    catch-ups a switch would have done a little faster, never a worse cache."""
    here = stored_break_even(translator, target, cache_dir)
    if here is not None:
        return here, "measured here"
    return translator.spec.break_even, "the file's"


_READ: Dict[str, tuple] = {}  # path -> ((mtime, size), table): read again only when it changes


def _read_table(path: Path) -> dict:
    """The stored table (every catch-up asks; the file is parsed once per change)."""
    try:
        stat = path.stat()
    except OSError:
        return {}
    stamp = (stat.st_mtime_ns, stat.st_size)
    cached = _READ.get(str(path))
    if cached is None or cached[0] != stamp:
        try:
            cached = (stamp, json.loads(path.read_text()))
        except (OSError, ValueError):
            cached = (stamp, {})
        _READ[str(path)] = cached
    return cached[1]


def store_break_even(found: BreakEven, translator: Translator, target: nn.Module,
                     cache_dir: Optional[Union[str, Path]] = None) -> Path:
    """Keep ``found`` for this machine and pair (``break-even.json``)."""
    path = _file(cache_dir)
    table = json.loads(json.dumps(_read_table(path)))  # a copy to change
    entry = found.to_dict()
    entry["measured"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    table.setdefault(machine_key(), {})[_pair_key(translator, target)] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    with written_atomically(path) as tmp:
        tmp.write_text(json.dumps(table, indent=1))
    return path

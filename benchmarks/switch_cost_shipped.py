"""Switch cost of the shipped translators against earlier ones, interleaved in one process:
median time to first token after `switch_text` (translation, 16-token native tail, first
step) for each, and re-prefills of the target (interleaved too), on Austen text.

    python benchmarks/switch_cost_shipped.py OLD_DIR [--tokens 2048] [--rounds 4] \
        [--json benchmarks/results/switch-cost-shipped.json] [--note "conditions"]

OLD_DIR holds the earlier smollm2-to-gemma3 / gemma3-to-smollm2 .safetensors files (e.g.
`git show REV:mlx_kvlingo/assets/translators/...`); a direction whose file is missing
there is timed with the shipped file alone.
"""
import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mlx_kvlingo.data import corpus as data
from mlx_kvlingo.models.cache import prefill
from mlx_kvlingo.models.load import load_pair
from mlx_kvlingo.pairs.shipped import ASSETS, SHIPPED
from mlx_kvlingo.switching.api import switch_text
from mlx_kvlingo.switching.generate import first_step
from mlx_kvlingo.translator.align import tokenize_with_offsets
from mlx_kvlingo.translator.maps import load_translator


def austen_text(tokenizer, n_tokens: int) -> str:
    """The first ``n_tokens`` target tokens of the novels, as text."""
    text = "\n\n".join(txt for _, txt in data.read_corpus("austen"))
    return tokenizer.decode(tokenizer.encode(text[:n_tokens * 8])[:n_tokens])


def interleaved_medians(runs: dict, rounds: int) -> dict:
    """Median seconds of each of ``runs`` (name -> callable), the runs interleaved
    round by round so that a change in the machine's load hits all alike; an extra
    first round warms up and is not counted."""
    times = {name: [] for name in runs}
    for r in range(rounds + 1):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            if r:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in times.items()}


def time_direction(source: str, target: str, old: Path, tokens: int, rounds: int) -> dict:
    src, stok, tgt, ttok = load_pair(source, target)
    text = austen_text(ttok, tokens)
    source_tokens = tokenize_with_offsets(stok, text)
    cache = prefill(src, mx.array(source_tokens[0])[None])
    mx.eval([(c.keys, c.values) for c in cache])
    translators = {"shipped now": load_translator(ASSETS / SHIPPED[(source, target)])}
    if old.is_file():
        translators["previous"] = load_translator(old)
    target_ids = mx.array(ttok.encode(text))[None]

    def switch(tr):
        res = switch_text(src, stok, tgt, ttok, tr, text, source_cache=cache,
                          native_tail=16, source_tokens=source_tokens, recompute=0.0)
        mx.eval(first_step(tgt, res))

    def reprefill():
        c = prefill(tgt, target_ids)
        mx.eval([(x.keys, x.values) for x in c])

    runs = {**{name: (lambda tr=tr: switch(tr)) for name, tr in translators.items()},
            "re-prefill": reprefill}
    med = interleaved_medians(runs, rounds)
    out = {"tokens": tokens, "rounds": rounds, "median_s": med,
           "reprefill_over_switch": med["re-prefill"] / med["shipped now"]}
    if "previous" in med:
        out["shipped_over_previous"] = med["shipped now"] / med["previous"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old_dir", type=Path)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--note", default="", help="Conditions of the run, kept in the JSON.")
    args = ap.parse_args()
    out = {}
    for (source, target), name in SHIPPED.items():
        if {source, target} != {"smollm2", "gemma3"}:
            continue  # the SmolLM2 <-> Gemma 3 files only
        out[f"{source}->{target}"] = r = time_direction(
            source, target, args.old_dir / name, args.tokens, args.rounds)
        print(json.dumps({f"{source}->{target}": r}), flush=True)
    out["conditions"] = args.note
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Did a recompute's choice of words cover each recall item's answer, and what did
the item score when it did or did not? From `benchmarks/recall.py --json` files and
the target's tokenizer alone (no model runs): it separates what the selection
misses from what a recomputed fact still loses.

    python benchmarks/recall_coverage.py benchmarks/results/recall-2026-12-05-s2g-550-folded.json

The selection is recomputed as a switch makes it (`switching.recompute.salient_spans`
over the positions the switch translates: the translator's native prefix and tail
left out), for each recompute budget the run scored.
"""
import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import json
import re
import sys

from pathlib import Path

from mlx_kvlingo.measure.recall import DEFAULT_RECOMPUTE
from mlx_kvlingo.models.load import load
from mlx_kvlingo.pairs.shipped import translator_for
from mlx_kvlingo.switching.api import RecomputeBudget
from mlx_kvlingo.switching.recompute import salient_spans
from mlx_kvlingo.translator.align import tokenize_with_offsets


def run_translator(run: dict):
    """The run's translator (the shipped one, or its file while it exists; else None)."""
    path = None if run.get("translator", "shipped") == "shipped" else Path(run["translator"])
    if path is not None and not path.is_file():
        return None
    return translator_for(run["source"], run["target"], path)


def prefix_and_tail(translator):
    """Its native prefix and tail (without it, 1 and 16: what every translator here uses)."""
    return (1, 16) if translator is None else (translator.spec.native_prefix,
                                              translator.spec.native_tail)


def answer_positions(item: dict, offsets) -> list:
    """Target positions of the answer's value where the item states it: where it
    stands as a whole word in a fact sentence, else its first place in the context.
    A yes/no answer is said nowhere: its fact sentence instead."""
    answer = item["answer"].strip()
    if item["kind"] == "yesno":
        start, stop = item["fact"]
    else:
        pattern = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(answer)}(?![A-Za-z0-9_])")
        found = [m.start() for a, b in [item["fact"]] + list(item.get("more", []))
                 for m in pattern.finditer(item["context"], a, b)]
        start = found[0] if found else item["context"].index(answer)
        stop = start + len(answer)
    return [i for i, (a, b) in enumerate(offsets) if b > start and a < stop]


def covered_by(item: dict, positions: list, chosen: set) -> bool:
    """Whether the recompute took the answer (for yes/no: any word of its fact)."""
    if item["kind"] == "yesno":
        return any(p in chosen for p in positions)
    return all(p in chosen for p in positions)


# A setting's name: "switch + recompute 10%", with its cap: "... (at most 128)".
_BUDGET = re.compile(r"switch \+ recompute (\d+)%(?: \(at most (\d+)\))?")


def budgets(run: dict, translator) -> dict:
    """Each recompute setting of the run -> its RecomputeBudget (the translator's own
    for the default setting, when its file is at hand)."""
    out = {}
    for setting in run["scores"]:
        m = _BUDGET.fullmatch(setting)
        if m:
            out[setting] = RecomputeBudget(int(m.group(1)) / 100, int(m.group(2) or 0))
        elif setting == DEFAULT_RECOMPUTE and translator is not None:
            out[setting] = RecomputeBudget.of(translator)
    return out


def coverage(run: dict, tokenizer) -> str:
    translator = run_translator(run)
    lo, tail = prefix_and_tail(translator)
    lines = [f"## {run['source']} -> {run['target']}, ~{run.get('tokens', '?')} tokens, "
             f"{len(run['items'])} items", ""]
    for setting, budget in budgets(run, translator).items():
        table = {}
        for i, item in enumerate(run["items"]):
            prompt = item["context"] + item["cue"]
            ids, offsets = tokenize_with_offsets(tokenizer, prompt)
            spans = salient_spans(prompt, offsets, budget.positions(len(ids)), lo,
                                  len(ids) - 1 - tail)
            chosen = {p for a, b in spans for p in range(a, b)}
            covered = covered_by(item, answer_positions(item, offsets), chosen)
            row = table.setdefault((item["kind"], covered), [0, 0, 0])
            row[0] += 1
            row[1] += run["scores"]["native"][i]["exact"]
            row[2] += run["scores"][setting][i]["exact"]
        lines += [f"{setting}:", "",
                  "| kind | answer recomputed | items | re-prefill right | switch right |",
                  "|---|---|---|---|---|"]
        lines += [f"| {kind} | {'yes' if cov else 'no'} | {n} | {native} | {switched} |"
                  for (kind, cov), (n, native, switched) in sorted(table.items())]
        lines.append("")
    return "\n".join(lines)


def main(paths):
    tokenizers = {}
    for path in paths:
        run = json.loads(open(path).read())
        if run["target"] not in tokenizers:
            tokenizers[run["target"]] = load(run["target"])[1]
        print(coverage(run, tokenizers[run["target"]]))


if __name__ == "__main__":
    main(sys.argv[1:])

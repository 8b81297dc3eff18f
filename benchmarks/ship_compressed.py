"""Ship compressed SmolLM2 <-> Gemma 3 translators (made by `mlx-kvlingo compress`): the
maps are copied byte for byte; the metadata gets the switch defaults and the CBR measured
on these very files (`benchmarks/cbr_equal_time.py --json`), which replaces the evaluation
the uncompressed maps carried (kept as ``eval_uncompressed``).

    python benchmarks/ship_compressed.py --pair s2g --file s2g-fold-k512-v1024.safetensors \
        --cbr benchmarks/results/cbr-equal-time-2026-12-05-s2g-512-folded.json \
        --cbr benchmarks/results/cbr-equal-time-2026-12-05-s2g-stdlib-512-folded.json \
        --native-tail 16 --recompute 0.1 --recompute-max 128
"""

import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse
import json
from pathlib import Path

from mlx_kvlingo.pairs.shipped import ASSETS, SHIPPED
from mlx_kvlingo.switching.api import RecomputeBudget
from mlx_kvlingo.translator.maps import load_translator, rewrite_spec

PAIRS = {"s2g": ("smollm2", "gemma3"), "g2s": ("gemma3", "smollm2")}


def cbr_summary(path: Path):
    """(corpus, {"context C, native tail M": the switch's CBR with its interval and
    the equal-time truncation's}) from one cbr_equal_time.py JSON (its first
    translator: the file shipped): the layout of the uncompressed files' evaluation
    (ship_translators.py)."""
    run = json.loads(path.read_text())
    args = run["args"]
    rows = run["rows"]
    label, switch = next((label, r) for label, r in rows.items() if label.startswith("switch"))
    # the truncation timed against this switch (its label ends "equal time: last N)"),
    # not another translator's of the same run
    n = label.rsplit("last ", 1)[1].rstrip(")")
    equal = rows.get(f"last {n} (equal time)") or rows[f"last {n}"]
    key = f"context {args['context']}, native tail {args['native_tail']}"
    return args["corpus"], {key: {"cbr": round(switch["cbr"], 4),
                                  "cbr_ci95": [round(x, 4) for x in switch["cbr_ci95"]],
                                  "windows": len(switch["windows"]),
                                  "equal_time_truncation_cbr": round(equal["cbr"], 4),
                                  "source": path.name}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", choices=sorted(PAIRS), required=True)
    ap.add_argument("--file", type=Path, required=True, help="The compressed translator.")
    ap.add_argument("--cbr", type=Path, action="append", default=[],
                    help="cbr_equal_time.py JSON measured on this file; repeat.")
    ap.add_argument("--native-tail", type=int, default=16)
    ap.add_argument("--recompute", type=float, default=0.1)
    ap.add_argument("--recompute-max", type=int, default=128)
    ap.add_argument("--recompute-reserve", type=int, default=0,
                    help="positions the default share leaves out (RecomputeBudget)")
    args = ap.parse_args()
    t = load_translator(args.file)
    if not t.spec.shared_rank:
        ap.error(f"{args.file} is not a compressed translator.")
    budget = RecomputeBudget.of(t, args.recompute, args.recompute_max)
    spec = t.spec
    spec.native_tail, spec.recompute, spec.recompute_max = (args.native_tail, budget.share,
                                                            budget.most)
    spec.recompute_reserve = args.recompute_reserve if budget.share else 0
    training = spec.training
    training.pop("gate", None)  # the package adds its calibrated threshold at load
    if "eval" in training and "eval_uncompressed" not in training:
        training["eval_uncompressed"] = training.pop("eval")  # (compressed again: kept)
    training["eval"] = {}
    for path in args.cbr:
        corpus, rows = cbr_summary(path)
        training["eval"].setdefault(corpus, {}).update(rows)
    out = ASSETS / SHIPPED[PAIRS[args.pair]]
    rewrite_spec(args.file, out, spec)
    load_translator(out)
    print(f"{args.file} -> {out} ({out.stat().st_size / 2**20:.1f} MB)")


if __name__ == "__main__":
    main()

"""Stage-1 and stage-2 fidelity on the built-in pair, with paired-bootstrap intervals.

Fits a stage-1 translator source -> target on the pair's training documents
(toy.toy_corpus: stdlib docstrings rewritten so that passages and names recur),
distils it briefly (stage 2), and scores both on the same held-out windows (built
the same way from held-out docstrings). Writes benchmarks/results/builtin-pair.json
and .md; with --install, also the stage-2 translator the package ships
(mlx_kvlingo/assets/toy_pair/source-to-target.safetensors, used by the demo).

    python benchmarks/builtin_pair.py --install     # ~5-10 minutes on a 2-core CPU
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (first: fast BLAS)
from mlx_kvlingo import blas
from mlx_kvlingo.measure.bootstrap import (
    benefit_interval,
    cbr_interval,
    paired_cbr_difference,
    per_window_fidelity,
)
from mlx_kvlingo.models.load import load
from mlx_kvlingo.pairs import toy

RESULTS = Path(__file__).resolve().parent / "results"


def pooled(rows, key):
    n = sum(f.tokens for f in rows)
    return sum(getattr(f, key) * f.tokens for f in rows) / n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fit-tokens", type=int, default=100_000)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=toy.DISTILL_LR)
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--install", action="store_true", help="Write the shipped stage-2 translator.")
    p.add_argument("--pair", type=Path, default=None,
                   help="A pair directory (source/, target/) instead of the shipped pair, e.g. "
                   "benchmarks/assets/context-pair; results go to builtin-pair-<name>.*, "
                   "--install writes <pair>/source-to-target.safetensors.")
    p.add_argument("--reverse", action="store_true",
                   help="The other direction: target -> source (results *-reverse.*, "
                   "--install writes target-to-source.safetensors).")
    args = p.parse_args()

    if args.pair:
        src_dir, tgt_dir = args.pair / "source", args.pair / "target"
    else:
        src_dir, tgt_dir = toy.ensure_toy_pair(log=print)
    if args.reverse:
        src_dir, tgt_dir = tgt_dir, src_dir
    src, stok = load(src_dir)
    tgt, ttok = load(tgt_dir)
    pair = toy.toy_pair_data(stok)
    t0 = time.perf_counter()
    stage1, report = toy.fit_translator(src, stok, tgt, ttok, pair, args.fit_tokens)
    fit_s = time.perf_counter() - t0
    print(f"stage 1: {report.tokens} positions, {fit_s:.0f}s")
    t0 = time.perf_counter()
    stage2 = toy.distill_translator(src, tgt, stage1, pair, args.steps, args.lr, log=print)
    distill_s = time.perf_counter() - t0
    items = pair.heldout(args.context, 64, args.windows)
    t0 = time.perf_counter()
    rows1, rows2 = per_window_fidelity(pair, src, tgt, [stage1, stage2], items, args.context)
    eval_s = time.perf_counter() - t0

    result = {
        "pair": {"source": str(src_dir), "target": str(tgt_dir)},
        "text": "held-out recurring documents (toy.toy_corpus), disjoint source docstrings",
        "context_len": args.context, "continuation_len": 64, "windows": len(rows1),
        "nll_native": pooled(rows1, "nll_native"), "nll_none": pooled(rows1, "nll_none"),
        "context_benefit": benefit_interval(rows1).to_dict(),
        "stage1": {"fit_tokens": report.tokens, "seconds": fit_s,
                   "nll_translated": pooled(rows1, "nll_translated"),
                   "cbr": cbr_interval(rows1).to_dict(), "kl": pooled(rows1, "kl"),
                   "top1": pooled(rows1, "top1")},
        "stage2": {"steps": args.steps, "lr": args.lr, "batch_size": 4, "seconds": distill_s,
                   "nll_translated": pooled(rows2, "nll_translated"),
                   "cbr": cbr_interval(rows2).to_dict(), "kl": pooled(rows2, "kl"),
                   "top1": pooled(rows2, "top1")},
        "stage2_minus_stage1_cbr": paired_cbr_difference(rows1, rows2).to_dict(),
        "eval_seconds": eval_s,
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, BLAS: "
                   f"{blas.preload_status}",
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    RESULTS.mkdir(exist_ok=True)
    name = "builtin-pair" + (f"-{args.pair.name.removesuffix('-pair')}" if args.pair else "")
    name += "-reverse" if args.reverse else ""
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
    (RESULTS / f"{name}.md").write_text(markdown(result))
    print(markdown(result))
    if args.install:
        out = (args.pair if args.pair else toy.ASSET_DIR) / (
            "target-to-source.safetensors" if args.reverse else "source-to-target.safetensors")
        stage2.save(out)
        print(f"Wrote {out}")


def markdown(r) -> str:
    b, d = r["context_benefit"], r["stage2_minus_stage1_cbr"]
    pct = lambda i: f"{i['value']:.1%} [{i['low']:.1%}, {i['high']:.1%}]"  # noqa: E731
    lines = [
        "# Built-in pair: stage 1 vs stage 2",
        "",
        f"{r['windows']} held-out windows, {r['context_len']}-token context, "
        f"{r['continuation_len']}-token continuation; {r['text']}.",
        f"Target NLL per token: re-prefill {r['nll_native']:.3f}, no context {r['nll_none']:.3f}; "
        f"context benefit {b['value']:.3f} [{b['low']:.3f}, {b['high']:.3f}] nats/token.",
        "Intervals: 95 % bootstrap over windows (2,000 resamples); the difference is paired "
        "(same windows, same resamples).",
        "",
        "| translator | NLL translated | CBR [95 % CI] | KL | top-1 |",
        "|---|---|---|---|---|",
    ]
    for key, name in (("stage1", f"stage 1 ({r['stage1']['fit_tokens']} positions)"),
                      ("stage2", f"stage 2 ({r['stage2']['steps']} steps, lr {r['stage2']['lr']:g})")):
        s = r[key]
        lines.append(f"| {name} | {s['nll_translated']:.3f} | {pct(s['cbr'])} | {s['kl']:.3f} | "
                     f"{s['top1']:.1%} |")
    lines += [
        "",
        f"Stage 2 minus stage 1, CBR: {d['value'] * 100:+.1f} points "
        f"[{d['low'] * 100:+.1f}, {d['high'] * 100:+.1f}].",
        "",
        f"Times (load average at the end {r.get('load_average')}): fit "
        f"{r['stage1']['seconds']:.0f}s, distillation {r['stage2']['seconds']:.0f}s, "
        f"evaluation {r['eval_seconds']:.0f}s. {r['machine']}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

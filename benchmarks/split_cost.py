"""What choosing the split per switch costs: a switch with the file's defaults (which
reads the source's reach and takes the long tail for text that goes on) against the
same switch told its tail and budget (the defaults without the long tail: nothing to
decide), to its first token, on recall items (questions) and on windows of text
that goes on, timed interleaved in one process beside the target's re-prefill.

    python benchmarks/split_cost.py --source smollm2 --target gemma3 --tokens 550 \
        --items 12 --windows 12 --json out.json

Per context: the path the defaults took (``long``: the long tail; ``defaults``),
and each switch's median seconds as a share of the re-prefill's; then the medians
over the contexts of each kind and path, and the paired difference (defaults - told).
"""
import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from cbr_defaults import windows  # this folder's
from switch_cost_shipped import interleaved_medians  # this folder's

from mlx_kvlingo.data.recall import PLAIN_KINDS, heldout_filler, recall_items
from mlx_kvlingo.measure.ttft import environment
from mlx_kvlingo.models.cache import last_logits, prefill
from mlx_kvlingo.models.load import load_pair
from mlx_kvlingo.pairs.shipped import load_shipped
from mlx_kvlingo.switching.api import switch_text
from mlx_kvlingo.switching.generate import first_step
from mlx_kvlingo.translator.align import tokenize_with_offsets
from mlx_kvlingo.translator.maps import load_translator


def time_context(src, stok, tgt, ttok, translator, text: str, rounds: int) -> dict:
    """Medians (s) of the defaults' switch, the told switch and the re-prefill on one
    context, interleaved; and the path the defaults took."""
    source_tokens = tokenize_with_offsets(stok, text)
    cache = prefill(src, mx.array(source_tokens[0])[None])
    mx.eval([(c.keys, c.values) for c in cache])
    ids = tokenize_with_offsets(ttok, text)[0]
    spec = translator.spec
    told = dict(native_tail=spec.native_tail, recompute=spec.recompute,
                recompute_max=spec.recompute_max)
    path = None

    def switched(**kw):
        nonlocal path
        result = switch_text(src, stok, tgt, ttok, translator, text, source_cache=cache,
                             source_tokens=source_tokens, **kw)
        if not kw:
            path = "long" if result.prompt.size == spec.long_tail + 1 else "defaults"
        first_step(tgt, result)

    def reprefill():
        mx.eval(last_logits(tgt, mx.array([ids[-1:]]), prefill(tgt, mx.array(ids[:-1])[None])))

    runs = {"defaults": switched, "told": lambda: switched(**told), "re-prefill": reprefill}
    med = interleaved_medians(runs, rounds)
    return {"path": path, **{k: med[k] / med["re-prefill"] for k in ("defaults", "told")},
            "re-prefill_s": med["re-prefill"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="smollm2")
    ap.add_argument("--target", default="gemma3")
    ap.add_argument("--translator", type=Path, default=None, help="default: the shipped one")
    ap.add_argument("--tokens", type=int, default=550)
    ap.add_argument("--items", type=int, default=12, help="plain-word recall items")
    ap.add_argument("--windows", type=int, default=12, help="windows of quotations and verse")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    src, stok, tgt, ttok = load_pair(args.source, args.target)
    t = (load_shipped(args.source, args.target) if args.translator is None
         else load_translator(args.translator))
    if not t.spec.long_tail:
        raise SystemExit("This file has no long tail: nothing to choose.")
    contexts = [("question", item.prompt) for item in recall_items(
        heldout_filler(), args.items, args.tokens, lambda x: len(ttok.encode(x)),
        kinds=list(PLAIN_KINDS), seed=args.seed)]
    contexts += [("text", text) for text, _ in windows(
        ttok, "fortunes", args.tokens, 64, args.windows, args.seed)]
    rows = []
    for i, (kind, text) in enumerate(contexts):
        rows.append({"kind": kind, **time_context(src, stok, tgt, ttok, t, text, args.rounds)})
        print(f"\r{i + 1}/{len(contexts)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    table = {}
    print(f"{args.source} -> {args.target}, ~{args.tokens} tokens, medians of {args.rounds}; "
          "shares of the re-prefill\n\n| contexts | path | n | defaults | told | defaults - told "
          "(paired median) |\n|---|---|---|---|---|---|")
    for kind in ("question", "text"):
        for path in ("defaults", "long"):
            mine = [r for r in rows if r["kind"] == kind and r["path"] == path]
            if not mine:
                continue
            d = np.array([r["defaults"] for r in mine])
            o = np.array([r["told"] for r in mine])
            table[f"{kind}, {path}"] = {"n": len(mine), "defaults": float(np.median(d)),
                                        "told": float(np.median(o)),
                                        "difference": float(np.median(d - o))}
            print(f"| {kind} | {path} | {len(mine)} | {np.median(d):.3f} | {np.median(o):.3f} | "
                  f"{np.median(d - o):+.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"environment": environment(),
                                         "command": " ".join(sys.argv),
                                         "args": {k: str(v) for k, v in vars(args).items()},
                                         "table": table, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

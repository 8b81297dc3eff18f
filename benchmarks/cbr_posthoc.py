"""Post-hoc corrections of a translated cache, scored by context-benefit retention
(CBR) of the translation alone (no native tail, no recompute) on text no translator
was trained on: does a cheap correction at switch time keep more of the context?

- ``key=B``: translated keys times B (a temperature on the attention they get);
- ``shrink=A``: translated values pulled toward their mean over the window, A of
  each row kept (what a least-squares map overshoots off its training text);
- ``shift=T``: translated values moved by their mean error on the last T positions,
  measured against the target's own values there (what a native tail of T would
  show the switch about this text; the target's full prefill gives them here).

    python benchmarks/cbr_posthoc.py --source smollm2 --target gemma3 \
        --windows 48 --json out.json

The windows are cbr_defaults.py's (the same seed gives the same windows); each
correction is paired against the plain translation on them.
"""
import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from cbr_defaults import cbr, nll, read_after, resampled, windows  # this folder's

from mlx_kvlingo.measure.ttft import environment
from mlx_kvlingo.models.cache import prefill
from mlx_kvlingo.models.load import load_pair
from mlx_kvlingo.pairs.shipped import load_shipped
from mlx_kvlingo.switching.api import switch_text
from mlx_kvlingo.translator.align import tokenize_with_offsets

PLAIN = "translation alone"
CORRECTIONS = ("key=0.9", "key=1.1", "shrink=0.9", "shrink=0.8", "shift=64", "shift=128")


def corrected(cache, native, correction: str):
    """Apply one correction to the translated rows (1..offset-1: row 0 is the
    target's own native prefix) of each layer of ``cache``, in place."""
    kind, _, value = correction.partition("=")
    for c, own in zip(cache, native):
        n = c.offset
        k, v = c.keys, c.values
        rows = slice(1, n)
        if kind == "key":
            k = mx.concatenate([k[:, :, :1], k[:, :, rows] * float(value), k[:, :, n:]], axis=2)
        elif kind == "shrink":
            a = float(value)
            mean = v[:, :, rows].mean(axis=2, keepdims=True)
            v = mx.concatenate([v[:, :, :1], a * v[:, :, rows] + (1 - a) * mean, v[:, :, n:]],
                               axis=2)
        elif kind == "shift":
            m = min(n, own.shape[2])
            lo = max(m - int(value), 1)
            shift = (own[:, :, lo:m] - v[:, :, lo:m]).mean(axis=2, keepdims=True)
            v = mx.concatenate([v[:, :, :1], v[:, :, rows] + shift, v[:, :, n:]], axis=2)
        else:
            raise SystemExit(f"unknown correction {correction!r}")
        c.keys, c.values = k, v


def score_window(src, stok, tgt, ttok, translator, text, continuation, corrections):
    ids = tokenize_with_offsets(ttok, text)[0]
    source_tokens = tokenize_with_offsets(stok, text)
    source_cache = prefill(src, mx.array(source_tokens[0])[None])
    mx.eval([(c.keys, c.values) for c in source_cache])
    own = prefill(tgt, mx.array(ids[:-1])[None])
    own_values = [c.values[:, :, :c.offset] for c in own]
    out = {"re-prefill": read_after(tgt, own, ids[-1:], continuation)}
    bos = getattr(ttok, "bos_token_id", None)
    specials = ids[:1] if bos is not None and ids[0] == bos else []
    out["no context"] = np.concatenate([[np.nan], read_after(
        tgt, None, specials + continuation[:1], continuation[1:])])
    for name in (PLAIN,) + tuple(corrections):
        result = switch_text(src, stok, tgt, ttok, translator, text, source_cache=source_cache,
                             source_tokens=source_tokens, native_tail=0, recompute=0.0)
        if name != PLAIN:
            corrected(result._cache, own_values, name)
        logits = result.read(tgt, extra=continuation[:-1], keep=len(continuation))[0]
        out[name] = nll(logits, continuation)
    return {k: v[1:] for k, v in out.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="smollm2")
    ap.add_argument("--target", default="gemma3")
    ap.add_argument("--corpus", default="fortunes")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--continuation", type=int, default=64)
    ap.add_argument("--windows", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--correction", action="append", default=None,
                    help=f"repeatable; default: {', '.join(CORRECTIONS)}")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    corrections = tuple(args.correction or CORRECTIONS)
    src, stok, tgt, ttok = load_pair(args.source, args.target)
    translator = load_shipped(args.source, args.target)
    items = windows(ttok, args.corpus, args.context, args.continuation, args.windows, args.seed)
    rows = []
    for i, (text, continuation) in enumerate(items):
        rows.append(score_window(src, stok, tgt, ttok, translator, text, continuation,
                                 corrections))
        print(f"  window {i + 1}/{len(items)}: " + " ".join(
            f"{k} {cbr(rows, k):.1%}" for k in (PLAIN,) + corrections), flush=True)
    table = {}
    print(f"\n| {args.source} -> {args.target}, {args.corpus}, {args.context} | CBR | "
          f"minus the plain translation, paired |\n|---|---|---|")
    for name in (PLAIN,) + corrections:
        value = cbr(rows, name)
        diff = [value - cbr(rows, PLAIN)] + resampled(rows, name, PLAIN) if name != PLAIN else None
        table[name] = {"cbr": value, "minus_plain": diff}
        diff_text = f"{diff[0]:+.1%} [{diff[1]:+.1%}, {diff[2]:+.1%}]" if diff else ""
        print(f"| {name} | {value:.1%} | {diff_text} |")
    if args.json:
        args.json.write_text(json.dumps({
            "environment": environment(), "command": " ".join(sys.argv),
            "args": {k: str(v) for k, v in vars(args).items()}, "windows": len(rows),
            "table": table}, indent=1))
        print(f"Wrote {args.json}")


if __name__ == "__main__":
    main()

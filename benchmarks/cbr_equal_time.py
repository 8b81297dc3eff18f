"""Context-benefit retention (CBR) of translators on held-out windows, beside the target
re-prefilling only its last N context tokens: N = 16 / 64 / 128 / 256 and the
*equal-time* N of each translator, whose re-prefill takes as long as that
translator's switch (native tail and first step included), timed in the same run.

    python benchmarks/cbr_equal_time.py --source smollm2 --target gemma3 \
        --translator A.safetensors --translator B.safetensors --corpus austen \
        --context 512 --windows 48 --json out.json

Default translator: the shipped one. The times are medians of interleaved rounds on
Austen text of the same length (a switch's time does not depend on what it reads).
"""
import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
from switch_cost_shipped import austen_text, interleaved_medians  # this folder's

from mlx_kvlingo.measure.evaluate import evaluate_pair
from mlx_kvlingo.measure.recall import equal_time_tokens, truncated_ids
from mlx_kvlingo.measure.ttft import environment
from mlx_kvlingo.models.cache import last_logits, prefill
from mlx_kvlingo.models.load import load_pair
from mlx_kvlingo.pairs.shipped import load_shipped
from mlx_kvlingo.switching.api import switch_text
from mlx_kvlingo.switching.generate import first_step
from mlx_kvlingo.train.samples import pair_data
from mlx_kvlingo.translator.align import tokenize_with_offsets
from mlx_kvlingo.translator.maps import load_translator

FIXED = (16, 64, 128, 256)


def switch_times(src, stok, tgt, ttok, translators, tokens: int, tail: int, rounds: int):
    """Median seconds of each translator's switch (from the source's cache) and of
    re-prefilling the last n tokens, for each n in FIXED and the whole context."""
    text = austen_text(ttok, tokens)
    source_tokens = tokenize_with_offsets(stok, text)
    cache = prefill(src, mx.array(source_tokens[0])[None])
    mx.eval([(c.keys, c.values) for c in cache])
    ids = tokenize_with_offsets(ttok, text)[0]
    bos = getattr(ttok, "bos_token_id", None)

    def switched(translator):
        first_step(tgt, switch_text(src, stok, tgt, ttok, translator, text, source_cache=cache,
                                    native_tail=tail, source_tokens=source_tokens,
                                    recompute=0.0))  # as scored: the translation alone

    def reprefill(n):
        kept = mx.array(truncated_ids(ids, n, bos))[None]
        c = prefill(tgt, kept[:, :-1])
        mx.eval(last_logits(tgt, kept[:, -1:], c))

    runs = {("switch", i): (lambda t=t: switched(t)) for i, t in enumerate(translators)}
    runs.update({n: (lambda n=n: reprefill(n)) for n in FIXED + (len(ids),)})
    med = interleaved_medians(runs, rounds)
    return [med.pop(("switch", i)) for i in range(len(translators))], med


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="smollm2")
    ap.add_argument("--target", default="gemma3")
    ap.add_argument("--translator", type=Path, action="append", default=None)
    ap.add_argument("--corpus", default="austen")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--continuation", type=int, default=64)
    ap.add_argument("--windows", type=int, default=48)
    ap.add_argument("--native-tail", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    src, stok, tgt, ttok = load_pair(args.source, args.target)
    paths = args.translator or [None]
    translators = [load_shipped(args.source, args.target) if p is None else load_translator(p)
                   for p in paths]
    switch_s, prefill_s = switch_times(src, stok, tgt, ttok, translators, args.context,
                                       args.native_tail, args.rounds)
    n_eq = [min(equal_time_tokens(prefill_s, s), args.context - 1) for s in switch_s]
    print(f"switch {switch_s} s; re-prefill {prefill_s}; equal-time N {n_eq}", flush=True)
    pair = pair_data(args.corpus, stok, ttok)
    items = pair.heldout(args.context, args.continuation, args.windows)
    fixed = tuple(n for n in FIXED if n < args.context)
    equal = sorted(set(n_eq) - set(fixed))
    rows = evaluate_pair(pair, src, tgt, translators, items, args.context,
                         (args.native_tail,), fixed + tuple(equal))
    labels = [f"switch: {p or 'shipped'} ({s / prefill_s[max(prefill_s)]:.2f} of the "
              f"re-prefill's time, equal time: last {n})"
              for p, s, n in zip(paths, switch_s, n_eq)]
    labels += [f"last {n}" for n in fixed] + [f"last {n} (equal time)" for n in equal]
    out = {"environment": environment(), "args": {k: str(v) for k, v in vars(args).items()},
           "switch_s": switch_s, "prefill_s": {str(k): v for k, v in prefill_s.items()},
           "equal_time_tokens": n_eq,
           "rows": {label: r.to_dict() for label, r in zip(labels, rows)}}
    print("| setting | CBR | 95% CI | KL | top-1 |\n|---|---|---|---|---|")
    for label, r in zip(labels, rows):
        lo, hi = r.cbr_interval()
        print(f"| {label} | {r.cbr:.1%} | [{lo:.1%}, {hi:.1%}] | {r.kl:.3f} | {r.top1:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

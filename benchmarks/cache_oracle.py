"""Where does a translated cache lose the context's benefit? Oracle swaps.

Per held-out window: the target's continuation NLL from no context, from its own
cache ("native"), from the translated cache (with a native tail), and from the
translated cache with some of its layers' keys and/or values overwritten by the
target's own ("oracle" variants). A variant that recovers most of the lost benefit
names the part of the cache the translator gets wrong. Every continuation token is
also put in one of three classes, by what the context holds:

- ``bigram``: the (previous, this) token pair occurs in the context: the token
  can be copied (what induction heads do);
- ``token``: the token occurs in the context, not after the same previous token;
- ``new``: it does not occur in the context.

CBR is reported per variant, overall and per class (pooled over windows, as
``mlx-kvlingo eval`` pools it), with each class's share of the benefit the
translated cache loses.

    python benchmarks/cache_oracle.py --source smollm2 --target gemma3 \\
        --windows 24 --context-len 384 --native-tail 16 [--groups 6] [--json OUT]

Contexts must fit every sliding window of the target (the swap copies cache rows
position by position): 384 tokens for Gemma 3 (window 512). The translator is the
shipped one unless ``--translator`` names a file.
"""

import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_kvlingo.measure.evaluate import continuation_logprobs
from mlx_kvlingo.models.cache import prefill
from mlx_kvlingo.models.load import load_pair
from mlx_kvlingo.pairs.shipped import load_shipped
from mlx_kvlingo.switching.api import translate_aligned
from mlx_kvlingo.train.samples import pair_data
from mlx_kvlingo.translator.maps import load_translator

CLASSES = ("bigram", "token", "new")


def oracle_variants(target, groups: int):
    """{name: [(kind, layer), ...]}: which cache arrays each variant takes from the
    target's own cache."""
    n = len(target.layers)
    full = [i for i in range(n) if not getattr(target.layers[i].self_attn, "is_sliding", False)]
    variants = {"translated": [], "native keys": [("k", i) for i in range(n)],
                "native values": [("v", i) for i in range(n)]}
    if 0 < len(full) < n:  # a model mixing sliding-window and full-attention layers
        variants[f"native K+V, full-attention layers {full}"] = [(x, i) for i in full for x in "kv"]
        variants[f"native keys, full-attention layers {full}"] = [("k", i) for i in full]
    for g in range(0, n, groups) if groups else ():
        layers = range(g, min(g + groups, n))
        variants[f"native K+V, layers {g}-{layers[-1]}"] = [(x, i) for i in layers for x in "kv"]
    return variants


def token_classes(context, continuation):
    bigrams, tokens = set(zip(context[:-1], context[1:])), set(context)
    seq = [context[-1]] + list(continuation)
    return ["bigram" if (seq[t], seq[t + 1]) in bigrams else "token" if seq[t + 1] in tokens
            else "new" for t in range(len(continuation))]


def swap_in(cache, native_cache, swaps, n: int):
    """Overwrite positions 0..n-1 of the listed layers' keys/values with the target's own."""
    for kind, i in swaps:
        if cache[i].offset != native_cache[i].offset:
            raise SystemExit(f"layer {i}: caches hold different positions (a sliding window "
                             "rotated?): use a shorter --context-len")
        dst = cache[i].keys if kind == "k" else cache[i].values
        src = native_cache[i].keys if kind == "k" else native_cache[i].values
        dst[..., :n, :] = src[..., :n, :]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--translator", type=Path, help="default: the shipped translator")
    ap.add_argument("--corpus", default="stdlib")
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--context-len", type=int, default=384)
    ap.add_argument("--continuation-len", type=int, default=48)
    ap.add_argument("--native-tail", type=int, default=16)
    ap.add_argument("--groups", type=int, default=0, help="also swap layers in groups of N")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    src, stok, tgt, ttok = load_pair(args.source, args.target)
    tr = load_translator(args.translator) if args.translator else load_shipped(args.source, args.target)
    items = pair_data(args.corpus, stok, ttok).heldout(
        args.context_len, args.continuation_len, args.windows)
    variants = oracle_variants(tgt, args.groups)
    sums = {v: dict.fromkeys(CLASSES, 0.0) for v in ["none", "native", *variants]}
    counts = dict.fromkeys(CLASSES, 0)
    for w, s in enumerate(items):
        a = s.alignment
        context, cont = mx.array(a.target_tokens)[None], mx.array(s.continuation)[None]
        n = context.shape[1] - 1

        def nll(cache):
            return np.array(nll(continuation_logprobs(tgt, context, cont, cache), cont)[0])

        nll_of = {"native": nll(prefill(tgt, context[:, :-1])),
                  "none": nll(prefill(tgt, context[:, : s.special_prefix])
                              if s.special_prefix else None)}
        source_cache = prefill(src, mx.array(a.source_tokens)[None])
        # Read, never run on (scoring appends the continuation): one prefill serves
        # every variant's swaps.
        own_cache = prefill(tgt, context[:, :-1])
        for name, swaps in variants.items():
            cache = translate_aligned(src, tgt, tr, source_cache, None, a, n,
                                      native_tail=args.native_tail)
            if swaps:
                swap_in(cache, own_cache, swaps, n)
            nll_of[name] = nll(cache)
        for t, c in enumerate(token_classes(a.target_tokens, s.continuation)):
            counts[c] += 1
            for v, x in nll_of.items():
                sums[v][c] += float(x[t])
        print(f"window {w + 1}/{len(items)}", flush=True)

    def cbr(v, classes=CLASSES):
        none = sum(sums["none"][c] for c in classes)
        return (none - sum(sums[v][c] for c in classes)) / (
            none - sum(sums["native"][c] for c in classes))

    lost = {c: sums["translated"][c] - sums["native"][c] for c in CLASSES}
    print(f"\n{args.source} -> {args.target}, {args.corpus}, {len(items)} windows of "
          f"{args.context_len} tokens, native tail {args.native_tail}; tokens per class: "
          + ", ".join(f"{c} {counts[c]}" for c in CLASSES))
    print("share of the lost benefit: " + ", ".join(
        f"{c} {lost[c] / sum(lost.values()):.0%}" for c in CLASSES))
    print("\n| cache | CBR | " + " | ".join(CLASSES) + " |\n|---|---|" + "---|" * len(CLASSES))
    for v in variants:
        print(f"| {v} | {cbr(v):.1%} | " + " | ".join(f"{cbr(v, [c]):.1%}" for c in CLASSES) + " |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(x) for k, x in vars(args).items()},
                                         "counts": counts, "nll_sums": sums}, indent=2))


if __name__ == "__main__":
    main()

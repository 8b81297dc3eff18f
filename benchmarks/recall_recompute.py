"""Recall after a switch with a few context positions recomputed by the target, by
how the positions are chosen, paired on the same items:

- ``switch``: the plain switch (the shipped translator, its native tail);
- ``fact (oracle)``: the fact's sentence recomputed (the item says where it is: an
  upper bound no real switch has, since it does not know the question);
- ``lexical B%``: tokens that look like facts (digits, identifiers, capitalised
  words inside a sentence), each with a few tokens before it, up to B % of the
  context;
- ``layer-0 B%``: the tokens whose translated layer-0 keys are farthest from the
  target's own (exact and cheap: layer 0 depends only on the token), up to B %.

    python benchmarks/recall_recompute.py --source gemma3 --target smollm2 --items 24
"""

import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse
import json
import re
import sys
from pathlib import Path

import mlx.core as mx

from mlx_kvlingo.data.recall import recall_items
from mlx_kvlingo.measure.bootstrap import mean_interval, paired_mean_difference
from mlx_kvlingo.measure.recall import (
    answer_tokens,
    native_state,
    read_source,
    score_state,
    switch_state,
)
from mlx_kvlingo.measure.ttft import environment
from mlx_kvlingo.models.cache import read_layer
from mlx_kvlingo.models.features import layer0_kv
from mlx_kvlingo.models.load import load_pair
from mlx_kvlingo.pairs.shipped import translator_for
from mlx_kvlingo.switching.recompute import merge_spans, recompute_spans
from mlx_kvlingo.translator.align import tokenize_with_offsets

sys.path.insert(0, str(Path(__file__).parent))
from recall import heldout_filler  # noqa: E402


def fact_span(item, offsets):
    """Target positions of the fact's sentence (the item knows where it put it)."""
    value = item.answer.strip()
    at = item.context.index(value)
    start = max(item.context.rfind(". ", 0, at) + 2, item.context.rfind("\n", 0, at) + 1, 0)
    end = item.context.find(".", at + len(value))
    end = len(item.context) if end < 0 else end + 1
    return [i for i, (a, b) in enumerate(offsets) if b > start and a < end]


FACT_LIKE = re.compile(r"\d|_|[a-z][A-Z]")


def lexical_positions(ids, offsets, text, budget):
    """Tokens that look like facts, ranked: digits and identifiers, then
    capitalised words not at a sentence start; the first ``budget`` by rank."""
    ranked = []
    for i, (a, b) in enumerate(offsets):
        piece = text[a:b]
        if not piece.strip():
            continue
        before = text[max(a - 3, 0):a]
        if FACT_LIKE.search(piece):
            ranked.append((0, i))
        elif piece.strip()[0].isupper() and not re.search(r"[.!?\n]\s*$|^$", before):
            ranked.append((1, i))
    return [i for _, i in sorted(ranked)[:budget]]


def layer0_positions(target, cache, ids, budget, start=1):
    """The positions whose translated layer-0 keys differ most from the target's own."""
    keys, _, first = read_layer(cache[0])
    n = keys.shape[2]
    native, _ = layer0_kv(target, mx.array(ids[first:first + n])[None], first)
    err = (mx.linalg.norm((keys - native).astype(mx.float32), axis=(1, 3))
           / (mx.linalg.norm(native.astype(mx.float32), axis=(1, 3)) + 1e-6))[0]
    order = mx.argsort(-err).tolist()
    return [first + i for i in order if first + i >= start][:budget]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", default="gemma3")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--tokens", type=int, default=550)
    p.add_argument("--items", type=int, default=24)
    p.add_argument("--budgets", default="0.05,0.1")
    p.add_argument("--before", type=int, default=4, help="tokens recomputed before each chosen one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    translator = translator_for(args.source, args.target, None)
    src, stok, tgt, ttok = load_pair(args.source, args.target, log=print)
    items = recall_items(heldout_filler(), args.items, args.tokens,
                         lambda text: len(ttok.encode(text)), seed=args.seed)
    budgets = [float(b) for b in args.budgets.split(",")]
    scores, recomputed = {}, {}

    def add(name, score, n=0):
        scores.setdefault(name, []).append(score)
        recomputed.setdefault(name, []).append(n)

    for k, item in enumerate(items):
        ids, offsets = tokenize_with_offsets(ttok, item.prompt)
        answer = answer_tokens(ttok, ids, item.prompt, item.answer)
        cache, pending, s = native_state(tgt, ids)
        add("native", score_state(tgt, ttok, cache, pending, answer, item.answer, s))
        read = read_source(src, stok, translator, item.prompt)

        def switched(select=None):
            cache, pending, s = switch_state(src, stok, tgt, ttok, translator, item.prompt,
                                             read=read)
            end = len(ids) - len(pending)  # translated positions end here
            spans = merge_spans(select(cache, end), before=args.before, gap=2, hi=end) \
                if select else []
            s += recompute_spans(tgt, cache, ids, spans)
            n = sum(b - a for a, b in spans)
            return score_state(tgt, ttok, cache, pending, answer, item.answer, s), n

        add("switch", *switched())
        add("fact (oracle)", *switched(lambda c, end: fact_span(item, offsets)))
        for b in budgets:
            n = int(b * len(ids) / (1 + args.before))  # chosen tokens, each widened
            add(f"lexical {b:.0%}", *switched(
                lambda c, end: lexical_positions(ids, offsets, item.prompt, n)))
            add(f"layer-0 {b:.0%}", *switched(lambda c, end: layer0_positions(tgt, c, ids, n)))
        print(f"item {k + 1}/{len(items)} {item.kind}: " + ", ".join(
            f"{name} {'+' if v[-1].exact else '-'}" for name, v in scores.items()), flush=True)

    print(f"\n{args.source} -> {args.target}, {len(items)} items, ~{args.tokens} tokens")
    print("| setting | exact [95% CI] | vs switch | answer NLL | TTFT | recomputed |")
    print("|---|---|---|---|---|---|")
    base = [float(s.exact) for s in scores["switch"]]
    summary = {}
    for name, v in scores.items():
        e = mean_interval([float(s.exact) for s in v])
        d = paired_mean_difference(base, [float(s.exact) for s in v])
        nll = sum(s.answer_nll for s in v) / len(v)
        ttft = sorted(s.ttft_s for s in v)[len(v) // 2]
        rec = sum(recomputed[name]) / len(v)
        summary[name] = dict(exact=e.to_dict(), vs_switch=d.to_dict(), answer_nll=nll,
                             ttft_s=ttft, recomputed=rec)
        print(f"| {name} | {e.value:.2f} [{e.low:.2f}, {e.high:.2f}] | "
              f"{d.value:+.2f} [{d.low:+.2f}, {d.high:+.2f}] | {nll:.2f} | {ttft * 1e3:.0f} ms "
              f"| {rec:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(dict(summary=summary, environment=environment(),
                                             command=" ".join(sys.argv)), indent=2))


if __name__ == "__main__":
    main()

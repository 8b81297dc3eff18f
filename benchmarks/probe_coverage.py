"""Which reading of the question finds the answer: how often the positions a
switch's question probe chooses cover the answer's tokens, per way of reading
(no generation, no timing of answers: the choice alone).

Per held-out recall item (``data.recall``), the shipped translator's switch, and
its default budget of positions chosen by the question alone (no fact-like words):

- ``tail``: the native tail and the last token read on the translated cache, the
  last token's attention scoring (what a one-shot switch did before); beside it the
  same reading averaged per position over the layers that see it (a target with
  sliding-window layers);
- ``last token``: the last token alone, on a copy of the cache with the tail
  translated too (cheaper: one token read instead of 17);
- ``first K`` / ``last K`` layers: the last-token reading scored over K of the
  target's layers only (could a probe stop early?);
- ``source``: the source reading its last token on its own cache (select
  "source", query.source_scores), and beside it that reading summed over the
  source's full-attention layers only, and averaged per position over the layers
  that see it (what select "source" does).

An item counts when any of its answer's tokens (else its fact sentence's) is among
the chosen positions. (The last token alone chose the answer as often as the tail,
yet answered fewer "who gave what to whom" items at ~1,100 tokens: the tail's
native reading is kept; see docs/design.md.) The probe's own time (median, ms) is given for the two ways
of reading.

    python benchmarks/probe_coverage.py --source smollm2 --target gemma3 \\
        --tokens 550 --items 48 --kinds plain --json out.json
"""
import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_kvlingo.data.recall import heldout_filler, recall_items
from mlx_kvlingo.measure.recall import fact_positions, read_source, switch_state
from mlx_kvlingo.models.load import load_pair
from mlx_kvlingo.pairs.shipped import translator_for
from mlx_kvlingo.models.cache import copy_cache
from mlx_kvlingo.switching import query
from mlx_kvlingo.switching.kernel import translate_into
from mlx_kvlingo.switching.choice import RecomputeBudget
from mlx_kvlingo.translator.align import tokenize_with_offsets

LAYER_COUNTS = (2, 4, 6, 8, 10, 12, 14)


class _PerLayer:
    """Records, per layer of a probe, the largest attention over heads that the
    question's last token gives each context position (query._ScoringAttention's
    score before its sum over layers)."""

    def __init__(self):
        self.rows = []
        self.original = query._ScoringAttention.__call__

    def __enter__(self):
        rows, original = self.rows, self.original

        def call(att, queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
            n = len(att.totals)
            out = original(att, queries, keys, values, cache, scale, mask, sinks)
            rows.append(att.totals[n])
            return out

        query._ScoringAttention.__call__ = call
        return self

    def __exit__(self, *exc):
        query._ScoringAttention.__call__ = self.original


def answer_positions(item, offsets):
    ans = item.answer.strip().lower()
    out = []
    for a, b in item.facts:
        j = item.context.lower().find(ans, a, b)
        if j >= 0:
            out += [i for i, (x, y) in enumerate(offsets) if y > j and x < j + len(ans)]
    return out or fact_positions(item, offsets)


def covered(scores, count, lo, hi, answer) -> bool:
    spans = query.question_spans(np.asarray(scores), count, lo, hi)
    return any(a <= p < b for a, b in spans for p in answer)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", default="smollm2")
    p.add_argument("--target", default="gemma3")
    p.add_argument("--tokens", type=int, default=550)
    p.add_argument("--items", type=int, default=48)
    p.add_argument("--kinds", default="plain")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    src, stok, tgt, ttok = load_pair(args.source, args.target, log=print)
    t = translator_for(args.source, args.target, None)
    items = recall_items(heldout_filler(), args.items, args.tokens,
                         lambda x: len(ttok.encode(x)), kinds=args.kinds.split(","),
                         seed=args.seed)
    budget = RecomputeBudget.of(t)
    hits, times = {}, {"tail": [], "last token": [], "source": []}
    for k, item in enumerate(items):
        ids, offsets = tokenize_with_offsets(ttok, item.prompt)
        n, lo = len(ids), max(t.spec.native_prefix, 1)
        end = n - 1 - t.spec.native_tail
        answer, count = answer_positions(item, offsets), budget.positions(n)
        read = read_source(src, stok, t, item.prompt)
        state = switch_state(src, stok, tgt, ttok, t, item.prompt, None, read, 0.0, 0)
        t0 = time.perf_counter()
        tail = query.question_scores(tgt, state._cache, ids, end, lo, state.history,
                                     per_layer_seen=False)
        times["tail"].append(time.perf_counter() - t0)
        tail_seen = query.question_scores(tgt, state._cache, ids, end, lo, state.history)
        source_cache, source_tokens = read
        alignment = state_alignment(stok, ttok, t, item.prompt, source_tokens)
        tokens = mx.array([ids])
        with _PerLayer() as per_layer:
            t0 = time.perf_counter()
            probed = tail_translated(src, tgt, t, source_cache, alignment, tokens,
                                     state._cache, end)
            last = query.question_scores(tgt, probed, ids, n - 1, lo, state.history,
                                         per_layer_seen=False)
            times["last token"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with _PerLayer() as source_layers:
            by_source = query.source_scores(src, source_cache, alignment, lo, end)
        times["source"].append(time.perf_counter() - t0)
        layers = np.stack([np.array(r) for r in per_layer.rows])[:, : end - lo]
        ways = {"tail": tail, "tail, mean over seeing layers": tail_seen,
                "last token": last[: end - lo], "source": by_source}
        ways.update(source_variants(src, source_layers.rows, alignment, lo, end))
        for c in LAYER_COUNTS:
            if c < len(layers):
                ways[f"first {c} layers"] = layers[:c].sum(0)
                ways[f"last {c} layers"] = layers[-c:].sum(0)
        for name, scores in ways.items():
            hits[name] = hits.get(name, 0) + covered(scores, count, lo, end, answer)
        print(f"  item {k + 1}/{len(items)} ({item.kind}): "
              + ", ".join(f"{w} {h}" for w, h in hits.items() if "layers" not in w), flush=True)
    out = {"source": args.source, "target": args.target, "tokens": args.tokens,
           "items": len(items), "kinds": args.kinds, "budget": budget.positions(args.tokens),
           "answer_covered": hits,
           "probe_ms": {w: 1e3 * statistics.median(v) for w, v in times.items()},
           "command": " ".join(sys.argv)}
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


def source_variants(source, rows, alignment, lo, end) -> dict:
    """The source's reading summed over its full-attention layers only, and averaged
    per position over the layers that see it: with sliding windows (Gemma 3: 15 of
    18 layers) a distant position is scored by fewer layers than a recent one."""
    from mlx_kvlingo.models.geometry import cache_geometry

    per_layer = np.stack([np.array(r) for r in rows])  # [layers, source positions 1..]
    n = per_layer.shape[1]
    last = len(alignment.source_tokens) - 1
    seen = np.zeros_like(per_layer)
    for i, lg in enumerate(cache_geometry(source).layers):
        first = last - lg.window + 1 if lg.window else 0
        seen[i, max(first - 1, 0):] = 1.0
    ways = {"source, full layers": per_layer[[lg.window is None or not lg.window for lg in
                                             cache_geometry(source).layers]].sum(0),
            "source, mean over seeing layers": per_layer.sum(0) / np.maximum(seen.sum(0), 1)}
    offsets = alignment.source_offsets[1: 1 + n]
    return {k: query.scores_by_characters(v, offsets, alignment.target_offsets[lo:end])
            for k, v in ways.items() if v.any()}


def tail_translated(source, target, translator, source_cache, alignment, tokens, cache, end):
    """A copy of ``cache`` (positions ..end-1) with the native tail's positions
    end..n-2 translated too, for the last token to be read alone."""
    probed = copy_cache(cache)
    alignment = alignment.with_native_prefix(translator.spec.native_prefix)
    return translate_into(source, target, translator, source_cache, probed, alignment,
                          tokens.shape[1] - 1, tokens, room=1)


def state_alignment(stok, ttok, translator, text, source_tokens):
    """The target-token alignment a switch of ``text`` uses."""
    if translator.cross_tokenizer:
        from mlx_kvlingo.translator.align import align_text
        return align_text(stok, ttok, text, translator.spec.native_prefix, source_tokens)
    from mlx_kvlingo.translator.align import identity_alignment
    return identity_alignment(source_tokens[0], translator.spec.native_prefix)


if __name__ == "__main__":
    main()

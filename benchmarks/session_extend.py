"""The same translation by the two paths of `switching.kernel.translate_into`, side by side: into a
fresh cache (what a switch does: buffers written in place, each target layer mapping
only the rows it keeps, e.g. the last 512 for a Gemma 3 sliding-window layer) and
extending an empty `make_prompt_cache` (what a Session's catch-up does; it once mapped every row for every layer, 3.7x the fresh path's time at
3,884 positions, `benchmarks/results/session-extend.json`). SmolLM2 -> Gemma 3 with the
shipped file, on Austen text; medians, interleaved.

    python benchmarks/session_extend.py [--tokens 1024,3900] [--rounds 2] [--json OUT]
"""
import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from switch_cost_shipped import austen_text  # this folder's: the same text

from mlx_kvlingo.models.cache import prefill
from mlx_kvlingo.models.load import load_pair
from mlx_kvlingo.pairs.shipped import shipped_translator
from mlx_kvlingo.switching.kernel import translate_into
from mlx_kvlingo.translator.align import align_text, tokenize_with_offsets
from mlx_kvlingo.translator.maps import load_translator

TAIL = 16  # positions left to the target, as with the shipped files' native tail


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024,3900")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    src, stok, tgt, ttok = load_pair("smollm2", "gemma3")
    tr = load_translator(shipped_translator("smollm2", "gemma3"))
    out = {}
    for n in map(int, args.tokens.split(",")):
        ctx = austen_text(ttok, n)
        st = tokenize_with_offsets(stok, ctx)
        source_cache = prefill(src, mx.array(st[0])[None])
        mx.eval([(c.keys, c.values) for c in source_cache])
        alignment = align_text(stok, ttok, ctx, tr.spec.native_prefix, st)
        alignment = alignment.with_native_prefix(tr.spec.native_prefix)
        tokens = mx.array(alignment.target_tokens)[None]
        end = tokens.shape[1] - 1 - TAIL
        paths = {"fresh": lambda: None, "extend": lambda: make_prompt_cache(tgt)}
        times = {name: [] for name in paths}
        for r in range(args.rounds + 1):  # round 0 warms up
            for name, cache in paths.items():
                t0 = time.perf_counter()
                c = translate_into(src, tgt, tr, source_cache, cache(), alignment, end, tokens,
                               room=TAIL + 1)
                mx.eval([(x.keys, x.values) for x in c])
                if r:
                    times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(v) for name, v in times.items()}
        out[n] = {"translated": end, "median_s": med, "extend_over_fresh": med["extend"] / med["fresh"]}
        print(json.dumps({n: out[n]}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

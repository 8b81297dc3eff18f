"""Prefill on the CPU with mlx-lm's attention and with cpu_math's (numpy
softmax, causal blocks), side by side in one run, on the real models.

Each repetition times both paths back to back on the same tokens (the order
alternates), so the ratios compare like with like even on a shared machine. Also
reports how far apart the two caches are (max |difference| of keys and values,
and of the next-token log-probabilities).

    python benchmarks/prefill_attention.py --json benchmarks/results/prefill-attention.json
"""

import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse
import json
import os
import platform
import statistics
import time

import mlx.core as mx

from mlx_kvlingo import cpu_math
from mlx_kvlingo.models.cache import prefill, read_layer
from mlx_kvlingo.models.load import load_pair


def timed_prefill(model, tokens, fast: bool):
    os.environ[cpu_math.ENV] = "1" if fast else "0"
    t0 = time.perf_counter()
    cache = prefill(model, tokens)
    mx.eval([(c.keys, c.values) for c in cache])
    return time.perf_counter() - t0, cache


def next_logprobs(model, cache, token):
    logits = model(token, cache=cache)[:, -1].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="512,1024")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    src, _, tgt, _ = load_pair("smollm2", "gemma3")
    rows = []
    for name, model in (("SmolLM2-135M", src), ("Gemma 3 270M", tgt)):
        for T in [int(x) for x in args.lengths.split(",")]:
            tokens = mx.random.randint(100, 20000, (args.batch, T + 1), key=mx.random.key(T))
            times = {True: [], False: []}
            for r in range(args.reps + 1):  # the first is a warm-up
                for fast in ((True, False) if r % 2 else (False, True)):
                    dt, cache = timed_prefill(model, tokens[:, :-1], fast)
                    if r:
                        times[fast].append(dt)
                    if r == 0:
                        lp = next_logprobs(model, cache, tokens[:, -1:])
                        kv = [read_layer(c)[:2] for c in cache]
                        if fast:
                            fast_out = (kv, lp)
                        else:
                            ref_out = (kv, lp)
            kv_diff = max(mx.abs(a - b).max().item()
                          for (fa, ra) in zip(fast_out[0], ref_out[0]) for a, b in zip(fa, ra))
            lp_diff = mx.abs(fast_out[1] - ref_out[1]).max().item()
            row = dict(model=name, tokens=T, batch=args.batch,
                       mlx_s=statistics.median(times[False]),
                       numpy_softmax_s=statistics.median(times[True]),
                       max_kv_diff=kv_diff, max_logprob_diff=lp_diff)
            row["speedup"] = row["mlx_s"] / row["numpy_softmax_s"]
            rows.append(row)
            print(f"{name} {T} tokens: mlx-lm {row['mlx_s']:.2f}s, cpu_math "
                  f"{row['numpy_softmax_s']:.2f}s ({row['speedup']:.2f}x); max |dKV| "
                  f"{kv_diff:.1e}, max |dlogprob| {lp_diff:.1e}", flush=True)
    os.environ.pop(cpu_math.ENV, None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": f"{platform.machine()}, {os.cpu_count()} cores",
                       "blas_threads": os.environ.get("MKL_NUM_THREADS"),
                       "reps": args.reps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

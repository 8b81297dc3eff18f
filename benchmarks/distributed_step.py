"""Time of one stage-2 step on 1 process vs 2 processes (mlx.launch, ring, loopback).

The same global batch (``--accumulate`` micro-batches of ``--batch-size``
sequences) is timed three ways, one after the other, repeated ``--rounds`` times
so the machine's load falls on each alike:

- ``1 rank, 1 thread``: one process, OPENBLAS_NUM_THREADS=1;
- ``1 rank, 2 threads``: one process with both cores' BLAS threads;
- ``2 ranks, 1 thread each``: ``mlx.launch -n 2 --backend ring`` on this machine,
  each rank taking half the micro-batches, gradients averaged every step.

Per step: ``prepare`` (the frozen source and teacher passes of this rank's
share), ``update`` (gradients, the all-reduce, the optimizer); rank 0's wall
time is the step's, and its CPU time says how much work it did (on a machine
shared with other jobs, wall time also depends on how much CPU the jobs get).
The all-reduce of the maps' gradients is also timed alone.

    python benchmarks/distributed_step.py --json benchmarks/results/distributed-step.json
    python benchmarks/distributed_step.py --model ~/.cache/mlx-kvlingo/SmolLM2-135M-Instruct-float32
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(args):
    import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

    import inspect as inspect_mod

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_map

    from mlx_kvlingo.data import corpus as data
    from mlx_kvlingo.models.load import load
    from mlx_kvlingo.train import distributed
    from mlx_kvlingo.train.distill import DistillConfig, Distiller
    from mlx_kvlingo.train.loop import RunConfig
    from mlx_kvlingo.train.samples import SharedTokens
    from mlx_kvlingo.translator.maps import Translator

    g = distributed.group()
    src, tok = load(args.source or args.model)
    tgt, _ = load(args.model)
    # Offline text: docstrings of a few standard modules, tokenized once.
    import email  # noqa: E401
    import json as j
    import os as o
    import re
    import subprocess as sp
    import textwrap
    text = "\n\n".join(inspect_mod.getdoc(m) or "" for m in (email, j, o, re, sp, textwrap,
                                                              inspect_mod, argparse))
    stream = data.token_stream(tok, [("doc", text)] * 4)
    translator = Translator.for_models(src, tgt, tok, tok)
    d = DistillConfig(steps=1000, lr=1e-5, batch_size=args.batch_size, accumulate=args.accumulate)
    config = RunConfig(d, context_lengths=(args.context,), continuation_len=args.continuation)
    pair = SharedTokens(stream, stream)
    distiller = Distiller(translator, tgt, d, g)
    positions = None
    if g is not None:
        positions = distributed.micro_batch_positions(pair.micro_batches(config), g)
    rows = []
    for step in range(args.warmup + args.steps):
        c0, t0 = time.process_time(), time.perf_counter()
        batches = pair.step_batches(src, tgt, translator, config, step, g)
        t1 = time.perf_counter()
        distiller.train_step(batches, positions)
        t2 = time.perf_counter()
        if step >= args.warmup:  # CPU seconds this process used (all its threads)
            rows.append((t1 - t0, t2 - t1, time.process_time() - c0))
    allreduce = None
    if g is not None:  # the collective alone, on a gradient-shaped tree
        grads = tree_map(lambda p: mx.ones_like(p), distiller.maps.trainable_parameters())
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            mx.eval(nn.average_gradients(grads, g))
            times.append(time.perf_counter() - t0)
        allreduce = statistics.median(times)
    if distributed.is_writer(g):
        params = sum(v.size for _, v in tree_flatten(distiller.maps.trainable_parameters()))
        Path(args.out).write_text(json.dumps({
            "prepare_s": statistics.median(r[0] for r in rows),
            "update_s": statistics.median(r[1] for r in rows),
            "step_s": statistics.median(r[0] + r[1] for r in rows),
            "cpu_s": statistics.median(r[2] for r in rows),
            "load_average": os.getloadavg()[0],
            "allreduce_s": allreduce,
            "params": params,
        }))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(args, ranks: int, threads: int, out: Path) -> dict:
    me = [os.path.abspath(__file__), "--worker", "--out", str(out), "--model", args.model,
          *(["--source", args.source] if args.source else []),
          *(str(x) for k in ("context", "continuation", "batch_size", "accumulate", "steps",
                             "warmup") for x in (f"--{k.replace('_', '-')}", getattr(args, k)))]
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               HF_HUB_OFFLINE="1")
    if ranks == 1:
        cmd = [sys.executable, *me]
    else:
        launch = Path(sys.executable).with_name("mlx.launch")
        cmd = [str(launch), "-n", str(ranks), "--backend", "ring", "-p", str(_free_port()),
               "--python", sys.executable, *me]
    subprocess.run(cmd, env=env, check=True, stdin=subprocess.DEVNULL, timeout=1800)
    return json.loads(out.read_text())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = Path(__file__).resolve().parents[1]
    p.add_argument("--model", default=str(here / "mlx_kvlingo/assets/toy_pair/target"))
    p.add_argument("--source", default=None, help="default: the model itself")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--continuation", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--accumulate", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-two-threads", action="store_true",
                   help="skip the 1-process, 2-thread configuration")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    configs = [("1 rank, 1 thread", 1, 1), ("1 rank, 2 threads", 1, 2),
               ("2 ranks, 1 thread each", 2, 1)]
    if args.no_two_threads:
        del configs[1]
    results = {name: [] for name, _, _ in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, ranks, threads in configs:
                row = run_config(args, ranks, threads, Path(tmp) / "row.json")
                results[name].append(row)
                print(f"round {r}: {name}: step {row['step_s']:.3f}s (prepare "
                      f"{row['prepare_s']:.3f}, update {row['update_s']:.3f}; rank 0 used "
                      f"{row['cpu_s']:.3f} CPU-s; load {row['load_average']:.1f})"
                      + (f", all-reduce alone {row['allreduce_s'] * 1e3:.1f} ms"
                         if row["allreduce_s"] else ""), flush=True)
    base = statistics.median(r["step_s"] for r in results[configs[0][0]])
    summary = {}
    for name, rows in results.items():
        step = statistics.median(r["step_s"] for r in rows)
        summary[name] = {"step_s": step, "speedup_vs_1_rank_1_thread": base / step,
                         "prepare_s": statistics.median(r["prepare_s"] for r in rows),
                         "update_s": statistics.median(r["update_s"] for r in rows),
                         "rank0_cpu_s": statistics.median(r["cpu_s"] for r in rows),
                         "allreduce_s": rows[0]["allreduce_s"]}
        print(f"{name:24s} {step:.3f} s/step  x{base / step:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "out", "json", "no_two_threads")},
            "machine": f"{os.cpu_count()} cores, shared with other jobs (load average "
                       f"{os.getloadavg()[0]:.1f} at the end)",
            "results": summary, "rounds": results}, indent=1))


if __name__ == "__main__":
    main()

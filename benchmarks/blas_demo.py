"""`mlx-kvlingo demo` end to end under each BLAS, side by side in one run.

The bar: on a machine without a system OpenBLAS the README's first command
(which preloads the mkl wheel) must take at most 1.5x the time it takes with
OpenBLAS, and MLX's fp32 GEMM must reach 70 % of numpy's. This runs `inspect` and
the demo in fresh processes, alternating ``MLX_KVLINGO_BLAS=mkl`` / ``openblas`` /
(optionally) ``none`` so that both see the same machine state, and writes
benchmarks/results/blas-demo.{json,md}. Needs the system OpenBLAS installed
(``apt-get install libopenblas0-pthread``) to have something to compare with.

    python benchmarks/blas_demo.py --rounds 3      # ~5 minutes on an idle 2-core machine
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (first: fast BLAS)
from mlx_kvlingo import blas
from mlx_kvlingo.measure.ttft import environment

RESULTS = Path(__file__).resolve().parent / "results"
CLI = [sys.executable, "-m", "mlx_kvlingo_cli.main"]


def run(args, choice):
    env = dict(os.environ, HF_HUB_OFFLINE="1", MLX_KVLINGO_BLAS=choice)
    t0 = time.perf_counter()
    proc = subprocess.run(CLI + args, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(args)} under {choice} failed:\n{proc.stderr}")
    return wall, proc.stdout + proc.stderr


def gemm_ratio(choice):
    _, out = run(["inspect"], choice)
    m = re.search(r"mlx ([\d.]+) GFLOP/s, numpy ([\d.]+) GFLOP/s", out)
    return float(m.group(1)), float(m.group(2))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--with-reference", action="store_true",
                   help="also time the reference BLAS (several minutes a run)")
    args = p.parse_args()
    if not blas.find_system_openblas():
        sys.exit("No system OpenBLAS to compare with: apt-get install libopenblas0-pthread")
    choices = ["mkl", "openblas"] + (["none"] if args.with_reference else [])
    walls = {c: [] for c in choices}
    gemm = {c: gemm_ratio(c) for c in choices}
    for r in range(args.rounds):
        for c in choices:
            wall, out = run(["demo"], c)
            warned = any(line.startswith("warning:") for line in out.splitlines())
            walls[c].append(wall)
            print(f"round {r + 1}: {c:8s} demo {wall:6.1f}s{'  (warned slow BLAS)' if warned else ''}",
                  flush=True)
    med = {c: statistics.median(v) for c, v in walls.items()}
    result = dict(environment=environment(), rounds=args.rounds, demo_wall_s=walls,
                  median_s=med, gemm_gflops={c: dict(mlx=m, numpy=n) for c, (m, n) in gemm.items()},
                  mkl_over_openblas=med["mkl"] / med["openblas"])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "blas-demo.json").write_text(json.dumps(result, indent=2))
    env = result["environment"]
    lines = [
        "# `mlx-kvlingo demo` under each BLAS (benchmarks/blas_demo.py)",
        "",
        f"{env['cpu']}, {env['cpu_count']} cores, load average at the end {env['load_average']}; "
        f"{args.rounds} rounds, alternating, each a fresh process.",
        "",
        "| BLAS | mlx GEMM GFLOP/s | numpy | mlx/numpy | demo wall, median | runs |",
        "|---|---|---|---|---|---|",
    ]
    for c in choices:
        m, n = gemm[c]
        runs = ", ".join(f"{w:.1f}" for w in walls[c])
        lines.append(f"| {c} | {m:.1f} | {n:.1f} | {m / n:.2f} | {med[c]:.1f} s | {runs} |")
    lines += ["", f"MKL (what a machine without a system OpenBLAS gets) over OpenBLAS: "
              f"**{result['mkl_over_openblas']:.2f}x** the demo's time (bar: at most 1.5x)."]
    (RESULTS / "blas-demo.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

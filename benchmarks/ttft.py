"""Time to first token after a switch vs a full re-prefill (SmolLM2-135M, float32).

    python benchmarks/ttft.py --json ttft.json            # contexts 64..4096
    python benchmarks/ttft.py --json ttft.json --quick    # 64 and 256, 2 repeats

The source is SmolLM2 itself with random translator maps: only timing matters,
and a translator of the same shape costs the same whatever its values. The
source's cache is given (it read the context during its turn); the switch is
timed as translation plus the target's first decoding step. Same as
`mlx-kvlingo bench ttft`.
"""

import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse
from pathlib import Path

from mlx_kvlingo.bench import DEFAULT_CONTEXTS, TTFTRow, format_rows, run_ttft_benchmark


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path("ttft.json"))
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--target", default=None, help="default: SmolLM2-135M-Instruct float32")
    p.add_argument("--source", default=None, help="default: the target itself")
    p.add_argument("--translator", default=None, help="default: random maps")
    p.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    repeats, warmup = args.repeats, args.warmup
    if args.quick:
        contexts = [c for c in contexts if c <= 256] or contexts[:1]
        repeats, warmup = min(repeats, 2), min(warmup, 1)
    plot = args.plot or args.json.with_suffix(".png")
    result = run_ttft_benchmark(args.target, args.source, args.translator, contexts,
                                repeats, warmup, json_out=args.json, plot_out=plot)
    fields = set(TTFTRow.__dataclass_fields__)
    print(format_rows([TTFTRow(**{k: v for k, v in r.items() if k in fields})
                       for r in result["rows"]]))
    print(f"Wrote {args.json} and {plot}")


if __name__ == "__main__":
    main()

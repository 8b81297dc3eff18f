"""Time to first token after a switch vs a full re-prefill, and the fraction of the
ceiling (one bare decoding step + the maps' matmuls) the switch reaches.

    python benchmarks/ttft.py --json benchmarks/results/ttft.json
    python benchmarks/ttft.py --json ttft.json --native-tail 0,16,64
    python benchmarks/ttft.py --json ttft.json --quick

Pairs (default): SmolLM2-135M -> itself (shared tokenizer) and both directions of
Gemma 3 270M <-> SmolLM2 (different tokenizers: the text is aligned inside the timed
switch), all float32, with random maps of the right geometry (only timing matters:
a trained translator of the same shape costs the same). Same as
`mlx-kvlingo bench ttft`.
"""

import sys

import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)
from mlx_kvlingo_cli.main import app

if __name__ == "__main__":
    sys.exit(app(["bench", "ttft", *sys.argv[1:]]))

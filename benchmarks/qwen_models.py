"""Cost of the two Qwen2.5-Coder instruct models on this CPU, float32.

For each model, in a fresh process (so that its peak RSS is its own): the load of
the converted directory (``mlx_kvlingo.load``, float32), a 512-token prefill of
Python source (the standard library's ``textwrap.py``) through the package's
``prefill`` (the re-prefill path: no LM head), and mlx-lm's ``stream_generate``
on the same 512 tokens, whose prompt and generation speeds are mlx-lm's own.
Writes benchmarks/results/qwen-models.json. The models must be fetched first
(``mlx-kvlingo fetch-models qwen``).

    OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 python benchmarks/qwen_models.py
"""

import argparse
import inspect
import json
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (first: fast BLAS)

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")


def measure(name: str, context: int, new_tokens: int, repeats: int) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    from mlx_kvlingo import load
    from mlx_kvlingo.models.cache import prefill

    t0 = time.perf_counter()
    model, tokenizer = load(name)
    load_s = time.perf_counter() - t0
    tokens = mx.array(tokenizer.encode(inspect.getsource(textwrap))[:context])
    prefill_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval([c.state for c in prefill(model, tokens)])
        prefill_s.append(time.perf_counter() - t0)
    last = None
    for last in stream_generate(model, tokenizer, tokens, max_tokens=new_tokens):
        pass
    return {
        "model": name,
        "load_s": round(load_s, 2),
        "context": context,
        "prefill_s": [round(s, 2) for s in prefill_s],
        "prefill_tok_s": round(context / min(prefill_s), 1),
        "mlx_lm_prompt_tok_s": round(last.prompt_tps, 1),
        "mlx_lm_decode_tok_s": round(last.generation_tps, 2),
        "decoded_tokens": last.generation_tokens,
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one model
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.context, args.new_tokens, args.repeats)))
        return
    from mlx_kvlingo.measure.ttft import environment

    rows = []
    for name in MODELS:
        cmd = [sys.executable, __file__, "--one", name, "--context", str(args.context),
               "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]))
    result = {"environment": environment(), "rows": rows}
    (RESULTS / "qwen-models.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Value maps fitted against the target's own attention.

From one pass over the same fit windows, two stage-1 translators with the layer map
of TRANSLATOR (e.g. a shipped file's: which source layers each map reads):

- ``OUT/plain.safetensors``: keys and values by plain least squares;
- ``OUT/attention.safetensors``: the same keys; values minimising the error of the
  target's attention outputs, |A (X Wᵀ - V)|² (fit.AttentionValueAccumulator).

Score both with one `mlx-kvlingo eval` command (same windows) and pair them with
benchmarks/paired_cbr.py.

    python benchmarks/attention_values.py --source gemma3 --target smollm2 \\
        --layer-map-from mlx_kvlingo/assets/translators/gemma3-to-smollm2.safetensors \\
        --out runs/attn-g2s
"""

import argparse
import time
from dataclasses import replace
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)
from mlx_kvlingo.models.load import load_pair
from mlx_kvlingo.train.fit import AttentionValueAccumulator, MomentAccumulator
from mlx_kvlingo.train.samples import pair_data
from mlx_kvlingo.translator.maps import Translator, load_translator


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--layer-map-from", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--corpus", default="stdlib+austen")
    ap.add_argument("--fit-tokens", type=int, default=32_000)
    ap.add_argument("--context-len", type=int, default=1024)
    ap.add_argument("--ridge", type=float, default=1e-3)
    args = ap.parse_args()

    src, src_tok, tgt, tgt_tok = load_pair(args.source, args.target)
    like = load_translator(args.layer_map_from)
    like.check_models(src, tgt, src_tok, tgt_tok)
    spec = replace(like.spec, training={}, native_tail=0)
    plain = Translator(spec)
    pair = pair_data(args.corpus, src_tok, tgt_tok)
    windows = max(args.fit_tokens // args.context_len, 1)
    moments = MomentAccumulator(plain)
    weighted = AttentionValueAccumulator.for_translator(plain)
    t0 = time.perf_counter()
    for n, (sk, sv, tk, tv, w) in enumerate(pair.fit_features(
            src, tgt, plain, windows, args.context_len, attention=True)):
        moments.add(sk, sv, tk, tv)
        weighted.add(sv, tv, w)
        print(f"window {n + 1}/{windows}: {moments.count} positions, "
              f"{time.perf_counter() - t0:.0f}s", flush=True)
    r2_k, r2_v = moments.solve(args.ridge)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    common = {"stage": 1, "corpus": args.corpus, "ridge": args.ridge,
              "layer_map_from": str(args.layer_map_from), "fit_tokens": moments.count}
    plain.spec.training = dict(common, method="least squares",
                               mean_r2_keys=mean(r2_k), mean_r2_values=mean(r2_v))
    args.out.mkdir(parents=True, exist_ok=True)
    plain.save(args.out / "plain.safetensors")
    r2_att = weighted.solve_into(plain, args.ridge)  # same keys, values against attention
    plain.spec.training = dict(common, method="least squares; values against attention",
                               mean_r2_keys=mean(r2_k), mean_r2_attention_outputs=mean(r2_att))
    plain.save(args.out / "attention.safetensors")
    print(f"{moments.count} positions in {time.perf_counter() - t0:.0f}s; mean R² keys "
          f"{mean(r2_k):.3f}, values {mean(r2_v):.3f}; values against attention: R² of the "
          f"attention outputs {mean(r2_att):.3f}. Wrote {args.out}/plain.safetensors and "
          "attention.safetensors")


if __name__ == "__main__":
    main()

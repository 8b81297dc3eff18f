"""Copy trained SmolLM2 <-> Gemma 3 translators into the package, in float16, with their
held-out evaluation (from benchmarks/fidelity.py's eval JSONs) in the metadata.

    python benchmarks/ship_translators.py --work runs/r2 [--native-tail 16] [--bits 8] [--pairs s2g]

(``--bits 8``: maps quantized group-wise, about half of float16's size; they load back
dequantized to float32.) A work file that is already quantized to ``--bits`` is shipped
with its tensors exactly as they are, only its metadata rewritten: quantizing the
dequantized maps again would move them (float16 scales and biases round differently),
and the metadata's evaluation must be that of the bytes that ship. So the way to ship
what was measured is: save the candidate with ``--bits 8`` into the work directory,
evaluate that file, then run this.
"""

import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse
import json
from pathlib import Path

import mlx.core as mx

from mlx_kvlingo.pairs.shipped import ASSETS, SHIPPED
from mlx_kvlingo.translator.maps import (
    file_quantization,
    load_translator,
    read_safetensors_header,
    rewrite_spec,
)

KEYS = {("smollm2", "gemma3"): "s2g", ("gemma3", "smollm2"): "g2s"}


def summary(eval_json: Path, translator: Path) -> dict:
    """CBR (with its interval), KL and top-1 per context length and native tail."""
    result = json.loads(eval_json.read_text())
    out = {}
    for e in result["translators"]:
        if Path(e["translator"]).resolve() != translator.resolve():
            continue
        for ctx, r in e["results"].items():
            out[f"context {ctx}, native tail {e['native_tail']}"] = {
                "cbr": round(r["cbr"], 4), "cbr_ci95": [round(x, 4) for x in r["cbr_ci95"]],
                "kl": round(r["kl"], 4), "top1": round(r["top1"], 4),
                "windows": len(r["windows"]),
                "context_benefit": round(r["context_benefit"], 4),
            }
    return out


def file_bits(path: Path):
    """The bits a translator file's maps are quantized to (None: plain float), from
    its header alone (load_translator's own reading of it)."""
    metadata = read_safetensors_header(path).get("__metadata__") or {}
    return file_quantization(path, metadata)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--native-tail", type=int, default=16,
                    help="Default native tail stored in the shipped files.")
    ap.add_argument("--bits", type=int, choices=(4, 8), default=None,
                    help="Quantize the maps to this many bits (default: float16).")
    ap.add_argument("--pairs", default="s2g,g2s",
                    help="Which directions to ship (the others stay as they are).")
    args = ap.parse_args()
    wanted = set(args.pairs.split(","))
    if not wanted <= set(KEYS.values()):
        ap.error(f"--pairs takes {sorted(KEYS.values())}, not {args.pairs!r}")
    ASSETS.mkdir(parents=True, exist_ok=True)
    for pair, name in SHIPPED.items():
        key = KEYS.get(pair)  # (the Qwen files are made by docs/training.md's commands)
        if key not in wanted:
            continue
        src = args.work / f"{key}.safetensors"
        t = load_translator(src)
        t.spec.training["eval"] = {
            corpus: summary(args.work / f"{key}.eval-{corpus}.json", src)
            for corpus in ("stdlib", "austen")
            if (args.work / f"{key}.eval-{corpus}.json").exists()
        }
        if hasattr(t.spec, "native_tail"):
            t.spec.native_tail = args.native_tail
        out = ASSETS / name
        if args.bits is not None and file_bits(src) == args.bits:
            rewrite_spec(src, out, t.spec)
        else:
            t.save(out, dtype=mx.float16, bits=args.bits)
        print(f"{src} -> {out} ({out.stat().st_size / 2**20:.1f} MB)")


if __name__ == "__main__":
    main()

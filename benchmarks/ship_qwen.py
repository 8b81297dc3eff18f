"""Remake the shipped Qwen2.5-Coder 0.5B <-> 1.5B translators: stage 1 (closed form)
on 20,000 positions of standard-library docstrings and Austen (training splits), three
adjacent source layers per map, saved in float16 with their recall measurement in
the metadata.

    mlx-kvlingo fit --source qwen2.5-coder-0.5b --target qwen2.5-coder-1.5b \\
        --out runs/qwen/q05-to-q15.stage1.safetensors --corpus stdlib+austen \\
        --tokens 20000 --context-len 256 --sources-per-layer 3
    mlx-kvlingo fit --source qwen2.5-coder-1.5b --target qwen2.5-coder-0.5b \\
        --out runs/qwen/q15-to-q05.stage1.safetensors --corpus stdlib+austen \\
        --tokens 20000 --context-len 256 --sources-per-layer 3
    mlx-kvlingo eval --task recall --source qwen2.5-coder-0.5b --target qwen2.5-coder-1.5b \\
        --translator runs/qwen/q05-to-q15.stage1.safetensors --recompute 0.1 \\
        --tokens 550 --items 12 --json runs/qwen/recall-05-15-550.json
    (and the same for 1.5b -> 0.5b), then
    python benchmarks/ship_qwen.py --work runs/qwen

Each fit took ~25 min on one core of a 2-core CPU (10.7 GB peak).
"""

import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse
import json
from pathlib import Path

import mlx.core as mx

from mlx_kvlingo.pairs.shipped import ASSETS, SHIPPED
from mlx_kvlingo.translator.maps import load_translator

WORK = {("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"): ("q05-to-q15", "recall-05-15-550"),
        ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"): ("q15-to-q05", "recall-15-05-550")}


def recall_summary(path: Path) -> dict:
    report = json.loads(path.read_text())
    return {setting: {"exact": round(s["exact"]["value"], 3),
                      "answer_nll": round(s["answer_nll"]["value"], 3),
                      "items": len(report["items"])}
            for setting, s in report["summary"].items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True)
    args = p.parse_args()
    for pair, (stem, recall) in WORK.items():
        t = load_translator(args.work / f"{stem}.stage1.safetensors")
        t.spec.training["eval"] = {"recall_550": recall_summary(args.work / f"{recall}.json")}
        out = ASSETS / SHIPPED[pair]
        t.save(out, dtype=mx.float16)
        print(f"{pair[0]} -> {pair[1]}: {out} ({out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()

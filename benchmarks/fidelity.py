"""Fidelity benchmark: SmolLM2-135M-Instruct <-> Gemma 3 270M across tokenizers.

For each direction it trains (through the `mlx-kvlingo` command, as a user would):
- stage 1: closed-form maps reading three adjacent source layers, fitted once; the
  "no sink" translator is the same maps with the first target position translated
  instead of computed by the target (native_prefix 0);
- stage 2: a short distillation from each stage-1 translator;
then measures all four with one `mlx-kvlingo eval` run on held-out stdlib docstrings
(documents no training saw) at several context lengths, next to the native
re-prefill and no-context rows. A same-tokenizer row on the built-in pair is added
for comparison. Writes JSON and a markdown table.

    python benchmarks/fidelity.py --quick      # < 15 minutes on a 2-core CPU
    python benchmarks/fidelity.py              # the full run
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {
    # stage 1: fit_samples contexts of fit_context target tokens; stage 2: steps at
    # train_contexts; eval: windows per context length.
    "quick": dict(fit_samples=12, fit_context=512, steps=8, train_contexts="256", lr=1e-5,
                  windows=4, contexts="128,512,1024"),
    "full": dict(fit_samples=48, fit_context=1024, steps=24, train_contexts="512", lr=1e-5,
                 windows=8, contexts="128,512,1024"),
}


def cli(*args):
    cmd = [sys.executable, "-m", "mlx_kvlingo_cli.main", *map(str, args)]
    print("$ mlx-kvlingo " + " ".join(map(str, args)), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return time.perf_counter() - t0


def without_sink(path: Path) -> Path:
    """The same maps, translating the first target position instead of computing it."""
    from mlx_kvlingo.translator import load_translator

    t = load_translator(path)
    t.spec.native_prefix = 0
    out = path.with_name(path.stem + "_nosink.safetensors")
    t.save(out)
    return out


def run_direction(name, source, target, work: Path, s: dict) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    s1 = work / "stage1.safetensors"
    times = {}
    times["stage1_s"] = cli(
        "train", "--stage", "1", "--source", source, "--target", target, "--out", s1,
        "--fit-tokens", s["fit_samples"] * s["fit_context"],
        "--context-lengths", s["fit_context"],
        "--sources-per-layer", 3, "--native-prefix", 1,
    )
    s1_nosink = without_sink(s1)
    stage2 = {}
    for label, init in (("sink", s1), ("nosink", s1_nosink)):
        out = work / f"stage2_{label}.safetensors"
        times[f"stage2_{label}_s"] = cli(
            "train", "--stage", "2", "--source", source, "--target", target, "--init", init,
            "--out", out, "--steps", s["steps"], "--lr", s["lr"], "--batch-size", 1,
            "--accumulate", 2, "--context-lengths", s["train_contexts"], "--eval-every", 0,
            "--checkpoint-every", s["steps"], "--native-prefix",
            1 if label == "sink" else 0,
        )
        stage2[label] = out
    report = work / "eval.json"
    times["eval_s"] = cli(
        "eval", "--source", source, "--target", target,
        "--translator", s1, "--translator", s1_nosink,
        "--translator", stage2["sink"], "--translator", stage2["nosink"],
        "--context-lengths", s["contexts"], "--windows", s["windows"],
        "--continuation-len", 48, "--json", report,
    )
    result = json.loads(report.read_text())
    labels = ["stage 1, sink", "stage 1, no sink", "stage 2, sink", "stage 2, no sink"]
    for entry, label in zip(result["translators"], labels):
        entry["label"] = label
    result["times"] = times
    result["direction"] = name
    return result


def same_tokenizer_row(work: Path, s: dict) -> dict:
    from mlx_kvlingo import toy

    src, tgt = toy.ensure_toy_pair(log=None)
    out = work / "toy.safetensors"
    cli("train", "--source", src, "--target", tgt, "--out", out, "--fit-tokens", 50_000,
        "--steps", 4 * s["steps"], "--lr", "3e-4", "--eval-every", 0, "--checkpoint-every", 1000)
    report = work / "toy_eval.json"
    cli("eval", "--source", src, "--target", tgt, "--translator", out,
        "--context-lengths", "128,256", "--windows", 16, "--json", report)
    return json.loads(report.read_text())


def markdown(results, toy, meta) -> str:
    lines = [
        f"# Fidelity: SmolLM2-135M-Instruct <-> Gemma 3 270M ({meta['mode']})",
        "",
        f"Machine: {meta['machine']}; mlx {meta['mlx']}; total {meta['seconds'] / 60:.1f} min. "
        "Held-out stdlib docstrings; continuation of 48 target tokens; per-token numbers.",
        "CBR = context benefit retained; 'benefit' = the target's own NLL(no context) - "
        f"NLL(native). Stage 1: 3 adjacent source layers per map, ridge 1e-3, "
        f"{meta['settings']['fit_samples']} contexts of {meta['settings']['fit_context']} tokens. "
        f"Stage 2: {meta['settings']['steps']} steps of 2 sequences (contexts "
        f"{meta['settings']['train_contexts']}), lr {meta['settings']['lr']:g}. "
        f"{meta['settings']['windows']} "
        "held-out windows per context length.",
        "",
    ]
    for r in results:
        lines += [f"## {r['direction']}", "",
                  "| context | row | NLL | CBR | KL | top-1 |", "|---|---|---|---|---|---|"]
        first = r["translators"][0]["results"]
        for ctx in sorted(first, key=int):
            f0 = first[ctx]
            lines.append(f"| {ctx} | native re-prefill | {f0['nll_native']:.3f} | 100% | 0 | 100% |")
            lines.append(f"| {ctx} | no context | {f0['nll_none']:.3f} | 0% | "
                         f"{f0['kl_none']:.3f} | - |")
            for e in r["translators"]:
                f = e["results"][ctx]
                lines.append(f"| {ctx} | {e['label']} | {f['nll_translated']:.3f} | "
                             f"{f['cbr']:.1%} | {f['kl']:.3f} | {f['top1']:.1%} |")
            lines.append(f"| {ctx} | *target's own context benefit* | "
                         f"{f0['context_benefit']:.3f} nats | | | |")
        lines += ["", "Times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in r["times"].items()), ""]
    if toy:
        lines += ["## Same tokenizer (built-in toy pair, stage 1 + 2)", "",
                  "| context | NLL native | translated | no context | benefit | CBR | KL | top-1 |",
                  "|---|---|---|---|---|---|---|---|"]
        for ctx, f in toy["results"].items():
            lines.append(f"| {ctx} | {f['nll_native']:.3f} | {f['nll_translated']:.3f} | "
                         f"{f['nll_none']:.3f} | {f['context_benefit']:.3f} | {f['cbr']:.1%} | "
                         f"{f['kl']:.3f} | {f['top1']:.1%} |")
        lines.append("")
        lines.append("(The toy target gains little from context, so its CBR is noisy.)")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--work", type=Path, default=None, help="Where translators are written.")
    args = ap.parse_args()
    mode = "quick" if args.quick else "full"
    s = SETTINGS[mode]
    work = args.work or (args.out / f"fidelity-{mode}-work")
    t0 = time.perf_counter()

    from mlx_kvlingo import pretrained

    smol = pretrained.fetch("smollm2", log=None)
    gemma = pretrained.fetch("gemma3", log=None)
    results = [
        run_direction("SmolLM2 -> Gemma 3", smol, gemma, work / "s2g", s),
        run_direction("Gemma 3 -> SmolLM2", gemma, smol, work / "g2s", s),
    ]
    toy = same_tokenizer_row(work / "toy", s)
    import mlx.core as mx

    meta = {
        "mode": mode,
        "settings": s,
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
                   f"MLX device {mx.default_device()}",
        "mlx": mx.__version__,
        "seconds": time.perf_counter() - t0,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"fidelity-{mode}.json").write_text(
        json.dumps({"meta": meta, "directions": results, "same_tokenizer": toy}, indent=2)
    )
    md = markdown(results, toy, meta)
    (args.out / f"fidelity-{mode}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()

"""Layer 0 computed by the target itself vs translated: the shipped translators,
paired on the same held-out windows .

The target's layer-0 K/V depend only on each token and its position, so the
target can compute them exactly (models.layer0_kv) instead of reading them from
the translator. This runs one `mlx-kvlingo eval --native-layer0 off,on` per
direction and held-out set (native tail 0 and 16 on the same windows), then
writes the report with paired-bootstrap intervals for every difference.

    python benchmarks/layer0_native.py                 # run the evals, write the report
    python benchmarks/layer0_native.py --report-only   # the report from evals in --work
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "mlx_kvlingo" / "assets" / "translators"
DIRECTIONS = (("s2g", "SmolLM2 -> Gemma 3", "smollm2", "gemma3", "smollm2-to-gemma3"),
              ("g2s", "Gemma 3 -> SmolLM2", "gemma3", "smollm2", "gemma3-to-smollm2"))
SETTINGS = dict(context="512", windows=48, continuation=48, tails="0,16")


def run_eval(key, source, target, file, corpus, work: Path) -> float:
    args = ["eval", "--source", source, "--target", target,
            "--translator", SHIPPED / f"{file}.safetensors", "--corpus", corpus,
            "--context-lengths", SETTINGS["context"], "--windows", SETTINGS["windows"],
            "--continuation-len", SETTINGS["continuation"], "--native-tail", SETTINGS["tails"],
            "--native-layer0", "off,on", "--json", work / f"{key}.eval-{corpus}.json"]
    print("$ mlx-kvlingo " + " ".join(map(str, args)), flush=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mlx_kvlingo_cli.main", *map(str, args)], check=True,
                   env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return time.perf_counter() - t0


def _fidelity(entry: dict, ctx: str):
    from mlx_kvlingo.measure.evaluate import Fidelity

    return Fidelity.from_dict(entry["results"][ctx])


def _name(e: dict) -> str:
    return f"tail {e['native_tail']}, layer 0 {'native' if e['native_layer0'] else 'translated'}"


def section(title: str, result: dict) -> tuple:
    """Markdown lines and the paired differences of one evaluation."""
    from mlx_kvlingo.measure.evaluate import MARKDOWN_HEAD, cbr_difference, markdown_rows

    entries = result["translators"]
    lines = [f"## {title}", "", MARKDOWN_HEAD[0].format("cache"), MARKDOWN_HEAD[1]]
    diffs = []
    for ctx in sorted(entries[0]["results"], key=int):
        lines += markdown_rows(ctx, [(_name(e), _fidelity(e, ctx)) for e in entries])
        by = {(e["native_tail"], e["native_layer0"]): e for e in entries}
        for m in sorted({e["native_tail"] for e in entries}):
            if (m, True) in by and (m, False) in by:
                on, off = _fidelity(by[m, True], ctx), _fidelity(by[m, False], ctx)
                d, (lo, hi) = cbr_difference(on, off)
                diffs.append(dict(context=int(ctx), native_tail=m, cbr_on=on.cbr, cbr_off=off.cbr,
                                  difference=d, ci95=[lo, hi], kl_on=on.kl, kl_off=off.kl,
                                  top1_on=on.top1, top1_off=off.top1))
    lines += ["", "Layer 0 native minus translated, paired (same windows, same resamples):", "",
              "| context | tail | CBR difference (points) | 95% CI | KL on / off | top-1 on / off |",
              "|---|---|---|---|---|---|"]
    for d in diffs:
        lines.append(f"| {d['context']} | {d['native_tail']} | {100 * d['difference']:+.1f} | "
                     f"{100 * d['ci95'][0]:+.1f}..{100 * d['ci95'][1]:+.1f} | "
                     f"{d['kl_on']:.3f} / {d['kl_off']:.3f} | "
                     f"{d['top1_on']:.1%} / {d['top1_off']:.1%} |")
    return lines + [""], diffs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "results" / "layer0-work")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--corpora", default="stdlib,austen")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--note", default="", help="Conditions to state in the report.")
    ap.add_argument("--summary", type=Path, default=None,
                    help="A markdown file with the conclusions, placed after the header.")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    import mlx.core as mx

    runs, md = [], []
    for corpus in args.corpora.split(","):
        for key, name, source, target, file in DIRECTIONS:
            report = args.work / f"{key}.eval-{corpus}.json"
            seconds = None
            if not args.report_only:
                seconds = run_eval(key, source, target, file, corpus, args.work)
            if not report.exists():
                continue
            result = json.loads(report.read_text())
            lines, diffs = section(f"{name}, held-out {corpus}", result)
            md += lines
            runs.append(dict(direction=key, corpus=corpus, translator=f"{file}.safetensors",
                             seconds=seconds, differences=diffs, eval=result))
    machine = (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
               f"MLX {mx.__version__} on {mx.default_device()}")
    head = ["# Layer 0 computed by the target vs translated (shipped translators)", "",
            f"Machine: {machine}. {args.note}".rstrip(),
            f"Settings: {json.dumps(SETTINGS)}; the translators shipped in "
            "mlx_kvlingo/assets/translators, unchanged (trained with layer 0 translated). "
            "CBR = (NLL none - NLL translated) / (NLL none - NLL native) over all windows' "
            "tokens; intervals are percentile bootstraps over windows (2000 draws); "
            "differences are paired on identical windows.", ""]
    if args.summary:
        head += [args.summary.read_text().strip(), ""]
    (args.out / "layer0-native.md").write_text("\n".join(head + md) + "\n")
    meta = dict(machine=machine, settings=SETTINGS, note=args.note)
    (args.out / "layer0-native.json").write_text(json.dumps(dict(meta=meta, runs=runs), indent=1))
    print("\n".join(head + md))


if __name__ == "__main__":
    main()

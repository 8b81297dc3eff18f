"""Fidelity benchmark: SmolLM2-135M-Instruct <-> Gemma 3 270M across tokenizers.

For each direction it trains the full recipe through the `mlx-kvlingo` command, as a
user would (`train --budget`): stage 1 from one Gram matrix over every source layer
(each map reads its best source layers by single-layer R²; the count with the lowest
held-out KL is kept, and the 3-adjacent-layer fit of the first release is written
beside it from the same moments), then stage 2 from the feature store (top-k +
tail teacher for Gemma's 262k vocabulary, half the samples with a 16-token native
tail) on a mix of the stdlib docstrings and Jane Austen's novels.

Then one `mlx-kvlingo eval` per held-out set — stdlib docstrings and Austen chapters,
documents no training saw — scores every translator with and without the native
tail on the *same* windows, and the report gives CBR with a paired-bootstrap 95%
interval, and each recipe change as a paired difference on identical windows.

    python benchmarks/fidelity.py --quick      # a small run, for the plumbing
    python benchmarks/fidelity.py              # the full run (about 2 h per direction here)
    python benchmarks/fidelity.py --work runs/r2 --skip-train   # re-evaluate trained files
    python benchmarks/fidelity.py --work runs/r2 --report-only  # just the report
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {
    "quick": dict(budget="20m", fit_tokens=8000, select="1,2,4", pool=8, windows=8,
                  contexts="512", train_contexts="512", tails="0,16"),
    "full": dict(budget="1h", fit_tokens=32000, select="1,2,4,6", pool=48, windows=48,
                 contexts="512,1024", train_contexts="512,1024", tails="0,16"),
}
DIRECTIONS = (("s2g", "SmolLM2 -> Gemma 3", "smollm2", "gemma3", 128),
              ("g2s", "Gemma 3 -> SmolLM2", "gemma3", "smollm2", 0))
HELDOUT = ("stdlib", "austen")


def cli(*args):
    cmd = [sys.executable, "-m", "mlx_kvlingo_cli.main", *map(str, args)]
    print("$ mlx-kvlingo " + " ".join(map(str, args)), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return time.perf_counter() - t0


def train(key, source, target, topk, work: Path, s: dict) -> float:
    return cli(
        "train", "--source", source, "--target", target, "--out", work / f"{key}.safetensors",
        "--corpus", "stdlib+austen", "--fit-tokens", s["fit_tokens"],
        "--sources-per-layer", 3, "--select-layers", s["select"],
        "--context-lengths", s["train_contexts"], "--batch-size", 2, "--accumulate", 1,
        "--lr", "1e-5", "--store-pool", s["pool"], "--teacher-topk", topk, "--native-tail", 16,
        "--eval-every", 0, "--checkpoint-every", 25, "--budget", s["budget"],
    )


def translators(key, work: Path):
    """(label, path) of the files a direction's training wrote: the 3-adjacent-layer
    stage-1 fit, the stage-1 candidate stage 2 started from (the same layer map),
    and stage 2."""
    from mlx_kvlingo.translator.maps import load_translator

    final = work / f"{key}.safetensors"
    out = [("stage 1, 3 adjacent layers", work / f"{key}.stage1-adjacent3.safetensors")]
    layer_map = load_translator(final).spec.layer_map if final.exists() else None
    for p in sorted(work.glob(f"{key}.stage1-top*.safetensors")):
        if load_translator(p).spec.layer_map == layer_map:
            k = p.name.split("-top")[1].split(".")[0]
            out.append((f"stage 1, top-{k} layers by R²", p))
    out.append(("stage 2 (full recipe)", final))
    return [(label, p) for label, p in out if p.exists()]


def evaluate(key, source, target, work: Path, s: dict, corpus: str, run=True) -> dict:
    """Run one held-out set's evaluation (or, with ``run`` False, read its report)."""
    report = work / f"{key}.eval-{corpus}.json"
    if not run:
        result = json.loads(report.read_text())
        result.setdefault("seconds", float("nan"))
        return result
    args = ["eval", "--source", source, "--target", target, "--corpus", corpus,
            "--context-lengths", s["contexts"], "--windows", s["windows"],
            "--continuation-len", 48, "--native-tail", s["tails"], "--json", report]
    for _, p in translators(key, work):
        args += ["--translator", p]
    seconds = cli(*args)
    result = json.loads(report.read_text())
    result["seconds"] = seconds
    return result


# ---------------------------------------------------------------------------
# The report


def _fidelity(entry: dict, ctx: str):
    from mlx_kvlingo.measure.evaluate import Fidelity

    return Fidelity.from_dict(entry["results"][ctx])


def _label(entry, labels):
    return f"{labels[entry['translator']]}, tail {entry['native_tail']}"


def markdown(runs: list, meta: dict) -> str:
    from mlx_kvlingo.measure.evaluate import MARKDOWN_HEAD, cbr_difference, markdown_rows

    lines = [f"# Fidelity: SmolLM2-135M-Instruct <-> Gemma 3 270M ({meta['mode']})", "",
             f"Machine: {meta['machine']}. Settings: {json.dumps(meta['settings'])}.",
             "CBR = context benefit retained, (NLL none - NLL translated) / (NLL none - NLL "
             "native), over all windows' tokens; 95% intervals are percentile bootstraps over "
             "windows; differences are paired (same windows, same resamples). Tail m: the "
             "target computed the last m context tokens itself. Continuations of 48 tokens.", ""]
    for run in runs:
        labels = {str(p): label for label, p in run["translators"]}
        for corpus, result in run["eval"].items():
            entries = result["translators"]
            lines += [f"## {run['name']}, held-out {corpus}", "",
                      MARKDOWN_HEAD[0].format("translator"), MARKDOWN_HEAD[1]]
            for ctx in sorted(entries[0]["results"], key=int):
                lines += markdown_rows(ctx, [(_label(e, labels), _fidelity(e, ctx))
                                             for e in entries])
            lines += ["", "Paired differences (CBR points, 95% CI):", "",
                      "| context | change | difference | 95% CI |", "|---|---|---|---|"]
            for ctx in sorted(entries[0]["results"], key=int):
                for name, a, b in _comparisons(entries, labels):
                    d, (lo, hi) = cbr_difference(_fidelity(a, ctx), _fidelity(b, ctx))
                    lines.append(f"| {ctx} | {name} | {100 * d:+.1f} | {100 * lo:+.1f}..{100 * hi:+.1f} |")
            if result.get("seconds") == result.get("seconds"):  # not NaN
                lines += ["", f"Evaluation took {result['seconds'] / 60:.1f} min.", ""]
            else:
                lines.append("")
    return "\n".join(lines) + "\n"


def _comparisons(entries, labels):
    """(what changed, with, without) pairs of eval entries."""
    by = {(labels[e["translator"]], e["native_tail"]): e for e in entries}
    tails = sorted({e["native_tail"] for e in entries})
    stage2 = "stage 2 (full recipe)"
    adjacent = "stage 1, 3 adjacent layers"
    chosen = [label for label in labels.values() if label.startswith("stage 1, top-")]
    out = []
    for m in tails:
        if (stage2, m) in by:
            for s1 in chosen + [adjacent]:
                if (s1, m) in by:
                    out.append((f"stage 2 vs {s1} (tail {m})", by[stage2, m], by[s1, m]))
        for s1 in chosen:
            if (s1, m) in by and (adjacent, m) in by:
                out.append((f"{s1} vs 3 adjacent (tail {m})", by[s1, m], by[adjacent, m]))
    if len(tails) > 1:
        for label in labels.values():
            if (label, tails[-1]) in by and (label, 0) in by:
                out.append((f"tail {tails[-1]} vs 0, {label}", by[label, tails[-1]], by[label, 0]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--work", type=Path, default=None, help="Where translators are written.")
    ap.add_argument("--skip-train", action="store_true", help="Evaluate the files in --work.")
    ap.add_argument("--directions", default="s2g,g2s")
    ap.add_argument("--report-only", action="store_true",
                    help="Write the report from evaluations already in --work.")
    args = ap.parse_args()
    mode = "quick" if args.quick else "full"
    s = SETTINGS[mode]
    work = args.work or (args.out / f"fidelity-{mode}-work")
    work.mkdir(parents=True, exist_ok=True)

    import platform

    import mlx.core as mx

    runs = []
    for key, name, source, target, topk in DIRECTIONS:
        if key not in args.directions.split(","):
            continue
        run = {"key": key, "name": name, "times": {}}
        if not (args.skip_train or args.report_only):
            run["times"]["train_s"] = train(key, source, target, topk, work, s)
        run["translators"] = [(label, str(p)) for label, p in translators(key, work)]
        run["eval"] = {c: evaluate(key, source, target, work, s, c, run=not args.report_only)
                       for c in HELDOUT}
        runs.append(run)
    meta = {"mode": mode, "settings": s, "mlx": mx.__version__,
            "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
                       f"MLX device {mx.default_device()}"}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"fidelity-v2-{mode}" + ("" if len(runs) == len(DIRECTIONS) else f"-{args.directions}")
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    md = markdown(runs, meta)
    (args.out / f"{stem}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()

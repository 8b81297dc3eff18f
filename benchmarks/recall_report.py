"""A markdown page from `benchmarks/recall.py --json` files: per run, every setting's
exact match, answer NLL and time to first token with 95 % bootstrap intervals over
items, the paired differences that matter, and exact match and answer NLL by kind of fact.

    python benchmarks/recall_report.py benchmarks/results/recall-*.json > page.md
"""

import json
import statistics
import sys

from mlx_kvlingo.measure.bootstrap import mean_interval, paired_mean_difference


def exact(run, setting):
    return [float(s["exact"]) for s in run["scores"][setting]]


def row(run, setting):
    e = mean_interval(exact(run, setting))
    n = mean_interval([s["answer_nll"] for s in run["scores"][setting]])
    ttft = statistics.median(s["ttft_s"] for s in run["scores"][setting])
    read = statistics.median(s["read"] for s in run["scores"][setting])
    return (f"| {setting} | {e.value:.2f} [{e.low:.2f}, {e.high:.2f}] | "
            f"{n.value:.2f} [{n.low:.2f}, {n.high:.2f}] | {ttft * 1e3:.0f} ms | {read:.0f} |")


def _switch_of(equal_time: str) -> str:
    """The switch setting an equal-time setting was timed against: "equal-time
    (switch + recompute 10% (at most 128))" -> "switch + recompute 10% (at most 128)"."""
    prefix = "equal-time ("
    return equal_time[len(prefix):-1] if equal_time.startswith(prefix) else "switch"


def gate_rows(run, settings, max_false_alarms: float = 0.2):
    """The fact probe as a gate, per switch setting: on the items the re-prefill
    answers, it should fire where the switch fails (true positives) and not where it
    succeeds (false positives). The threshold is the lowest probe NLL at which it
    fires on at most ``max_false_alarms`` of the successes."""
    out = []
    native = exact(run, "native")
    for s in settings:
        probes = [x.get("probe") for x in run["scores"][s]]
        if not s.startswith("switch") or any(p is None for p in probes):
            continue
        items = [(p, bool(e)) for p, e, n in zip(probes, exact(run, s), native) if n]
        fails = sorted(p for p, ok in items if not ok)
        oks = sorted(p for p, ok in items if ok)
        if not fails or not oks:
            continue
        k = min(len(oks) - 1, int(len(oks) * (1 - max_false_alarms)))
        threshold = oks[k]
        tpr = sum(p > threshold for p in fails) / len(fails)
        fpr = sum(p > threshold for p in oks) / len(oks)
        auc = sum((f > o) + 0.5 * (f == o) for f in fails for o in oks) / (len(fails) * len(oks))
        if not out:
            out += ["", "Fact probe as a gate (items the re-prefill answers; fires when the "
                    "probe NLL exceeds the threshold):", "",
                    "| setting | switch fails | threshold (nats) | fires on fails (TPR) | "
                    "fires on successes (FPR) | AUC |", "|---|---|---|---|---|---|"]
        out.append(f"| {s} | {len(fails)} of {len(items)} | {threshold:.2f} | {tpr:.2f} | "
                   f"{fpr:.2f} | {auc:.2f} |")
    return out


def page(runs) -> str:
    out = []
    for run in runs:
        settings = list(run["scores"])
        equal = json.loads(run["notes"].get("equal_time_tokens", "{}"))
        native_ttft = statistics.median(s["ttft_s"] for s in run["scores"]["native"])
        out += [f"## {run['source']} -> {run['target']}, ~{run.get('tokens', '?')} tokens, "
                f"{len(run['items'])} items", "",
                f"`{run.get('command', '')}`", "",
                "| setting | exact match [95% CI] | answer NLL [95% CI] | TTFT (median) | "
                "tokens in the cache |", "|---|---|---|---|---|"]
        out += [row(run, s) for s in settings]
        out += ["", "Equal-time truncations (last N tokens, N from this run's times): "
                + ", ".join(f"{k}: {v}" for k, v in equal.items()), ""]
        out += ["| paired difference in exact match | value [95% CI] |", "|---|---|"]
        pairs = [("native", "switch")] + [("switch", s) for s in settings
                                          if s.startswith("switch +")]
        pairs += [(_switch_of(s), s) for s in settings if s.startswith("equal-time")]
        for a, b in pairs:
            d = paired_mean_difference(exact(run, a), exact(run, b))
            out.append(f"| {b} minus {a} | {d.value:+.2f} [{d.low:+.2f}, {d.high:+.2f}] |")
        native = sum(exact(run, "native"))
        out += ["", "Relative to the re-prefill (exact matches / the re-prefill's; time to "
                "first token / the re-prefill's):", ""]
        for s in settings:
            if s.startswith("switch"):
                t = statistics.median(x["ttft_s"] for x in run["scores"][s]) / native_ttft
                out.append(f"- {s}: {sum(exact(run, s)) / max(native, 1):.2f} of the "
                           f"re-prefill's exact matches, {t:.2f} of its time")
        kinds = sorted({i["kind"] for i in run["items"]})
        out += ["", "| exact match by kind | " + " | ".join(kinds) + " |",
                "|---|" + "---|" * len(kinds)]
        for s in settings:
            by = run["summary"][s]["by_kind"]
            out.append(f"| {s} | " + " | ".join(f"{by.get(k, 0):.2f}" for k in kinds) + " |")
        out += ["", "| answer NLL by kind (nats per token) | " + " | ".join(kinds) + " |",
                "|---|" + "---|" * len(kinds)]
        for s in settings:
            cells = []
            for k in kinds:
                nlls = [x["answer_nll"] for i, x in zip(run["items"], run["scores"][s])
                        if i["kind"] == k]
                cells.append(f"{statistics.mean(nlls):.2f}")
            out.append(f"| {s} | " + " | ".join(cells) + " |")
        bins = [(0.0, 0.15, "first 15 %"), (0.15, 0.4, "15-40 %"), (0.4, 1.0, "past 40 %")]
        out += ["", "| exact match by the fact's depth | " + " | ".join(
            f"{name} ({sum(lo <= i['depth'] < hi for i in run['items'])} items)"
            for lo, hi, name in bins) + " |", "|---|" + "---|" * len(bins)]
        for s in settings:
            cells = []
            for lo, hi, _ in bins:
                hits = [x["exact"] for i, x in zip(run["items"], run["scores"][s])
                        if lo <= i["depth"] < hi]
                cells.append(f"{sum(hits) / max(len(hits), 1):.2f}")
            out.append(f"| {s} | " + " | ".join(cells) + " |")
        out += gate_rows(run, settings)
        env = run.get("environment", {})
        out += ["", f"Machine: {env.get('platform')}, {env.get('cpu')}, {env.get('cpu_count')} "
                f"cores, MLX {env.get('mlx')}, {env.get('blas')}; load average when it ended "
                f"{env.get('load_average')} (two such runs shared the machine, one per core).",
                ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(page([json.load(open(p)) for p in sys.argv[1:]]))

"""Calibrate `serve --auto SMALL:LARGE`: on held-out coding questions with checkable
answers ("what does this program print?", `mlx_kvlingo/data/code_questions.py`), how
often the small model is unsure, and what sending those turns to the large model
(which reads the question translated from the small one's cache) costs and buys.

Every question is a fresh conversation, answered three ways: by the small model
(through the server's own routing code, `ConversationStore` with model "auto" and a
threshold that never escalates: its answer, the mean entropy of its first
``--probe`` tokens, and whether it had finished by then); by the large model after
the small one's probe, reading the question translated from the small one's cache
(the escalation path); and by the large model after a re-prefill (no translator).
Then, for thresholds over the probe entropies, the share of turns the server would
route (entropy above the threshold and the small answer not already finished within
the probe), their accuracy and the mean time per turn.

    python benchmarks/auto_route.py --small qwen2.5-coder-0.5b --large qwen2.5-coder-1.5b \
        --translator q05-to-q15.safetensors --questions 60 --json out.json
"""
import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from mlx_kvlingo.chat.session import Session
from mlx_kvlingo.data.code_questions import answered, code_questions
from mlx_kvlingo.measure.bootstrap import mean_interval
from mlx_kvlingo.measure.ttft import environment
from mlx_kvlingo.models.load import load
from mlx_kvlingo.pairs.shipped import translator_for
from mlx_kvlingo.serve.conversations import (
    AUTO,
    AutoRoute,
    ConversationStore,
    TurnRequest,
    escalate,
)


def escalated(session: Session, prompt: str, probe: int, max_tokens: int) -> dict:
    """The escalation path on a fresh conversation, as the server takes it
    (``serve.conversations.escalate``): the small model reads the question and writes
    ``probe`` tokens, then the large model answers, reading the question itself; what
    came before it (the system prompt) is translated when ``session`` has a
    translator, prefilled when not."""
    t0 = time.perf_counter()
    new = [{"role": "user", "content": prompt}]
    stream = session.generate("small", new, max_tokens, stream=True)
    for n, _ in enumerate(stream, 1):
        if n >= probe:
            break
    stream.close()
    turn = escalate(session, "large", new, max_tokens, {})
    for _ in turn:
        pass
    report = turn.report
    return {"text": report.text, "total_s": time.perf_counter() - t0,
            "translated": report.translated, "ttft_s": report.ttft_s}


def ask(store: ConversationStore, model: str, prompt: str, max_tokens: int) -> dict:
    """One fresh single-turn conversation through the server's code path."""
    text, stats = "", None
    for kind, value in store.run(TurnRequest(model, [{"role": "user", "content": prompt}],
                                             max_tokens=max_tokens)):
        if kind == "delta":
            text += value
        elif kind == "done":
            stats = value
    return {"text": text, "model": stats.model, "route": stats.route,
            "total_s": stats.total_ms / 1e3, "ttft_s": (stats.ttft_ms or 0) / 1e3,
            "translated": stats.translated_tokens}


def sweep(rows, thresholds):
    """Route share, accuracy and mean time per turn for each entropy threshold."""
    out = []
    for t in thresholds:
        routed = [r["entropy"] > t and not r["finished_in_probe"] for r in rows]
        right = [r["large_right"] if x else r["small_right"] for r, x in zip(rows, routed)]
        secs = [r["large_s"] if x else r["small_s"] for r, x in zip(rows, routed)]
        acc = mean_interval([float(v) for v in right])
        out.append({"threshold": t, "routed": sum(routed) / len(rows), "accuracy": acc.value,
                    "accuracy_ci95": [acc.low, acc.high], "mean_s": statistics.mean(secs)})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", default="qwen2.5-coder-0.5b")
    ap.add_argument("--large", default="qwen2.5-coder-1.5b")
    ap.add_argument("--translator", type=Path, default=None,
                    help="small -> large translator (default: the shipped one)")
    ap.add_argument("--questions", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--probe", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--recompute", type=float, default=0.0,
                    help="share of a catch-up the large model recomputes on fact-like words "
                    "(Session(recompute=...), serve --recompute)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    models = {"small": load(args.small), "large": load(args.large)}
    translator = translator_for(args.small, args.large, args.translator)
    switched = Session(models, {("small", "large"): translator}, recompute=args.recompute)
    prefilled = Session(models)  # no translator: the large model prefills
    small_only = ConversationStore(switched, auto=AutoRoute("small", "large", args.probe, 1e9))
    rows = []
    for i, q in enumerate(code_questions(args.questions, args.seed)):
        s = ask(small_only, AUTO, q.prompt, args.max_tokens)
        g = escalated(switched.fresh(), q.prompt, args.probe, args.max_tokens)
        p = escalated(prefilled.fresh(), q.prompt, args.probe, args.max_tokens)
        rows.append({"kind": q.kind, "code": q.code, "answer": q.answer,
                     "entropy": s["route"]["entropy"],
                     "finished_in_probe": s["route"]["probe_tokens"] < args.probe,
                     "small": s["text"], "small_right": answered(s["text"], q.answer),
                     "small_s": s["total_s"],
                     "large": g["text"], "large_right": answered(g["text"], q.answer),
                     "large_s": g["total_s"], "large_ttft_s": g["ttft_s"],
                     "translated": g["translated"],
                     "large_prefilled": p["text"],
                     "large_prefilled_right": answered(p["text"], q.answer),
                     "large_prefilled_s": p["total_s"], "large_prefilled_ttft_s": p["ttft_s"]})
        r = rows[-1]
        print(f"{i + 1}/{args.questions} {q.kind}: entropy {r['entropy']:.2f}, small "
              f"{'+' if r['small_right'] else '-'}, large (switched) "
              f"{'+' if r['large_right'] else '-'}, large (prefilled) "
              f"{'+' if r['large_prefilled_right'] else '-'}", flush=True)
    entropies = sorted(r["entropy"] for r in rows)
    thresholds = sorted({round(entropies[int(q * (len(entropies) - 1))], 3)
                         for q in (0.0, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)} | {-1.0})
    table = sweep(rows, thresholds)
    summary = {
        "small accuracy": mean_interval([float(r["small_right"]) for r in rows]).value,
        "large accuracy, switched": mean_interval([float(r["large_right"]) for r in rows]).value,
        "large accuracy, prefilled": mean_interval(
            [float(r["large_prefilled_right"]) for r in rows]).value,
        "median large ttft switched / prefilled (s)": [
            statistics.median(r["large_ttft_s"] for r in rows),
            statistics.median(r["large_prefilled_ttft_s"] for r in rows)],
    }
    print(json.dumps(summary, indent=1))
    print("| --auto-entropy | routed | accuracy | 95% CI | mean s/turn |\n|---|---|---|---|---|")
    for t in table:
        lo, hi = t["accuracy_ci95"]
        print(f"| {t['threshold']} | {t['routed']:.0%} | {t['accuracy']:.2f} | "
              f"[{lo:.2f}, {hi:.2f}] | {t['mean_s']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"environment": environment(),
                                         "args": {k: str(v) for k, v in vars(args).items()},
                                         "summary": summary, "sweep": table, "rows": rows},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

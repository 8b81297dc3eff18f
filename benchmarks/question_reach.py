"""Can a switch tell, from the source's reading of the context's last token, whether
what comes next needs the distant context (a question about a fact stated far back)
or only the recent one (text that goes on)? If it could, each switch would choose its
own split: a long native tail for text that goes on (what CBR rewards), the default
tail with the recompute for a question (what recall needs).

For held-out windows of ``--corpus`` (what cbr_defaults.py scores) and recall items
(plain-word facts and fact-like ones, what recall.py scores), the source reads the
whole context and then its last token once more on its own cache (the probe the
files' ``select=source`` recompute already makes), and three signals are taken:

- *recent share*: of the ``--top`` best-scored positions (query.question_scores),
  the share within the last ``--recent`` positions;
- *copy*: the source's most likely next token is the token at, or right after, one
  of the ``--copy-top`` best-scored positions older than the last ``--recent`` (the
  signature of a retrieval: the answer is read off a distant position);
- *reach*: the KL divergence of the source's next-token distribution reading only
  the first token and the last ``--recent`` from its distribution reading the whole
  context (nats): how much the next token needs what lies further back. Here the
  short reading is a prefill of those tokens alone (the last ones keep their distances
  to each other; the first comes nearer);
- *reach in the probe's pass* (``reach_pass``): the same KL with the short reading
  made in the probe's own pass (query.last_token_reading): the last token read twice,
  once seeing only the first token and the ``--recent`` - 1 before it on the cache of
  the whole context (those rows were computed seeing everything), at no second pass;
  ``reach_context``: the same over the context's own tokens only (the LM head's rows
  gathered, not all of them: what a switch reads, query.source_reading);
  ``reach_context_2``: the larger of that and the next step's, both readings going
  on with the full one's likeliest token (one more pass: what a switch reads, the
  files' ``long_tail``); ``reach_context_3``: the same three tokens on; ``hidden_cosine``: 1 - the cosine of the two readings'
  final hidden states.

    python benchmarks/question_reach.py --source gemma3 --target smollm2 --tokens 550 \
        --json benchmarks/results/question-reach-DATE-g2s-550.json

Each signal is reported per kind of item (``--time``: only how long the reach's
second pass and the probe with and without its near reading take).
``--signal reach_pass`` splits by the one-pass reach. With ``--cbr-json`` (a cbr_defaults.py run on the same windows:
the same ``--tokens``, corpus and seed, with a ``--variant`` of a long tail) and
``--recall-json`` (a recall.py run on the same items), it also reports what a switch that chose per window would have kept: the long tail
where the reach is at most a threshold, the file's defaults elsewhere (``--long``: the
variant's row; a recall item in tail mode is scored by that run's switch without the
recompute, ``--recall-tail``).

    python benchmarks/question_reach.py --source gemma3 --target smollm2 --tokens 512 \
        --items 0 --cbr-json cbr-g2s-512.json --long "switch (tail=128,recompute=0)"
"""
import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import trim_prompt_cache
from cbr_defaults import DEFAULTS, cbr, resampled, windows  # this folder's
from switch_cost_shipped import interleaved_medians  # this folder's

from mlx_kvlingo.data.recall import KINDS, PLAIN_KINDS, heldout_filler, recall_items
from mlx_kvlingo.measure.ttft import environment
from mlx_kvlingo.models.cache import last_logits, prefill
from mlx_kvlingo.models.load import load_pair
from mlx_kvlingo.switching.query import (head_logits, last_token_reaches, last_token_reading,
                                         last_token_rows, question_scores, reach_of)
from mlx_kvlingo.translator.align import tokenize_with_offsets

REACH_STEPS = (0.1, 0.2, 0.3, 0.5)
SIGNALS = ("reach", "reach_pass", "reach_context", "reach_context_2", "reach_context_3",
           "hidden_cosine")


def probe(model, tokenizer, text: str, recent: int):
    """(source ids, scores of positions 1..n-2 as the last token reads them, the
    model's log-probabilities of the token after the whole context, the reach in
    the probe's pass)."""
    ids = tokenize_with_offsets(tokenizer, text)[0]
    cache = prefill(model, mx.array(ids[:-1])[None])
    mx.eval([(c.keys, c.values) for c in cache])
    # One pass gives the probe's scores (its full row is the probe: tests/test_reach.py)
    # and both readings' hidden states; the full one's head is the whole context's.
    scores, hidden = last_token_rows(model, cache, ids, recent - 1)
    scores = np.asarray(scores)
    near, full = np.array(hidden[0]), np.array(hidden[1])
    steps = last_token_reaches(model, cache, ids, recent - 1, vocab=ids, steps=3)[1]
    passes = {"reach_pass": reach_of(model, hidden),
              "reach_context": reach_of(model, hidden, ids),
              "reach_context_2": max(steps[:2]),
              "reach_context_3": max(steps),
              "hidden_cosine": 1 - float(near @ full / np.linalg.norm(near) / np.linalg.norm(full))}
    return ids, scores, log_probs(head_logits(model, hidden[1])), passes


def log_probs(logits: mx.array) -> np.ndarray:
    logits = logits.astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits))


def reach(model, ids, whole: np.ndarray, recent: int) -> float:
    """KL(whole context || first token + last ``recent``) of the next token, nats;
    ``whole``: the log-probabilities after the whole context (:func:`probe`)."""
    near = log_probs(last_logits(model, mx.array([ids[:1] + ids[-recent:]]), None)[0, -1])
    return float(np.sum(np.exp(whole) * (whole - near)))


def signals(ids, scores, predicted: int, top: int, recent: int, copy_top: int) -> dict:
    """The attention's two signals (see the module's docstring). ``scores[i]`` is
    position i + 1's; positions 1-3 (the sink's neighbours) are not counted."""
    n = len(scores)
    positions = np.arange(1, n + 1)
    first_recent = n + 1 - recent
    best = np.argsort(-scores, kind="stable")
    counted = best[positions[best] >= 4]
    share = float(np.mean(positions[counted[:top]] >= first_recent))
    distant = [int(positions[i]) for i in counted if positions[i] < first_recent][:copy_top]
    copy = any(ids[p] == predicted or (p + 1 < len(ids) and ids[p + 1] == predicted)
               for p in distant)
    return {"recent_share": share, "copy": bool(copy)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="gemma3")
    ap.add_argument("--target", default="smollm2", help="whose tokens measure the length")
    ap.add_argument("--tokens", type=int, default=550)
    ap.add_argument("--corpus", default="fortunes")
    ap.add_argument("--windows", type=int, default=48)
    ap.add_argument("--items", type=int, default=48, help="recall items of each group")
    ap.add_argument("--top", type=int, default=32)
    ap.add_argument("--recent", type=int, default=128)
    ap.add_argument("--copy-top", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cbr-json", type=Path, default=None)
    ap.add_argument("--long", default="switch (tail=128,recompute=0)")
    ap.add_argument("--recall-json", type=Path, default=None)
    ap.add_argument("--recall-tail", default="switch")
    ap.add_argument("--recall-defaults", default="switch + default recompute by source")
    ap.add_argument("--with-rows", type=Path, default=None,
                    help="another run's JSON whose rows join these for the AUC (a run of the "
                    "windows beside one of the recall items)")
    ap.add_argument("--signal", choices=SIGNALS, default="reach",
                    help="the reach that splits (--cbr-json, --recall-json)")
    ap.add_argument("--time", type=int, default=0, metavar="ROUNDS",
                    help="time the second pass the reach needs (the source over one token, "
                    "with its LM head) against the target's re-prefill of the first window, "
                    "medians of ROUNDS after a warm-up, and stop")
    args = ap.parse_args(argv)
    src, stok, tgt, ttok = load_pair(args.source, args.target)
    if args.time:
        text = windows(ttok, args.corpus, args.tokens, 64, 1, args.seed)[0][0]
        return time_reach_pass(src, stok, tgt, ttok, text, args.time, args.recent)
    texts = [("continuation", text) for text, _ in windows(
        ttok, args.corpus, args.tokens, 64, args.windows, args.seed)]
    for kinds in (PLAIN_KINDS, KINDS) if args.items else ():
        texts += [(item.kind, item.prompt) for item in recall_items(
            heldout_filler(), args.items, args.tokens, lambda t: len(ttok.encode(t)),
            kinds=list(kinds), seed=args.seed)]
    rows = []
    for i, (kind, text) in enumerate(texts):
        ids, scores, whole, passes = probe(src, stok, text, args.recent)
        rows.append({"kind": kind, **signals(ids, scores, int(whole.argmax()), args.top,
                                             args.recent, args.copy_top),
                     "reach": reach(src, ids, whole, args.recent), **passes})
        print(f"\r{i + 1}/{len(texts)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    table = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        shares = [r["recent_share"] for r in mine]
        table[kind] = {"items": len(mine), "copy": sum(r["copy"] for r in mine),
                       "recent_share_q10_q50_q90": np.quantile(shares, [.1, .5, .9]).round(2)
                       .tolist(),
                       "reach_over": {str(t): sum(r["reach"] > t for r in mine)
                                      for t in REACH_STEPS}}
        for signal in SIGNALS:
            values = [r[signal] for r in mine]
            table[kind][f"{signal}_q10_q50_q90"] = np.quantile(values, [.1, .5, .9]).tolist()
    print(f"{args.source}, {args.tokens} target tokens ({args.target}): top {args.top}, "
          f"recent = last {args.recent}, copy from the {args.copy_top} best distant\n\n"
          "| kind | items | copy signature fires | recent share q10 / q50 / q90 | "
          f"reach over {' / '.join(map(str, REACH_STEPS))} | "
          + " | ".join(f"{signal} q10 / q50 / q90" for signal in SIGNALS)
          + " |\n|---|---|---|---|---|" + "---|" * len(SIGNALS))
    for kind, t in table.items():
        print(f"| {kind} | {t['items']} | {t['copy']} | "
              f"{' / '.join(f'{q:.2f}' for q in t['recent_share_q10_q50_q90'])} | "
              f"{' / '.join(str(v) for v in t['reach_over'].values())} | "
              + " | ".join(" / ".join(f"{q:.3g}" for q in t[f"{signal}_q10_q50_q90"])
                           for signal in SIGNALS) + " |")
    extra = json.loads(args.with_rows.read_text())["rows"] if args.with_rows else []
    table["auc"] = separation(rows + extra)
    print("\nhow well each signal tells text that goes on from a question (AUC: the chance a "
          "question's is the higher): " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                   table["auc"].items()))
    split = {}
    if args.cbr_json:
        split["cbr"] = split_cbr(json.loads(args.cbr_json.read_text()), rows, args.long,
                                 args.signal)
    if args.recall_json:
        split["recall"] = split_recall(json.loads(args.recall_json.read_text()), rows,
                                       args.recall_tail, args.recall_defaults, args.signal)
    if args.json:
        args.json.write_text(json.dumps({"environment": environment(),
                                         "command": " ".join(sys.argv),
                                         "args": {k: str(v) for k, v in vars(args).items()},
                                         "table": table, "split": split, "rows": rows},
                                        indent=1))


def separation(rows: list) -> dict:
    """Per signal, the AUC of telling the recall items from the windows of text that
    goes on (0.5: no better than chance)."""
    text = [r for r in rows if r["kind"] == "continuation"]
    asked = [r for r in rows if r["kind"] != "continuation"]
    out = {}
    for signal in SIGNALS + ("recent_share",):
        a = np.array([r[signal] for r in text])[:, None]
        b = np.array([r[signal] for r in asked])[None]
        auc = float(np.mean((b > a) + 0.5 * (b == a))) if a.size and b.size else float("nan")
        out[signal] = 1 - auc if signal == "recent_share" else auc
    return out


def time_reach_pass(src, stok, tgt, ttok, text: str, rounds: int, recent: int) -> None:
    """Median seconds, interleaved, of the source's second pass over the context's
    last token (with its LM head; the cache holds the rest), of its probe (the
    scores alone) and of its probe with the near reading (the reach in the same
    pass), and of the target's re-prefill of the context."""
    sids = tokenize_with_offsets(stok, text)[0]
    tids = tokenize_with_offsets(ttok, text)[0]
    cache = prefill(src, mx.array(sids[:-1])[None])
    mx.eval([(c.keys, c.values) for c in cache])

    def reprefill():
        mx.eval(last_logits(tgt, mx.array([tids[-1:]]), prefill(tgt, mx.array(tids[:-1])[None])))

    def second_pass():
        mx.eval(src(mx.array([sids[-1:]]), cache=cache)[0, -1])
        trim_prompt_cache(cache, 1)  # as it was: the probes read the same cache

    runs = {"second pass": second_pass,
            "probe": lambda: question_scores(src, cache, sids, len(sids) - 1, 1),
            "probe with the reach": lambda: last_token_reading(src, cache, sids, recent - 1),
            "probe with the reach over the context's tokens": lambda: last_token_reading(
                src, cache, sids, recent - 1, vocab=sids),
            "the same, two steps": lambda: last_token_reading(
                src, cache, sids, recent - 1, vocab=sids, steps=2),
            "re-prefill": reprefill}
    med = interleaved_medians(runs, rounds)
    full = med.pop("re-prefill")
    print(f"target re-prefill of {len(tids)} tokens: {full * 1e3:.0f} ms")
    for name, sec in med.items():
        print(f"{name}: {sec * 1e3:.0f} ms, {sec / full:.3f} of the re-prefill")


def split_cbr(run: dict, rows: list, long: str, signal: str = "reach") -> dict:
    """CBR of a per-window choice on a cbr_defaults run's windows: ``long`` where the
    window's reach is at most each threshold, the defaults elsewhere; paired with
    the defaults and with the long tail's equal-time truncation."""
    reaches = [r[signal] for r in rows if r["kind"] == "continuation"]
    windows_ = [{k: np.array(v) for k, v in w.items()} for w in run["windows"]]
    if len(windows_) != len(reaches):
        raise SystemExit(f"{len(windows_)} windows in --cbr-json, {len(reaches)} read here")
    equal = f"last {run['switches'][long]['equal_time_tokens']}"
    out = {}
    print(f"\nper window: {long} where reach <= t, else {DEFAULTS} "
          f"(CBR {cbr(windows_, DEFAULTS):.1%}; {long}: {cbr(windows_, long):.1%}; "
          f"{equal}: {cbr(windows_, equal):.1%})")
    for t in REACH_STEPS:
        for w, x in zip(windows_, reaches):
            w["split"] = w[long] if x <= t else w[DEFAULTS]
        value = cbr(windows_, "split")
        versus = [value - cbr(windows_, DEFAULTS)] + resampled(windows_, "split", DEFAULTS)
        minus_equal = [value - cbr(windows_, equal)] + resampled(windows_, "split", equal)
        long_share = float(np.mean([x <= t for x in reaches]))
        out[str(t)] = {"cbr": value, "long_share": long_share, "minus_defaults": versus,
                       "minus_long_equal_time": minus_equal}
        print(f"  t = {t}: {long_share:.0%} of windows long, CBR {value:.1%}; - defaults "
              f"{versus[0]:+.1%} [{versus[1]:+.1%}, {versus[2]:+.1%}]; - {equal} "
              f"{minus_equal[0]:+.1%} [{minus_equal[1]:+.1%}, {minus_equal[2]:+.1%}]")
    return out


def split_recall(run: dict, rows: list, tail: str, defaults: str, signal: str = "reach") -> dict:
    """Exact match of a per-item choice on a recall.py run's items (the same
    items in the same order): ``tail`` where the item's reach is at most each
    threshold, ``defaults`` elsewhere."""
    kinds = [i["kind"] for i in run["items"]]
    mine = [r for r in rows if r["kind"] != "continuation"][:len(kinds)]
    if [r["kind"] for r in mine] != kinds:
        raise SystemExit("--recall-json holds other items than these")
    scores = run["scores"]
    native = float(np.mean([s["exact"] for s in scores["native"]]))
    out = {"native": native, "defaults": float(np.mean([s["exact"] for s in scores[defaults]]))}
    print(f"\nper item: {tail} where reach <= t, else {defaults} (exact: native {native:.3f}, "
          f"defaults {out['defaults']:.3f})")
    for t in REACH_STEPS:
        exact = [scores[tail if r[signal] <= t else defaults][j]["exact"]
                 for j, r in enumerate(mine)]
        out[str(t)] = float(np.mean(exact))
        print(f"  t = {t}: exact {out[str(t)]:.3f} ({out[str(t)] / native:.2f} of native's)")
    return out


if __name__ == "__main__":
    main()

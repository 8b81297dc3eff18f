"""Can a switch tell, from the source's reading of the context's last token, whether
what comes next needs the distant context (a question about a fact stated far back)
or only the recent one (text that goes on)? If it could, each switch would choose its
own split: a long native tail for text that goes on (what CBR rewards), the default
tail with the recompute for a question (what recall needs).

For held-out windows of ``--corpus`` (what cbr_defaults.py scores) and recall items
(plain-word facts and fact-like ones, what recall.py scores), the source reads the
whole context and then its last token once more on its own cache (the probe the
files' ``select=source`` recompute already makes), and two signals are taken:

- *recent share*: of the ``--top`` best-scored positions (query.question_scores),
  the share within the last ``--recent`` positions;
- *copy*: the source's most likely next token is the token at, or right after, one
  of the ``--copy-top`` best-scored positions older than the last ``--recent`` (the
  signature of a retrieval: the answer is read off a distant position).

    python benchmarks/question_reach.py --source gemma3 --target smollm2 --tokens 550 \
        --json benchmarks/results/question-reach-DATE-g2s-550.json

Nothing is timed; each signal is reported per kind of item.
"""
import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from cbr_defaults import windows  # this folder's

from mlx_kvlingo.data.recall import KINDS, PLAIN_KINDS, heldout_filler, recall_items
from mlx_kvlingo.measure.ttft import environment
from mlx_kvlingo.models.cache import prefill
from mlx_kvlingo.models.load import load_pair
from mlx_kvlingo.switching.query import question_scores
from mlx_kvlingo.translator.align import tokenize_with_offsets


def probe(model, tokenizer, text: str):
    """(source ids, scores of positions 1..n-2 as the last token reads them, the
    model's most likely next token)."""
    ids = tokenize_with_offsets(tokenizer, text)[0]
    cache = prefill(model, mx.array(ids[:-1])[None])
    mx.eval([(c.keys, c.values) for c in cache])
    scores = np.asarray(question_scores(model, cache, ids, len(ids) - 1, 1))
    logits = model(mx.array([ids[-1:]]), cache=cache)[0, -1]
    return ids, scores, int(mx.argmax(logits).item())


def signals(ids, scores, predicted: int, top: int, recent: int, copy_top: int) -> dict:
    """The two signals of one probe (see the module's docstring). ``scores[i]`` is
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
    args = ap.parse_args(argv)
    src, stok, _, ttok = load_pair(args.source, args.target)
    texts = [("continuation", text) for text, _ in windows(
        ttok, args.corpus, args.tokens, 64, args.windows, args.seed)]
    for kinds in (PLAIN_KINDS, KINDS):
        texts += [(item.kind, item.prompt) for item in recall_items(
            heldout_filler(), args.items, args.tokens, lambda t: len(ttok.encode(t)),
            kinds=list(kinds), seed=args.seed)]
    rows = []
    for i, (kind, text) in enumerate(texts):
        ids, scores, predicted = probe(src, stok, text)
        rows.append({"kind": kind, **signals(ids, scores, predicted, args.top, args.recent,
                                             args.copy_top)})
        print(f"\r{i + 1}/{len(texts)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    table = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        shares = [r["recent_share"] for r in mine]
        table[kind] = {"items": len(mine), "copy": sum(r["copy"] for r in mine),
                       "recent_share_q10_q50_q90": np.quantile(shares, [.1, .5, .9]).round(2)
                       .tolist()}
    print(f"{args.source}, {args.tokens} target tokens ({args.target}): top {args.top}, "
          f"recent = last {args.recent}, copy from the {args.copy_top} best distant\n\n"
          "| kind | items | copy signature fires | recent share q10 / q50 / q90 |\n|---|---|---|---|")
    for kind, t in table.items():
        print(f"| {kind} | {t['items']} | {t['copy']} | "
              f"{' / '.join(f'{q:.2f}' for q in t['recent_share_q10_q50_q90'])} |")
    if args.json:
        args.json.write_text(json.dumps({"environment": environment(),
                                         "command": " ".join(sys.argv),
                                         "args": {k: str(v) for k, v in vars(args).items()},
                                         "table": table, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

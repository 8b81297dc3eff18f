"""Long-range recall after a switch, against a re-prefill, the equal-time truncation
and no context, on the real pair with the shipped translators.

Items: a fact (a number, an invented name, a code identifier or a list item, in
several phrasings) put in at 5 / 25 / 50 % of held-out text (Austen chapters and
standard-library docstrings that training never read), asked for at the end;
``--kinds plain``: facts in ordinary lowercase words instead (a place or object,
who did what to whom, yes/no, two facts combined, a made-up term's definition, a
helper described in a code comment).

    python benchmarks/recall.py --source smollm2 --target gemma3 --tokens 550 \
        --items 48 --json benchmarks/results/recall-s2g-550.json
"""

import argparse
import json
import sys
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)
from mlx_kvlingo.data.recall import KINDS, PLAIN_KINDS, heldout_filler, recall_items
from mlx_kvlingo.measure.recall import format_kinds, format_table, measure_recall
from mlx_kvlingo.measure.session_recall import measure_session_recall
from mlx_kvlingo.measure.ttft import environment
from mlx_kvlingo.models.load import load_pair
from mlx_kvlingo.pairs.shipped import translator_for


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", default="smollm2")
    p.add_argument("--target", default="gemma3")
    p.add_argument("--translator", type=Path, default=None, help="default: the shipped one")
    p.add_argument("--tokens", type=int, default=550, help="context length, target tokens")
    p.add_argument("--items", type=int, default=48)
    p.add_argument("--kinds", default=",".join(KINDS),
                   help="comma-separated kinds of fact or groups: 'facts' (the default "
                   "kinds), 'plain' (facts in ordinary words: %s), 'all'"
                   % ",".join(PLAIN_KINDS))
    p.add_argument("--native-tail", type=int, default=None, help="default: the translator's")
    p.add_argument("--recompute", default="",
                   help="comma-separated budgets (0.1 = 10%% of the context) of switches that "
                   "recompute fact-like words; 'default': the translator file's own")
    p.add_argument("--select", default="",
                   help="comma-separated ways to choose each recompute's positions "
                   "(question, source, question-words, lexical); default: the translator file's own")
    p.add_argument("--recompute-max", type=int, default=0,
                   help="the most positions each recompute budget may come to (0: no limit)")
    p.add_argument("--oracle", action="store_true",
                   help="also a switch that recomputes the fact sentence (an upper bound)")
    p.add_argument("--session", action="store_true",
                   help="the conversation protocol instead (measure/session_recall.py): the "
                   "source reads the fact, the target the next piece, the source the next, "
                   "the target the cue; needs translators both ways (--translator and "
                   "--reverse-translator, default: the shipped ones)")
    p.add_argument("--break-even", type=int, default=None,
                   help="with --session: also the files' defaults in a session whose "
                   "catch-ups prefill under this many translated positions")
    p.add_argument("--reverse-translator", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="JSON-lines file of scored items; a rerun skips them (default: "
                   "next to --json)")
    args = p.parse_args(argv)
    if args.checkpoint is None and args.json is not None:
        args.checkpoint = args.json.with_suffix(".items.jsonl")

    translator = translator_for(args.source, args.target, args.translator)
    src, stok, tgt, ttok = load_pair(args.source, args.target, log=print)
    translator.check_models(src, tgt, stok, ttok)
    items = recall_items(heldout_filler(), args.items, args.tokens,
                         lambda text: len(ttok.encode(text)), kinds=args.kinds.split(","),
                         seed=args.seed)
    budgets = [None if b == "default" else float(b) for b in args.recompute.split(",") if b]
    if args.session:
        reverse = translator_for(args.target, args.source, args.reverse_translator)
        result = measure_session_recall(
            {args.source: (src, stok), args.target: (tgt, ttok)},
            {(args.source, args.target): translator, (args.target, args.source): reverse},
            args.source, args.target, items, recompute=budgets, break_even=args.break_even)
    else:
        result = measure_recall(src, stok, tgt, ttok, translator, items,
                                native_tail=args.native_tail, recompute=budgets,
                                oracle=args.oracle, source_name=args.source,
                                target_name=args.target, checkpoint=args.checkpoint,
                                recompute_max=args.recompute_max,
                                selections=[s for s in args.select.split(",") if s] or [None])
    print(format_table(result))
    print()
    print(format_kinds(result))
    if args.json:
        out = result.to_dict()
        out.update(environment=environment(), command=" ".join(sys.argv),
                   translator=str(args.translator or "shipped"), tokens=args.tokens)
        args.json.write_text(json.dumps(out, indent=2))
        print(f"Wrote {args.json}")


if __name__ == "__main__":
    main()

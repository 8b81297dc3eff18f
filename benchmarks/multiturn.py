"""Multi-turn fidelity on the built-in pair: ten alternating turns, both starting models.

Each conversation cuts one held-out stdlib module's docstrings into turn-sized
segments; the two models take turns "writing" them (reading them as their own
turn). At every turn the model taking it is scored on its segment from its
session cache (its own spans native, the other model's spans translated with a
stage-1 translator) against a native re-prefill of the identical transcript.

    python benchmarks/multiturn.py --json multiturn.json --markdown multiturn.md
"""

import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse
import json
import time
from pathlib import Path

from mlx_kvlingo import data, toy
from mlx_kvlingo.bench import environment
from mlx_kvlingo.models import load
from mlx_kvlingo.multiturn import conversations_from_stream, format_markdown, multiturn_fidelity
from mlx_kvlingo.builtin_pair import stage1_translator


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path("multiturn.json"))
    p.add_argument("--markdown", type=Path, default=Path("multiturn.md"))
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--segment-len", type=int, default=24, help="tokens per turn")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--fit-tokens", type=int, default=50_000, help="stage-1 fit positions")
    p.add_argument("--cache-dir", type=Path, default=None)
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    src_dir, tgt_dir = toy.ensure_toy_pair(args.cache_dir, log=print)
    small, tok = load(src_dir)
    large, large_tok = load(tgt_dir)
    models = {"small": (small, tok), "large": (large, large_tok)}
    translators = {
        ("small", "large"): stage1_translator(small, tok, large, large_tok, args.cache_dir,
                                              args.fit_tokens, log=print),
        ("large", "small"): stage1_translator(large, large_tok, small, tok, args.cache_dir,
                                              args.fit_tokens, log=print),
    }
    _, heldout = data.split_documents(data.stdlib_documents())
    docs = [tok.encode(text, add_special_tokens=False) for _, text in heldout]
    conversations = conversations_from_stream(docs, args.turns, args.segment_len,
                                              args.conversations)
    if not conversations:
        raise SystemExit("No held-out document is long enough; lower --segment-len or --turns.")
    results = multiturn_fidelity(models, translators, conversations)
    title = (f"Multi-turn fidelity, built-in pair (small = qwen3 4 layers, large = llama 6 "
             f"layers), stage-1 translators both ways ({args.fit_tokens} positions), "
             f"{len(conversations)} held-out conversations of {args.turns} turns x "
             f"{args.segment_len} tokens")
    md = format_markdown(results, title)
    md += ("\nEach row: the model taking the turn scores its segment from its session cache "
           "(own spans native, the other model's spans translated, first token native) "
           "against a native prefill of the identical transcript (NLL native) and against "
           "no context (only the previous token). CBR = (none - session) / (none - native).\n")
    out = {
        "benchmark": "multiturn",
        "turns": args.turns,
        "segment_len": args.segment_len,
        "conversations": len(conversations),
        "fit_tokens": args.fit_tokens,
        "translators": {f"{s}->{t}": tr.spec.training.get("fit", {}) for (s, t), tr in
                        translators.items()},
        "environment": environment(),
        "seconds": round(time.perf_counter() - t0, 1),
        "results": {start: [r.to_dict() for r in rows] for start, rows in results.items()},
    }
    args.json.write_text(json.dumps(out, indent=2))
    args.markdown.write_text(md)
    print(md)
    print(f"Wrote {args.json} and {args.markdown} ({out['seconds']}s)")


if __name__ == "__main__":
    main()

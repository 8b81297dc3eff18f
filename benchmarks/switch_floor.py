"""Where a switch's time goes, against a re-prefill: the translation, the question's
probe, the first pass with and without the recompute, timed interleaved in one
process (shipped translators and their defaults; Austen text).

    python benchmarks/switch_floor.py --tokens 550,1100,2048 --rounds 5 \
        --json benchmarks/results/switch-floor-DATE.json
    python benchmarks/switch_floor.py --tokens 550 \
        --pairs smollm2:gemma3,smollm2:gemma3@narrow.safetensors  # a file beside the shipped

Parts (medians of ``--rounds`` after a warm-up round, each a share of the re-prefill):

- *translation*: the switch with no recompute, up to its first pass;
- *probe*: the switch with its defaults up to its first pass, less the translation
  (the plan, the target reading the question on the translated cache, or with
  ``--select source`` the source reading its last token on its own, and for a
  target with sliding-window layers the older rows its recompute reads, translated
  beside the cache: kernel.History);
- *first pass*: the target reading its pending tokens (native tail and the last
  token, LM head on the last) without a recompute;
- *recompute*: what the recomputed positions add to that pass.

The *floor* is translation + probe + first pass: a question-aware switch that
recomputes nothing. Run it on an idle machine with one BLAS thread.
"""
import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse
import json
from pathlib import Path

import mlx.core as mx
from switch_cost_shipped import austen_text, interleaved_medians  # this folder's

from mlx_kvlingo.measure.ttft import environment
from mlx_kvlingo.models.cache import last_logits, prefill
from mlx_kvlingo.models.load import load_pair
from mlx_kvlingo.pairs.shipped import load_shipped
from mlx_kvlingo.switching.api import switch_text
from mlx_kvlingo.switching.generate import first_step
from mlx_kvlingo.translator.align import tokenize_with_offsets
from mlx_kvlingo.translator.maps import load_translator


def time_parts(src, stok, tgt, ttok, translator, n: int, rounds: int,
               select=None) -> dict:
    """Medians of the re-prefill and of the switch cut at its parts, n target tokens;
    ``select``: how the switch chooses what to recompute (None: the file's way)."""
    text = austen_text(ttok, n)
    source_tokens = tokenize_with_offsets(stok, text)
    cache = prefill(src, mx.array(source_tokens[0])[None])
    mx.eval([(c.keys, c.values) for c in cache])
    ids = mx.array(tokenize_with_offsets(ttok, text)[0])[None]
    recomputed = []

    def built(**kw):
        return switch_text(src, stok, tgt, ttok, translator, text, source_cache=cache,
                           source_tokens=source_tokens, select=select, **kw)

    def whole(**kw):
        result = built(**kw)
        recomputed.append(sum(b - a for a, b in result.deferred))
        first_step(tgt, result)

    def reprefill():
        mx.eval(last_logits(tgt, ids[:, -1:], prefill(tgt, ids[:, :-1])))

    med = interleaved_medians({
        "re-prefill": reprefill,
        "translation": lambda: built(recompute=0.0),
        "translation + first pass": lambda: whole(recompute=0.0),
        "translation + probe": built,
        "switch, defaults": whole,
    }, rounds)
    parts = {
        "translation": med["translation"],
        "probe": med["translation + probe"] - med["translation"],
        "first pass": med["translation + first pass"] - med["translation"],
        "recompute": (med["switch, defaults"] - med["translation + probe"])
        - (med["translation + first pass"] - med["translation"]),
    }
    parts["floor"] = parts["translation"] + parts["probe"] + parts["first pass"]
    return {"tokens": ids.shape[1], "recomputed": max(recomputed), "median_s": med,
            "parts_s": parts, "over_reprefill": {
                **{k: v / med["re-prefill"] for k, v in parts.items()},
                "switch, defaults": med["switch, defaults"] / med["re-prefill"]}}


def table(results: dict) -> str:
    lines = ["| direction, tokens | re-prefill | translation | probe | first pass | recompute "
             "(positions) | **floor** | **switch** |", "|---|---|---|---|---|---|---|---|"]
    for name, by_n in results.items():
        for r in by_n.values():
            o = r["over_reprefill"]
            lines.append(
                f"| {name}, {r['tokens']} | {r['median_s']['re-prefill']:.2f} s | "
                f"{o['translation']:.2f} | {o['probe']:.2f} | {o['first pass']:.2f} | "
                f"{o['recompute']:.2f} ({r['recomputed']}) | **{o['floor']:.2f}** | "
                f"**{o['switch, defaults']:.2f}** |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="550,1100,2048")
    ap.add_argument("--pairs", default="smollm2:gemma3,gemma3:smollm2",
                    help="SOURCE:TARGET pairs, comma-separated, with the shipped translator "
                    "or SOURCE:TARGET@FILE with another (timed in the same run as the others)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--select", default=None,
                    help="how the switch chooses what to recompute (default: the file's; "
                    "'source': the source reads the question, its probe)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    results = {}
    for pair in args.pairs.split(","):
        pair, _, path = pair.partition("@")
        source, target = pair.split(":")
        src, stok, tgt, ttok = load_pair(source, target)
        translator = load_translator(path) if path else load_shipped(source, target)
        name = f"{source} -> {target}" + (f" ({Path(path).name})" if path else "")
        results[name] = {}
        for n in (int(x) for x in args.tokens.split(",")):
            results[name][n] = time_parts(src, stok, tgt, ttok, translator, n, args.rounds,
                                           args.select)
            print(json.dumps({f"{name} {n}": results[name][n]["over_reprefill"]}), flush=True)
        del src, tgt
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"results": results, "table": table(results),
                                         "environment": environment()}, indent=1) + "\n")


if __name__ == "__main__":
    main()

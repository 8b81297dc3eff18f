"""Time to first token of a switch with and without recomputing fact-like words,
against a re-prefill of the target, interleaved in one process (shipped translators,
by default SmolLM2 <-> Gemma 3 with their 16-token native tail; Austen text).

    python benchmarks/switch_cost_recompute.py [--tokens 550,2048] [--recompute 0.1] \
        [--rounds 3] [--json benchmarks/results/switch-cost-recompute.json] [--note "..."] \
        [--s2g OTHER.safetensors] [--g2s OTHER.safetensors]

    python benchmarks/switch_cost_recompute.py --pairs qwen2.5-coder-0.5b:qwen2.5-coder-1.5b \
        --tokens 512,2048 --recompute 0.1 --recompute-max 128 --rounds 2

``--s2g`` / ``--g2s``: other translator files (e.g. compressed ones) timed beside the shipped
ones in the same interleaved rounds.

Run it on an idle machine with one BLAS thread: the ratios are what it is for.
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


def time_direction(source, target, lengths, shares, rounds, files=(), native_tail=None,
                   most=0):
    """Each translator (the shipped one, then ``files``) with each recompute share,
    and the re-prefill, interleaved."""
    src, stok, tgt, ttok = load_pair(source, target)
    translators = {"": load_shipped(source, target)}
    translators.update({f" [{Path(f).stem}]": load_translator(f) for f in files})
    out = {}
    for n in lengths:
        text = austen_text(ttok, n)
        source_tokens = tokenize_with_offsets(stok, text)
        cache = prefill(src, mx.array(source_tokens[0])[None])
        mx.eval([(c.keys, c.values) for c in cache])
        ids = mx.array(tokenize_with_offsets(ttok, text)[0])[None]

        def switched(translator, share):
            res = switch_text(src, stok, tgt, ttok, translator, text, source_cache=cache,
                              native_tail=native_tail, source_tokens=source_tokens,
                              recompute=share, recompute_max=most)
            first_step(tgt, res)

        def reprefill():
            c = prefill(tgt, ids[:, :-1])
            mx.eval(last_logits(tgt, ids[:, -1:], c))

        runs = {"re-prefill": reprefill}
        for name, t in translators.items():
            runs[f"switch{name}"] = lambda t=t: switched(t, 0.0)
            cap = f" (at most {most})" if most else ""
            runs.update({f"switch + recompute {s:.0%}{cap}{name}": (lambda t=t, s=s: switched(t, s))
                         for s in shares})
        med = interleaved_medians(runs, rounds)
        out[n] = {"tokens": ids.shape[1], "median_s": med,
                  "over_reprefill": {k: v / med["re-prefill"] for k, v in med.items()}}
        print(json.dumps({f"{source}->{target} {n}": out[n]}), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="550,2048")
    ap.add_argument("--recompute", default="0.1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--note", default="", help="Conditions of the run, kept in the JSON.")
    ap.add_argument("--s2g", action="append", default=[],
                    help="Another SmolLM2 -> Gemma 3 translator file to time beside the shipped")
    ap.add_argument("--g2s", action="append", default=[],
                    help="Another Gemma 3 -> SmolLM2 translator file to time beside the shipped")
    ap.add_argument("--pairs", default="smollm2:gemma3,gemma3:smollm2",
                    help="SOURCE:TARGET pairs with shipped translators, comma-separated")
    ap.add_argument("--recompute-max", type=int, default=0,
                    help="the most positions each recompute share may come to (0: no limit)")
    ap.add_argument("--native-tail", type=int, default=None,
                    help="default: each translator's own (16 for SmolLM2 <-> Gemma 3)")
    args = ap.parse_args()
    lengths = [int(x) for x in args.tokens.split(",")]
    shares = [float(x) for x in args.recompute.split(",") if x]
    others = {("smollm2", "gemma3"): args.s2g, ("gemma3", "smollm2"): args.g2s}
    pairs = [tuple(p.split(":")) for p in args.pairs.split(",")]
    out = {f"{s}->{t}": time_direction(s, t, lengths, shares, args.rounds, others.get((s, t), ()),
                                       args.native_tail, args.recompute_max)
           for s, t in pairs}
    out.update(conditions=args.note, environment=environment())
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

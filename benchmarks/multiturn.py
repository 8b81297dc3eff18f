"""Multi-turn fidelity: ten alternating turns, both starting models.

``--pair builtin`` (default): the built-in pair (shared tokenizer), segments of
token ids cut from held-out stdlib docstrings, stage-1 translators fitted here.

``--pair real``: SmolLM2-135M <-> Gemma 3 270M (different tokenizers), text
segments (each model reads its own tokenization), translators from
``--translator smol:gemma=FILE --translator gemma:smol=FILE``. With ``--gate``
the quality gate is measured too: its threshold is calibrated on separate
held-out conversations (the score at which it would fire on at most
``--gate-fire-rate`` of turns), then the evaluation conversations are played
again with the gate on.

At every turn the model taking it is scored on its segment from its session
cache (own spans native, the other model's spans translated) against a native
prefill of the identical transcript (its own view of it) and against no context.

    python benchmarks/multiturn.py --json multiturn.json --markdown multiturn.md
    python benchmarks/multiturn.py --pair real --translator smol:gemma=s2g.safetensors \\
        --translator gemma:smol=g2s.safetensors --gate --json multiturn-real.json \\
        --markdown multiturn-real.md
"""

import argparse
import json
import time
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)
from mlx_kvlingo.data import corpus as data
from mlx_kvlingo.measure.multiturn import (
    conversations_from_stream,
    format_markdown,
    multiturn_fidelity,
    run_conversation,
    text_conversations,
)
from mlx_kvlingo.measure.ttft import environment
from mlx_kvlingo.models.load import load
from mlx_kvlingo.pairs import toy
from mlx_kvlingo.pairs.builtin import stage1_translator


def builtin_setup(args):
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
    convs = conversations_from_stream(docs, args.turns, args.segment_len,
                                      args.conversations + args.calibration)
    title = (f"Multi-turn fidelity, built-in pair (small = qwen3 4 layers, large = llama 6 "
             f"layers), stage-1 translators both ways ({args.fit_tokens} positions)")
    return models, translators, convs, title


def real_setup(args):
    from mlx_kvlingo.models import pretrained
    from mlx_kvlingo.translator.maps import load_translator

    smol, stok = load(pretrained.fetch("smollm2"))
    gemma, gtok = load(pretrained.fetch("gemma3"))
    models = {"smol": (smol, stok), "gemma": (gemma, gtok)}
    translators = {}
    for spec in args.translator:
        pair, _, file = spec.partition("=")
        src, _, tgt = pair.partition(":")
        t = load_translator(file)
        t.check_models(models[src][0], models[tgt][0], models[src][1], models[tgt][1])
        translators[src, tgt] = t
    if len(translators) != 2:
        raise SystemExit("--pair real needs --translator smol:gemma=FILE and gemma:smol=FILE")
    _, heldout = data.split_documents(data.stdlib_documents())
    docs = sorted((t for _, t in heldout), key=len, reverse=True)
    convs = text_conversations(docs, args.turns, args.segment_chars,
                               args.conversations + args.calibration)
    fits = ", ".join(f"{s}->{t}: {tr.spec.training.get('fit', {}).get('tokens', '?')} positions"
                     for (s, t), tr in translators.items())
    title = ("Multi-turn fidelity, SmolLM2-135M-Instruct <-> Gemma 3 270M (different "
             f"tokenizers, character-aligned), translators: {fits}")
    return models, translators, convs, title


def gate_scores(models, translators, convs, gate):
    """Per turn of each conversation (both starting models): the gate's score."""
    names = list(models)
    scores = []
    for start in names:
        other = names[1] if start == names[0] else names[0]
        for segments in convs:
            order = [other if i % 2 == 0 else start for i in range(len(segments))]
            for d in run_conversation(models, translators, segments, order, gate):
                if d["gate"]:
                    scores.append(d["gate"]["score"])
    return scores


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", choices=("builtin", "real"), default="builtin")
    p.add_argument("--json", type=Path, default=Path("multiturn.json"))
    p.add_argument("--markdown", type=Path, default=Path("multiturn.md"))
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--segment-len", type=int, default=24, help="tokens per turn (builtin)")
    p.add_argument("--segment-chars", type=int, default=120, help="characters per turn (real)")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--fit-tokens", type=int, default=50_000, help="stage-1 fit positions (builtin)")
    p.add_argument("--translator", action="append", default=[], help="SRC:TGT=FILE (real)")
    p.add_argument("--gate", action="store_true", help="measure the quality gate too")
    p.add_argument("--gate-tokens", type=int, default=8)
    p.add_argument("--gate-fire-rate", type=float, default=0.2)
    p.add_argument("--calibration", type=int, default=0,
                   help="extra held-out conversations to calibrate the gate on")
    p.add_argument("--native-tail", type=int, default=None,
                   help="positions before each turn the reader computes over the translation "
                   "(default: each translator's own, e.g. 16 for the shipped ones)")
    p.add_argument("--cache-dir", type=Path, default=None)
    args = p.parse_args(argv)
    if args.gate and not args.calibration:
        args.calibration = 2

    t0 = time.perf_counter()
    models, translators, convs, title = (real_setup if args.pair == "real" else builtin_setup)(args)
    if args.native_tail is not None:
        for t in translators.values():
            t.spec.native_tail = args.native_tail
    tails = sorted({t.spec.native_tail for t in translators.values()})
    title += f", native tail {'/'.join(map(str, tails))}"
    calib, convs = convs[args.conversations:], convs[:args.conversations]
    if not convs:
        raise SystemExit("No held-out document is long enough; lower the segment size or turns.")
    results = multiturn_fidelity(models, translators, convs)
    unit = "tokens" if args.pair == "builtin" else "characters"
    size = args.segment_len if args.pair == "builtin" else args.segment_chars
    title += f", {len(convs)} held-out conversations of {args.turns} turns x {size} {unit}"
    md = format_markdown(results, title)
    out = {
        "benchmark": "multiturn", "pair": args.pair, "turns": args.turns,
        "segment": {unit: size}, "conversations": len(convs),
        "translators": {f"{s}->{t}": tr.spec.training for (s, t), tr in translators.items()},
        "native_tail": {f"{s}->{t}": tr.spec.native_tail for (s, t), tr in translators.items()},
        "environment": environment(),
        "results": {start: [r.to_dict() for r in rows] for start, rows in results.items()},
    }
    if args.gate:
        from mlx_kvlingo.switching.gate import QualityGate, calibrate_threshold

        scores = gate_scores(models, translators, calib,
                             QualityGate(args.gate_tokens, threshold=float("inf")))
        threshold = calibrate_threshold(scores, args.gate_fire_rate)
        gated = multiturn_fidelity(models, translators, convs,
                                   gate=QualityGate(args.gate_tokens, threshold))
        out["gate"] = {"tokens": args.gate_tokens, "threshold": threshold,
                       "calibration_conversations": len(calib),
                       "calibration_scores": scores, "max_fire_rate": args.gate_fire_rate,
                       "results": {s: [r.to_dict() for r in rows] for s, rows in gated.items()}}
        md += "\n" + gate_markdown(results, gated, threshold, args, len(calib), len(scores))
    md += ("\nEach row: the model taking the turn scores its segment from its session cache "
           "(own spans native, the other model's spans translated, first token native) "
           "against a native prefill of the identical transcript (NLL native) and against "
           "no context (only the previous token, after BOS where the model has one). "
           "CBR = (none - session) / (none - native).\n")
    out["seconds"] = round(time.perf_counter() - t0, 1)
    args.json.write_text(json.dumps(out, indent=2))
    args.markdown.write_text(md)
    print(md)
    print(f"Wrote {args.json} and {args.markdown} ({out['seconds']}s)")


def gate_markdown(plain, gated, threshold, args, n_calib, n_scores) -> str:
    lines = [f"## Quality gate ({args.gate_tokens} context tokens computed natively and "
             f"scored; threshold {threshold:+.3f} nats, calibrated on {n_scores} turns of "
             f"{n_calib} other held-out conversations to fire on at most "
             f"{args.gate_fire_rate:.0%} of turns)", "",
             "| start | turn | model | CBR without gate | CBR with gate | gate fired |",
             "|---|---:|---|---:|---:|---:|"]
    for start in plain:
        for a, b in zip(plain[start], gated[start]):
            lines.append(f"| {start} | {a.turn} | {a.model} | {a.cbr:.1%} | {b.cbr:.1%} "
                         f"| {b.fallbacks}/{b.conversations} |")
    for start in plain:
        worst = min(plain[start], key=lambda r: r.cbr)
        after = next(r for r in gated[start] if r.turn == worst.turn)
        fired = sum(r.fallbacks for r in gated[start])
        total = sum(r.conversations for r in gated[start])
        lines.append(f"\n{start} first: worst turn {worst.turn} ({worst.model}) CBR "
                     f"{worst.cbr:.1%} without the gate, {after.cbr:.1%} with it; the gate "
                     f"fired on {fired} of {total} turns.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

"""Context-benefit retention (CBR) of a switch with its file's defaults (native tail
and the question-aware recompute, whose question is the context's last tokens) on
text no translator was trained on, beside the translation alone, the re-prefill,
no context and the equal-time truncation (the target re-prefilling only the last
N context tokens, N timed in the same run to take as long as the switch).

    python benchmarks/cbr_defaults.py --source smollm2 --target gemma3 \
        --corpus fortunes --context 512 --windows 48 --json out.json

``--variant tail=48,recompute=0.15,max=96`` (repeatable) adds a switch with other
settings than the file's (native tail, recompute share, its cap, ``select=question``:
how its positions are chosen; ``file=PATH``: another translator file, with its own
defaults unless the variant sets them), scored on the same windows and timed in the
same rounds, each against its own equal-time truncation and, paired, against the
file's defaults: how the switch's time is best split between the tail and the
recompute, or which of two files keeps more.

Windows: ``--context`` target tokens of the corpus (the whole corpus: fortunes are
quotations, verse and dialogue that no shipped file read) followed by
``--continuation`` tokens, scored from the second (no context has nothing to predict
the first from). CBR = (NLL no context - NLL setting) /
(NLL no context - NLL re-prefill), pooled over the windows' tokens; 95 % intervals
and paired differences by resampling windows.
"""
import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Tuple

import mlx.core as mx
import numpy as np
from switch_cost_shipped import interleaved_medians  # this folder's

from mlx_kvlingo.data.corpus import read_corpus
from mlx_kvlingo.measure.recall import equal_time_tokens, truncated_ids
from mlx_kvlingo.measure.ttft import environment
from mlx_kvlingo.metrics import log_softmax
from mlx_kvlingo.models.cache import last_logits, prefill
from mlx_kvlingo.models.load import load_pair
from mlx_kvlingo.pairs.shipped import load_shipped
from mlx_kvlingo.switching.api import switch_text
from mlx_kvlingo.switching.generate import first_step
from mlx_kvlingo.translator.align import tokenize_with_offsets
from mlx_kvlingo.translator.maps import load_translator

FIXED = (16, 64, 128, 256)


def windows(tokenizer, corpus: str, context: int, continuation: int, count: int, seed: int):
    """(context text, continuation ids) pairs from random places of the corpus."""
    rng = random.Random(seed)
    docs = [t for _, t in read_corpus(corpus) if len(t) > 8 * (context + continuation)]
    out = []
    while len(out) < count:
        text = rng.choice(docs)
        ids, offsets = tokenize_with_offsets(tokenizer, text, add_special_tokens=False)
        if len(ids) < context + continuation + 2:
            continue
        s = rng.randrange(0, len(ids) - context - continuation)
        a, b = offsets[s][0], offsets[s + context - 1][1]
        rest = ids[s + context:s + context + continuation]
        out.append((text[a:b], list(rest)))
    return out


def nll(logits: mx.array, targets) -> np.ndarray:
    """Per-token NLL of ``targets`` from logits [T, vocab] predicting each."""
    lp = log_softmax(logits.astype(mx.float32))
    return -np.array(lp[mx.arange(len(targets)), mx.array(targets)])


def read_after(target, cache, prompt, continuation) -> np.ndarray:
    """The target reads ``prompt`` (after ``cache``) and the continuation; the NLL of
    each continuation token."""
    inputs = mx.array([list(prompt) + list(continuation[:-1])])
    logits = last_logits(target, inputs, cache, keep=len(continuation))[0]
    return nll(logits, continuation)


DEFAULTS = "switch (file defaults)"


def parse_variant(text: str) -> Tuple[str, dict]:
    """``tail=48,recompute=0.15,max=96`` -> (its row's name, switch_text keywords)."""
    names = {"tail": ("native_tail", int), "recompute": ("recompute", float),
             "max": ("recompute_max", int), "select": ("select", str),
             "file": ("translator", load_translator)}
    kw = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key not in names:
            raise SystemExit(f"--variant takes {', '.join(names)}, not {key!r}")
        kw[names[key][0]] = names[key][1](value)
    return f"switch ({text})", kw


def score_window(src, stok, tgt, ttok, translator, text, continuation, truncations,
                 variants=None):
    """NLL per continuation token for each setting on one window (``variants``: name
    -> switch_text keywords, beside the file's defaults)."""
    ids = tokenize_with_offsets(ttok, text)[0]
    bos = getattr(ttok, "bos_token_id", None)
    source_tokens = tokenize_with_offsets(stok, text)
    source_cache = prefill(src, mx.array(source_tokens[0])[None])
    mx.eval([(c.keys, c.values) for c in source_cache])
    out = {"re-prefill": read_after(tgt, prefill(tgt, mx.array(ids[:-1])[None]), ids[-1:],
                                    continuation)}
    # No context: the BOS the model expects (if any) and the first continuation
    # token, which is why every setting scores the continuation from its second token.
    specials = ids[:1] if bos is not None and ids[0] == bos else []
    out["no context"] = np.concatenate([[np.nan], read_after(
        tgt, None, specials + continuation[:1], continuation[1:])])
    switches = {DEFAULTS: {}, **(variants or {}),
                "translation alone": {"native_tail": 0, "recompute": 0.0}}
    for label, kw in switches.items():
        kw = dict(kw)
        result = switch_text(src, stok, tgt, ttok, kw.pop("translator", translator), text,
                             source_cache=source_cache, source_tokens=source_tokens, **kw)
        logits = result.read(tgt, extra=continuation[:-1], keep=len(continuation))[0]
        out[label] = nll(logits, continuation)
    for n in truncations:
        kept = truncated_ids(ids, n, bos)
        out[f"last {n}"] = read_after(tgt, prefill(tgt, mx.array(kept[:-1])[None]), kept[-1:],
                                      continuation)
    return {k: v[1:] for k, v in out.items()}


def switch_seconds(src, stok, tgt, ttok, translator, text, rounds: int, variants=None):
    """Median seconds of the switch with the file's defaults (to its first token), of
    each of ``variants`` (name -> switch_text keywords), and of re-prefilling the last
    n context tokens, for n in FIXED and all of them. Returns ({switch name: s},
    {n: s})."""
    ids = tokenize_with_offsets(ttok, text)[0]
    bos = getattr(ttok, "bos_token_id", None)
    source_tokens = tokenize_with_offsets(stok, text)
    cache = prefill(src, mx.array(source_tokens[0])[None])
    mx.eval([(c.keys, c.values) for c in cache])

    def switched(**kw):
        kw = dict(kw)
        first_step(tgt, switch_text(src, stok, tgt, ttok, kw.pop("translator", translator), text,
                                    source_cache=cache, source_tokens=source_tokens, **kw))

    def reprefill(n):
        kept = mx.array(truncated_ids(ids, n, bos))[None]
        mx.eval(last_logits(tgt, kept[:, -1:], prefill(tgt, kept[:, :-1])))

    switches = {DEFAULTS: {}, **(variants or {})}
    runs = {name: (lambda kw=kw: switched(**kw)) for name, kw in switches.items()}
    runs.update({n: (lambda n=n: reprefill(n)) for n in FIXED + (len(ids),)})
    med = interleaved_medians(runs, rounds)
    return {name: med.pop(name) for name in switches}, med


def cbr(rows, label) -> float:
    none = sum(r["no context"].sum() for r in rows)
    native = sum(r["re-prefill"].sum() for r in rows)
    return (none - sum(r[label].sum() for r in rows)) / (none - native)


def resampled(rows, label, other=None, draws=2000, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(draws):
        sample = [rows[i] for i in rng.integers(0, len(rows), len(rows))]
        out.append(cbr(sample, label) - (cbr(sample, other) if other else 0.0))
    return np.percentile(out, [2.5, 97.5]).tolist()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="smollm2")
    ap.add_argument("--target", default="gemma3")
    ap.add_argument("--translator", type=Path, default=None, help="default: the shipped one")
    ap.add_argument("--corpus", default="fortunes")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--continuation", type=int, default=64)
    ap.add_argument("--windows", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--variant", action="append", default=[],
                    help="another switch, e.g. tail=48,recompute=0.15,max=96 (repeatable)")
    ap.add_argument("--time-only", action="store_true",
                    help="time the switches and the re-prefills (the first window) and stop: "
                         "a re-timing after a change that leaves the scores as they were")
    args = ap.parse_args(argv)
    variants = dict(parse_variant(v) for v in args.variant)
    src, stok, tgt, ttok = load_pair(args.source, args.target)
    t = (load_shipped(args.source, args.target) if args.translator is None
         else load_translator(args.translator))
    items = windows(ttok, args.corpus, args.context, args.continuation, args.windows, args.seed)
    switch_s, prefill_s = switch_seconds(src, stok, tgt, ttok, t, items[0][0], args.rounds,
                                         variants)
    full = prefill_s[max(prefill_s)]
    n_eq = {name: min(equal_time_tokens(prefill_s, sec), args.context - 1)
            for name, sec in switch_s.items()}
    for name, sec in switch_s.items():
        print(f"{name}: {sec * 1e3:.0f} ms = {sec / full:.2f} of the re-prefill's "
              f"{full * 1e3:.0f} ms; equal time: the last {n_eq[name]} tokens", flush=True)
    if args.time_only:
        if args.json:
            args.json.write_text(json.dumps({
                "environment": environment(), "command": " ".join(sys.argv),
                "args": {k: str(v) for k, v in vars(args).items()},
                "prefill_s": {str(k): v for k, v in prefill_s.items()},
                "switches": {name: {"seconds": sec, "share_of_reprefill": sec / full,
                                    "equal_time_tokens": n_eq[name]}
                             for name, sec in switch_s.items()}}, indent=1))
        return
    truncations = sorted(set(FIXED + tuple(n_eq.values())))
    rows = []
    t0 = time.perf_counter()
    for i, (text, continuation) in enumerate(items):
        rows.append(score_window(src, stok, tgt, ttok, t, text, continuation, truncations,
                                 variants))
        print(f"  window {i + 1}/{len(items)} ({time.perf_counter() - t0:.0f} s)", flush=True)
    labels = [k for k in rows[0] if k not in ("re-prefill", "no context")]
    equal = {f"last {n}" for n in n_eq.values()}
    table = {}
    print(f"\n{args.source} -> {args.target}, {args.corpus}, {args.context} context tokens, "
          f"{len(rows)} windows\n\n| setting | CBR | 95% CI | NLL/token |\n|---|---|---|---|")
    for label in ["re-prefill", "no context"] + labels:
        value = cbr(rows, label)
        ci = resampled(rows, label) if label not in ("re-prefill", "no context") else None
        nll_mean = float(np.mean(np.concatenate([r[label] for r in rows])))
        name = label + (" (equal time)" if label in equal else "")
        table[name] = {"cbr": value, "ci": ci, "nll": nll_mean}
        ci_text = f"[{ci[0]:.1%}, {ci[1]:.1%}]" if ci else ""
        print(f"| {name} | {value:.1%} | {ci_text} | {nll_mean:.3f} |")
    versus = {}
    for name in switch_s:
        eq = f"last {n_eq[name]}"
        diff = cbr(rows, name) - cbr(rows, eq)
        diff_ci = resampled(rows, name, eq)
        versus[name] = {"share_of_reprefill": switch_s[name] / full,
                        "equal_time_tokens": n_eq[name], "minus_equal_time": [diff] + diff_ci}
        print(f"{name} ({switch_s[name] / full:.2f} of the re-prefill) - {eq}, paired: "
              f"{diff:+.1%} [{diff_ci[0]:+.1%}, {diff_ci[1]:+.1%}]")
        if name != DEFAULTS:
            gain = cbr(rows, name) - cbr(rows, DEFAULTS)
            gain_ci = resampled(rows, name, DEFAULTS)
            versus[name]["minus_defaults"] = [gain] + gain_ci
            print(f"{name} - {DEFAULTS}, paired: {gain:+.1%} [{gain_ci[0]:+.1%}, "
                  f"{gain_ci[1]:+.1%}]")
    if args.json:
        args.json.write_text(json.dumps({
            "environment": environment(), "command": " ".join(sys.argv),
            "args": {k: str(v) for k, v in vars(args).items()},
            "switch_s": switch_s[DEFAULTS], "prefill_s": {str(k): v for k, v in prefill_s.items()},
            "switch_share_of_reprefill": switch_s[DEFAULTS] / full,
            "equal_time_tokens": n_eq[DEFAULTS], "table": table,
            "switch_minus_equal_time": versus[DEFAULTS]["minus_equal_time"],
            "switches": versus,
            # Each window's NLL per scored token, per setting: to pair a later run's
            # settings (or a mix of these, one per window) with these on the same windows.
            "windows": [{k: [round(float(x), 4) for x in v] for k, v in r.items()}
                        for r in rows]}, indent=1))
        print(f"Wrote {args.json}")


if __name__ == "__main__":
    main()

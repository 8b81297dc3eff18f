"""A coding chat escalates to the large model: a user pastes held-out Python code
in which one detail is stated once (a plain word in a comment, a helper's name, a
constant's value; with ``--kinds prints``, a short function whose output must be
worked out), the small model answers, then the user asks the large model
about the detail. Scored for the large model after a switch (a `Session`
catch-up: the paste and the small model's answer translated, the question read
natively), the large model after a re-prefill of the same messages, and the small
model answering itself; with the question turn's time to first token. Beside
them, the two baselines every switch is measured against: the large model
re-prefilling only the conversation's most recent tokens, as many as the switch's
time to first token allows (the *equal-time truncation*), and the large model
asked the question with nothing pasted (*no context*); and a one-shot switch of the same conversation (the small model's cache of the
whole prompt switched with `switch`, as `mlx-kvlingo switch` does) for its time
to first token and its answer.

    python benchmarks/session_code.py --tokens 1000 --items 24 --json OUT.json

Defaults: Qwen2.5-Coder 0.5B -> 1.5B Instruct (`fetch-models qwen`) with the
shipped translators and their defaults. A rerun with the same --json skips the
items its checkpoint (OUT.items.jsonl) holds.
"""
import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse
import copy
import dataclasses
import json
import re
import statistics
from pathlib import Path
from typing import Optional

from mlx_kvlingo import Session
from mlx_kvlingo.data.code_questions import stated as printed_output
from mlx_kvlingo.data.recall import PLAIN_KINDS, heldout_code_filler, recall_items
from mlx_kvlingo.measure.bootstrap import mean_interval, paired_mean_difference
from mlx_kvlingo.measure.recall import matches
from mlx_kvlingo.models.load import load
from mlx_kvlingo.pairs.shipped import load_shipped
from mlx_kvlingo.switching.pipeline import first_token_time, run_switch
from mlx_kvlingo.translator.maps import load_translator
from mlx_lm import stream_generate

PASTE = ("Here is a Python module I am working on:\n\n```python\n{code}\n```\n\n"
         "Summarise what it does in one sentence.")
QUESTION = ("In the module I pasted, how does this line end? Reply with the missing word "
            "or value only.\n\n{cue}")
# The ``prints`` kind: a function put into the module; what does calling it print?
PRINTS_QUESTION = ("In the module I pasted, what does calling `{name}()` print? Reply with "
                   "the printed output only.")
SETTINGS = ("large after switch", "large after re-prefill", "small itself",
            "large after one-shot switch", "large, equal-time truncation", "large, no context")
EQUAL_TIME, NO_CONTEXT = SETTINGS[4], SETTINGS[5]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", default="qwen2.5-coder-0.5b")
    p.add_argument("--large", default="qwen2.5-coder-1.5b")
    p.add_argument("--tokens", type=int, default=1000, help="pasted code, in tokens")
    p.add_argument("--items", type=int, default=24)
    p.add_argument("--kinds", default="code,identifier,number",
                   help="recall kinds (data/recall.py); 'prints' asks what a function "
                        "put into the module prints")
    p.add_argument("--small-answer", type=int, default=32, help="tokens of the small answer")
    p.add_argument("--select", default=None,
                   help="how the catch-up chooses what to recompute (default: the files')")
    p.add_argument("--also-select", default=None,
                   help="also the large model after a switch whose catch-up chooses this "
                        "way (e.g. 'source'), on the same chat, timed beside the others")
    p.add_argument("--translator", type=Path, default=None,
                   help="the small -> large translator file (default: the shipped one)")
    p.add_argument("--switch-only", action="store_true",
                   help="only the large model after a Session switch: a cheap run to pair "
                        "per chat with a full run of the same items (same --tokens, --kinds, "
                        "--seed) that had another --translator")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    small, tok = load(args.small)
    large, large_tok = load(args.large)
    translators = {("small", "large"): (load_translator(args.translator) if args.translator
                                        else load_shipped(args.small, args.large)),
                   ("large", "small"): load_shipped(args.large, args.small)}
    if args.select is not None:
        for t in translators.values():
            t.spec.recompute_select = args.select
    models = {"small": (small, tok), "large": (large, large_tok)}
    switching, native = Session(models, translators), Session(models, {})
    other = None
    if args.also_select is not None:
        other = Session(models, {k: _selecting(t, args.also_select)
                                 for k, t in translators.items()})
    items = recall_items(heldout_code_filler(), args.items, args.tokens,
                         lambda text: len(tok.encode(text)), kinds=args.kinds.split(","),
                         seed=args.seed, code_filler=heldout_code_filler())
    checkpoint = args.json.with_suffix(".items.jsonl") if args.json else None

    def show(i, item, row):
        print(f"  item {i + 1}/{len(items)} ({item.kind}, {row['context_tokens']} tokens): "
              + ", ".join(f"{s} {'+' if row[s]['right'] else '-'} "
                          f"{row[s]['ttft_s'] * 1e3:.0f} ms" for s in settings_of([row])),
              flush=True)

    rows = checkpointed(items, args.seed, checkpoint, show, lambda item: run_item(
        switching.fresh(), native.fresh(), item, args.small_answer, models,
        translators[("small", "large")], args.switch_only,
        other.fresh() if other is not None else None, args.also_select))
    report(rows, args)


def report(rows, args) -> None:
    """Print the rows' table (:func:`summarise`) and, with ``args.json``, write the
    arguments, the rows and the summary there."""
    summary = summarise(rows)
    print(summary["table"])
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows, "summary": summary}, indent=2))
        print(f"Wrote {args.json}")


def checkpointed(items, seed: int, checkpoint: Optional[Path], show, run_one) -> list:
    """Each item's row: from the checkpoint (JSON lines) when it holds the item, else
    ``run_one(item)``, appended to it at once and shown with ``show(i, item, row)``,
    so that an interrupted run loses at most the item it was on."""
    done = _load(checkpoint)
    rows = []
    for i, item in enumerate(items):
        key = f"{seed}:{i}:{item.kind}:{item.answer}"
        if key not in done:
            done[key] = {**run_one(item), "key": key}
            if checkpoint is not None:
                with open(checkpoint, "a") as f:
                    f.write(json.dumps(done[key]) + "\n")
            show(i, item, done[key])
        rows.append(done[key])
    return rows


def _selecting(translator, way: str):
    """A copy of ``translator`` whose switches choose what to recompute ``way``."""
    other = copy.copy(translator)
    other.spec = dataclasses.replace(translator.spec, recompute_select=way)
    return other


def settings_of(rows) -> list:
    """The settings the rows hold, in table order (SETTINGS, then the switches with
    another selection: ``large after switch (WAY)``)."""
    extra = sorted({k for r in rows for k in r if k.startswith(SETTINGS[0] + " (")})
    present = [s for s in SETTINGS if any(s in r for r in rows)]
    return present[:1] + extra + present[1:]


def run_item(switching: Session, native: Session, item, small_tokens: int, models,
             translator, switch_only: bool = False, other: Optional[Session] = None,
             way: Optional[str] = None) -> dict:
    """One chat three ways, and the one-shot switch (see the module's docstring);
    ``switch_only``: the large model after the Session's switch alone; ``other``: a
    Session whose switch chooses ``way``, on the same chat."""
    paste = PASTE.format(code=item.context)
    question = question_of(item)
    limit = 40 if item.kind == "prints" else 20  # a printed list is longer than a word
    said = switching.generate("small", paste, max_tokens=small_tokens).text
    own = switching.branch(len(switching.messages))
    after_switch = switching.generate("large", question, max_tokens=limit)
    out = {"kind": item.kind, "answer": item.answer,
           "context_tokens": after_switch.context_tokens,
           "translated": after_switch.translated, "recomputed": after_switch.recomputed}
    out[SETTINGS[0]] = scored(after_switch.text, after_switch.ttft_s, item)
    if other is not None:
        other.generate("small", paste, max_tokens=small_tokens)
        r = other.generate("large", question, max_tokens=limit)
        out[f"{SETTINGS[0]} ({way})"] = dict(scored(r.text, r.ttft_s, item),
                                             recomputed=r.recomputed)
    if switch_only:
        return out
    itself = own.generate("small", question, max_tokens=limit)
    reprefilled = native.generate("large", [{"role": "user", "content": paste},
                                            {"role": "assistant", "content": said},
                                            {"role": "user", "content": question}],
                                  max_tokens=limit)
    prompt = list(switching.transcript_of("large").tokens[:after_switch.context_tokens])
    one_shot = run_switch(*models["small"], *models["large"], translator, prompt,
                          max_tokens=limit, compare=False)
    for name, r in zip(SETTINGS[1:3], (reprefilled, itself)):
        out[name] = scored(r.text, r.ttft_s, item)
    out[SETTINGS[3]] = scored(one_shot["switch_answer"], one_shot["switch_ttft_s"], item)
    # Equal time: the re-prefill's cost is close to linear in its length here (a
    # 1.5B's attention is ~5 % of its FLOPs at 2,000 tokens), so the most recent
    # tokens a re-prefill reads in the switch's time are the prompt's length scaled
    # by the two times' ratio (a little fewer than it could read: the baseline's
    # own time is recorded beside it).
    keep = max(1, round(len(prompt) * after_switch.ttft_s / reprefilled.ttft_s))
    ttft, _, text = first_token_time(stream_generate(*models["large"], prompt[-keep:],
                                                     max_tokens=limit))
    out[EQUAL_TIME] = dict(scored(text, ttft, item), tokens=keep)
    blank = native.fresh().generate("large", question, max_tokens=limit)
    out[NO_CONTEXT] = scored(blank.text, blank.ttft_s, item)
    return out


def scored(said: str, ttft_s: float, item) -> dict:
    """One setting's row: what the model said, whether it is right, its first token."""
    return {"said": said, "right": answered(said, item), "ttft_s": ttft_s}


def question_of(item) -> str:
    """The user's question about the pasted module: how a line ends, or what calling
    the function put into it prints (``prints``)."""
    if item.kind == "prints":
        return PRINTS_QUESTION.format(name=re.search(r"(\w+)\(\)", item.cue).group(1))
    return QUESTION.format(cue=item.cue.strip())


def answered(said: str, item) -> bool:
    """A chat answer is right when it starts with the detail, after any quote or code
    mark (a plain word in any case; a name or number as written), or repeats the
    line and goes on with it; a ``prints`` answer when its first line is the output
    (:func:`data.code_questions.stated`)."""
    if item.kind == "prints":
        return printed_output(said, item.answer)
    said = said.strip().lstrip("`\"'*# ")
    cue = item.cue.strip().lstrip("#\"' ").rstrip()
    if said.lower().startswith(cue.lower()):
        said = said[len(cue):]
    return matches(said.lstrip("`\"'* "), item.answer, item.kind in PLAIN_KINDS)


def summarise(rows) -> dict:
    """Accuracy with a 95 % bootstrap interval per setting, by kind, and the question
    turn's median time to first token."""
    lines = ["| setting | right [95% CI] | " + " | ".join(sorted({r['kind'] for r in rows}))
             + " | TTFT (median) |", "|---|---|" + "---|" * len({r['kind'] for r in rows})
             + "---|"]
    out = {}
    kinds = sorted({r["kind"] for r in rows})
    for s in settings_of(rows):
        have = [r for r in rows if s in r]  # a checkpoint from before a setting existed
        if not have:
            continue
        right = [float(r[s]["right"]) for r in have]
        ci = mean_interval(right)
        lo, hi = ci.low, ci.high
        ttft = statistics.median(r[s]["ttft_s"] for r in have)
        by_kind = [sum(r[s]["right"] for r in have if r["kind"] == k) for k in kinds]
        n_kind = [sum(r["kind"] == k for r in have) for k in kinds]
        out[s] = {"right": sum(right) / len(right), "ci": [lo, hi], "ttft_s": ttft,
                  "n": len(have)}
        lines.append(f"| {s} | {sum(right) / len(right):.2f} [{lo:.2f}, {hi:.2f}] | "
                     + " | ".join(f"{a}/{b}" for a, b in zip(by_kind, n_kind))
                     + f" | {ttft * 1e3:.0f} ms |")
    if EQUAL_TIME in out:
        kept = [r[EQUAL_TIME]["tokens"] for r in rows if EQUAL_TIME in r]
        out[EQUAL_TIME]["tokens"] = statistics.median(kept)
        lines.append(f"\nequal-time truncation: the last {statistics.median(kept):.0f} tokens "
                     "(median)")
    if SETTINGS[1] not in out:  # a --switch-only run
        out["table"] = "\n".join(lines)
        return out
    diff = paired_mean_difference([float(r[SETTINGS[1]]["right"]) for r in rows],
                                  [float(r[SETTINGS[0]]["right"]) for r in rows])
    out["switch - re-prefill"] = [diff.value, diff.low, diff.high]
    lines.append(f"\nswitch - re-prefill, paired: {diff.value:+.2f} [{diff.low:+.2f}, "
                 f"{diff.high:+.2f}]")
    for s in settings_of(rows)[1:]:
        if not s.startswith(SETTINGS[0]):
            continue
        have = [r for r in rows if s in r]
        d = paired_mean_difference([float(r[SETTINGS[0]]["right"]) for r in have],
                                   [float(r[s]["right"]) for r in have])
        out[f"{s} - switch"] = [d.value, d.low, d.high]
        lines.append(f"{s} - switch, paired: {d.value:+.2f} [{d.low:+.2f}, {d.high:+.2f}]; "
                     f"first token {out[SETTINGS[1]]['ttft_s'] / out[s]['ttft_s']:.1f}x "
                     "sooner than the re-prefill")
    base = out[SETTINGS[1]]
    out["switch / re-prefill"] = {
        "right": out[SETTINGS[0]]["right"] / base["right"] if base["right"] else None,
        "ttft": base["ttft_s"] / out[SETTINGS[0]]["ttft_s"]}
    lines.append(f"\nswitch / re-prefill: right {out['switch / re-prefill']['right']}, "
                 f"first token {out['switch / re-prefill']['ttft']:.1f}x sooner; median "
                 f"context {statistics.median(r['context_tokens'] for r in rows)} tokens")
    one_shot = out[SETTINGS[3]]["ttft_s"]
    out["session / one-shot ttft"] = out[SETTINGS[0]]["ttft_s"] / one_shot
    lines.append(f"the Session's switch took {out['session / one-shot ttft']:.2f}x the one-shot "
                 f"switch's time to first token ({one_shot * 1e3:.0f} ms); the re-prefill "
                 f"{base['ttft_s'] / one_shot:.1f}x")
    out["table"] = "\n".join(lines)
    return out


def _load(path):
    if path is None or not Path(path).is_file():
        return {}
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return {r["key"]: r for r in rows}


if __name__ == "__main__":
    main()

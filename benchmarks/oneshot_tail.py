"""A one-shot switch of a coding chat (what `mlx-kvlingo switch` does with a chat
prompt) with several native tails: the same chats as `session_code.py` (a user
pastes held-out code, the small model answers, the user asks about a detail), the
small model's cache of the whole prompt switched to the large one, which answers.
With no native tail the question itself is translated; with a tail of m the large
model reads the prompt's last m tokens itself, in its first pass.

    python benchmarks/oneshot_tail.py --tokens 1000 --items 48 --tails 0,16,32 \
        --json benchmarks/results/oneshot-tail-DATE.json

Scored as `session_code.py` scores (the same items for the same --tokens, --items
and --seed, so its re-prefill rows pair with these), with each switch's time to
first token. A rerun with the same --json skips the items its checkpoint holds.
"""
import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse
import json
import statistics
from pathlib import Path

import mlx.core as mx
from session_code import PASTE, QUESTION, answered, checkpointed  # this folder's

from mlx_kvlingo import Session
from mlx_kvlingo.data.recall import heldout_code_filler, recall_items
from mlx_kvlingo.measure.bootstrap import mean_interval, paired_mean_difference
from mlx_kvlingo.models.cache import prefill
from mlx_kvlingo.models.load import load
from mlx_kvlingo.pairs.shipped import load_shipped
from mlx_kvlingo.switching.api import switch
from mlx_kvlingo.switching.generate import generate_after_switch
from mlx_kvlingo.switching.pipeline import first_token_time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", default="qwen2.5-coder-0.5b")
    p.add_argument("--large", default="qwen2.5-coder-1.5b")
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--items", type=int, default=48)
    p.add_argument("--kinds", default="code,identifier,number")
    p.add_argument("--tails", default="0,16,32")
    p.add_argument("--small-answer", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    tails = [int(x) for x in args.tails.split(",")]
    small, tok = load(args.small)
    large, large_tok = load(args.large)
    translator = load_shipped(args.small, args.large)
    chats = Session({"small": (small, tok)}, {})
    items = recall_items(heldout_code_filler(), args.items, args.tokens,
                         lambda text: len(tok.encode(text)), kinds=args.kinds.split(","),
                         seed=args.seed, code_filler=heldout_code_filler())
    checkpoint = args.json.with_suffix(".items.jsonl") if args.json else None

    def show(i, item, row):
        print(f"  item {i + 1}/{len(items)} ({item.kind}): " + ", ".join(
            f"tail {m} {'+' if row[str(m)]['right'] else '-'} "
            f"{row[str(m)]['ttft_s'] * 1e3:.0f} ms" for m in tails), flush=True)

    rows = checkpointed(items, args.seed, checkpoint, show, lambda item: run_item(
        chats.fresh(), small, large, large_tok, translator, item, tails, args.small_answer))
    report = summarise(rows, tails)
    print(report["table"])
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows, "summary": report}, indent=2))


def run_item(chat: Session, small, large, large_tok, translator, item, tails, small_tokens):
    """The chat's prompt for the large model, switched once per native tail."""
    paste = PASTE.format(code=item.context)
    said = chat.generate("small", paste, max_tokens=small_tokens).text
    messages = [{"role": "user", "content": paste}, {"role": "assistant", "content": said},
                {"role": "user", "content": QUESTION.format(cue=item.cue.strip())}]
    prompt = large_tok.apply_chat_template(messages, add_generation_prompt=True)
    source_cache = prefill(small, mx.array(prompt[:-1])[None])
    mx.eval([(c.keys, c.values) for c in source_cache])
    out = {"kind": item.kind, "answer": item.answer, "context_tokens": len(prompt)}
    for m in tails:
        result = switch(small, large, translator, prompt, source_cache=source_cache,
                        native_tail=m, tokenizer=large_tok)
        ttft, _, text = first_token_time(generate_after_switch(large, large_tok, result,
                                                               max_tokens=20))
        out[str(m)] = {"said": text, "right": answered(text, item),
                       "ttft_s": result.translate_s + ttft}
    return out


def summarise(rows, tails) -> dict:
    out, lines = {}, ["| native tail | right [95% CI] | by kind | first token (median) |",
                      "|---|---|---|---|"]
    kinds = sorted({r["kind"] for r in rows})
    for m in tails:
        right = [float(r[str(m)]["right"]) for r in rows]
        ci = mean_interval(right)
        by_kind = " / ".join(f"{sum(r[str(m)]['right'] for r in rows if r['kind'] == k)}"
                             for k in kinds)
        ttft = statistics.median(r[str(m)]["ttft_s"] for r in rows)
        out[str(m)] = {"right": sum(right) / len(right), "ci": [ci.low, ci.high], "ttft_s": ttft}
        lines.append(f"| {m} | {out[str(m)]['right']:.2f} [{ci.low:.2f}, {ci.high:.2f}] | "
                     f"{by_kind} ({', '.join(kinds)}) | {ttft * 1e3:.0f} ms |")
    base = [float(r[str(tails[0])]["right"]) for r in rows]
    for m in tails[1:]:
        d = paired_mean_difference(base, [float(r[str(m)]["right"]) for r in rows])
        out[f"{m} - {tails[0]}"] = [d.value, d.low, d.high]
        lines.append(f"\ntail {m} - tail {tails[0]}, paired: {d.value:+.2f} [{d.low:+.2f}, "
                     f"{d.high:+.2f}]")
    out["table"] = "\n".join(lines)
    return out


if __name__ == "__main__":
    main()

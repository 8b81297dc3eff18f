"""A coding chat routed between a small and a large model, on the `openai` package.

Every turn asks for model "auto": the server lets the small model start the
answer, and when it is unsure (the mean entropy of its first tokens is above the
server's `--auto-entropy`), the large model answers instead: it reads the new
question itself and the conversation before it translated from the small one's
cache rather than re-reading it.
Each turn prints which model answered, why, and what the turn cost.

    mlx-kvlingo fetch-models qwen
    mlx-kvlingo serve --model small=qwen2.5-coder-0.5b --model large=qwen2.5-coder-1.5b \\
        --auto small:large --auto-entropy 0.5 &
    python examples/coding_router.py

    mlx-kvlingo serve --auto small:large &     # the built-in pair (tiny, offline)
    python examples/coding_router.py --max-tokens 8
"""

import argparse

from openai import OpenAI

TURNS = [
    "Write a Python function that returns the second largest number in a list.",
    "What does it return for [3, 3, 1]?",
    "Make it return None when the list has fewer than two distinct numbers.",
    "What is the time complexity?",
]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args(argv)

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    messages = []
    for question in TURNS:
        messages.append({"role": "user", "content": question})
        reply = client.chat.completions.create(model="auto", messages=messages,
                                               max_tokens=args.max_tokens)
        answer = reply.choices[0].message.content
        messages.append({"role": "assistant", "content": answer})
        stats = (reply.model_extra or {}).get("kvlingo", {})
        route = stats.get("route", {})
        why = (f"entropy {route['entropy']:.2f} after {route['probe_tokens']} tokens"
               if "entropy" in route else "no probe")
        print(f"user: {question}\n[{reply.model}] {answer}")
        print(f"  -> answered by {reply.model} ({'escalated' if route.get('escalated') else 'kept'},"
              f" {why}); context {stats.get('context_tokens')} tokens, "
              f"{stats.get('translated_tokens')} translated, {stats.get('prefilled_tokens')} "
              f"prefilled, first token after {stats.get('ttft_ms') or 0:.0f} ms\n")


if __name__ == "__main__":
    main()

"""A chat client on the `openai` package, talking to `mlx-kvlingo serve`.

What a local chat app does: it resends the whole message list at every turn and
names the model it wants. Here the conversation alternates between the two
served models; the server recognises the conversation by its messages and the
model taking a turn translates what the other one wrote instead of re-reading it.
Each turn prints the answer and the server's own account of what it cost.

    mlx-kvlingo serve --model smol=smollm2 --model gemma=gemma3 &    # real pair
    python examples/openai_client.py --small smol --large gemma

    mlx-kvlingo serve &                                               # built-in pair
    python examples/openai_client.py                                  # small / large
"""

import argparse

from openai import OpenAI

QUESTIONS = [
    "What does the zip function do in Python?",
    "Show a short example.",
    "And what does enumerate do?",
    "Which of the two would you use to number the lines of a file?",
]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    p.add_argument("--small", default="small")
    p.add_argument("--large", default="large")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args(argv)

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    print("models:", ", ".join(m.id for m in client.models.list().data))
    messages = []
    for i, question in enumerate(QUESTIONS):
        model = (args.small, args.large)[i % 2]
        messages.append({"role": "user", "content": question})
        print(f"\n[{model}] user: {question}\n[{model}] assistant: ", end="", flush=True)
        answer, stats = "", None
        stream = client.chat.completions.create(model=model, messages=messages,
                                                max_tokens=args.max_tokens, stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                answer += chunk.choices[0].delta.content
                print(chunk.choices[0].delta.content, end="", flush=True)
            stats = (chunk.model_extra or {}).get("kvlingo") or stats
        messages.append({"role": "assistant", "content": answer})
        print(f"\n  -> {stats['model']}: context {stats['context_tokens']} tokens, "
              f"{stats['cached_tokens']} cached, {stats['translated_tokens']} translated, "
              f"{stats['prefilled_tokens']} prefilled, first token after "
              f"{stats['ttft_ms']:.0f} ms")


if __name__ == "__main__":
    main()

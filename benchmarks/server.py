"""Time to first token through `mlx-kvlingo serve` (HTTP, the `openai` client).

1. A switch turn: SmolLM2 reads a long user message (a held-out stdlib text of
   about N SmolLM2 tokens) and answers one token; then the client sends the next
   turn to Gemma 3. Timed: from sending that request to its first content delta
   (streamed), with the context translated (a server with translators) vs
   re-prefilled (a server without: the "forced re-prefill" fallback). N = 256,
   1024, 4096.
2. Concurrency: K clients each switch an existing ~256-token conversation to
   Gemma at the same moment; p50 / p95 of their TTFTs for K = 1, 2, 4, 8 (one
   worker runs all model work, so later requests wait in the queue).

    python benchmarks/server.py --json benchmarks/results/server.json \
        --markdown benchmarks/results/server.md [--translator smol:gemma=FILE]

Without --translator the maps are random (timing only: a translator of the same
shape costs the same whatever its values), three source layers per map like the
fitted cross-tokenizer ones.
"""

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import openai

import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)
from mlx_kvlingo.chat.session import Session
from mlx_kvlingo.data import corpus as data
from mlx_kvlingo.measure.ttft import environment
from mlx_kvlingo.models import pretrained
from mlx_kvlingo.models.load import load
from mlx_kvlingo.serve.conversations import ConversationStore
from mlx_kvlingo.serve.server import ServerConfig, make_server
from mlx_kvlingo.translator.maps import Translator, load_translator


def start(base):
    store = ConversationStore(base, max_conversations=64)
    server = make_server(store, port=0, max_queue=64, config=ServerConfig(max_tokens=64))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                 timeout=3600)


def context_text(tokenizer, texts, n: int, nonce: str) -> str:
    """``nonce`` + held-out text cut to about ``n`` tokens of ``tokenizer``."""
    text = nonce + "\n" + "\n\n".join(texts)
    ids = tokenizer.encode(text, add_special_tokens=False)[:n]
    return tokenizer.decode(ids)


def switch_ttft(client, text: str, source: str, target: str) -> dict:
    msgs = [{"role": "user", "content": text}]
    first = client.chat.completions.create(model=source, messages=msgs, max_tokens=1)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Summarize that in one sentence."}]
    t0 = time.perf_counter()
    ttft, stats = None, {}
    for chunk in client.chat.completions.create(model=target, messages=msgs, max_tokens=4,
                                                stream=True):
        if not chunk.choices:
            continue
        if ttft is None and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - t0
        if chunk.choices[0].finish_reason:
            stats = chunk.model_extra["kvlingo"]
    return {"ttft_s": ttft, "translated": stats["translated_tokens"],
            "prefilled": stats["prefilled_tokens"], "context": stats["context_tokens"],
            "translate_ms": stats["translate_ms"], "server_ttft_ms": stats["ttft_ms"],
            "warnings": len(stats["warnings"])}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path("server.json"))
    p.add_argument("--markdown", type=Path, default=Path("server.md"))
    p.add_argument("--contexts", default="256,1024,4096")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--streams", default="1,2,4,8")
    p.add_argument("--stream-context", type=int, default=256)
    p.add_argument("--translator", default=None, help="smol:gemma=FILE (default: random maps)")
    args = p.parse_args(argv)

    t_start = time.perf_counter()
    smol, stok = load(pretrained.fetch("smollm2"))
    gemma, gtok = load(pretrained.fetch("gemma3"))
    if args.translator:
        t = load_translator(args.translator.partition("=")[2])
        kind = f"file {args.translator}"
    else:
        t = Translator.for_models(smol, gemma, stok, gtok, sources_per_layer=3)
        kind = "random maps, 3 source layers per map (timing only)"
    models = {"smol": (smol, stok), "gemma": (gemma, gtok)}
    # The translation alone (not a file's default recompute), as the figures were taken.
    translate_srv, translate = start(
        Session(models, {("smol", "gemma"): t}, recompute=0.0, break_even=0))
    prefill_srv, reprefill = start(Session(models))  # no translator: gemma re-prefills
    _, heldout = data.split_documents(data.stdlib_documents())
    texts = [t for _, t in heldout]

    rows = []
    for n in [int(x) for x in args.contexts.split(",")]:
        for mode, client in (("translate", translate), ("re-prefill", reprefill)):
            runs = [switch_ttft(client, context_text(stok, texts, n, f"Document {n}-{mode}-{r}"),
                                "smol", "gemma") for r in range(args.repeats)]
            row = {"context": n, "mode": mode, "runs": runs,
                   "ttft_s_median": statistics.median(r["ttft_s"] for r in runs)}
            rows.append(row)
            print(f"{n:>5} {mode:<10} TTFT {row['ttft_s_median'] * 1e3:8.0f} ms "
                  f"(translated {runs[-1]['translated']}, prefilled {runs[-1]['prefilled']})",
                  flush=True)

    concurrency = []
    for k in [int(x) for x in args.streams.split(",") if x.strip()]:
        convs = []
        for i in range(k):  # set up (not timed): each client's conversation on smol
            text = context_text(stok, texts, args.stream_context, f"Stream {k}-{i}")
            msgs = [{"role": "user", "content": text}]
            first = translate.chat.completions.create(model="smol", messages=msgs, max_tokens=1)
            convs.append(msgs + [{"role": "assistant", "content": first.choices[0].message.content},
                                 {"role": "user", "content": "Summarize that."}])
        barrier, ttfts = threading.Barrier(k), [None] * k

        def client_thread(i):
            barrier.wait()
            t0 = time.perf_counter()
            for chunk in translate.chat.completions.create(model="gemma", messages=convs[i],
                                                           max_tokens=4, stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    ttfts[i] = time.perf_counter() - t0
                    break

        threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(k)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        s = sorted(ttfts)
        row = {"streams": k, "ttft_s": ttfts, "p50_s": statistics.median(s),
               "p95_s": s[min(len(s) - 1, int(round(0.95 * (len(s) - 1))))]}
        concurrency.append(row)
        print(f"{k} streams: p50 {row['p50_s'] * 1e3:.0f} ms, p95 {row['p95_s'] * 1e3:.0f} ms",
              flush=True)
    translate_srv.close()
    prefill_srv.close()

    out = {"benchmark": "server", "translator": kind, "environment": environment(),
           "seconds": round(time.perf_counter() - t_start, 1), "switch": rows,
           "concurrency": concurrency, "stream_context": args.stream_context}
    args.json.write_text(json.dumps(out, indent=2))
    md = ["# TTFT through `mlx-kvlingo serve` (SmolLM2-135M -> Gemma 3 270M, float32, CPU)",
          "", f"Translator: {kind}. Medians of {args.repeats}; TTFT measured by the `openai` "
          "client from sending the switch request to its first content delta (HTTP on "
          "loopback included).", "",
          "| context (SmolLM2 tokens) | Gemma context | translate: TTFT | tokens translated "
          "| re-prefill: TTFT | speed-up |", "|---:|---:|---:|---:|---:|---:|"]
    by = {(r["context"], r["mode"]): r for r in rows}
    for n in sorted({r["context"] for r in rows}):
        a, b = by[n, "translate"], by[n, "re-prefill"]
        md.append(f"| {n} | {a['runs'][-1]['context']} | {a['ttft_s_median'] * 1e3:.0f} ms "
                  f"| {a['runs'][-1]['translated']} | {b['ttft_s_median'] * 1e3:.0f} ms "
                  f"| {b['ttft_s_median'] / a['ttft_s_median']:.1f}x |")
    md += ["", f"Concurrent switch turns (each ~{args.stream_context}-token context, all "
           "sent at once; one worker serves them in turn):", "",
           "| streams | p50 TTFT | p95 TTFT |", "|---:|---:|---:|"]
    md += [f"| {r['streams']} | {r['p50_s'] * 1e3:.0f} ms | {r['p95_s'] * 1e3:.0f} ms |"
           for r in concurrency]
    args.markdown.write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()

"""How far a switch's translated cache rows are from the target's own, by kind of token,
on text a translator was trained on and on text it never read.

For ``--windows`` windows of ``--context`` target tokens of each corpus (as
``cbr_defaults.py`` draws them), the context is translated with the shipped file
(no native tail, nothing recomputed) and prefilled by the target; per position, the
relative squared error |translated - native|^2 / |native|^2 of its keys and of its
values, averaged over the target's layers, then over the positions of each kind
(the target token's text: a word, punctuation, a digit, whitespace, or containing a
newline).

    python benchmarks/kv_error_by_token.py --source smollm2 --target gemma3
"""
import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)

import argparse

import mlx.core as mx
import numpy as np
from cbr_defaults import windows  # this folder's

from mlx_kvlingo.models.cache import prefill
from mlx_kvlingo.models.load import load_pair
from mlx_kvlingo.pairs.shipped import load_shipped
from mlx_kvlingo.switching.api import switch_text
from mlx_kvlingo.translator.align import tokenize_with_offsets


def kind(text: str) -> str:
    if "\n" in text:
        return "newline"
    if not text.strip():
        return "space"
    if any(c.isalpha() for c in text):
        return "word"
    if any(c.isdigit() for c in text):
        return "digit"
    return "punct"


def relative_errors(translated, native, n: int):
    """Per position < n: the keys' and the values' relative squared error, averaged
    over layers."""
    ek, ev = np.zeros(n), np.zeros(n)
    for a, b in zip(translated, native):
        for total, x, y in ((ek, a.keys, b.keys), (ev, a.values, b.values)):
            x, y = np.array(x[..., :n, :]), np.array(y[..., :n, :])
            total += ((x - y) ** 2).sum((0, 1, 3)) / np.maximum((y ** 2).sum((0, 1, 3)), 1e-9)
    return ek / len(translated), ev / len(translated)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="smollm2")
    ap.add_argument("--target", default="gemma3")
    ap.add_argument("--corpus", action="append", default=None,
                    help="default: fortunes and austen")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8)
    args = ap.parse_args()
    src, stok, tgt, ttok = load_pair(args.source, args.target)
    translator = load_shipped(args.source, args.target)
    print(f"{args.source} -> {args.target}, {args.windows} windows of {args.context} tokens: "
          "positions, mean relative squared error of keys / values\n")
    print("| corpus | " + " | ".join(["word", "punct", "digit", "space", "newline"]) + " |")
    print("|---|---|---|---|---|---|")
    for corpus in args.corpus or ["fortunes", "austen"]:
        errors = {}
        for text, _ in windows(ttok, corpus, args.context, 64, args.windows, 0):
            ids, offsets = tokenize_with_offsets(ttok, text)
            source_tokens = tokenize_with_offsets(stok, text)
            source_cache = prefill(src, mx.array(source_tokens[0])[None])
            switched = switch_text(src, stok, tgt, ttok, translator, text,
                                   source_cache=source_cache, source_tokens=source_tokens,
                                   native_tail=0, recompute=0.0)
            held = switched.prompt_cache  # every context position but the pending last
            n = min(c.offset for c in held)
            ek, ev = relative_errors(held, prefill(tgt, mx.array(ids)[None]), n)
            for i in range(1, n):  # position 0 (BOS) is the target's own
                a, b = offsets[i]
                errors.setdefault(kind(text[a:b]), []).append((ek[i], ev[i]))
        cells = []
        for k in ["word", "punct", "digit", "space", "newline"]:
            e = np.array(errors.get(k, np.zeros((0, 2))))
            cells.append(f"{len(e)}: {e[:, 0].mean():.3f} / {e[:, 1].mean():.3f}" if len(e)
                         else "")
        print(f"| {corpus} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

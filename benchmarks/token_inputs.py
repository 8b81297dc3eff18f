"""Stage 1 with and without token maps, from one shared Gram: what the target's own
token embeddings buy the maps of chosen target layers (``train --token-layers``).

One pass over ``--windows`` training windows accumulates the shared Gram of every
source layer *plus* the target's token inputs (models.token_inputs: the embeddings
of each token and of the token before it). Both translators come from those same
moments and the same layer choice (each map's top-k source layers by single-layer
R²): one without token maps, one whose maps for ``--token-layers`` also read the
token inputs. They are scored on the same held-out windows (CBR, KL, top-1,
attention-output cosine per layer, native tails 0 and 16), with paired intervals.

    python benchmarks/token_inputs.py --source smollm2 --target gemma3 \\
        --windows 48 --eval-windows 48 --json benchmarks/results/token-inputs.json
"""

import argparse
import json
import time
from dataclasses import replace

import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)
from mlx_kvlingo.data import corpus as data
from mlx_kvlingo.measure.evaluate import cbr_difference, evaluate_pair
from mlx_kvlingo.models.features import token_features, token_inputs
from mlx_kvlingo.models.load import load_pair
from mlx_kvlingo.train.fit import GramAccumulator, accumulate_features
from mlx_kvlingo.train.recipe import resolve_token_layers
from mlx_kvlingo.train.samples import SharedTokens, pair_data
from mlx_kvlingo.translator.maps import Translator


def _shared_features(src, tgt, pair, windows: int, context_len: int):
    for tokens in data.token_windows(pair.train_stream, context_len, 1, windows):
        sk, sv, _ = token_features(src, tokens)
        tk, tv, _ = token_features(tgt, tokens)
        yield sk, sv, tk, tv, token_inputs(tgt, tokens, 0, tokens.shape[1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", default="smollm2")
    p.add_argument("--target", default="gemma3")
    p.add_argument("--corpus", default="stdlib", help="training and held-out text")
    p.add_argument("--windows", type=int, default=48, help="training windows for the fit")
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--sources-per-layer", type=int, default=18)
    p.add_argument("--token-layers", default="full")
    p.add_argument("--ridge", type=float, default=1e-3)
    p.add_argument("--eval-windows", type=int, default=48)
    p.add_argument("--native-tails", default="0,16")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    src, stok, tgt, ttok = load_pair(args.source, args.target)
    pair = pair_data(args.corpus, stok, ttok)
    layers = resolve_token_layers(args.token_layers, tgt)
    t = Translator.for_models(src, tgt, stok, ttok, token_layers=layers)
    geo_s = t.spec.source.cache_geometry.layers
    geo_t = t.spec.target.cache_geometry.layers
    every = list(range(len(geo_s)))
    t0 = time.perf_counter()
    if isinstance(pair, SharedTokens):  # one tokenizer: windows both models read alike
        features = _shared_features(src, tgt, pair, args.windows, args.context_len)
        skip = t.spec.native_prefix
    else:
        features = pair.fit_features(src, tgt, t, args.windows, args.context_len, layers=every)
        skip = 0
    acc = accumulate_features(GramAccumulator([g.width for g in geo_s], [g.width for g in geo_t],
                                      t.spec.token_width),
                      features, skip, None, None)
    fit_s = time.perf_counter() - t0
    print(f"Gram over {acc.count} positions ({args.windows} windows) in {fit_s:.0f}s", flush=True)
    layer_map = [r[: args.sources_per_layer] for r in acc.ranked_layers(args.ridge)]
    plain, plain_report = acc.translator(replace(t.spec, token_layers=[], token_width=0),
                                         layer_map, args.ridge)
    tok, tok_report = acc.translator(t.spec, layer_map, args.ridge)

    tails = [int(x) for x in args.native_tails.split(",")]
    items = pair.heldout(args.context_len, 48, args.eval_windows)
    t1 = time.perf_counter()
    rows = evaluate_pair(pair, src, tgt, [plain, tok], items, args.context_len, tails)
    eval_s = time.perf_counter() - t1
    out = {"settings": vars(args), "token_layers": layers, "fit_positions": acc.count,
           "fit_s": round(fit_s, 1), "eval_s": round(eval_s, 1),
           "fit_r2": {"plain": plain_report.to_dict(), "token_maps": tok_report.to_dict()},
           "rows": [], "differences": []}
    for name, offset in (("plain", 0), ("token maps", len(tails))):
        for j, m in enumerate(tails):
            r = rows[offset + j]
            out["rows"].append(dict(r.to_dict(), translator=name))
            lo, hi = r.cbr_interval()
            print(f"{name:10s} tail {m:2d}: CBR {r.cbr:.1%} [{lo:.1%}, {hi:.1%}]  KL {r.kl:.3f}  "
                  f"top-1 {r.top1:.1%}  attention cosine "
                  + " ".join(f"{i}:{r.attention_cosine[i]:.3f}" for i in layers), flush=True)
    for j, m in enumerate(tails):
        d, (lo, hi) = cbr_difference(rows[len(tails) + j], rows[j])
        out["differences"].append({"native_tail": m, "cbr": d, "ci95": [lo, hi]})
        print(f"token maps - plain, tail {m}: {d * 100:+.1f} [{lo * 100:+.1f}, {hi * 100:+.1f}] points")
    for i in layers:
        print(f"layer {i} fit R2 keys {plain_report.r2_keys[i]:.3f} -> {tok_report.r2_keys[i]:.3f}, "
              f"values {plain_report.r2_values[i]:.3f} -> {tok_report.r2_values[i]:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

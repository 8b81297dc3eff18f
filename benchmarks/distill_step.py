"""Cost of one stage-2 step: fresh frozen passes vs the feature store, side by side.

The shapes of the shipped recipe: 2 sequences of 512-token contexts and
64-token continuations, SmolLM2-135M -> Gemma 3 270M (the 262k-vocabulary target,
the expensive direction) and back. For each repeat, in one process and interleaved:

- fresh: the source's prefill of the context, the teacher's prefill and
  full-vocabulary log-probs (``prepare``), then the gradient step (``update``) —
  what every step cost before the store;
- stored: the same samples read back from the store's shards (float16 features,
  top-k teacher), then the gradient step with the top-k + tail KL.

Medians over repeats; the ratio is what a step got cheaper. Timings taken while
other jobs share the machine are only comparable as ratios within one run.

    python benchmarks/distill_step.py --json benchmarks/results/distill-step.json
    python benchmarks/distill_step.py --rank 16 ...  # also the stored step of `train --rank 16`

(`--rank R`: a third path, the same stored batches training a rank-R correction on
frozen maps, whose backward skips the full maps' weight gradients; as in `train`, the
frozen maps run once per sample (timed apart, and amortized over the recipe's 300 / 48
epochs) and every later step reuses their outputs.)
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx_kvlingo  # noqa: F401  (first: fast BLAS before mlx.core)
from mlx_kvlingo.data import corpus as data
from mlx_kvlingo.measure.ttft import environment
from mlx_kvlingo.models.load import load
from mlx_kvlingo.train.distill import DistillConfig, Distiller
from mlx_kvlingo.train.loop import RunConfig
from mlx_kvlingo.train.samples import AlignedText
from mlx_kvlingo.train.store import FeatureStore
from mlx_kvlingo.translator.maps import Translator


def time_direction(source, target, repeats: int, context: int, topk: int, tail: int,
                   rank: int = 0, sources_per_layer: int = 4, epochs: float = 300 / 48) -> dict:
    src, src_tok = load(source)
    tgt, tgt_tok = load(target)
    translator = Translator.for_models(src, tgt, src_tok, tgt_tok,
                                       sources_per_layer=sources_per_layer)
    train, heldout = data.split_documents(data.read_corpus("stdlib"))
    text = "\n\n".join(t for _, t in train)
    pair = AlignedText(src_tok, tgt_tok, text, text)
    config = RunConfig(DistillConfig(batch_size=2, accumulate=1, lr=1e-5),
                       context_lengths=(context,), continuation_len=64)
    fresh_cfg = DistillConfig(batch_size=2, accumulate=1, lr=1e-5)
    stored_cfg = DistillConfig(batch_size=2, accumulate=1, lr=1e-5, teacher_topk=topk,
                               native_tail=tail)
    def copy():  # each path trains its own maps
        t = Translator(translator.spec)
        t.update(translator.parameters())
        return t

    fresh, stored = Distiller(translator, tgt, fresh_cfg), Distiller(copy(), tgt, stored_cfg)
    lowrank = None
    if rank:  # the same stored step training a rank-R correction on frozen maps
        lowrank = Distiller(copy(), tgt, DistillConfig(batch_size=2, accumulate=1, lr=1e-4,
                                                       teacher_topk=topk, native_tail=tail,
                                                       rank=rank))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = FeatureStore(Path(tmp), {"bench": 1}, pool=repeats + 1, teacher_topk=topk,
                             log=lambda m: None)

        def compute(v):
            return pair.step_batches(src, tgt, translator, config, v)

        for r in range(repeats + 1):  # the first round warms up
            t0 = time.perf_counter()
            batches = compute(r)
            t1 = time.perf_counter()
            fresh.train_step(batches)
            t2 = time.perf_counter()
            store.get(r, lambda v: batches)  # write the shard (not timed)
            t3 = time.perf_counter()
            cached = store._read(store.shard(r))
            t4 = time.perf_counter()
            stored.train_step(cached)
            t5 = time.perf_counter()
            if lowrank is not None:  # as `train` does: the frozen maps run once per sample
                attached = lowrank.with_frozen_outputs(cached, {}, r)
                t6 = time.perf_counter()
                lowrank.train_step(attached)
            t7 = time.perf_counter()
            if r:
                rows.append(dict(fresh_prepare_s=t1 - t0, fresh_update_s=t2 - t1,
                                 stored_read_s=t4 - t3, stored_update_s=t5 - t4))
                if lowrank is not None:
                    rows[-1][f"stored_rank{rank}_frozen_s"] = t6 - t5
                    rows[-1][f"stored_rank{rank}_update_s"] = t7 - t6
            shard_mb = store.shard(r).stat().st_size / 2**20
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    fresh_s = med["fresh_prepare_s"] + med["fresh_update_s"]
    stored_s = med["stored_read_s"] + med["stored_update_s"]
    out = dict(source=source, target=target, context=context, continuation=64, sequences=2,
               teacher_topk=topk, native_tail=tail, repeats=repeats, medians=med,
               fresh_step_s=fresh_s, stored_step_s=stored_s, ratio=fresh_s / stored_s,
               shard_mb=shard_mb, rows=rows)
    if rank:
        # A sample's frozen-map outputs are computed on its first step and reused on
        # every later epoch over the pool: amortized over `train`'s epochs
        # (steps / store pool; 300 / 48 in the recipe).
        lowrank_s = med["stored_read_s"] + med[f"stored_rank{rank}_update_s"]
        amortized_s = lowrank_s + med[f"stored_rank{rank}_frozen_s"] / epochs
        out.update(rank=rank, stored_lowrank_step_s=lowrank_s, ratio_lowrank=fresh_s / lowrank_s,
                   epochs=epochs, stored_lowrank_amortized_s=amortized_s,
                   ratio_lowrank_amortized=fresh_s / amortized_s)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path("distill-step.json"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--rank", type=int, default=0,
                   help="Also time the stored step training a rank-R correction (--rank of train).")
    p.add_argument("--sources-per-layer", type=int, default=4)
    args = p.parse_args(argv)
    results = []
    for source, target, topk in (("smollm2", "gemma3", 128), ("gemma3", "smollm2", 0)):
        r = time_direction(source, target, args.repeats, args.context, topk, tail=16,
                           rank=args.rank, sources_per_layer=args.sources_per_layer)
        results.append(r)
        m = r["medians"]
        print(f"{source} -> {target}: fresh step {r['fresh_step_s']:.2f}s "
              f"(prepare {m['fresh_prepare_s']:.2f} + update {m['fresh_update_s']:.2f}), "
              f"stored step {r['stored_step_s']:.2f}s (read {m['stored_read_s']:.2f} + update "
              f"{m['stored_update_s']:.2f}): {r['ratio']:.1f}x cheaper; shard {r['shard_mb']:.1f} MB"
              + (f"; stored rank-{args.rank} step {r['stored_lowrank_step_s']:.2f}s: "
                 f"{r['ratio_lowrank']:.1f}x ({r['stored_lowrank_amortized_s']:.2f}s, "
                 f"{r['ratio_lowrank_amortized']:.1f}x with the frozen maps' once-per-sample "
                 f"run amortized over {r['epochs']:.2f} epochs)" if args.rank else ""))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"environment": environment(), "results": results}, indent=1))
    print(f"Wrote {args.json}")


if __name__ == "__main__":
    main()

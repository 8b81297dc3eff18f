"""Train a translator for your own pair of models: stage 1, then a short stage 2.

Runs as it stands on the built-in pair (offline, about a minute on a laptop CPU):

    python examples/train_translator.py --out /tmp/small-to-large.safetensors

Stage 1 fits every map in closed form (least squares) on the standard library's
docstrings; stage 2 distils the maps through the frozen target, streaming fresh
samples each step, with a held-out evaluation at the start and the end. Point
--source / --target at your own mlx-lm models (sharing a tokenizer) and raise
--steps (and lower --lr for deep targets: 1e-3 diverges on 30 layers) for a real run.
"""

import argparse
from pathlib import Path

import mlx_kvlingo as kv  # first: fast BLAS on Linux, before mlx.core
from mlx_kvlingo.data import corpus as data
from mlx_kvlingo.pairs import toy
from mlx_kvlingo.train.distill import DistillConfig
from mlx_kvlingo.train.fit import fit_stage1
from mlx_kvlingo.train.loop import RunConfig, train
from mlx_kvlingo.train.samples import SharedTokens

p = argparse.ArgumentParser(description="Stage 1 + a few stage-2 steps.")
p.add_argument("--source", help="source model (default: the built-in pair's small model)")
p.add_argument("--target", help="target model (default: the built-in pair's large model)")
p.add_argument("--out", type=Path, default=Path("translator.safetensors"))
p.add_argument("--fit-tokens", type=int, default=20_000)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--lr", type=float, default=1e-4)
p.add_argument("--context", type=int, default=128)
args = p.parse_args()

if not (args.source and args.target):
    source_dir, target_dir = toy.ensure_toy_pair()
    args.source, args.target = args.source or source_dir, args.target or target_dir
source, tokenizer = kv.load(args.source)
target, target_tokenizer = kv.load(args.target)

# Text: the standard library's docstrings, split into training and held-out documents.
train_docs, heldout_docs = data.split_documents(data.stdlib_documents())
train_stream = data.token_stream(tokenizer, train_docs)
heldout_stream = data.token_stream(tokenizer, heldout_docs)

# Stage 1: closed-form least squares from streamed moments.
translator = kv.Translator.for_models(source, target, tokenizer, target_tokenizer)
windows = data.token_windows(train_stream, args.context, 8, args.fit_tokens // args.context)
report = fit_stage1(source, target, translator, windows)
print(f"stage 1: {report.tokens} positions in {report.seconds:.1f}s, mean R² keys "
      f"{report.to_dict()['mean_r2_keys']:.3f}, values {report.to_dict()['mean_r2_values']:.3f}")

# Stage 2: distillation, KL(target on its own cache ‖ target on the translated cache).
config = RunConfig(
    DistillConfig(steps=args.steps, lr=args.lr, batch_size=2, accumulate=2),
    context_lengths=(args.context,),
    continuation_len=32,
    eval_every=args.steps,  # evaluate at the start and at the end
    eval_windows=8,
    checkpoint_every=args.steps,
)


def progress(record):
    if "eval" in record:
        e = record["eval"]
        print(f"  eval @ step {record['step']}: KL {e['kl']:.4f}, top-1 {e['top1']:.1%}, "
              f"CBR {e['cbr']:.1%}")
    else:
        print(f"  step {record['step']}: loss {record['loss']:.4f}")


summary = train(source, target, translator, SharedTokens(train_stream, heldout_stream),
                args.out, config, progress=progress)
print(f"stage 2: {summary['steps']} steps in {summary['seconds']:.1f}s; wrote {args.out} "
      f"(log and plot beside it)")

# The file loads back and is checked against the models before use.
trained = kv.load_translator(args.out)
trained.check_models(source, target, tokenizer, target_tokenizer)
print(f"translator {trained.spec.source.name} -> {trained.spec.target.name}, "
      f"training stage {trained.spec.training.get('stage')}")

"""The embedded default pair: two small models built and trained here, no hub needed.

``mlx-kvlingo demo`` and the tests need two *different* models that read the same
tokens and actually use their context. Nothing can be downloaded at test time, so
this module trains a byte-level BPE tokenizer and two small transformers of
different shape (a qwen3 and a llama, different depth, head count and width),
and saves each as an ordinary mlx-lm model directory that ``mlx_lm.load`` opens.
The shipped pair's recipe is build_toy_pair with a shared embedding: a copy task,
then docstrings rewritten so that passages and names recur, so that the models
copy from their context; the target's token embedding is a fixed isometry of the
source's, as in a model family, which is what lets linear maps carry the copying
(builtin-pair-training.md, run 12). The first release's recipe
(build_docstring_pair: plain docstrings) made a pair that barely used its context.
"""

import json
import math
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Callable, List, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from .. import files
from ..data.corpus import split_documents, stdlib_documents, token_stream, token_windows
from ..train import recipe
from ..train.distill import DistillConfig, Distiller
from ..train.loop import RunConfig
from ..train.samples import SharedTokens, sample_windows
from ..translator.maps import load_translator

VOCAB_SIZE = 1024

# Two models of different geometry: depth 4 vs 6, 2 vs 3 KV heads, head_dim 32 vs 24.
PAIR_CONFIGS = {
    "source": dict(
        model_type="qwen3",
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=384,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=10000.0,
    ),
    "target": dict(
        model_type="llama",
        hidden_size=144,
        num_hidden_layers=6,
        intermediate_size=384,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=24,
        rope_theta=10000.0,
    ),
}
COMMON = dict(
    rms_norm_eps=1e-5,
    vocab_size=VOCAB_SIZE,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


# ---------------------------------------------------------------------------
# Training text in which things recur


def _passages(text: str, min_chars: int = 80, max_chars: int = 220) -> List[str]:
    """Sentence runs of about min_chars..max_chars, in order (longer sentences cut)."""
    sentences = re.split(r"(?<=[.!?:])\s+|\n\s*\n", text)
    out, buf = [], ""
    for s in sentences:
        s = " ".join(s.split())
        if not s:
            continue
        buf = f"{buf} {s}" if buf else s
        if len(buf) >= min_chars:
            out.append(buf[:max_chars])
            buf = ""
    return out


def _invented_name(rng: random.Random) -> str:
    """A pronounceable word no model can guess without having seen it."""
    syllables = [rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(2, 4))]
    return "".join(syllables)


def recurring_documents(
    docs,
    seed: int = 0,
    passages_per_doc: int = 4,
    occurrences: int = 12,
    names_per_doc: int = 3,
):
    """Documents in which passages and names recur, built from ``docs``.

    Plain docstrings barely reward looking back (the old built-in target gained
    0.09 nats/token from 256 tokens of context), so CBR measured on them was noise.
    Here each document takes a few consecutive passages of one source document,
    renames a few of their words to invented names (consistently within the
    document), states every passage once and then repeats them in random order.
    A model that copies from its context predicts most of a held-out window from
    it (repeated text, invented names only the context predicts), so a good
    translator must carry that over. Build held-out documents from held-out
    sources only.
    """
    rng = random.Random(seed)
    out = []
    for name, text in docs:
        ps = _passages(text)
        for g in range(0, len(ps) - passages_per_doc + 1, passages_per_doc):
            group = ps[g : g + passages_per_doc]
            group = _rename_words(group, names_per_doc, rng)
            order = list(range(passages_per_doc))
            while len(order) < occurrences:
                i = rng.randrange(passages_per_doc)
                if i != order[-1]:
                    order.append(i)
            out.append((f"{name}#{g // passages_per_doc}", "\n\n".join(group[i] for i in order)))
    return out


def _rename_words(passages: List[str], count: int, rng: random.Random) -> List[str]:
    words = sorted({w for p in passages for w in re.findall(r"\b[A-Za-z]{5,}\b", p)})
    if not words:
        return passages
    chosen = rng.sample(words, min(count, len(words)))
    names = {w: _invented_name(rng) for w in chosen}
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, chosen)) + r")\b")
    return [pattern.sub(lambda m: names[m.group(0)], p) for p in passages]


def toy_corpus(seed: int = 0):
    """(train, held-out) recurring documents from the stdlib's docstrings, split by
    source document: what the demo measures the built-in pair on."""
    train, heldout = split_documents(stdlib_documents())
    return recurring_documents(train, seed), recurring_documents(heldout, seed + 1)


def copy_task_documents(n_tokens: int, vocab_size: int = VOCAB_SIZE, seed: int = 0,
                        spans_per_doc: int = 4, occurrences: int = 12, span_len=(8, 32)):
    """Token documents of random spans that recur, about ``n_tokens`` in all.

    Nothing in them is predictable except by finding the earlier occurrence of
    the current span and copying what followed it: all the gradient they give
    pushes towards copying (induction). Evaluation never uses them. The 4-layer
    source needed ~3,400 steps of 32 x 64 tokens of them before it copied
    (build_toy_pair's phase 1)."""
    rng = random.Random(seed)
    docs, total = [], 0
    while total < n_tokens:
        spans = [[rng.randrange(1, vocab_size) for _ in range(rng.randint(*span_len))]
                 for _ in range(spans_per_doc)]
        order = list(range(spans_per_doc))
        while len(order) < occurrences:
            i = rng.randrange(spans_per_doc)
            if i != order[-1]:
                order.append(i)
        doc = [t for i in order for t in spans[i]]
        docs.append(doc)
        total += len(doc)
    return docs


def training_stream(tokenizer, copy_fraction: float = 0.5, seed: int = 0) -> List[int]:
    """The built-in pair's training tokens: recurring documents from the training
    docstrings, shuffled together with copy-task documents (``copy_fraction`` of
    all tokens)."""
    docs = [tokenizer.encode(text + "\n\n", add_special_tokens=False)
            for _, text in toy_corpus(seed)[0]]
    n_text = sum(map(len, docs))
    docs += copy_task_documents(int(n_text * copy_fraction / (1 - copy_fraction)), seed=seed)
    random.Random(seed).shuffle(docs)
    return [t for d in docs for t in d]


def toy_pair_data(tokenizer, corpus=None):
    """The built-in pair's training and held-out token streams, as a SharedTokens
    (``corpus``: what toy_corpus() returned, to save reading the stdlib again)."""
    train, heldout = corpus or toy_corpus()
    return SharedTokens(token_stream(tokenizer, train), token_stream(tokenizer, heldout))


def build_tokenizer(docs, out_dir: Path, vocab_size: int = VOCAB_SIZE):
    """Train a byte-level BPE tokenizer and save it as a Hugging Face tokenizer dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((text for _, text in docs), trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "model_max_length": 1000000000,
            }
        )
    )


def load_tokenizer(model_dir: Path):
    from mlx_lm.tokenizer_utils import load as load_tok

    return load_tok(Path(model_dir))


def _build_model(config: dict, seed: int):
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    mx.eval(model.parameters())
    return model


def context_benefit(model, stream, windows: int = 16, context_len: int = 256,
                    continuation_len: int = 64, seed: int = 12345):
    """(NLL with no context, NLL after ``context_len`` tokens of context) in
    nats/token, on the same ``continuation_len`` tokens of ``windows`` windows of
    ``stream`` (the first continuation token is not scored: it has no context in
    the second case). A cheap probe of whether a model looks back, for logging
    during training; benchmarks/builtin_pair.py measures the real thing."""
    w = sample_windows(stream, context_len + continuation_len, windows, random.Random(seed))
    scored = continuation_len - 1

    def nll(x):
        logits = model(x[:, :-1]).astype(mx.float32)[:, -scored:]
        return nn.losses.cross_entropy(logits, x[:, -scored:], reduction="mean").item()

    return nll(w[:, -continuation_len:]), nll(w)


def train_language_model(
    model,
    stream,
    steps: int,
    seq_len: int = 256,
    batch_size: int = 8,
    lr: float = 3e-3,
    seed: int = 0,
    log: Optional[Callable[[str], None]] = None,
    probe_stream=None,
    probe_every: int = 200,
    probe_context: int = 256,
    constant_lr: bool = False,
    weight_decay: float = 0.01,
):
    """Next-token training with AdamW and a cosine schedule; returns the final loss.
    ``constant_lr`` keeps the rate flat after warmup: learning to copy from the
    context comes after a long plateau, and a decaying rate can end the run on it
    (builtin-pair-training.md, run 8).
    With ``probe_stream`` (held-out tokens), logs context_benefit on it every
    ``probe_every`` steps: the curve that shows whether copying from context has
    been learned yet (it appears abruptly, if at all)."""
    warmup = max(min(steps // 20, 200), 1)
    after = (lambda _: mx.array(lr)) if constant_lr else optim.cosine_decay(lr, steps)
    schedule = optim.join_schedules([optim.linear_schedule(1e-5, lr, warmup), after], [warmup])
    opt = optim.AdamW(learning_rate=schedule, weight_decay=weight_decay)

    def loss_fn(model, x):
        logits = model(x[:, :-1])
        return nn.losses.cross_entropy(logits, x[:, 1:], reduction="mean")

    state = [model.state, opt.state]

    def step(x):
        loss, grads = nn.value_and_grad(model, loss_fn)(model, x)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss

    step = mx.compile(step, inputs=state, outputs=state)
    windows = token_windows(stream, seq_len + 1, batch_size, 10**9, seed)
    loss = math.nan
    t0 = time.perf_counter()
    for i in range(steps):
        try:
            x = next(windows)
        except StopIteration:
            windows = token_windows(stream, seq_len + 1, batch_size, 10**9, seed + i)
            x = next(windows)
        loss = step(x)
        mx.eval(state)
        if log and (i % 50 == 0 or i == steps - 1):
            log(f"  step {i + 1}/{steps} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f}s)")
        if log and probe_stream is not None and ((i + 1) % probe_every == 0 or i == steps - 1):
            none, ctx = context_benefit(model, probe_stream, context_len=probe_context,
                                        continuation_len=min(64, probe_context))
            log(f"  step {i + 1}/{steps} held-out NLL {none:.3f} without context, {ctx:.3f} "
                f"with; context benefit {none - ctx:.3f} nats/token")
    return float(loss.item())


def save_model_dir(model, config: dict, tokenizer_dir: Path, out_dir: Path):
    """Save an mlx-lm model directory atomically: config, weights, tokenizer files."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(tmp / "model.safetensors"), weights)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, tmp / name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


ASSET_DIR = files.ASSETS / "toy_pair"
# A stage-2 translator source -> target for the shipped pair, made by
# benchmarks/builtin_pair.py (stage-1 fit plus a short distillation).
STAGE2_TRANSLATOR = ASSET_DIR / "source-to-target.safetensors"


def ensure_toy_pair(
    cache_dir: Optional[Path] = None,
    rebuild: bool = False,
    log: Optional[Callable[[str], None]] = print,
):
    """Paths (source_dir, target_dir) of the built-in pair.

    The package ships a trained pair; ``rebuild=True`` trains one from scratch into
    ``cache_dir`` with the shipped pair's recipe, build_toy_pair with a shared
    embedding (about an hour and a half of one core here; kept there for the next
    call, and resumed after an interruption).
    """
    shipped = ASSET_DIR / "source", ASSET_DIR / "target"
    if not rebuild and all((d / "model.safetensors").exists() for d in shipped):
        return shipped
    return build_toy_pair(Path(cache_dir or files.default_cache_dir()) / "toy-pair-shared",
                          shared_embedding=True, log=log)


def build_docstring_pair(out: Path, steps: int = 800, save_dtype=mx.float16,
                         log: Optional[Callable[[str], None]] = print):
    """The first release's recipe: a byte-level BPE tokenizer, then each model
    trained for ``steps`` steps (8 x 256, lr 3e-3, cosine) on the training
    docstrings, into ``out``/{tokenizer,source,target}; parts already there are
    reused. That built-in pair's target gains only ~0.1
    nats/token from context (build_toy_pair is the recipe that makes the models
    copy). Its tokenizer is the one every built-in pair since uses."""
    log = log or (lambda s: None)
    train_docs, _ = split_documents(stdlib_documents())
    tok_dir = out / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        log("Training a byte-level BPE tokenizer on the standard library's docstrings ...")
        build_tokenizer(train_docs, tok_dir)
    stream = token_stream(load_tokenizer(tok_dir), train_docs)
    for seed, role in enumerate(("source", "target")):
        if (out / role / "model.safetensors").exists():
            continue
        config = dict(PAIR_CONFIGS[role], **COMMON)
        log(f"Training the {role} model ({config['model_type']}, "
            f"{config['num_hidden_layers']} layers) for {steps} steps ...")
        model = _build_model(config, seed=seed)
        train_language_model(model, stream, steps, seed=seed, log=log)
        model.set_dtype(save_dtype)
        save_model_dir(model, config, tok_dir, out / role)
    return out / "source", out / "target"


# The recipe that makes the pair look back. Learning to copy from the
# context comes only after a long plateau at chance (induction heads form
# abruptly), and text alone, whose tokens a bigram model already predicts well,
# gives little gradient towards it. So phase 1 trains on the short copy task
# alone (random spans that recur: copying is the only way to predict anything)
# until the drop; phase 2 moves to recurring documents at the full context
# length, keeping a quarter of the rows copy task so the skill is not unlearned.
# A constant rate and no weight decay: a decaying rate ended runs on the plateau
# (benchmarks/results/builtin-pair-training.md).
# The source learned to copy after ~3,400 steps at 2e-3, the target after ~3,900 at
# 1e-3 (builtin-pair-training.md, runs 9-10); with the shared embedding the target
# did at ~2,600 (run 12).
COPY_PHASE = dict(seq_len=64, batch_size=32, lr=dict(source=2e-3, target=1e-3),
                  span_len=(4, 10), steps=dict(source=4250, target=4500))
# The target stops at 1,000: its context benefit falls as it learns the text itself
# (builtin-pair-training.md, run 10).
TEXT_PHASE = dict(seq_len=256, batch_size=8, lr=1e-3, copy_fraction=0.25,
                  steps=dict(source=1500, target=1000))


def copy_stream(n_tokens: int, seed: int = 0) -> List[int]:
    """Phase 1's training tokens: short recurring random spans, one stream."""
    docs = copy_task_documents(n_tokens, seed=seed, span_len=COPY_PHASE["span_len"])
    return [t for d in docs for t in d]


def build_toy_pair(out: Path, copy_steps: Optional[int] = None,
                   text_steps: Optional[int] = None,
                   save_dtype=mx.float16, log: Optional[Callable[[str], None]] = print,
                   tokenizer_dir: Path = ASSET_DIR / "source",
                   roles=("source", "target"), shared_embedding: bool = False):
    """Train both models of the built-in pair with the two-phase recipe above into
    ``out``/{source,target} (the tokenizer: the shipped one, a byte-level BPE that
    build_tokenizer trained on the training docstrings). Each phase of each model
    is saved when done (``out``/<role>-copy after phase 1), so an interrupted
    build resumes at the phase it was in. Logs the held-out context benefit as it
    goes: the copy probe's (32-token context) in phase 1, the recurring
    documents' (256) in phase 2. About 35 + 12 minutes per model on one core
    here. ``shared_embedding``: the target's token embedding is the source's
    (trained first), turned by a fixed isometry and frozen (_share_embedding).
    The shipped pair was made this way: its source is the source of
    benchmarks/assets/context-pair (phase 1 in pieces, resumed from checkpoints
    with a fresh optimizer), its target one run with shared_embedding=True.
    Without the shared embedding (benchmarks/assets/context-pair) translators
    kept ~6 % of the context benefit (builtin-pair-context.md)."""
    log = log or (lambda s: None)
    done = out / "source", out / "target"
    if all((out / role / "model.safetensors").exists() for role in roles):
        return done  # nothing left to train: skip tokenizing the corpus
    tokenizer = load_tokenizer(tokenizer_dir)
    copy_probe = copy_stream(40_000, seed=99)
    text = training_stream(tokenizer, TEXT_PHASE["copy_fraction"])
    text_probe = token_stream(tokenizer, toy_corpus()[1])
    for role in roles:
        seed = ("source", "target").index(role)
        config = dict(PAIR_CONFIGS[role], **COMMON)
        final, after_copy = out / role, out / f"{role}-copy"
        if (final / "model.safetensors").exists():
            continue
        if (after_copy / "model.safetensors").exists():  # phase 1 done (its config wins)
            config = json.loads((after_copy / "config.json").read_text())
            model = _build_model(config, seed=seed)
            model.load_weights(str(after_copy / "model.safetensors"))
            model.set_dtype(mx.float32)
            if shared_embedding and role == "target":
                model.model.embed_tokens.freeze()
        else:
            model = _build_model(config, seed=seed)
            if shared_embedding and role == "target":
                _share_embedding(model, out / "source", seed)
            steps = copy_steps or COPY_PHASE["steps"][role]
            log(f"{role}: phase 1, the copy task, {steps} steps")
            train_language_model(
                model, copy_stream(3_000_000, seed), steps, seq_len=COPY_PHASE["seq_len"],
                batch_size=COPY_PHASE["batch_size"], lr=COPY_PHASE["lr"][role], seed=seed, log=log,
                probe_stream=copy_probe, probe_context=32, constant_lr=True, weight_decay=0.0)
            save_model_dir(model, config, tokenizer_dir, after_copy)
        steps = text_steps or TEXT_PHASE["steps"][role]
        log(f"{role}: phase 2, recurring documents, {steps} steps")
        train_language_model(
            model, text, steps, seq_len=TEXT_PHASE["seq_len"],
            batch_size=TEXT_PHASE["batch_size"], lr=TEXT_PHASE["lr"], seed=seed, log=log,
            probe_stream=text_probe, constant_lr=True, weight_decay=0.0)
        model.set_dtype(save_dtype)
        save_model_dir(model, config, tokenizer_dir, final)
    return done


def _share_embedding(target, source_dir: Path, seed: int):
    """Give ``target`` the source's token embedding, turned into its own width by a
    fixed random isometry, and freeze it: the two models then represent each token
    by linearly related vectors, as members of one model family do. Between two
    independently trained small models the token identities that copying matches
    on have no linear relation, and translators kept ~6 % of the context benefit
    (builtin-pair-training.md, run 11)."""
    weights = source_dir / "model.safetensors"
    if not weights.exists():
        raise FileNotFoundError(f"A shared embedding needs the trained source first: {weights}")
    source = mx.load(str(weights))["model.embed_tokens.weight"]
    width = target.model.embed_tokens.weight.shape[1]
    # An explicit key rather than reseeding the global generator; it draws the same
    # numbers as mx.random.seed(seed + 1000) then normal() did when the shipped
    # pair was made.
    key = mx.random.split(mx.random.key(seed + 1000))[1]
    q, _ = mx.linalg.qr(mx.random.normal((width, source.shape[1]), key=key), stream=mx.cpu)
    target.model.embed_tokens.weight = source.astype(mx.float32) @ q.T  # rows keep their norms
    target.model.embed_tokens.freeze()


# ---------------------------------------------------------------------------
# Translators for the built-in pair


def fit_translator(source, source_tok, target, target_tok, pair, tokens: int = 50_000,
                   context_len: int = 256, progress=None):
    """Stage 1 source -> target on ``pair``'s training stream (toy_pair_data), with
    ``progress`` as :func:`~mlx_kvlingo.train.recipe.fit_translator` takes it.
    Returns (translator, FitReport)."""
    return recipe.fit_translator(source, source_tok, target, target_tok, "toy", tokens,
                                 context_len, pair=pair, progress=progress or recipe.no_progress,
                                 log=lambda s: None)


# Stage 2 for the built-in pair: its maps are small (<= 64 wide), so a larger
# learning rate than the real models' 1e-5..1e-4 is stable here.
DISTILL_LR = 1e-3


def distill_translator(source, target, translator, pair, steps: int, lr: float = DISTILL_LR,
                       batch_size: int = 4, context_len: int = 256, seed: int = 0, log=None):
    """A short stage 2 (distillation) from ``translator``, in memory; returns the
    distilled translator. Each step draws fresh training windows."""
    config = RunConfig(
        DistillConfig(steps=steps, lr=lr, batch_size=batch_size, accumulate=1, seed=seed),
        context_lengths=(context_len,),
    )
    # The Distiller trains full maps in place: work on a copy, so that the caller
    # keeps its stage-1 translator to compare against.
    distiller = Distiller(_copy(translator), target, config.distill)
    t0 = time.perf_counter()
    while distiller.step < steps:
        batches = pair.step_batches(source, target, distiller.base, config, distiller.step)
        loss, _ = distiller.train_step(batches)
        if log and (distiller.step % 25 == 0 or distiller.step == steps):
            log(f"  step {distiller.step}/{steps} KL {loss:.4f} ({time.perf_counter() - t0:.0f}s)")
    out = distiller.translator()
    out.spec.training = dict(translator.spec.training, stage=2, distill=dict(
        steps=steps, lr=lr, batch_size=batch_size, context_len=context_len, seed=seed))
    return out


def _copy(translator):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "copy.safetensors"
        translator.save(path)
        return load_translator(path)

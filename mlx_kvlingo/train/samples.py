"""Training and evaluation samples for a pair of models.

Three kinds of samples, one interface (``step_batches``, ``heldout``, ``evaluate``):

- :class:`SharedTokens` — both models share a tokenizer: windows of one token
  stream, batched, position j of the target reads position j of the source.
- :class:`AlignedText` — different tokenizers: text snippets whose context and
  continuation are split at a space and tokenized separately by each model (so no
  translated position sees past the context), the target's tokens aligned to the
  source's by characters (``align.py``). One sample per micro-batch.
- :class:`ChatSamples` — a shared tokenizer, whole chats (chat_samples.py): the
  chat so far translated, the question and the target's own answer read by it,
  the KL weighted per token. One sample per micro-batch.

Sampling is a pure function of (seed, step), so a resumed training run draws the
samples an uninterrupted one would have drawn.
"""

import json
import random
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List, Sequence

import mlx.core as mx

from ..data import corpus as data
from ..errors import KvlingoError
from ..models.cache import cache_features
from ..models.features import attention_weights, token_features, token_inputs
from ..models.geometry import tokenizer_fingerprint
from ..translator.align import NATIVE, Alignment, align_offsets, tokenize_with_offsets
from . import distributed
from .distill import Batch, make_batch, make_batch_from_features, native_prefix_kv


def _step_rng(seed: int, step: int) -> random.Random:
    return random.Random(seed * 1_000_003 + step)


# ---------------------------------------------------------------------------
# Shared tokenizer


def sample_windows(stream: Sequence[int], length: int, count: int, rng: random.Random):
    """``count`` windows of ``length`` tokens at random offsets of a token stream."""
    if len(stream) <= length:
        raise KvlingoError(f"The corpus has {len(stream)} tokens; windows need {length}.")
    starts = [rng.randrange(0, len(stream) - length) for _ in range(count)]
    return mx.array([stream[s : s + length] for s in starts])


class SharedTokens:
    aligned = False  # position j of the target reads position j of the source

    def __init__(self, train_stream: Sequence[int], heldout_stream: Sequence[int]):
        self.train_stream = train_stream
        self.heldout_stream = heldout_stream

    def step_samples(self, config, step: int):
        """The micro-batches (context [B, C], continuation [B, L]) of one step."""
        d = config.distill
        rng = _step_rng(d.seed, step)
        out = []
        for _ in range(d.accumulate):
            c = rng.choice(list(config.context_lengths))
            w = sample_windows(self.train_stream, c + config.continuation_len, d.batch_size, rng)
            out.append((w[:, :c], w[:, c:]))
        return out

    def micro_batches(self, config) -> int:
        return config.distill.accumulate

    def step_batches(self, source, target, translator, config, step: int,
                     group=None, native: bool = False) -> List[Batch]:
        """The step's micro-batches; with ``group``, this rank's share of them.
        ``native``: with the target's own K/V of the translated positions."""
        return [
            make_batch(source, target, translator, c, n, native)
            for c, n in distributed.share(self.step_samples(config, step), group)
        ]

    def heldout(self, context_len: int, continuation_len: int, count: int):
        w = sample_windows(
            self.heldout_stream, context_len + continuation_len, count, random.Random(12345)
        )
        return [w[i : i + 8] for i in range(0, count, 8)]


# ---------------------------------------------------------------------------
# Chats (one tokenizer): the samples chat_samples.build_chat_samples writes


def _heldout(index: int, every: int = 8) -> bool:
    return zlib.crc32(str(index).encode()) % every == 0


class ChatSamples(SharedTokens):
    """Chat samples (``chat_samples.build_chat_samples``), one per micro-batch, drawn
    from the training chats by (seed, step); every 8th chat (by a hash of its index) is held
    out. The held-out and training chats' tokens, end to end, are the token streams
    the evaluation windows and the store's corpus digest read."""

    def __init__(self, rows: List[dict]):
        if not rows:
            raise KvlingoError("No chat samples: build them first (mlx-kvlingo chat-data).")
        self.train_rows = [r for r in rows if not _heldout(r["index"])]
        self.heldout_rows = [r for r in rows if _heldout(r["index"])] or self.train_rows[-1:]

        def stream(rs):
            return [t for r in rs for t in r["context"] + r["continuation"]]

        super().__init__(stream(self.train_rows), stream(self.heldout_rows))

    @classmethod
    def from_file(cls, path, source_tokenizer, target_tokenizer) -> "ChatSamples":
        if tokenizer_fingerprint(source_tokenizer) != tokenizer_fingerprint(target_tokenizer):
            raise KvlingoError("Chat samples need two models with one tokenizer.")
        path = Path(path)
        if not path.is_file():
            raise KvlingoError(f"No chat samples at {path} (mlx-kvlingo chat-data makes them).")
        return cls([json.loads(line) for line in path.read_text().splitlines() if line.strip()])

    def micro_batches(self, config) -> int:
        return config.distill.accumulate * config.distill.batch_size

    def step_samples(self, config, step: int):
        """(context [1, C], continuation [1, L], weights [1, L]) per micro-batch: the
        training chats in a seeded order, a new one each epoch, so that a pool of
        ``len(train_rows) / micro_batches`` steps holds each chat once."""
        per, n = self.micro_batches(config), len(self.train_rows)
        rows = []
        for k in range(step * per, (step + 1) * per):
            epoch, i = divmod(k, n)
            order = list(range(n))
            _step_rng(config.distill.seed, epoch).shuffle(order)
            rows.append(self.train_rows[order[i]])
        return [(mx.array(r["context"])[None], mx.array(r["continuation"])[None],
                 mx.array(r["weights"], dtype=mx.float32)[None]) for r in rows]

    def step_batches(self, source, target, translator, config, step: int,
                     group=None, native: bool = False) -> List[Batch]:
        return [replace(make_batch(source, target, translator, c, n, native), weights=w)
                for c, n, w in distributed.share(self.step_samples(config, step), group)]


# ---------------------------------------------------------------------------
# Different tokenizers


@dataclass
class AlignedSample:
    alignment: Alignment  # of the context: both models' tokens, target -> source
    continuation: List[int]  # target tokens of the continuation
    special_prefix: int  # leading target tokens without text (BOS)


class AlignedText:
    aligned = True  # each target token reads the source token holding its last character

    def __init__(self, source_tokenizer, target_tokenizer, train_text: str, heldout_text: str):
        self.source_tokenizer = source_tokenizer
        self.target_tokenizer = target_tokenizer
        self.train_text = train_text
        self.heldout_text = heldout_text

    def sample(self, text: str, context_len: int, continuation_len: int,
               rng: random.Random) -> AlignedSample:
        """A snippet whose target tokenization has about ``context_len`` context
        tokens, split at a space, and ``continuation_len`` continuation tokens."""
        span = 8 * (context_len + continuation_len)
        if len(text) < span + 2:
            raise KvlingoError(f"The corpus has {len(text)} characters; {span} are needed.")
        for _ in range(50):
            at = rng.randrange(0, len(text) - span)
            at = text.find(" ", at) + 1 or at  # start at a word
            chunk = text[at : at + span]
            ids, offsets = tokenize_with_offsets(self.target_tokenizer, chunk, False)
            if len(ids) < context_len + continuation_len + 8:
                continue
            split = chunk.find(" ", offsets[context_len - 1][1])
            if split <= 0:
                continue
            context_text, continuation_text = chunk[:split], chunk[split:]
            cont, _ = tokenize_with_offsets(self.target_tokenizer, continuation_text, False)
            if len(cont) < continuation_len:
                continue
            s_ids, s_off = tokenize_with_offsets(self.source_tokenizer, context_text)
            t_ids, t_off = tokenize_with_offsets(self.target_tokenizer, context_text)
            special = next((j for j, (a, b) in enumerate(t_off) if b > a), len(t_off))
            # Translators add their own native prefix (Alignment.with_native_prefix).
            index = align_offsets(s_off, t_off, native_prefix=0)
            return AlignedSample(
                Alignment(s_ids, t_ids, index), cont[:continuation_len], special
            )
        raise KvlingoError("Could not cut a sample from the corpus: is it mostly whitespace?")

    def micro_batches(self, config) -> int:
        return config.distill.accumulate * config.distill.batch_size

    def step_batches(self, source, target, translator, config, step: int,
                     group=None, native: bool = False) -> List[Batch]:
        """The step's micro-batches (one sample each); with ``group``, this rank's
        share (every sample is drawn, so the rng stays in step with one process).
        ``native``: with the target's own K/V of the translated positions."""
        d = config.distill
        rng = _step_rng(d.seed, step)
        samples = []
        for _ in range(self.micro_batches(config)):
            c = rng.choice(list(config.context_lengths))
            samples.append(self.sample(self.train_text, c, config.continuation_len, rng))
        return [make_aligned_batch(source, target, translator, s, native)
                for s in distributed.share(samples, group)]

    def heldout(self, context_len: int, continuation_len: int, count: int):
        rng = random.Random(12345)
        return [self.sample(self.heldout_text, context_len, continuation_len, rng)
                for _ in range(count)]

    def fit_features(self, source, target, translator, count: int, context_len: int, seed=0,
                     layers=None, group=None, attention: bool = False):
        """(source, target) feature pairs for the stage-1 fit: the target's translated
        positions and the source features aligned to them (of the translator's source
        layers, or of ``layers``). With ``group``, this rank's share of the samples.
        ``attention``: each item also carries, per target layer, the target's
        attention from every query of the window to the translated positions
        ([1, T, n], for fit.AttentionValueAccumulator)."""
        rng = random.Random(seed)
        layers = translator.source_layers if layers is None else layers
        samples = (self.sample(self.train_text, context_len, 1, rng) for _ in range(count))
        for s in distributed.shard_iter(samples, group):
            idx = s.alignment.with_native_prefix(translator.spec.native_prefix).source_index
            keep = [j for j, i in enumerate(idx) if i != NATIVE]
            rows = mx.array([idx[j] for j in keep])
            sk, sv, _ = token_features(source, mx.array(s.alignment.source_tokens)[None], layers)
            tokens = mx.array(s.alignment.target_tokens)[None]
            if attention:
                cache, weights = attention_weights(target, tokens)
                tk, tv, _ = cache_features(target, cache)
            else:
                tk, tv, _ = token_features(target, tokens)
            gather = lambda xs, r: [x[:, r] if x is not None else None for x in xs]  # noqa: E731
            keep = mx.array(keep)
            item = gather(sk, rows), gather(sv, rows), gather(tk, keep), gather(tv, keep)
            if translator.spec.token_layers and not attention:
                item += (token_inputs(target, tokens, 0, tokens.shape[1])[:, keep],)
            yield (*item, [w[:, :, keep] for w in weights]) if attention else item


def make_aligned_batch(source, target, translator, s: AlignedSample,
                       native: bool = False) -> Batch:
    """A distillation Batch (B = 1) from an aligned sample. Native positions must form
    a prefix (true for plain text: BOS and the attention sink)."""
    a = s.alignment.with_native_prefix(translator.spec.native_prefix)
    context = mx.array(a.target_tokens)[None]
    n = context.shape[1] - 1
    k = a.native_prefix
    if any(i == NATIVE for i in a.source_index[k:n]):
        raise KvlingoError("Native positions inside a context are not supported in training.")
    src_k, src_v, _ = token_features(source, mx.array(a.source_tokens)[None], translator.source_layers)
    rows = mx.array(a.source_index[k:n])
    src_k = [x[:, rows] if x is not None else None for x in src_k]
    src_v = [x[:, rows] if x is not None else None for x in src_v]
    prefix = native_prefix_kv(target, context, k)
    return make_batch_from_features(target, src_k, src_v, prefix, k, context,
                                    mx.array(s.continuation)[None], native)


def split_corpus(corpus: str, tokenizer):
    """(train, held-out) documents of a corpus, split by document."""
    docs = data.read_corpus(corpus, tokenizer)
    train, heldout = data.split_documents(docs)
    if not (train and heldout):
        raise KvlingoError(
            f"Corpus {corpus!r} has {len(docs)} document(s): too few to hold some out "
            "for evaluation. Give more text."
        )
    return train, heldout


def pair_data(corpus: str, src_tok, tgt_tok):
    """Training/evaluation samples of a corpus for a pair of models: shared token
    windows when the tokenizers agree, character-aligned text when they differ;
    ``chats:FILE.jsonl``: chat samples (chat_samples.py)."""
    if corpus.startswith("chats:"):
        return ChatSamples.from_file(corpus[len("chats:"):], src_tok, tgt_tok)
    train, heldout = split_corpus(corpus, tgt_tok)
    if tokenizer_fingerprint(src_tok) == tokenizer_fingerprint(tgt_tok):
        return SharedTokens(data.token_stream(src_tok, train), data.token_stream(src_tok, heldout))

    def join(docs):
        return "\n\n".join(text for _, text in docs)

    return AlignedText(src_tok, tgt_tok, join(train), join(heldout))

"""Stage 2: distil the maps through the frozen target.

Loss: forward KL(target on its native cache ‖ target on the translated cache) per
continuation token. The source builds the cache for ``context[:-1]``; the target
computes its own K/V for the first ``native_prefix`` tokens, processes the
context's last token itself and then the teacher-forced continuation. Gradients
reach the maps through the target: the translated cache is built *inside* the
differentiated function (MLX slice assignment is functional).

Two ways to train (``rank``):
- ``rank == 0``: every map entry is trained (start from the stage-1 fit);
- ``rank > 0``: the stage-1 maps stay frozen and a low-rank correction B·A is
  trained on top (B starts at zero); it is merged into the maps on save, so the
  translator file format does not change. ``layer_ranks`` gives some target layers
  a rank of their own (``"5:64,11:64,17:64"``): where the loss sits, the oracle
  swaps of benchmarks/cache_oracle.py say (a few layers hold most of it).
"""

import math
from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import make_prompt_cache

from .. import cpu_math
from ..errors import KvlingoError
from ..models.cache import (
    append_layer,
    build_cache,
    cache_features,
    last_logits,
    prefill,
    read_layer,
)
from ..models.features import layer0_features, token_features, token_inputs
from ..translator.maps import Translator
from . import distributed


@dataclass
class DistillConfig:
    steps: int = 1000
    lr: float = 1e-4  # 1e-3 diverged on a 30-layer target
    warmup: float = 0.05  # fraction of steps
    weight_decay: float = 0.0
    clip: float = 1.0
    batch_size: int = 4  # sequences per micro-batch
    accumulate: int = 2  # micro-batches per optimizer step
    rank: int = 0  # 0: train full maps; >0: frozen maps + low-rank correction
    # With rank > 0: "LAYER:RANK,..." target layers whose correction has a rank of its own.
    layer_ranks: str = ""
    seed: int = 0
    # "rms": each map's step is scaled by its starting RMS, so lr is a relative rate
    # (value maps are ~50x smaller than key maps; one absolute rate moves them far
    # more). "none": one absolute rate for every entry.
    lr_scale: str = "none"
    native_tail: int = 0  # last context positions the target computes itself (odd micro-batches)
    teacher_topk: int = 0  # 0: full-vocabulary teacher; k: top-k + tail
    # Token maps (spec.token_layers) in stage 2: "train" from their stage-1 fit, or
    # "frozen" at it. On every one of Gemma 3's layers (11.8 M weights), trained
    # whole they lost their stage-1 lead and frozen they kept it (+9 points held-out;
    # benchmarks/results/ablations.md).
    token_maps: str = "train"

    def schedule(self):
        warm = max(int(self.steps * self.warmup), 1)
        return optim.join_schedules(
            [
                optim.linear_schedule(self.lr * 1e-3, self.lr, warm),
                optim.cosine_decay(self.lr, max(self.steps - warm, 1), self.lr * 0.1),
            ],
            [warm],
        )


# ---------------------------------------------------------------------------
# Low-rank correction


class LowRankMaps(nn.Module):
    """Frozen maps plus a trainable low-rank correction per map: W + B A. A
    compressed translator's correction reads what its maps read, the frozen shared
    projection: the file keeps its format and its cost per token."""

    def __init__(self, translator: Translator, rank: int, seed: int = 0,
                 layer_ranks: Optional[dict] = None):
        super().__init__()
        self.base = translator
        self.base.freeze()
        # Token maps (spec.token_layers) are small (two embeddings wide): they train
        # whole, from their stage-1 fit, beside the correction (unless the Distiller's
        # config freezes them).
        for m in translator.k_tok + translator.v_tok:
            m.unfreeze()
        key = mx.random.key(seed)
        self.a_k, self.b_k, self.a_v, self.b_v = [], [], [], []
        for i, (km, vm) in enumerate(zip(translator.k_maps, translator.v_maps)):
            r = (layer_ranks or {}).get(i, rank)
            for a, b, m in ((self.a_k, self.b_k, km), (self.a_v, self.b_v, vm)):
                out_dim, in_dim = m.weight.shape
                key, sub = mx.random.split(key)
                a.append(mx.random.normal((r, in_dim), key=sub) / math.sqrt(in_dim))
                b.append(mx.zeros((out_dim, r)))

    def __call__(self, keys, values, tokens=None, frozen=None):
        """``tokens``: as for :meth:`Translator.__call__`. ``frozen``: the frozen
        maps' source terms on these inputs (per target layer, K and V), when already
        computed (:meth:`Distiller.with_frozen_outputs`); the frozen maps are then
        not run again, only the correction."""
        spec = self.base.spec
        if spec.shared_rank:  # never given frozen outputs (with_frozen_outputs)
            return self._shared(keys, values, tokens)
        out_k, out_v = [], []
        for i, layers in enumerate(spec.layer_map):
            xk, xv = [keys[j] for j in layers], [values[j] for j in layers]
            if frozen:
                base_k, base_v = frozen[0][i], frozen[1][i]
            else:
                base_k, base_v = self.base.k_maps[i](_concat(xk)), self.base.v_maps[i](_concat(xv))
            out_k.append(base_k + _project(xk, self.a_k[i]) @ self.b_k[i].T)
            out_v.append(base_v + _project(xv, self.a_v[i]) @ self.b_v[i].T)
        return self.base.add_token_terms(out_k, out_v, tokens)

    def _shared(self, keys, values, tokens):
        """A compressed base: each layer's map and its correction read the shared
        projection."""
        zk, zv = self.base.shared_projections(keys, values, tokens)
        out_k = [m(zk) + (zk @ a.T) @ b.T for m, a, b in zip(self.base.k_maps, self.a_k, self.b_k)]
        out_v = [m(zv) + (zv @ a.T) @ b.T for m, a, b in zip(self.base.v_maps, self.a_v, self.b_v)]
        return self.base.add_token_terms(out_k, out_v, tokens)

    def merged(self) -> Translator:
        """The base translator with the corrections folded into its maps."""
        t = Translator(self.base.spec)
        if self.base.spec.shared_rank:
            t.k_shared.weight = self.base.k_shared.weight
            t.v_shared.weight = self.base.v_shared.weight
        for i in range(len(t.k_maps)):
            t.k_maps[i].weight = self.base.k_maps[i].weight + self.b_k[i] @ self.a_k[i]
            t.v_maps[i].weight = self.base.v_maps[i].weight + self.b_v[i] @ self.a_v[i]
        for mine, theirs in ((t.k_tok, self.base.k_tok), (t.v_tok, self.base.v_tok)):
            for a, b in zip(mine, theirs):
                a.weight = b.weight
        mx.eval(t.parameters())
        return t


def parse_layer_ranks(text: str, rank: int, n_layers: Optional[int] = None) -> dict:
    """``"5:64,11:64"`` -> {5: 64, 11: 64}; "" -> {}. ``rank``: the other layers'
    (layer ranks need a low-rank correction); ``n_layers``: the target's layer
    count, to check the layers against."""
    if text and not rank:
        raise KvlingoError("Layer ranks set ranks of a low-rank correction: they need a "
                           "rank > 0 (--rank) for the other layers.")
    ranks = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        layer, colon, rank = part.partition(":")
        if not (colon and layer.strip().isdigit() and rank.strip().isdigit()
                and int(rank) >= 1):
            raise KvlingoError(f"Layer ranks are LAYER:RANK pairs with RANK >= 1, "
                               f"comma-separated (5:64,11:64), not {part!r}.")
        if n_layers is not None and int(layer) >= n_layers:
            raise KvlingoError(f"Layer ranks: the target has {n_layers} layers; "
                               f"there is no layer {int(layer)}.")
        ranks[int(layer)] = int(rank)
    return ranks


def _concat(xs):
    return xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=-1)


def _project(xs, a):
    """``concat(xs) @ a.T`` block by block, without building the concatenation: a
    wide map reads up to 18 source layers, and each map's concatenation (written,
    then read, forward and backward) cost more than the rank-16 product itself."""
    out, start = None, 0
    for x in xs:
        y = x @ a[:, start : start + x.shape[-1]].T
        out = y if out is None else out + y
        start += x.shape[-1]
    return out


# ---------------------------------------------------------------------------
# One batch: what is computed without gradients, and the loss


@dataclass
class Batch:
    """Everything a training step needs that does not depend on the maps.

    The teacher is the target's log-probs over the continuation from its native
    cache: the full vocabulary (``teacher_idx`` None), or its top-k entries with
    their vocabulary ids; the rest of the mass is one "tail" category, so the KL
    over those k+1 categories is exact (see :func:`kl_loss`).
    """

    src_keys: List[Optional[mx.array]]  # per source layer, [B, n, width]: positions n_native..C-2
    src_values: List[Optional[mx.array]]
    prefix: List[Tuple[mx.array, mx.array]]  # target's own K/V of the native prefix
    context: mx.array  # [B, C] target token ids
    continuation: mx.array  # [B, L]
    teacher: mx.array  # [B, L, V] or [B, L, k] log-probs
    n_native: int
    teacher_idx: Optional[mx.array] = None  # [B, L, k] vocabulary ids of `teacher`
    native_tail: int = 0  # last context positions the target computes itself
    # Training a low-rank correction: the frozen maps' outputs on src_keys/src_values
    # (per target layer), computed once per sample (Distiller.with_frozen_outputs).
    frozen_keys: Optional[List[mx.array]] = None
    frozen_values: Optional[List[mx.array]] = None
    # The target's own K/V (content space, per target layer, [B, n, width]) of the
    # translated positions, read off the teacher's prefill when asked for: a stage-1
    # fit on the store's samples needs no prefill of its own (train.store_fit_features).
    # Never stored.
    native_keys: Optional[List[mx.array]] = None
    native_values: Optional[List[mx.array]] = None
    # [B, L] weight of each continuation token in the loss (None: all alike). A chat
    # sample weighs its answer's tokens by how much they need the distant context
    # and its question's not at all (chat_samples.py).
    weights: Optional[mx.array] = None

    @property
    def tokens(self) -> int:
        return self.continuation.size

    @property
    def inputs(self) -> mx.array:
        """What the target reads itself: the native tail, the context's last token and
        the continuation but its last token."""
        m = self.native_tail
        return mx.concatenate([self.context[:, -1 - m :], self.continuation[:, :-1]], axis=1)

    def with_native_tail(self, m: int) -> "Batch":
        n_translated = self.context.shape[1] - 1 - self.n_native
        return replace(self, native_tail=max(0, min(m, n_translated - 1)))

    def with_teacher_topk(self, k: int) -> "Batch":
        """The same batch with the teacher cut to its top-k (+ tail) entries."""
        if not k or self.teacher_idx is not None:
            return self
        idx = mx.argpartition(-self.teacher, k - 1, axis=-1)[..., :k]
        top = mx.take_along_axis(self.teacher, idx, axis=-1)
        return replace(self, teacher=top, teacher_idx=idx.astype(mx.int32))


def make_batch(source, target, translator: Translator, context, continuation,
               native: bool = False) -> Batch:
    """Teacher log-probs, source features and the target's native prefix for one batch
    of (context [B, C], continuation [B, L]) token ids read alike by both models
    (``native``: see :func:`make_batch_from_features`)."""
    n = context.shape[1] - 1  # positions in the translated cache
    k = min(translator.spec.native_prefix, n)
    src_k, src_v, _ = token_features(source, context[:, :-1], translator.source_layers)
    src_k = [x[:, k:] if x is not None else None for x in src_k]
    src_v = [x[:, k:] if x is not None else None for x in src_v]
    prefix = native_prefix_kv(target, context, k)
    return make_batch_from_features(target, src_k, src_v, prefix, k, context, continuation, native)


def native_prefix_kv(target, context, k: int):
    """The target's own K/V (as cached, per layer) of its first ``k`` context tokens."""
    if not k:
        return []
    return [read_layer(c)[:2] for c in prefill(target, context[:, :k])]


def make_batch_from_features(target, src_k, src_v, prefix, n_native, context, continuation,
                             native: bool = False):
    """Add the teacher (the target on its own cache of ``context[:, :-1]``) to source
    features already cut to the translated positions n_native..C-2. ``native``: keep
    the target's own K/V of those positions too (from the same prefill)."""
    inputs = mx.concatenate([context[:, -1:], continuation[:, :-1]], axis=1)
    teacher_cache = prefill(target, context[:, :-1])
    # Read before the continuation's pass moves the sliding windows.
    native_kv = _native_kv(target, teacher_cache, n_native) if native else (None, None)
    with cpu_math.numpy_passes():
        logits = target(inputs, cache=teacher_cache).astype(mx.float32)
    teacher = cpu_math.log_softmax(logits)
    batch = Batch(src_k, src_v, prefix, context, continuation, teacher, n_native,
                  native_keys=native_kv[0], native_values=native_kv[1])
    mx.eval(batch.src_keys, batch.src_values, batch.prefix, batch.teacher)
    return batch


def _native_kv(target, cache, start: int):
    """The target's own (keys, values) in content space, per layer, of a one-pass
    prefill ``cache`` from position ``start`` on, evaluated."""
    keys, values, _ = cache_features(target, cache)
    keys, values = [k[:, start:] for k in keys], [v[:, start:] for v in values]
    mx.eval(keys, values)
    return keys, values


def with_native_features(target, batch: Batch) -> Batch:
    """``batch`` with the target's own K/V of its translated positions, from a fresh
    prefill of its context (for a batch read back from a store, which keeps none)."""
    keys, values = _native_kv(target, prefill(target, batch.context[:, :-1]), batch.n_native)
    return replace(batch, native_keys=keys, native_values=values)


def translated_cache(target, maps, batch: Batch):
    """The target cache built from the maps' output (differentiable in the maps):
    the native prefix, then the translated positions up to the native tail. With
    the translator's ``native_layer0`` layer 0 is the target's own (exact, no
    gradient), so training spends itself on the layers that are translated."""
    cache = make_prompt_cache(target)
    for c, (pk, pv) in zip(cache, batch.prefix):
        append_layer(c, pk, pv, 0, batch.n_native)
    n = batch.context.shape[1] - 1 - batch.n_native - batch.native_tail
    cut = lambda xs: [x[:, :n] if x is not None else None for x in xs]  # noqa: E731
    spec = _spec(maps)
    lo = batch.n_native
    tokens = token_inputs(target, batch.context, lo, lo + n) if spec.token_layers else None
    if batch.frozen_keys is not None:
        frozen = (cut(batch.frozen_keys), cut(batch.frozen_values))
        keys, values = maps(cut(batch.src_keys), cut(batch.src_values), tokens, frozen=frozen)
    else:
        keys, values = maps(cut(batch.src_keys), cut(batch.src_values), tokens)
    if spec.native_layer0:
        keys[0], values[0] = layer0_features(
            target, batch.context[:, batch.n_native : batch.n_native + n])
    return build_cache(target, keys, values, start=batch.n_native, cache=cache)


def _spec(maps):
    """The translator spec behind trainable maps (a Translator or LowRankMaps)."""
    spec = getattr(maps, "spec", None)
    return spec if spec is not None else maps.base.spec


def kl_loss(maps, target, batch: Batch):
    """Mean KL(native ‖ translated) per continuation token.

    With a top-k teacher the categories are its k tokens plus one tail holding the
    rest of the mass, on both sides: exact for that partition, unlike plain
    truncation (which drops the tail and biases the student).
    """
    keep = batch.continuation.shape[1]
    cpu_math.install(target)  # its softmax and activation in numpy (cpu_math; differentiable)
    with cpu_math.numpy_passes():
        logits = last_logits(target, batch.inputs, translated_cache(target, maps, batch), keep)
    logits = logits.astype(mx.float32)
    lse = cpu_math.logsumexp(logits)  # 262k entries for Gemma: numpy's exp on a CPU
    t = batch.teacher
    if batch.teacher_idx is None:
        return _mean(batch, (mx.exp(t) * (t - (logits - lse))).sum(-1))
    s = mx.take_along_axis(logits, batch.teacher_idx, axis=-1) - lse
    p = mx.exp(t)
    kl = (p * (t - s)).sum(-1)
    eps = 1e-7
    p_tail = mx.maximum(1 - p.sum(-1), 0.0)
    q_tail = mx.maximum(1 - mx.exp(s).sum(-1), eps)
    kl = kl + p_tail * (mx.log(p_tail + eps) - mx.log(q_tail))
    return _mean(batch, kl)


def _mean(batch: Batch, kl: mx.array) -> mx.array:
    """The per-token KL [B, L] averaged over tokens, by the batch's weights if any."""
    if batch.weights is None:
        return kl.mean()
    w = batch.weights.astype(kl.dtype)
    return (kl * w).sum() / mx.maximum(w.sum(), 1e-6)


# ---------------------------------------------------------------------------
# The optimizer step


class RmsScaledAdamW(optim.AdamW):
    """AdamW whose step on each tensor is scaled by that tensor's RMS at the start.

    Adam's step is about ``lr`` per entry whatever the gradient's scale, so one rate
    moves small tensors (value maps) relatively far more than large ones (key maps).
    Scaling each tensor's step by its starting RMS makes ``lr`` a relative rate.
    """

    def init_single(self, parameter: mx.array, state: dict):
        super().init_single(parameter, state)
        state["rms"] = mx.sqrt(mx.mean(parameter.astype(mx.float32) ** 2))

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict):
        new = super().apply_single(gradient, parameter, state)
        return parameter + state["rms"].astype(parameter.dtype) * (new - parameter)


class Distiller:
    """Owns the trainable maps, the optimizer and the gradient step.

    ``group`` (an ``mx.distributed`` group, see distributed.py): each rank passes
    its share of a step's micro-batches and the gradients are averaged over ranks
    (token-weighted), so every rank takes the same optimizer step as one process
    over the whole batch. None: no collective call.
    """

    def __init__(self, translator: Translator, target, config: DistillConfig, group=None):
        self.config = config
        self.group = group
        self.base = translator  # its spec says which source layers and prefix to use
        target.freeze()
        layer_ranks = parse_layer_ranks(config.layer_ranks, config.rank,
                                        len(translator.spec.layer_map))
        if config.token_maps not in ("train", "frozen"):
            raise KvlingoError(f"token_maps must be 'train' or 'frozen', not {config.token_maps!r}.")
        self.maps = (LowRankMaps(translator, config.rank, config.seed, layer_ranks)
                     if config.rank else translator)
        if config.token_maps == "frozen":  # before the optimizer reads what trains
            for m in translator.k_tok + translator.v_tok:
                m.freeze()
        if config.lr_scale not in ("none", "rms"):
            raise ValueError(f"lr_scale must be 'none' or 'rms', not {config.lr_scale!r}")
        # A low-rank correction starts at zero: there is no scale to keep.
        scaled = config.lr_scale == "rms" and not config.rank
        self.optimizer = (RmsScaledAdamW if scaled else optim.AdamW)(
            learning_rate=config.schedule(), weight_decay=config.weight_decay
        )
        self.optimizer.init(self.maps.trainable_parameters())
        # Not mx.compile'd: with gradient accumulation and the skip of non-finite
        # steps the compiled version failed to trace here ("array without a
        # primitive"); the update is ~1/3 of a step, the teacher/source passes the rest.
        self._grad = nn.value_and_grad(self.maps, lambda m, b: kl_loss(m, target, b))
        self.step = 0  # optimizer steps taken
        self.skipped = 0  # steps dropped for a non-finite loss or gradient

    def train_step(self, batches: List[Batch], positions=None) -> Tuple[float, bool]:
        """One optimizer step over micro-batches (gradient accumulation).

        Returns (mean loss, applied). A non-finite loss or gradient skips the
        update entirely: nothing non-finite is ever written into the maps.
        ``positions``: see :meth:`gradients`.
        """
        total, grads = self.gradients(batches, positions)
        grads, norm = optim.clip_grad_norm(grads, self.config.clip)
        mx.eval(total, norm)
        loss = total.item()
        self.step += 1
        if not (math.isfinite(loss) and math.isfinite(norm.item())):
            self.skipped += 1
            return loss, False
        self.optimizer.update(self.maps, grads)
        mx.eval(self.maps.parameters(), self.optimizer.state)
        return loss, True

    def gradients(self, batches: List[Batch], positions=None):
        """Token-weighted mean loss and gradients over micro-batches (lazy arrays).

        ``positions``: each micro-batch's place in the whole step (default 0, 1, ...);
        with several ranks a rank holds only some, and the native tail goes by place.
        """
        positions = range(len(batches)) if positions is None else positions
        total, grads = 0.0, None
        weight = sum(b.tokens for b in batches)
        cfg = self.config
        # Half the micro-batches train with the native tail, half without, so one
        # set of maps serves switches with and without it.
        batches = [b.with_teacher_topk(cfg.teacher_topk)
                   .with_native_tail(cfg.native_tail if j % 2 else 0)
                   for j, b in zip(positions, batches)]
        for b in batches:
            loss, g = self._grad(self.maps, b)
            scale = b.tokens / weight
            g = tree_map(lambda x: x * scale, g)
            grads = g if grads is None else tree_map(mx.add, grads, g)
            total += loss * scale
        if self.group is not None:
            total, grads = distributed.mean_over_ranks(total, grads, weight, self.group)
        return total, grads

    def with_frozen_outputs(self, batches: List[Batch], memo: dict, key,
                            dtype=mx.float16) -> List[Batch]:
        """Training a low-rank correction, ``batches`` with the frozen maps' outputs
        attached, computed on the first call for ``key`` and kept in ``memo`` (in
        ``dtype``). Over a feature-store pool a sample comes back every epoch, and
        the frozen maps are most of a stored step's work (a top-18 map reads 18
        source layers): this runs them once per sample instead of every step. With
        full maps (``rank == 0``) the batches are returned as they are."""
        if not isinstance(self.maps, LowRankMaps) or self.maps.base.spec.shared_rank:
            # A compressed base's maps are small beside its shared projection, which
            # the correction reads anyway: nothing to save.
            return batches
        if key not in memo:
            outs = [self.maps.base.map_sources(b.src_keys, b.src_values) for b in batches]
            outs = [([k.astype(dtype) for k in ks], [v.astype(dtype) for v in vs])
                    for ks, vs in outs]
            mx.eval(outs)
            memo[key] = outs
        return [replace(b, frozen_keys=ks, frozen_values=vs)
                for b, (ks, vs) in zip(batches, memo[key])]

    def translator(self) -> Translator:
        """The current maps as a plain translator (corrections merged)."""
        return self.maps.merged() if isinstance(self.maps, LowRankMaps) else self.maps

    # -- checkpoint state ----------------------------------------------------

    def state_arrays(self) -> dict:
        """Everything needed to continue exactly: the base maps, the low-rank
        correction (if any) and the optimizer state."""
        base = self.maps.base if isinstance(self.maps, LowRankMaps) else self.maps
        arrays = {f"base.{k}": v for k, v in tree_flatten(base.parameters())}
        if isinstance(self.maps, LowRankMaps):
            arrays.update(
                {f"lowrank.{k}": v for k, v in tree_flatten(self.maps.trainable_parameters())}
            )
        arrays.update({f"opt.{k}": v for k, v in tree_flatten(self.optimizer.state)})
        return arrays

    def load_state_arrays(self, arrays: dict):
        """Restore the correction and optimizer state (the base maps are restored
        into the translator before the Distiller is made; see train.resume)."""
        from mlx.utils import tree_unflatten

        if isinstance(self.maps, LowRankMaps):
            lowrank = [(k[8:], v) for k, v in arrays.items() if k.startswith("lowrank.")]
            self.maps.load_weights(lowrank, strict=False)
        opt = [(k[4:], v) for k, v in arrays.items() if k.startswith("opt.")]
        self.optimizer.state = tree_unflatten(opt)
        mx.eval(self.maps.parameters(), self.optimizer.state)

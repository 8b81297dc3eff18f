"""A whole training run, as ``mlx-kvlingo train`` does it: stage 1 (closed form),
then stage 2 (distillation), alone or data-parallel under ``mlx.launch``.

Under ``mlx.launch -n N`` every rank runs the same call: the ranks check that they
read the same models and corpus, stage 1 sums its moments over them, stage 2
averages gradients, and rank 0 alone writes files (``distributed.is_writer``).
"""

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..errors import KvlingoError
from ..models.geometry import cache_geometry
from ..models.load import load_pair
from ..translator.maps import Translator, TranslatorSpec, load_translator
from . import distributed
from .distill import DistillConfig, parse_layer_ranks
from .loop import RunConfig, load_checkpoint, plan_steps, probe_step_cost, store_fit_features, train
from .recipe import fit_translator, no_progress
from .samples import pair_data
from .store import corpus_digest


@dataclass
class TrainOptions:
    """What ``mlx-kvlingo train`` is given (its ``--help`` says what each means)."""

    source: str
    target: str
    out: Path
    stage: str = "both"  # "1", "2" or "both"
    init: Optional[Path] = None  # stage 2 only: the translator to start from (default out)
    corpus: str = "stdlib"
    fit_tokens: int = 200_000
    ridge: float = 1e-3
    sources_per_layer: int = 1
    select_layers: Optional[Sequence[int]] = None
    token_layers: str = ""
    native_prefix: int = 1
    native_layer0: Optional[bool] = None
    distill: DistillConfig = field(default_factory=DistillConfig)
    context_lengths: Sequence[int] = (128, 256)
    continuation_len: int = 64
    eval_every: int = 50
    keep_best: bool = False  # end with the evaluated translator of lowest held-out KL
    checkpoint_every: int = 50
    store_pool: int = 0
    budget_s: Optional[float] = None  # whole run; stage 2's step count is planned to fit
    resume: bool = False
    peer_timeout: float = 1800

    def run_config(self) -> RunConfig:
        return RunConfig(self.distill, context_lengths=tuple(self.context_lengths),
                         continuation_len=self.continuation_len, eval_every=self.eval_every,
                         checkpoint_every=self.checkpoint_every, store_pool=self.store_pool,
                         keep_best=self.keep_best)


def train_translator(o: TrainOptions, log: Callable[[str], None] = print,
                     progress: Optional[Callable[[dict], None]] = None,
                     fit_progress: Callable = no_progress) -> dict:
    """Run stage 1 and/or stage 2 and write ``o.out`` (logs, plot and checkpoints
    beside it). Returns stage 2's summary (``stopped`` when interrupted: run again
    with ``resume``), or ``{"stage": 1}`` after stage 1 alone. ``progress`` gets
    stage 2's log records; ``fit_progress`` is stage 1's progress bar."""
    t_start = time.perf_counter()
    group = distributed.group()
    if group is not None:
        log(f"Training on {group.size()} processes (mlx.distributed).")
    if o.stage not in ("1", "2", "both"):
        raise KvlingoError(f"--stage must be 1, 2 or both, not {o.stage!r}.")
    # Before any work; the layers are checked once the target is known.
    parse_layer_ranks(o.distill.layer_ranks, o.distill.rank)
    config = o.run_config()
    src, src_tok, tgt, tgt_tok = load_pair(o.source, o.target, log=log)
    pair = None
    if group is not None:  # before any work: every rank must read the same data
        pair = pair_data(o.corpus, src_tok, tgt_tok)
        check_same_data(src, tgt, pair, group)
    from_store = None  # set when stage 1 builds stage 2's store
    if o.stage in ("1", "both") and not o.resume:
        if o.stage == "both" and o.store_pool and group is None:
            # One pass over the pool's samples serves both stages (the fit reads
            # the target's K/V off the teacher's prefill): the recipe's longest part.
            pair = pair_data(o.corpus, src_tok, tgt_tok)
            log(f"Stage 1 fits on stage 2's feature store ({o.store_pool} pool steps), "
                "built now: one pass over the samples for both stages.")

            def from_store(t):
                return store_fit_features(src, tgt, t, pair, o.out, config, o.fit_tokens,
                                          o.corpus, progress)
        translator, report = fit_translator(
            src, src_tok, tgt, tgt_tok, o.corpus, o.fit_tokens, max(config.context_lengths),
            8, o.ridge, o.sources_per_layer, o.native_prefix, o.select_layers,
            candidates_beside=o.out, group=group, pair=pair, from_store=from_store,
            token_layers=o.token_layers, progress=fit_progress, log=log,
        )
        translator.spec.native_layer0 = bool(o.native_layer0)
        r = report.to_dict()
        log(f"Stage 1: {r['tokens']} positions, {r['seconds']:.1f}s, mean R² keys "
            f"{r['mean_r2_keys']:.3f}, values {r['mean_r2_values']:.3f}")
        if from_store is not None and r["tokens"] < o.fit_tokens:
            log(f"  (all of the pool's positions: fewer than --fit-tokens {o.fit_tokens}; "
                "a larger --store-pool gives the fit more)")
        if distributed.is_writer(group):
            translator.save(o.out)
        if o.stage == "1":
            log(f"Wrote {o.out}")
            return {"stage": 1}
    elif not o.resume:
        translator = starting_translator(o.init or o.out, src, tgt, src_tok, tgt_tok, group)
        if o.native_layer0 is not None:
            translator.spec.native_layer0 = o.native_layer0
            translator.check_models(src, tgt, src_tok, tgt_tok)  # a supported target?
    else:
        translator = None  # the checkpoint holds it
    pair = pair or pair_data(o.corpus, src_tok, tgt_tok)
    if o.budget_s and o.resume:
        steps = checkpoint_steps(o.out) if distributed.is_writer(group) else None
        config.distill.steps = distributed.broadcast_json(steps, group)
    elif o.budget_s:
        steps = budget_steps(o.budget_s, time.perf_counter() - t_start, src, tgt, translator,
                             pair, config, built=config.store_pool if from_store else 0, log=log)
        config.distill.steps = distributed.broadcast_json(steps, group)  # rank 0's plan
    d = config.distill
    log(f"Stage 2: {d.steps} steps of {d.accumulate}x{d.batch_size} sequences, lr {d.lr:g}"
        + (f", low-rank correction of rank {d.rank}" if d.rank else ", full maps")
        + (f" (target layers {d.layer_ranks}: their own ranks)" if d.layer_ranks else ""))
    try:
        return train(src, tgt, translator, pair, o.out, config, resume=o.resume,
                     progress=progress, corpus_id=o.corpus, group=group,
                     peer_timeout=o.peer_timeout)
    finally:
        if group is not None:
            # The run is over (its files written, or a peer lost): mlx.launch SIGTERMs
            # every rank once one exits non-zero; let this one finish its report.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


def budget_steps(budget_s, spent_s, src, tgt, translator, pair, config, built=0,
                 log: Callable[[str], None] = print) -> int:
    """Stage 2's step count for a whole-run time budget, from a timed probe step."""
    prepare_s, update_s = probe_step_cost(src, tgt, translator, pair, config)
    # The optimizer step and bookkeeping add to the gradient evaluation; evaluations
    # during training cost about a step per window (none at --eval-every 0).
    evals = (config.distill.steps // config.eval_every + 1) if config.eval_every else 0
    eval_s = evals * config.eval_windows * (prepare_s + update_s) / max(
        config.distill.batch_size * config.distill.accumulate, 1)
    steps = plan_steps(budget_s, spent_s + prepare_s + update_s, prepare_s, 1.1 * update_s,
                       config.store_pool, eval_s, built)
    if config.store_pool:
        steps = max(steps, 1)
    log(f"Budget {budget_s / 60:.0f} min: {spent_s / 60:.1f} min spent; a step's frozen "
        f"passes take {prepare_s:.1f}s and its update {update_s:.1f}s, so stage 2 runs "
        f"{steps} steps" + (f" over a pool of {config.store_pool}" if config.store_pool else ""))
    return steps


def checkpoint_steps(out: Path) -> int:
    """The step count the interrupted run beside ``out`` planned."""
    _, info = load_checkpoint(Path(str(out) + ".ckpt.safetensors"))
    return info["config"]["distill"]["steps"]


def check_same_data(src, tgt, pair, group):
    """Every rank must read the same models and corpus (each draws samples from its own)."""
    distributed.check_same({
        "corpus": corpus_digest(pair),
        "source": cache_geometry(src).fingerprint(),
        "target": cache_geometry(tgt).fingerprint(),
    }, group)


def starting_translator(path, src, tgt, src_tok, tgt_tok, group) -> Translator:
    """The translator stage 2 starts from: read by rank 0 and sent to every rank
    (on several machines only rank 0 needs the file)."""
    found, error = None, None
    if distributed.is_writer(group):
        try:
            translator = load_translator(path)
            translator.check_models(src, tgt, src_tok, tgt_tok)
            found = {"spec": translator.spec.to_json()}
        except KvlingoError as e:
            found, error = {"error": str(e)}, e
    found = distributed.broadcast_json(found, group)
    if "error" in found:
        raise error or KvlingoError(found["error"])
    if not distributed.is_writer(group):
        translator = Translator(TranslatorSpec.from_json(found["spec"]))
    distributed.broadcast_module(translator, group)
    return translator

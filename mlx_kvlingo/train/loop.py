"""A stage-2 training run you can leave alone: sampling, evaluation, checkpoints,
resume, logs and a plot.

Files next to the translator ``OUT``:
- ``OUT`` — the translator, written atomically at every checkpoint and at the end;
- ``OUT.ckpt.safetensors`` — maps + optimizer state + run position, for ``resume``;
- ``OUT.log.jsonl`` — one JSON object per step and per evaluation;
- ``OUT.best.safetensors`` — in a run that evaluates, the translator of the evaluation
  with the lowest held-out KL so far (the starting point included); with
  ``keep_best`` it becomes ``OUT`` at the end (an early stop on held-out KL);
- ``OUT.png`` — loss, KL and CBR curves (when matplotlib, the ``plot`` extra, is installed).

Sampling is a pure function of (seed, step) (see samples.py), so a resumed run
draws exactly the samples the uninterrupted run would have drawn.

Under ``mlx.launch`` (``group``, see distributed.py) every rank runs this loop on
its share of each step's micro-batches; rank 0 alone evaluates and writes files,
and a checkpoint records how many ranks wrote it (a resume needs as many).
"""

import json
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx

from ..errors import KvlingoError
from ..files import save_safetensors_atomic, written_atomically
from ..measure.evaluate import Fidelity, evaluate_pair
from ..models.features import token_inputs
from ..translator.maps import Translator, TranslatorSpec
from . import distributed
from .distill import DistillConfig, Distiller, with_native_features
from .store import FeatureStore, corpus_digest, store_key

CHECKPOINT_VERSION = 1


@dataclass
class RunConfig:
    distill: DistillConfig = field(default_factory=DistillConfig)
    context_lengths: Sequence[int] = (128, 256)  # a few buckets of context length
    continuation_len: int = 64
    eval_every: int = 50
    eval_windows: int = 16
    eval_context: Optional[int] = None  # default: the largest context bucket
    checkpoint_every: int = 50
    # >0: cache the frozen passes of this many steps on disk (store.py) and cycle
    # over them in epochs; 0: fresh samples at every step.
    store_pool: int = 0
    # End with the evaluated translator of lowest held-out KL, not the last step's: a
    # small training set (a few dozen chats) overfits before the steps run out.
    keep_best: bool = False

    def __post_init__(self):  # before any work, not after stage 1
        if self.keep_best and not self.eval_every:
            raise KvlingoError("Keeping the best translator needs held-out evaluations to "
                               "choose from: set --eval-every (eval_every) above 0.")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["context_lengths"] = list(self.context_lengths)
        return d


class StopRequested:
    """SIGINT/SIGTERM set a flag; the loop checkpoints and returns at a step boundary."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no handlers
                pass
        return self

    def _handle(self, signum, frame):
        if self.requested:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def plan_steps(budget_s: float, spent_s: float, prepare_s: float, update_s: float,
               pool: int, eval_s: float = 0.0, built: int = 0) -> int:
    """Optimizer steps that fit what is left of a time budget.

    A stored run pays ``prepare_s`` (the frozen passes) once per pool step, then
    ``update_s`` per step; a run without a store (``pool`` 0) pays both every step.
    ``built``: pool steps already on disk (a stage 1 that built the store), which
    cost only their reading from here on.
    """
    left = budget_s - spent_s - eval_s
    if pool:
        left -= max(pool - built, 0) * prepare_s
        steps = left / update_s
    else:
        steps = left / (prepare_s + update_s)
    if steps < 1:
        raise KvlingoError(
            f"The time budget ({budget_s / 60:.0f} min) leaves no time for stage 2: "
            f"{spent_s / 60:.1f} min are spent and a step costs about "
            f"{prepare_s + update_s:.1f}s. Give a longer budget or a smaller --store-pool."
        )
    return int(steps)


def probe_step_cost(source, target, translator, pair_data, config: RunConfig):
    """Seconds for one step's frozen passes and for its gradients, measured on the
    step the run starts with (on a copy of the maps: nothing is trained). With a
    store and a low-rank correction the frozen maps run once per pool sample, as in
    :func:`train`: that run counts with the frozen passes, and the gradients are
    timed as every later epoch's step computes them."""
    maps = Translator(translator.spec)
    maps.update(translator.parameters())
    distiller = Distiller(maps, target, config.distill)
    t0 = time.perf_counter()
    batches = pair_data.step_batches(source, target, translator, config, 0)
    if config.store_pool:
        batches = distiller.with_frozen_outputs(batches, {}, 0)
    t1 = time.perf_counter()
    mx.eval(distiller.gradients(batches))
    return t1 - t0, time.perf_counter() - t1


def open_store(source, target, translator, pair_data, out: Path, config: RunConfig,
               corpus_id: str = "", group=None, progress=None):
    """The feature store of a run writing ``out`` (``OUT.store/``), keyed on what its
    shards depend on; ``translator`` gives the source layers it keeps."""
    key = store_key(source, target, translator, config,
                    f"{corpus_id}:{corpus_digest(pair_data)}")
    store_dir = _paths(out)["store"]
    if group is not None:  # each rank keeps its own share of every pool step
        part = f"rank{group.rank()}of{group.size()}"
        key["part"] = part
        store_dir = store_dir.with_name(f"{store_dir.name}-{part}")
    return FeatureStore(store_dir, key, config.store_pool, config.distill.teacher_topk,
                        log=lambda m: progress and progress({"message": m}))


@dataclass
class EveryLayer:
    """A translator as sampling and the store see it, reading every source layer:
    the store of a stage-1 fit that has yet to choose them."""

    spec: TranslatorSpec

    @property
    def source_layers(self):
        return list(range(self.spec.source.cache_geometry.n_layers))


def store_fit_features(source, target, translator, pair_data, out: Path, config: RunConfig,
                       positions: int, corpus_id: str = "", progress=None):
    """Build the whole store of a run writing ``out`` (every source layer), and yield
    (source K, source V, target K, target V) of its first ``positions`` translated
    positions, for a stage-1 fit (fit.fit_selected).

    Stage 1 and stage 2 both prefill source and target over their samples; here the
    fit reads the target's K/V off the teacher's prefill of stage 2's pool, so the
    recipe runs those passes once. Shards already on disk (a rerun) are read back,
    and the target's K/V recomputed for those the fit needs.
    """
    view = EveryLayer(translator.spec)
    store = open_store(source, target, view, pair_data, out, config, corpus_id,
                       progress=progress)
    taken = 0
    for v in range(store.pool):
        computed = []

        def compute(v):
            computed.extend(pair_data.step_batches(source, target, view, config, v,
                                                   native=taken < positions))
            return computed

        batches = store.get(v, compute)
        if progress and ((v + 1) % 8 == 0 or v + 1 == store.pool):
            progress({"message": f"feature store: {v + 1}/{store.pool} pool steps"})
        if taken >= positions:
            continue
        for b in computed or [with_native_features(target, b) for b in batches]:
            item = (b.src_keys, b.src_values, b.native_keys, b.native_values)
            n = b.native_keys[0].shape[1]
            if translator.spec.token_layers:
                item += (token_inputs(target, b.context, b.n_native, b.n_native + n),)
            yield item
            taken += b.native_keys[0].shape[0] * n


def _paths(out: Path):
    out = Path(out)
    return {
        "translator": out,
        "checkpoint": out.with_name(out.name + ".ckpt.safetensors"),
        "log": out.with_name(out.name + ".log.jsonl"),
        "plot": out.with_name(out.name + ".png"),
        "store": out.with_name(out.name + ".store"),
        "best": out.with_name(out.name + ".best.safetensors"),
    }


def save_checkpoint(path: Path, distiller: Distiller, spec: TranslatorSpec, config: RunConfig):
    info = {
        "version": CHECKPOINT_VERSION,
        "step": distiller.step,
        "skipped": distiller.skipped,
        "config": config.to_dict(),
        "spec": spec.to_json(),
    }
    if distiller.group is not None:  # absent: one process (as before distribution)
        info["world_size"] = distiller.group.size()
    meta = {"mlx_kvlingo_checkpoint": json.dumps(info)}
    save_safetensors_atomic(path, distiller.state_arrays(), meta)


def load_checkpoint(path: Path):
    try:
        arrays, meta = mx.load(str(path), format="safetensors", return_metadata=True)
        info = json.loads(meta["mlx_kvlingo_checkpoint"])
    except Exception as e:
        raise KvlingoError(f"Cannot resume: checkpoint {path} is unreadable ({e}).") from e
    return arrays, info


def _truncate_log(path: Path, step: int):
    """Drop log lines past ``step`` (written after the checkpoint we resume from)."""
    if not path.exists():
        return
    keep = [l for l in path.read_text().splitlines() if l and json.loads(l).get("step", 0) <= step]
    path.write_text("".join(l + "\n" for l in keep))


def _best_in_log(path: Path) -> Optional[dict]:
    """The evaluation record of lowest held-out KL in a run's log (None: none)."""
    if not path.exists():
        return None
    evals = [r for r in map(json.loads, filter(None, path.read_text().splitlines()))
             if "eval" in r]
    return min(evals, key=lambda r: r["eval"]["kl"], default=None)


def _keep_if_best(paths, distiller: Distiller, config: RunConfig, record: dict,
                  best: Optional[dict]) -> dict:
    """Write the translator to ``OUT.best.safetensors`` when ``record`` (an
    evaluation) has a lower held-out KL than ``best``; returns the best record."""
    if best is not None and record["eval"]["kl"] >= best["eval"]["kl"]:
        return best
    _trained(distiller, config, heldout_kl=record["eval"]["kl"]).save(paths["best"])
    return record


def train(
    source,
    target,
    translator: Optional[Translator],
    pair_data,
    out: Path,
    config: RunConfig,
    resume: bool = False,
    progress: Optional[Callable[[dict], None]] = None,
    corpus_id: str = "",
    group=None,
    peer_timeout: float = 0,
) -> dict:
    """Distil ``translator`` (already stage-1 fitted) and write it to ``out``.

    ``pair_data``: a :class:`~mlx_kvlingo.train.samples.SharedTokens` or
    :class:`~mlx_kvlingo.train.samples.AlignedText` that draws each step's batches and
    the held-out evaluation set.

    With ``resume=True`` the translator, optimizer and position come from the
    checkpoint next to ``out`` (``translator`` may be None).

    Returns a summary: steps done, skipped steps, the last evaluation, whether the
    run was stopped early (then resumable with ``resume=True``).

    ``group``: an ``mx.distributed`` group when launched on several processes (every
    rank calls this with the same arguments and the same starting translator);
    ``progress`` is then called on rank 0 only. Its step records also carry
    ``total``, the run's number of steps. ``peer_timeout``: seconds one step
    may take before this rank gives up on the others (see distributed.Watchdog).
    """
    paths = _paths(out)
    writer = distributed.is_writer(group)
    positions = None
    if group is not None:
        positions = distributed.micro_batch_positions(pair_data.micro_batches(config), group)
    if writer:
        paths["translator"].parent.mkdir(parents=True, exist_ok=True)
    else:
        progress = None
    if resume:
        distiller = _resume(paths, target, config, group)
    else:
        if translator is None:
            raise KvlingoError("A starting translator (the stage-1 fit) is needed.")
        distiller = Distiller(translator, target, config.distill, group)
        for stale in ("log", "best"):  # an earlier run's, in the same place
            if writer and paths[stale].exists():
                paths[stale].unlink()

    store = None
    if config.store_pool:
        store = open_store(source, target, distiller.base, pair_data, out, config,
                           corpus_id, group, progress)

    frozen = {}  # pool step -> the frozen maps' outputs on its samples (rank > 0)

    def step_batches(step: int):
        if store is None:
            return pair_data.step_batches(source, target, distiller.base, config, step, group)
        v = store.pool_step(step, config.distill.seed)
        batches = store.get(
            v, lambda v: pair_data.step_batches(source, target, distiller.base, config, v, group)
        )
        return distiller.with_frozen_outputs(batches, frozen, v, store.dtype)

    eval_context = config.eval_context or max(config.context_lengths)
    # Drawn only for a run that evaluates (a small chat set may hold too few held-out tokens).
    eval_items = (pair_data.heldout(eval_context, config.continuation_len, config.eval_windows)
                  if config.eval_every else None)

    def evaluate() -> Fidelity:
        translators = [distiller.translator()]
        return evaluate_pair(pair_data, source, target, translators, eval_items, eval_context)[0]

    stopped = False
    last_eval = None
    # On resume, the best evaluation before the checkpoint (its file is the one beside
    # OUT; without that file the next evaluation starts the comparison again).
    best = (_best_in_log(paths["log"]) if resume and writer and paths["best"].exists()
            else None)
    t_run = time.perf_counter()
    log_path = paths["log"] if writer else os.devnull
    saved = distiller.step  # the step of the checkpoint a failure falls back to
    watchdog = distributed.Watchdog(peer_timeout, group)
    with open(log_path, "a") as log, StopRequested() as stop, watchdog:
        if distiller.step == 0 and config.eval_every and writer:
            # The starting point (the stage-1 fit), for comparison.
            last_eval = {"step": 0, "eval": evaluate().to_dict()}
            log.write(json.dumps(last_eval) + "\n")
            best = _keep_if_best(paths, distiller, config, last_eval, best)
            if progress:
                progress(last_eval)
        while distiller.step < config.distill.steps:
            watchdog.hint = _resume_hint(paths, saved)
            watchdog.arm(f"step {distiller.step + 1}")
            t0 = time.perf_counter()
            batches = step_batches(distiller.step)
            t1 = time.perf_counter()
            with distributed.collective_errors(
                group, f"averaging the gradients of step {distiller.step + 1}",
                _resume_hint(paths, saved),
            ):
                loss, applied = distiller.train_step(batches, positions)
            t2 = time.perf_counter()
            tokens = sum(b.tokens for b in batches)
            if group is not None:  # the whole step's: its micro-batches are equally long
                tokens = tokens * pair_data.micro_batches(config) // len(batches)
            record = {
                "step": distiller.step,
                "loss": loss,
                "applied": applied,
                "lr": float(distiller.optimizer.learning_rate.item()),
                "tokens": tokens,
                "prepare_s": round(t1 - t0, 4),
                "update_s": round(t2 - t1, 4),
                "tokens_per_s": tokens / (t2 - t0),
            }
            log.write(json.dumps(record) + "\n")
            if progress:  # with the run's step count, for a bar and its ETA
                progress(dict(record, total=config.distill.steps))
            done = distiller.step
            if writer and config.eval_every and (
                done % config.eval_every == 0 or done == config.distill.steps
            ):
                fid = evaluate()
                last_eval = {"step": done, "eval": fid.to_dict()}
                log.write(json.dumps(last_eval) + "\n")
                best = _keep_if_best(paths, distiller, config, last_eval, best)
                if progress:
                    progress(last_eval)
            stop_now = stop.requested
            if group is not None:  # a stop reaching one rank stops all at this step
                with distributed.collective_errors(group, f"finishing step {done}",
                                                   _resume_hint(paths, saved)):
                    # Not written back into stop.requested: a signal landing during
                    # the collective must not be lost; the next step agrees on it.
                    stop_now = distributed.any_rank(stop.requested, group)
            watchdog.disarm()
            if (config.checkpoint_every and done % config.checkpoint_every == 0) or stop_now:
                log.flush()
                if writer:
                    _save_all(paths, distiller, config)
                saved = done
            if stop_now:
                stopped = True
                break
        log.flush()
    if writer:
        if not stopped:
            _save_all(paths, distiller, config)
            if config.keep_best and best is not None:
                with written_atomically(paths["translator"]) as tmp:
                    shutil.copyfile(paths["best"], tmp)
        write_plot(paths["log"], paths["plot"])
    # No rank leaves before rank 0's files are whole: mlx.launch ends the others as
    # soon as one process exits with a non-zero status (as a stopped run does).
    distributed.barrier(group, "waiting for rank 0 to write the translator")
    return {
        "steps": distiller.step,
        "skipped": distiller.skipped,
        "stopped": stopped,
        "seconds": time.perf_counter() - t_run,
        "last_eval": last_eval,
        "best_eval": best,
        "paths": {k: str(v) for k, v in paths.items()},
    }


def _resume_hint(paths, step: int) -> str:
    if not step:
        return "No checkpoint was written yet: start the run again."
    return (f"The checkpoint of step {step} ({paths['checkpoint']}) is intact: run the "
            "same mlx.launch command with --resume, with the same number of processes.")


def _read_checkpoint(paths, group):
    """(arrays, info) of the checkpoint, read by the writer and sent to every rank
    (on several machines only rank 0 has the file)."""
    found = None
    if distributed.is_writer(group):
        try:
            if not paths["checkpoint"].exists():
                raise KvlingoError(f"Cannot resume: no checkpoint at {paths['checkpoint']}.")
            arrays, info = load_checkpoint(paths["checkpoint"])
            found = {"info": info}
        except KvlingoError as e:
            found = {"error": str(e)}
    found = distributed.broadcast_json(found, group)
    if "error" in found:
        raise KvlingoError(found["error"])
    if group is None:
        return arrays, found["info"]
    return distributed.broadcast_arrays(arrays if distributed.is_writer(group) else None,
                                        group), found["info"]


def _resume(paths, target, config: RunConfig, group=None) -> Distiller:
    """Rebuild the Distiller exactly as it was at the last checkpoint."""
    arrays, info = _read_checkpoint(paths, group)
    ranks, now = info.get("world_size", 1), distributed.size(group)
    if ranks != now:
        raise KvlingoError(
            f"Cannot resume: checkpoint {paths['checkpoint']} was written by a run of "
            f"{ranks} process(es) and this run has {now}. Resume with the same number "
            f"(mlx.launch -n {ranks} ...{'' if ranks > 1 else ', or without mlx.launch'}): "
            "each process's share of the samples and its feature store depend on it."
        )
    # Settings added since the checkpoint was written take their defaults there.
    saved = {**RunConfig().to_dict(), **info["config"]}
    saved["distill"] = {**asdict(DistillConfig()), **saved["distill"]}
    if saved != config.to_dict():
        raise KvlingoError(
            "Cannot resume: the run's settings differ from the checkpoint's "
            f"({saved} vs {config.to_dict()})."
        )
    translator = Translator(TranslatorSpec.from_json(info["spec"]))
    translator.load_weights([(k[5:], v) for k, v in arrays.items() if k.startswith("base.")])
    distiller = Distiller(translator, target, config.distill, group)
    distiller.load_state_arrays(arrays)
    distiller.step, distiller.skipped = info["step"], info["skipped"]
    if distributed.is_writer(group):
        _truncate_log(paths["log"], distiller.step)
    return distiller


def _trained(distiller: Distiller, config: RunConfig, **facts) -> Translator:
    """The current maps as a translator whose file says how stage 2 made them."""
    t = distiller.translator()
    t.spec.training = dict(t.spec.training, stage=2,
                           distill={"steps_done": distiller.step, **facts, **config.to_dict()})
    return t


def _save_all(paths, distiller: Distiller, config: RunConfig):
    t = _trained(distiller, config)
    save_checkpoint(paths["checkpoint"], distiller, t.spec, config)
    t.save(paths["translator"])


def write_plot(log_path: Path, png_path: Path) -> bool:
    """Loss/KL and CBR curves from the JSON-lines log; skipped (False) when
    matplotlib, the ``plot`` extra, is not installed."""
    from ..plotting import available, pyplot

    if not available():
        return False
    plt = pyplot()
    steps, losses, ev_steps, ev_kl, ev_cbr = [], [], [], [], []
    for line in Path(log_path).read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            steps.append(r["step"])
            losses.append(r["loss"])
        elif "eval" in r:
            ev_steps.append(r["step"])
            ev_kl.append(r["eval"]["kl"])
            ev_cbr.append(r["eval"]["cbr"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(steps, losses, lw=0.8, label="train KL (loss)")
    a.plot(ev_steps, ev_kl, "o-", label="held-out KL")
    a.set_xlabel("step")
    a.set_ylabel("nats / token")
    a.legend()
    b.plot(ev_steps, ev_cbr, "o-", color="C2")
    b.set_xlabel("step")
    b.set_ylabel("context benefit retained")
    fig.tight_layout()
    tmp = png_path.with_name(f".{png_path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, png_path)
    return True

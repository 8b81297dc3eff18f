"""Data-parallel training across processes with MLX's own distributed layer.

``mlx.launch -n 2 mlx-kvlingo train ...`` (ring backend over TCP; MPI where it is
installed) starts the same command in every process ("rank"). Each rank reads its
own share of the samples; stage 1 sums its least-squares moments across ranks
before one solve, stage 2 averages gradients every step, and rank 0 (the
*writer*) alone writes the translator, checkpoints, logs and plots.

A process that was not launched that way has a world of one: :func:`group` is
None and no function here makes a collective call, so a single-process run does
exactly what it did before distribution existed.

Every collective here is matched on every rank (same calls, same order), which is
what keeps the ring from waiting forever; a rank that dies closes its sockets and
the others' next collective raises (see :class:`PeerLost`).
"""

import dataclasses
import itertools
import json
import os
import sys
import threading
from typing import Iterable, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..errors import KvlingoError

_UNSET = object()
_group = _UNSET


class PeerLost(KvlingoError):
    """A collective failed: another rank of the run died or became unreachable."""


# Set by mlx.launch (ring, jaccl, nccl: MLX_RANK) or by mpirun (Open MPI, MPICH).
_LAUNCHED_BY = ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def group() -> Optional[mx.distributed.Group]:
    """The group of all launched processes, or None when this process runs alone
    (then not even ``mx.distributed.init`` is called)."""
    global _group
    if _group is _UNSET:
        _group = None
        if any(v in os.environ for v in _LAUNCHED_BY):
            g = mx.distributed.init()
            _group = g if g.size() > 1 else None
    return _group


def rank(g=None) -> int:
    return g.rank() if g is not None else 0


def size(g=None) -> int:
    return g.size() if g is not None else 1


def is_writer(g=None) -> bool:
    """Whether this process writes files (rank 0, or the only process)."""
    return rank(g) == 0


def share(items: Iterable, g=None) -> list:
    """This rank's share of ``items``: every size-th item from the rank-th. Item j
    always goes to rank j % size, so the shares partition the items whatever each
    item costs to make."""
    return list(items)[rank(g) :: size(g)]


def shard_iter(items: Iterable, g=None) -> Iterable:
    """Lazy :func:`share` of an iterable (items of other ranks are drawn, not kept)."""
    return items if g is None else itertools.islice(items, rank(g), None, size(g))


# ---------------------------------------------------------------------------
# Stage 1: moments


def all_sum_moments(acc, g) -> None:
    """Sum a moment accumulator (``fit.MomentAccumulator`` or ``GramAccumulator``)
    across ranks, in place, in float64: afterwards every rank holds the moments of
    every rank's positions and one solve gives the maps of the whole corpus."""

    def total(a: np.ndarray) -> np.ndarray:
        # float64 collectives run on the CPU stream (the GPU has no float64).
        s = mx.distributed.all_sum(mx.array(a, dtype=mx.float64), group=g, stream=mx.cpu)
        return np.array(s, dtype=np.float64)

    def visit(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if isinstance(v, np.ndarray):
                    node[k] = total(v)
                else:
                    visit(v)
        elif isinstance(node, list):
            for v in node:
                visit(v)
        elif dataclasses.is_dataclass(node):  # fit.Moments
            for f in dataclasses.fields(node):
                v = getattr(node, f.name)
                setattr(node, f.name, total(v) if isinstance(v, np.ndarray)
                        else int(total(np.array([v], dtype=np.float64))[0]))

    with collective_errors(g, "summing the stage-1 moments"):
        visit(acc.xtx)
        visit(acc.outputs)
        acc.count = int(total(np.array([acc.count], dtype=np.float64))[0])


# ---------------------------------------------------------------------------
# Stage 2: gradients


def mean_over_ranks(loss: mx.array, grads, tokens: int, g):
    """The token-weighted mean over ranks of each rank's (mean loss, mean gradients)
    over its ``tokens`` continuation tokens: what one process computes over the
    whole global batch. One all-reduce (``mlx.nn.average_gradients`` packs the
    small arrays together); lazy, like the gradients it is given."""
    w = mx.array(float(tokens))
    tree = {"loss": loss * w, "tokens": w, "grads": tree_map(lambda x: x * w, grads)}
    mean = nn.average_gradients(tree, g)  # sums / size: the size cancels below
    w_all = mean["tokens"]
    return mean["loss"] / w_all, tree_map(lambda x: x / w_all, mean["grads"])


def any_rank(flag: bool, g) -> bool:
    """True on every rank when ``flag`` is true on any (e.g. a stop request that
    reached one process only), so all ranks leave the loop at the same step."""
    if g is None:
        return flag
    return mx.distributed.all_sum(mx.array([int(flag)]), group=g, stream=mx.cpu).item() > 0


def barrier(g, doing: str = "waiting for the other processes") -> None:
    """Return when every rank has reached this point."""
    if g is None:
        return
    with collective_errors(g, doing):
        mx.eval(mx.distributed.all_sum(mx.array([1]), group=g, stream=mx.cpu))


# ---------------------------------------------------------------------------
# Sending the writer's state to every rank (it alone reads files on resume)


def broadcast_json(obj, g):
    """The writer's ``obj`` (JSON-able) on every rank; other ranks pass anything."""
    if g is None:
        return obj
    with collective_errors(g, "receiving the run's state from rank 0"):
        data = json.dumps(obj).encode() if is_writer(g) else b""
        n = int(mx.distributed.all_sum(mx.array([len(data)]), group=g, stream=mx.cpu).item())
        buf = np.frombuffer(data, dtype=np.uint8) if is_writer(g) else np.zeros(n, np.uint8)
        got = mx.distributed.all_sum(mx.array(buf.astype(np.int32)), group=g, stream=mx.cpu)
        return json.loads(np.array(got).astype(np.uint8).tobytes().decode())


def check_same(facts: dict, g) -> None:
    """Refuse to train when this rank's ``facts`` (e.g. digests of the corpus and the
    models) differ from rank 0's: ranks draw their samples from their own copies, and
    different copies would silently train on different data. Every rank raises."""
    if g is None:
        return
    theirs = broadcast_json(facts if is_writer(g) else None, g)
    differ = sorted(k for k in set(facts) | set(theirs) if facts.get(k) != theirs.get(k))
    with collective_errors(g, "comparing the data of every process"):
        count = mx.distributed.all_sum(mx.array([int(bool(differ))]), group=g, stream=mx.cpu)
        count = int(count.item())
    if count:
        mine = f" Here (rank {rank(g)}): {', '.join(differ)} differ." if differ else ""
        raise KvlingoError(
            f"{count} process(es) of the run read other data than rank 0 (models or "
            f"corpus on their machines differ).{mine} Give every machine the same files "
            "(same model directories and corpus; 'stdlib' depends on the Python version)."
        )


def broadcast_arrays(arrays: Optional[dict], g) -> dict:
    """The writer's flat dict of arrays, bit for bit, on every rank."""
    if g is None:
        return arrays
    names = broadcast_json(
        {k: [list(v.shape), str(v.dtype).split(".")[-1]] for k, v in arrays.items()}
        if is_writer(g) else None, g)
    out = {}
    with collective_errors(g, "receiving the run's state from rank 0"):
        for k, (shape, dtype) in names.items():
            x = arrays[k] if is_writer(g) else mx.zeros(shape, getattr(mx, dtype))
            # all_gather, not all_sum: exact for every dtype (and for -0.0).
            out[k] = mx.distributed.all_gather(x[None], group=g, stream=mx.cpu)[0]
        mx.eval(out)
    return out


def broadcast_module(module: nn.Module, g) -> None:
    """Replace a module's parameters by the writer's, on every rank."""
    if g is None:
        return
    params = broadcast_arrays(dict(tree_flatten(module.parameters())), g)
    module.update(tree_unflatten(list(params.items())))
    mx.eval(module.parameters())


# ---------------------------------------------------------------------------
# Failures


class collective_errors:
    """Turn a failed collective (MLX raises RuntimeError, e.g. "[ring] connection to
    a peer was lost") into a :class:`PeerLost` that names this rank and what it was
    doing; ``hint`` says how to go on."""

    def __init__(self, g, doing: str, hint: str = ""):
        self.g, self.doing, self.hint = g, doing, hint

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if self.g is None or kind is None or not issubclass(kind, RuntimeError):
            return False
        raise PeerLost(
            f"Rank {rank(self.g)} of {size(self.g)} stopped while {self.doing}: {err}. "
            "Another process of the run probably died or lost its network (see its "
            "output above)." + (f" {self.hint}" if self.hint else "")
        ) from err


class Watchdog:
    """Ends this process when one step takes longer than ``seconds``.

    A rank that *dies* closes its sockets and the others' next collective raises at
    once. A machine that vanishes (power, network) closes nothing, and the others
    would wait in the collective for ever: so each step is armed with a deadline,
    and at the deadline this process prints why and exits with status 1 (from a
    timer thread: the main thread is blocked inside MLX). Files are written
    atomically, so the last checkpoint stays whole. ``seconds`` 0: no deadline.

    The first step a process arms gets ``FIRST_STEP_GRACE`` times the limit: it alone
    pays one-time costs (allocation, the teacher's first passes, a peer still loading
    its models), so a limit sized for the steady steps must not end the run there (a
    loaded CI machine once had both ranks give up on step 1 at 15 s).
    """

    FIRST_STEP_GRACE = 4

    def __init__(self, seconds: float, g, hint: str = ""):
        self.seconds = seconds if g is not None else 0
        self.g, self.hint = g, hint
        self._timer = None
        self._armed_before = False

    def arm(self, what: str):
        self.disarm()
        if self.seconds > 0:
            limit = self.seconds * (1 if self._armed_before else self.FIRST_STEP_GRACE)
            self._armed_before = True
            self._timer = threading.Timer(limit, self._fire, args=(what, limit))
            self._timer.daemon = True
            self._timer.start()

    def disarm(self):
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):  # never outlive the loop it guards (e.g. on an error)
        self.disarm()

    def _fire(self, what: str, limit: float):
        sys.stderr.write(
            f"error: Rank {rank(self.g)} of {size(self.g)} waited more than "
            f"{limit:g}s for {what}: another process of the run is stuck or "
            f"unreachable (--peer-timeout sets this limit). {self.hint}\n")
        sys.stderr.flush()
        os._exit(1)


def micro_batch_positions(count: int, g) -> List[int]:
    """Global positions of this rank's micro-batches among ``count`` per step;
    refuses a world larger than the micro-batches it would share."""
    if count < size(g):
        raise KvlingoError(
            f"A step has {count} micro-batch(es) but the run has {size(g)} processes: "
            "each needs at least one. Raise --accumulate (or --batch-size for a "
            "cross-tokenizer pair) or launch fewer processes."
        )
    return share(range(count), g)

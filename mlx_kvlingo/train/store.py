"""A disk store of what stage 2 computes without gradients.

A distillation step needs, per sample, the source's features of the context and
the teacher's distribution over the continuation. Both depend only on the sample
(the models are frozen), and they are most of a step's cost: the source's prefill
and the teacher's prefill plus its vocabulary head (12 of 17 s per step with
Gemma 3 as the target). The store computes them once per sample and keeps them
as safetensors shards, so later epochs only run the target over the continuation
on the translated cache.

Layout (a directory): ``manifest.json`` says what the shards were built for
(models, source layers, native prefix, sampling settings, corpus, dtype, teacher
top-k); ``step-NNNNN.safetensors`` holds the micro-batches of one pool step.
A store built for anything else is refused by name and rebuilt; one built with
more source layers than a run reads serves it (a stage-1 fit on the store's samples
builds it with every source layer before the layers are chosen). A damaged shard is
reported and recomputed. Shards are written atomically, so an interrupted run
leaves only whole shards.

Which pool step a training step reads is a seeded permutation per epoch, a pure
function of (seed, step), so a resumed run reads what the uninterrupted one would.
"""

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Callable, List

import mlx.core as mx

from ..files import save_safetensors_atomic
from ..models.geometry import cache_geometry
from .distill import Batch

STORE_VERSION = 1


class StoreError(Exception):
    """A store or shard that cannot be used."""


def corpus_digest(pair_data) -> str:
    """A short digest of the training text the samples are drawn from."""
    h = hashlib.sha256()
    text = getattr(pair_data, "train_text", None)
    if text is not None:
        h.update(text.encode())
    else:
        h.update(json.dumps(list(pair_data.train_stream)).encode())
    return h.hexdigest()[:16]


class FeatureStore:
    """Pool steps of precomputed batches on disk.

    ``key``: everything the shards depend on (a JSON-able dict); ``pool``: number of
    distinct steps; ``dtype``: how source features and the teacher are kept
    (float16 halves the disk and read cost; float32 reproduces the uncached step).
    """

    def __init__(self, root: Path, key: dict, pool: int, teacher_topk: int = 0,
                 dtype=mx.float16, log: Callable[[str], None] = print):
        self.root = Path(root)
        self.pool = pool
        self.teacher_topk = teacher_topk
        self.dtype = dtype
        self.log = log
        self.key = dict(key, version=STORE_VERSION, teacher_topk=teacher_topk,
                        dtype=str(dtype))
        # Source layers the run reads; a store holding more is read without the rest.
        self.layers = set(self.key.get("source_layers", ()))
        self._open()

    # -- the manifest ----------------------------------------------------------

    def _open(self):
        manifest = self.root / "manifest.json"
        if manifest.exists():
            try:
                have = json.loads(manifest.read_text())["key"]
            except (ValueError, KeyError, OSError) as e:
                have = {"unreadable": str(e)}
            if have == self.key or self._serves(have):
                return
            differs = sorted(k for k in set(have) | set(self.key) if have.get(k) != self.key.get(k))
            self.log(f"Feature store {self.root} was built for other settings "
                     f"({', '.join(differs)} differ); rebuilding it.")
            shutil.rmtree(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = manifest.with_name(".manifest.json.tmp")
        tmp.write_text(json.dumps({"key": self.key}, indent=1))
        os.replace(tmp, manifest)

    def _serves(self, have: dict) -> bool:
        """A store whose key differs only in holding more source layers."""
        layers = "source_layers"
        rest = lambda k: {n: v for n, v in k.items() if n != layers}  # noqa: E731
        return (layers in have and rest(have) == rest(self.key)
                and self.layers <= set(have[layers]))

    # -- which pool step a training step reads --------------------------------

    def pool_step(self, step: int, seed: int) -> int:
        epoch, i = divmod(step, self.pool)
        order = list(range(self.pool))
        if epoch:  # the first epoch reads the pool in order, so it is built in order
            random.Random(seed * 7919 + epoch).shuffle(order)
        return order[i]

    # -- shards ----------------------------------------------------------------

    def shard(self, pool_step: int) -> Path:
        return self.root / f"step-{pool_step:05d}.safetensors"

    def get(self, pool_step: int, compute: Callable[[int], List[Batch]]) -> List[Batch]:
        """The batches of a pool step: from its shard, or computed (and stored)."""
        path = self.shard(pool_step)
        if path.exists():
            try:
                return self._read(path)
            except StoreError as e:
                self.log(f"{e}; recomputing it.")
        batches = [b.with_teacher_topk(self.teacher_topk) for b in compute(pool_step)]
        self._write(path, batches)
        return self._read(path)  # what later epochs will read, exactly

    def built(self) -> int:
        return sum(1 for _ in self.root.glob("step-*.safetensors"))

    def _write(self, path: Path, batches: List[Batch]):
        arrays, meta = {}, []
        for j, b in enumerate(batches):
            p = f"mb{j}."
            for name, xs in (("src_k", b.src_keys), ("src_v", b.src_values)):
                for layer, x in enumerate(xs):
                    if x is not None:
                        arrays[f"{p}{name}.{layer}"] = x.astype(self.dtype)
            for layer, (k, v) in enumerate(b.prefix):
                arrays[f"{p}prefix_k.{layer}"] = k
                arrays[f"{p}prefix_v.{layer}"] = v
            arrays[p + "context"] = b.context.astype(mx.int32)
            arrays[p + "continuation"] = b.continuation.astype(mx.int32)
            arrays[p + "teacher"] = b.teacher.astype(self.dtype)
            if b.teacher_idx is not None:
                arrays[p + "teacher_idx"] = b.teacher_idx.astype(mx.int32)
            if b.weights is not None:
                arrays[p + "weights"] = b.weights.astype(mx.float32)
            meta.append({"n_native": b.n_native, "source_layers": len(b.src_keys),
                         "prefix_layers": len(b.prefix)})
        save_safetensors_atomic(path, arrays, {"batches": json.dumps(meta)})

    def _read(self, path: Path) -> List[Batch]:
        try:
            arrays, info = mx.load(str(path), format="safetensors", return_metadata=True)
            meta = json.loads(info["batches"])
            batches = [self._batch(arrays, f"mb{j}.", m, self.layers) for j, m in enumerate(meta)]
        except Exception as e:  # any damage: unreadable header, missing tensor, bad JSON
            raise StoreError(f"Feature store shard {path} is damaged ({type(e).__name__}: {e})") from e
        mx.eval([(b.src_keys, b.src_values, b.teacher) for b in batches])
        return batches

    @staticmethod
    def _batch(arrays: dict, p: str, m: dict, keep=None) -> Batch:
        def layers(name, n):
            return [arrays.get(f"{p}{name}.{i}") for i in range(n)]

        def source(name):  # None for a layer the run does not read
            xs = layers(name, m["source_layers"])
            return [x if not keep or i in keep else None for i, x in enumerate(xs)]

        f32 = lambda xs: [x.astype(mx.float32) if x is not None else None for x in xs]  # noqa: E731
        prefix = list(zip(layers("prefix_k", m["prefix_layers"]),
                          layers("prefix_v", m["prefix_layers"])))
        return Batch(
            src_keys=f32(source("src_k")),
            src_values=f32(source("src_v")),
            prefix=prefix,
            context=arrays[p + "context"],
            continuation=arrays[p + "continuation"],
            teacher=arrays[p + "teacher"].astype(mx.float32),
            n_native=m["n_native"],
            teacher_idx=arrays.get(p + "teacher_idx"),
            weights=arrays.get(p + "weights"),
        )


def store_key(source, target, translator, config, corpus_id: str) -> dict:
    """What a store's shards depend on (the maps excluded: they are what trains)."""
    d = config.distill
    return {
        "source": translator.spec.source.name,
        "source_geometry": cache_geometry(source).fingerprint(),
        "target": translator.spec.target.name,
        "target_geometry": cache_geometry(target).fingerprint(),
        "source_layers": translator.source_layers,
        "native_prefix": translator.spec.native_prefix,
        "alignment": translator.spec.alignment,
        "context_lengths": list(config.context_lengths),
        "continuation_len": config.continuation_len,
        "batch_size": d.batch_size,
        "accumulate": d.accumulate,
        "seed": d.seed,
        "corpus": corpus_id,
    }

"""Stage 2 with the frozen passes cached: same loss and gradients, exact top-k KL,
damaged or mismatched stores refused and rebuilt, RMS-scaled steps."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_kvlingo import data
from mlx_kvlingo.distill import (
    DistillConfig,
    Distiller,
    RmsScaledAdamW,
    kl_loss,
    make_batch,
)
from mlx_kvlingo.fit import fit_stage1
from mlx_kvlingo.samples import SharedTokens
from mlx_kvlingo.store import FeatureStore
from mlx_kvlingo.train import RunConfig, train
from mlx_kvlingo.translator import Translator, load_translator

from tiny import tiny_model


@pytest.fixture(scope="module")
def pair():
    src, tgt = tiny_model("qwen3", seed=1), tiny_model("gemma3_text", seed=2)
    tgt.freeze()
    stream = np.random.default_rng(0).integers(0, 97, 3000).tolist()
    t = Translator.for_models(src, tgt)
    fit_stage1(src, tgt, t, data.token_windows(stream, 24, 4, 8))
    return src, tgt, t, stream


def _batch(pair, seed=0, context=20, tail=0):
    src, tgt, t, stream = pair
    w = mx.array(stream[seed * 40 : seed * 40 + context + 6])[None]
    w = mx.concatenate([w, mx.array(stream[seed * 40 + 500 : seed * 40 + 500 + context + 6])[None]])
    return make_batch(src, tgt, t, w[:, :context], w[:, context:]).with_native_tail(tail)


def _loss_and_grads(t, tgt, batch):
    f = nn.value_and_grad(t, lambda m, b: kl_loss(m, tgt, b))
    loss, g = f(t, batch)
    mx.eval(loss, g)
    return loss.item(), g


@pytest.mark.parametrize("tail", [0, 3])
def test_cached_step_equals_the_uncached_step(pair, tmp_path, tail):
    src, tgt, t, _ = pair
    fresh = [_batch(pair, 1)]
    store = FeatureStore(tmp_path / "s", {"k": 1}, pool=1, dtype=mx.float32, log=lambda m: None)
    cached = store.get(0, lambda v: fresh)
    a = _loss_and_grads(t, tgt, fresh[0].with_native_tail(tail))
    b = _loss_and_grads(t, tgt, cached[0].with_native_tail(tail))
    assert a[0] == pytest.approx(b[0], rel=1e-5)
    for (name, ga), (_, gb) in zip(_flat(a[1]), _flat(b[1])):
        np.testing.assert_allclose(np.array(ga), np.array(gb), rtol=1e-4, atol=1e-7, err_msg=name)
    assert any(float(mx.abs(g).max()) > 0 for _, g in _flat(a[1]))  # gradients do flow
    # float16 shards (the default) stay close.
    half = FeatureStore(tmp_path / "h", {"k": 1}, pool=1, log=lambda m: None).get(0, lambda v: fresh)
    c = _loss_and_grads(t, tgt, half[0].with_native_tail(tail))
    assert c[0] == pytest.approx(a[0], rel=2e-2)


@pytest.mark.parametrize("tail", [0, 3])
def test_frozen_map_outputs_computed_once_give_the_same_step(pair, tail):
    """Training a low-rank correction, the frozen maps' outputs attached to a batch
    (computed once per sample) give the loss and gradients of running the maps."""
    src, tgt, t, _ = pair
    base = Translator(t.spec)
    base.update(t.parameters())
    distiller = Distiller(base, tgt, DistillConfig(rank=4, seed=1))
    for b in distiller.maps.b_k + distiller.maps.b_v:  # a non-zero correction
        b[:] = 0.01 * mx.random.normal(b.shape, key=mx.random.key(len(b.shape)))
    batches = [_batch(pair, 2), _batch(pair, 3)]
    memo = {}
    attached = distiller.with_frozen_outputs(batches, memo, key=7, dtype=mx.float32)
    again = distiller.with_frozen_outputs(batches, memo, key=7, dtype=mx.float32)
    assert list(memo) == [7] and again[0].frozen_keys[1] is attached[0].frozen_keys[1]
    for plain, with_frozen in zip(batches, attached):
        a = _loss_and_grads(distiller.maps, tgt, plain.with_native_tail(tail))
        b = _loss_and_grads(distiller.maps, tgt, with_frozen.with_native_tail(tail))
        assert a[0] == pytest.approx(b[0], rel=1e-6)
        for (name, ga), (_, gb) in zip(_flat(a[1]), _flat(b[1])):
            np.testing.assert_allclose(np.array(ga), np.array(gb), rtol=1e-5, atol=1e-8,
                                       err_msg=name)
        assert any(float(mx.abs(g).max()) > 0 for _, g in _flat(a[1]))
    # Full maps train every entry: nothing is frozen, nothing attached.
    full = Distiller(t, tgt, DistillConfig())
    assert full.with_frozen_outputs(batches, {}, key=0) is batches


def _flat(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)


def test_topk_teacher_kl_is_exact_on_its_partition(pair):
    """The top-k + tail KL is the KL over k+1 categories: equal to the full KL when k
    covers the vocabulary, never above it otherwise (coarser partition), and it
    vanishes for a student equal to the teacher."""
    src, tgt, t, _ = pair
    b = _batch(pair, 2)
    full = kl_loss(t, tgt, b).item()
    assert full > 0
    vocab = b.teacher.shape[-1]
    assert kl_loss(t, tgt, b.with_teacher_topk(vocab)).item() == pytest.approx(full, rel=1e-4)
    top = kl_loss(t, tgt, b.with_teacher_topk(8)).item()
    assert 0 < top <= full + 1e-6


def test_native_tail_batches_read_the_tail_themselves(pair):
    """With a tail of m, the target reads m more tokens and the maps fill m fewer
    positions; the loss stays over the same continuation."""
    src, tgt, t, _ = pair
    b = _batch(pair, 3, tail=4)
    assert b.inputs.shape[1] == b.continuation.shape[1] + 4
    assert mx.array_equal(b.inputs[:, :5], b.context[:, -5:])
    # All of the translated positions native but one: the translation barely matters.
    n = b.context.shape[1] - 1 - b.n_native
    zero = Translator(t.spec)
    for m in zero.k_maps + zero.v_maps:
        m.weight = mx.zeros_like(m.weight)
    near_native = kl_loss(zero, tgt, b.with_native_tail(n - 1)).item()
    assert near_native < kl_loss(zero, tgt, b.with_native_tail(0)).item()


def test_store_refuses_other_settings_and_damaged_shards(pair, tmp_path):
    logs = []
    fresh = [_batch(pair, 4)]
    calls = []

    def compute(v):
        calls.append(v)
        return fresh

    root = tmp_path / "store"
    s = FeatureStore(root, {"source_layers": [0, 1]}, pool=2, log=logs.append)
    s.get(0, compute)
    assert calls == [0] and s.shard(0).exists()
    FeatureStore(root, {"source_layers": [0, 1]}, pool=2, log=logs.append).get(0, compute)
    assert calls == [0]  # read back, not recomputed

    # A damaged shard is named and recomputed.
    s.shard(0).write_bytes(s.shard(0).read_bytes()[:100])
    again = FeatureStore(root, {"source_layers": [0, 1]}, pool=2, log=logs.append).get(0, compute)
    assert calls == [0, 0] and any(str(s.shard(0)) in m and "damaged" in m for m in logs)
    assert mx.allclose(again[0].teacher, fresh[0].teacher.astype(mx.float16).astype(mx.float32))

    # A store built for other settings is refused by name and rebuilt from scratch.
    FeatureStore(root, {"source_layers": [0, 2]}, pool=2, log=logs.append)
    assert "source_layers" in logs[-1] and not s.shard(0).exists()


def test_pool_steps_cycle_in_seeded_epochs(tmp_path):
    s = FeatureStore(tmp_path / "p", {}, pool=5, log=lambda m: None)
    first = [s.pool_step(i, seed=1) for i in range(5)]
    second = [s.pool_step(i, seed=1) for i in range(5, 10)]
    assert first == list(range(5)) and sorted(second) == list(range(5))
    assert second == [s.pool_step(i, seed=1) for i in range(5, 10)]


def test_training_from_a_store_resumes_and_reuses_shards(pair, tmp_path):
    """A stored run reads each pool step's shard after the first epoch; an
    interrupted and resumed stored run ends with the same maps."""
    src, tgt, t, stream = pair
    d = DistillConfig(steps=6, lr=1e-3, batch_size=2, accumulate=1, seed=3, teacher_topk=16,
                      native_tail=2)
    cfg = RunConfig(d, context_lengths=(16,), continuation_len=6, eval_every=0,
                    checkpoint_every=1, store_pool=2)
    data_ = SharedTokens(stream[:2000], stream[2000:])

    def fresh():
        c = Translator(t.spec)
        c.update(t.parameters())
        return c

    out = tmp_path / "a" / "t.safetensors"
    summary = train(src, tgt, fresh(), data_, out, cfg)
    shards = sorted(p.name for p in (tmp_path / "a" / "t.safetensors.store").glob("step-*"))
    assert shards == ["step-00000.safetensors", "step-00001.safetensors"]
    log = [line for line in (tmp_path / "a" / "t.safetensors.log.jsonl").read_text().splitlines()]
    assert summary["steps"] == 6 and len(log) == 6

    # Stop after 3 steps (as a signal would), then resume.
    out_b = tmp_path / "b" / "t.safetensors"
    train(src, tgt, fresh(), data_, out_b, cfg, progress=_stop_after(3))
    assert load_translator(out_b).spec.training["distill"]["steps_done"] == 3
    train(src, tgt, None, data_, out_b, cfg, resume=True)
    a = load_translator(out)
    b = load_translator(out_b)
    for x, y in zip(a.k_maps + a.v_maps, b.k_maps + b.v_maps):
        np.testing.assert_allclose(np.array(x.weight), np.array(y.weight), rtol=1e-5, atol=1e-7)


def _stop_after(n):
    import os
    import signal

    def progress(record):
        if record.get("step") == n and "loss" in record:
            os.kill(os.getpid(), signal.SIGINT)

    return progress


def test_rms_scaled_adamw_moves_each_tensor_by_the_same_relative_amount():
    big = mx.random.normal((16, 16), key=mx.random.key(0))
    small = big * 0.01
    params = {"big": big, "small": small}
    opt = RmsScaledAdamW(learning_rate=1e-2, weight_decay=0.0)
    opt.init(params)
    grads = {"big": mx.ones_like(big), "small": mx.ones_like(small)}
    new = opt.apply_gradients(grads, params)
    rel = {k: float(mx.abs(new[k] - params[k]).max() / mx.sqrt(mx.mean(params[k] ** 2)))
           for k in params}
    assert rel["big"] == pytest.approx(rel["small"], rel=1e-3)
    assert rel["big"] > 0


def test_budget_plans_steps_from_measured_costs():
    from mlx_kvlingo.errors import KvlingoError
    from mlx_kvlingo.train import plan_steps

    # Stored: the pool's frozen passes once, then updates only.
    assert plan_steps(3600, 600, prepare_s=10, update_s=2, pool=60) == (3600 - 600 - 600) // 2
    # Fresh samples: both costs every step.
    assert plan_steps(3600, 600, prepare_s=10, update_s=2, pool=0) == 3000 // 12
    with pytest.raises(KvlingoError, match="budget"):
        plan_steps(600, 590, prepare_s=10, update_s=2, pool=60)


def test_budget_and_duration_parsing_in_the_cli():
    from mlx_kvlingo.errors import KvlingoError
    from mlx_kvlingo_cli.main import _duration

    assert [_duration(t) for t in ("1h", "45m", "1h30m", "90s", "3600")] == [
        3600, 2700, 5400, 90, 3600]
    with pytest.raises(KvlingoError, match="duration"):
        _duration("soon")


@pytest.mark.parametrize("arch, tied", [("llama", True), ("llama", False), ("qwen3", True),
                                        ("gemma3_text", True)])
def test_last_logits_equal_the_full_forward(arch, tied):
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_kvlingo.models import last_logits

    m = tiny_model(arch, seed=5, tie_word_embeddings=tied)
    assert ("lm_head" in m) != tied
    x = mx.array(np.random.default_rng(1).integers(0, 97, (2, 12)))
    full = m(x, cache=make_prompt_cache(m))[:, -5:]
    part = last_logits(m, x, make_prompt_cache(m), 5)
    np.testing.assert_allclose(np.array(part), np.array(full), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rank, pool", [(0, 0), (2, 3)])
def test_probe_measures_a_step_without_training(pair, rank, pool):
    from mlx_kvlingo.train import probe_step_cost

    src, tgt, t, stream = pair
    before = [np.array(m.weight) for m in t.k_maps + t.v_maps]
    cfg = RunConfig(DistillConfig(batch_size=2, accumulate=1, rank=rank), context_lengths=(16,),
                    continuation_len=6, store_pool=pool)
    prepare_s, update_s = probe_step_cost(src, tgt, t, SharedTokens(stream, stream), cfg)
    assert prepare_s > 0 and update_s > 0
    assert all(np.array_equal(a, np.array(m.weight)) for a, m in zip(before, t.k_maps + t.v_maps))
    assert "k_maps" in dict(t.trainable_parameters())  # still trainable afterwards

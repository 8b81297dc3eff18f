"""Stage 2 with the frozen passes cached: same loss and gradients, exact top-k KL,
damaged or mismatched stores refused and rebuilt, RMS-scaled steps."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from tiny import tiny_model

from mlx_kvlingo.data import corpus as data
from mlx_kvlingo.train.distill import (
    Batch,
    DistillConfig,
    Distiller,
    RmsScaledAdamW,
    kl_loss,
    make_batch,
)
from mlx_kvlingo.train.fit import fit_stage1
from mlx_kvlingo.train.loop import RunConfig, train
from mlx_kvlingo.train.samples import SharedTokens
from mlx_kvlingo.train.store import FeatureStore
from mlx_kvlingo.translator.maps import Translator, load_translator


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
    from mlx_kvlingo.train.loop import plan_steps

    # Stored: the pool's frozen passes once, then updates only.
    assert plan_steps(3600, 600, prepare_s=10, update_s=2, pool=60) == (3600 - 600 - 600) // 2
    # The store already built (by stage 1): updates only.
    assert plan_steps(3600, 600, prepare_s=10, update_s=2, pool=60, built=60) == 3000 // 2
    assert plan_steps(3600, 600, prepare_s=10, update_s=2, pool=60, built=20) == 2600 // 2
    # Fresh samples: both costs every step.
    assert plan_steps(3600, 600, prepare_s=10, update_s=2, pool=0) == 3000 // 12
    with pytest.raises(KvlingoError, match="budget"):
        plan_steps(600, 590, prepare_s=10, update_s=2, pool=60)


def test_budget_and_duration_parsing_in_the_cli():
    from mlx_kvlingo.errors import KvlingoError
    from mlx_kvlingo_cli.main import parse_duration

    assert [parse_duration(t) for t in ("1h", "45m", "1h30m", "90s", "3600")] == [
        3600, 2700, 5400, 90, 3600]
    with pytest.raises(KvlingoError, match="duration"):
        parse_duration("soon")


@pytest.mark.parametrize("arch, tied", [("llama", True), ("llama", False), ("qwen3", True),
                                        ("gemma3_text", True)])
def test_last_logits_equal_the_full_forward(arch, tied):
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_kvlingo.models.cache import last_logits

    m = tiny_model(arch, seed=5, tie_word_embeddings=tied)
    assert ("lm_head" in m) != tied
    x = mx.array(np.random.default_rng(1).integers(0, 97, (2, 12)))
    full = m(x, cache=make_prompt_cache(m))[:, -5:]
    part = last_logits(m, x, make_prompt_cache(m), 5)
    np.testing.assert_allclose(np.array(part), np.array(full), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rank, pool", [(0, 0), (2, 3)])
def test_probe_measures_a_step_without_training(pair, rank, pool):
    from mlx_kvlingo.train.loop import probe_step_cost

    src, tgt, t, stream = pair
    before = [np.array(m.weight) for m in t.k_maps + t.v_maps]
    cfg = RunConfig(DistillConfig(batch_size=2, accumulate=1, rank=rank), context_lengths=(16,),
                    continuation_len=6, store_pool=pool)
    prepare_s, update_s = probe_step_cost(src, tgt, t, SharedTokens(stream, stream), cfg)
    assert prepare_s > 0 and update_s > 0
    assert all(np.array_equal(a, np.array(m.weight)) for a, m in zip(before, t.k_maps + t.v_maps))
    assert "k_maps" in dict(t.trainable_parameters())  # still trainable afterwards


# ---------------------------------------------------------------------------
# Stage 1 fitted on the store's samples (one pass over them for both stages)


def test_native_features_are_the_targets_own_prefill(pair):
    """The target K/V a batch keeps for a stage-1 fit (read off the teacher's
    prefill, before the continuation moves the sliding windows) equal a fresh
    prefill's, and with_native_features (for stored batches) gives the same."""
    from mlx_kvlingo.models.features import token_features
    from mlx_kvlingo.train.distill import with_native_features

    src, tgt, t, stream = pair
    assert any(g.window for g in t.spec.target.cache_geometry.layers)  # a sliding layer
    w = mx.array([stream[100:130], stream[700:730]])
    b = make_batch(src, tgt, t, w[:, :24], w[:, 24:], native=True)
    assert make_batch(src, tgt, t, w[:, :24], w[:, 24:]).native_keys is None
    keys, values, _ = token_features(tgt, w[:, :23])
    k = b.n_native
    again = with_native_features(tgt, b)
    for mine, again_, direct in ((b.native_keys, again.native_keys, keys),
                                 (b.native_values, again.native_values, values)):
        assert len(mine) == len(direct) and mine[0].shape[1] == 23 - k
        for x, y, z in zip(mine, again_, direct):
            np.testing.assert_allclose(np.array(x), np.array(z[:, k:]), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(np.array(y), np.array(z[:, k:]), rtol=1e-5, atol=1e-6)


def test_a_store_with_more_source_layers_serves_a_run(tmp_path):
    batch = Batch(src_keys=[mx.ones((1, 3, 2)) * i for i in range(3)],
                  src_values=[mx.ones((1, 3, 2)) * -i for i in range(3)], prefix=[],
                  context=mx.zeros((1, 5), mx.int32), continuation=mx.zeros((1, 2), mx.int32),
                  teacher=mx.zeros((1, 2, 4)), n_native=1)
    built = []
    compute = lambda v: built.append(v) or [batch]  # noqa: E731
    root = tmp_path / "s"
    FeatureStore(root, {"a": 1, "source_layers": [0, 1, 2]}, pool=1, log=print).get(0, compute)
    narrow = FeatureStore(root, {"a": 1, "source_layers": [0, 2]}, pool=1, log=print)
    got = narrow.get(0, compute)[0]
    assert built == [0]  # read, not rebuilt
    assert got.src_keys[1] is None and got.src_values[1] is None
    assert float(got.src_keys[2][0, 0, 0]) == 2 and float(got.src_values[2][0, 0, 0]) == -2
    messages = []
    FeatureStore(root, {"a": 2, "source_layers": [0]}, pool=1, log=messages.append)
    FeatureStore(root, {"a": 2, "source_layers": [0, 3]}, pool=1, log=messages.append)
    assert "(a, source_layers differ)" in messages[0]
    assert "(source_layers differ)" in messages[1]
    assert not list(root.glob("step-*"))  # both rebuilt from nothing


def test_stage1_from_the_store_equals_a_fit_on_its_samples(pair, tmp_path, monkeypatch):
    """store_fit_features builds the whole pool, gives the fit exactly the pool's
    samples (source features of every layer, target K/V of the translated
    positions), and stage 2 then reads the store instead of sampling again."""
    from mlx_kvlingo.models.features import token_features
    from mlx_kvlingo.train.fit import fit_features
    from mlx_kvlingo.train.loop import store_fit_features

    src, tgt, t, stream = pair
    d = DistillConfig(steps=4, lr=1e-3, batch_size=2, accumulate=1, seed=5, teacher_topk=8)
    cfg = RunConfig(d, context_lengths=(12, 16), continuation_len=6, eval_every=0,
                    checkpoint_every=0, store_pool=3)  # 0: only at the end
    data_ = SharedTokens(stream[:2000], stream[2000:])
    out = tmp_path / "t.safetensors"

    def direct():  # the pool's samples, prefilled here
        for v in range(3):
            for context, _ in data_.step_samples(cfg, v):
                sk, sv, _ = token_features(src, context[:, :-1])
                tk, tv, _ = token_features(tgt, context[:, :-1])
                k = t.spec.native_prefix
                yield [x[:, k:] for x in sk], [x[:, k:] for x in sv], \
                      [x[:, k:] for x in tk], [x[:, k:] for x in tv]

    a, b = Translator(t.spec), Translator(t.spec)
    fit_features(a, store_fit_features(src, tgt, a, data_, out, cfg, positions=10**6))
    fit_features(b, direct())
    shards = sorted((tmp_path / "t.safetensors.store").glob("step-*"))
    assert len(shards) == 3
    for x, y in zip(a.k_maps + a.v_maps, b.k_maps + b.v_maps):
        np.testing.assert_allclose(np.array(x.weight), np.array(y.weight), rtol=1e-4, atol=1e-6)
    lengths = [c.shape[1] - 1 - t.spec.native_prefix
               for v in range(3) for c, _ in data_.step_samples(cfg, v)]
    assert a.spec.training["fit"]["tokens"] == 2 * sum(lengths)  # every sample, once

    # A rerun reads the shards back (the target's K/V recomputed): the same fit, up
    # to the store's float16 source features.
    mtimes = [p.stat().st_mtime_ns for p in shards]
    c = Translator(t.spec)
    fit_features(c, store_fit_features(src, tgt, c, data_, out, cfg, positions=10**6))
    assert c.spec.training["fit"]["tokens"] == a.spec.training["fit"]["tokens"]
    for x, y in zip(a.k_maps + a.v_maps, c.k_maps + c.v_maps):
        x, y = np.array(x.weight), np.array(y.weight)
        assert np.linalg.norm(x - y) < 5e-3 * np.linalg.norm(y)

    # Stage 2 on the narrower translator trains from the store without sampling.
    monkeypatch.setattr(SharedTokens, "step_batches", _no_sampling)
    summary = train(src, tgt, a, data_, out, cfg)
    assert summary["steps"] == 4 and out.exists()
    assert (tmp_path / "t.safetensors.ckpt.safetensors").exists()  # at the end only
    assert [p.stat().st_mtime_ns for p in shards] == mtimes


def _no_sampling(*args, **kwargs):
    raise AssertionError("stage 2 sampled a step the store holds")


def test_train_both_stages_makes_one_pass_over_the_pool(toy_pair_dirs, tmp_path):
    """`train --stage both --store-pool N`: stage 1 fits on the store it builds, and
    stage 2 trains on it without a store of its own."""
    import json
    import os
    import subprocess
    import sys

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(m.__doc__ for m in (json, os, subprocess, pytest)) * 3)
    out = tmp_path / "t.safetensors"
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_kvlingo_cli.main", "train", "--source", toy_pair_dirs[0],
         "--target", toy_pair_dirs[1], "--out", str(out), "--corpus", str(corpus),
         "--select-layers", "1,2", "--fit-tokens", "100000", "--steps", "4",
         "--store-pool", "3", "--context-lengths", "32,48", "--continuation-len", "16",
         "--batch-size", "2", "--accumulate", "1", "--eval-every", "0", "--checkpoint-every", "2",
         "--rank", "2", "--layer-ranks", "0:3", "--token-layers", "full"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Stage 1 fits on stage 2's feature store (3 pool steps)" in proc.stdout
    assert "rank 2 (target layers 0:3: their own ranks)" in proc.stdout
    assert "feature store: 3/3 pool steps" in proc.stdout
    assert "Done: 4 steps" in proc.stdout
    store = tmp_path / "t.safetensors.store"
    assert len(list(store.glob("step-*"))) == 3
    n_source = len(json.loads((store / "manifest.json").read_text())["key"]["source_layers"])
    t = load_translator(out)
    assert n_source == t.spec.source.cache_geometry.n_layers  # every layer, for the choice
    # --token-layers full: every layer of a target without sliding windows, fitted
    # on the store (token inputs read off its contexts) and trained in stage 2.
    assert t.spec.token_layers == list(range(t.spec.target.cache_geometry.n_layers))
    s1_top2 = load_translator(tmp_path / "t.stage1-top2.safetensors")
    assert s1_top2.spec.token_layers == t.spec.token_layers
    assert any(mx.abs(a.weight - b.weight).max().item() > 0
               for a, b in zip(t.k_tok + t.v_tok, s1_top2.k_tok + s1_top2.v_tok))
    assert (tmp_path / "t.stage1-top1.safetensors").exists()
    assert (tmp_path / "t.stage1-top2.safetensors").exists()
    # 3 pool steps of 2 sequences, fewer positions than --fit-tokens asked: all of them.
    s1 = load_translator(tmp_path / "t.stage1-top2.safetensors").spec.training["fit"]
    assert 6 * (32 - 2) <= s1["tokens"] <= 6 * (48 - 2)

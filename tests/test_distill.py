"""Stage 2: distillation, resumable runs, skipped non-finite steps."""

import json
import os
import signal

import mlx.core as mx
import numpy as np
import pytest
from tiny import tiny_model

from mlx_kvlingo.data import corpus as data
from mlx_kvlingo.measure.evaluate import evaluate_translator
from mlx_kvlingo.train.distill import DistillConfig, Distiller, LowRankMaps, make_batch
from mlx_kvlingo.train.fit import fit_stage1
from mlx_kvlingo.train.loop import RunConfig, train
from mlx_kvlingo.train.samples import SharedTokens
from mlx_kvlingo.translator.maps import Translator, load_translator


@pytest.fixture(scope="module")
def tiny_pair():
    src, tgt = tiny_model("qwen3", seed=1), tiny_model("llama", seed=2)
    stream = np.random.default_rng(0).integers(0, 97, 4000).tolist()
    t = Translator.for_models(src, tgt)
    fit_stage1(src, tgt, t, data.token_windows(stream, 32, 4, 16))
    return src, tgt, t, stream


def _config(steps=6, rank=0, **kw):
    d = DistillConfig(steps=steps, lr=1e-3, batch_size=2, accumulate=2, rank=rank, seed=3)
    return RunConfig(d, context_lengths=(16, 24), continuation_len=8, eval_every=0,
                     checkpoint_every=kw.pop("checkpoint_every", 2), eval_windows=4, **kw)


def _fresh(t):
    """A copy of the stage-1 translator, so runs do not share trained state."""
    c = Translator(t.spec)
    c.update(t.parameters())
    return c


def _maps(path):
    t = load_translator(path)
    return [np.array(m.weight) for m in t.k_maps + t.v_maps]


def test_samples_depend_only_on_seed_and_step(tiny_pair):
    stream = tiny_pair[3]
    a = SharedTokens(stream, stream).step_samples(_config(), 5)
    b = SharedTokens(stream, stream).step_samples(_config(), 5)
    c = SharedTokens(stream, stream).step_samples(_config(), 6)
    assert all(mx.array_equal(x[0], y[0]) for x, y in zip(a, b))
    # Another step draws other windows.
    assert [x[0].tolist() for x in a] != [y[0].tolist() for y in c]


@pytest.mark.parametrize("rank, sig", [(0, signal.SIGINT), (4, signal.SIGINT), (0, signal.SIGTERM)])
def test_interrupted_run_resumes_to_the_same_maps(tiny_pair, tmp_path, rank, sig):
    src, tgt, t, stream = tiny_pair
    config = _config(rank=rank)
    whole = train(src, tgt, _fresh(t), SharedTokens(stream, stream), tmp_path / "a.safetensors", config)
    assert whole["steps"] == 6 and not whole["stopped"]

    # Ctrl-C (SIGINT) or SIGTERM during step 3: the run checkpoints at the step
    # boundary and stops.
    def interrupt(record):
        if record.get("step") == 3:
            os.kill(os.getpid(), sig)

    out = tmp_path / "b.safetensors"
    part = train(src, tgt, _fresh(t), SharedTokens(stream, stream), out, config, progress=interrupt)
    assert part["stopped"] and part["steps"] == 3
    rest = train(src, tgt, None, SharedTokens(stream, stream), out, config, resume=True)
    assert rest["steps"] == 6 and not rest["stopped"]
    for a, b in zip(_maps(tmp_path / "a.safetensors"), _maps(out)):
        if rank == 0:
            np.testing.assert_array_equal(a, b)
        else:  # W + B·A is recomputed from restored factors: equal to float rounding
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    steps = [json.loads(l)["step"] for l in (tmp_path / "b.safetensors.log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_killed_run_resumes_from_its_last_checkpoint(tiny_pair, tmp_path):
    """A kill (no chance to save) loses only the steps since the last checkpoint."""
    src, tgt, t, stream = tiny_pair
    config = _config()
    train(src, tgt, _fresh(t), SharedTokens(stream, stream), tmp_path / "a.safetensors", config)

    class Killed(Exception):
        pass

    def die(record):
        if record.get("step") == 5:  # checkpoint was written after step 4
            raise Killed

    out = tmp_path / "b.safetensors"
    with pytest.raises(Killed):
        train(src, tgt, _fresh(t), SharedTokens(stream, stream), out, config, progress=die)
    rest = train(src, tgt, None, SharedTokens(stream, stream), out, config, resume=True)
    assert rest["steps"] == 6
    for a, b in zip(_maps(tmp_path / "a.safetensors"), _maps(out)):
        np.testing.assert_array_equal(a, b)


def test_resume_refuses_other_settings_or_no_checkpoint(tiny_pair, tmp_path):
    from mlx_kvlingo.errors import KvlingoError

    src, tgt, t, stream = tiny_pair
    out = tmp_path / "c.safetensors"
    with pytest.raises(KvlingoError, match="no checkpoint"):
        train(src, tgt, None, SharedTokens(stream, stream), out, _config(), resume=True)
    train(src, tgt, _fresh(t), SharedTokens(stream, stream), out, _config(steps=2))
    with pytest.raises(KvlingoError, match="settings differ"):
        train(src, tgt, None, SharedTokens(stream, stream), out, _config(steps=4, checkpoint_every=1), resume=True)


def test_keep_best_ends_with_the_lowest_heldout_kl_and_survives_a_resume(tiny_pair, tmp_path):
    """An lr far too high makes every step worse on held-out windows: with
    keep_best the run ends with its starting maps (the evaluation of step 0), and
    an interrupted run resumes to the same choice."""
    from mlx_kvlingo.errors import KvlingoError

    src, tgt, t, stream = tiny_pair

    def config(keep_best):
        d = DistillConfig(steps=6, lr=0.5, batch_size=2, accumulate=2, seed=3)
        return RunConfig(d, context_lengths=(16, 24), continuation_len=8, eval_every=2,
                         checkpoint_every=2, eval_windows=4, keep_best=keep_best)

    with pytest.raises(KvlingoError, match="eval-every"):
        RunConfig(eval_every=0, keep_best=True)
    last = tmp_path / "last.safetensors"
    train(src, tgt, _fresh(t), SharedTokens(stream, stream), last, config(False))
    out = tmp_path / "best.safetensors"
    summary = train(src, tgt, _fresh(t), SharedTokens(stream, stream), out, config(True))
    evals = [json.loads(l) for l in (tmp_path / "best.safetensors.log.jsonl").read_text()
             .splitlines() if "eval" in l]
    assert [r["step"] for r in evals] == [0, 2, 4, 6]
    best = min(evals, key=lambda r: r["eval"]["kl"])
    assert summary["best_eval"]["step"] == best["step"] == 0, evals
    start = [np.array(m.weight) for m in t.k_maps + t.v_maps]
    for a, b in zip(start, _maps(out)):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(start, _maps(last)))
    assert load_translator(out).spec.training["distill"]["steps_done"] == 0

    def interrupt(record):
        if record.get("step") == 3:
            os.kill(os.getpid(), signal.SIGINT)

    again = tmp_path / "again.safetensors"
    part = train(src, tgt, _fresh(t), SharedTokens(stream, stream), again, config(True),
                 progress=interrupt)
    assert part["stopped"]
    rest = train(src, tgt, None, SharedTokens(stream, stream), again, config(True), resume=True)
    assert rest["best_eval"]["step"] == 0
    for a, b in zip(_maps(out), _maps(again)):
        np.testing.assert_array_equal(a, b)


def test_non_finite_loss_is_skipped_and_never_written(tiny_pair):
    src, tgt, t, stream = tiny_pair
    t = _fresh(t)
    distiller = Distiller(t, tgt, _config().distill)
    (ctx, cont), = SharedTokens(stream, stream).step_samples(_config(), 0)[:1]
    batch = make_batch(src, tgt, t, ctx, cont)
    before = [np.array(m.weight) for m in t.k_maps]
    batch.teacher = mx.full(batch.teacher.shape, mx.nan)
    loss, applied = distiller.train_step([batch])
    assert not applied and not np.isfinite(loss) and distiller.skipped == 1
    for a, m in zip(before, t.k_maps):
        np.testing.assert_array_equal(a, np.array(m.weight))
        assert np.isfinite(np.array(m.weight)).all()


def test_low_rank_correction_keeps_base_frozen_and_merges(tiny_pair):
    src, tgt, t, stream = tiny_pair
    t = _fresh(t)
    base = [np.array(m.weight) for m in t.v_maps]
    distiller = Distiller(t, tgt, _config(rank=3).distill)
    assert isinstance(distiller.maps, LowRankMaps)
    names = [k for k, _ in __import__("mlx.utils").utils.tree_flatten(distiller.maps.trainable_parameters())]
    assert names and all(n.split(".")[0] in ("a_k", "b_k", "a_v", "b_v") for n in names)
    for _ in range(3):
        batches = [make_batch(src, tgt, t, c, n) for c, n in SharedTokens(stream, stream).step_samples(_config(), distiller.step)]
        distiller.train_step(batches)
    merged = distiller.translator()
    for i, m in enumerate(t.v_maps):
        np.testing.assert_array_equal(np.array(m.weight), base[i])  # base untouched
        expect = base[i] + np.array(distiller.maps.b_v[i] @ distiller.maps.a_v[i])
        np.testing.assert_allclose(np.array(merged.v_maps[i].weight), expect, rtol=1e-5, atol=1e-6)
    assert any(np.abs(np.array(b)).max() > 0 for b in distiller.maps.b_k)  # it learned


def test_layer_ranks_give_chosen_layers_their_own_rank(tiny_pair):
    from dataclasses import replace

    from mlx_kvlingo.errors import KvlingoError
    from mlx_kvlingo.train.distill import parse_layer_ranks

    src, tgt, t, stream = tiny_pair
    t = _fresh(t)
    n = len(t.spec.layer_map)
    distiller = Distiller(t, tgt, replace(_config(rank=2).distill, layer_ranks=f"{n - 1}:5"))
    ranks = [a.shape[0] for a in distiller.maps.a_k]
    assert ranks == [2] * (n - 1) + [5] and [b.shape[1] for b in distiller.maps.b_v] == ranks
    for _ in range(2):
        batches = [make_batch(src, tgt, t, c, m) for c, m in
                   SharedTokens(stream, stream).step_samples(_config(), distiller.step)]
        distiller.train_step(batches)
    assert np.abs(np.array(distiller.maps.b_k[n - 1])).max() > 0  # the wide one learned
    merged = distiller.translator()
    expect = np.array(t.k_maps[n - 1].weight) + np.array(
        distiller.maps.b_k[n - 1] @ distiller.maps.a_k[n - 1])
    np.testing.assert_allclose(np.array(merged.k_maps[n - 1].weight), expect, rtol=1e-5, atol=1e-6)
    assert parse_layer_ranks(" 5:64, 11:32 ", 16) == {5: 64, 11: 32}
    assert parse_layer_ranks("", 0) == {}
    for bad in ("5", "5:0", "a:4", "5:4:4"):
        with pytest.raises(KvlingoError, match="LAYER:RANK"):
            parse_layer_ranks(bad, 16)
    with pytest.raises(KvlingoError, match=f"has {n} layers"):
        Distiller(_fresh(t), tgt, replace(_config(rank=2).distill, layer_ranks=f"{n}:4"))
    with pytest.raises(KvlingoError, match="need a rank > 0"):
        Distiller(_fresh(t), tgt, replace(_config(rank=0).distill, layer_ranks="0:4"))


@pytest.mark.slow
def test_distillation_lowers_heldout_kl_below_stage1(docstring_pair, tmp_path):
    """30 steps of the whole `train` path lower held-out KL and keep top-1. On the
    first release's pair: on the shipped one the gain comes only after ~200 steps
    (30 steps at lr 2e-3 on its recurring documents: KL x1.03; at this test's 3e-4
    on docstrings: x0.97), and test_builtin_pair checks its 2,500-step translator."""
    src, stok, tgt, ttok = docstring_pair
    train_docs, heldout_docs = data.split_documents(data.stdlib_documents())
    train_stream = data.token_stream(stok, train_docs)
    heldout_stream = data.token_stream(stok, heldout_docs)
    t = Translator.for_models(src, tgt, stok, ttok)
    fit_stage1(src, tgt, t, data.token_windows(train_stream, 256, 8, 80))
    windows = list(data.token_windows(heldout_stream, 256 + 64, 8, 24, seed=7))
    stage1 = evaluate_translator(src, tgt, t, windows, 256)
    config = RunConfig(DistillConfig(steps=30, lr=3e-4, batch_size=4, accumulate=2),
                       context_lengths=(128, 256), eval_every=0, checkpoint_every=30)
    train(src, tgt, t, SharedTokens(train_stream, heldout_stream), tmp_path / "t.safetensors", config)
    stage2 = evaluate_translator(src, tgt, load_translator(tmp_path / "t.safetensors"), windows, 256)
    print("stage 1", stage1, "\nstage 2", stage2)
    assert stage2.kl < 0.92 * stage1.kl
    assert stage2.top1 >= stage1.top1
    assert (tmp_path / "t.safetensors.png").exists()


def test_full_disk_during_checkpoint_keeps_the_previous_one(tiny_pair, tmp_path, monkeypatch):
    """A write that fails half way (ENOSPC) leaves the last good checkpoint and
    translator as they were, with no temporary file behind."""
    import errno

    from mlx_kvlingo.train import loop as train_mod

    src, tgt, t, stream = tiny_pair
    out = tmp_path / "t.safetensors"
    train(src, tgt, _fresh(t), SharedTokens(stream, stream), out, _config(steps=2))
    ckpt = tmp_path / "t.safetensors.ckpt.safetensors"
    before = {p: p.read_bytes() for p in (out, ckpt)}

    def full_disk(path, arrays, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(train_mod.mx, "save_safetensors", full_disk)
    with pytest.raises(OSError, match="No space left"):
        train(src, tgt, _fresh(t), SharedTokens(stream, stream), out, _config(steps=2))
    for p, content in before.items():
        assert p.read_bytes() == content
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


def test_low_rank_maps_over_several_source_layers_equal_their_merged_maps():
    """The correction is applied block by block over a map's source layers (no
    concatenation); the result is the merged maps' translation."""
    src, tgt = tiny_model("qwen3", seed=1), tiny_model("llama", seed=2)
    t = Translator.for_models(src, tgt, sources_per_layer=3)
    maps = LowRankMaps(t, rank=4, seed=5)
    for b in maps.b_k + maps.b_v:
        b[:] = mx.random.normal(b.shape, key=mx.random.key(b.shape[0])) * 0.1
    widths = [g["n_kv_heads"] * g["head_dim"] for g in t.spec.source.geometry["layers"]]
    keys = [mx.random.normal((2, 5, w), key=mx.random.key(i)) for i, w in enumerate(widths)]
    values = [mx.random.normal((2, 5, w), key=mx.random.key(50 + i)) for i, w in enumerate(widths)]
    got_k, got_v = maps(keys, values)
    want_k, want_v = maps.merged()(keys, values)
    for a, b in zip(got_k + got_v, want_k + want_v):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)

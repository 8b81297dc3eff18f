"""Data-parallel training under `mlx.launch -n 2 --backend ring` on loopback.

Two processes must give what one process gives over the same samples: the same
stage-1 maps (summed moments, one solve) and the same stage-2 steps (gradients
averaged over the global batch). A rank killed mid-run must end the run with a
clear message and a checkpoint that still resumes.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

TESTS = Path(__file__).parent
LAUNCH = Path(sys.executable).with_name("mlx.launch")

def launches(test):
    """A test that starts processes with mlx.launch: slow (seconds to a minute)."""
    test = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")(test)
    return pytest.mark.slow(test)

WORKER = textwrap.dedent('''
    """Alone (a world of one) or under mlx.launch: fit and/or train tiny maps and
    save what this rank holds."""
    import os, sys
    sys.path.insert(0, sys.argv[1])  # tests/, for tiny
    import mlx_kvlingo  # noqa: F401  (fast BLAS first)
    import numpy as np
    from mlx_kvlingo.data import corpus as data
    from mlx_kvlingo.models.features import token_features
    from mlx_kvlingo.train import distributed
    from mlx_kvlingo.train.distill import DistillConfig, Distiller
    from mlx_kvlingo.train.fit import fit_selected, fit_stage1
    from mlx_kvlingo.train.loop import RunConfig
    from mlx_kvlingo.train.samples import SharedTokens
    from mlx_kvlingo.translator.maps import Translator
    from tiny import tiny_model

    mode, out = sys.argv[2], sys.argv[3]
    g = distributed.group()
    if mode == "check":  # rank 1 reads another corpus than rank 0
        try:
            distributed.check_same({"corpus": str(distributed.rank(g)), "model": "m"}, g)
            message = "accepted"
        except Exception as e:
            message = f"{type(e).__name__}: {e}"
        name = f"check-{distributed.size(g)}-rank{distributed.rank(g)}.npz"
        np.savez(os.path.join(out, name), message=np.array(message))
        sys.exit(0)
    src, tgt = tiny_model("qwen3", seed=1), tiny_model("llama", seed=2)
    stream = np.random.default_rng(0).integers(0, 97, 4000).tolist()
    # 11 windows in batches of 2: 6 batches, the last of one window (unequal shares).
    windows = lambda: distributed.shard_iter(data.token_windows(stream, 32, 2, 11), g)
    maps = lambda t: {f"m{i}": np.array(m.weight) for i, m in enumerate(t.k_maps + t.v_maps)}
    t = Translator.for_models(src, tgt)
    report = fit_stage1(src, tgt, t, windows(), group=g)
    result = {"tokens": np.array(report.tokens)}
    if mode == "fit":
        result.update(maps(t))

        def every_layer():  # the all-layer Gram of source-layer selection
            for w in windows():
                sk, sv, _ = token_features(src, w, list(range(4)))
                tk, tv, _ = token_features(tgt, w)
                yield sk, sv, tk, tv

        sel, _, _ = fit_selected(t, every_layer(), [2], skip=1, group=g)
        result.update({f"sel_{k}": v for k, v in maps(sel).items()})
        result["sel_layers"] = np.array(sel.spec.layer_map)
    else:
        # 4 micro-batches of 2 windows: 2 per rank; the native tail on odd ones.
        d = DistillConfig(steps=2, lr=1e-3, batch_size=2, accumulate=4, seed=3, native_tail=2)
        config = RunConfig(d, context_lengths=(16, 24), continuation_len=8, eval_every=0)
        pair = SharedTokens(stream, stream)
        result.update({f"fit_{k}": v for k, v in maps(t).items()})  # before the steps
        distiller = Distiller(t, tgt, d, g)
        positions = None
        if g is not None:
            positions = distributed.micro_batch_positions(pair.micro_batches(config), g)
        losses = []
        for step in range(2):
            batches = pair.step_batches(src, tgt, t, config, step, g)
            losses.append(distiller.train_step(batches, positions)[0])
        result.update(maps(distiller.translator()))
        result["losses"] = np.array(losses)
    name = f"{mode}-{distributed.size(g)}-rank{distributed.rank(g)}.npz"
    np.savez(os.path.join(out, name), **result)
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args, n=2):
    """The mlx.launch command line for ``n`` ranks on loopback (ring backend) on a
    free port, so parallel test runs do not collide on the default one."""
    return [str(LAUNCH), "-n", str(n), "--backend", "ring", "-p", str(_free_port()),
            "--python", sys.executable, *map(str, args)]


def _env():
    # One BLAS thread per rank, whichever BLAS is loaded (MKL where the machine has no
    # OpenBLAS): two ranks of two threads each on two cores made steps take 1-10 s.
    return dict(os.environ, HF_HUB_OFFLINE="1", OPENBLAS_NUM_THREADS="1",
                MKL_NUM_THREADS="1", OMP_NUM_THREADS="1")


def _worker(tmp_path, mode, ranks):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    args = [script, TESTS, mode, tmp_path]
    cmd = _launch(args) if ranks > 1 else [sys.executable, *map(str, args)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    # mlx.launch (ring) exits 0 even when a rank fails: check each rank's output file.
    names = [f"{mode}-{ranks}-rank{r}.npz" for r in range(ranks)]
    missing = [n for n in names if not (tmp_path / n).exists()]
    assert not missing and proc.returncode == 0, (missing, proc.stdout, proc.stderr)
    return [dict(np.load(tmp_path / n)) for n in names]


@launches
def test_stage1_on_two_ranks_equals_one_process(tmp_path):
    (one,) = _worker(tmp_path, "fit", 1)
    r0, r1 = _worker(tmp_path, "fit", 2)
    assert int(r0["tokens"]) == int(one["tokens"]) == 11 * 31  # both shares (first position native)
    for k in one:
        # Every rank holds the same maps (rank 0's, sent to all) ...
        np.testing.assert_array_equal(r0[k], r1[k], err_msg=k)
        # ... and they are the one-process fit over the same windows.
        np.testing.assert_allclose(r0[k], one[k], rtol=1e-5, atol=1e-6, err_msg=k)


@launches
def test_two_stage2_steps_on_two_ranks_equal_one_process(tmp_path):
    (one,) = _worker(tmp_path, "steps", 1)
    r0, r1 = _worker(tmp_path, "steps", 2)
    np.testing.assert_allclose(r0["losses"], one["losses"], rtol=1e-5)
    for k in (k for k in one if k.startswith("m")):
        np.testing.assert_array_equal(r0[k], r1[k], err_msg=k)  # identical on every rank
        np.testing.assert_allclose(r0[k], one[k], rtol=1e-5, atol=1e-6, err_msg=k)
        # The steps moved the maps far more than that tolerance (so a rank that
        # stepped on its own share alone would fail the comparison).
        assert np.abs(one[k] - one["fit_" + k]).max() > 1e-4, k


@launches
def test_ranks_refuse_to_train_on_different_data(tmp_path):
    r0, r1 = _worker(tmp_path, "check", 2)
    for r, m in ((0, r0), (1, r1)):
        message = str(m["message"])
        assert message.startswith("KvlingoError: 1 process(es) of the run read other data"), message
        assert ("Here (rank 1): corpus differ" in message) == (r == 1), message
    (alone,) = _worker(tmp_path, "check", 1)  # one process: nothing to compare
    assert str(alone["message"]) == "accepted"


def _ranks_of(launcher: subprocess.Popen) -> dict:
    """{rank: pid} of the processes an mlx.launch started on this machine (it starts
    them from threads, so look at every thread's children)."""
    ranks = {}
    for task in Path(f"/proc/{launcher.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            for e in env:
                if e.startswith(b"MLX_RANK="):
                    ranks[int(e[9:])] = int(pid)
    return ranks


def _steps(log: Path):
    return [json.loads(l)["step"] for l in log.read_text().splitlines() if '"loss"' in l]


def _train_args(toy_pair_dirs, tmp_path):
    """`mlx-kvlingo train` arguments for a short run on the built-in toy pair."""
    import inspect

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(m.__doc__ for m in (json, re, os, textwrap, inspect,
                                                      subprocess, shutil)) * 3)

    def train_args(out, *extra):
        return ["-m", "mlx_kvlingo_cli.main", "train", "--source", toy_pair_dirs[0],
                "--target", toy_pair_dirs[1], "--out", out, "--corpus", corpus,
                "--fit-tokens", 1000, "--steps", 16, "--checkpoint-every", 2,
                "--eval-every", 0, "--context-lengths", "32,48", "--continuation-len", 16,
                "--batch-size", 2, "--accumulate", 2, "--store-pool", 4, *extra]

    return train_args


def _wait_for_step(log: Path, step: int, launcher, stderr: Path):
    while not (log.exists() and max(_steps(log), default=0) >= step):
        assert launcher.poll() is None, stderr.read_text()
        time.sleep(0.05)


@launches
def test_killed_rank_ends_the_run_and_the_checkpoint_resumes(toy_pair_dirs, tmp_path):
    from mlx_kvlingo.train.loop import load_checkpoint

    train_args = _train_args(toy_pair_dirs, tmp_path)

    def launch(out, *extra):
        return subprocess.run(_launch(train_args(out, *extra)), env=_env(), text=True,
                              capture_output=True, timeout=300, stdin=subprocess.DEVNULL)

    # The run that is not interrupted, for comparison.
    whole = launch(tmp_path / "a.safetensors")
    assert "Done: 16 steps" in whole.stdout, whole.stderr

    out = tmp_path / "b.safetensors"
    log, ckpt = Path(f"{out}.log.jsonl"), Path(f"{out}.ckpt.safetensors")
    stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(stdout, "w") as o, open(stderr, "w") as e:
        launcher = subprocess.Popen(_launch(train_args(out)), env=_env(), stdout=o, stderr=e,
                                    stdin=subprocess.DEVNULL)
        try:
            _wait_for_step(log, 3, launcher, stderr)
            os.kill(_ranks_of(launcher)[1], signal.SIGKILL)
            launcher.wait(timeout=120)  # the surviving rank does not hang
        finally:
            if launcher.poll() is None:
                launcher.kill()
    err = stderr.read_text()
    assert "Node with rank 1 exited with code -9" in err
    # Rank 0 says what happened and how to go on; it exits non-zero (1, or -15 when
    # mlx.launch's SIGTERM reaches it first). mlx.launch itself exits 0 (ring).
    assert re.search(r"error: Rank 0 of 2 stopped while .*connection to a peer was lost", err)
    assert "--resume, with the same number of processes" in err
    assert re.search(r"Node with rank 0 exited with code (1|-15)", err)
    assert "Done:" not in stdout.read_text()

    # The checkpoint is whole: it loads, and says 2 processes wrote it.
    _, info = load_checkpoint(ckpt)
    assert info["world_size"] == 2 and 2 <= info["step"] < 16 and info["step"] % 2 == 0

    # One process may not resume it ...
    alone = subprocess.run([sys.executable, *map(str, train_args(out, "--resume"))],
                           env=_env(), text=True, capture_output=True, timeout=300)
    assert alone.returncode == 1
    assert "written by a run of 2 process(es) and this run has 1" in alone.stderr
    # ... two do, and finish where the uninterrupted run did.
    rest = launch(out, "--resume")
    assert "Done: 16 steps" in rest.stdout, rest.stderr
    assert _steps(log) == list(range(1, 17))
    from mlx_kvlingo.translator.maps import load_translator

    a, b = load_translator(tmp_path / "a.safetensors"), load_translator(out)
    for x, y in zip(a.k_maps + a.v_maps, b.k_maps + b.v_maps):
        np.testing.assert_array_equal(np.array(x.weight), np.array(y.weight))


@launches
def test_a_frozen_rank_times_out_the_others(toy_pair_dirs, tmp_path):
    """A machine that vanishes closes no socket: the others give up after
    --peer-timeout seconds instead of waiting in the all-reduce for ever. (15 s: with
    6 s a loaded machine once stalled a rank that long before any was frozen.)"""
    train_args = _train_args(toy_pair_dirs, tmp_path)
    out = tmp_path / "c.safetensors"
    log, stderr = Path(f"{out}.log.jsonl"), tmp_path / "stderr.txt"
    with open(stderr, "w") as e:
        launcher = subprocess.Popen(_launch(train_args(out, "--peer-timeout", 15)), env=_env(),
                                    stdout=subprocess.DEVNULL, stderr=e,
                                    stdin=subprocess.DEVNULL)
        ranks = {}
        try:
            _wait_for_step(log, 3, launcher, stderr)
            ranks = _ranks_of(launcher)
            os.kill(ranks[1], signal.SIGSTOP)  # alive, sockets open, never answers
            t0 = time.time()
            while "waited more than 15s" not in stderr.read_text():
                assert time.time() - t0 < 120, stderr.read_text()
                time.sleep(0.1)
        finally:
            for pid in ranks.values():  # a stopped process ignores mlx.launch's SIGTERM
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            launcher.wait(timeout=60)
    err = stderr.read_text()
    assert "error: Rank 0 of 2 waited more than 15s for step" in err
    assert "is intact: run the same mlx.launch command with --resume" in err
    assert "Node with rank 0 exited with code 1" in err


def test_the_watchdog_gives_the_first_step_its_grace_and_then_the_limit():
    from mlx_kvlingo.train.distributed import Watchdog

    fired = []
    with Watchdog(0.25, _Rank(0, 2)) as dog:
        dog._fire = lambda what, limit: fired.append((what, limit))  # not os._exit
        dog.arm("step 1")
        assert dog._timer.interval == 0.25 * Watchdog.FIRST_STEP_GRACE
        time.sleep(0.4)
        assert fired == []  # past the limit, within the grace
        dog.arm("step 2")  # re-arming cancels step 1's deadline
        assert dog._timer.interval == 0.25
        t0 = time.time()
        while not fired and time.time() - t0 < 10:  # a loaded machine runs timers late
            time.sleep(0.05)
        time.sleep(1.2)  # step 1's cancelled deadline (1 s) would have fired by now
        assert fired == [("step 2", 0.25)]
    assert Watchdog(5, None)._timer is None and Watchdog(5, None).seconds == 0  # one process


class _Rank:
    """Stands for an mx.distributed group in the sharding helpers (rank and size)."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def _interleave(shares):
    """Rank r's share holds items r, r+N, ...: put them back in global order."""
    out = []
    for i in range(max(len(s) for s in shares)):
        out += [s[i] for s in shares if i < len(s)]
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_rank_shares_partition_one_process_samples(monkeypatch, size):
    """Without launching: each rank's share of a step's micro-batches and of the
    stage-1 samples, put back together, is exactly what one process draws, for both
    kinds of pair (the cross-tokenizer one draws its samples from one rng)."""
    from test_align import TEXT, _bpe
    from tiny import tiny_model

    from mlx_kvlingo.train import samples
    from mlx_kvlingo.train.distill import DistillConfig
    from mlx_kvlingo.train.loop import RunConfig
    from mlx_kvlingo.train.samples import AlignedText, SharedTokens
    from mlx_kvlingo.translator.maps import Translator

    config = RunConfig(DistillConfig(batch_size=2, accumulate=5, seed=4),
                       context_lengths=(8, 12), continuation_len=4)
    ranks = [_Rank(r, size) for r in range(size)]
    monkeypatch.setattr(samples, "make_batch",
                        lambda s, t, tr, c, n, native=False: (c.tolist(), n.tolist()))
    monkeypatch.setattr(samples, "make_aligned_batch",
                        lambda s, t, tr, x, native=False: x.alignment.target_tokens)
    shared = SharedTokens(list(range(500)), list(range(500)))
    whole = shared.step_batches(None, None, None, config, 7)
    assert _interleave([shared.step_batches(None, None, None, config, 7, g) for g in ranks]) == whole
    assert len(whole) == shared.micro_batches(config) == 5

    stok, ttok = _bpe(300), _bpe(330, bos=True)
    text = (TEXT * 40).replace("\n", " ")
    aligned = AlignedText(stok, ttok, text, text)
    whole = aligned.step_batches(None, None, None, config, 7)
    assert _interleave([aligned.step_batches(None, None, None, config, 7, g) for g in ranks]) == whole
    assert len(whole) == aligned.micro_batches(config) == 10 and len({str(w) for w in whole}) > 1

    src = tiny_model("qwen3", vocab_size=300)
    tgt = tiny_model("llama", vocab_size=330)
    t = Translator.for_models(src, tgt, stok, ttok)

    def fit_rows(g):
        return [np.array(f[0][0]).tolist() for f in aligned.fit_features(src, tgt, t, 5, 12, group=g)]

    assert _interleave([fit_rows(g) for g in ranks]) == fit_rows(None)


@launches
def test_a_stop_reaching_one_rank_stops_all_with_a_checkpoint(toy_pair_dirs, tmp_path):
    """SIGTERM (or Ctrl-C) on rank 1 alone: the ranks agree on it at the step boundary,
    rank 0 writes the checkpoint of that step, and both stop as a single process does."""
    from mlx_kvlingo.train.loop import load_checkpoint

    train_args = _train_args(toy_pair_dirs, tmp_path)
    out = tmp_path / "d.safetensors"
    log, stdout, stderr = Path(f"{out}.log.jsonl"), tmp_path / "out.txt", tmp_path / "err.txt"
    with open(stdout, "w") as o, open(stderr, "w") as e:
        launcher = subprocess.Popen(_launch(train_args(out)), env=_env(), stdout=o, stderr=e,
                                    stdin=subprocess.DEVNULL)
        try:
            _wait_for_step(log, 3, launcher, stderr)
            pid = _ranks_of(launcher)[1]
            masks = [l for l in Path(f"/proc/{pid}/status").read_text().splitlines()
                     if l.startswith(("SigBlk", "SigIgn", "SigCgt"))]
            os.kill(pid, signal.SIGTERM)
            launcher.wait(timeout=120)
        finally:
            if launcher.poll() is None:
                launcher.kill()
    err = stderr.read_text()
    assert "Node with rank 1 exited with code 130" in err and "error:" not in err, (
        err, stdout.read_text(), masks)
    _, info = load_checkpoint(Path(f"{out}.ckpt.safetensors"))
    assert 3 <= info["step"] == max(_steps(log)) < 16  # the step both stopped after
    # Rank 0 says so and exits 130 too (mlx.launch's SIGTERM, sent when rank 1 exits
    # non-zero, could only beat it by microseconds, to -15).
    assert f"Stopped at step {info['step']}; checkpoint written" in stdout.read_text()
    assert re.search("Node with rank 0 exited with code (130|-15)", err)

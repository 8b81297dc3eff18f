"""Each `mlx-kvlingo` command, run end to end as a user runs it (a subprocess)."""

import os
import re
import subprocess
import sys

import pytest

from mlx_kvlingo.translator.maps import load_translator


def run_cli(*args, check=True, timeout=600, env=None):
    env = dict(os.environ, HF_HUB_OFFLINE="1", **{k: str(v) for k, v in (env or {}).items()})
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_kvlingo_cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_help_lists_the_commands():
    out = run_cli("--help").stdout
    for command in ("inspect", "fit", "train", "eval", "switch", "demo", "fetch-models",
                    "chat", "convert-cache", "bench", "push", "compress", "defaults"):
        assert re.search(rf"\b{command}\b", out), command


def test_inspect_reports_blas_and_gemm_rate():
    out = run_cli("inspect", "--gemm-size", "256").stdout
    assert "BLAS preload" in out
    rates = re.search(r"mlx ([\d.]+) GFLOP/s, numpy ([\d.]+) GFLOP/s", out)
    assert rates and float(rates.group(1)) > 0 and float(rates.group(2)) > 0


def test_inspect_describes_a_model(toy_pair_dirs):
    out = run_cli("inspect", toy_pair_dirs[1], "--gemm-size", "128").stdout
    assert "llama, 6 layers" in out
    assert re.search(r"^\s+5\s+3\s+24\s+-\s+RoPE", out, re.M)


@pytest.fixture(scope="module")
def fitted_translator(toy_pair_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("fit") / "toy.safetensors"
    src, tgt = toy_pair_dirs
    proc = run_cli("fit", "--source", src, "--target", tgt, "--out", out,
                   "--tokens", "6000", "--context-len", "128")
    assert "Wrote" in proc.stdout
    return out


def test_fit_writes_a_translator_for_the_pair(fitted_translator, toy_pair_dirs):
    t = load_translator(fitted_translator)
    assert t.spec.training["stage"] == 1
    assert t.spec.training["fit"]["tokens"] >= 5000
    assert t.spec.source.name == str(toy_pair_dirs[0])
    assert len(t.k_maps) == 6


def test_switch_compare_reports_both_times(fitted_translator, toy_pair_dirs):
    src, tgt = toy_pair_dirs
    proc = run_cli("switch", "--source", src, "--target", tgt, "--translator",
                   fitted_translator, "--prompt", "Return the number of items in the list.",
                   "--max-tokens", "8", "--compare")
    out = proc.stdout
    assert "time to first token after switch" in out
    assert re.search(r"switch is [\d.]+x faster", out)


def test_defaults_shows_and_sets_a_files_switch_defaults(fitted_translator, tmp_path):
    """`defaults` prints a file's native tail and recompute budget and writes new
    ones to --out, the maps unchanged; bad values are refused, nothing written."""
    import mlx.core as mx

    out = tmp_path / "with-defaults.safetensors"
    assert "recompute 0%" in run_cli("defaults", fitted_translator).stdout
    said = run_cli("defaults", fitted_translator, "--recompute", "0.1", "--recompute-max",
                   "128", "--native-tail", "4", "--out", out).stdout
    assert "native tail 4; recompute 10%, at most 128 positions" in said
    t, before = load_translator(out), load_translator(fitted_translator)
    assert (t.spec.recompute, t.spec.recompute_max, t.spec.native_tail) == (0.1, 128, 4)
    assert before.spec.recompute == 0.0
    for a, b in zip(t.k_maps + t.v_maps, before.k_maps + before.v_maps):
        assert mx.array_equal(a.weight, b.weight)
    said = run_cli("defaults", out, "--recompute-reserve", "55").stdout
    assert "recompute 10% less 55 positions, at most 128 positions" in said
    assert load_translator(out).spec.recompute_reserve == 55
    said = run_cli("defaults", out, "--break-even", "256").stdout
    assert "chosen by question; catch-ups under 256 positions prefill" in said
    assert load_translator(out).spec.break_even == 256
    assert load_translator(out).spec.recompute_reserve == 55  # the others kept
    bad = run_cli("defaults", out, "--break-even", "-1", check=False)
    assert bad.returncode != 0 and load_translator(out).spec.break_even == 256
    bad = run_cli("defaults", out, "--recompute", "1.5", check=False)
    assert bad.returncode != 0 and "share of the context" in bad.stderr + bad.stdout
    assert load_translator(out).spec.recompute == 0.1
    # A long tail is the source's choice: refused with the question's reading.
    bad = run_cli("defaults", out, "--long-tail", "128", "--long-tail-reach", "0.3",
                  check=False)
    assert bad.returncode != 0 and "--select source" in bad.stderr + bad.stdout
    said = run_cli("defaults", out, "--long-tail", "128", "--long-tail-reach", "0.3",
                   "--select", "source").stdout
    assert "a long tail of 128 without the recompute where the next token reaches at most " \
        "0.3 nats" in said
    assert (load_translator(out).spec.long_tail, load_translator(out).spec.long_tail_reach) \
        == (128, 0.3)


def test_compress_writes_a_cheaper_translator_that_switches(fitted_translator, toy_pair_dirs,
                                                           tmp_path):
    src, tgt = toy_pair_dirs
    out = tmp_path / "small.safetensors"
    proc = run_cli("compress", "--source", src, "--target", tgt, "--translator",
                   fitted_translator, "--out", out, "--key-rank", "16", "--value-rank", "24",
                   "--tokens", "1024")
    macs = re.search(r"multiply-adds per token ([\d.]+) M -> ([\d.]+) M", proc.stdout)
    assert macs and float(macs.group(2)) < float(macs.group(1))
    assert load_translator(out).spec.shared_rank == {"k": 16, "v": 24}
    proc = run_cli("switch", "--source", src, "--target", tgt, "--translator", out,
                   "--prompt", "Return the number of items in the list.", "--max-tokens", "4")
    assert proc.returncode == 0
    bad = run_cli("compress", "--source", tgt, "--target", src, "--translator",
                  fitted_translator, "--out", tmp_path / "x.safetensors", check=False)
    assert bad.returncode != 0 and "not the source model" in bad.stderr + bad.stdout


def switch_at_thresholds(translator, dirs, prompt, *gate):
    """`switch --compare` with a gate option at a threshold that never fires ("100")
    and one that always fires ("-100"): {threshold: stdout}."""
    src, tgt = dirs
    return {threshold: run_cli("switch", "--source", src, "--target", tgt, "--translator",
                               translator, "--prompt", prompt, "--max-tokens", "8",
                               "--compare", *gate, threshold).stdout
            for threshold in ("100", "-100")}


def test_switch_gate_keeps_or_replaces_the_translation(fitted_translator, toy_pair_dirs):
    prompt = ("Return a new list containing all items from the iterable in ascending "
              "order, and close the file when done.")
    outs = switch_at_thresholds(fitted_translator, toy_pair_dirs, prompt, "--gate",
                                "--gate-threshold")
    assert re.search(r"gate: score [-+][\d.]+ nats .* on 7 tokens: translation kept", outs["100"])
    fired = outs["-100"]
    assert "re-prefilled: gate: the translated context predicts" in fired
    # After the fallback the target decodes from a native cache: the re-prefill's answer.
    assert re.search(r"answers agree on the first (\d+) of \1 tokens", fired)


def test_switch_fact_gate_keeps_or_re_prefills(fitted_translator, toy_pair_dirs):
    prompt = ("The clerk said the locker code is 58213 and that parse_cfg_v2 reads it. "
              "Return a new list containing all items from the iterable.")
    outs = switch_at_thresholds(fitted_translator, toy_pair_dirs, prompt, "--fact-gate")
    assert re.search(r"fact probe: [\d.]+ nats on \[.*58213.*\].*: kept", outs["100"])
    assert "re-prefilled" in outs["-100"]
    assert re.search(r"answers agree on the first (\d+) of \1 tokens", outs["-100"])


def test_switch_refuses_a_translator_for_other_models(fitted_translator, toy_pair_dirs):
    src, tgt = toy_pair_dirs
    # Swapped roles: geometry differs, so the translator must be refused.
    proc = run_cli("switch", "--source", tgt, "--target", src, "--translator",
                   fitted_translator, "--prompt", "hello there", check=False)
    assert proc.returncode == 1
    assert "does not fit" in proc.stderr and "layers" in proc.stderr


def test_switch_rejects_damaged_translator_and_empty_prompt(tmp_path, toy_pair_dirs):
    src, tgt = toy_pair_dirs
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 5)
    proc = run_cli("switch", "--source", src, "--target", tgt, "--translator", bad,
                   "--prompt", "hi", check=False)
    assert proc.returncode == 1 and "truncated" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_fit_with_a_missing_model_fails_clearly(tmp_path):
    out = tmp_path / "t.safetensors"
    proc = run_cli("fit", "--source", tmp_path / "nope", "--target", tmp_path / "nope",
                   "--out", out, check=False)
    assert proc.returncode == 1
    assert "Could not load model" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()

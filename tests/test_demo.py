"""`mlx-kvlingo demo`, run as a user runs it (a subprocess)."""

import os
import re
import subprocess
import sys

import pytest


def run_demo(*args, env=None, timeout=900):
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_kvlingo_cli.main", "demo", *map(str, args)],
        capture_output=True, text=True, timeout=timeout,
        env=dict(os.environ, HF_HUB_OFFLINE="1", **(env or {})),
    )
    return proc


@pytest.mark.slow
def test_builtin_demo_shows_benefit_cbr_timing_and_both_answers():
    proc = run_demo("--windows", "16", "--fit-tokens", "8000", "--repeats", "1",
                    "--max-tokens", "12")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    benefit = float(re.search(r"context benefit\s+(-?[\d.]+) nats/token", out).group(1))
    assert benefit >= 1.0  # the shipped pair copies from its context: CBR is a signal
    assert "mostly noise" not in out
    cbrs = re.findall(r"CBR (-?[\d.]+)% \[(-?[\d.]+)%, (-?[\d.]+)%\]", out)
    assert len(cbrs) >= 1
    for value, low, high in cbrs:
        assert float(low) <= float(value) <= float(high)
    assert re.search(r"re-prefill [\d.]+ ms: [\d.]+x faster", out)
    assert "after switch:" in out and "after re-prefill:" in out and "the text goes on:" in out


def test_real_demo_without_translators_says_what_to_do(tmp_path):
    proc = run_demo("--real", "--translators", tmp_path)
    assert proc.returncode == 1
    assert "No translators for SmolLM2 <-> Gemma 3" in proc.stderr
    assert "smollm2-to-gemma3.safetensors" in proc.stderr and "mlx-kvlingo train" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.network
@pytest.mark.slow
def test_real_demo_runs_with_a_translator_from_the_environment(tmp_path):
    """A quick stage-1 translator stands in for the shipped ones (found through
    MLX_KVLINGO_TRANSLATORS); the demo scores it and switches a real paragraph."""
    from mlx_kvlingo.models import pretrained

    smol = pretrained.fetch("smollm2", log=None)
    gemma = pretrained.fetch("gemma3", log=None)
    out = tmp_path / "gemma3-to-smollm2.safetensors"
    fit = subprocess.run(
        [sys.executable, "-m", "mlx_kvlingo_cli.main", "fit", "--source", gemma,
         "--target", smol, "--out", out, "--tokens", "1024", "--context-len", "128"],
        capture_output=True, text=True, timeout=900, env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert fit.returncode == 0, fit.stderr
    proc = run_demo("--real", "--windows", "2", "--context", "128", "--repeats", "1",
                    "--max-tokens", "4", env={"MLX_KVLINGO_TRANSLATORS": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert "=== gemma3 -> smollm2" in proc.stdout
    assert "context benefit" in proc.stdout and "CBR" in proc.stdout
    assert "after switch:" in proc.stdout and "after re-prefill:" in proc.stdout

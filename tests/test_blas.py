"""The fast-BLAS preload (blas.py) and the slow-BLAS warning."""

import os
import platform
import subprocess
import sys

import pytest

from mlx_kvlingo import blas

linux = pytest.mark.skipif(platform.system() != "Linux", reason="the preload is Linux-only")
needs_mkl = pytest.mark.skipif(blas.find_mkl() is None, reason="no mkl wheel (Linux x86_64 only)")


def python(code: str, **env):
    """Run code in a fresh interpreter (the preload happens once, at import)."""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, HF_HUB_OFFLINE="1", **env),
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_choice_reads_the_environment(monkeypatch):
    monkeypatch.delenv(blas.DISABLE_ENV, raising=False)
    monkeypatch.delenv(blas.CHOICE_ENV, raising=False)
    assert blas.choice() == "auto"
    monkeypatch.setenv(blas.CHOICE_ENV, "MKL")
    assert blas.choice() == "mkl"
    monkeypatch.setenv(blas.CHOICE_ENV, "bogus")
    assert blas.choice() == "auto"
    monkeypatch.setenv(blas.DISABLE_ENV, "1")  # the old switch still turns it off
    assert blas.choice() == "none"


@needs_mkl
def test_mkl_is_the_fallback_and_can_be_forced():
    names = lambda which: [name for name, _ in blas.candidates(which)]  # noqa: E731
    assert names("mkl") == ["MKL"]
    assert names("auto")[-1] == "MKL"  # after a system OpenBLAS, when there is one
    assert blas.candidates("none") == []
    if blas.find_system_openblas():
        assert names("auto") == ["OpenBLAS", "MKL"]


GEMM = ("import mlx_kvlingo; from mlx_kvlingo import blas; "
        "print(blas.preload_status); print(blas.measure_gemm_gflops(512)[0])")


@linux
@needs_mkl
def test_mkl_wheel_alone_is_preloaded_and_used_by_mlx():
    """A machine without system OpenBLAS (emulated by MLX_KVLINGO_BLAS=mkl) gets MKL
    from the pip wheel, mapped into the process before mlx.core. (How fast it is
    shows in `mlx-kvlingo inspect`; timings are not asserted in tests.)"""
    status, _ = python(GEMM, MLX_KVLINGO_BLAS="mkl").splitlines()
    assert status.startswith("loaded MKL ") and "libmkl_rt" in status
    status, _ = python(GEMM, MLX_KVLINGO_BLAS="none").splitlines()
    assert status.startswith("disabled")


@linux
@needs_mkl
def test_mkl_results_match_the_reference_blas():
    code = ("import mlx_kvlingo, mlx.core as mx; mx.random.seed(0); "
            "a = mx.random.normal((64, 96)); b = mx.random.normal((96, 32)); "
            "print(repr((a @ b).sum().item()), repr(abs(a @ b).sum().item()))")
    fast = [float(x) for x in python(code, MLX_KVLINGO_BLAS="mkl").split()]
    ref = [float(x) for x in python(code, MLX_KVLINGO_BLAS="none").split()]
    assert fast == pytest.approx(ref, rel=1e-5)


@linux
def test_importing_mlx_first_warns_unless_a_fast_blas_is_already_mapped():
    """A Python API user who imports mlx.core before mlx_kvlingo is too late for
    the preload; they are told at import, not left with ~20x slower matmuls."""
    late = "import mlx.core, warnings; warnings.simplefilter('always'); import mlx_kvlingo"
    proc = subprocess.run([sys.executable, "-c", late], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr
    assert "RuntimeWarning" in proc.stderr and "Import mlx_kvlingo first" in proc.stderr
    in_order = "import warnings; warnings.simplefilter('error'); import mlx_kvlingo, mlx.core"
    assert python(in_order) == ""
    openblas = blas.find_system_openblas()
    if openblas:  # preloaded by the user: nothing to warn about
        late_ok = late.replace("'always'", "'error'")
        python(late_ok, LD_PRELOAD=openblas)


@linux
def test_cli_warns_once_when_blas_is_slow_and_names_the_fix():
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_kvlingo_cli.main", "switch", "--source", "s",
         "--target", "t", "--translator", "missing.safetensors"],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, HF_HUB_OFFLINE="1", MLX_KVLINGO_BLAS="none"),
    )
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, proc.stderr
    assert "reference BLAS" in warnings[0] and "mlx-kvlingo[blas]" in warnings[0]
    assert proc.returncode == 1  # the command itself still runs (and fails on its input)


def test_warning_when_loaded_but_measured_slow(monkeypatch):
    if platform.system() != "Linux":
        pytest.skip("Linux only")
    monkeypatch.setattr(blas, "preloaded_path", "/some/libopenblas.so.0")
    monkeypatch.setattr(blas, "measure_gemm_gflops", lambda *a, **k: (5.0, 100.0))
    message = blas.slow_blas_warning()
    assert "5.0 GFLOP/s" in message and "100.0" in message and blas.FIX in message
    monkeypatch.setattr(blas, "measure_gemm_gflops", lambda *a, **k: (80.0, 100.0))
    assert blas.slow_blas_warning() is None


def test_no_warning_off_linux(monkeypatch):
    monkeypatch.setattr(blas.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(blas, "preloaded_path", None)
    assert blas.slow_blas_warning() is None

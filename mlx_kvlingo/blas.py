"""Fast BLAS for MLX's Linux CPU build.

MLX's Linux CPU wheel links the netlib *reference* BLAS, whose fp32 GEMM runs at
~5 GFLOP/s on a laptop-class core; OpenBLAS does ~30x better with identical
results. Loading ``libopenblas`` with ``RTLD_GLOBAL`` before ``mlx.core`` makes
MLX's ``sgemm`` calls resolve to it. This module must therefore run before
anything imports ``mlx.core``: ``mlx_kvlingo/__init__.py`` imports it first.

Set ``MLX_KVLINGO_NO_OPENBLAS=1`` to turn the preload off.
"""

import ctypes
import ctypes.util
import os
import platform
import sys
import time

DISABLE_ENV = "MLX_KVLINGO_NO_OPENBLAS"

# What happened at import time, for `mlx-kvlingo inspect`.
preload_status = "not attempted"
preloaded_path = None


def _find_openblas():
    path = ctypes.util.find_library("openblas")
    if path:
        return path
    # find_library can miss the Debian alternative when ldconfig's cache is stale.
    for candidate in (
        "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
        "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    ):
        if os.path.exists(candidate):
            return candidate
    return None


def preload_openblas():
    """Load OpenBLAS globally so MLX's CPU matmuls use it (Linux only)."""
    global preload_status, preloaded_path
    if platform.system() != "Linux":
        preload_status = "not needed (MLX uses Accelerate/Metal on macOS)"
        return
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        preload_status = f"disabled by {DISABLE_ENV}"
        return
    if "mlx.core" in sys.modules and preloaded_path is None:
        preload_status = "too late: mlx.core was imported before mlx_kvlingo"
        return
    path = _find_openblas()
    if path is None:
        preload_status = (
            "OpenBLAS not found (install libopenblas0-pthread); "
            "MLX uses its slow reference BLAS"
        )
        return
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        preload_status = f"failed to load {path}: {e}"
        return
    preloaded_path = path
    preload_status = f"loaded {path}"


def blas_libraries():
    """Shared objects with 'blas' in their name mapped into this process."""
    libs = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and "blas" in parts[-1].lower():
                    if parts[-1] not in libs:
                        libs.append(parts[-1])
    except OSError:
        pass
    return libs


def measure_gemm_gflops(n=1024, repeats=5):
    """Median fp32 GEMM rate of MLX and of numpy, in GFLOP/s, on the same matrices."""
    import mlx.core as mx
    import numpy as np

    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a, b)
    an, bn = np.array(a), np.array(b)

    def rate(fn):
        fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return 2 * n**3 / sorted(times)[len(times) // 2] / 1e9

    mlx_rate = rate(lambda: mx.eval(mx.matmul(a, b)))
    numpy_rate = rate(lambda: an @ bn)
    return mlx_rate, numpy_rate

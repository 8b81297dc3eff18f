"""Fast BLAS for MLX's Linux CPU build.

MLX's Linux CPU wheel links the netlib *reference* BLAS, whose fp32 GEMM runs at
~5 GFLOP/s; an optimised BLAS does 20-30x better with the same results. Loading
one with ``RTLD_GLOBAL`` before ``mlx.core`` makes MLX's ``cblas_sgemm`` calls
resolve to it. This module must therefore run before anything imports
``mlx.core``: ``mlx_kvlingo/__init__.py`` imports it first.

Which library, in order of preference:

1. a system OpenBLAS (Debian's ``libopenblas0-pthread``), when there is one;
2. Intel MKL from the ``mkl`` pip wheel (``libmkl_rt.so.3``, installed on Linux
   x86_64 by the ``blas`` extra, which ``dev`` includes). Its symbols are the
   plain ``cblas_sgemm``/``sgemm_`` MLX calls; ``scipy-openblas`` wheels do not
   work, their symbols carry a ``scipy_`` prefix.

``MLX_KVLINGO_BLAS`` chooses: ``auto`` (default, the order above), ``openblas``
(system OpenBLAS only), ``mkl`` (the wheel only, skipping any system OpenBLAS:
this is how to try a machine without the apt package), or ``none`` (no preload;
``MLX_KVLINGO_NO_OPENBLAS=1`` means the same, kept for old scripts).
"""

import ctypes
import ctypes.util
import glob
import os
import platform
import sys
import time
import warnings

CHOICE_ENV = "MLX_KVLINGO_BLAS"
DISABLE_ENV = "MLX_KVLINGO_NO_OPENBLAS"
CHOICES = ("auto", "openblas", "mkl", "none")

# The fix a slow machine needs, named by every warning.
FIX = ('pip install "mlx-kvlingo[blas]" (Linux x86_64: the mkl wheel) '
       "or apt-get install libopenblas0-pthread")

# What happened at import time, for `mlx-kvlingo inspect` and the slow-BLAS warning.
preload_status = "not attempted"
preloaded_path = None


def find_system_openblas():
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


def find_mkl():
    """``libmkl_rt.so.*`` of an installed ``mkl`` wheel, or None.

    The wheel puts its libraries in ``<prefix>/lib`` (not in site-packages), so
    look in this interpreter's prefixes first and ask the package's file list
    only for other layouts (``pip install --user``)."""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix, sys.exec_prefix)):
        hits = sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")))
        if hits:
            return hits[-1]
    try:
        from importlib.metadata import PackageNotFoundError, files

        for f in files("mkl") or ():
            if f.name.startswith("libmkl_rt.so"):
                path = str(f.locate())
                if os.path.exists(path):
                    return path
    except PackageNotFoundError:
        pass
    return None


def _mkl_threading_layer(mkl_path: str) -> str:
    """MKL's threading runtime: GNU OpenMP when the system has it, else Intel's
    OpenMP from the intel-openmp wheel (an mkl dependency), else one thread."""
    if ctypes.util.find_library("gomp"):
        return "GNU"
    if glob.glob(os.path.join(os.path.dirname(mkl_path), "libiomp5.so")):
        return "INTEL"
    return "SEQUENTIAL"


def choice() -> str:
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return "none"
    value = os.environ.get(CHOICE_ENV, "auto").strip().lower() or "auto"
    return value if value in CHOICES else "auto"


def candidates(which: str):
    """(name, path) of the libraries to try, best first."""
    out = []
    if which in ("auto", "openblas"):
        path = find_system_openblas()
        if path:
            out.append(("OpenBLAS", path))
    if which in ("auto", "mkl"):
        path = find_mkl()
        if path:
            out.append(("MKL", path))
    return out


def _load(name: str, path: str):
    if name == "MKL":
        # Read by libmkl_rt when it loads; a user's own setting wins.
        os.environ.setdefault("MKL_THREADING_LAYER", _mkl_threading_layer(path))
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def preload():
    """Load a fast BLAS globally so MLX's CPU matmuls use it (Linux only)."""
    global preload_status, preloaded_path
    if platform.system() != "Linux":
        preload_status = "not needed (MLX uses Accelerate/Metal on macOS)"
        return
    which = choice()
    if which == "none":
        preload_status = f"disabled by {CHOICE_ENV}=none or {DISABLE_ENV}"
        return
    if "mlx.core" in sys.modules and preloaded_path is None:
        preload_status = "too late: mlx.core was imported before mlx_kvlingo"
        if not _fast_blas_mapped():
            # A Python API user (a chat app importing mlx first) would otherwise
            # get ~20x slower matmuls and no word of why.
            warnings.warn(
                "mlx_kvlingo was imported after mlx.core, too late to give MLX a fast "
                "BLAS: its CPU matmuls will use the slow reference BLAS. Import "
                "mlx_kvlingo first (before mlx, mlx_lm).", RuntimeWarning, stacklevel=3)
        return
    if preloaded_path is not None:
        return
    errors = []
    for name, path in candidates(which):
        try:
            _load(name, path)
        except OSError as e:
            errors.append(f"{path}: {e}")
            continue
        preloaded_path = path
        extra = f", MKL_THREADING_LAYER={os.environ['MKL_THREADING_LAYER']}" if name == "MKL" else ""
        preload_status = f"loaded {name} {path}{extra}"
        return
    if errors:
        preload_status = "failed to load " + "; ".join(errors)
    else:
        wanted = {"auto": "no system OpenBLAS and no mkl wheel",
                  "openblas": "no system OpenBLAS", "mkl": "no mkl wheel"}[which]
        preload_status = f"{wanted} found; MLX uses its slow reference BLAS"


# The old name, called by mlx_kvlingo/__init__.py.
preload_openblas = preload


def preload_failed() -> bool:
    """True on Linux when no fast BLAS was loaded."""
    return platform.system() == "Linux" and preloaded_path is None


def _fast_blas_mapped() -> bool:
    """True when an OpenBLAS or MKL that MLX's calls can resolve to is already
    mapped (e.g. the user preloaded one); numpy's ``libscipy_openblas`` does not
    count, its symbols are prefixed."""
    names = (os.path.basename(p).lower() for p in blas_libraries())
    return any(n.startswith(("libopenblas", "libmkl_rt")) for n in names)


def blas_libraries():
    """BLAS shared objects (OpenBLAS, MKL, netlib) mapped into this process."""
    libs = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                name = os.path.basename(parts[-1]).lower() if len(parts) >= 6 else ""
                if ("blas" in name or name.startswith("libmkl_rt")) and parts[-1] not in libs:
                    libs.append(parts[-1])
    except OSError:
        pass
    return libs


def measure_gemm_gflops(n=1024, repeats=5, pause=0.2):
    """Best-of-``repeats`` fp32 GEMM rates of numpy and of MLX, in GFLOP/s, on the
    same matrices: (mlx, numpy).

    Best-of rather than median because the machine may be busy. numpy's own
    OpenBLAS and the one MLX uses keep separate thread pools that spin for a while
    after each call; timed alternately they steal each other's cores, so each is
    timed in its own block, with a pause between the blocks."""
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
        time.sleep(pause)
        return 2 * n**3 / min(times) / 1e9

    numpy_rate = rate(lambda: an @ bn)
    mlx_rate = rate(lambda: mx.eval(mx.matmul(a, b)))
    return mlx_rate, numpy_rate


# "Far below numpy's rate". Measured here, mlx/numpy is 0.7-1.8 with OpenBLAS or
# MKL and 0.05-0.2 on the reference BLAS, but a fast BLAS limited to one thread
# (OPENBLAS_NUM_THREADS=1) on a busy machine measured 0.27 against numpy's two
# threads: a higher threshold warns falsely. The reference BLAS is also caught by
# the preload's own status, whatever it measures.
SLOW_RATIO = 0.15


def slow_blas_warning(n: int = 512):
    """One line naming the fix when MLX's CPU matmuls are slow here, else None.

    Costs about 0.2 s when the BLAS is fast, up to ~1.5 s when it is slow."""
    if platform.system() != "Linux":
        return None
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return None  # a GPU build does not use the CPU BLAS for the model
    if preload_failed():
        return (f"warning: MLX's CPU matmuls use the slow reference BLAS ({preload_status}); "
                f"expect ~20x slower runs. Fix: {FIX}.")
    # A busy machine can make one measurement of a fast BLAS look slow; a slow
    # BLAS looks slow every time. Warn only when three tries agree.
    for _ in range(3):
        mlx_rate, np_rate = measure_gemm_gflops(n, repeats=4, pause=0.1)
        if mlx_rate >= SLOW_RATIO * np_rate:
            return None
    return (f"warning: MLX's fp32 GEMM runs at {mlx_rate:.1f} GFLOP/s, numpy's at "
            f"{np_rate:.1f}, although {preload_status}; see `mlx-kvlingo inspect`. Fix: {FIX}.")

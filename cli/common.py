"""What every command shares: the package's own errors become one line and exit 1."""

import typer

from mlx_kvlingo.errors import KvlingoError


def fail(message: str):
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(1)


def run(fn):
    """Run a command body; KvlingoError and OSError (unwritable output, full disk)
    become ``error: ...`` on stderr and exit status 1, never a traceback."""
    try:
        return fn()
    except KvlingoError as e:
        fail(str(e))
    except OSError as e:
        fail(f"{type(e).__name__}: {e}")


def warn_if_slow_blas():
    """At the start of a command that does heavy work: one line on stderr when MLX's
    CPU matmuls are slow here (no fast BLAS loaded, or GEMM far below numpy's),
    naming the fix. Silent on macOS and when BLAS is fast."""
    from mlx_kvlingo import blas

    message = blas.slow_blas_warning()
    if message:
        typer.secho(message, fg="yellow", err=True)

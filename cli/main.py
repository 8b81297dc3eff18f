import mlx_kvlingo  # noqa: F401  (first: loads fast BLAS before mlx.core)
import typer

app = typer.Typer(help="Translate KV caches between mlx-lm models.", no_args_is_help=True)


@app.command()
def inspect():
    """placeholder"""

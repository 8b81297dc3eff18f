"""`mlx-kvlingo serve`: the options, then :func:`mlx_kvlingo.serve.server.run`."""

from pathlib import Path
from typing import List, Optional

import typer

import mlx_kvlingo  # noqa: F401  (first: loads fast BLAS before mlx.core)
from mlx_kvlingo.serve.server import API_KEY_ENV, ServeOptions
from mlx_kvlingo.serve.server import run as run_server
from mlx_kvlingo_cli.common import run as _run


def register(app: typer.Typer):
    """Add `serve` to ``app``."""

    @app.command()
    def serve(
        model: Optional[List[str]] = typer.Option(
            None, "--model",
            help="NAME=PATH (or PATH) of an mlx-lm model; repeat. Default: the built-in pair."),
        translator: Optional[List[str]] = typer.Option(
            None, "--translator", "-t", help="SOURCE:TARGET=FILE (or FILE); repeat."),
        host: str = typer.Option("127.0.0.1", help="Address to bind."),
        port: int = typer.Option(8000, help="Port (0: any free port)."),
        api_key: Optional[str] = typer.Option(
            None, help=f"Require 'Authorization: Bearer KEY' (default ${API_KEY_ENV})."),
        allow_insecure_bind: bool = typer.Option(
            False, help="Allow a non-loopback --host without an API key."),
        auto: Optional[str] = typer.Option(
            None, help="SMALL:LARGE for model 'auto' (default: the first two models)."),
        auto_entropy: float = typer.Option(
            2.5, help="auto escalates when the small model's mean entropy (nats) over its "
            "first --auto-probe answer tokens is above this."),
        auto_probe: int = typer.Option(8, help="Answer tokens the small model probes with."),
        gate: bool = typer.Option(False, help="Quality gate: judge every translated cache "
                                  "and re-prefill when it is predicted bad."),
        gate_threshold: Optional[float] = typer.Option(
            None, help="Gate threshold (nats/token over the no-context NLL; default: the "
            "translator's recorded one, else 0)."),
        fit_missing: bool = typer.Option(
            False, help="Fit stage-1 translators for directions without one (cached)."),
        fit_tokens: int = typer.Option(10_000, help="Positions for stage-1 fits."),
        max_queue: int = typer.Option(8, help="Requests that may wait for the worker."),
        max_tokens: int = typer.Option(
            512, "--max-tokens", "-m",
            help="max_tokens when a request gives none (as mlx_lm.server's --max-tokens)."),
        max_tokens_limit: int = typer.Option(
            2048, help="Largest max_tokens a request may ask (a larger one gets a 400)."),
        max_body_kb: int = typer.Option(4096, help="Largest request body (KiB)."),
        max_conversations: int = typer.Option(32, help="Conversations kept (LRU)."),
        max_cache_mb: int = typer.Option(4096, help="Bytes of caches kept (MiB, LRU)."),
        request_timeout: float = typer.Option(
            600.0, help="Seconds a request may take, waiting included; then it is stopped "
            "and answered 504 (an error event in a stream)."),
        keepalive: float = typer.Option(
            10.0, help="Seconds between ': keepalive' comments of a stream that waits for "
            "the worker or for its model to catch up."),
        allowed_origin: Optional[List[str]] = typer.Option(
            None, help="Origin browsers may call from (CORS); repeat. Default: any ('*')."),
        cache_dir: Optional[Path] = typer.Option(None, help="Where fitted translators are kept."),
        recompute: Optional[float] = typer.Option(
            None, help="Share of the conversation (0.1 = 10%) the reading model recomputes "
            "itself among the positions it translated, chosen by the request's new "
            "messages and the words that look like facts. Default: the translator's (see "
            "`mlx-kvlingo defaults`)."),
        recompute_max: Optional[int] = typer.Option(
            None, help="The most positions one catch-up recomputes (0: no limit; default: "
            "the translator's)."),
        break_even: Optional[int] = typer.Option(
            None, help="A catch-up that would translate fewer positions prefills them "
            "instead. Default: what `mlx-kvlingo break-even` measured for the pair on this "
            "machine, else the translator file's (0: always translate)."),
    ):
        """Serve the models over an OpenAI-compatible API (/v1/chat/completions):
        a conversation moves between models by translating its cache."""
        options = ServeOptions(
            models=model or [], translators=translator or [], host=host, port=port,
            api_key=api_key, allow_insecure_bind=allow_insecure_bind, auto=auto,
            auto_entropy=auto_entropy, auto_probe=auto_probe, gate=gate,
            gate_threshold=gate_threshold, fit_missing=fit_missing, fit_tokens=fit_tokens,
            max_queue=max_queue, max_tokens=max_tokens_limit, default_max_tokens=max_tokens,
            max_body_kb=max_body_kb, max_conversations=max_conversations,
            max_cache_mb=max_cache_mb, request_timeout=request_timeout, keepalive=keepalive,
            allowed_origins=allowed_origin or ["*"], cache_dir=cache_dir, recompute=recompute,
            recompute_max=recompute_max, break_even=break_even)
        _run(lambda: run_server(options, log=typer.echo))

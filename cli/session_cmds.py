"""`mlx-kvlingo chat`, `convert-cache` and `bench ttft`.

Wired into the main app with ``register(app)``.
"""

import sys
from pathlib import Path
from typing import List, Optional

import typer

import mlx_kvlingo  # noqa: F401  (first: loads fast BLAS before mlx.core)
from mlx_kvlingo.errors import KvlingoError
from mlx_kvlingo.pairs.assemble import build_session, describe_session
from mlx_kvlingo_cli.common import make_sampler, read_prompt
from mlx_kvlingo_cli.common import run as _run

# ---------------------------------------------------------------------------
# chat

CHAT_HELP = """\
Commands:
  /switch NAME   answer the next turns with model NAME
  /models        list the models and translators
  /stats         per-turn table: tokens translated, prefilled, generated; time to first token
  /reset         start a new conversation
  /help          this text
  /quit          leave (also Ctrl-D)
Anything else is sent as your message. Ctrl-C stops an answer."""


def _stats(session) -> str:
    from mlx_kvlingo.chat.session import format_reports

    lines = [format_reports(session.reports) if session.reports else "No turns yet."]
    lines.append(f"conversation: {len(session.transcript)} tokens")
    for name in session.model_names:
        t = session.transcript_of(name)
        lines.append(f"  {name}: cache holds {t.processed[name]} of its {len(t)} tokens, "
                     f"{t.translated[name]} of them translated")
    return "\n".join(lines)


class LineReader:
    """Reads lines from a file descriptor while staying interruptible.

    ``input()`` blocks inside C; when Ctrl-C's SIGINT is delivered to one of MLX's
    or BLAS's worker threads instead of the main thread, the blocked read never
    returns and Python never gets to raise KeyboardInterrupt. Waiting in short
    ``select`` slices lets the main thread act on the signal within 0.2 s.
    """

    def __init__(self, fd: int = 0, out=None):
        self.fd, self.out, self.buf = fd, out or sys.stdout, b""

    def __call__(self, prompt: str = "") -> str:
        import os
        import select

        self.out.write(prompt)
        self.out.flush()
        while b"\n" not in self.buf:
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if not ready:
                continue
            data = os.read(self.fd, 4096)
            if not data:  # end of input (Ctrl-D on an empty line)
                if self.buf:
                    line, self.buf = self.buf, b""
                    return line.decode("utf-8", "replace")
                raise EOFError
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode("utf-8", "replace")


def chat_loop(session, first: str, max_tokens: int, sampler=None, read=None, out=None):
    """The interactive loop (``read(prompt)`` returns one line or raises EOFError)."""
    out = out or sys.stdout
    read = read or LineReader(out=out)

    def say(text="", end="\n"):
        out.write(text + end)
        out.flush()

    current = first
    say(f"Talking to {current}. Type /help for commands.")
    while True:
        try:
            line = read(f"[{current}] you> ")
        except (EOFError, KeyboardInterrupt):
            say()
            break
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            cmd, _, arg = line.partition(" ")
            arg = arg.strip()
            if cmd in ("/quit", "/exit"):
                break
            elif cmd == "/help":
                say(CHAT_HELP)
            elif cmd == "/models":
                say(describe_session(session))
            elif cmd == "/stats":
                say(_stats(session))
            elif cmd == "/reset":
                session.reset()
                say("New conversation.")
            elif cmd == "/switch":
                if arg in session.model_names:
                    current = arg
                    say(f"Now talking to {current}.")
                else:
                    say(f"No model named {arg!r}; models: {', '.join(session.model_names)}.")
            else:
                say(f"Unknown command {cmd}; /help lists them.")
            continue
        kwargs = {"sampler": sampler} if sampler is not None else {}
        stream = session.generate(current, line, max_tokens=max_tokens, stream=True, **kwargs)
        say(f"{current}> ", end="")
        try:
            for r in stream:
                say(r.text, end="")
        except KeyboardInterrupt:
            stream.close()
            say(" [stopped]", end="")
        except KvlingoError as e:
            stream.close()
            say(f"\nerror: {e}")
            continue
        report = stream.report
        say()
        say(f"  ({report.summary()})")
        for w in report.warnings:
            say(f"  warning: {w}")
    say("Bye.")


def register(app: typer.Typer):
    """Add `chat`, `convert-cache` and `bench ttft` to ``app``."""

    @app.command()
    def chat(
        model: Optional[List[str]] = typer.Option(
            None, "--model",
            help="NAME=PATH (or PATH) of an mlx-lm model; repeat. Default: the built-in pair."),
        translator: Optional[List[str]] = typer.Option(
            None, "--translator", "-t",
            help="SOURCE:TARGET=FILE (or FILE, matched to the models); repeat."),
        first: Optional[str] = typer.Option(None, help="Model that answers first (default: the first)."),
        fit_missing: bool = typer.Option(
            False, help="Fit stage-1 translators for directions without one (cached)."),
        fit_tokens: int = typer.Option(10_000, help="Positions for stage-1 fits."),
        max_tokens: int = typer.Option(128, "--max-tokens", "-m",
                                       help="Maximum number of tokens per answer."),
        temp: float = typer.Option(0.0, help="Sampling temperature (0: greedy)."),
        top_p: float = typer.Option(1.0, help="Sampling top-p (1: off)."),
        seed: Optional[int] = typer.Option(None, help="PRNG seed for sampling."),
        system: Optional[str] = typer.Option(None, "--system-prompt", "--system",
                                             help="System prompt."),
        keep_quantized: bool = typer.Option(
            False, help="Keep quantized models quantized on the CPU (default there: "
            "dequantized and cast to float32)."),
        cache_dir: Optional[Path] = typer.Option(
            None, help="Where fitted translators are kept (default $MLX_KVLINGO_CACHE "
            "or ~/.cache/mlx-kvlingo)."),
        recompute: Optional[float] = typer.Option(
            None, help="Share of the conversation (0.1 = 10%) the reading model recomputes "
            "itself among the positions it translated: those its new message attends to, "
            "and the words that look like facts. Default: the translator's (see "
            "`mlx-kvlingo defaults`)."),
        recompute_max: Optional[int] = typer.Option(
            None, help="The most positions one catch-up recomputes (0: no limit; default: "
            "the translator's)."),
    ):
        """Chat with two or more models, switching with /switch NAME: each model
        translates what the others wrote instead of re-reading it."""
        def go():
            sampler = make_sampler(temp, top_p, seed)
            session = build_session(model or [], translator or [], fit_missing, fit_tokens,
                                    cache_dir, system, log=typer.echo, recompute=recompute,
                                    recompute_max=recompute_max, keep_quantized=keep_quantized)
            start = first or session.model_names[0]
            if start not in session.model_names:
                raise KvlingoError(f"--first {start!r} is not one of {session.model_names}.")
            typer.echo(describe_session(session))
            chat_loop(session, start, max_tokens, sampler)

        _run(go)

    @app.command("convert-cache")
    def convert_cache(
        in_file: Optional[Path] = typer.Argument(
            None, metavar="IN", show_default=False,
            help="Prompt-cache file written by mlx-lm for SOURCE (or --prompt-cache-file)."),
        prompt_cache_file: Optional[Path] = typer.Option(
            None, help="Prompt-cache file written by mlx-lm for SOURCE, as IN."),
        translator: Path = typer.Option(..., help="Translator file SOURCE -> TARGET."),
        source: str = typer.Option(..., help="The model that wrote IN (path or hub id)."),
        target: str = typer.Option(..., help="The model to convert for; written into OUT's "
                                   "metadata: pass the same string to mlx_lm.generate --model."),
        out: Path = typer.Option(..., help="Prompt-cache file to write."),
        prompt: Optional[str] = typer.Option(
            None, "--prompt", "-p",
            help="The prompt given to mlx_lm.cache_prompt (needed when the translator "
            "computes its first tokens natively, the default; '-' reads from stdin)."),
        prompt_file: Optional[Path] = typer.Option(None, help="Read the prompt from a file."),
        dtype: str = typer.Option("auto", help="auto (the target's own dtype), float16, "
                                  "bfloat16 or float32."),
        keep_quantized: bool = typer.Option(
            False, help="Keep quantized models quantized on the CPU (default there: "
            "dequantized and cast to float32)."),
    ):
        """Turn an mlx-lm prompt-cache file made by SOURCE into one for TARGET, so
        `mlx_lm.generate --model TARGET --prompt-cache-file OUT` continues from it.
        Models with different tokenizers need a cross-tokenizer translator and the
        prompt: OUT then holds TARGET's own tokenization of it."""
        import mlx.core as mx

        from mlx_kvlingo.models.load import load
        from mlx_kvlingo.switching.prompt_cache import convert_prompt_cache_file, native_dtype
        from mlx_kvlingo.translator.maps import load_translator

        def go():
            if (in_file is None) == (prompt_cache_file is None):
                raise KvlingoError("Give the prompt-cache file once: IN or --prompt-cache-file.")
            text = read_prompt(prompt, prompt_file)
            if dtype not in ("auto", "float16", "bfloat16", "float32"):
                raise KvlingoError(f"--dtype must be auto, float16, bfloat16 or float32, not {dtype!r}.")
            t = load_translator(translator)
            if text is None and t.cross_tokenizer:
                raise KvlingoError(
                    "A cross-tokenizer translator re-tokenizes the cached prompt for the "
                    "target: give it with --prompt or --prompt-file.")
            if text is None and t.spec.native_prefix:
                raise KvlingoError(
                    f"The translator computes the first {t.spec.native_prefix} token(s) with "
                    "the target itself, which needs their ids; prompt-cache files do not store "
                    "token ids. Give the prompt you cached with --prompt or --prompt-file.")
            src, src_tok = load(source, keep_quantized=keep_quantized)
            tgt, tgt_tok = load(target, keep_quantized=keep_quantized)
            t.check_models(src, tgt, src_tok, tgt_tok)
            out_dtype = native_dtype(target) if dtype == "auto" else getattr(mx, dtype)
            r = convert_prompt_cache_file(in_file or prompt_cache_file, out, src, tgt, t, target, tgt_tok, text,
                                          out_dtype, source_tokenizer=src_tok)
            typer.echo(f"Converted {r.tokens} cached tokens ({r.translated} translated, "
                       f"{r.native} computed by the target) in {r.seconds:.2f}s; wrote {out} "
                       f"({r.dtype}) for {r.target_model}.")

        _run(go)

    bench = typer.Typer(help="Benchmarks.", no_args_is_help=True, add_completion=False)

    @bench.command("ttft")
    def bench_ttft(
        json_out: Path = typer.Option(..., "--json", help="Write the results here."),
        plot: Optional[Path] = typer.Option(
            None, help="PNG plot (default: beside the JSON, when matplotlib, the plot "
            "extra, is installed)."),
        pairs: str = typer.Option(
            "smollm2:smollm2,gemma3:smollm2,smollm2:gemma3",
            help="SOURCE:TARGET pairs (paths or the built-in smollm2, gemma3, fetched once)."),
        target: Optional[str] = typer.Option(
            None, help="One target model instead of --pairs."),
        source: Optional[str] = typer.Option(None, help="Its source (default: the target)."),
        translator: Optional[Path] = typer.Option(
            None, help="Translator file for the one pair (default: random maps; timing only)."),
        contexts: str = typer.Option("256,1024,4096", help="Context lengths (target tokens)."),
        native_tail: str = typer.Option(
            "0", "--native-tail", help="Native tails to time, e.g. 0,16,64."),
        repeats: int = typer.Option(3, help="Timed runs per context (medians reported)."),
        rounds: int = typer.Option(
            3, help="Switch and ceiling timings per run (they are cheap; the prefill is not)."),
        warmup: int = typer.Option(1, help="Untimed runs first."),
        quick: bool = typer.Option(False, help="Short run: contexts up to 256, 2 repeats."),
    ):
        """Time to first token after a switch vs a full re-prefill of the target, and
        the fraction of the ceiling (one decoding step + the maps) it reaches."""
        from mlx_kvlingo.measure.ttft import TTFTRow, format_rows, format_split, run_ttft_benchmark

        def counts(text, name, minimum):
            try:
                values = [int(x) for x in text.split(",") if x.strip()]
            except ValueError:
                values = []
            if not values or min(values) < minimum:
                raise KvlingoError(f"{name} expects numbers >= {minimum}, got {text!r}.")
            return values

        def go():
            lengths = counts(contexts, "--contexts", 2)
            tails = counts(native_tail, "--native-tail", 0)
            n, w = repeats, warmup
            if quick:
                lengths = [c for c in lengths if c <= 256] or lengths[:1]
                n, w = min(repeats, 2), min(warmup, 1)
            if n < 1:
                raise KvlingoError("--repeats must be at least 1.")
            if rounds < 1:
                raise KvlingoError("--rounds must be at least 1.")
            from mlx_kvlingo import plotting

            if plot is not None and not plotting.available():
                plotting.pyplot()  # the error naming the extra, before the long run
            png = plot or (json_out.with_suffix(".png") if plotting.available() else None)
            result = run_ttft_benchmark(target, source, translator, lengths, n, w,
                                        json_out=json_out, plot_out=png, log=typer.echo,
                                        pairs=pairs.split(","), native_tails=tails,
                                        rounds=1 if quick else rounds)
            fields = set(TTFTRow.__dataclass_fields__)
            rows = [TTFTRow(**{k: v for k, v in r.items() if k in fields}) for r in result["rows"]]
            typer.echo(format_rows(rows))
            typer.echo("\nSplit of a switch (one profiled run, ms):")
            typer.echo(format_split(rows))
            typer.echo(f"Wrote {json_out}" + (f" and {png}" if png else
                                                f" (no plot: {plotting.INSTALL_HINT})"))

        _run(go)

    app.add_typer(bench, name="bench")

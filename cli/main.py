"""The `mlx-kvlingo` command."""

import json
import platform
from pathlib import Path
from typing import List, Optional

import typer

import mlx_kvlingo  # noqa: F401  (first: loads fast BLAS before mlx.core)
from mlx_kvlingo.errors import KvlingoError
from mlx_kvlingo.models.load import load_pair
from mlx_kvlingo.train.recipe import fit_translator
from mlx_kvlingo_cli.common import fail
from mlx_kvlingo_cli.common import run as _run
from mlx_kvlingo_cli.common import show_progress
from mlx_kvlingo_cli.common import warn_if_slow_blas as _warn_if_slow_blas

app = typer.Typer(
    help="Translate KV caches between mlx-lm models, so a conversation can switch "
    "models without re-prefilling its context.",
    no_args_is_help=True,
    add_completion=False,
)


def _progressbar(total: int, label: str):
    return typer.progressbar(length=total, label=label)


# Options shared by the commands that generate, named and meant as in mlx_lm.generate.
MAX_TOKENS_HELP = "Maximum number of tokens to generate."
TEMP_HELP = "Sampling temperature (0: greedy)."
TOP_P_HELP = "Sampling top-p (1: off)."
SEED_HELP = "PRNG seed for sampling."
PROMPT_HELP = "The context / question ('-' reads from stdin)."
QUIET_HELP = "No progress bars (never drawn when stderr is not a terminal)."
KEEP_QUANTIZED_HELP = ("Keep a quantized model quantized on the CPU (default there: "
                       "dequantized and cast to float32, which runs faster there).")


CORPUS_HELP = ("'stdlib' (built in, offline), 'austen', 'fortunes' or 'jargon' (Debian's packages), "
               "a .txt/.jsonl "
               "file or directory, or hf:OWNER/NAME (a hub dataset); mix with + "
               "(stdlib*2+austen: docstrings weighed twice). Stage 2 only: "
               "chats:FILE.jsonl, chat samples made by `chat-data`.")


# ---------------------------------------------------------------------------
# inspect


@app.command()
def inspect(
    model: Optional[str] = typer.Argument(None, help="Also describe this model's cache."),
    gemm_size: int = typer.Option(1024, help="Matrix size for the GEMM measurement."),
    keep_quantized: bool = typer.Option(False, help="Describe MODEL as loaded quantized "
                                        "(see `switch --keep-quantized`)."),
    adapter_path: Optional[str] = typer.Option(None, help="LoRA adapters for MODEL (mlx-lm)."),
    revision: Optional[str] = typer.Option(None, help="Hub revision of MODEL."),
):
    """Report the device, the BLAS in use and a measured fp32 GEMM rate."""
    import mlx.core as mx

    from mlx_kvlingo import blas

    typer.echo(f"platform      {platform.system()} {platform.machine()}")
    typer.echo(f"mlx           {mx.__version__}, default device {mx.default_device()}")
    typer.echo(f"BLAS preload  {blas.preload_status}  ({blas.CHOICE_ENV}={blas.choice()})")
    libs = blas.blas_libraries()
    if libs:
        typer.echo("BLAS mapped   " + "\n              ".join(libs))
    mlx_rate, np_rate = blas.measure_gemm_gflops(gemm_size)
    typer.echo(
        f"fp32 GEMM     mlx {mlx_rate:.1f} GFLOP/s, numpy {np_rate:.1f} GFLOP/s "
        f"(mlx/numpy {mlx_rate / np_rate:.2f}) at {gemm_size}x{gemm_size}, best of 5"
    )
    if platform.system() == "Linux" and (
        blas.preload_failed() or mlx_rate < blas.SLOW_RATIO * np_rate
    ):
        typer.secho(
            f"warning: MLX's CPU matmuls are slow here. Fix: {blas.FIX}; then import "
            "mlx_kvlingo before mlx.core.",
            fg="yellow",
        )
    if model:
        _run(lambda: _describe_model(model, keep_quantized=keep_quantized,
                                     adapter_path=adapter_path, revision=revision))


def _describe_model(path: str, **options):
    from mlx_kvlingo.models.geometry import cache_geometry
    from mlx_kvlingo.models.load import load

    m, _ = load(path, **options)
    g = cache_geometry(m)
    typer.echo(f"\n{path}: {g.model_type}, {g.n_layers} layers, cache dtype {g.dtype}, "
               f"fingerprint {g.fingerprint()}")
    typer.echo(f"{'layer':>5} {'kv heads':>8} {'head_dim':>8} {'window':>7}  rope")
    for i, lg in enumerate(g.layers):
        typer.echo(f"{i:>5} {lg.n_kv_heads:>8} {lg.head_dim:>8} {str(lg.window or '-'):>7}  "
                   f"{lg.rope['class']} {json.dumps({k: v for k, v in lg.rope.items() if k != 'class'})}")


# ---------------------------------------------------------------------------
# fit


TOKEN_LAYERS_HELP = (
    "Target layers whose maps also read the target's own embeddings of each token and "
    "the token before it (cheap, exact; for a copy/induction key the previous token is "
    "what another tokenizer's features carry worst): 'full' (the target's "
    "full-attention layers; every layer of a model without sliding windows), 'all', or "
    "comma-separated layers. Needs --select-layers. Default: none."
)


SELECT_HELP = (
    "Choose each map's source layers from data: comma-separated candidate counts "
    "(e.g. 2,4,8); each map reads its best source layers by single-layer R², and the "
    "count with the lowest held-out KL is kept. Default: --sources-per-layer adjacent layers."
)


def _counts(text: Optional[str]) -> Optional[list]:
    if not text:
        return None
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise KvlingoError(f"--select-layers takes counts >= 1, got {text!r}.")
    return values


@app.command()
def fit(
    source: str = typer.Option(..., help="Source model: local path or hub id."),
    target: str = typer.Option(..., help="Target model: local path or hub id."),
    out: Path = typer.Option(..., help="Translator file to write (.safetensors)."),
    corpus: str = typer.Option("stdlib", help=CORPUS_HELP),
    tokens: int = typer.Option(200_000, help="Token positions to fit on."),
    context_len: int = typer.Option(256, help="Window length in tokens."),
    batch_size: int = typer.Option(8),
    ridge: float = typer.Option(1e-3, help="Ridge strength, relative to mean eigenvalue."),
    sources_per_layer: int = typer.Option(1, help="Source layers concatenated per map."),
    native_prefix: int = typer.Option(1, help="First tokens the target computes itself."),
    select_layers: Optional[str] = typer.Option(None, help=SELECT_HELP),
    token_layers: str = typer.Option("", help=TOKEN_LAYERS_HELP),
):
    """Stage 1: fit a translator in closed form and write it to OUT (under
    `mlx.launch -n N`, on N processes)."""
    from mlx_kvlingo.train import distributed

    def go():
        group = distributed.group()
        if group is not None:
            _quiet_unless_writer(group)
        _warn_if_slow_blas()
        src, src_tok, tgt, tgt_tok = load_pair(source, target, log=typer.echo)
        translator, report = fit_translator(
            src, src_tok, tgt, tgt_tok, corpus, tokens, context_len, batch_size, ridge,
            sources_per_layer, native_prefix, _counts(select_layers), group=group,
            token_layers=token_layers, progress=_progressbar, log=typer.echo,
        )
        if distributed.is_writer(group):
            translator.save(out)
        r = report.to_dict()
        typer.echo(
            f"Fitted on {r['tokens']} positions in {r['seconds']:.1f}s: mean R² keys "
            f"{r['mean_r2_keys']:.3f}, values {r['mean_r2_values']:.3f}. Wrote {out}"
        )

    _run(go)


@app.command()
def compress(
    source: str = typer.Option(..., help="Source model (short name, path or hub id): "
                               "calibration features come from it."),
    target: str = typer.Option(..., help="Target model's name (only to find a shipped "
                               "translator; not loaded)."),
    out: Path = typer.Option(..., help="Compressed translator file to write."),
    translator: Optional[Path] = typer.Option(None, help="Translator file to compress "
                                              "(default: the one shipped for the pair)."),
    key_rank: int = typer.Option(384, help="Width of the shared projection of keys."),
    value_rank: int = typer.Option(768, help="Width of the shared projection of values."),
    corpus: str = typer.Option("stdlib", help=CORPUS_HELP),
    tokens: int = typer.Option(8192, help="Calibration positions (the corpus's training "
                               "part)."),
    bits: Optional[int] = typer.Option(None, help="Save quantized to 8 or 4 bits."),
    fold_tokens: bool = typer.Option(False, help="Fold the token maps into the projection "
                                     "(loads the target too)."),
    keep_quantized: bool = typer.Option(False, help=KEEP_QUANTIZED_HELP),
):
    """Compress a translator: every map reads one shared low-rank projection of the
    source layers instead of its own concatenation of them (a cheaper switch). A
    compressed translator is compressed again to the ranks given."""
    from mlx_kvlingo.models.geometry import cache_geometry
    from mlx_kvlingo.models.load import load
    from mlx_kvlingo.pairs.shipped import translator_for
    from mlx_kvlingo.translator.compress import compress_on_corpus

    def go():
        _warn_if_slow_blas()
        if bits not in (None, 4, 8):
            fail(f"--bits takes 8 or 4, not {bits}.")
        t = translator_for(source, target, translator)
        src, src_tok = load(source, keep_quantized=keep_quantized)
        if cache_geometry(src) != t.spec.source.cache_geometry:
            fail(f"{source} is not the source model this translator was made for "
                 f"({t.spec.source.name}).")
        # A compressed file is compressed again as it was made (token maps folded or not).
        fold = fold_tokens or bool(t.spec.shared_tokens)
        tgt, tgt_tok = load(target, keep_quantized=keep_quantized) if fold else (None, None)
        small, r = compress_on_corpus(src, src_tok, t, key_rank, value_rank, corpus, tokens,
                                      target=tgt, target_tokenizer=tgt_tok)
        small.save(out, bits=bits)
        mean = [sum(e) / len(e) for e in (r.key_error, r.value_error)]
        typer.echo(
            f"Ranks {r.key_rank} (keys) / {r.value_rank} (values), calibrated on {r.tokens} "
            f"positions: maps' relative error {mean[0]:.4f} / {mean[1]:.4f} (mean), "
            f"{max(r.key_error + r.value_error):.4f} (worst layer); multiply-adds per "
            f"token {r.macs_before / 1e6:.1f} M -> {r.macs_after / 1e6:.1f} M. Wrote {out}")

    _run(go)


# ---------------------------------------------------------------------------
# train and eval


def _int_list(text: str) -> list:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 2:
        raise KvlingoError(f"Expected comma-separated lengths >= 2, got {text!r}.")
    return values


def parse_duration(text: str) -> float:
    """Seconds from '1h', '45m', '90s', '1h30m' or a plain number of seconds."""
    import re

    parts = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*"
                         r"(?:(\d+(?:\.\d+)?)s?)?\s*", text)
    if not parts or not any(parts.groups()):
        raise KvlingoError(f"--budget takes a duration like 1h, 45m or 3600, not {text!r}.")
    h, m, sec = (float(g) if g else 0.0 for g in parts.groups())
    return h * 3600 + m * 60 + sec


def _print_progress(record: dict):
    if "message" in record:
        typer.echo(f"  {record['message']}")
    elif "eval" in record:
        e = record["eval"]
        typer.echo(
            f"  eval @ step {record['step']}: KL {e['kl']:.4f} (no context {e['kl_none']:.4f}), "
            f"top-1 {e['top1']:.1%}, CBR {e['cbr']:.1%}"
            + ("" if e["cbr_meaningful"] else " (context benefit small: CBR noisy)")
        )
    elif record["step"] % 10 == 0 or not record["applied"]:
        skipped = "" if record["applied"] else "  SKIPPED (non-finite loss)"
        typer.echo(
            f"  step {record['step']}: loss {record['loss']:.4f}, lr {record['lr']:.2e}, "
            f"{record['tokens_per_s']:.0f} tok/s{skipped}"
        )


class TrainProgress:
    """Stage 2's progress: on a terminal, a bar on stderr (step / total, ETA, loss,
    tokens/s) with evaluations and messages printed above it; otherwise (or with
    --quiet) the plain lines of :func:`_print_progress`."""

    def __init__(self, show: bool):
        self.show, self.bar = show, None

    def __call__(self, record: dict):
        from mlx_kvlingo.progress import around_bars, bar

        if not self.show:
            return _print_progress(record)
        if "loss" in record and "total" in record:
            if self.bar is None:
                self.bar = bar(total=record["total"], initial=record["step"] - 1,
                               desc="stage 2", progress=True, unit="step")
            self.bar.update(record["step"] - self.bar.n)
            self.bar.set_postfix(loss=f"{record['loss']:.4f}",
                                 tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
            if record["applied"]:
                return
        around_bars(_print_progress)(record)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _quiet_unless_writer(group):
    """Only rank 0 prints progress under mlx.launch (errors still reach stderr)."""
    import contextlib
    import os

    from mlx_kvlingo.train import distributed

    if not distributed.is_writer(group):
        contextlib.redirect_stdout(open(os.devnull, "w")).__enter__()


@app.command()
def train(
    source: str = typer.Option(..., help="Source model: local path or hub id."),
    target: str = typer.Option(..., help="Target model: local path or hub id."),
    out: Path = typer.Option(..., help="Translator file to write; logs and checkpoints go beside it."),
    stage: str = typer.Option("both", help="1 (closed form), 2 (distillation) or both."),
    init: Optional[Path] = typer.Option(None, help="Stage 2 only: translator to start from (default OUT)."),
    corpus: str = typer.Option("stdlib", help=CORPUS_HELP),
    fit_tokens: int = typer.Option(200_000, help="Stage 1: token positions to fit on."),
    ridge: float = typer.Option(1e-3),
    sources_per_layer: int = typer.Option(1),
    select_layers: Optional[str] = typer.Option(None, help=SELECT_HELP),
    token_layers: str = typer.Option("", help=TOKEN_LAYERS_HELP),
    native_prefix: int = typer.Option(1, help="First tokens the target computes itself (0 = off)."),
    steps: int = typer.Option(500, help="Stage 2: optimizer steps."),
    lr: float = typer.Option(1e-4, help="Stage 2: peak learning rate (AdamW)."),
    warmup: float = typer.Option(0.05, help="Fraction of steps of linear warmup."),
    batch_size: int = typer.Option(4, help="Sequences per micro-batch."),
    accumulate: int = typer.Option(2, help="Micro-batches per optimizer step."),
    rank: int = typer.Option(0, help="0: train the full maps; >0: frozen maps + low-rank correction."),
    layer_ranks: str = typer.Option(
        "", help="With --rank > 0: target layers whose correction has a rank of its own, "
        "LAYER:RANK pairs (5:64,11:64,17:64; benchmarks/cache_oracle.py finds the layers "
        "that hold the loss)."),
    context_lengths: str = typer.Option("128,256", help="Context-length buckets, comma-separated."),
    continuation_len: int = typer.Option(64),
    eval_every: int = typer.Option(50, help="Stage 2: steps between held-out evaluations "
                                   "(0: none)."),
    keep_best: bool = typer.Option(
        False, "--keep-best", help="Stage 2, with --eval-every: end with the evaluated "
        "translator of lowest held-out KL (the start included), not the last step's; each "
        "new best is written to OUT.best.safetensors as the run goes."),
    checkpoint_every: int = typer.Option(
        50, help="Steps between checkpoints (0: only at the end and when stopped)."),
    seed: int = typer.Option(0),
    store_pool: int = typer.Option(
        0, help="Stage 2: cache the frozen source/teacher passes of this many steps on "
        "disk (OUT.store/) and train epochs over them; 0 = fresh samples every step."),
    teacher_topk: int = typer.Option(
        0, help="Stage 2: keep the teacher's top-k log-probs + one tail bucket (exact KL "
        "over k+1 categories); 0 = full vocabulary."),
    native_tail: int = typer.Option(
        0, help="Stage 2: half the micro-batches have their last N context tokens "
        "computed by the target itself, as a switch with --native-tail does."),
    lr_scale: str = typer.Option(
        "none", help="'rms': scale each map's step by its RMS (lr becomes relative)."),
    token_maps: str = typer.Option(
        "train", help="Stage 2, with --token-layers: 'train' the token maps from their "
        "stage-1 fit, or keep them 'frozen' at it (better with token maps on many layers)."),
    budget: Optional[str] = typer.Option(
        None, help="Whole-run time budget (e.g. 1h, 45m, 3600): stage 2's step count is "
        "chosen, after stage 1 and a timed probe step, so the run ends within it "
        "(--steps is then ignored)."),
    native_layer0: Optional[bool] = typer.Option(
        None, "--native-layer0/--no-native-layer0",
        help="The target computes layer 0 itself (exact) instead of translating it; "
        "stage 2 then trains the other layers around it, and the file records it "
        "(default: off for a new translator, as recorded for --init)."),
    resume: bool = typer.Option(False, help="Continue an interrupted stage-2 run."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help=QUIET_HELP),
    peer_timeout: float = typer.Option(
        1800, help="Under mlx.launch: seconds a stage-2 step may take before a process "
        "gives up on the others (a vanished machine closes no socket; the first step gets "
        "4x); 0 = wait for ever."),
):
    """Train a translator: stage 1 (closed form) then stage 2 (distillation).

    Under `mlx.launch -n N` it trains data-parallel on N processes (README,
    "Training on several machines"); rank 0 prints and writes every file."""
    from mlx_kvlingo.train import distributed
    from mlx_kvlingo.train.distill import DistillConfig
    from mlx_kvlingo.train.pipeline import TrainOptions, train_translator

    def go():
        group = distributed.group()
        if group is not None:
            _quiet_unless_writer(group)
        _warn_if_slow_blas()
        options = TrainOptions(
            source=source, target=target, out=out, stage=stage, init=init, corpus=corpus,
            fit_tokens=fit_tokens, ridge=ridge, sources_per_layer=sources_per_layer,
            select_layers=_counts(select_layers), token_layers=token_layers,
            native_prefix=native_prefix, native_layer0=native_layer0,
            distill=DistillConfig(steps=steps, lr=lr, warmup=warmup, batch_size=batch_size,
                                  accumulate=accumulate, rank=rank, layer_ranks=layer_ranks,
                                  seed=seed, lr_scale=lr_scale, native_tail=native_tail,
                                  teacher_topk=teacher_topk, token_maps=token_maps),
            context_lengths=_int_list(context_lengths), continuation_len=continuation_len,
            eval_every=eval_every, keep_best=keep_best, checkpoint_every=checkpoint_every,
            store_pool=store_pool,
            budget_s=parse_duration(budget) if budget else None, resume=resume,
            peer_timeout=peer_timeout)
        progress = TrainProgress(show_progress(quiet) and distributed.is_writer(group))
        try:
            summary = train_translator(options, log=typer.echo, progress=progress,
                                       fit_progress=_progressbar)
        finally:
            progress.close()
        if "steps" not in summary:  # stage 1 alone
            return
        if summary["stopped"]:
            typer.echo(f"Stopped at step {summary['steps']}; checkpoint written. "
                       "Run the same command with --resume to continue.")
            raise typer.Exit(130)
        from mlx_kvlingo import plotting

        beside = ("log and plot beside it" if plotting.available() else
                  f"the log beside it (no plot: {plotting.INSTALL_HINT})")
        typer.echo(f"Done: {summary['steps']} steps in {summary['seconds']:.0f}s "
                   f"({summary['skipped']} skipped). Wrote {out}, {beside}.")
        best = summary.get("best_eval")
        if keep_best and best is not None:
            typer.echo(f"Kept the translator of step {best['step']}: the lowest held-out KL "
                       f"evaluated ({best['eval']['kl']:.4f}).")

    _run(go)


@app.command("chat-data")
def chat_data(
    source: str = typer.Option(..., help="Model the chats start with: it answers the paste."),
    target: str = typer.Option(..., help="Model the chats switch to: its answers to the "
                               "questions are what stage 2 distils on."),
    out: Path = typer.Option(..., help="JSON-lines file to write (appended to: a rerun "
                             "goes on where it stopped)."),
    count: int = typer.Option(64, help="Chats."),
    lengths: str = typer.Option("500,1000", help="Pasted code, in tokens (in turn)."),
    first_answer_tokens: int = typer.Option(32, help="Tokens of the source's answer."),
    max_tokens: int = typer.Option(48, help="Tokens of the target's answer."),
    seed: int = typer.Option(0),
):
    """Make stage-2 samples from coding chats: the standard library's own sources
    pasted into a user turn, the source's answer, a question about the paste and the
    target's answer, weighted toward what needs the paste. Train on them with
    `train --stage 2 --corpus chats:OUT`. Both models must share a tokenizer."""
    from mlx_kvlingo.data.code_chats import code_chats
    from mlx_kvlingo.models.geometry import tokenizer_fingerprint
    from mlx_kvlingo.train.chat_samples import build_chat_samples

    def go():
        _warn_if_slow_blas()
        src, src_tok, tgt, tgt_tok = load_pair(source, target, log=typer.echo)
        if tokenizer_fingerprint(src_tok) != tokenizer_fingerprint(tgt_tok):
            raise KvlingoError("chat-data needs two models with one tokenizer.")
        chats = code_chats(count, lambda text: len(tgt_tok.encode(text)),
                           _int_list(lengths), seed)
        n = build_chat_samples(src, src_tok, tgt, chats, out, first_answer_tokens,
                               max_tokens, log=typer.echo)
        typer.echo(f"{n} chat samples in {out}.")

    _run(go)


@app.command("eval")
def eval_cmd(
    source: str = typer.Option(..., help="Source model."),
    target: str = typer.Option(..., help="Target model."),
    translator: Optional[List[Path]] = typer.Option(
        None, help="Translator file; repeat to compare several on the same samples (--task "
        "recall: one; default the shipped one)."
    ),
    task: str = typer.Option(
        "cbr", help="'cbr': context benefit retained on held-out text; 'recall': a fact "
        "deep in held-out text asked for at the end, after a switch, a re-prefill, the "
        "equal-time truncation and no context."),
    corpus: str = typer.Option("stdlib", help=CORPUS_HELP + " Its held-out split is used."),
    context_lengths: str = typer.Option("128,256", help="Comma-separated context lengths."),
    continuation_len: int = typer.Option(64),
    windows: int = typer.Option(32, help="Held-out windows per context length."),
    native_tail: str = typer.Option(
        "0", help="Comma-separated numbers of last context tokens the target computes "
        "itself on top of the translated cache (each is scored on the same windows)."),
    native_layer0: str = typer.Option(
        "file", help="Layer 0 computed by the target itself instead of translated: "
        "'on', 'off', 'off,on' (both, scored on the same windows) or 'file' (as the "
        "translator file records)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
    tokens: int = typer.Option(550, help="--task recall: context length in target tokens."),
    items: int = typer.Option(48, help="--task recall: items (facts asked for)."),
    recompute: str = typer.Option(
        "", help="--task recall: comma-separated budgets (0.1 = 10% of the context) of "
        "switches that recompute positions (chosen by the translator's own way)."),
    recompute_max: int = typer.Option(
        0, help="--task recall: the most positions each budget may come to (0: no limit)."),
    kinds: str = typer.Option(
        "facts", help="--task recall: comma-separated kinds of fact or groups of them: "
        "'facts' (number,name,identifier,list: facts that look like facts), 'plain' "
        "(place,relation,yesno,combined,definition,code: facts in ordinary words), 'all'."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help=QUIET_HELP),
):
    """Measure translators on held-out text: NLLs, CBR (with a bootstrap 95% interval
    over windows), KL, top-1 per context length; or (--task recall) long-range recall
    with exact match, answer NLL and time to first token."""
    if task == "recall":
        return _recall(source, target, translator, tokens, items, recompute, json_out,
                       recompute_max, kinds, quiet)
    if task != "cbr":
        fail(f"--task is cbr or recall, not {task!r}.")
    if not translator:
        fail("Give --translator (--task cbr).")
    from mlx_kvlingo.measure.evaluate import format_table
    from mlx_kvlingo.train.heldout import evaluate_files, write_report

    def go():
        _warn_if_slow_blas()
        try:
            tails = [int(x) for x in native_tail.split(",") if x.strip()]
        except ValueError:
            raise KvlingoError(f"--native-tail takes numbers >= 0, got {native_tail!r}.")
        scored = evaluate_files(source, target, translator, corpus, _int_list(context_lengths),
                                continuation_len, windows, tails, native_layer0, log=typer.echo,
                                progress=show_progress(quiet))
        for s in scored:
            typer.echo(f"\n{s.title()}:")
            typer.echo(format_table(s.rows))
        if json_out:
            write_report(json_out, scored, source=source, target=target, corpus=corpus,
                         continuation_len=continuation_len, windows=windows)
            typer.echo(f"Wrote {json_out}")

    _run(go)


def _recall(source, target, translator, tokens, items, recompute, json_out, recompute_max=0,
            kinds="facts", quiet=False):
    from mlx_kvlingo.data.recall import expand_kinds
    from mlx_kvlingo.measure.recall import format_kinds, format_table, run_recall
    from mlx_kvlingo.pairs.shipped import translator_for

    def go():
        _warn_if_slow_blas()
        if translator and len(translator) > 1:
            raise KvlingoError("--task recall scores one translator.")
        try:
            budgets = [float(b) for b in recompute.split(",") if b.strip()]
        except ValueError:
            raise KvlingoError(f"--recompute takes fractions such as 0.1, got {recompute!r}.")
        chosen = expand_kinds(kinds)
        t = translator_for(source, target, translator[0] if translator else None)
        # Scored items go next to the report as they finish: a rerun resumes.
        checkpoint = json_out.with_suffix(".items.jsonl") if json_out else None
        result = run_recall(source, target, t, tokens, items, recompute=budgets, log=typer.echo,
                            checkpoint=checkpoint, recompute_max=recompute_max,
                            kinds=chosen, progress=show_progress(quiet))
        typer.echo(format_table(result))
        typer.echo("\n" + format_kinds(result))
        if json_out:
            json_out.write_text(json.dumps(result.to_dict(), indent=2))
            typer.echo(f"Wrote {json_out}")

    _run(go)


# ---------------------------------------------------------------------------
# switch


def switch_printer(echo=None):
    """``on_text(kind, segment)`` for :func:`run_switch`: prints each answer's
    segments as they are generated, under a header when the answer starts."""
    from mlx_kvlingo_cli.common import echo_stream

    write = echo or echo_stream()
    headers = {"switch": "--- target after switch ---\n",
               "prefill": "--- target after re-prefill ---\n"}
    seen = []

    def on_text(kind, segment):
        if kind not in seen:
            write(("\n" if seen else "") + headers[kind])
            seen.append(kind)
        write(segment)

    def start(kind):  # an answer's header even when it is empty
        if kind not in seen:
            on_text(kind, "")

    on_text.start = start
    on_text.seen = seen
    return on_text


def _warm_sampler(sampler, model):
    """Run mlx-lm's (compiled) sampler once on logits of the model's vocabulary, so
    its compilation is not timed as part of the first token."""
    import mlx.core as mx

    vocab = model(mx.array([[0]])).shape[-1]
    mx.eval(sampler(mx.zeros((1, vocab))))


@app.command("switch")
def switch_cmd(
    source: str = typer.Option(..., help="Model that reads the context."),
    target: str = typer.Option(..., help="Model that answers."),
    translator: Optional[Path] = typer.Option(
        None, help="Translator file for source -> target (default: the shipped one, for "
        "--source smollm2 --target gemma3 and back)."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help=PROMPT_HELP),
    prompt_file: Optional[Path] = typer.Option(None, help="Read the prompt from a file."),
    max_tokens: int = typer.Option(64, "--max-tokens", "-m", help=MAX_TOKENS_HELP),
    temp: float = typer.Option(0.0, help=TEMP_HELP),
    top_p: float = typer.Option(1.0, help=TOP_P_HELP),
    seed: Optional[int] = typer.Option(None, help=SEED_HELP),
    raw: bool = typer.Option(False, "--ignore-chat-template", "--raw",
                             help="Use the raw prompt without the tokenizer's chat template."),
    compare: bool = typer.Option(False, help="Also re-prefill the target and compare."),
    gate: bool = typer.Option(False, help="Quality gate: the target scores the context's "
                              "last tokens on the translated cache and re-prefills when the "
                              "translation is predicted bad."),
    gate_threshold: Optional[float] = typer.Option(
        None, help="Gate threshold (nats/token over the no-context NLL; default: the "
        "translator's recorded one, else 0)."),
    recompute: Optional[float] = typer.Option(
        None, help="Share of the context (0.1 = 10%) the target recomputes itself after the "
        "translation: the positions the prompt's last tokens attend to, and the words that "
        "look like facts (numbers, names, identifiers). Default: the translator's (see "
        "`mlx-kvlingo defaults`), which for a prompt that just goes on may be its long native "
        "tail instead; given, it is used as given."),
    recompute_max: Optional[int] = typer.Option(
        None, help="The most positions the recompute may come to (0: no limit; default: "
        "the translator's)."),
    fact_gate: Optional[float] = typer.Option(
        None, help="Fact probe threshold (nats): the target is asked to continue the "
        "context's most fact-like words on the switched cache, and re-prefills when their "
        "mean NLL is above this (the translation lost them)."),
    keep_quantized: bool = typer.Option(False, help=KEEP_QUANTIZED_HELP),
):
    """The source reads the prompt, its cache is translated, the target answers;
    the answer is printed as it is generated."""

    from mlx_kvlingo.switching.gate import QualityGate, SwitchJudge
    from mlx_kvlingo.pairs.shipped import translator_for
    from mlx_kvlingo.switching.pipeline import prompt_context, run_switch
    from mlx_kvlingo_cli.common import make_sampler, read_prompt

    def go():
        _warn_if_slow_blas()
        if (prompt is None) == (prompt_file is None):
            raise KvlingoError("Give exactly one of --prompt and --prompt-file.")
        text = read_prompt(prompt, prompt_file)
        sampler = make_sampler(temp, top_p, seed)
        t = translator_for(source, target, translator)
        src, src_tok, tgt, tgt_tok = load_pair(source, target, log=typer.echo,
                                               keep_quantized=keep_quantized)
        t.check_models(src, tgt, src_tok, tgt_tok)
        if t.cross_tokenizer and not raw:
            typer.echo("(cross-tokenizer pair: the prompt is used as plain text, "
                       "without a chat template)")
        context = prompt_context(src_tok, text, t.cross_tokenizer, chat_template=not raw)
        judge = None
        if gate or fact_gate is not None:
            judge = SwitchJudge(tgt, tgt_tok, t, QualityGate(threshold=gate_threshold)
                                if gate else None, fact_gate)
        if sampler is not None:
            _warm_sampler(sampler, tgt)
        printer = switch_printer()
        # The switched cache is built here; the answers stream through the printer.
        r = run_switch(src, src_tok, tgt, tgt_tok, t, context, max_tokens, compare,
                       judge=judge, recompute=recompute, recompute_max=recompute_max,
                       sampler=sampler, on_text=printer)
        printer.start("switch")
        if compare:
            printer.start("prefill")
        typer.echo()
        if "fact_gate" in r:
            f = r["fact_gate"]
            nll = "none" if f["probe_nll"] is None else f"{f['probe_nll']:.3f} nats"
            typer.echo(f"--- fact probe: {nll} on {f['words']} (threshold {f['threshold']}): "
                       f"{f['action']}")
        if "gate" in r:
            g = r["gate"]
            typer.echo(f"--- gate: score {g['score']:+.3f} nats (threshold {g['threshold']:+.3f}) "
                       f"on {g['tokens']} tokens: " + (g["reason"] and "re-prefilled: "
                       + g["reason"] or "translation kept"))
        typer.echo(f"--- time to first token after switch: {r['switch_ttft_s'] * 1e3:.1f} ms "
                   f"(translate {r['translate_s'] * 1e3:.1f} ms; {r['context_tokens']} "
                   "context tokens)")
        if compare:
            typer.echo(f"--- time to first token after re-prefill: {r['prefill_ttft_s'] * 1e3:.1f} ms; "
                       f"switch is {r['ratio']:.1f}x faster; answers agree on the first "
                       f"{r['agreeing_prefix']} of {len(r['switch_tokens'])} tokens")

    _run(go)


@app.command()
def defaults(
    translator: Path = typer.Argument(..., help="Translator file."),
    native_tail: Optional[int] = typer.Option(
        None, help="Last context tokens the target computes itself at a switch."),
    recompute: Optional[float] = typer.Option(
        None, help="Share of the context (0.1 = 10%) the target recomputes itself at a "
        "switch (0: none)."),
    recompute_max: Optional[int] = typer.Option(
        None, help="The most positions that share may come to (0: no limit)."),
    recompute_reserve: Optional[int] = typer.Option(
        None, help="Positions the share leaves out (the switch's fixed cost): it recomputes "
        "the share of the context less these."),
    select: Optional[str] = typer.Option(
        None, help="How the recomputed positions are chosen: 'question' (those the next "
        "question attends to, with the fact-like words), 'question-words' (the same, each "
        "widened to its whole word), 'source' (as 'question', read by the source on its own "
        "cache) or 'lexical' (the fact-like words only)."),
    long_tail: Optional[int] = typer.Option(
        None, help="A one-shot switch whose next token reaches little beyond its last N "
        "context tokens (text that goes on, not a question about a distant fact) has the "
        "target compute those N itself and recomputes nothing (0: never; needs --select "
        "source)."),
    long_tail_reach: Optional[float] = typer.Option(
        None, help="How little: the most KL (nats) between the source's next token reading "
        "only the last --long-tail tokens and reading everything."),
    break_even: Optional[int] = typer.Option(
        None, help="Catch-ups (a chat's, the server's) that would translate fewer positions "
        "prefill instead: the break-even `mlx-kvlingo break-even` measured on the machine the "
        "defaults are set for (a machine's own measurement replaces it; 0: none)."),
    out: Optional[Path] = typer.Option(
        None, help="Write the file with the new defaults here (default: in place)."),
):
    """Show a translator file's switch defaults, or set them (the maps are kept byte
    for byte): what a switch, a chat or a server does when not told otherwise."""
    from dataclasses import replace

    from mlx_kvlingo.switching.choice import SELECTIONS, RecomputeBudget
    from mlx_kvlingo.translator.maps import load_translator, rewrite_spec

    def go():
        loaded = load_translator(translator)
        spec = loaded.spec
        changes = {k: v for k, v in [("native_tail", native_tail), ("recompute", recompute),
                                     ("recompute_max", recompute_max),
                                     ("recompute_reserve", recompute_reserve),
                                     ("recompute_select", select),
                                     ("long_tail", long_tail),
                                     ("long_tail_reach", long_tail_reach),
                                     ("break_even", break_even)] if v is not None}
        if changes:
            if select is not None and select not in SELECTIONS:
                raise KvlingoError(f"--select is one of {', '.join(SELECTIONS)}, not "
                                   f"{select!r}.")
            if native_tail is not None and native_tail < 0:
                raise KvlingoError(f"--native-tail is a count >= 0, not {native_tail}.")
            if recompute_reserve is not None and recompute_reserve < 0:
                raise KvlingoError(f"--recompute-reserve is a count >= 0, not "
                                   f"{recompute_reserve}.")
            if break_even is not None and break_even < 0:
                raise KvlingoError(f"--break-even is a count >= 0, not {break_even}.")
            if long_tail is not None and long_tail < 0:
                raise KvlingoError(f"--long-tail is a count >= 0, not {long_tail}.")
            if long_tail_reach is not None and not long_tail_reach >= 0:
                raise KvlingoError(f"--long-tail-reach is in nats, >= 0, not {long_tail_reach}.")
            budget = RecomputeBudget.of(loaded, recompute, recompute_max)
            spec = replace(spec, **changes)
            spec.recompute = budget.share
            spec.recompute_max = budget.most if budget.share else 0
            spec.recompute_reserve = spec.recompute_reserve if budget.share else 0
            if spec.long_tail and spec.recompute_select != "source":
                raise KvlingoError("A long tail is chosen by the source's reading: set "
                                   "--select source with it.")
            if not spec.long_tail:
                spec.long_tail_reach = 0.0
            rewrite_spec(translator, out or translator, spec)
            load_translator(out or translator)  # what was written reads back
            typer.echo(f"Wrote {out or translator}")
        cap = f", at most {spec.recompute_max} positions" if spec.recompute_max else ""
        less = (f" less {spec.recompute_reserve} positions" if spec.recompute
                and spec.recompute_reserve else "")
        way = f", chosen by {spec.recompute_select}" if spec.recompute else ""
        gate = (f"; catch-ups under {spec.break_even} positions prefill" if spec.break_even
                else "")
        long = (f"; a long tail of {spec.long_tail} without the recompute where the next token "
                f"reaches at most {spec.long_tail_reach:g} nats beyond it" if spec.long_tail
                else "")
        typer.echo(f"native tail {spec.native_tail}; recompute {spec.recompute:.0%}{less}{cap}"
                   f"{way}{long}{gate}")

    _run(go)


@app.command("break-even")
def break_even_cmd(
    source: str = typer.Option(..., help="Model whose cache is translated."),
    target: str = typer.Option(..., help="Model that reads it."),
    translator: Optional[Path] = typer.Option(
        None, help="Translator file for source -> target (default: the shipped one)."),
    repeats: int = typer.Option(2, help="Timings per length (the median is kept)."),
    store: bool = typer.Option(
        True, help="Keep the result for this machine and pair (break-even.json in the cache "
        "directory), where a Session and `serve` read it."),
    keep_quantized: bool = typer.Option(False, help=KEEP_QUANTIZED_HELP),
):
    """Measure, on this machine, the shortest span a switch is worth it for: below it a
    conversation's catch-up (and `serve`) prefills instead of translating."""
    from mlx_kvlingo.data.corpus import stdlib_documents
    from mlx_kvlingo.pairs.shipped import translator_for
    from mlx_kvlingo.switching.break_even import (LENGTHS, QUESTION, measure_break_even,
                                                  store_break_even)

    def go():
        _warn_if_slow_blas()
        t = translator_for(source, target, translator)
        src, src_tok, tgt, tgt_tok = load_pair(source, target, log=typer.echo,
                                               keep_quantized=keep_quantized)
        t.check_models(src, tgt, src_tok, tgt_tok)
        text = "\n\n".join(doc for _, doc in stdlib_documents()[:60])
        need = max(LENGTHS) + QUESTION
        source_ids, target_ids = src_tok.encode(text)[:need], tgt_tok.encode(text)[:need]
        typer.echo(f"{'positions':>9} {'switch ms':>10} {'prefill ms':>11}")

        def show(n, switch_s, prefill_s):
            typer.echo(f"{n:>9} {switch_s * 1e3:>10.0f} {prefill_s * 1e3:>11.0f}"
                       + ("  switch wins" if switch_s < prefill_s else ""))

        found = measure_break_even(src, tgt, t, source_ids, target_ids, repeats=repeats,
                                   progress=show)
        typer.echo(f"break-even: {found.tokens} positions ({found.machine})")
        if store:
            typer.echo(f"Kept in {store_break_even(found, t, tgt)}")

    _run(go)


@app.command()
def push(
    translator: Path = typer.Argument(..., help="Translator file to upload."),
    repo_id: str = typer.Argument(..., help="Hub repo id, OWNER/NAME."),
    eval_json: Optional[Path] = typer.Option(None, help="An `eval --json` report for the card."),
    private: bool = typer.Option(False),
):
    """Upload a translator to the Hugging Face hub with a generated model card."""
    from mlx_kvlingo.translator.publish import push as push_translator

    def go():
        fidelity = json.loads(eval_json.read_text())["results"] if eval_json else None
        url = push_translator(translator, repo_id, fidelity=fidelity, private=private)
        typer.echo(f"Uploaded {translator} to {repo_id}: {url}")

    _run(go)


from mlx_kvlingo_cli.demo_cmd import register as _register_demo  # noqa: E402

_register_demo(app)

from mlx_kvlingo_cli.fetch_cmd import register as _register_fetch  # noqa: E402

_register_fetch(app)

from mlx_kvlingo_cli.session_cmds import register as _register_session  # noqa: E402

_register_session(app)

from mlx_kvlingo_cli.serve_cmd import register as _register_serve  # noqa: E402

_register_serve(app)

if __name__ == "__main__":
    app()

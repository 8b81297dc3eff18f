"""Time to first token after a switch, against a full re-prefill, and against the
ceiling the method allows.

- re-prefill: the target reads the context's first T - 1 tokens in one pass (its
  body; mlx-lm's generate_step does the same), then one bare decoding step on the
  last token (``decode_step_s``);
- switch: the source already holds the context in its cache (it read it during
  its turn, so that is not timed); its cache is translated (``translate_s``; for
  a pair with different tokenizers this includes tokenizing and aligning the
  text), then the target's first step over the pending tokens
  (``first_step_s``, :func:`mlx_kvlingo.switching.generate.first_step`);
- ceiling: a switch cannot beat one decoding step plus the maps' matmuls, so
  ``ceiling_s`` = the bare decoding step of the re-prefill above (on the target's
  own cache of T - 1 tokens) + the translator's map matmuls alone over the
  positions the target's cache holds (``maps_s``, inputs ready in memory). The
  three are timed in the same run, interleaved, so the machine's drift affects
  them alike: ``fraction`` = ratio / ceiling_ratio = ceiling_s / switch_s.

Only timing is measured here: a translator with random maps times exactly like a
trained one of the same shape, and a model can be its own source.
"""

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .. import blas
from ..data.corpus import split_documents, stdlib_documents, token_stream
from ..errors import KvlingoError
from ..models.cache import copy_cache, prefill
from ..models.geometry import cache_geometry, max_positions, tokenizer_fingerprint
from ..models.load import load
from ..models.pretrained import PRETRAINED, fetch
from ..switching.api import SwitchResult, resolve_native_tail, switch, switch_aligned, switch_text
from ..switching.generate import first_step
from ..translator.align import align_text, identity_alignment, tokenize_with_offsets
from ..translator.maps import Translator, load_translator

DEFAULT_CONTEXTS = (256, 1024, 4096)


@dataclass
class TTFTRow:
    context: int  # target tokens in the context
    prefill_s: float  # re-prefill: body over T - 1 tokens + bare decoding step (median)
    switch_s: float  # translate_s + first_step_s (median of the sums)
    ratio: float  # achieved: prefill_s / switch_s
    translate_s: float
    decode_s: float  # the switch's first step (native tail + last token)
    translate_peak_mb: float  # MLX allocator peak during the translation
    translate_extra_mb: float  # ... above what was allocated before it
    repeats: int
    decode_step_s: float = 0.0  # ceiling part: bare step on the target's own T-1 cache
    maps_s: float = 0.0  # ceiling part: the maps' matmuls alone
    ceiling_s: float = 0.0  # decode_step_s + maps_s
    ceiling_ratio: float = 0.0  # prefill_s / ceiling_s
    fraction: float = 0.0  # ratio / ceiling_ratio = ceiling_s / switch_s
    native_tail: int = 0
    pair: str = ""
    memory: Dict[str, float] = field(default_factory=dict)  # MB: caches, maps, bound
    prefill_all_s: List[float] = field(default_factory=list)
    switch_all_s: List[float] = field(default_factory=list)
    ceiling_all_s: List[float] = field(default_factory=list)
    translate_profile: Dict[str, float] = field(default_factory=dict)  # split of the switch

    def to_dict(self) -> dict:
        return asdict(self)


def environment() -> dict:
    """The machine and software a benchmark ran on."""
    import mlx_lm

    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        pass
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_gb": round(mem, 1) if mem else None,
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "device": str(mx.default_device()),
        "blas": blas.preload_status,
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        # Thread settings change BLAS timings (and how they suffer on a busy machine).
        "threads_env": {k: v for k, v in os.environ.items()
                        if k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")},
    }
    if mx.default_device() == mx.gpu and mx.metal.is_available():
        info["gpu"] = mx.metal.device_info().get("device_name")
    return info


@dataclass
class _Context:
    """One context to time: the target's tokens, the source's live cache, and how
    to switch it (shared tokenizer: token ids; otherwise: text, aligned inside the
    timed switch)."""

    tokens: mx.array  # [T] target token ids
    source_cache: list
    text: Optional[str] = None
    # The source's (ids, offsets) of `text`: it tokenized the text to read it, so
    # the switch tokenizes only for the target.
    source_tokens: Optional[tuple] = None


def _shared_context(source, stream: Sequence[int], context: int) -> _Context:
    tokens = mx.array(list(stream[:context]))
    return _Context(tokens, _evaluated(prefill(source, tokens[None, :-1])))


def _text_context(source, source_tokenizer, target_tokenizer, text: str, context: int):
    """The prefix of ``text`` that the target tokenizes into ``context`` tokens (or
    as close as a cut at a token end allows), and the source's cache of it."""
    ids, offsets = tokenize_with_offsets(target_tokenizer, text)
    if len(ids) < context:
        raise ValueError(f"The text has {len(ids)} target tokens, fewer than {context}.")
    cut = offsets[context - 1][1]
    for _ in range(8):  # a cut can tokenize differently at its end: adjust
        ids_cut, off_cut = tokenize_with_offsets(target_tokenizer, text[:cut])
        if len(ids_cut) == context:
            break
        cut = off_cut[context - 1][1] if len(ids_cut) > context else offsets[len(ids_cut)][1]
    prefix = text[:cut]
    source_tokens = tokenize_with_offsets(source_tokenizer, prefix)
    source_cache = _evaluated(prefill(source, mx.array(source_tokens[0])[None]))
    return _Context(mx.array(ids_cut), source_cache, prefix, source_tokens)


def _evaluated(cache):
    mx.eval([(c.keys, c.values) for c in cache])
    return cache


def _nbytes(cache) -> int:
    return sum(c.keys.nbytes + c.values.nbytes for c in cache if c.keys is not None)


def _switch(source, target, translator, ctx: _Context, m: int, tokenizers):
    """The translation alone: no recompute, whatever the translator's default
    (benchmarks/switch_cost_recompute.py times that)."""
    if ctx.text is None:
        return switch(source, target, translator, ctx.tokens, source_cache=ctx.source_cache,
                      native_tail=m, recompute=0.0)
    return switch_text(source, tokenizers[0], target, tokenizers[1], translator, ctx.text,
                       source_cache=ctx.source_cache, native_tail=m,
                       source_tokens=ctx.source_tokens, recompute=0.0)


def _timed_switch(source, target, translator, ctx, m, tokenizers):
    """(translate_s, first_step_s, bytes above what was allocated before at the
    translation's peak, the same for the first step's peak (its activations: the
    cache is allocated by then), target cache bytes, rows of each layer's buffer)."""
    active = mx.get_active_memory()
    mx.reset_peak_memory()
    result = _switch(source, target, translator, ctx, m, tokenizers)
    _evaluated(result._cache)  # the translation, before the first step reads it
    translate_peak = mx.get_peak_memory() - active
    before_step = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    first_step(target, result)
    step = time.perf_counter() - t0
    return (result.translate_s, step, translate_peak, mx.get_peak_memory() - before_step,
            _nbytes(result.cache), [c.keys.shape[2] for c in result.cache])


def timed_prefill(target, tokens: mx.array):
    """(re-prefill time to first token, its bare decoding step, a copy of the
    prefilled cache as it was before that step): the body over all tokens but the
    last, then one bare step on the target's own cache. The copy (made outside the
    timing) lets :func:`timed_bare_step` time the same step again."""
    t0 = time.perf_counter()
    cache = _evaluated(prefill(target, tokens[None, :-1]))
    t1 = time.perf_counter()
    saved = copy_cache(cache)
    t2 = time.perf_counter()
    first_step(target, SwitchResult(cache, tokens[-1:], 0.0))
    t3 = time.perf_counter()
    return (t1 - t0) + (t3 - t2), t3 - t2, saved


def timed_bare_step(target, saved, last: mx.array) -> float:
    """The bare decoding step again, on a fresh copy of the prefilled cache."""
    cache = copy_cache(saved)
    t0 = time.perf_counter()
    first_step(target, SwitchResult(cache, last, 0.0))
    return time.perf_counter() - t0


def _map_inputs(target, translator, context: int):
    """Inputs ready in memory for the maps alone: per target layer, one row per
    position its cache holds (a sliding layer: its window); then, per token map
    (spec.token_layers), as many rows of token inputs."""
    inputs, tokens = [], []
    for i, (lg, km) in enumerate(zip(cache_geometry(target).layers, translator.k_maps)):
        rows = min(context - 1, lg.window) if lg.window else context - 1
        inputs.append(mx.random.normal((1, rows, km.weight.shape[1])))
        if i in translator.spec.token_layers:
            tokens.append(mx.random.normal((1, rows, translator.spec.token_width)))
    if translator.spec.shared_rank:  # a compressed translator: its projection's inputs
        width = translator.k_shared.weight.shape[1]
        inputs = _SharedInputs(mx.random.normal((1, max(x.shape[1] for x in inputs), width)),
                               [x.shape[1] for x in inputs])
        mx.eval(inputs.features, tokens)
    else:
        mx.eval(inputs, tokens)
    return inputs, tokens


@dataclass
class _SharedInputs:
    """A compressed translator's map inputs: the source features of every row (keys
    and values alike, for timing), and how many rows each target layer maps."""

    features: mx.array
    rows: List[int]


def _timed_maps(translator, inputs) -> float:
    sources, tokens = inputs
    t0 = time.perf_counter()
    if isinstance(sources, _SharedInputs):  # the projections, then each layer's rows
        zk, zv = translator.k_shared(sources.features), translator.v_shared(sources.features)
        maps = [(km(zk[:, -n:]), vm(zv[:, -n:])) for n, km, vm in
                zip(sources.rows, translator.k_maps, translator.v_maps)]
    else:
        maps = [(km(x), vm(x)) for x, km, vm in
                zip(sources, translator.k_maps, translator.v_maps)]
    mx.eval(maps + [(kt(x), vt(x)) for x, kt, vt in zip(tokens, translator.k_tok,
                                                         translator.v_tok)])
    return time.perf_counter() - t0


def _working_set(translator, buffer_rows: Sequence[int]) -> int:
    """Bytes of one layer's working set, the largest layer's: its source features (K
    and V) and map outputs over the rows of its cache buffer (the positions it holds
    and the room preallocated for the next tokens, as the target cache's bytes
    count them), what ``bound_mb`` allows beyond the caches and maps. With token maps,
    plus the target's token inputs over the longest buffer: the switch looks them up
    once and holds them for every token layer."""
    layer = max(rows * (2 * km.weight.shape[1] + 2 * km.weight.shape[0]) * 4
                for rows, km in zip(buffer_rows, translator.k_maps))
    if translator.spec.shared_rank:  # one kind's concatenated source features and
        # both projections, over every row
        width = translator.k_shared.weight.shape[1] + sum(translator.spec.shared_rank.values())
        layer += max(buffer_rows) * width * 4
    tokens = max(buffer_rows) * translator.spec.token_width * 4 if translator.spec.token_layers else 0
    return layer + tokens


def profile_switch(source, target, translator, ctx: _Context, m: int = 0,
                   tokenizers=None) -> Dict[str, float]:
    """Where a switch's time goes, with an evaluation after each part (so the sum
    exceeds an unprofiled switch a little): aligning the text (cross-tokenizer),
    the native prefix, reading and un-rotating the source keys, the map matmuls,
    re-rotating and writing the target cache, and the first step."""
    t0 = time.perf_counter()
    if ctx.text is None:
        alignment = identity_alignment(ctx.tokens.tolist(), translator.spec.native_prefix)
    else:
        alignment = align_text(tokenizers[0], tokenizers[1], ctx.text,
                               translator.spec.native_prefix, ctx.source_tokens)
    phases = {"align_s": time.perf_counter() - t0}
    result = switch_aligned(source, target, translator, ctx.source_cache, alignment,
                             mx.array(alignment.target_tokens)[None],
                             resolve_native_tail(translator, m), time.perf_counter(), phases)
    t1 = time.perf_counter()
    first_step(target, result)
    phases["first_step_s"] = time.perf_counter() - t1
    return phases


def measure_ttft(
    source: nn.Module,
    target: nn.Module,
    translator: Translator,
    stream: Optional[Sequence[int]],
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    repeats: int = 3,
    warmup: int = 1,
    profile: bool = True,
    log: Optional[Callable[[str], None]] = None,
    native_tails: Sequence[int] = (0,),
    text: Optional[str] = None,
    tokenizers=None,
    rounds: int = 3,
) -> List[TTFTRow]:
    """Time re-prefill, switch and the ceiling's parts side by side for each context
    length: on the first ``context`` tokens of ``stream`` (token ids read alike by
    both models), or, for models with different tokenizers, on the prefix of
    ``text`` that the target reads as ``context`` tokens (``tokenizers``: (source,
    target)). Medians of ``repeats`` runs after ``warmup`` untimed runs; within a
    run the paths alternate so slow drift of the machine affects all alike. Each run
    times the re-prefill once and the switch and the ceiling's parts (bare step,
    maps) ``rounds`` times: they are cheap, and the fraction of the ceiling depends
    on them alone, so their medians are over repeats x rounds (one slow first step,
    174 against 161 ms, cost a fraction 7 points with 3 samples). One row per
    context and native tail."""
    log = log or (lambda s: None)
    tails = sorted(set(native_tails) | {0})
    rows = []
    for context in contexts:
        if text is None:
            if context > len(stream):
                raise ValueError(f"The text has {len(stream)} tokens, fewer than {context}.")
            ctx = _shared_context(source, stream, context)
        else:
            ctx = _text_context(source, tokenizers[0], tokenizers[1], text, context)
        T = ctx.tokens.size
        inputs = _map_inputs(target, translator, T)
        pre, steps, maps = [], [], []
        sw = {m: ([], []) for m in tails}
        extra, step_extra, cache_bytes, buffer_rows = [], [], 0, []
        for i in range(warmup + repeats):
            p, d, saved = timed_prefill(target, ctx.tokens)
            for j in range(rounds):
                if j:
                    d = timed_bare_step(target, saved, ctx.tokens[-1:])
                ms = _timed_maps(translator, inputs)
                for m in tails:
                    tr, fs, ex, step_ex, cache_bytes_m, buffer_rows = _timed_switch(
                        source, target, translator, ctx, m, tokenizers)
                    if i >= warmup:
                        sw[m][0].append(tr)
                        sw[m][1].append(fs)
                        if m == 0:
                            extra.append(ex)
                            step_extra.append(step_ex)
                            cache_bytes = cache_bytes_m
                if i >= warmup:
                    steps.append(d)
                    maps.append(ms)
            del saved
            if i >= warmup:
                pre.append(p)
        med = statistics.median
        ceiling = [d + ms for d, ms in zip(steps, maps)]
        source_mb = _nbytes(ctx.source_cache) / 2**20
        maps_mb = sum(w.nbytes for _, w in tree_flatten(translator.parameters())) / 2**20
        working_mb = _working_set(translator, buffer_rows) / 2**20
        target_mb = cache_bytes / 2**20
        bound = source_mb + target_mb + maps_mb + working_mb
        held = source_mb + maps_mb + max(extra) / 2**20
        memory = {
            "source_cache_mb": source_mb, "target_cache_mb": target_mb, "maps_mb": maps_mb,
            "layer_working_set_mb": working_mb, "bound_mb": bound,
            "switch_peak_mb": held, "within_bound": float(held <= bound),
            # The first step's own activations on top of the caches (Gemma 3's
            # 262k-entry logits alone are 1 MB), as any decoding step holds them.
            "first_step_activations_mb": max(step_extra) / 2**20,
        }
        profile_s = profile_switch(source, target, translator, ctx, 0, tokenizers) if profile else {}
        for m in tails:
            trans, first = sw[m]
            totals = [a + b for a, b in zip(trans, first)]
            ratio = med(pre) / med(totals)
            ceiling_ratio = med(pre) / med(ceiling)
            row = TTFTRow(
                context=T, prefill_s=med(pre), switch_s=med(totals), ratio=ratio,
                translate_s=med(trans), decode_s=med(first),
                translate_peak_mb=held, translate_extra_mb=max(extra) / 2**20,
                repeats=repeats, decode_step_s=med(steps), maps_s=med(maps),
                ceiling_s=med(ceiling), ceiling_ratio=ceiling_ratio,
                fraction=ratio / ceiling_ratio, native_tail=m, memory=dict(memory),
                prefill_all_s=pre, switch_all_s=totals, ceiling_all_s=ceiling,
                translate_profile=profile_s if m == 0 else {},
            )
            log(f"  context {T:>5}, tail {m:>3}: re-prefill {row.prefill_s * 1e3:8.1f} ms, "
                f"switch {row.switch_s * 1e3:7.1f} ms (translate {row.translate_s * 1e3:6.1f} "
                f"+ first step {row.decode_s * 1e3:6.1f}), {row.ratio:5.1f}x; ceiling "
                f"{row.ceiling_s * 1e3:7.1f} ms, {row.ceiling_ratio:5.1f}x; "
                f"{row.fraction:6.1%} of the ceiling")
            rows.append(row)
        del ctx, inputs
    return rows

def format_rows(rows: Sequence[TTFTRow]) -> str:
    """The table: achieved and ceiling ratios, their fraction, the switch's split
    (translate + first step) and the ceiling's parts, and memory."""
    lines = [f"{'pair':<20} {'context':>7} {'tail':>4} {'prefill_s':>9} {'switch_s':>8} "
             f"{'ratio':>6} {'ceiling':>7} {'fraction':>8} {'translate_s':>11} "
             f"{'first_s':>7} {'maps_s':>7} {'step_s':>7} {'peak MB':>7} {'bound MB':>8}"]
    for r in rows:
        bound = r.memory.get("bound_mb", float("nan"))
        lines.append(
            f"{r.pair[:20]:<20} {r.context:>7} {r.native_tail:>4} {r.prefill_s:>9.4f} "
            f"{r.switch_s:>8.4f} {r.ratio:>5.1f}x {r.ceiling_ratio:>6.1f}x {r.fraction:>8.1%} "
            f"{r.translate_s:>11.4f} {r.decode_s:>7.4f} {r.maps_s:>7.4f} {r.decode_step_s:>7.4f} "
            f"{r.translate_peak_mb:>7.1f} {bound:>8.1f}"
        )
    return "\n".join(lines)


def format_report(result: dict, rows: Sequence[TTFTRow]) -> str:
    """The results as a small markdown page: machine, table, split, memory, notes."""
    env = result["environment"]
    mem = ["| pair | context | source cache | target cache | maps | one layer's working set "
           "| bound | switch peak | under the bound by | first step's activations |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.native_tail == 0:
            m = r.memory
            mem.append(f"| {r.pair} | {r.context} | {m['source_cache_mb']:.1f} | "
                       f"{m['target_cache_mb']:.1f} | {m['maps_mb']:.1f} | "
                       f"{m['layer_working_set_mb']:.1f} | {m['bound_mb']:.1f} | "
                       f"{m['switch_peak_mb']:.1f} | "
                       f"{m['bound_mb'] - m['switch_peak_mb']:.2f} | "
                       f"{m['first_step_activations_mb']:.1f} |")
    return "\n".join([
        "# Time to first token after a switch",
        "",
        f"{env['platform']}, {env['cpu']} ({env['cpu_count']} cores), {env['device']}, mlx "
        f"{env['mlx']}, mlx-lm {env['mlx_lm']}, BLAS: {env['blas']}, thread settings: "
        f"{env.get('threads_env') or 'default'}; load average before / after: "
        f"{result['load_average_before']} / {env['load_average']}. Medians of "
        f"{result['repeats']} runs after {result['warmup']} warm-up (the switch and the "
        f"ceiling's parts: {result['repeats'] * result.get('rounds', 1)} samples, "
        f"{result.get('rounds', 1)} per run).",
        "",
        "```", format_rows(rows), "```", "",
        "Split of one profiled switch (ms; an evaluation after each part):", "",
        "```", format_split(rows), "```", "",
        "Memory (MB, MLX allocator, model weights excluded):", "", *mem, "",
        result["note"], "",
    ])


def format_split(rows: Sequence[TTFTRow]) -> str:
    """Where each switch's time goes (profiled runs, milliseconds)."""
    parts = ("align_s", "native_prefix_s", "read_unrope_s", "maps_s", "rerope_write_s",
             "first_step_s")
    lines = [f"{'pair':<20} {'context':>7} " + " ".join(f"{p[:-2]:>14}" for p in parts)]
    for r in rows:
        if r.translate_profile:
            lines.append(f"{r.pair[:20]:<20} {r.context:>7} " + " ".join(
                f"{r.translate_profile.get(p, 0.0) * 1e3:>14.1f}" for p in parts))
    return "\n".join(lines)


def plot_ttft(rows: Sequence[TTFTRow], path, title: str = ""):
    """Per pair: TTFT of re-prefill, switch and the ceiling against context length
    (no native tail), and the achieved and ceiling speed-ups. Needs matplotlib (the
    ``plot`` extra)."""
    from ..plotting import pyplot

    plt = pyplot()

    rows = [r for r in rows if r.native_tail == 0]
    pairs = list(dict.fromkeys(r.pair for r in rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for n, pair in enumerate(pairs):
        rs = [r for r in rows if r.pair == pair]
        x = [r.context for r in rs]
        color = f"C{n}"
        a.plot(x, [r.prefill_s * 1e3 for r in rs], "o-", color=color, label=f"{pair}: re-prefill")
        a.plot(x, [r.switch_s * 1e3 for r in rs], "s--", color=color, label=f"{pair}: switch")
        a.plot(x, [r.ceiling_s * 1e3 for r in rs], ":", color=color, label=f"{pair}: ceiling")
        b.plot(x, [r.ratio for r in rs], "o-", color=color, label=f"{pair}: achieved")
        b.plot(x, [r.ceiling_ratio for r in rs], ":", color=color, label=f"{pair}: ceiling")
        for r in rs:
            b.annotate(f"{r.fraction:.0%}", (r.context, r.ratio), textcoords="offset points",
                       xytext=(0, 6), ha="center", fontsize=8, color=color)
    a.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="time to first token (ms)")
    b.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="re-prefill / switch")
    for ax in (a, b):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def heldout_stream(tokenizer, min_tokens: int) -> List[int]:
    """Held-out stdlib docstrings as one token stream of at least ``min_tokens``
    (the training split is appended if the held-out one is too short)."""
    train, heldout = split_documents(stdlib_documents())
    stream = token_stream(tokenizer, heldout)
    if len(stream) < min_tokens:
        stream += token_stream(tokenizer, train)
    return stream


def heldout_text(tokenizer, min_tokens: int) -> str:
    """Held-out stdlib docstrings joined into one text that ``tokenizer`` reads as at
    least ``min_tokens`` tokens (for pairs with different tokenizers)."""
    import random

    train, heldout = split_documents(stdlib_documents())
    docs = list(heldout)
    random.Random(0).shuffle(docs)
    docs += train
    parts, n = [], 0
    for _, text in docs:
        parts.append(text + "\n\n")
        n += len(tokenizer.encode(text, add_special_tokens=False)) + 1
        if n >= min_tokens + 64:
            break
    return "".join(parts)


DEFAULT_PAIRS = ("smollm2:smollm2", "gemma3:smollm2", "smollm2:gemma3")


def _model_path(name: str, log) -> str:
    """A path as given, or a built-in pretrained name (smollm2, gemma3), fetched once."""
    return str(fetch(name, log=log)) if name in PRETRAINED else name


def measure_pair(source_path, target_path, translator_path, contexts, repeats, warmup,
                 native_tails=(0,), log=None, loaded=None, label=None, rounds=3) -> dict:
    """One pair's rows: models loaded (``loaded``: a dict path -> (model, tokenizer)
    shared across pairs), translator from a file or random maps of the right
    geometry, text from the held-out stdlib docstrings."""
    log = log or (lambda s: None)
    loaded = {} if loaded is None else loaded
    for path in (source_path, target_path):
        if path not in loaded:
            loaded[path] = load(path)
    source, stok = loaded[source_path]
    target, ttok = loaded[target_path]
    if translator_path:
        translator = load_translator(translator_path)
        translator.check_models(source, target, stok, ttok)
        kind = f"translator file {translator_path}"
    else:
        mx.random.seed(0)
        translator = Translator.for_models(source, target, stok, ttok)
        mx.eval(translator.parameters())
        kind = "random maps (timing only: a trained translator of this shape costs the same)"
    limit = min(x for x in (max_positions(source), max_positions(target), 10**9) if x)
    contexts = [c for c in contexts if c <= limit]
    if not contexts:
        raise KvlingoError("No context length fits the models' maximum positions.")
    cross = tokenizer_fingerprint(stok) != tokenizer_fingerprint(ttok)
    pair = label or f"{Path(source_path).name} -> {Path(target_path).name}"
    log(f"TTFT {pair} ({'different tokenizers: text aligned inside the switch' if cross else 'shared tokenizer'}); translator: {kind}")
    if cross:
        text = heldout_text(ttok, max(contexts))
        rows = measure_ttft(source, target, translator, None, contexts, repeats, warmup,
                            log=log, native_tails=native_tails, text=text,
                            tokenizers=(stok, ttok), rounds=rounds)
    else:
        stream = heldout_stream(ttok, max(contexts))
        rows = measure_ttft(source, target, translator, stream, contexts, repeats, warmup,
                            log=log, native_tails=native_tails, rounds=rounds)
    for r in rows:
        r.pair = pair
    return {"source": str(source_path), "target": str(target_path), "translator": kind,
            "cross_tokenizer": cross, "rows": rows}


NOTE = (
    "Per context T (target tokens) and native tail m. prefill_s: the target's body over "
    "T - 1 tokens in one pass, then one bare decoding step on the last (decode_step_s). "
    "switch_s = translate_s + decode_s: the source's cache of the context is given (it "
    "read the context during its turn); translate_s builds the target's cache (for "
    "different tokenizers: tokenizing and aligning the text included), decode_s is the "
    "target's first step over the pending tokens (native tail + last token) with "
    "switch.first_step. Ceiling: ceiling_s = decode_step_s + maps_s (the translator's map "
    "matmuls alone over the positions the target's cache holds, inputs in memory); "
    "ceiling_ratio = prefill_s / ceiling_s; fraction = ratio / ceiling_ratio. All parts "
    "are timed in the same run, interleaved; prefill_s: median of `repeats`; the switch and "
    "the ceiling's parts: medians of `repeats` x `rounds` (each run times them `rounds` "
    "times after its one re-prefill). translate_profile: one "
    "profiled switch (an evaluation after each part). Memory (MB, MLX allocator): "
    "switch_peak_mb = source cache + maps + the switch's own allocations at their peak "
    "while it translates (the target cache included); bound_mb = source cache + target "
    "cache + maps + one layer's working set (the largest layer's source features and map "
    "outputs, K and V, over the rows of its cache buffer); first_step_activations_mb: the "
    "first decoding step's own peak on top of them (its activations: logits, attention). "
    "Maxima over the timed switches. Model weights excluded."
)


def run_ttft_benchmark(
    target_path: Optional[str] = None,
    source_path: Optional[str] = None,
    translator_path: Optional[str] = None,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    repeats: int = 3,
    warmup: int = 1,
    json_out=None,
    plot_out=None,
    log: Optional[Callable[[str], None]] = print,
    pairs: Optional[Sequence[str]] = None,
    native_tails: Sequence[int] = (0,),
    rounds: int = 3,
) -> dict:
    """The TTFT benchmark over ``pairs`` ("source:target", models by path or built-in
    name; default: SmolLM2 -> SmolLM2 and both directions of Gemma 3 270M <->
    SmolLM2) or, when ``target_path`` is given, the one pair ``source_path`` (default
    the target itself) -> ``target_path``. Translator from ``translator_path`` (one
    pair only) or random maps of the right geometry. Writes JSON (and a PNG plot)
    when paths are given; returns the result dict."""
    log = log or (lambda s: None)
    if target_path is not None:
        pairs = [f"{source_path or target_path}:{target_path}"]
    pairs = list(pairs or DEFAULT_PAIRS)
    if translator_path and len(pairs) > 1:
        raise KvlingoError("A translator file fits one pair: give --target (and --source).")
    load_before = environment()["load_average"]
    loaded, results = {}, []
    for spec in pairs:
        source_name, _, target_name = spec.partition(":")
        target_name = target_name or source_name
        label = f"{Path(source_name).name} -> {Path(target_name).name}"
        results.append(measure_pair(
            _model_path(source_name, log), _model_path(target_name, log),
            translator_path, contexts, repeats, warmup, native_tails, log, loaded, label, rounds))
    rows = [r for p in results for r in p["rows"]]
    result = {
        "benchmark": "ttft",
        "pairs": [dict(p, rows=[r.to_dict() for r in p["rows"]]) for p in results],
        "target": results[0]["target"],
        "source": results[0]["source"],
        "translator": results[0]["translator"],
        "note": NOTE,
        "repeats": repeats,
        "rounds": rounds,
        "warmup": warmup,
        "native_tails": sorted(set(native_tails) | {0}),
        "environment": environment(),
        "load_average_before": load_before,
        "rows": [r.to_dict() for r in rows],
    }
    if json_out:
        json_out = Path(json_out)
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2))
        json_out.with_suffix(".md").write_text(format_report(result, rows))
    if plot_out:
        plot_ttft(rows, plot_out, title=f"TTFT after a switch vs re-prefill and the ceiling: "
                  f"{result['environment']['device']}, mlx {mx.__version__}")
    return result

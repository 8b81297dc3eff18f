"""Time to first token after a switch, against a full re-prefill of the target.

Both paths end in the target's first generated token, produced by mlx-lm's own
``generate_step`` (what ``stream_generate`` and ``mlx_lm.generate`` run):

- re-prefill: the target reads the whole context (in mlx-lm's prefill chunks),
  then samples;
- switch: the source already holds the context in its cache (it read it during
  its turn, so that is not timed); the cache is translated (``translate_s``) and
  the target runs one decoding step on the context's last token (``decode_s``).

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

from .models import apply_rope_tables, build_cache, cache_features, prefill, rope_tables
from .switch import switch
from .translator import Translator

DEFAULT_CONTEXTS = (64, 256, 1024, 4096)


@dataclass
class TTFTRow:
    context: int
    prefill_s: float  # target's time to first token after a full prefill (median)
    switch_s: float  # translate_s + decode_s (median of the sums)
    ratio: float  # prefill_s / switch_s
    translate_s: float
    decode_s: float
    translate_peak_mb: float  # peak memory (MLX allocator) during translation
    translate_extra_mb: float  # ... above what was allocated before it
    repeats: int
    decode_step_s: float = 0.0  # one bare decoding step (model call + argmax), no mlx-lm loop
    translate_proposed_s: Optional[float] = None  # the proposed faster translation (see below)
    proposed_max_abs_diff: Optional[float] = None  # its cache vs the shipped one
    prefill_all_s: List[float] = field(default_factory=list)
    switch_all_s: List[float] = field(default_factory=list)
    translate_profile: Dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def environment() -> dict:
    """The machine and software a benchmark ran on."""
    import mlx_lm

    from . import blas

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
    }
    if mx.default_device() == mx.gpu and mx.metal.is_available():
        info["gpu"] = mx.metal.device_info().get("device_name")
    return info


def _first_token_s(model, prompt: mx.array, cache) -> float:
    """Seconds until mlx-lm's generate_step yields its first token."""
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    gen = generate_step(prompt, model, max_tokens=1, prompt_cache=cache)
    next(gen)
    elapsed = time.perf_counter() - t0
    gen.close()
    mx.synchronize()  # the pipelined next step must not leak into the next timing
    return elapsed


def _bare_step_s(model, token: mx.array, cache) -> float:
    """Seconds for one decoding step done by hand: the model on one token, argmax."""
    t0 = time.perf_counter()
    logits = model(token.reshape(1, -1), cache=cache)[:, -1, :]
    mx.eval(mx.argmax(logits, axis=-1))
    return time.perf_counter() - t0


def _evaluated(cache):
    mx.eval([(c.keys, c.values) for c in cache])
    return cache


def profile_translate(source, target, translator, source_cache, tokens) -> Dict[str, float]:
    """Where translation time goes, with an evaluation after each phase (so the
    sum exceeds an unsynchronized run a little): reading and un-rotating the source
    keys, the map matmuls, re-rotating and writing the target cache."""
    from mlx_lm.models.cache import make_prompt_cache

    n = tokens.shape[-1] - 1
    k = min(translator.spec.native_prefix, n)
    out = {}
    t0 = time.perf_counter()
    cache = make_prompt_cache(target)
    if k:
        prefill(target, tokens.reshape(1, -1)[:, :k], cache)
        _evaluated(cache)
    t1 = time.perf_counter()
    keys, values, _ = cache_features(source, source_cache, translator.source_layers, span=(k, n))
    mx.eval([x for x in keys + values if x is not None])
    t2 = time.perf_counter()
    tk, tv = translator(keys, values)
    mx.eval(tk, tv)
    t3 = time.perf_counter()
    build_cache(target, tk, tv, start=k, cache=cache)
    _evaluated(cache)
    t4 = time.perf_counter()
    out.update(native_prefix_s=t1 - t0, read_unrope_s=t2 - t1, maps_s=t3 - t2,
               rerope_write_s=t4 - t3)
    return out


# ---------------------------------------------------------------------------
# The prototype of the faster translation, kept for comparison: both of its ideas
# (memoized native prefix, rope tables shared across layers) are now in
# switch.py / models.py, so its column should match translate_s.


def proposed_translate(source, target, translator, source_cache, tokens, memo: dict):
    """``translate_cache`` with (1) the native prefix's K/V memoized per prefix ids
    (exact: position 0's K/V depend on token 0 only), (2) rope applied from probed
    cos/sin tables instead of ``mx.fast.rope`` (bit-identical, faster on CPU),
    one table per distinct rope module and span."""
    from mlx_lm.models.cache import make_prompt_cache

    from .models import (
        _flatten_heads,
        _split_heads,
        append_layer,
        cache_dtype,
        cache_geometry,
        describe_rope,
        read_layer,
    )

    tokens = tokens.reshape(-1)
    n = tokens.size - 1
    k = min(translator.spec.native_prefix, n)
    cache = make_prompt_cache(target)
    if k:
        key = (id(target), tuple(tokens[:k].tolist()))
        if key not in memo:
            own = prefill(target, tokens[None, :k])
            memo[key] = [read_layer(c)[:2] for c in own]
            mx.eval(memo[key])
        for c, (pk, pv) in zip(cache, memo[key]):
            append_layer(c, pk, pv, 0, k)
    tables = {}

    def table(rope, D):  # one table per distinct rope (layers usually share one)
        key = (json.dumps(describe_rope(rope), sort_keys=True), D)
        t = tables.get(key)
        if t is None:
            t = tables[key] = rope_tables(rope, k, n - k, D)
        return t

    keys, values = [None] * len(source_cache), [None] * len(source_cache)
    for i in translator.source_layers:
        kk, vv, _ = read_layer(source_cache[i])
        kk, vv = kk[..., k:n, :], vv[..., k:n, :]
        rope = source.layers[i].self_attn.rope
        kk = apply_rope_tables(kk, table(rope, kk.shape[-1]), rope, inverse=True)
        keys[i], values[i] = _flatten_heads(kk), _flatten_heads(vv)
    tk, tv = translator(keys, values)
    dtype = cache_dtype(target)
    for i, (c, lg) in enumerate(zip(cache, cache_geometry(target).layers)):
        rope = target.layers[i].self_attn.rope
        kk = _split_heads(tk[i], lg.n_kv_heads)
        kk = apply_rope_tables(kk, table(rope, lg.head_dim), rope)
        append_layer(c, kk.astype(dtype), _split_heads(tv[i], lg.n_kv_heads).astype(dtype), k, n)
    return cache


def measure_ttft(
    source: nn.Module,
    target: nn.Module,
    translator: Translator,
    stream: Sequence[int],
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    repeats: int = 5,
    warmup: int = 1,
    profile: bool = True,
    proposed: bool = True,
    log: Optional[Callable[[str], None]] = None,
) -> List[TTFTRow]:
    """Time re-prefill and switch side by side for each context length, on the
    first ``context`` tokens of ``stream`` (token ids read alike by both models).
    Medians of ``repeats`` runs after ``warmup`` untimed runs of each path; the two
    paths alternate so slow drift of the machine affects both alike."""
    log = log or (lambda s: None)
    rows = []
    for context in contexts:
        if context > len(stream):
            raise ValueError(f"The text has {len(stream)} tokens, fewer than {context}.")
        tokens = mx.array(list(stream[:context]))
        source_cache = _evaluated(prefill(source, tokens[None, :-1]))  # the source's turn
        pre, trans, dec, steps, peaks, extras, prop = [], [], [], [], [], [], []
        memo, diff = {}, None
        for i in range(warmup + repeats):
            p = _first_token_s(target, tokens, None)
            active = mx.get_active_memory()
            mx.reset_peak_memory()
            result = switch(source, target, translator, tokens, source_cache=source_cache)
            peak = mx.get_peak_memory()
            d = _first_token_s(target, result.last_token, result.cache)
            from mlx_lm.models.cache import trim_prompt_cache

            trim_prompt_cache(result.cache, result.cache[0].offset - (context - 1))
            b = _bare_step_s(target, result.last_token, result.cache)
            if proposed:
                t0 = time.perf_counter()
                cache = _evaluated(proposed_translate(source, target, translator,
                                                      source_cache, tokens, memo))
                pt = time.perf_counter() - t0
                if diff is None:
                    trim_prompt_cache(result.cache, 1)
                    diff = max(
                        max(mx.abs(a.keys[..., :a.offset, :] - c.keys[..., :c.offset, :]).max().item(),
                            mx.abs(a.values[..., :a.offset, :] - c.values[..., :c.offset, :]).max().item())
                        for a, c in zip(result.cache, cache)
                    )
                del cache
            if i >= warmup:
                pre.append(p)
                trans.append(result.translate_s)
                dec.append(d)
                steps.append(b)
                peaks.append(peak)
                extras.append(peak - active)
                if proposed:
                    prop.append(pt)
            del result
        sw = [t + d for t, d in zip(trans, dec)]
        med = statistics.median
        row = TTFTRow(
            context=context,
            prefill_s=med(pre),
            switch_s=med(sw),
            ratio=med(pre) / med(sw),
            translate_s=med(trans),
            decode_s=med(dec),
            translate_peak_mb=max(peaks) / 2**20,
            translate_extra_mb=max(extras) / 2**20,
            repeats=repeats,
            decode_step_s=med(steps),
            translate_proposed_s=med(prop) if prop else None,
            proposed_max_abs_diff=diff,
            prefill_all_s=pre,
            switch_all_s=sw,
        )
        if profile:
            row.translate_profile = profile_translate(
                source, target, translator, source_cache, tokens
            )
        del source_cache
        log(f"  context {context:>5}: re-prefill {row.prefill_s * 1e3:8.1f} ms, switch "
            f"{row.switch_s * 1e3:7.1f} ms (translate {row.translate_s * 1e3:6.1f} + decode "
            f"{row.decode_s * 1e3:6.1f}), {row.ratio:5.1f}x")
        rows.append(row)
    return rows


def format_rows(rows: Sequence[TTFTRow]) -> str:
    lines = [f"{'context':>7} {'prefill_s':>10} {'switch_s':>9} {'ratio':>7} "
             f"{'translate_s':>11} {'decode_s':>9} {'step_s':>7} {'peak MB':>8} {'extra MB':>8} "
             f"{'proposed translate_s':>20}"]
    for r in rows:
        prop = f"{r.translate_proposed_s:.4f}" if r.translate_proposed_s is not None else "-"
        lines.append(
            f"{r.context:>7} {r.prefill_s:>10.4f} {r.switch_s:>9.4f} {r.ratio:>6.1f}x "
            f"{r.translate_s:>11.4f} {r.decode_s:>9.4f} {r.decode_step_s:>7.4f} "
            f"{r.translate_peak_mb:>8.1f} {r.translate_extra_mb:>8.1f} {prop:>20}"
        )
    return "\n".join(lines)


def plot_ttft(rows: Sequence[TTFTRow], path, title: str = ""):
    """TTFT of both paths (and the switch's two parts) against context length, and
    the speed-up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r.context for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.plot(x, [r.prefill_s * 1e3 for r in rows], "o-", label="re-prefill")
    a.plot(x, [r.switch_s * 1e3 for r in rows], "o-", label="switch (translate + 1 step)")
    a.plot(x, [r.translate_s * 1e3 for r in rows], "--", label="  translate")
    a.plot(x, [r.decode_s * 1e3 for r in rows], ":", label="  first decoding step")
    a.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="time to first token (ms)")
    a.set_xticks(x, [str(v) for v in x])
    a.legend()
    a.grid(alpha=0.3)
    b.bar([str(v) for v in x], [r.ratio for r in rows], color="tab:green")
    for i, r in enumerate(rows):
        b.text(i, r.ratio, f"{r.ratio:.1f}x", ha="center", va="bottom")
    b.set(xlabel="context tokens", ylabel="re-prefill / switch")
    b.grid(alpha=0.3, axis="y")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def heldout_stream(tokenizer, min_tokens: int) -> List[int]:
    """Held-out stdlib docstrings as one token stream of at least ``min_tokens``
    (the training split is appended if the held-out one is too short)."""
    from .data import split_documents, stdlib_documents, token_stream

    train, heldout = split_documents(stdlib_documents())
    stream = token_stream(tokenizer, heldout)
    if len(stream) < min_tokens:
        stream += token_stream(tokenizer, train)
    return stream


def run_ttft_benchmark(
    target_path: Optional[str] = None,
    source_path: Optional[str] = None,
    translator_path: Optional[str] = None,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    repeats: int = 5,
    warmup: int = 1,
    json_out=None,
    plot_out=None,
    log: Optional[Callable[[str], None]] = print,
) -> dict:
    """The TTFT benchmark: target ``target_path`` (default SmolLM2-135M-Instruct,
    float32, from :mod:`mlx_kvlingo.pretrained`); source ``source_path`` (default
    the target itself); translator from ``translator_path`` or random maps of the
    right shape. Writes JSON (and a PNG plot) when paths are given; returns the
    result dict."""
    from .errors import KvlingoError
    from .models import load
    from .translator import load_translator

    log = log or (lambda s: None)
    if target_path is None:
        from .pretrained import fetch

        target_path = str(fetch("smollm2", log=log))
    target, tokenizer = load(target_path)
    if source_path is None or source_path == target_path:
        source, source_path = target, target_path
    else:
        source, _ = load(source_path)
    if translator_path:
        translator = load_translator(translator_path)
        translator.check_models(source, target)
        kind = f"translator file {translator_path}"
    else:
        mx.random.seed(0)
        translator = Translator.for_models(source, target)
        mx.eval(translator.parameters())
        kind = "random maps (timing only: a trained translator of this shape costs the same)"
    max_pos = getattr(getattr(target, "args", None), "max_position_embeddings", None)
    if max_pos:
        contexts = [c for c in contexts if c <= max_pos]
    if not contexts:
        raise KvlingoError("No context length fits the target's maximum position.")
    log(f"TTFT: target {target_path}, source {source_path}, translator: {kind}")
    stream = heldout_stream(tokenizer, max(contexts))
    load_before = environment()["load_average"]
    rows = measure_ttft(source, target, translator, stream, contexts, repeats, warmup, log=log)
    result = {
        "benchmark": "ttft",
        "target": str(target_path),
        "source": str(source_path),
        "translator": kind,
        "note": ("switch_s = translate_s + decode_s: the source's cache of the context is "
                 "given (it read the context during its turn); translate the cache, then "
                 "the target's first decoding step on the last context token. prefill_s: "
                 "the target reads the whole context and yields its first token. Both "
                 "through mlx_lm.generate.generate_step; medians of `repeats` runs. "
                 "decode_step_s: one bare decoding step on the translated cache (mlx-lm's "
                 "loop also schedules the second step before returning the first token). "
                 "translate_proposed_s: a prototype of the proposed faster translation "
                 "(memoized native prefix, rope from probed tables), not the shipped path; "
                 "proposed_max_abs_diff: its cache vs the shipped one."),
        "repeats": repeats,
        "warmup": warmup,
        "environment": environment(),
        "load_average_before": load_before,
        "rows": [r.to_dict() for r in rows],
    }
    if json_out:
        json_out = Path(json_out)
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2))
    if plot_out:
        name = Path(str(target_path)).name
        plot_ttft(rows, plot_out, title=f"TTFT after a switch vs re-prefill: {name}, "
                  f"{result['environment']['device']}, mlx {mx.__version__}")
    return result

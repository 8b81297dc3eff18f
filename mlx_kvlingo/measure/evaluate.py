"""Fidelity of a translator on held-out text (CBR, KL, top-1; see ``metrics``).

Each held-out window is split into a context and a continuation. The target
predicts the continuation three ways, differing only in the cache it starts from:

- native: its own prefill of the context (what a re-prefill gives);
- translated: the translated source cache (plus its own step on the last token);
- none: no context at all, only the context's last token.

Reported per continuation token: NLLs, KL(native ‖ translated), top-1 agreement
with native, and the context benefit retained
CBR = (NLL_none − NLL_translated) / (NLL_none − NLL_native).
"""

import random
from dataclasses import asdict, dataclass, field
from typing import Iterable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from .. import cpu_math
from ..errors import KvlingoError
from ..metrics import cbr, kl, nll
from ..models.cache import copy_cache, prefill
from ..progress import bar
from ..switching.api import translate_aligned
from ..translator.align import identity_alignment

# CBR divides by the target's own context benefit; below this it is mostly noise.
MIN_CONTEXT_BENEFIT = 0.5


@dataclass
class Fidelity:
    context_len: int
    tokens: int  # continuation tokens scored
    nll_native: float
    nll_translated: float
    nll_none: float
    kl: float  # KL(native ‖ translated), nats per token
    kl_none: float  # KL(native ‖ no context), the naive baseline
    top1: float  # fraction of positions where argmax agrees with native
    native_tail: int = 0  # last context tokens the target computed itself
    native_layer0: bool = False  # layer 0 computed by the target, not translated
    # A truncation baseline, not a translation: the target re-prefilled only the last
    # ``truncated`` context tokens (behind its leading special tokens), the rest
    # dropped; its NLL stands where a translation's would (0: a translation).
    truncated: int = 0
    # Per target layer: cosine between the attention outputs for the continuation
    # with the native and with the translated context K/V, same queries (a better
    # predictor of retention than R²). Mean over tokens and windows.
    attention_cosine: List[float] = field(default_factory=list)
    # Per window: summed NLLs, KL and top-1 hits, and the token count, so intervals
    # and paired differences can be bootstrapped over windows.
    windows: List[dict] = field(default_factory=list, repr=False)

    @property
    def context_benefit(self) -> float:
        return self.nll_none - self.nll_native

    @property
    def cbr(self) -> float:
        return cbr(self.nll_none, self.nll_translated, self.nll_native)

    @property
    def cbr_meaningful(self) -> bool:
        return self.context_benefit >= MIN_CONTEXT_BENEFIT

    @property
    def attention_cosine_mean(self) -> float:
        c = self.attention_cosine
        return sum(c) / len(c) if c else float("nan")

    @property
    def attention_cosine_worst(self) -> float:
        return min(self.attention_cosine) if self.attention_cosine else float("nan")

    def cbr_interval(self, level: float = 0.95, draws: int = 2000, seed: int = 0):
        """Bootstrap interval of CBR over windows (CBR as a ratio of summed NLLs)."""
        return bootstrap_interval([self], lambda rows: _cbr_of(rows[0]), level, draws, seed)

    @classmethod
    def from_dict(cls, d: dict) -> "Fidelity":
        """A row back from :meth:`to_dict` (e.g. an ``eval --json`` file); the
        derived fields it added are dropped."""
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def to_dict(self) -> dict:
        d = asdict(self)
        lo, hi = self.cbr_interval() if len(self.windows) > 1 else (float("nan"),) * 2
        d.update(
            cbr=self.cbr,
            cbr_ci95=[lo, hi],
            attention_cosine_mean=self.attention_cosine_mean,
            attention_cosine_worst=self.attention_cosine_worst,
            context_benefit=self.context_benefit,
            cbr_meaningful=self.cbr_meaningful,
        )
        return d


def _cbr_of(windows: Sequence[dict]) -> float:
    """CBR pooled over windows: a ratio of summed NLLs."""
    return cbr(*(sum(w[k] for w in windows) for k in ("none", "translated", "native")))


def bootstrap_interval(rows: Sequence["Fidelity"], statistic, level=0.95, draws=2000, seed=0):
    """Percentile bootstrap over windows, resampling the *same* windows for every
    row (paired): ``statistic`` maps a list of per-row window lists to a number."""
    n = len(rows[0].windows)
    if any(len(r.windows) != n for r in rows):
        raise ValueError("Paired bootstrap needs the same windows in every row.")
    rng = random.Random(seed)
    values = []
    for _ in range(draws):
        pick = [rng.randrange(n) for _ in range(n)]
        values.append(statistic([[r.windows[i] for i in pick] for r in rows]))
    values.sort()
    a = (1 - level) / 2
    return values[int(a * draws)], values[min(int((1 - a) * draws), draws - 1)]


def cbr_difference(a: "Fidelity", b: "Fidelity", level=0.95, draws=2000, seed=0):
    """CBR(a) - CBR(b) and its paired bootstrap interval (a, b on identical windows)."""
    lo, hi = bootstrap_interval(
        [a, b], lambda rows: _cbr_of(rows[0]) - _cbr_of(rows[1]), level, draws, seed
    )
    return a.cbr - b.cbr, (lo, hi)


def continuation_logprobs(model: nn.Module, context: mx.array, continuation: mx.array, cache):
    """Log-probs [B, L, V] the model gives each continuation token, from ``cache``
    holding ``context[:, :-1]`` (or None for no context)."""
    inputs = mx.concatenate([context[:, -1:], continuation[:, :-1]], axis=1)
    with cpu_math.numpy_passes():
        logits = model(inputs, cache=cache).astype(mx.float32)
    return cpu_math.log_softmax(logits)


class ScoreTotals:
    """Per-token sums over scored continuations."""

    def __init__(self, native_tail: int = 0, native_layer0: bool = False, truncated: int = 0):
        self.truncated = truncated
        self.sums = dict(native=0.0, translated=0.0, none=0.0, kl=0.0, kl_none=0.0, top1=0.0)
        self.n = 0
        self.native_tail = native_tail
        self.native_layer0 = native_layer0
        self.windows: List[dict] = []
        self.cosine_sum: Optional[List[float]] = None
        self.cosine_n = 0

    def add_cosine(self, per_layer: List[float]):
        if self.cosine_sum is None:
            self.cosine_sum = [0.0] * len(per_layer)
        self.cosine_sum = [a + b for a, b in zip(self.cosine_sum, per_layer)]
        self.cosine_n += 1

    def add(self, continuation, native, translated, none):
        """Add one batch of windows (one row of the batch = one window)."""
        p = cpu_math.exp(native)  # once: a vocabulary of 262k makes it the costly part
        per = dict(
            native=nll(native, continuation).sum(-1),
            translated=nll(translated, continuation).sum(-1),
            none=nll(none, continuation).sum(-1),
            kl=kl(native, translated, p).sum(-1),
            top1=(native.argmax(-1) == translated.argmax(-1)).sum(-1),
            kl_none=kl(native, none, p).sum(-1),
        )
        mx.eval(per)
        for b in range(continuation.shape[0]):
            w = {k: v[b].item() for k, v in per.items() if k != "kl_none"}
            w["tokens"] = continuation.shape[1]
            self.windows.append(w)
        for k, v in per.items():
            self.sums[k] += v.sum().item()
        self.n += continuation.size

    def result(self, context_len: int) -> Fidelity:
        if self.n == 0:
            raise ValueError("No windows to evaluate.")
        s, n = self.sums, self.n
        return Fidelity(
            context_len=context_len,
            tokens=n,
            nll_native=s["native"] / n,
            nll_translated=s["translated"] / n,
            nll_none=s["none"] / n,
            kl=s["kl"] / n,
            kl_none=s["kl_none"] / n,
            top1=s["top1"] / n,
            native_tail=self.native_tail,
            native_layer0=self.native_layer0,
            truncated=self.truncated,
            windows=self.windows,
            attention_cosine=[c / self.cosine_n for c in self.cosine_sum or []],
        )


def evaluate_translator(
    source: nn.Module,
    target: nn.Module,
    translator,
    windows: Iterable[mx.array],
    context_len: int,
) -> Fidelity:
    """Score ``translator`` on token windows [B, T] (T > context_len) read identically
    by both models."""
    return evaluate_translators(source, target, [translator], windows, context_len)[0]


class _AttentionRecorder(nn.Module):
    """Stands in for a layer's ``self_attn`` and records its inputs and output."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = []

    def __call__(self, x, mask=None, cache=None):
        out = self.inner(x, mask, cache)
        self.calls.append((x, mask, out))
        return out


def native_attention(target, context, continuation, cache):
    """Continuation log-probs from ``cache`` (the target's native cache of the
    context), and each layer's attention (input, mask, output) on the way."""
    layers = target.layers
    recorders = [_AttentionRecorder(layer.self_attn) for layer in layers]
    for layer, r in zip(layers, recorders):
        layer.self_attn = r
    try:
        logprobs = continuation_logprobs(target, context, continuation, cache)
        mx.eval(logprobs, [r.calls[-1][2] for r in recorders])
    finally:
        for layer, r in zip(layers, recorders):
            layer.self_attn = r.inner
    return logprobs, [r.calls[-1] for r in recorders]


def attention_cosine(target, recorded, cache) -> List[float]:
    """Per layer, the mean cosine between the recorded native attention output and
    the output of the same queries (the recorded inputs) over ``cache``'s K/V."""
    out = []
    for layer, c, (x, mask, native) in zip(target.layers, cache, recorded):
        with cpu_math.numpy_passes():
            other = layer.self_attn(x, mask, c)
        num = (native * other).sum(-1)
        den = mx.sqrt((native * native).sum(-1) * (other * other).sum(-1)) + 1e-12
        out.append((num / den).mean())
    mx.eval(out)
    return [v.item() for v in out]


def _variants(translators, native_tails: Sequence[int]) -> List[Tuple[object, int]]:
    """Every translator with every native tail, translator-major. (To score a
    translator with and without native layer 0 on the same windows, pass both
    ``t.with_native_layer0(False)`` and ``t.with_native_layer0(True)``.)"""
    return [(t, m) for t in translators for m in native_tails]


def _score_translated(tot, target, continuation, native, none, recorded, cache, logprobs):
    """Add one translated cache's scores to ``tot``. Both scorings write into the
    cache they read, so one gets a copy: translating once per variant instead of
    twice (top-18 maps, SmolLM2 -> Gemma 3: about a tenth of the evaluation's time)."""
    tot.add(continuation, native, logprobs(copy_cache(cache)), none)
    tot.add_cosine(attention_cosine(target, recorded, cache))


def _score_truncations(truncations, totals, target, context, continuation, native, none,
                       logprobs, specials: int = 0):
    """Add the truncation baselines' scores: the target's own cache of its leading
    ``specials`` tokens and the last n context tokens before the last one."""
    for n, tot in zip(truncations, totals):
        if not 0 < n < context.shape[1]:
            raise KvlingoError(f"Cannot keep the last {n} tokens of a "
                               f"{context.shape[1]}-token context.")
        kept = mx.concatenate([context[:, :specials], context[:, -(n + 1):-1]], axis=1)
        tot.add(continuation, native, logprobs(prefill(target, kept)), none)


def evaluate_translators(
    source, target, translators, windows, context_len: int, native_tails: Sequence[int] = (0,),
    truncations: Sequence[int] = (), progress: Optional[bool] = False,
) -> List[Fidelity]:
    """Score several translators (each with each native tail) on the same windows;
    the native and no-context passes are computed once per window. ``truncations``:
    also score the target re-prefilling only the last n context tokens, for each n
    (rows after the translators', ``Fidelity.truncated``). ``progress``: a bar over
    the windows on standard error (None: when it is a terminal)."""
    variants = _variants(translators, native_tails)
    totals = [ScoreTotals(m, getattr(t.spec, "native_layer0", False)) for t, m in variants]
    cut = [ScoreTotals(truncated=n) for n in truncations]
    for tokens in bar(windows, desc=f"context {context_len}", progress=progress,
                      unit="window", leave=False):
        context, continuation = tokens[:, :context_len], tokens[:, context_len:]

        def logprobs(cache):
            return continuation_logprobs(target, context, continuation, cache)

        native, recorded = native_attention(
            target, context, continuation, prefill(target, context[:, :-1]))
        none = logprobs(None)
        source_cache = prefill(source, context[:, :-1])
        n = context.shape[1] - 1
        for (t, m), tot in zip(variants, totals):
            a = identity_alignment(context[0].tolist(), t.spec.native_prefix)
            a = a.with_native_tail(m, n)

            cache = translate_aligned(source, target, t, source_cache, None, a, n, context)
            _score_translated(tot, target, continuation, native, none, recorded, cache, logprobs)
        _score_truncations(truncations, cut, target, context, continuation, native, none,
                           logprobs)
    return [t.result(context_len) for t in totals + cut]


def evaluate_aligned(
    source, target, translators, samples, context_len: int, native_tails: Sequence[int] = (0,),
    truncations: Sequence[int] = (), progress: Optional[bool] = False,
) -> List[Fidelity]:
    """Score translators (each with each native tail) on
    :class:`~mlx_kvlingo.train.samples.AlignedSample`s (pairs with different tokenizers,
    one sample at a time). The no-context baseline keeps the target's leading
    special tokens (e.g. Gemma's BOS, without which it is off distribution), and so
    do the ``truncations`` (as in :func:`evaluate_translators`, as is ``progress``)."""
    variants = _variants(translators, native_tails)
    totals = [ScoreTotals(m, getattr(t.spec, "native_layer0", False)) for t, m in variants]
    cut = [ScoreTotals(truncated=n) for n in truncations]
    for s in bar(samples, desc=f"context {context_len}", progress=progress, unit="window",
                 leave=False):
        context = mx.array(s.alignment.target_tokens)[None]
        continuation = mx.array(s.continuation)[None]

        def logprobs(cache):
            return continuation_logprobs(target, context, continuation, cache)

        native, recorded = native_attention(
            target, context, continuation, prefill(target, context[:, :-1]))
        specials = context[:, : s.special_prefix]
        none = logprobs(prefill(target, specials) if s.special_prefix else None)
        source_cache = prefill(source, mx.array(s.alignment.source_tokens)[None])
        n = context.shape[1] - 1
        for (t, m), tot in zip(variants, totals):
            a = s.alignment.with_native_tail(m, n)

            cache = translate_aligned(source, target, t, source_cache, None, a, n)
            _score_translated(tot, target, continuation, native, none, recorded, cache, logprobs)
        _score_truncations(truncations, cut, target, context, continuation, native, none,
                           logprobs, s.special_prefix)
    return [t.result(context_len) for t in totals + cut]


def evaluate_pair(pair, source, target, translators, items, context_len: int,
                  native_tails: Sequence[int] = (0,), truncations: Sequence[int] = (),
                  progress: Optional[bool] = False) -> List[Fidelity]:
    """Score translators on what ``pair.heldout`` returned: windows of shared
    token ids (``train.samples.SharedTokens``) or aligned samples
    (``train.samples.AlignedText``, different tokenizers: ``pair.aligned``)."""
    score = evaluate_aligned if getattr(pair, "aligned", False) else evaluate_translators
    return score(source, target, translators, items, context_len, native_tails, truncations,
                 progress)


MARKDOWN_HEAD = ["| context | {} | NLL | CBR | 95% CI | KL | top-1 | attn cos (worst layer) |",
                 "|---|---|---|---|---|---|---|---|"]


def markdown_rows(context: int, labelled: Sequence[Tuple[str, Fidelity]]) -> List[str]:
    """Markdown rows (see :data:`MARKDOWN_HEAD`) of one context length: native
    re-prefill, no context, each (label, row) scored on the same windows, and the
    target's own context benefit."""
    f0 = labelled[0][1]
    lines = [f"| {context} | native re-prefill | {f0.nll_native:.3f} | 100% | | 0 | 100% | |",
             f"| {context} | no context | {f0.nll_none:.3f} | 0% | | {f0.kl_none:.3f} | | |"]
    for label, f in labelled:
        lo, hi = f.cbr_interval()
        lines.append(f"| {context} | {label} | {f.nll_translated:.3f} | {f.cbr:.1%} | "
                     f"{lo:.1%}..{hi:.1%} | {f.kl:.3f} | {f.top1:.1%} | "
                     f"{f.attention_cosine_mean:.3f} ({f.attention_cosine_worst:.3f}) |")
    lines.append(f"| {context} | *target's own context benefit: {f0.context_benefit:.3f} "
                 f"nats/token, {len(f0.windows)} windows* | | | | | | |")
    return lines


def format_table(rows: List[Fidelity]) -> str:
    """A plain-text table of fidelity rows, with a note where CBR is not meaningful."""
    head = (
        f"{'context':>7} {'tokens':>6} {'NLL native':>10} {'translated':>10} "
        f"{'no context':>10} {'benefit':>7} {'CBR':>6} {'95% CI':>13} {'KL':>7} {'KL none':>7} "
        f"{'top-1':>6} {'tail':>4} {'attn cos':>8} {'worst':>6}"
    )
    lines = [head]
    for r in rows:
        flag = "" if r.cbr_meaningful else " *"
        ci = "{:.1%}..{:.1%}".format(*r.cbr_interval()) if len(r.windows) > 1 else "-"
        lines.append(
            f"{r.context_len:>7} {r.tokens:>6} {r.nll_native:>10.3f} {r.nll_translated:>10.3f} "
            f"{r.nll_none:>10.3f} {r.context_benefit:>7.3f} {r.cbr:>6.1%} {ci:>13} {r.kl:>7.3f} "
            f"{r.kl_none:>7.3f} {r.top1:>6.1%} {r.native_tail:>4} "
            f"{r.attention_cosine_mean:>8.3f} {r.attention_cosine_worst:>6.3f}{flag}"
        )
    if any(not r.cbr_meaningful for r in rows):
        lines.append(
            f"* the target gains less than {MIN_CONTEXT_BENEFIT} nats/token from context "
            "here, so CBR is mostly noise; read KL and top-1 instead."
        )
    return "\n".join(lines)

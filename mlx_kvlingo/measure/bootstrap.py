"""Intervals for CBR: per-window fidelity and a paired bootstrap over windows.

CBR pools windows as a ratio of sums, Σ(NLL_none − NLL_translated) /
Σ(NLL_none − NLL_native), so the interval resamples whole windows and recomputes
that ratio. Comparing two translators resamples the *same* windows for both
(paired): window-to-window spread, which both share, then cancels, and a gain of
a few points becomes visible with ~50 windows.
"""

from dataclasses import dataclass
from typing import List, Sequence

import mlx.core as mx
import numpy as np

from .evaluate import Fidelity, evaluate_pair

RESAMPLES = 2000


@dataclass
class Interval:
    value: float
    low: float  # 2.5th percentile of the bootstrap
    high: float  # 97.5th percentile

    def __str__(self) -> str:
        return f"{self.value:.1%} [{self.low:.1%}, {self.high:.1%}]"

    def to_dict(self) -> dict:
        return {"value": self.value, "low": self.low, "high": self.high}


def per_window_fidelity(pair, source, target, translators, items, context_len: int) -> List[List[Fidelity]]:
    """Fidelity of each translator on each held-out window separately:
    [translator][window].

    ``pair``: a :class:`~mlx_kvlingo.train.samples.SharedTokens` or
    :class:`~mlx_kvlingo.train.samples.AlignedText`; ``items``: what its ``heldout``
    returned (batches of token windows, or aligned samples), scored one window at
    a time with the pair's own ``evaluate``."""
    rows = [[] for _ in translators]
    for item in _single_windows(items):
        for r, f in zip(rows, evaluate_pair(pair, source, target, translators, [item], context_len)):
            r.append(f)
    return rows


def _single_windows(items):
    for item in items:
        if isinstance(item, mx.array):
            yield from (item[i : i + 1] for i in range(item.shape[0]))
        else:
            yield item


def _sums(rows: Sequence[Fidelity]):
    """Per-window totals (benefit, retained) in nats: NLL_none − NLL_native and
    NLL_none − NLL_translated, each times the window's tokens."""
    n = np.array([f.tokens for f in rows], dtype=np.float64)
    benefit = n * np.array([f.nll_none - f.nll_native for f in rows])
    retained = n * np.array([f.nll_none - f.nll_translated for f in rows])
    return benefit, retained


def _resample_indices(count: int, resamples: int, seed: int):
    return np.random.default_rng(seed).integers(0, count, size=(resamples, count))


def _interval(value: float, draws: np.ndarray) -> Interval:
    low, high = np.percentile(draws, [2.5, 97.5])
    return Interval(float(value), float(low), float(high))


def cbr_interval(rows: Sequence[Fidelity], resamples: int = RESAMPLES, seed: int = 0) -> Interval:
    """Pooled CBR of one translator with a 95 % bootstrap interval over windows."""
    benefit, retained = _sums(rows)
    idx = _resample_indices(len(rows), resamples, seed)
    draws = retained[idx].sum(1) / benefit[idx].sum(1)
    return _interval(retained.sum() / benefit.sum(), draws)


def benefit_interval(rows: Sequence[Fidelity], resamples: int = RESAMPLES, seed: int = 0) -> Interval:
    """The target's own context benefit, nats per continuation token, with its interval."""
    benefit, _ = _sums(rows)
    n = np.array([f.tokens for f in rows], dtype=np.float64)
    idx = _resample_indices(len(rows), resamples, seed)
    draws = benefit[idx].sum(1) / n[idx].sum(1)
    return _interval(benefit.sum() / n.sum(), draws)


def paired_cbr_difference(
    rows_a: Sequence[Fidelity], rows_b: Sequence[Fidelity], resamples: int = RESAMPLES, seed: int = 0
) -> Interval:
    """CBR(b) − CBR(a) on the same windows, with a paired 95 % bootstrap interval:
    an interval above zero means b retains more of the context than a."""
    if len(rows_a) != len(rows_b):
        raise ValueError("Paired comparison needs the same windows for both translators.")
    benefit, retained_a = _sums(rows_a)
    _, retained_b = _sums(rows_b)
    idx = _resample_indices(len(rows_a), resamples, seed)
    denom = benefit[idx].sum(1)
    draws = (retained_b[idx].sum(1) - retained_a[idx].sum(1)) / denom
    return _interval((retained_b.sum() - retained_a.sum()) / benefit.sum(), draws)


def mean_interval(values: Sequence[float], resamples: int = RESAMPLES, seed: int = 0) -> Interval:
    """A mean over items (an exact-match rate, a mean NLL) with its 95 % interval."""
    v = np.asarray(values, dtype=np.float64)
    idx = _resample_indices(len(v), resamples, seed)
    return _interval(v.mean(), v[idx].mean(1))


def paired_mean_difference(a: Sequence[float], b: Sequence[float], resamples: int = RESAMPLES,
                           seed: int = 0) -> Interval:
    """mean(b) − mean(a) over the same items, with a paired 95 % interval."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError("A paired comparison needs the same items on both sides.")
    idx = _resample_indices(len(a), resamples, seed)
    return _interval((b - a).mean(), (b - a)[idx].mean(1))

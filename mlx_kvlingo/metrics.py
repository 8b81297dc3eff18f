"""The scores every measurement shares: NLL, KL and the context benefit retained.

CBR = (NLL_none − NLL_translated) / (NLL_none − NLL_native): the share of what the
context is worth to the target (its benefit over no context at all) that is kept
after a switch; 100 % is as good as a re-prefill.
"""

from typing import Optional

import mlx.core as mx

from . import cpu_math


def cbr(nll_none: float, nll_translated: float, nll_native: float) -> float:
    """Context benefit retained; NaN when the context is worth nothing."""
    benefit = nll_none - nll_native
    return (nll_none - nll_translated) / benefit if benefit else float("nan")


def nll(logprobs: mx.array, targets: mx.array) -> mx.array:
    """Per-position negative log-likelihood of ``targets`` ([..., T]) under
    ``logprobs`` ([..., T, vocab])."""
    return -mx.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]


def log_softmax(logits: mx.array) -> mx.array:
    """Log-probabilities in float32 (the vocabulary's log-sum-exp in numpy on the CPU)."""
    return cpu_math.log_softmax(logits.astype(mx.float32))


def kl(p_log: mx.array, q_log: mx.array, p: Optional[mx.array] = None) -> mx.array:
    """KL(p ‖ q) per position. ``p``: exp(``p_log``), when the caller has it (one
    exponential of a 262k vocabulary serves several KLs against the same ``p``)."""
    p = cpu_math.exp(p_log) if p is None else p
    return (p * (p_log - q_log)).sum(-1)

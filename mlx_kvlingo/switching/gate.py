"""A cheap check of a translated cache before answering on it, and the fallback.

Before a model answers on a cache that holds translated positions, it computes
the last ``tokens`` context positions itself on top of the translated cache (a
short prefill; those positions then stay native in the cache, which also helps
fidelity) and scores its predictions of those known tokens: the mean NLL of
tokens 2..m given the translated context. The same tokens are scored with no
context (only the leading BOS, when the model has one): a forward pass over m
tokens. When

    NLL(with the translated context) - NLL(no context) > threshold

the translated context predicts the conversation's own last tokens worse than
the threshold allows, and the model re-prefills its context natively instead.
A good translation gives a negative difference (context helps); a broken one
gives about zero or positive.

The threshold comes from the gate (explicit), else from the translator's
metadata (``spec.training["gate"]["threshold"]``, written by
:func:`calibrate_threshold` users), else 0.0 nats ("no better than no context").
:func:`calibrate_threshold` picks it on held-out data so that the gate fires on
at most a given share of switches.
"""

import time
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..errors import KvlingoError
from ..metrics import log_softmax, nll
from ..models.cache import copy_cache, prefill
from .api import SwitchResult, as_batch, switch
from .recompute import recompute_spans, salient_spans, salient_words

DEFAULT_TOKENS = 8
DEFAULT_THRESHOLD = 0.0


@dataclass
class GateDecision:
    tokens: int  # predictions scored (positions computed natively minus one)
    nll_translated: float  # mean NLL of the scored tokens after the translated cache
    nll_none: float  # the same tokens with no context
    threshold: float
    fallback: bool
    computed: int  # context positions the gate computed natively (kept in the cache)
    ms: float
    reason: Optional[str] = None

    @property
    def score(self) -> float:
        return self.nll_translated - self.nll_none

    def to_dict(self) -> dict:
        d = asdict(self)
        d["score"] = round(self.score, 4)
        for k in ("nll_translated", "nll_none", "ms"):
            d[k] = round(d[k], 4)
        return d


def _mean_nll(logits: mx.array, targets: Sequence[int]) -> mx.array:
    """Mean NLL of ``targets`` under ``logits`` [T, V] (one row per target)."""
    return nll(log_softmax(logits), mx.array(list(targets))).mean()


def score_tail(model: nn.Module, cache: List, tail: Sequence[int], specials: Sequence[int] = ()):
    """Feed ``tail`` through ``model`` on ``cache`` (which then holds it too) and
    return (NLL of tail[1:] with the cache's context, NLL of tail[1:] with no
    context but ``specials``)."""
    logits = model(mx.array([list(tail)]), cache=cache)[0, :-1]
    fresh = make_prompt_cache(model)
    alone = model(mx.array([list(specials) + list(tail)]), cache=fresh)[0, len(specials):-1]
    with_ctx, none = _mean_nll(logits, tail[1:]), _mean_nll(alone, tail[1:])
    mx.eval(with_ctx, none, [(c.keys, c.values) for c in cache])
    return with_ctx.item(), none.item()


class QualityGate:
    """Judges translated caches (see the module's docstring). ``tokens``: context
    positions computed natively and scored; ``threshold``: None takes the
    translator's recorded one, else :data:`DEFAULT_THRESHOLD`."""

    def __init__(self, tokens: int = DEFAULT_TOKENS, threshold: Optional[float] = None):
        if tokens < 2:
            raise ValueError("The gate needs at least 2 tokens (1 prediction).")
        self.tokens = tokens
        self.threshold = threshold

    def threshold_for(self, translators: Sequence = ()) -> float:
        if self.threshold is not None:
            return float(self.threshold)
        for t in translators:
            recorded = (t.spec.training.get("gate") or {}).get("threshold")
            if recorded is not None:
                return float(recorded)
        return DEFAULT_THRESHOLD

    def judge(self, model: nn.Module, cache: List, tail: Sequence[int],
              specials: Sequence[int] = (), translators: Sequence = ()) -> GateDecision:
        """Compute ``tail`` (the context's last tokens, not yet in ``cache``) natively
        on ``cache`` and decide whether the translated context is bad."""
        t0 = time.perf_counter()
        with_ctx, none = score_tail(model, cache, tail, specials)
        threshold = self.threshold_for(translators)
        bad = with_ctx - none > threshold
        reason = (f"gate: the translated context predicts its last {len(tail) - 1} tokens at "
                  f"{with_ctx:.2f} nats vs {none:.2f} with no context (> {threshold:+.2f})"
                  if bad else None)
        return GateDecision(len(tail) - 1, with_ctx, none, threshold, bad, len(tail),
                            (time.perf_counter() - t0) * 1e3, reason)


def calibrate_threshold(scores: Sequence[float], max_fire_rate: float = 0.1) -> float:
    """The threshold at which the gate fires on at most ``max_fire_rate`` of the
    held-out switches whose gate scores are ``scores`` (it bounds the re-prefill
    cost; where the gate fires is then where translation is worst)."""
    if not scores:
        raise ValueError("No scores to calibrate on.")
    s = sorted(scores)
    k = min(len(s) - 1, max(0, int(round((1 - max_fire_rate) * len(s))) - 1))
    return float(s[k])


def switch_with_gate(source: nn.Module, target: nn.Module, translator, tokens,
                     source_cache: Optional[List] = None, gate: Optional[QualityGate] = None,
                     specials: Sequence[int] = ()):
    """:func:`~mlx_kvlingo.switching.api.switch` for models that share a tokenizer, judged by
    ``gate``: the context's last ``gate.tokens`` tokens before the final one are
    computed by the target itself and scored; on a bad score the target prefills
    the whole context instead. Returns (SwitchResult, GateDecision or None)."""
    gate = gate or QualityGate()
    tokens = as_batch(tokens)
    m = min(gate.tokens, tokens.shape[1] - 1 - max(translator.spec.native_prefix, 1))
    result = switch(source, target, translator, tokens, source_cache, native_tail=max(m, 0))
    return judge_switch(target, result, tokens[0].tolist(), gate, specials, [translator])


def judge_switch(target: nn.Module, result, context_tokens: Sequence[int],
                 gate: Optional[QualityGate] = None, specials: Sequence[int] = (),
                 translators: Sequence = ()):
    """Judge a switch (:class:`~mlx_kvlingo.switching.api.SwitchResult`, any pair) before
    the target answers on it: its pending native tail (all but the last token) is
    computed on the translated cache, and its last ``gate.tokens`` scored (as a
    Session does, so one calibration serves both); on a bad score the target
    prefills ``context_tokens`` (its own tokens of the whole context) instead.
    Returns (the result to decode from, GateDecision or None when the tail is too
    short to score). Either way the result's pending is the last token only."""
    gate = gate or QualityGate()
    tail = result.pending[:-1].tolist()
    if len(tail) < 2:
        return result, None
    t0 = time.perf_counter()
    cache = result.prompt_cache  # the gate reads the cache as the answer will
    if len(tail) > gate.tokens:  # the part of the tail the gate does not score
        prefill(target, mx.array(tail[:-gate.tokens])[None], cache)
        tail = tail[-gate.tokens:]
    decision = gate.judge(target, cache, tail, specials, translators)
    if decision.fallback:
        cache = prefill(target, mx.array(list(context_tokens[:-1]))[None])
        mx.eval([(c.keys, c.values) for c in cache])
    spent = time.perf_counter() - t0
    return SwitchResult(cache, result.pending[-1:], result.translate_s + spent, target), decision


# ---------------------------------------------------------------------------
# Fact probes: does the cache still hold the context's facts?
#
# The tail score above sees only the last tokens, so it cannot notice that a fact
# stated early was lost. A fact probe asks the cache for the facts themselves,
# without knowing any question: for the few most fact-like words of the context
# (the words a recompute would choose: numbers, identifiers, names), the model
# reads the tokens that led up to the word, appended after the context, and must
# continue with the word. A model copies a passage it can still find (induction),
# so a low NLL says the fact is there and a high one that it is lost.


@dataclass
class FactProbe:
    nll: float  # mean NLL of the probed words' tokens (the score)
    words: List[str]  # the words probed
    per_word: List[float]
    ms: float


def probe_facts(model: nn.Module, cache: List, tokens: Sequence[int], text: str,
                offsets: Sequence, probes: int = 3, lead: int = 6,
                lo: int = 1) -> Optional[FactProbe]:
    """Probe ``cache`` (holding ``tokens[:len(cache)]``, the rest of ``tokens``
    still to read; ``offsets``: each token's characters in ``text``) for its ``probes``
    most fact-like words: each probe is read on a copy of the cache, so the cache
    is left as it was. None when the context has no fact-like word."""
    t0 = time.perf_counter()
    end = min(c.offset for c in cache)
    # Words with something before them to lead up to them.
    words = [w for w in salient_words(text, offsets, lo, end) if w[1][0] > lo][:probes]
    if not words:
        return None
    per_word, said = [], []
    for _, positions in words:
        a = max(positions[0] - lead, lo)
        probe = list(tokens[a:positions[-1] + 1])
        logits = model(mx.array([probe[:-1]]), cache=copy_cache(cache))[0]
        n = len(positions)
        per_word.append(_mean_nll(logits[-n:], probe[-n:]).item())
        said.append(text[offsets[positions[0]][0]:offsets[positions[-1]][1]])
    return FactProbe(sum(per_word) / len(per_word), said, per_word,
                     (time.perf_counter() - t0) * 1e3)


@dataclass
class FactGateDecision:
    probe: Optional[FactProbe]
    threshold: float
    action: str  # "kept", "recomputed" (a larger share) or "re-prefilled"
    ms: float


def guard_facts(target: nn.Module, result: SwitchResult, tokens: Sequence[int], text: str,
                offsets: Sequence, threshold: float, recompute: Optional[float] = None,
                lo: int = 1):
    """Probe a switch's cache for its facts (:func:`probe_facts`) and act when the
    probe's NLL exceeds ``threshold``: recompute the fact-like words up to the
    ``recompute`` share of the context (switching.recompute), or, without it,
    prefill the whole context instead. ``tokens``: the target's tokens of the whole
    context (``offsets``: their characters in ``text``). Returns (the result to
    decode from, FactGateDecision)."""
    t0 = time.perf_counter()
    pending = result.prompt
    cache = result.prompt_cache  # probe the cache as the answer will read it
    probe = probe_facts(target, cache, tokens, text, offsets, lo=lo)
    action = "kept"
    if probe is not None and probe.nll > threshold:
        end = len(tokens) - len(pending)
        if recompute:
            spans = salient_spans(text, offsets, int(recompute * len(tokens)), lo, end)
            recompute_spans(target, cache, tokens, spans)
            action = "recomputed"
        else:
            cache = prefill(target, mx.array(list(tokens[:end]))[None])
            mx.eval([(c.keys, c.values) for c in cache])
            action = "re-prefilled"
    spent = time.perf_counter() - t0
    decision = FactGateDecision(probe, threshold, action, spent * 1e3)
    return SwitchResult(cache, pending, result.translate_s + spent, target), decision


class SwitchJudge:
    """The quality gate and the fact probe as one judge of a switch
    (switching.pipeline.Judge): the fact probe first (above ``fact_gate`` nats the
    target re-prefills), then the gate (its tail read natively: ``native_tail``)."""

    def __init__(self, target: nn.Module, tokenizer, translator,
                 gate: Optional[QualityGate] = None, fact_gate: Optional[float] = None):
        self.target, self.translator, self.gate, self.fact_gate = target, translator, gate, \
            fact_gate
        self.bos = getattr(tokenizer, "bos_token_id", None)
        tail = translator.spec.native_tail
        self.native_tail = max(gate.tokens, tail) if gate is not None else None

    def __call__(self, result: SwitchResult):
        found = {}
        tokens, lo = result.context, self.translator.spec.native_prefix
        if self.fact_gate is not None:
            if result.text is None:
                raise KvlingoError("The fact probe needs the context's text.")
            text, offsets = result.text
            result, decision = guard_facts(self.target, result, tokens, text, offsets,
                                           self.fact_gate, lo=lo)
            probe = decision.probe
            found["fact_gate"] = {"action": decision.action, "threshold": self.fact_gate,
                                  "probe_nll": probe and probe.nll,
                                  "words": probe and probe.words}
            if decision.action == "re-prefilled":
                return result, found
        if self.gate is not None:
            specials = tokens[:1] if self.bos is not None and tokens[0] == self.bos else []
            result, decision = judge_switch(self.target, result, tokens, self.gate, specials,
                                            [self.translator])
            if decision is not None:
                found["gate"] = decision.to_dict()
        return result, found

"""One switch against a re-prefill of the same context, side by side: the
`switch` and `demo` commands' measurement.

The source has read the context during its turn, so its cache is given and not
timed; the switch's time to first token is the translation plus the target's
first step, the re-prefill's is mlx-lm's ``stream_generate`` from the tokens.
"""

import statistics
import time
from typing import Optional

import mlx.core as mx
from mlx_lm.generate import stream_generate

from ..chat.gate import guard_facts, judge_switch
from ..models.cache import prefill
from ..switching.api import RecomputeBudget, switch, switch_text
from ..switching.generate import generate_after_switch
from ..switching.kernel import check_fits
from ..switching.recompute import token_offsets
from ..translator.align import align_text, tokenize_with_offsets


def first_token_time(responses, on_text=None):
    """Consume a stream_generate iterator; return (seconds to first token, tokens, text).
    ``on_text(segment)``, when given, receives each response's text as it arrives
    (after the first token's time is taken)."""
    t0 = time.perf_counter()
    first, toks, text = None, [], ""
    for r in responses:
        if first is None:
            first = time.perf_counter() - t0
        toks.append(r.token)
        text += r.text
        if on_text is not None and r.text:
            on_text(r.text)
    return first, toks, text


def run_switch(src, src_tok, tgt, tgt_tok, translator, context, max_tokens, compare, repeats=1,
               gate=None, recompute: Optional[float] = None, fact_gate: Optional[float] = None,
               recompute_max: Optional[int] = None, sampler=None, on_text=None):
    """Switch a context from src to tgt and generate; optionally re-prefill too.

    ``context``: token ids (shared tokenizer) or text (any pair). ``gate``: a
    QualityGate judging the switch (its native tail, at least ``gate.tokens``).
    ``recompute``, ``recompute_max``: the share of the context the target recomputes
    on fact-like words, and the most positions (None: the translator's defaults).
    ``fact_gate``: a threshold for the switched cache's fact probe
    (chat.gate.guard_facts), above which the target re-prefills instead.
    ``sampler``: mlx-lm sampler for both answers (None: greedy). ``on_text(kind,
    segment)``: called with each segment of the first run's answers as they are
    generated, ``kind`` "switch" or "prefill" (for printing them as they come).
    Returns a dict of timings (medians over ``repeats``) and the answers.
    """
    tail = translator.spec.native_tail if gate is None else max(
        gate.tokens, translator.spec.native_tail)
    if translator.cross_tokenizer:
        tokenized = tokenize_with_offsets(src_tok, context)  # the source reads these
        a = align_text(src_tok, tgt_tok, context, translator.spec.native_prefix, tokenized)
        source_tokens, target_tokens = a.source_tokens, a.target_tokens
        text = (context, a.target_offsets)

        def translate(source_cache):
            return switch_text(src, src_tok, tgt, tgt_tok, translator, context, source_cache,
                               native_tail=tail, source_tokens=tokenized, recompute=recompute,
                               recompute_max=recompute_max)
    else:
        tokens = src_tok.encode(context) if isinstance(context, str) else list(context)
        source_tokens, target_tokens = tokens[:-1], tokens

        text = None
        budget = RecomputeBudget.of(translator, recompute, recompute_max)
        if budget.share or fact_gate is not None:  # the text the fact-like words are found in
            text = ((context, tokenize_with_offsets(src_tok, context)[1])
                    if isinstance(context, str) else token_offsets(src_tok, tokens))

        def translate(source_cache):
            return switch(src, tgt, translator, tokens, source_cache=source_cache,
                          native_tail=tail, recompute=budget.share, text=text,
                          recompute_max=budget.most)

    bos = getattr(tgt_tok, "bos_token_id", None)
    specials = target_tokens[:1] if bos is not None and target_tokens[0] == bos else []
    decisions = []

    facts = []

    def do_switch(source_cache):
        result = translate(source_cache)
        if fact_gate is not None:
            result, decision = guard_facts(tgt, result, target_tokens, text[0], text[1],
                                           fact_gate, lo=translator.spec.native_prefix)
            facts.append(decision)
            if decision.action == "re-prefilled":
                return result
        if gate is None:
            return result
        result, decision = judge_switch(tgt, result, target_tokens, gate, specials, [translator])
        decisions.append(decision)
        return result

    check_fits(tgt, len(target_tokens))  # before the source's prefill, not after it
    # The source has read the context during its turn: its cache is given, not timed.
    source_cache = prefill(src, mx.array(source_tokens)[None])
    mx.eval([(c.keys, c.values) for c in source_cache])
    switch_times, translate_times, prefill_times = [], [], []
    sampling = {} if sampler is None else {"sampler": sampler}

    def streamed(kind, i):
        if on_text is None or i:
            return None
        return lambda segment: on_text(kind, segment)

    for i in range(repeats):
        result = do_switch(source_cache)
        first, sw_tokens, sw_text = first_token_time(
            generate_after_switch(tgt, tgt_tok, result, max_tokens=max_tokens, **sampling),
            streamed("switch", i),
        )
        translate_times.append(result.translate_s)
        switch_times.append(result.translate_s + first)
        if compare:
            first, pf_tokens, pf_text = first_token_time(
                stream_generate(tgt, tgt_tok, mx.array(target_tokens), max_tokens=max_tokens,
                                **sampling),
                streamed("prefill", i),
            )
            prefill_times.append(first)
    out = {
        "context_tokens": len(target_tokens),
        "translate_s": statistics.median(translate_times),
        "switch_ttft_s": statistics.median(switch_times),
        "switch_answer": sw_text,
        "switch_tokens": sw_tokens,
    }
    if decisions and decisions[-1] is not None:
        out["gate"] = decisions[-1].to_dict()
    if facts:
        probe = facts[-1].probe
        out["fact_gate"] = {"action": facts[-1].action, "threshold": fact_gate,
                            "probe_nll": probe and probe.nll, "words": probe and probe.words}
    if compare:
        out.update(
            prefill_ttft_s=statistics.median(prefill_times),
            prefill_answer=pf_text,
            prefill_tokens=pf_tokens,
            ratio=statistics.median(prefill_times) / statistics.median(switch_times),
            agreeing_prefix=next(
                (i for i, (a, b) in enumerate(zip(sw_tokens, pf_tokens)) if a != b),
                min(len(sw_tokens), len(pf_tokens)),
            ),
        )
    return out

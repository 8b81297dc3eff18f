"""Text in, answer out: the source reads a context, the context is switched to the
target, the target answers; optionally the target re-prefills the same context
and answers too, side by side. The `switch` and `demo` commands are options, this
one call, and printing.

The source has read the context during its turn, so its cache is given and not
timed; the switch's time to first token is the switch (translation, alignment
and the choice of what to recompute) plus the target's first step. The context's
text is aligned once, inside the timed switch.
"""

import statistics
import time
from typing import Callable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
from mlx_lm.generate import stream_generate

from ..errors import KvlingoError
from ..models.cache import prefill
from ..translator.align import tokenize_with_offsets
from .api import SwitchResult, switch, switch_text
from .generate import generate_after_switch
from .kernel import check_fits

# A judge looks at a switch before the target answers on it and may replace it (a
# quality gate that re-prefills): result -> (result to answer from, what it found,
# or None). ``native_tail``: the tail it needs read natively (None: the file's).
Judge = Callable[[SwitchResult], Tuple[SwitchResult, Optional[dict]]]


def prompt_context(tokenizer, prompt: str, cross_tokenizer: bool,
                   chat_template: bool = True) -> Union[str, List[int]]:
    """What the source reads for a user's prompt: across tokenizers the text itself
    (each model tokenizes it; no chat template, which would differ between them);
    with a shared tokenizer its ids, in the tokenizer's chat template as a user
    message when it has one (``chat_template``)."""
    if not prompt.strip():
        raise KvlingoError("The prompt is empty.")
    if cross_tokenizer:
        return prompt
    if chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True)
    else:
        ids = tokenizer.encode(prompt)
    if len(ids) < 2:
        raise KvlingoError("The prompt must be at least 2 tokens long.")
    return list(ids)


def first_token_time(responses, on_text: Optional[Callable[[str], None]] = None):
    """Consume a stream_generate iterator; return (seconds to first token, tokens,
    text). ``on_text``: called with each text segment as it is generated."""
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


def run_switch(src, src_tok, tgt, tgt_tok, translator, context, max_tokens: int,
               compare: bool, repeats: int = 1, judge: Optional[Judge] = None,
               recompute: Optional[float] = None, recompute_max: Optional[int] = None,
               sampler=None, on_text=None, native_tail: Optional[int] = None) -> dict:
    """Switch ``context`` (text, or token ids with a shared tokenizer) from src to
    tgt and generate up to ``max_tokens``; with ``compare``, re-prefill the target
    too. ``judge``: looks at each switch before the answer (see :data:`Judge`).
    ``recompute``, ``recompute_max``, ``native_tail``: as in :func:`switch` (None:
    the translator's defaults). ``sampler``: mlx-lm sampler for both answers (None:
    greedy). ``on_text(kind, segment)``: each segment of the first run's answers as
    it is generated, ``kind`` "switch" or "prefill". Returns a dict of timings
    (medians over ``repeats``), the answers, and what the judge found."""
    source_tokens, text = _source_tokens(src_tok, translator, context)
    n_target = (len(tgt_tok.encode(context)) if isinstance(context, str)
                and translator.cross_tokenizer else len(source_tokens) + 1)
    check_fits(tgt, n_target)  # before the source's prefill, not after it
    source_cache = prefill(src, mx.array(source_tokens)[None])
    mx.eval([(c.keys, c.values) for c in source_cache])
    tail = native_tail if native_tail is not None else getattr(judge, "native_tail", None)

    def do_switch() -> SwitchResult:
        if translator.cross_tokenizer:
            return switch_text(src, src_tok, tgt, tgt_tok, translator, context, source_cache,
                               native_tail=tail, source_tokens=text[1], recompute=recompute,
                               recompute_max=recompute_max)
        return switch(src, tgt, translator, source_tokens + [text[2]], source_cache,
                      native_tail=tail, recompute=recompute, text=text[0],
                      recompute_max=recompute_max, tokenizer=src_tok)

    sampling = {} if sampler is None else {"sampler": sampler}
    switch_times, translate_times, prefill_times, found = [], [], [], None
    for i in range(repeats):
        result = do_switch()
        target_tokens = list(result.context)
        if judge is not None:
            result, found = judge(result)
        first, sw_tokens, sw_text = first_token_time(
            generate_after_switch(tgt, tgt_tok, result, max_tokens=max_tokens, **sampling),
            _streamed(on_text, "switch", i))
        translate_times.append(result.translate_s)
        switch_times.append(result.translate_s + first)
        if compare:
            first, pf_tokens, pf_text = first_token_time(
                stream_generate(tgt, tgt_tok, mx.array(target_tokens), max_tokens=max_tokens,
                                **sampling),
                _streamed(on_text, "prefill", i))
            prefill_times.append(first)
    out = {
        "context_tokens": len(target_tokens),
        "translate_s": statistics.median(translate_times),
        "switch_ttft_s": statistics.median(switch_times),
        "switch_answer": sw_text,
        "switch_tokens": sw_tokens,
    }
    if found:
        out.update(found)
    if compare:
        out.update(
            prefill_ttft_s=statistics.median(prefill_times),
            prefill_answer=pf_text,
            prefill_tokens=pf_tokens,
            ratio=statistics.median(prefill_times) / statistics.median(switch_times),
            agreeing_prefix=_agreeing_prefix(sw_tokens, pf_tokens),
        )
    return out


def _source_tokens(src_tok, translator, context) -> Tuple[List[int], tuple]:
    """The tokens the source reads (the context but its last token, with a shared
    tokenizer: the target's first step reads that one), and what the switch needs
    of the text: (text, offsets) and the last token; or, across tokenizers, the
    source's (ids, offsets), which the switch aligns the target's tokens to."""
    if translator.cross_tokenizer:
        if not isinstance(context, str):
            raise KvlingoError("A cross-tokenizer switch takes the context as text.")
        tokenized = tokenize_with_offsets(src_tok, context)
        return list(tokenized[0]), (None, tokenized)
    if isinstance(context, str):
        ids, offsets = tokenize_with_offsets(src_tok, context)
        text = (context, offsets)
    else:
        ids, text = list(context), None
    if len(ids) < 2:
        raise KvlingoError("A context needs at least 2 tokens to switch.")
    return ids[:-1], (text, None, ids[-1])


def _streamed(on_text, kind: str, i: int):
    if on_text is None or i:
        return None
    return lambda segment: on_text(kind, segment)


def _agreeing_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

"""The target's first decoding step after a switch, and generation after it."""

import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse, generate_step, stream_generate
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .api import SwitchResult


def first_step(target: nn.Module, result: SwitchResult, sampler=None):
    """The target's first decoding step after a switch, done bare: one forward pass
    over ``result.pending`` on ``result.cache`` (LM head on the last position only;
    a deferred recompute in the same pass, ``SwitchResult.read``), then the sampler
    (default greedy) on the log-probabilities. Returns (token id,
    log-probabilities [vocab]); the cache then holds the whole context.

    This is what mlx-lm's ``generate_step`` computes for its first token, without
    its pipelining (which builds and schedules the second step before returning
    the first)."""
    logits = result.read(target)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    token = (sampler or greedy_sampler)(logprobs)
    mx.eval(token, logprobs)
    return token.item(), logprobs[0]


# Generation options the bare first step reproduces exactly; any other option
# (logits processors, a quantized or bounded cache, a draft model) takes mlx-lm's
# own loop from the start.
_FIRST_STEP_OPTIONS = {"max_tokens", "sampler"}


def generate_after_switch(target, tokenizer, result: SwitchResult, **kwargs):
    """Stream the target's answer from a switched cache (mlx-lm ``GenerationResponse``s).

    The first response arrives after one bare forward pass over ``result.pending``
    (:func:`first_step`); the rest comes from mlx-lm's ``generate_step``, so greedy
    output is identical to ``stream_generate`` from the same cache.
    """
    if set(kwargs) - _FIRST_STEP_OPTIONS:
        return stream_generate(target, tokenizer, result.prompt,
                               prompt_cache=result.prompt_cache, **kwargs)
    return _stream_after_switch(target, tokenizer, result, **kwargs)


def _stream_after_switch(target, tokenizer, result: SwitchResult, max_tokens: int = 256,
                         sampler=None):
    """``stream_generate``'s loop (same responses, same stopping rules) over the bare
    first step followed by ``generate_step``."""
    if max_tokens == 0:
        raise ValueError("Maximum number of tokens must be non-zero (use -1 for no limit).")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    detokenizer = tokenizer.detokenizer

    def tokens():
        token, logprobs = first_step(target, result, sampler)
        yield token, logprobs
        rest = max_tokens - 1 if max_tokens > 0 else -1
        yield from generate_step(mx.array([token]), target, max_tokens=rest,
                                 sampler=sampler, prompt_cache=result.cache)

    n_prompt = result.pending.size
    tic = time.perf_counter()
    prompt_tps = 0.0
    token, logprobs = None, None
    for n, (token, logprobs) in enumerate(tokens()):
        if n == 0:
            prompt_tps = n_prompt / (time.perf_counter() - tic)
            tic = time.perf_counter()
        if token in tokenizer.eos_token_ids:
            break
        detokenizer.add_token(token)
        if (n + 1) == max_tokens:
            break
        yield GenerationResponse(
            text=detokenizer.last_segment, token=token, logprobs=logprobs, from_draft=False,
            prompt_tokens=n_prompt, prompt_tps=prompt_tps, generation_tokens=n + 1,
            generation_tps=(n + 1) / (time.perf_counter() - tic),
            peak_memory=mx.get_peak_memory() / 1e9, finish_reason=None,
        )
    detokenizer.finalize()
    yield GenerationResponse(
        text=detokenizer.last_segment, token=token, logprobs=logprobs, from_draft=False,
        prompt_tokens=n_prompt, prompt_tps=prompt_tps, generation_tokens=n + 1,
        generation_tps=(n + 1) / (time.perf_counter() - tic),
        peak_memory=mx.get_peak_memory() / 1e9,
        finish_reason="stop" if token in tokenizer.eos_token_ids else "length",
    )

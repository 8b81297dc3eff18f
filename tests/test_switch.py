"""Switching with mlx-lm's own generation loop, on the built-in pair."""

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate

from mlx_kvlingo.errors import KvlingoError
from mlx_kvlingo.models import cache_length, prefill
from mlx_kvlingo.switch import generate_after_switch, switch
from mlx_kvlingo.translator import Translator

ROOT = Path(__file__).resolve().parents[1]


def identity_translator(model, tokenizer):
    t = Translator.for_models(model, model, tokenizer, tokenizer)
    for m in t.k_maps + t.v_maps:
        m.weight = mx.eye(m.weight.shape[0])
    return t


def test_stream_generate_after_exact_switch_equals_full_prefill(toy_pair):
    _, _, tgt, tok = toy_pair
    t = identity_translator(tgt, tok)
    tokens = tok.encode("Return the sum of the items of the iterable, or start if empty.")
    result = switch(tgt, tgt, t, tokens)
    assert cache_length(result.cache) == len(tokens) - 1
    assert result.last_token.tolist() == tokens[-1:]
    switched = [r.token for r in generate_after_switch(tgt, tok, result, max_tokens=12)]
    native = [r.token for r in stream_generate(tgt, tok, mx.array(tokens), max_tokens=12)]
    assert switched == native and len(native) == 12


def test_switch_uses_the_given_source_cache(toy_pair):
    """The live source cache is what gets translated: a cache of other text changes
    the answer."""
    _, _, tgt, tok = toy_pair
    t = identity_translator(tgt, tok)
    tokens = mx.array(tok.encode("Open the file and return a stream; raise OSError on failure."))
    other = mx.array(tok.encode("A frozen set of hashable items, built from an iterable ok."))
    n = min(tokens.size, other.size)
    tokens, other = tokens[:n], other[:n]
    own = switch(tgt, tgt, t, tokens, source_cache=prefill(tgt, tokens[None, :-1]))
    wrong = switch(tgt, tgt, t, tokens, source_cache=prefill(tgt, other[None, :-1]))
    a = tgt(own.last_token[None], cache=own.cache)
    b = tgt(wrong.last_token[None], cache=wrong.cache)
    assert mx.abs(a - b).max().item() > 1e-2


def test_switch_rejects_bad_input(toy_pair):
    src, stok, tgt, ttok = toy_pair
    t = Translator.for_models(src, tgt, stok, ttok)
    with pytest.raises(KvlingoError, match="at least 2 tokens"):
        switch(src, tgt, t, [5])
    with pytest.raises(KvlingoError, match="holds 3 tokens"):
        switch(src, tgt, t, list(range(10, 20)), source_cache=prefill(src, mx.array([[1, 2, 3]])))


@pytest.mark.slow
def test_example_script_runs():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "switch_models.py")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "translated" in proc.stdout and "Return a new list" in proc.stdout


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_retained_spans_rebuild_the_native_cache(arch):
    """Multi-turn: the target translates only the spans the other model wrote, and
    processes its own turns itself; with an exact translator the result equals a
    native prefill of the whole transcript."""
    from mlx_kvlingo.switch import translate_span

    from tiny import tiny_model

    m = tiny_model(arch)
    t = Translator.for_models(m, m)
    for lin in t.k_maps + t.v_maps:
        lin.weight = mx.eye(lin.weight.shape[0])
    tokens = mx.random.randint(0, 97, (1, 40), key=mx.random.key(4))
    source_cache = prefill(m, tokens[:, :30])  # the other model read/wrote 0..29
    cache = translate_span(m, m, t, source_cache, None, tokens, 12)  # its turn: 0..11
    cache = prefill(m, tokens[:, 12:20], cache)  # the target's own turn: 12..19
    cache = translate_span(m, m, t, source_cache, cache, tokens, 30)  # other's turn: 20..29
    assert cache_length(cache) == 30
    got = m(tokens[:, 30:], cache=cache)
    native = m(tokens)[:, 30:]
    assert mx.abs(got - native).max().item() < 1e-4


def test_context_longer_than_the_target_allows_is_refused():
    from tiny import tiny_model

    m = tiny_model("qwen2", max_position_embeddings=16)
    t = Translator.for_models(m, m)
    with pytest.raises(KvlingoError, match="at most 16 positions"):
        switch(m, m, t, list(range(1, 21)))

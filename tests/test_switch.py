"""Switching with mlx-lm's own generation loop, on the built-in pair."""

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate
from tiny import identity_translator

from mlx_kvlingo.errors import KvlingoError
from mlx_kvlingo.models.cache import cache_length, prefill
from mlx_kvlingo.switching.api import switch
from mlx_kvlingo.switching.generate import generate_after_switch
from mlx_kvlingo.translator.maps import Translator

ROOT = Path(__file__).resolve().parents[1]


def test_stream_generate_after_exact_switch_equals_full_prefill(toy_pair):
    _, _, tgt, tok = toy_pair
    t = identity_translator(tgt, tok)
    tokens = tok.encode("Return the sum of the items of the iterable, or start if empty.")
    result = switch(tgt, tgt, t, tokens)
    assert cache_length(result._cache) == len(tokens) - 1
    assert result.prompt[-1:].tolist() == tokens[-1:]
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
    a = tgt(own.prompt[-1:][None], cache=own._cache)
    b = tgt(wrong.prompt[-1:][None], cache=wrong._cache)
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
    from tiny import tiny_model

    from mlx_kvlingo.switching.api import translate_span

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


def test_the_switch_command_refuses_a_long_context_before_any_prefill(monkeypatch):
    """`mlx-kvlingo switch` checks the length first: a too-long prompt fails at once,
    not after the source has read all of it."""
    from tiny import tiny_model

    from mlx_kvlingo.switching import pipeline as compare
    from mlx_kvlingo.switching.pipeline import run_switch

    def no_prefill(*args, **kwargs):
        raise AssertionError("prefilled before the length check")

    monkeypatch.setattr(compare, "prefill", no_prefill)
    m = tiny_model("qwen2", max_position_embeddings=16)
    t = Translator.for_models(m, m)
    with pytest.raises(KvlingoError, match="at most 16 positions"):
        run_switch(m, None, m, None, t, list(range(1, 21)), max_tokens=1, compare=False)


# ---------------------------------------------------------------------------
# The fast path, the bare first step and the native tail


def _random_translator(src, tgt, seed=0, **kw):
    mx.random.seed(seed)
    t = Translator.for_models(src, tgt, **kw)
    mx.eval(t.parameters())
    return t


def _layers(cache):
    from mlx_kvlingo.models.cache import read_layer

    return [read_layer(c) for c in cache]


@pytest.mark.parametrize("arch, token_layers", [("qwen3", ()), ("llama", ()),
                                                 ("llama_traditional", ()), ("gemma3_text", ()),
                                                 ("gemma3_text", (0, 2, 5))])
def test_fresh_cache_path_equals_the_layer_by_layer_path(arch, token_layers):
    """Translating into a fresh cache (buffers written in place, fused rotations,
    sliding layers translating only their window) builds the same cache as
    extending an empty one through the general path (where sliding layers map only
    the rows they keep, token maps included), for a random translator."""
    from mlx_lm.models.cache import make_prompt_cache
    from tiny import tiny_model

    from mlx_kvlingo.switching.api import translate_aligned
    from mlx_kvlingo.translator.align import NATIVE, identity_alignment

    m = tiny_model(arch)
    t = _random_translator(m, m, sources_per_layer=2 if arch == "llama" else 1,
                           token_layers=token_layers)
    tokens = mx.random.randint(0, 97, (1, 30), key=mx.random.key(2))
    source_cache = prefill(m, tokens[:, :29])
    # A source that read 59 tokens for the target's 30 (a cross-tokenizer pair whose
    # source tokenizes finer): its rows are gathered before the maps.
    long_source = prefill(m, mx.random.randint(0, 97, (1, 59), key=mx.random.key(3)))
    cases = [(None, source_cache),  # shared tokenizer
             ([NATIVE, 1, 1, 2, 5, 4] + list(range(6, 29)), source_cache),  # mapped, gathered
             ([NATIVE] + [2 * i for i in range(1, 29)] + [58], long_source)]  # gathered, mapped
    for index, source_cache in cases:
        a = identity_alignment(tokens[0].tolist(), 1)
        if index is not None:
            a.source_index = index + ([29] if len(index) < 30 else [])
        fast = translate_aligned(m, m, t, source_cache, None, a, 29)
        slow = translate_aligned(m, m, t, source_cache, make_prompt_cache(m), a, 29)
        for (fk, fv, fs), (sk, sv, ss) in zip(_layers(fast), _layers(slow)):
            assert fs == ss and fk.shape == sk.shape
            assert mx.abs(fk - sk).max().item() < 1e-4 and mx.abs(fv - sv).max().item() < 1e-4
        # ... and both continue alike.
        rest = tokens[:, 29:]
        assert mx.abs(m(rest, cache=fast) - m(rest, cache=slow)).max().item() < 1e-4


@pytest.mark.parametrize("arch", ["qwen2", "gemma3_text"])
def test_native_tail_with_an_exact_translator_equals_a_native_prefill(arch):
    from tiny import tiny_model

    from mlx_kvlingo.switching.api import translate_context
    from mlx_kvlingo.switching.generate import first_step

    m = tiny_model(arch)
    t = Translator.for_models(m, m)
    for lin in t.k_maps + t.v_maps:
        lin.weight = mx.eye(lin.weight.shape[0])
    tokens = mx.random.randint(0, 97, (1, 20), key=mx.random.key(5))
    native = m(tokens)[0, -1]
    for tail in (0, 1, 6, 19, 40):
        result = switch(m, m, t, tokens, native_tail=tail)
        assert cache_length(result._cache) + result.pending.size == 20
        assert result.pending.size == min(tail, 19) + 1
        token, logprobs = first_step(m, result)
        assert token == mx.argmax(native).item()
        assert mx.abs(logprobs - (native - mx.logsumexp(native))).max().item() < 1e-4
        cache = translate_context(m, m, t, tokens, native_tail=tail)
        assert cache_length(cache) == 19
        assert mx.abs(m(tokens[:, -1:], cache=cache)[0, -1] - native).max().item() < 1e-4


def test_a_native_tail_of_the_whole_context_is_a_native_prefill():
    """With any translator, a tail covering every position translates nothing."""
    from tiny import tiny_model

    from mlx_kvlingo.switching.api import translate_context
    from mlx_kvlingo.switching.generate import first_step

    m = tiny_model("qwen3")
    t = _random_translator(m, m)
    tokens = mx.random.randint(0, 97, (1, 16), key=mx.random.key(6))
    result = switch(m, m, t, tokens, native_tail=15)
    assert cache_length(result._cache) == 0 and result.pending.size == 16
    _, logprobs = first_step(m, result)
    native = m(tokens)[0, -1]
    assert mx.abs(logprobs - (native - mx.logsumexp(native))).max().item() < 1e-4
    cache = translate_context(m, m, t, tokens, native_tail=15)
    for (k, v, _), (nk, nv, _) in zip(_layers(cache), _layers(prefill(m, tokens[:, :15]))):
        assert mx.abs(k - nk).max().item() < 1e-4 and mx.abs(v - nv).max().item() < 1e-4


def test_native_tail_positions_read_the_translated_ones():
    """What is exact about a tail on top of an inexact translation: its layer-0 K/V
    (they depend only on its tokens and positions), not deeper layers (the tail
    attends to translated positions), and the translated positions are untouched."""
    from tiny import tiny_model

    from mlx_kvlingo.switching.api import translate_context

    m = tiny_model("llama")
    t = _random_translator(m, m)
    tokens = mx.random.randint(0, 97, (1, 24), key=mx.random.key(7))
    tail = 5
    with_tail = _layers(translate_context(m, m, t, tokens, native_tail=tail))
    without = _layers(translate_context(m, m, t, tokens, native_tail=0))
    native = _layers(prefill(m, tokens[:, :23]))
    lo = 23 - tail
    k0, v0, _ = with_tail[0]
    assert mx.abs(k0[..., lo:, :] - native[0][0][..., lo:, :]).max().item() < 1e-4
    assert mx.abs(v0[..., lo:, :] - native[0][1][..., lo:, :]).max().item() < 1e-4
    assert mx.abs(with_tail[-1][1][..., lo:, :] - native[-1][1][..., lo:, :]).max().item() > 1e-3
    for (k, v, _), (wk, wv, _) in zip(with_tail, without):
        assert mx.abs(k[..., :lo, :] - wk[..., :lo, :]).max().item() < 1e-5
        assert mx.abs(v[..., :lo, :] - wv[..., :lo, :]).max().item() < 1e-5


def test_native_tail_defaults_to_the_translator_and_round_trips(tmp_path):
    from tiny import tiny_model

    from mlx_kvlingo.errors import TranslatorFileError
    from mlx_kvlingo.translator.maps import load_translator

    m = tiny_model("qwen2")
    t = _random_translator(m, m)
    t.spec.native_tail = 4
    tokens = mx.random.randint(0, 97, (1, 12), key=mx.random.key(8))
    assert switch(m, m, t, tokens).pending.size == 5
    assert switch(m, m, t, tokens, native_tail=0).pending.size == 1
    t.save(tmp_path / "t.safetensors")
    assert load_translator(tmp_path / "t.safetensors").spec.native_tail == 4
    t.spec.native_tail = -1
    t.save(tmp_path / "bad.safetensors")
    with pytest.raises(TranslatorFileError, match="native_tail"):
        load_translator(tmp_path / "bad.safetensors")
    with pytest.raises(KvlingoError, match="native_tail"):
        switch(m, m, t, tokens, native_tail=-2)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "mistral", "gemma3_text"])
def test_last_logits_equal_the_models_own_last_position(arch):
    from mlx_lm.models.cache import make_prompt_cache
    from tiny import tiny_model

    from mlx_kvlingo.models.cache import last_logits

    m = tiny_model(arch)
    tokens = mx.random.randint(0, 97, (1, 9), key=mx.random.key(9))
    cache = prefill(m, tokens[:, :4])
    got = last_logits(m, tokens[:, 4:], cache)
    want = m(tokens)[:, -1:, :]
    assert got.shape == want.shape and mx.abs(got - want).max().item() < 1e-4
    assert mx.abs(last_logits(m, tokens, make_prompt_cache(m)) - want).max().item() < 1e-4


@pytest.mark.parametrize("tail", [0, 3])
def test_generate_after_switch_streams_what_mlx_lm_streams(toy_pair, tail):
    """The bare first step then generate_step give the same responses as mlx-lm's
    stream_generate from the same translated cache (random maps, native tail),
    including the stop reason; options it does not reproduce take mlx-lm's loop."""
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    src, stok, tgt, ttok = toy_pair
    t = _random_translator(src, tgt, source_tokenizer=stok, target_tokenizer=ttok)
    tokens = stok.encode("Return the number of items in a container, or raise TypeError.")
    for kwargs in ({"max_tokens": 10}, {"max_tokens": 1}, {"max_tokens": 6, "sampler": make_sampler(0.0)},
                   {"max_tokens": 5, "logits_processors": make_logits_processors(repetition_penalty=1.3)}):
        ours = list(generate_after_switch(tgt, ttok, switch(src, tgt, t, tokens, native_tail=tail), **kwargs))
        r = switch(src, tgt, t, tokens, native_tail=tail)
        theirs = list(stream_generate(tgt, ttok, r.pending, prompt_cache=r._cache, **kwargs))
        assert [(x.token, x.text, x.finish_reason) for x in ours] == [
            (x.token, x.text, x.finish_reason) for x in theirs]
        assert ours[-1].generation_tokens == theirs[-1].generation_tokens


def test_switch_runs_on_worker_threads():
    """The switch's second stream is thread-local: a switch on another thread (a
    server's MLX thread) works and builds the same cache."""
    import threading

    from tiny import tiny_model

    from mlx_kvlingo.chat.session import finish_thread

    m = tiny_model("qwen3")
    t = _random_translator(m, m)
    tokens = mx.random.randint(0, 97, (1, 20), key=mx.random.key(10))
    here = switch(m, m, t, tokens)
    out = {}

    def work():
        try:
            r = switch(m, m, t, tokens)
            out["diff"] = max(mx.abs(a.keys - b.keys).max().item() for a, b in zip(r._cache, here._cache))
        finally:
            finish_thread()

    for _ in range(2):
        th = threading.Thread(target=work)
        th.start()
        th.join()
        assert out.pop("diff") < 1e-6


def test_a_switch_holds_at_most_one_layer_of_intermediates():
    """Peak memory of a switch: the target cache it builds plus one layer's source
    features and map outputs (the bound), however many layers the model has:
    the loop must not queue every layer's work at once, and the two units it keeps
    in flight are a layer's keys or values, not whole layers."""
    from tiny import tiny_model

    from mlx_kvlingo.switching.api import switch

    model = tiny_model("llama", num_hidden_layers=16, hidden_size=256, num_attention_heads=8,
                       num_key_value_heads=8, intermediate_size=256)
    t = Translator.for_models(model, model)
    tokens = mx.random.randint(0, 97, (1, 1024))
    source_cache = prefill(model, tokens[:, :-1])
    mx.eval([(c.keys, c.values) for c in source_cache])
    switch(model, model, t, tokens, source_cache=source_cache)  # warm-up: kernels, tables
    active = mx.get_active_memory()
    mx.reset_peak_memory()
    result = switch(model, model, t, tokens, source_cache=source_cache)
    extra = mx.get_peak_memory() - active
    cache = sum(c.keys.nbytes + c.values.nbytes for c in result._cache)
    # One layer: K and V source features and K and V map outputs, float32.
    layer = 4 * 1024 * (2 * t.k_maps[0].weight.shape[1] + 2 * t.k_maps[0].weight.shape[0])
    assert extra <= cache + layer, (extra - cache) / layer

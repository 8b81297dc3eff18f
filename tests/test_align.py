"""Cross-tokenizer alignment and translation through it."""

import mlx.core as mx
import pytest
from tiny import tiny_model

from mlx_kvlingo.models.cache import prefill
from mlx_kvlingo.switching.api import translate_aligned, translate_span
from mlx_kvlingo.translator.align import (
    NATIVE,
    align_offsets,
    align_text,
    identity_alignment,
    tokenize_with_offsets,
)
from mlx_kvlingo.translator.maps import Translator

TEXT = ("The quick brown fox jumps over the lazy dog. def parse(value): return int(value)\n"
        "    Raise ValueError if the string is not a number; otherwise return it.\n")


def _bpe(vocab_size, bos=None):
    """A small byte-level BPE tokenizer (transformers fast tokenizer) trained on TEXT."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<bos>"] if bos else []
    tok.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>" if bos else None)


@pytest.fixture(scope="module")
def tokenizers():
    return _bpe(300), _bpe(330, bos=True)


def test_each_target_token_reads_the_source_token_holding_its_last_char(tokenizers):
    src, tgt = tokenizers
    a = align_text(src, tgt, TEXT, native_prefix=1)
    s_off = src(TEXT, return_offsets_mapping=True)["offset_mapping"]
    t_off = tgt(TEXT, return_offsets_mapping=True)["offset_mapping"]
    assert a.target_tokens[0] == tgt.bos_token_id and a.source_index[0] == NATIVE
    assert a.native_prefix == 1
    assert len(a.source_tokens) != len(a.target_tokens)  # really different splits
    for j in range(1, len(t_off)):
        i = a.source_index[j]
        last = t_off[j][1] - 1
        assert s_off[i][0] <= last < s_off[i][1]


def test_alignment_rules():
    # Target token 0 is BOS (no chars): native. A gap in the source's coverage falls
    # back to the last source token starting before the character.
    src = [(0, 3), (3, 4), (6, 9)]
    tgt = [(0, 0), (0, 2), (2, 5), (5, 9)]
    # A leading textless target token pairs with source token 0 unless native;
    # a textless one after text has no counterpart.
    assert align_offsets(src, tgt, native_prefix=0) == [0, 0, 1, 2]
    assert align_offsets(src, tgt + [(9, 9)], native_prefix=1)[-1] == NATIVE
    assert align_offsets(src, tgt, native_prefix=2) == [NATIVE, NATIVE, 1, 2]
    assert identity_alignment([5, 6, 7], 1).source_index == [NATIVE, 1, 2]
    runs = identity_alignment(list(range(6)), 2).runs(1, 5)
    assert runs == [(True, 1, 2), (False, 2, 5)]


def _align_offsets_loop(source_offsets, target_offsets, native_prefix):
    """The rule written as a plain loop (align_offsets is vectorised)."""
    import bisect

    texty = [(a, b, i) for i, (a, b) in enumerate(source_offsets) if b > a]
    starts = [a for a, _, _ in texty]
    out, seen_text = [], False
    for j, (a, b) in enumerate(target_offsets):
        seen_text = seen_text or b > a
        if j < native_prefix or not texty:
            out.append(NATIVE)
        elif b <= a:
            out.append(0 if not seen_text else NATIVE)
        else:
            k = bisect.bisect_right(starts, b - 1) - 1
            out.append(texty[k][2] if k >= 0 else NATIVE)
    return out


def _random_offsets(rng, length):
    """Offsets of a random tokenization of ``length`` characters, with textless
    tokens (specials) and a few uncovered characters (whitespace) mixed in."""
    out, pos = [], 0
    while pos < length:
        if rng.random() < 0.1:
            out.append((pos, pos))
            continue
        pos += rng.random() < 0.1  # a character no token covers
        end = min(pos + rng.randint(1, 5), length)
        if end > pos:
            out.append((pos, end))
        pos = end
    return out


def test_vectorised_alignment_matches_the_rule_on_random_tokenizations():
    import random

    rng = random.Random(0)
    for trial in range(300):
        length = rng.randint(0, 60)
        src, tgt = _random_offsets(rng, length), _random_offsets(rng, length)
        for k in (0, 1, 3):
            assert align_offsets(src, tgt, k) == _align_offsets_loop(src, tgt, k), (src, tgt, k)


def test_offsets_from_the_rust_tokenizer_equal_the_hf_call(tokenizers):
    from mlx_kvlingo.translator.align import tokenize_with_offsets

    for tok in tokenizers:
        for special in (True, False):
            enc = tok(TEXT, return_offsets_mapping=True, add_special_tokens=special)
            ids, offsets = tokenize_with_offsets(tok, TEXT, special)
            assert ids == enc["input_ids"]
            assert [tuple(o) for o in offsets] == [tuple(o) for o in enc["offset_mapping"]]


def test_aligned_path_with_identity_alignment_is_exact():
    """translate_aligned (gather + native runs) equals the shared-token path and the
    native prefill when the alignment is the identity and the maps exact."""
    m = tiny_model("qwen3")
    t = Translator.for_models(m, m)
    for lin in t.k_maps + t.v_maps:
        lin.weight = mx.eye(lin.weight.shape[0])
    tokens = mx.random.randint(0, 97, (1, 24), key=mx.random.key(9))
    a = identity_alignment(tokens[0].tolist(), 2)
    a.source_index[7] = NATIVE  # a native token inside the context (e.g. a template marker)
    source_cache = prefill(m, tokens[:, :20])
    cache = translate_aligned(m, m, t, source_cache, None, a, 20)
    native = m(tokens)[:, 20:]
    assert mx.abs(m(tokens[:, 20:], cache=cache) - native).max().item() < 1e-4
    shared = translate_span(m, m, t, source_cache, None, tokens, 20)
    assert mx.abs(m(tokens[:, 20:], cache=shared) - native).max().item() < 1e-4


def test_gathered_features_come_from_the_aligned_source_positions():
    """With a permuted alignment, the translated cache holds the source's K/V of the
    positions named by the alignment (checked through an exact translator)."""
    from mlx_kvlingo.models.cache import cache_features

    m = tiny_model("llama")
    t = Translator.for_models(m, m, native_prefix=0)
    for lin in t.k_maps + t.v_maps:
        lin.weight = mx.eye(lin.weight.shape[0])
    tokens = mx.random.randint(0, 97, (1, 12), key=mx.random.key(3))
    source_cache = prefill(m, tokens)
    a = identity_alignment(tokens[0].tolist(), 0)
    a.source_index = [0, 2, 2, 5, 1, 7, 7, 7, 3, 11, 10, 4]
    cache = translate_aligned(m, m, t, source_cache, None, a, 12)
    sk, sv, _ = cache_features(m, source_cache)
    tk, tv, _ = cache_features(m, cache)
    rows = mx.array(a.source_index)
    for layer in range(len(m.layers)):
        assert mx.allclose(tv[layer], sv[layer][:, rows], atol=1e-5)
        assert mx.allclose(tk[layer], sk[layer][:, rows], atol=1e-4)


def test_with_native_tail_marks_the_last_positions_before_the_end():
    a = identity_alignment(list(range(10)), 1)
    assert a.with_native_tail(3).source_index == [NATIVE] + list(range(1, 6)) + [NATIVE] * 3 + [9]
    assert a.with_native_tail(2, end=5).source_index == (
        [NATIVE, 1, 2, NATIVE, NATIVE] + list(range(5, 10)))
    assert a.with_native_tail(0) is a
    assert a.with_native_tail(50).source_index == [NATIVE] * 9 + [9]
    runs = a.with_native_tail(3).runs(0, 9)
    assert runs == [(True, 0, 1), (False, 1, 6), (True, 6, 9)]


def test_switch_text_leaves_the_native_tail_in_target_tokens(tokenizers):
    """Different tokenizers: the last m target tokens (and the last one) are left for
    the target's first step; a tail over the whole context is a native prefill."""
    from mlx_kvlingo.models.cache import cache_length
    from mlx_kvlingo.switching.api import switch_text
    from mlx_kvlingo.switching.generate import first_step

    stok, ttok = tokenizers
    src, tgt = tiny_model("llama", vocab_size=300), tiny_model("qwen3", seed=1, vocab_size=330)
    t = Translator.for_models(src, tgt, stok, ttok)
    ids = ttok(TEXT)["input_ids"]
    r = switch_text(src, stok, tgt, ttok, t, TEXT, native_tail=4)
    assert r.pending.tolist() == ids[-5:] and cache_length(r._cache) == len(ids) - 5
    r = switch_text(src, stok, tgt, ttok, t, TEXT, native_tail=len(ids))
    _, logprobs = first_step(tgt, r)
    native = tgt(mx.array(ids)[None])[0, -1]
    assert mx.abs(logprobs - (native - mx.logsumexp(native))).max().item() < 1e-4


def test_switch_text_with_the_sources_tokenization_given_is_the_same_switch(tokenizers):
    """A caller that prefilled the source passes its (ids, offsets): the switch
    skips that tokenization and builds the same cache; offsets that do not fit the
    text change the alignment (so they are really used)."""
    from mlx_kvlingo.models.cache import cache_features, prefill
    from mlx_kvlingo.switching.api import switch_text

    stok, ttok = tokenizers
    src, tgt = tiny_model("llama", vocab_size=300), tiny_model("qwen3", seed=1, vocab_size=330)
    t = Translator.for_models(src, tgt, stok, ttok, native_prefix=0)
    tokenized = tokenize_with_offsets(stok, TEXT)
    source_cache = prefill(src, mx.array(tokenized[0])[None])
    plain = switch_text(src, stok, tgt, ttok, t, TEXT, source_cache=source_cache)
    given = switch_text(src, stok, tgt, ttok, t, TEXT, source_cache=source_cache,
                        source_tokens=tokenized)
    keys = [cache_features(tgt, r._cache)[0] for r in (plain, given)]
    assert all(mx.array_equal(a, b) for a, b in zip(*keys))
    shifted = (tokenized[0], [(0, 1)] * len(tokenized[1]))  # every target token -> source 0
    other = switch_text(src, stok, tgt, ttok, t, TEXT, source_cache=source_cache,
                        source_tokens=shifted)
    assert not mx.array_equal(cache_features(tgt, other._cache)[0][1], keys[0][1])



@pytest.mark.parametrize("native_layer0", [False, True])
def test_switch_text_builds_the_cache_the_general_path_builds(tokenizers, native_layer0):
    """switch_text maps one layer over every source row before it aligns the text
    (beside the tokenization), then gathers its rows: the same cache as translating
    span by span into an empty cache, and the early layer is really used."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_kvlingo.models.cache import prefill, read_layer
    from mlx_kvlingo.switching.api import switch_text, translate_aligned
    from mlx_kvlingo.switching.kernel import map_early_layer

    stok, ttok = tokenizers
    src, tgt = tiny_model("llama", vocab_size=300), tiny_model("qwen3", seed=1, vocab_size=330)
    t = Translator.for_models(src, tgt, stok, ttok)
    t.spec.native_layer0 = native_layer0
    source_cache = prefill(src, mx.array(tokenize_with_offsets(stok, TEXT)[0])[None])
    early = map_early_layer(src, tgt, t, source_cache)
    assert early is not None and early.layer == (1 if native_layer0 else 0)
    r = switch_text(src, stok, tgt, ttok, t, TEXT, source_cache=source_cache, native_tail=0)
    a = align_text(stok, ttok, TEXT, t.spec.native_prefix)
    end = len(a.target_tokens) - 1
    slow = translate_aligned(src, tgt, t, source_cache, make_prompt_cache(tgt), a, end,
                             native_tail=0)
    for c, d in zip(r._cache, slow):
        (fk, fv, fs), (sk, sv, ss) = read_layer(c), read_layer(d)
        assert fs == ss and fk.shape == sk.shape
        assert mx.abs(fk - sk).max().item() < 1e-4 and mx.abs(fv - sv).max().item() < 1e-4


def test_switch_text_refuses_a_source_cache_shorter_than_the_text(tokenizers):
    """Refused by name, not read past: the early layer's gather alone would not notice."""
    from mlx_kvlingo.errors import KvlingoError
    from mlx_kvlingo.switching.api import switch_text

    stok, ttok = tokenizers
    src, tgt = tiny_model("llama", vocab_size=300), tiny_model("qwen3", seed=1, vocab_size=330)
    t = Translator.for_models(src, tgt, stok, ttok)
    ids = tokenize_with_offsets(stok, TEXT)[0]
    short = prefill(src, mx.array(ids[: len(ids) // 2])[None])
    with pytest.raises(KvlingoError, match="source cache holds"):
        switch_text(src, stok, tgt, ttok, t, TEXT, source_cache=short, native_tail=0)


def test_a_switch_chosen_by_the_sources_reading_across_tokenizers(tokenizers):
    """select='source' across tokenizers: the source's scores are carried to the
    target's tokens by characters; with a recompute the target reads the chosen
    positions itself, not those its own reading would choose."""
    from mlx_kvlingo.switching.api import switch_text
    from mlx_kvlingo.switching.query import source_scores

    stok, ttok = tokenizers
    src, tgt = tiny_model("llama", vocab_size=300), tiny_model("qwen3", seed=1, vocab_size=330)
    t = Translator.for_models(src, tgt, stok, ttok)
    t.spec.native_tail, t.spec.recompute, t.spec.recompute_max = 2, 0.2, 0
    r = switch_text(src, stok, tgt, ttok, t, TEXT, select="source")
    assert r.deferred and sum(b - a for a, b in r.deferred) <= int(0.2 * len(r.context))
    a = align_text(stok, ttok, TEXT, t.spec.native_prefix)
    assert a.source_offsets is not None
    cache = prefill(src, mx.array(a.source_tokens)[None])
    scores = source_scores(src, cache, a, 1, len(a.target_tokens) - 3)
    assert scores.shape == (len(a.target_tokens) - 4,) and scores.max() > 0
    assert switch_text(src, stok, tgt, ttok, t, TEXT, select="question").deferred != r.deferred

"""Sessions whose models use different tokenizers (offline, built-in pair and tiny models)."""

import mlx.core as mx
import pytest
from tiny import identity_translator, native_greedy

from mlx_kvlingo.chat.session import Session
from mlx_kvlingo.chat.transcript import TEMPLATE
from mlx_kvlingo.errors import KvlingoError
from mlx_kvlingo.models.geometry import tokenizer_fingerprint
from mlx_kvlingo.models.load import load
from mlx_kvlingo.translator.maps import Translator

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def identity(model, tok_a, tok_b):
    t = identity_translator(model, tok_a, tok_b)
    assert t.cross_tokenizer
    return t


def assert_greedy_under_native(model, tokens, start, tol=1e-3):
    """Every token from ``start`` on is a greedy choice of the model given a native
    prefill of everything before it: its log-prob is within ``tol`` of the best.
    (Comparing with a fresh greedy run instead fails on near-ties, where float
    error of ~1e-5 through an exact translation picks the other of two tokens.)"""
    logits = model(mx.array(tokens[:-1])[None])[0].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.array(tokens[start:])
    rows = lp[start - 1:]
    gap = rows.max(axis=-1) - mx.take_along_axis(rows, chosen[:, None], axis=-1)[:, 0]
    assert gap.max().item() < tol, gap.tolist()


@pytest.fixture(scope="module")
def twin_tokenizers(toy_pair_dirs):
    """The built-in target under two tokenizers that split text alike but differ
    (one has an extra special token): the session must treat them as different
    tokenizers, and every translation through an identity map is then exact."""
    model, tok_a = load(toy_pair_dirs[1])
    _, tok_b = load(toy_pair_dirs[1])
    tok_b._tokenizer.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    assert tokenizer_fingerprint(tok_a) != tokenizer_fingerprint(tok_b)
    return model, tok_a, tok_b


QUESTIONS = ["Return the sum of the items.", "Open the file and return a stream.",
             "Close the file.", "Raise ValueError if empty."]


def test_cross_tokenizer_turns_equal_native_prefill_with_exact_maps(twin_tokenizers):
    m, ta, tb = twin_tokenizers
    s = Session({"a": (m, ta), "b": (m, tb)},
                {("a", "b"): identity(m, ta, tb), ("b", "a"): identity(m, tb, ta)},
                chat_template=False)
    assert s.cross_tokenizer
    for i, q in enumerate(QUESTIONS):
        name = "ab"[i % 2]
        r = s.generate(name, q, max_tokens=8)
        view = s.transcript_of(name)
        start = r.context_tokens
        # The model's own answer: each id it generated is the greedy choice a native
        # prefill of its own view of the conversation gives.
        assert r.generated >= 1
        assert_greedy_under_native(m, view.tokens[:start + r.generated], start)
        assert view.processed[name] == len(view)
        # Each generated token's characters, inside the answer's decoded text: the
        # last one ends where that text ends (what aligns the other view to it).
        answer = s.tokenizer_of(name).decode(view.tokens[start:start + r.generated],
                                             skip_special_tokens=True)
        assert view.offsets[start + r.generated - 1][1] == len(answer) > 0
        if i:
            # The other model's text arrives translated; template tokens and the
            # first position are computed natively.
            assert r.translated > 0 and r.translated_from == {"ab"[(i + 1) % 2]: r.translated}
            assert not r.warnings
    # Both views hold the same conversation, each in its own tokenization.
    assert s.text("a") == s.text("b")
    assert s.messages[-1]["content"] == s.reports[-1].text


def test_each_model_renders_its_own_template_and_template_tokens_are_native(toy_pair_dirs, tmp_path):
    """A real difference: the built-in target's tokenizer with a chat template,
    and a tiny model with a 300-token tokenizer and the plain format."""
    from tiny import tiny_model

    from mlx_kvlingo.pairs.toy import build_tokenizer, load_tokenizer

    big, tok = load(toy_pair_dirs[1])
    tok._tokenizer.chat_template = CHAT_TEMPLATE
    docs = [("d", "Return the sum of the items in a list. Open and close the file. " * 30)]
    build_tokenizer(docs, tmp_path, vocab_size=300)
    small_tok = load_tokenizer(tmp_path)
    small = tiny_model("qwen3", vocab_size=300)
    s = Session({"big": (big, tok), "small": (small, small_tok)},
                {("big", "small"): Translator.for_models(big, small, tok, small_tok),
                 ("small", "big"): Translator.for_models(small, big, small_tok, tok)},
                system_prompt="Be brief.")
    r0 = s.generate("big", "Sum the items.", max_tokens=6)
    r1 = s.generate("small", "Now open the file.", max_tokens=6)
    r2 = s.generate("big", "Close it.", max_tokens=5)
    big_view, small_view = s.transcript_of("big"), s.transcript_of("small")
    # Each view is its own rendering of the conversation: big's with its template,
    # small's in the plain format (its tokenizer has none).
    assert tok.decode(big_view.tokens[:r2.context_tokens]) == tok.apply_chat_template(
        s.messages[:6], tokenize=False, add_generation_prompt=True)
    text = small_tok.decode(small_view.tokens[:r1.context_tokens])
    assert text == (f"system: Be brief.\n\nuser: Sum the items.\n\nassistant:{r0.text}\n\n"
                    "user: Now open the file.\n\nassistant:")
    # small caught up on big's first turn: the message text (system, question, answer)
    # was translated, the template tokens and the first position computed natively.
    before = r1.context_tokens - r1.new_tokens
    texty = [j for j in range(1, before) if small_view.pieces[j] != TEMPLATE]
    assert r1.translated == len(texty) > len("Sum the items.".split())
    assert r1.prefilled == before - r1.translated + r1.new_tokens
    assert r2.translated > 0 and r2.translated_from == {"small": r2.translated}
    # big's own answer keeps the ids it generated.
    start = r0.context_tokens
    assert big_view.tokens[start:start + r0.generated] == native_greedy(
        big, tok, big_view.tokens[:start], 6)[:r0.generated]
    assert big_view.processed["big"] == len(big_view)


def test_truncate_then_regenerate_and_edit(twin_tokenizers):
    m, ta, tb = twin_tokenizers
    s = Session({"a": (m, ta), "b": (m, tb)},
                {("a", "b"): identity(m, ta, tb), ("b", "a"): identity(m, tb, ta)},
                chat_template=False)
    s.generate("a", QUESTIONS[0], max_tokens=6)
    first = s.generate("b", QUESTIONS[1], max_tokens=6)
    n_a, n_b = len(s.transcript_of("a")), len(s.transcript_of("b"))
    # Regenerate b's answer: keep the messages up to the user's, answer again.
    s.truncate(3)
    assert len(s.messages) == 3
    again = s.generate("b", None, max_tokens=6)
    assert again.text == first.text and again.context_tokens == first.context_tokens
    assert (len(s.transcript_of("a")), len(s.transcript_of("b"))) == (n_a, n_b)
    # Edit the second question: everything after the first answer goes.
    s.truncate(2)
    r = s.generate("a", QUESTIONS[2], max_tokens=6)
    view = s.transcript_of("a")
    assert view.tokens[r.context_tokens:] == native_greedy(m, ta, view.tokens[:r.context_tokens], 6)
    with pytest.raises(KvlingoError):
        s.generate("c", "hi")


def test_multiturn_fidelity_on_text_is_exact_with_exact_cross_tokenizer_maps(twin_tokenizers):
    from mlx_kvlingo.measure.multiturn import multiturn_fidelity, text_conversations

    m, ta, tb = twin_tokenizers
    doc = ("Return a new list containing all items from the iterable in ascending order. "
           "A custom key function can be supplied to customize the sort order, and the "
           "reverse flag can be set to request the result in descending order. ") * 3
    convs = text_conversations([doc], turns=4, segment_chars=50, count=1)
    assert len(convs) == 1 and len(convs[0]) == 5 and "".join(convs[0]) in doc
    res = multiturn_fidelity({"a": (m, ta), "b": (m, tb)},
                             {("a", "b"): identity(m, ta, tb), ("b", "a"): identity(m, tb, ta)},
                             convs)
    for rows in res.values():
        assert [r.turn for r in rows] == [1, 2, 3, 4]
        for r in rows:
            assert abs(r.nll_session - r.nll_native) < 1e-3 and r.top1 == 1.0
            assert r.translated_tokens > 0


def test_a_cross_tokenizer_catch_up_recomputes_old_words_with_their_context(toy_pair_dirs):
    """Different tokenizers, gemma-style sliding layers (windows of 8) and a
    catch-up with template tokens computed natively between translated runs: the
    recompute of words older than the window reads the rows the catch-up kept
    (kernel.History), so with exact maps the reader still answers as a native
    prefill would."""
    from tiny import tiny_model

    from mlx_kvlingo.pairs.toy import VOCAB_SIZE

    m = tiny_model("gemma3_text", vocab_size=VOCAB_SIZE + 8)
    _, ta = load(toy_pair_dirs[1])
    _, tb = load(toy_pair_dirs[1])
    tb._tokenizer.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    # The words' choice, not the question's: a's answer below re-tokenizes into other
    # byte-level pieces in b's view, so even with exact maps the positions after it
    # are translated from a context that differs from b's. The tolerance below holds
    # for the fact-like words' spans this test was written around (other spans leave
    # the first answer tokens ~0.5 nats off); what it checks is that their recompute
    # reads the rows the catch-up kept.
    ab, ba = identity(m, ta, tb), identity(m, tb, ta)
    ab.spec.recompute_select = ba.spec.recompute_select = "lexical"
    s = Session({"a": (m, ta), "b": (m, tb)}, {("a", "b"): ab, ("b", "a"): ba},
                chat_template=False, recompute=0.5, recompute_max=0)
    s.generate("a", "Remember this.", max_tokens=4)  # a's answer: translated after a prefill
    s.read("a", "The locker code is 58213 and the helper is parse_cfg_v2 for Pomini. "
           + "It rained all day long and then it stopped. " * 3)
    r = s.generate("b", "Which code was it?", max_tokens=6)
    assert r.translated > 40 and s.reports[-1].recomputed > 0
    view = s.transcript_of("b")
    assert_greedy_under_native(m, view.tokens[:r.context_tokens + r.generated], r.context_tokens)

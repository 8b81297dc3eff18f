"""The multi-model Session: exactness, token accounting, fallback, templates, threads."""

import threading

import mlx.core as mx
import pytest
from tiny import identity_translator, native_greedy

from mlx_kvlingo.chat.session import Session, finish_thread, format_reports
from mlx_kvlingo.errors import KvlingoError
from mlx_kvlingo.models.cache import prefill
from mlx_kvlingo.pairs.builtin import builtin_session, stage1_translator


@pytest.fixture(scope="module")
def target(toy_pair):
    return toy_pair[2], toy_pair[3]


def twin_session(model, tok, both=True, **kw):
    """One model under two names with exact translators: a switch must change nothing."""
    translators = {("a", "b"): identity_translator(model, tok)}
    if both:
        translators["b", "a"] = identity_translator(model, tok)
    return Session({"a": (model, tok), "b": (model, tok)}, translators, **kw)


def next_logits(model, cache, token):
    return model(mx.array([[token]]), cache=cache)[0, -1]


QUESTIONS = ["Return the sum of the items.", "Open the file and return a stream.",
             "Close the file.", "Raise ValueError if empty."]


def test_switching_with_an_exact_translator_equals_native_prefill(target):
    m, tok = target
    s = twin_session(m, tok)
    for i, q in enumerate(QUESTIONS):
        name = "ab"[i % 2]
        r = s.generate(name, q, max_tokens=8)
        tokens = s.tokens
        start = r.context_tokens
        got = tokens[start:start + r.generated]
        assert got == native_greedy(m, tok, tokens[:start], 8), f"turn {i}"
        assert not r.warnings
    # The cache "a" builds over four turns (half of it translated from "b") gives
    # the log-probs a native prefill of the whole transcript gives.
    tokens = s.tokens
    native = prefill(m, mx.array(tokens[:-1])[None])
    want = next_logits(m, native, tokens[-1])
    want = want - mx.logsumexp(want)
    got = s.read("a", [tokens[0]])[0]  # catches up on b's last turn, then reads one token
    assert mx.abs(got - want).max().item() < 1e-3
    assert s.reports[-1].translated == s.reports[-2].new_tokens + 8 - 1


def test_token_accounting(target):
    m, tok = target
    s = twin_session(m, tok)
    r0 = s.generate("a", QUESTIONS[0], max_tokens=5)
    n0 = len(tok.encode("user: " + QUESTIONS[0] + "\n\nassistant:"))
    assert (r0.translated, r0.prefilled, r0.generated, r0.new_tokens) == (0, n0, 5, n0)
    assert r0.context_tokens == n0 and r0.ttft_s > 0

    r1 = s.generate("b", QUESTIONS[1], max_tokens=4)
    # b reads a's whole turn: the first token natively (the translator's native
    # prefix), the rest translated; then its own new tokens.
    assert r1.translated == n0 + 5 - 1 and r1.translated_from == {"a": n0 + 5 - 1}
    assert r1.prefilled == 1 + r1.new_tokens and r1.generated == 4
    assert r1.context_tokens == n0 + 5 + r1.new_tokens

    r2 = s.generate("a", QUESTIONS[2], max_tokens=3)
    assert r2.translated == r1.new_tokens + 4  # only what b wrote since a's last turn
    assert r2.prefilled == r2.new_tokens
    t = s.transcript
    assert t.processed == {"a": len(t), "b": len(t) - r2.new_tokens - 3}
    assert t.translated == {"a": r2.translated, "b": r1.translated}
    assert [(sp.writer, sp.kind) for sp in t.spans] == [
        ("a", "prompt"), ("a", "generated"), ("b", "prompt"), ("b", "generated"),
        ("a", "prompt"), ("a", "generated")]
    table = format_reports(s.reports)
    assert len(table.splitlines()) == 4


def test_missing_translator_falls_back_to_prefill_and_says_so(target):
    m, tok = target
    s = twin_session(m, tok, both=False)  # a -> b only
    s.generate("a", QUESTIONS[0], max_tokens=4)
    r1 = s.generate("b", QUESTIONS[1], max_tokens=4)
    assert r1.translated > 0 and not r1.warnings
    r2 = s.generate("a", QUESTIONS[2], max_tokens=6)
    assert r2.translated == 0
    assert r2.prefilled == r1.new_tokens + 4 + r2.new_tokens
    assert len(r2.warnings) == 1 and "no translator b -> a" in r2.warnings[0]
    start = r2.context_tokens
    assert s.tokens[start:] == native_greedy(m, tok, s.tokens[:start], 6)


def test_two_threads_are_serialized_and_consistent(target):
    m, tok = target
    s = twin_session(m, tok)
    barrier = threading.Barrier(2)
    errors = []

    def chat(name, questions):
        try:
            barrier.wait()
            for q in questions:
                stream = s.generate(name, q, max_tokens=6, stream=True)
                for _ in stream:
                    pass
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            finish_thread()

    threads = [threading.Thread(target=chat, args=("a", QUESTIONS[:2])),
               threading.Thread(target=chat, args=("b", QUESTIONS[2:]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(s.reports) == 4 and [r.index for r in s.reports] == [0, 1, 2, 3]
    assert any(r.wait_s > 1e-4 for r in s.reports)  # one thread did wait for the other
    # Turns did not interleave: each one is its prompt then its answer, contiguous,
    # and every answer is what the model gives from a native prefill of what came
    # before it.
    spans = s.transcript.spans
    assert len(spans) == 8
    for r, (p, g) in zip(s.reports, zip(spans[::2], spans[1::2])):
        assert (p.writer, g.writer) == (r.model, r.model) and p.end == g.start
        assert g.end - g.start == r.generated == 6
        assert s.tokens[g.start:g.end] == native_greedy(m, tok, s.tokens[:g.start], 6)


def test_a_thread_cannot_start_a_turn_while_streaming_one(target):
    m, tok = target
    s = twin_session(m, tok)
    stream = s.generate("a", QUESTIONS[0], max_tokens=20, stream=True)
    next(stream)
    with pytest.raises(KvlingoError, match="still streaming"):
        s.generate("b", QUESTIONS[1], max_tokens=2)
    stream.close()  # stop early: the tokens so far stay in the conversation
    assert stream.report.generated == 1
    assert len(s.transcript) == stream.report.context_tokens + 1
    # a's cache holds the context (its first token is read when a next decodes);
    # b translates what a's cache holds but the native first position.
    held = s.transcript.processed["a"]
    assert held == stream.report.context_tokens
    r = s.generate("b", QUESTIONS[1], max_tokens=2)
    assert r.translated == held - 1


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_chat_template_transcript_extends_the_previous_one(toy_pair_dirs):
    from mlx_kvlingo.models.load import load

    m, tok = load(toy_pair_dirs[1])
    tok._tokenizer.chat_template = CHAT_TEMPLATE
    eos = tok.eos_token_id
    calls = {"n": 0}

    def stop_after_two(tokens, logits):  # force an end-of-turn token as the 3rd token
        calls["n"] += 1
        if calls["n"] == 3:
            return mx.where(mx.arange(logits.shape[-1]) == eos, 0.0, -1e9)[None]
        return logits

    s = twin_session(m, tok, system_prompt="Be brief.")
    turns = [("a", "Sum a list.", {}), ("b", "Now open a file.", {"logits_processors": [stop_after_two]}),
             ("a", "And close it.", {}), ("b", None, {})]
    for name, message, kw in turns:
        r = s.generate(name, message, max_tokens=6, **kw)
        # What the models read is exactly the template's rendering of the conversation
        # so far (answers included), up to the generation prompt.
        rendered = tok.apply_chat_template(s.messages[:-1], tokenize=False,
                                           add_generation_prompt=True)
        assert tok.decode(s.tokens[:r.context_tokens]) == rendered
    assert s.reports[1].finish_reason == "stop" and s.reports[1].generated == 3
    assert s.messages[0] == {"role": "system", "content": "Be brief."}


def test_read_turns_and_errors(target):
    m, tok = target
    s = twin_session(m, tok)
    ids = tok.encode("Return the number of items in the container, or zero.")
    lp = s.read("a", ids)
    assert lp.shape == (len(ids) - 1, m.args.vocab_size)
    more = tok.encode(" The container must be sized.")
    lp = s.read("b", more)
    native = prefill(m, mx.array(ids[:-1])[None])
    want = m(mx.array([[ids[-1]] + more[:-1]]), cache=native)[0]
    want = want - mx.logsumexp(want, axis=-1, keepdims=True)
    assert mx.abs(lp - want).max().item() < 1e-3
    assert s.reports[-1].kind == "read" and s.reports[-1].translated == len(ids) - 2
    with pytest.raises(KvlingoError, match="No model named 'c'"):
        s.generate("c", "hi")
    with pytest.raises(KvlingoError, match="already"):
        s.add_model("a", m, tok)
    with pytest.raises(KvlingoError, match="message"):
        s.generate("a", [{"role": "user"}])
    s.reset()
    assert len(s.transcript) == 0 and s.transcript.processed == {"a": 0, "b": 0}
    with pytest.raises(KvlingoError, match="Nothing to read"):
        s.read("a", [])


def test_a_model_with_a_new_tokenizer_joins_before_the_first_turn(target, tmp_path):
    from mlx_kvlingo.pairs.toy import build_tokenizer, load_tokenizer

    m, tok = target
    docs = [("d", "Return the sum of a list of numbers. " * 20)]
    build_tokenizer(docs, tmp_path, vocab_size=300)
    other = load_tokenizer(tmp_path)
    s = Session({"a": (m, tok)})
    s.generate("a", "Sum.", max_tokens=2)
    with pytest.raises(KvlingoError, match="tokenizer no model"):
        s.add_model("b", m, other)
    s.reset()
    s.add_model("b", m, other)
    assert s.cross_tokenizer


def test_multiturn_fidelity_is_exact_with_exact_translators(target):
    from mlx_kvlingo.measure.multiturn import format_markdown, multiturn_fidelity

    m, tok = target
    text = ("Return a new list containing all items from the iterable in ascending order. "
            "A custom key function can be supplied to customize the sort order, and the "
            "reverse flag can be set to request the result in descending order. ") * 3
    ids = tok.encode(text)
    conv = [[ids[i * 12:(i + 1) * 12] for i in range(5)]]
    models = {"a": (m, tok), "b": (m, tok)}
    res = multiturn_fidelity(models, {("a", "b"): identity_translator(m, tok), ("b", "a"): identity_translator(m, tok)},
                             conv)
    assert set(res) == {"a", "b"}
    for rows in res.values():
        assert [r.turn for r in rows] == [1, 2, 3, 4]
        assert rows[0].model != rows[1].model
        for r in rows:
            assert abs(r.nll_session - r.nll_native) < 1e-3 and r.kl < 1e-4 and r.top1 == 1.0
            assert r.translated_tokens > 0
    assert "| 4 |" in format_markdown(res)


def test_builtin_session_switches_between_the_pair(kv_cache_dir, toy_pair):
    src, stok, tgt, ttok = toy_pair
    files = sorted((kv_cache_dir / "translators").glob("*.safetensors"))
    assert len(files) == 1  # large -> small; small -> large is the shipped stage 2
    again = stage1_translator(tgt, ttok, src, stok, kv_cache_dir)  # from the cache
    assert again.spec.training["stage"] == 1
    assert sorted((kv_cache_dir / "translators").glob("*.safetensors")) == files
    s = builtin_session(cache_dir=kv_cache_dir)
    assert s.model_names == ["small", "large"]
    assert s.translator("small", "large").spec.training["stage"] == 2
    s.generate("small", "Return the sum of a list.", max_tokens=8)
    r = s.generate("large", "Open a file.", max_tokens=8)
    assert r.translated > 0 and not r.warnings and r.generated == 8


def test_a_model_can_continue_when_the_template_adds_nothing(toy_pair_dirs):
    """With a template that writes nothing after a message (no generation prompt),
    a turn without a message makes the model re-read the last token itself, also
    when it wrote that token (its cache is trimmed by one and the token re-read)."""
    from mlx_kvlingo.models.load import load

    m, tok = load(toy_pair_dirs[1])
    tok._tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    s = twin_session(m, tok)
    s.generate("a", "Return the sum of the items.", max_tokens=4)
    for name in ("b", "b", "a"):
        before = len(s.transcript)
        r = s.generate(name, None, max_tokens=4)
        assert r.new_tokens == 0 and r.context_tokens == before
        assert s.tokens[before:] == native_greedy(m, tok, s.tokens[:before], 4)
        assert s.transcript.processed[name] == len(s.transcript)


def test_the_translators_native_tail_is_computed_by_the_reader(target):
    """A translator's ``native_tail`` m: the last m positions a switch would
    translate are prefilled by the reader instead (exact, whatever the maps)."""
    m, tok = target
    zero = identity_translator(m, tok, scale=0.0)  # a translation that carries nothing
    zero.spec.native_tail = 4
    s = Session({"a": (m, tok), "b": (m, tok)}, {("a", "b"): zero})
    r0 = s.generate("a", QUESTIONS[0], max_tokens=5)
    before = len(s.tokens)
    r1 = s.generate("b", QUESTIONS[1], max_tokens=2)
    assert r1.native_tail == 4 and r1.translated == before - 1 - 4
    assert r1.prefilled == 1 + 4 + r1.new_tokens
    # Layer 0 depends only on each token and its position: the tail's keys equal a
    # native prefill's, the translated positions before it hold the zero maps' output.
    native = prefill(m, mx.array(s.tokens[:before])[None])
    got, want = s.cache("b")[0].keys[..., :before, :], native[0].keys[..., :before, :]
    assert mx.allclose(got[..., -4:, :], want[..., -4:, :], atol=1e-4)
    assert mx.abs(got[..., 1:before - 4, :]).max().item() == 0.0
    assert r0.native_tail == 0


def test_an_answer_interrupted_between_two_layers_leaves_a_readable_cache(target):
    """Ctrl-C can land inside a forward pass, after some layers' caches took the new
    token and before the others did. The writer's cache must come back with every
    layer at one length, so the next model still translates all of it (CI saw the
    switch fall back to a full prefill: 'layer 3 holds positions 0..190')."""
    m, tok = target
    s = twin_session(m, tok)
    layer = m.model.layers[len(m.model.layers) // 2]
    original = type(layer)
    calls = {"n": 0}

    class InterruptedOnce(original):
        def __call__(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 6:  # the prompt's pass, then a few decoding steps
                raise KeyboardInterrupt
            return original.__call__(self, *args, **kwargs)

    layer.__class__ = InterruptedOnce
    stream = s.generate("a", QUESTIONS[0], max_tokens=50, stream=True)
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in stream:
                pass
    finally:
        layer.__class__ = original
    stream.close()
    offsets = {c.offset for c in s.cache("a")}
    assert len(offsets) == 1 and offsets.pop() == s.transcript.processed["a"]
    r = s.generate("b", QUESTIONS[1], max_tokens=2)
    assert not r.warnings and r.translated == s.transcript.processed["a"] - 1
    # and a, reading b's turn, continues as a native prefill of the transcript would
    r2 = s.generate("a", QUESTIONS[2], max_tokens=4)
    start = r2.context_tokens
    assert s.tokens[start:] == native_greedy(m, tok, s.tokens[:start], 4)


def test_recomputing_fact_like_words_after_an_exact_catch_up_changes_nothing(target):
    """Session(recompute=...): after a catch-up translates, the reader recomputes
    the fact-like words among the translated positions itself; with an exact
    translator its answers are those of a session without it, and the report
    counts the positions it recomputed."""
    m, tok = target
    turns = [("a", "The locker code is 58213 and the helper is parse_cfg_v2."),
             ("b", "Which code was it?"), ("a", "And the helper?")]
    answers = {}
    for share in (0.0, 0.3):
        s = twin_session(m, tok, recompute=share)
        answers[share] = [s.generate(name, text, max_tokens=6).text for name, text in turns]
        recomputed = [r.recomputed for r in s.reports]
    assert answers[0.3] == answers[0.0]
    assert recomputed[1] > 0 and recomputed[0] == 0  # the first turn translated nothing


def test_a_session_recomputes_what_its_translators_default_to(target):
    """Without its own budget a Session recomputes what a switch of the whole
    conversation would: the share the translators that wrote a catch-up default to
    (spec.recompute), less their reserve, capped at their spec.recompute_max; its
    own budget (0: none) overrides them; a budget out of range is refused."""
    m, tok = target
    turns = [("a", "The locker code is 58213 and the helper is parse_cfg_v2 for Pomini."),
             ("b", "Which code was it?")]

    def recomputed(share=0.5, reserve=0, **kw):
        s = twin_session(m, tok, **kw)
        for t in s._translators.values():
            t.spec.recompute, t.spec.recompute_max = share, 10
            t.spec.recompute_reserve = reserve
        for name, text in turns:
            s.generate(name, text, max_tokens=2)
        return s.reports[1].recomputed, s.reports[1].translated

    assert 0 < recomputed()[0] <= 10
    assert recomputed(recompute=0.0)[0] == 0
    # Uncapped: the file's share, what a session's own budget of it recomputes.
    assert recomputed(0.3, recompute_max=0) == recomputed(recompute=0.3, recompute_max=0)
    assert recomputed(0.3, recompute_max=0)[0] > recomputed(recompute=0.1, recompute_max=0)[0]
    assert recomputed(0.0)[0] == 0  # files that recompute nothing: a catch-up neither
    # The files' reserve comes off their share; a session's own share has none.
    assert recomputed(0.3, reserve=3, recompute_max=0)[0] < recomputed(0.3, recompute_max=0)[0]
    assert recomputed(0.3, reserve=3, recompute=0.3, recompute_max=0) == recomputed(
        recompute=0.3, recompute_max=0)
    with pytest.raises(KvlingoError, match="share of the context"):
        twin_session(m, tok, recompute=1.5)
    with pytest.raises(KvlingoError, match="number of positions"):
        twin_session(m, tok, recompute_max=-1)


def test_a_catch_up_recomputes_words_older_than_a_sliding_window_with_their_context(target):
    """Gemma-style sliding layers (windows of 8) drop a long catch-up's older rows
    as it writes them. Its recompute of the fact-like words older than the window
    reads them from what the catch-up kept (kernel.History), so with exact
    translators the reader's log-probs stay a native prefill's."""
    from tiny import tiny_model

    from mlx_kvlingo.metrics import log_softmax
    from mlx_kvlingo.pairs.toy import VOCAB_SIZE

    _, tok = target
    m = tiny_model("gemma3_text", vocab_size=VOCAB_SIZE)
    s = twin_session(m, tok, recompute=0.5, recompute_max=0)
    s.read("a", "The locker code is 58213 and the helper is parse_cfg_v2 for Pomini. "
                + "It rained all day long and then it stopped. " * 3)
    got = s.read("b", "Which code was it?")
    report = s.reports[-1]
    assert report.translated > 40 and report.recomputed > 0
    ids = s.tokens
    want = log_softmax(m(mx.array([ids]))[0, len(ids) - got.shape[0] - 1:-1])
    assert mx.abs(got - want).max().item() < 1e-3


def test_a_catch_up_recomputes_a_fact_like_word_at_its_very_end(target):
    """The word the catch-up's translated positions end with is recomputed within
    them: a span never reaches past the catch-up (its cache ends there)."""
    m, tok = target
    s = twin_session(m, tok, recompute=1.0, recompute_max=0)
    s.read("a", "It rained. The code is 58213")
    s.read("b", " and then?")
    assert s.reports[-1].recomputed > 0


@pytest.mark.parametrize("arch", ["toy", "gemma3_text"])
def test_a_catch_up_recomputes_what_an_earlier_turn_translated(target, arch):
    """The fact a question needs may have been translated turns before: a catch-up
    chooses its recompute among every position the reader still holds translated,
    not only those it translates now. With the whole conversation's budget it
    leaves none, and those of the first turn are then the reader's own rows. On
    Gemma-style sliding layers (windows of 8) that takes the rows the session kept
    for them after the window dropped them; without those, they stay translated."""
    from tiny import tiny_model

    from mlx_kvlingo.models.geometry import cache_geometry
    from mlx_kvlingo.pairs.toy import VOCAB_SIZE

    m, tok = target
    if arch != "toy":
        m = tiny_model(arch, vocab_size=VOCAB_SIZE)
    first = "The parser keeps its scratch files under the piano in the hall."
    pieces = [("b", " It rained all day and then it stopped, and the roads were wet."),
              ("a", " The train was late and the station was cold that evening.")]

    def conversation(keep_rows=True):
        inexact = {("a", "b"): identity_translator(m, tok, scale=0.5),
                   ("b", "a"): identity_translator(m, tok, scale=0.5)}
        s = Session({"a": (m, tok), "b": (m, tok)}, inexact, recompute=0.0)
        if not keep_rows:
            s.entry("b").kept = None
        s.read("a", first)
        for name, text in pieces:
            s.read(name, text)
        earlier = list(s.transcript.still_translated["b"])
        s.recompute, s.recompute_max = 1.0, 0
        s.read("b", " Where are the scratch files?")
        return s, earlier

    s, earlier = conversation()
    n = len(tok.encode(first))
    assert earlier and earlier[0][0] <= 2 and earlier[0][1] >= n - 2  # the first turn's
    assert s.reports[-1].recomputed >= sum(b - a for a, b in earlier)
    assert s.transcript.still_translated["b"] == []
    native = prefill(m, mx.array(tok.encode(first))[None])
    full = [i for i, lg in enumerate(cache_geometry(m).layers) if not lg.window]
    for i in full:
        got = s.cache("b")[i].keys[..., 1:n - 1, :]
        assert mx.abs(got - native[i].keys[..., 1:n - 1, :]).max().item() < 1e-4
    if arch != "toy":
        assert s.nbytes() > sum(c.nbytes for c in s.cache("b")) + sum(
            c.nbytes for c in s.cache("a"))  # the kept rows count
        s.reset()
        assert s.nbytes() == 0
        s, earlier = conversation(keep_rows=False)
        left = s.transcript.still_translated["b"]
        assert left and left[0][0] < 8  # older than a window: out of reach


def test_a_turn_that_translates_nothing_still_recomputes_what_was_translated(target):
    """A model that reads on after its own turn translates nothing new, but its
    question may need what an earlier catch-up translated: those positions are
    chosen as in any catch-up; a conversation without translated positions
    recomputes nothing."""
    m, tok = target
    inexact = {("a", "b"): identity_translator(m, tok, scale=0.5)}
    s = Session({"a": (m, tok), "b": (m, tok)}, inexact, recompute=0.0)
    s.read("a", "The parser keeps its scratch files under the piano in the hall.")
    s.read("b", " It rained all day.")
    earlier = list(s.transcript.still_translated["b"])
    assert earlier and s.reports[-1].recomputed == 0
    s.recompute, s.recompute_max = 1.0, 0
    s.read("b", " Where are the files?")
    assert s.reports[-1].translated == 0
    assert s.reports[-1].recomputed >= sum(b - a for a, b in earlier)
    assert s.transcript.still_translated["b"] == []
    s.read("b", " Under the")
    assert s.reports[-1].recomputed == 0

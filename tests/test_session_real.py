"""A conversation between the real models (SmolLM2 <-> Gemma 3: different tokenizers)."""

import pytest

pytestmark = pytest.mark.network


@pytest.fixture(scope="module")
def real_session_parts():
    """The two real models and the translators shipped for them (no fitting here)."""
    from mlx_kvlingo.models.load import load
    from mlx_kvlingo.pairs.shipped import shipped_translator
    from mlx_kvlingo.translator.maps import load_translator

    smol, stok = load("smollm2")
    gemma, gtok = load("gemma3")
    s2g = load_translator(shipped_translator("smollm2", "gemma3"))
    g2s = load_translator(shipped_translator("gemma3", "smollm2"))
    return {"smol": (smol, stok), "gemma": (gemma, gtok)}, {("smol", "gemma"): s2g,
                                                            ("gemma", "smol"): g2s}


def test_real_pair_chat_each_model_in_its_own_format(real_session_parts):
    from mlx_kvlingo.chat.session import Session

    models, translators = real_session_parts
    (_, stok), (_, gtok) = models["smol"], models["gemma"]
    assert stok.has_chat_template and not gtok.chat_template  # Gemma 3 270M is a base model
    s = Session(models, translators, break_even=0)  # short turns, translated all the same
    r0 = s.generate("smol", "What does the zip function do in Python?", max_tokens=24)
    r1 = s.generate("gemma", "Give an example.", max_tokens=24)
    r2 = s.generate("smol", "Thanks. And enumerate?", max_tokens=6)
    smol_view, gemma_view = s.transcript_of("smol"), s.transcript_of("gemma")
    # SmolLM2 reads its ChatML rendering; Gemma the plain format after its BOS.
    assert stok.decode(smol_view.tokens[:r2.context_tokens]) == stok.apply_chat_template(
        s.messages[:5], tokenize=False, add_generation_prompt=True)
    assert gemma_view.tokens[0] == gtok.bos_token_id
    assert gtok.decode(gemma_view.tokens[1:r1.context_tokens]) == (
        f"user: What does the zip function do in Python?\n\nassistant:{r0.text}\n\n"
        "user: Give an example.\n\nassistant:")
    for r in (r1, r2):
        # The shipped translators keep their last 16 positions native (native_tail).
        assert r.translated > 10 and r.native_tail == 16
        assert not r.warnings and r.generated > 0
    assert not r0.translated


def test_real_pair_multiturn_beats_no_context(real_session_parts):
    from mlx_kvlingo.data import corpus as data
    from mlx_kvlingo.measure.multiturn import multiturn_fidelity, text_conversations

    models, translators = real_session_parts
    _, heldout = data.split_documents(data.stdlib_documents())
    convs = text_conversations([t for _, t in heldout], turns=4, segment_chars=160, count=2)
    res = multiturn_fidelity(models, translators, convs)
    for start, rows in res.items():
        print(start, [(r.turn, r.model, round(r.cbr, 2)) for r in rows])
        assert sum(r.nll_session for r in rows) < sum(r.nll_none for r in rows), start


def test_chat_and_serve_use_the_shipped_translators_for_the_short_names():
    from mlx_kvlingo.pairs.assemble import build_session

    def two_turns(break_even):
        session = build_session(["smol=smollm2", "gemma=gemma3"], [], False, 0, None, None)
        assert session.has_translator("smol", "gemma") and session.has_translator("gemma", "smol")
        assert session.translator("smol", "gemma").cross_tokenizer
        session.break_even = break_even
        # Longer than the files' native tail (16): a catch-up the tail covers is all native.
        session.generate("smol", "We are planning a picnic by the river on Saturday with "
                         "bread, cheese, cold tea and a basket of fruit. Name a fruit.",
                         max_tokens=4)
        return session.generate("gemma", "Another one?", max_tokens=4)

    r = two_turns(0)
    assert r.translated > 0 and not r.warnings
    # The files' break-even (128 / 256 positions, where nothing was measured on the machine
    # running this): a catch-up that short is prefilled.
    from mlx_kvlingo.switching.break_even import stored_break_even

    session = build_session(["smol=smollm2", "gemma=gemma3"], [], False, 0, None, None)
    if stored_break_even(session.translator("smol", "gemma"), session.model("gemma")) is None:
        r = two_turns(None)
        assert r.translated == 0 and "break-even" in r.fallback

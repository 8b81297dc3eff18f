"""The conversation store and router behind `serve`, without sockets."""

import numpy as np
import pytest
from tiny import identity_translator, user

from mlx_kvlingo.chat.session import Session
from mlx_kvlingo.serve.conversations import (
    AutoRoute,
    ConversationStore,
    TurnRequest,
    UnknownModel,
    common_prefix,
)
from mlx_kvlingo.serve.engine import Engine, QueueFull


@pytest.fixture(scope="module")
def base(toy_pair):
    """One model under two names with exact translators: any route gives the
    answers a native prefill gives, so conversations can be compared exactly."""
    m, tok = toy_pair[2], toy_pair[3]
    return Session({"a": (m, tok), "b": (m, tok)},
                   {("a", "b"): identity_translator(m, tok), ("b", "a"): identity_translator(m, tok)})


def run(store, model, messages, **kw):
    events = list(store.run(TurnRequest(model=model, messages=messages, **kw)))
    assert events[0][0] == "start" and events[-1][0] == "done"
    text = "".join(v for k, v in events if k == "delta")
    return text, events[-1][1]


def test_requests_extend_a_conversation_and_a_switch_translates(base):
    store = ConversationStore(base)
    msgs = [{"role": "system", "content": "Answer in Python."}, user("Sum a list.")]
    text, s1 = run(store, "a", msgs, max_tokens=6)
    assert s1.translated_tokens == 0 and s1.cached_tokens == 0 and s1.generated_tokens == 6
    msgs += [{"role": "assistant", "content": text}, user("Now open a file.")]
    text2, s2 = run(store, "b", msgs, max_tokens=6)
    assert s2.conversation == s1.conversation and len(store) == 1
    # b had nothing cached: what a wrote arrives translated, not re-prefilled.
    assert s2.translated_tokens > 0 and s2.cached_tokens == 0
    assert s2.prefilled_tokens < s2.context_tokens - s2.translated_tokens + 2
    msgs += [{"role": "assistant", "content": text2}, user("Close it.")]
    _, s3 = run(store, "a", msgs, max_tokens=4)
    assert s3.cached_tokens == s1.context_tokens + 6 or s3.cached_tokens == s1.context_tokens + 5
    assert s3.usage()["prompt_tokens_details"]["cached_tokens"] == s3.cached_tokens
    assert s3.translated_tokens > 0
    # Same answers as one fresh conversation answering the same list natively.
    fresh = ConversationStore(base)
    assert run(fresh, "b", msgs[:4] + [user("Now open a file.")], max_tokens=6)[0] == text2


def test_regenerate_and_edit_branch_and_leave_the_stored_conversation_whole(base):
    store = ConversationStore(base)
    msgs = [user("Return the sum of the items.")]
    text, s1 = run(store, "a", msgs, max_tokens=6)
    again, s2 = run(store, "b", msgs, max_tokens=6)  # regenerate, with the other model
    assert s2.branched_from == s1.conversation and s2.shared_messages == 1
    assert again == text  # exact translators: same greedy answer
    assert s2.translated_tokens > 0  # b read the question translated from a's copied cache
    assert store.conversation_messages(s1.conversation)[-1]["content"] == text  # kept whole
    msgs2 = msgs + [{"role": "assistant", "content": again}, user("Open a file.")]
    _, s3 = run(store, "a", msgs2, max_tokens=4)
    edited = msgs + [{"role": "assistant", "content": again}, user("Close a file.")]
    _, s4 = run(store, "a", edited, max_tokens=4)
    assert s4.shared_messages == 2 and s4.branched_from == s3.conversation
    assert store.conversation_messages(s4.conversation)[-2] == user("Close a file.")
    assert store.conversation_messages(s3.conversation)[-2] == user("Open a file.")


def test_chats_sharing_a_system_prompt_keep_each_others_caches_whole(base):
    """Two chats that share only the system prompt: the second copies that prefix;
    back to the first, it reuses its whole cache and reads only its new message."""
    store = ConversationStore(base)
    system = {"role": "system", "content": "You write Python."}
    first = [system, user("Sum a list.")]
    text, s1 = run(store, "a", first, max_tokens=6)
    answered = s1.context_tokens + s1.generated_tokens
    cache = store.session_of(s1.conversation).cache("a")
    before = [(c.offset, np.array(c.keys[..., :c.offset, :])) for c in cache]
    _, s2 = run(store, "a", [system, user("Open a file.")], max_tokens=6)
    # The copy wrote its own tokens after the shared prefix; the first chat's cache
    # holds what it held, value for value.
    after = [(c.offset, np.array(c.keys[..., :c.offset, :])) for c in cache]
    assert [o for o, _ in after] == [o for o, _ in before]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(after, before))
    assert s2.conversation != s1.conversation and s2.branched_from == s1.conversation
    assert s2.shared_messages == 1 and 0 < s2.cached_tokens < s1.context_tokens
    first += [{"role": "assistant", "content": text}, user("And the product?")]
    _, s3 = run(store, "a", first, max_tokens=4)
    assert s3.conversation == s1.conversation and s3.branched_from is None
    # a's whole cache of the first chat (its last answer token at most left to read)
    assert answered - 1 <= s3.cached_tokens <= answered and s3.cached_translated_tokens == 0
    assert s3.prefilled_tokens == s3.context_tokens - s3.cached_tokens  # only the new tokens
    assert len(store) == 2


def test_cached_tokens_count_only_positions_the_model_computed(base):
    """a, b, a, a: a's third turn catches up on b's answer by translation; on its
    fourth turn those positions are in a's cache but are not an exact hit."""
    store = ConversationStore(base)
    msgs = [user("Sum a list.")]
    for i, model in enumerate("abaa"):
        text, s = run(store, model, msgs, max_tokens=4)
        msgs += [{"role": "assistant", "content": text}, user(f"Step {i + 2}?")]
        if i == 2:
            third = s
    session = store.session_of(s.conversation)
    view = session.transcript_of("a")
    assert third.translated_tokens > 0
    held = s.cached_tokens + s.cached_translated_tokens
    assert s.cached_translated_tokens >= third.translated_tokens
    assert s.cached_tokens <= held - third.translated_tokens
    assert s.usage()["prompt_tokens_details"]["cached_tokens"] == s.cached_tokens
    # what a holds now: everything, its last two turns' positions its own
    assert view.own_positions("a") < view.processed["a"]


def test_a_stop_string_cuts_the_stored_answer(base):
    store = ConversationStore(base)
    full, _ = run(ConversationStore(base), "a", [user("Sum a list.")], max_tokens=8)
    stop = full[4:6]
    text, s = run(store, "a", [user("Sum a list.")], max_tokens=8, stop=[stop])
    assert text == full[:full.find(stop)] and s.finish_reason == "stop"
    assert store.conversation_messages(s.conversation)[-1]["content"] == text
    # The client sends the answer it got back: the same conversation, extended.
    msgs = [user("Sum a list."), {"role": "assistant", "content": text}, user("Again.")]
    _, s2 = run(store, "b", msgs, max_tokens=4)
    assert s2.conversation == s.conversation and s2.branched_from is None
    assert s2.shared_messages == 2
    fresh, _ = run(ConversationStore(base), "b", msgs, max_tokens=4)
    assert run(store, "b", msgs, max_tokens=4)[0] == fresh  # the cut answer reads as sent


def test_lru_by_count_and_bytes(base):
    store = ConversationStore(base, max_conversations=2)
    ids = [run(store, "a", [user(q)], max_tokens=2)[1].conversation
           for q in ("One.", "Two.", "Three.")]
    assert len(store) == 2 and store.evicted == 1
    # The first conversation is gone: its messages start a new one.
    assert run(store, "a", [user("One.")], max_tokens=2)[1].conversation not in ids
    tiny = ConversationStore(base, max_bytes=1)
    for q in ("One.", "Two."):
        run(tiny, "a", [user(q)], max_tokens=2)
    assert len(tiny) == 1  # over the byte budget, only the current one stays


def test_auto_routes_on_the_small_models_uncertainty(base):
    calm = ConversationStore(base, auto=AutoRoute("a", "b", probe_tokens=4, max_entropy=1e9))
    text, s = run(calm, "auto", [user("Sum a list.")], max_tokens=6)
    assert s.model == "a" and s.route["escalated"] is False and s.route["probe_tokens"] == 4
    assert s.route["entropy"] > 0 and s.generated_tokens == 6
    eager = ConversationStore(base, auto=AutoRoute("a", "b", probe_tokens=4, max_entropy=-1))
    text2, s2 = run(eager, "auto", [user("Sum a list.")], max_tokens=6)
    assert s2.model == "b" and s2.route["escalated"] is True
    assert text2 == text  # exact translators: the same answer, from the other model
    messages = eager.conversation_messages(s2.conversation)
    assert [m["content"] for m in messages[-2:]] == ["Sum a list.", text2]  # no probe left
    # The next hard turn: b translates what a wrote since, and reads the question itself.
    msgs = [user("Sum a list."), {"role": "assistant", "content": text2},
            user("And the product?")]
    text3, s3 = run(eager, "a", msgs, max_tokens=4)
    msgs += [{"role": "assistant", "content": text3}, user("Now the mean of the items.")]
    _, s4 = run(eager, "auto", msgs, max_tokens=4)
    assert s4.conversation == s2.conversation
    assert s4.model == "b" and s4.translated_tokens > 0
    assert s4.prefilled_tokens >= 6  # the question's tokens, read by b itself


def test_stop_strings_unknown_models_and_cancel(base):
    store = ConversationStore(base)
    full, _ = run(store, "a", [user("Sum a list.")], max_tokens=8)
    stop = full[3:5]
    text, s = run(ConversationStore(base), "a", [user("Sum a list.")], max_tokens=8, stop=[stop])
    assert text == full[:full.find(stop)] and s.finish_reason == "stop"
    with pytest.raises(UnknownModel):
        list(store.run(TurnRequest(model="../../etc/passwd", messages=[user("x")])))
    calls = iter(range(100))
    events = list(store.run(TurnRequest(model="b", messages=[user("Open.")], max_tokens=50),
                            cancelled=lambda: next(calls) >= 2))
    assert events[-1][1].finish_reason == "cancelled" and events[-1][1].generated_tokens <= 4
    assert common_prefix([user("a"), user("b")], [user("a "), user("c")]) == 1


def test_engine_queue_bound_cancel_and_errors():
    import threading

    release = threading.Event()
    engine = Engine(max_queue=1)

    def blocker(cancelled):
        release.wait(10)
        yield "done"

    def failing(cancelled):
        raise ValueError("boom")
        yield

    first = engine.submit(blocker)
    while engine.running is None:
        pass
    waiting = engine.submit(failing)
    with pytest.raises(QueueFull):
        engine.submit(blocker)
    release.set()
    assert list(first) == ["done"]
    with pytest.raises(ValueError, match="boom"):
        list(waiting)
    job = engine.submit(lambda cancelled: iter(range(10**6)))
    it = iter(job)
    next(it)
    job.cancel()
    assert job.finished.wait(5)
    engine.close()
    assert engine.cancelled == 1


def test_the_message_trie_finds_the_longest_prefix_and_forgets_removed_paths():
    from mlx_kvlingo.serve.conversations import MessageTrie, conversation_keys

    trie = MessageTrie()
    sys_, a, b = {"role": "system", "content": "S"}, user("a"), user("b")
    trie.put(1, conversation_keys(None, [sys_, a]))
    trie.put(2, conversation_keys(None, [sys_, b]))
    assert trie.longest(conversation_keys(None, [sys_, a, b])) == ({1}, 3)
    assert trie.longest(conversation_keys(None, [sys_, user("c")])) == ({1, 2}, 2)
    assert trie.longest(conversation_keys([{"x": 1}], [sys_])) == (set(), 0)  # other tools
    trie.remove(1)
    assert trie.longest(conversation_keys(None, [sys_, a])) == ({2}, 2)
    trie.put(2, conversation_keys(None, [sys_, b, a]))  # a conversation grows: moved
    assert trie.longest(conversation_keys(None, [sys_, b, a])) == ({2}, 4)
    assert trie._root.children[conversation_keys(None, [])[0]].through == {2}


def test_a_stop_string_cut_across_tokenizers_reads_like_the_text_sent(toy_pair_dirs):
    """Two tokenizers (one with an extra special token) and exact maps: after a
    stop string cut a's answer, b answers the next turn as a fresh conversation
    holding the cut answer does, and every view spells the cut answer."""
    from tiny import identity_translator

    from mlx_kvlingo.models.load import load

    model, ta = load(toy_pair_dirs[1])
    _, tb = load(toy_pair_dirs[1])
    tb._tokenizer.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    base = Session({"a": (model, ta), "b": (model, tb)},
                   {("a", "b"): identity_translator(model, ta, tb),
                    ("b", "a"): identity_translator(model, tb, ta)}, chat_template=False)
    assert base.cross_tokenizer
    full, _ = run(ConversationStore(base), "a", [user("Sum a list.")], max_tokens=10)
    stop = full[5:7]
    store = ConversationStore(base)
    text, s = run(store, "a", [user("Sum a list.")], max_tokens=10, stop=[stop])
    assert text == full[:full.find(stop)] and len(text) >= 5
    session = store.session_of(s.conversation)
    for name in ("a", "b"):
        assert session.text(name).rstrip().endswith(text.rstrip()), name
    msgs = [user("Sum a list."), {"role": "assistant", "content": text}, user("Again.")]
    got, s2 = run(store, "b", msgs, max_tokens=6)
    assert s2.conversation == s.conversation and s2.translated_tokens > 0
    assert got == run(ConversationStore(base), "b", msgs, max_tokens=6)[0]


def test_own_positions_leave_out_foreign_ranges_through_truncation():
    from mlx_kvlingo.chat.transcript import Transcript

    view = Transcript()
    view.add_model("a")
    view.append(list(range(100)), "a", "prompt")
    view.processed["a"] = 100
    view.mark_foreign("a", 10, 30)
    view.mark_foreign("a", 20, 40)  # overlapping ranges count once
    view.mark_foreign("a", 60, 70)
    assert view.own_positions("a") == 100 - 30 - 10
    view.truncate(65)  # the cache is cut inside the last foreign range
    assert view.own_positions("a") == 65 - 30 - 5
    view.processed["a"] = 0  # the cache was reset: nothing held, nothing foreign
    view.clip_foreign("a")
    assert view.own_positions("a") == 0 and view.foreign["a"] == []
    copy = view.copy()
    copy.mark_foreign("a", 0, 1)
    assert view.foreign["a"] == []  # a copy's ranges are its own

"""`mlx-kvlingo serve` driven over HTTP by the real `openai` client (built-in pair)."""

import http.client
import json
import re
import threading
import time

import openai
import pytest
from tiny import user

from mlx_kvlingo.errors import KvlingoError
from mlx_kvlingo.serve.conversations import AutoRoute, ConversationStore
from mlx_kvlingo.serve.server import ServerConfig, make_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from mlx_kvlingo.pairs.builtin import builtin_session

    return builtin_session(cache_dir=tmp_path_factory.getbasetemp() / "kvlingo-cache")


class Running:
    def __init__(self, base, api_key=None, max_queue=8, auto=None, **config):
        auto = auto or AutoRoute("small", "large", probe_tokens=4, max_entropy=1e9)
        self.store = ConversationStore(base, auto=auto)
        self.server = make_server(self.store, port=0, max_queue=max_queue,
                                  config=ServerConfig(api_key=api_key, **config))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = self.server.url

    def client(self, api_key="none", **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **kw)

    def close(self):
        self.server.close()


@pytest.fixture
def serve(base):
    running = []

    def start(**kw):
        running.append(Running(base, **kw))
        return running[-1]

    yield start
    for r in running:
        r.close()


def test_models_plain_and_streamed_answers_and_a_switch(serve):
    srv = serve()
    client = srv.client()
    assert [m.id for m in client.models.list().data] == ["small", "large", "auto"]
    msgs = [user("Return the sum of the items.")]
    raw = client.chat.completions.with_raw_response.create(
        model="small", messages=msgs, max_tokens=8)
    r = raw.parse()
    answer = r.choices[0].message.content
    assert answer and r.model == "small" and r.choices[0].finish_reason in ("length", "stop")
    kv = r.model_extra["kvlingo"]
    assert kv["translated_tokens"] == 0 and r.usage.completion_tokens == kv["generated_tokens"]
    assert r.usage.prompt_tokens == kv["context_tokens"] > 0
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert raw.headers["x-kvlingo-model"] == "small"

    # Streamed: the same request again is a regenerate; greedy gives the same text.
    chunks = list(client.chat.completions.create(
        model="small", messages=msgs, max_tokens=8, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer
    last = [c for c in chunks if c.choices][-1]
    regenerated = last.model_extra["kvlingo"]
    # a copy of the first conversation's prefix; the first one stays whole
    assert last.choices[0].finish_reason and regenerated["branched_from"] == kv["conversation"]
    assert regenerated["shared_messages"] == 1
    assert chunks[-1].usage.completion_tokens > 0

    # The other model takes the next turn: the conversation is translated.
    msgs += [{"role": "assistant", "content": answer}, user("Open a file.")]
    raw = client.chat.completions.with_raw_response.create(
        model="large", messages=msgs, max_tokens=6)
    r2 = raw.parse()
    kv2 = r2.model_extra["kvlingo"]
    assert r2.model == "large" and kv2["conversation"] == regenerated["conversation"]
    assert kv2["translated_tokens"] > 0 and int(raw.headers["x-kvlingo-translated-tokens"]) > 0
    assert kv2["prefilled_tokens"] < kv2["context_tokens"] // 2
    msgs += [{"role": "assistant", "content": r2.choices[0].message.content}, user("Close it.")]
    r3 = client.chat.completions.create(model="small", messages=msgs, max_tokens=4)
    assert r3.usage.prompt_tokens_details.cached_tokens >= kv["context_tokens"]
    assert r3.model_extra["kvlingo"]["translated_tokens"] > 0


def test_auto_routing(serve):
    srv = serve()
    client = srv.client()
    r = client.chat.completions.create(model="auto", messages=[user("Sum a list.")], max_tokens=6)
    route = r.model_extra["kvlingo"]["route"]
    assert r.model == "small" and route["requested"] == "auto" and route["escalated"] is False
    srv.store.auto = AutoRoute("small", "large", probe_tokens=4, max_entropy=-1.0)
    msgs = [user("Sum a list."), {"role": "assistant", "content": r.choices[0].message.content},
            user("Open a file.")]
    raw = client.chat.completions.with_raw_response.create(model="auto", messages=msgs,
                                                           max_tokens=6)
    r = raw.parse()
    kv = r.model_extra["kvlingo"]
    assert r.model == "large" and kv["route"]["escalated"] is True and kv["route"]["entropy"] > 0
    # large translates the conversation small held and reads the new question itself
    assert kv["translated_tokens"] > 0 and kv["prefilled_tokens"] >= 4
    assert raw.headers["x-kvlingo-route"] == "auto-escalated"


def test_error_shapes_and_auth(serve):
    srv = serve(api_key="s3cret", max_tokens=64, max_body=2048)
    with pytest.raises(openai.AuthenticationError) as e:
        srv.client(api_key="wrong").models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    client = srv.client(api_key="s3cret")
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="/etc/passwd", messages=[user("hi")])
    assert e.value.body["code"] == "model_not_found" and "small" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="small", messages=[])
    assert e.value.body["param"] == "messages" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="small", messages=[user("hi")], max_tokens=65)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="small", messages=[user("x" * 4000)])
    assert e.value.status_code == 413
    conn = http.client.HTTPConnection(*srv.server.server_address[:2])
    conn.request("GET", "/health")
    assert conn.getresponse().status == 401
    assert client.chat.completions.create(model="small", messages=[user("hi")],
                                          max_tokens=2).choices[0].message.content is not None
    with pytest.raises(KvlingoError, match="API key"):
        make_server(srv.store, host="0.0.0.0", port=0)


def test_an_error_keeps_the_connection_when_its_body_was_read(serve):
    """A client reuses the connection after an error reply (the openai client's pool
    does): the server must either answer the next request on it or say
    `Connection: close` with the error, never close silently."""
    srv = serve(max_body=2048)
    conn = http.client.HTTPConnection(*srv.server.server_address[:2])
    auth = {"Authorization": "Bearer none", "Content-Type": "application/json"}
    for body in (b"{not json", b'{"model": "nope", "messages": []}', b"x" * 4000):
        conn.request("POST", "/v1/chat/completions", body=body, headers=auth)
        reply = conn.getresponse()
        reply.read()
        assert reply.status in (400, 404, 413) and reply.getheader("Connection") is None
    conn.request("GET", "/v1/models", headers=auth)
    assert conn.getresponse().status == 200  # the same socket still answers

    # A chunked body is not drained: the error says the connection closes.
    conn = http.client.HTTPConnection(*srv.server.server_address[:2])
    conn.request("POST", "/v1/chat/completions", body=iter([b"{}"]),
                 headers={**auth, "Transfer-Encoding": "chunked"})
    reply = conn.getresponse()
    assert reply.status == 411 and reply.getheader("Connection") == "close"


def test_queue_overflow_is_503_with_retry_after(serve):
    srv = serve(max_queue=1)
    release = threading.Event()

    def blocker(cancelled):
        release.wait(30)
        yield "start", None

    srv.server.engine.submit(blocker)  # the worker is busy
    while srv.server.engine.running is None:
        time.sleep(0.01)
    client = srv.client()
    waiting = []
    t = threading.Thread(target=lambda: waiting.append(client.chat.completions.create(
        model="small", messages=[user("Wait for it.")], max_tokens=2)))
    t.start()
    while srv.server.engine.waiting < 1:
        time.sleep(0.01)
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="small", messages=[user("One more.")], max_tokens=2)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"]
    assert e.value.body["code"] == "queue_full"
    release.set()
    t.join(60)
    assert waiting and waiting[0].choices[0].message.content is not None


def test_a_client_that_disconnects_mid_stream_cancels_its_job(serve):
    srv = serve()
    client = srv.client()
    msgs = [user("Describe the module in detail.")]
    stream = client.chat.completions.create(model="large", messages=msgs, max_tokens=2000,
                                            stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    engine = srv.server.engine
    deadline = time.time() + 60
    while engine.cancelled < 1 and time.time() < deadline:
        time.sleep(0.05)
    assert engine.cancelled == 1
    stored = srv.store.conversation_messages(1)[-1]["content"]
    r = client.chat.completions.create(model="small", messages=[user("Sum a list.")],
                                       max_tokens=4)
    assert r.choices[0].message.content and r.usage.completion_tokens == 4
    assert len(stored) < 2000


def conversation(client, first, turns=6, max_tokens=6):
    msgs, out = [user(first)], []
    for i in range(turns):
        model = ("small", "large")[i % 2]
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens)
        answer = r.choices[0].message.content
        out.append((model, answer, r.model_extra["kvlingo"]["translated_tokens"]))
        msgs += [{"role": "assistant", "content": answer}, user(f"And step {i + 2}?")]
    return out


def test_concurrent_conversations_are_isolated(serve):
    firsts = ["Return the sum of the items.", "Open the file and return a stream.",
              "Close the file.", "Raise ValueError if the list is empty."]
    alone_srv = serve()
    alone = [conversation(alone_srv.client(), f) for f in firsts]
    srv = serve()
    results = [None] * 4

    def client_thread(i):
        results[i] = conversation(srv.client(), firsts[i])

    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert results == alone
    assert len(srv.store) == 4
    assert all(n > 0 for conv in results for _, _, n in conv[1:])


def test_a_stream_that_fails_mid_way_ends_with_an_error_event(serve):
    from mlx_kvlingo.serve.conversations import TurnStats

    srv = serve()

    def failing_run(request, cancelled):
        yield "start", TurnStats(conversation=0, model="small")
        yield "delta", "Hel"
        raise KvlingoError("the model fell over")

    srv.store.run = failing_run
    stream = srv.client().chat.completions.create(model="small", messages=[user("Hi.")],
                                                  stream=True)
    got = []
    with pytest.raises(openai.APIError, match="fell over"):
        for chunk in stream:
            got.append(chunk.choices[0].delta.content)
    assert got == ["", "Hel"]


def test_the_openai_client_example_runs_against_the_server(serve):
    import subprocess
    import sys
    from pathlib import Path

    srv = serve()
    example = Path(__file__).resolve().parents[1] / "examples" / "openai_client.py"
    out = subprocess.run([sys.executable, str(example), "--base-url", srv.url + "/v1",
                          "--max-tokens", "6"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    turns = [line for line in out.stdout.splitlines() if line.startswith("  -> ")]
    assert len(turns) == 4 and turns[0].startswith("  -> small") and "large" in turns[1]
    # From the second turn on, the model taking it translates what the other wrote.
    assert all(" 0 translated" not in t for t in turns[1:]), turns


def test_the_coding_router_example_routes_through_auto(serve):
    """examples/coding_router.py against a live server: every turn asks for "auto";
    with a threshold no probe exceeds, the small model answers every turn; with one
    every probe exceeds, the large one does, reading the conversation translated."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "coding_router.py"

    def turns(srv):
        out = subprocess.run([sys.executable, str(example), "--base-url", srv.url + "/v1",
                              "--max-tokens", "6"], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr
        return [line for line in out.stdout.splitlines() if line.startswith("  -> ")]

    kept = turns(serve())
    assert len(kept) == 4 and all("answered by small (kept" in t for t in kept), kept
    escalated = turns(serve(auto=AutoRoute("small", "large", probe_tokens=4, max_entropy=-1.0)))
    assert all("answered by large (escalated" in t for t in escalated), escalated
    # Every turn is large's: it keeps its cache and reads only each new question.
    for t in escalated[1:]:
        context, prefilled = map(int, re.search(r"context (\d+) tokens, \d+ translated, "
                                                r"(\d+) prefilled", t).groups())
        assert prefilled < context // 2, t


def test_a_client_resetting_a_kept_alive_connection_prints_no_traceback(serve, capfd):
    import socket
    import struct

    srv = serve()
    sock = socket.create_connection(srv.server.server_address[:2])
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    # Close with a reset (linger 0) while the server waits for the next request.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
    time.sleep(0.5)
    conn = http.client.HTTPConnection(*srv.server.server_address[:2])
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    assert "Traceback" not in capfd.readouterr().err


# -- conversations chat apps rely on ------------------------------------------


def test_two_chats_sharing_a_system_prompt_then_back_to_the_first(serve):
    """The second chat copies the shared prefix; the first keeps its whole cache
    and, coming back to it, re-prefills only its new tokens."""
    client = serve().client()
    system = {"role": "system", "content": "You write Python."}
    first = [system, user("Return the sum of the items.")]
    a1 = client.chat.completions.create(model="small", messages=first, max_tokens=6)
    kv1 = a1.model_extra["kvlingo"]
    b1 = client.chat.completions.create(model="small", messages=[system, user("Open a file.")],
                                        max_tokens=6)
    kvb = b1.model_extra["kvlingo"]
    assert kvb["conversation"] != kv1["conversation"] and kvb["branched_from"] == kv1["conversation"]
    assert 0 < b1.usage.prompt_tokens_details.cached_tokens < a1.usage.prompt_tokens
    first += [{"role": "assistant", "content": a1.choices[0].message.content},
              user("Close it.")]
    a2 = client.chat.completions.create(model="small", messages=first, max_tokens=4)
    kv2 = a2.model_extra["kvlingo"]
    answered = a1.usage.prompt_tokens + a1.usage.completion_tokens
    assert kv2["conversation"] == kv1["conversation"] and kv2["branched_from"] is None
    assert answered - 1 <= a2.usage.prompt_tokens_details.cached_tokens <= answered
    assert kv2["prefilled_tokens"] == a2.usage.prompt_tokens - kv2["cached_tokens"]
    assert kv2["translated_tokens"] == 0


def test_cached_tokens_after_a_switch_count_only_the_models_own_positions(serve):
    """small, large, small, small: small's third turn translates large's answer
    into its cache; its fourth turn reports those positions apart."""
    client = serve().client()
    msgs, replies = [user("Return the sum of the items.")], []
    for i, model in enumerate(["small", "large", "small", "small"]):
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=4)
        replies.append(r)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 user(f"Step {i + 2}.")]
    third, fourth = (r.model_extra["kvlingo"] for r in replies[2:])
    assert third["translated_tokens"] > 0
    cached = replies[3].usage.prompt_tokens_details.cached_tokens
    held = cached + fourth["cached_translated_tokens"]
    assert fourth["cached_translated_tokens"] >= third["translated_tokens"]
    assert cached <= held - third["translated_tokens"] and cached == fourth["cached_tokens"]
    # held = everything small's cache had before its fourth turn's new message
    assert fourth["prefilled_tokens"] == replies[3].usage.prompt_tokens - held


def test_a_stop_string_cuts_the_stored_answer_so_the_next_request_extends_it(serve):
    client = serve().client()
    msgs = [user("Return the sum of the items.")]
    full = client.chat.completions.create(model="small", messages=msgs, max_tokens=10)
    full = full.choices[0].message.content
    stop = full[4:7]
    r = client.chat.completions.create(model="small", messages=msgs, max_tokens=10, stop=stop)
    text = r.choices[0].message.content
    assert text == full[:full.find(stop)] and r.choices[0].finish_reason == "stop"
    conversation = r.model_extra["kvlingo"]["conversation"]
    msgs += [{"role": "assistant", "content": text}, user("Now open a file.")]
    r2 = client.chat.completions.create(model="large", messages=msgs, max_tokens=4)
    kv2 = r2.model_extra["kvlingo"]
    assert kv2["conversation"] == conversation and kv2["branched_from"] is None
    assert kv2["shared_messages"] == 2


# -- limits: timeouts and keepalives -----------------------------------------------


def _hold_the_worker(srv, seconds):
    release = threading.Event()

    def blocker(cancelled):
        release.wait(seconds)
        yield "start", None

    srv.server.engine.submit(blocker)
    while srv.server.engine.running is None:
        time.sleep(0.01)
    return release


def test_a_request_timeout_is_a_504_or_an_error_event_never_silence(serve):
    srv = serve(request_timeout=0.6, keepalive=0.1)
    release = _hold_the_worker(srv, 30)
    client = srv.client()
    t0 = time.time()
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="small", messages=[user("Hi.")], max_tokens=2)
    assert e.value.status_code == 504 and e.value.body["code"] == "timeout"
    assert e.value.response.headers["x-should-retry"] == "false"
    assert time.time() - t0 < 10

    # A stream waiting for the worker gets keepalive comments, then an error event.
    conn = http.client.HTTPConnection(*srv.server.server_address[:2], timeout=30)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(
        {"model": "small", "messages": [user("Hi.")], "max_tokens": 2, "stream": True}),
        headers={"Content-Type": "application/json"})
    reply = conn.getresponse()
    body = reply.read().decode()
    assert reply.status == 200 and body.startswith(": keepalive\n\n")
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    assert events == [{"error": {"message": events[0]["error"]["message"], "type": "server_error",
                                 "param": None, "code": "timeout"}}]
    # and the openai client raises on it
    with pytest.raises(openai.APIError, match="timeout"):
        for _ in client.chat.completions.create(model="small", messages=[user("Hi.")],
                                                max_tokens=2, stream=True):
            pass
    release.set()


def test_a_waiting_stream_gets_keepalive_comments_and_then_its_answer(serve):
    srv = serve(keepalive=0.1)
    release = _hold_the_worker(srv, 30)
    threading.Timer(0.8, release.set).start()
    stream = srv.client().chat.completions.create(
        model="small", messages=[user("Sum a list.")], max_tokens=4, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text
    conn = http.client.HTTPConnection(*srv.server.server_address[:2], timeout=30)
    release = _hold_the_worker(srv, 30)
    threading.Timer(0.8, release.set).start()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(
        {"model": "small", "messages": [user("Sum a list.")], "max_tokens": 4, "stream": True}),
        headers={"Content-Type": "application/json"})
    body = conn.getresponse().read().decode()
    assert body.count(": keepalive\n\n") >= 3 and body.rstrip().endswith("data: [DONE]")


# -- parity with mlx_lm.server ----------------------------------------------------


def test_sampling_fields_go_through_mlx_lm(serve):
    client = serve().client()
    msgs = [user("Return the sum of the items.")]
    greedy = client.chat.completions.create(model="small", messages=msgs, max_tokens=8,
                                            logprobs=True, top_logprobs=3)
    content = greedy.choices[0].logprobs.content
    assert len(content) == greedy.usage.completion_tokens
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0]) and entry.token == entry.top_logprobs[0].token
    # temperature 1 with top_k 1 (or min_p 1) keeps only the most likely token: greedy.
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        r = client.chat.completions.create(model="small", messages=msgs, max_tokens=8,
                                           temperature=1.0, seed=3, extra_body=extra)
        assert r.choices[0].message.content == greedy.choices[0].message.content, extra
    # logit_bias: one token forced at every step
    token = content[0].model_extra["id"]
    forced = client.chat.completions.create(model="small", messages=[user("Anything.")],
                                            max_tokens=5, logit_bias={str(token): 100},
                                            logprobs=True)
    assert [e.model_extra["id"] for e in forced.choices[0].logprobs.content] == [token] * 5
    # penalties are accepted (mlx-lm's logits processors); bad values are a 400
    client.chat.completions.create(model="small", messages=msgs, max_tokens=2,
                                   presence_penalty=0.5, frequency_penalty=0.5,
                                   extra_body={"repetition_penalty": 1.2,
                                               "repetition_context_size": 10})
    for bad in ({"top_k": -1}, {"min_p": 2}, {"repetition_penalty": "x"},
                {"logit_bias": {"a": 1}}, {"top_logprobs": 50}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="small", messages=msgs, max_tokens=2,
                                           extra_body=bad)
        assert e.value.body["param"] == next(iter(bad)), bad


def test_fields_that_cannot_be_honoured_are_a_400(serve):
    client = serve().client()
    msgs = [user("Hi.")]
    cases = [({"response_format": {"type": "json_object"}}, "response_format"),
             ({"n": 2}, "n"),
             ({"logprobs": True, "stream": True}, "logprobs"),
             ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
             ({"tool_choice": "required"}, "tool_choice"),
             ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs")]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="small", messages=msgs, max_tokens=2,
                                           extra_body=body)
        assert e.value.body["param"] == param, body
    # the tool role is accepted: a tool's result reads like any message
    r = client.chat.completions.create(model="small", max_tokens=2, messages=[
        user("Sum 1 and 2."),
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}])
    assert r.usage.completion_tokens == 2


def test_text_completions(serve):
    client = serve().client()
    r = client.completions.create(model="small", prompt="def add(a, b):", max_tokens=6,
                                  logprobs=2)
    assert r.object == "text_completion" and r.choices[0].text
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 0
    assert len(r.choices[0].logprobs.tokens) == 6
    assert all(len(t) == 2 for t in r.choices[0].logprobs.top_logprobs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="small", prompt="def add(a, b):", max_tokens=6, stream=True) if c.choices)
    assert streamed == r.choices[0].text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="auto", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="small", prompt="x", max_tokens=2, echo=True)
    assert e.value.body["param"] == "echo"


def test_cors_preflight_and_headers(serve):
    srv = serve(api_key="k")
    conn = http.client.HTTPConnection(*srv.server.server_address[:2])
    conn.request("OPTIONS", "/v1/chat/completions",
                 headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST"})
    reply = conn.getresponse()
    reply.read()
    assert reply.status == 204
    assert reply.getheader("Access-Control-Allow-Origin") == "*"
    assert reply.getheader("Access-Control-Allow-Methods") == "*"
    assert reply.getheader("Access-Control-Allow-Headers") == "*"
    conn.request("GET", "/v1/models", headers={"Authorization": "Bearer k"})
    reply = conn.getresponse()
    reply.read()
    assert reply.status == 200 and reply.getheader("Access-Control-Allow-Origin") == "*"
    only = serve(allowed_origins=["http://app.example"])
    conn = http.client.HTTPConnection(*only.server.server_address[:2])
    for origin, allowed in (("http://app.example", "http://app.example"), ("http://evil", None)):
        conn.request("OPTIONS", "/v1/models", headers={"Origin": origin})
        reply = conn.getresponse()
        reply.read()
        assert reply.getheader("Access-Control-Allow-Origin") == allowed


TOOLS_TEMPLATE = (
    "{% if tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                        "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture
def templated(toy_pair_dirs):
    """The built-in small model with a chat template that renders tools (its own
    tokenizer has no template), under both names of the auto route."""
    from mlx_kvlingo.chat.session import Session
    from mlx_kvlingo.models.load import load

    model, tok = load(toy_pair_dirs[0])
    tok._tokenizer.chat_template = TOOLS_TEMPLATE
    return Session({"small": (model, tok), "large": (model, tok)}), tok


def test_tools_reach_the_chat_template_and_tool_calls_are_parsed(serve, templated):
    base, tok = templated
    srv = Running(base)
    try:
        client = srv.client()
        msgs = [user("Return the sum of the items.")]
        plain = client.chat.completions.create(model="small", messages=msgs, max_tokens=8)
        with_tools = client.chat.completions.create(model="small", messages=msgs, max_tokens=8,
                                                    tools=[ADD])
        assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens  # tools rendered
        kv = with_tools.model_extra["kvlingo"]
        assert kv["branched_from"] is None  # other tools: another conversation
        answer = with_tools.choices[0].message.content
        assert len(answer) > 8 and with_tools.choices[0].message.tool_calls is None

        # A tokenizer with tool calling: its parser reads the section after the marker.
        at = next(i for i in range(2, len(answer) - 3) if answer.find(answer[i:i + 3]) == i
                  and answer[:i].strip())
        marker = answer[at:at + 3]
        tok._tool_call_start, tok._tool_call_end = marker, None
        tok._tool_parser = lambda text, tools: {"name": tools[0]["function"]["name"],
                                                "arguments": {"rest": text}}
        r = client.chat.completions.create(model="small", messages=msgs, max_tokens=8,
                                           tools=[ADD])
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
        assert json.loads(call.function.arguments) == {"rest": answer[at + 3:]}
        assert r.choices[0].message.content == answer[:at]
        chunks = list(client.chat.completions.create(model="small", messages=msgs,
                                                     max_tokens=8, tools=[ADD], stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        assert text == answer[:at] and marker not in text
        assert [c.function.name for c in calls] == ["add"] and calls[0].index == 0
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    finally:
        srv.close()


def test_serve_options_reach_the_server(kv_cache_dir):
    from mlx_kvlingo.serve.server import ServeOptions, start

    server = start(ServeOptions(port=0, request_timeout=5.0, keepalive=2.0,
                                allowed_origins=["http://app.example"], cache_dir=kv_cache_dir),
                   log=lambda *_: None)
    try:
        config = server.config
        assert (config.request_timeout, config.keepalive) == (5.0, 2.0)
        assert config.allowed_origins == ["http://app.example"]
    finally:
        server.server_close()
        server.engine.close()

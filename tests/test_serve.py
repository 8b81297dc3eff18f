"""`mlx-kvlingo serve` driven over HTTP by the real `openai` client (built-in pair)."""

import http.client
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
    assert last.choices[0].finish_reason and last.model_extra["kvlingo"]["truncated_messages"] == 1
    assert chunks[-1].usage.completion_tokens > 0

    # The other model takes the next turn: the conversation is translated.
    msgs += [{"role": "assistant", "content": answer}, user("Open a file.")]
    raw = client.chat.completions.with_raw_response.create(
        model="large", messages=msgs, max_tokens=6)
    r2 = raw.parse()
    kv2 = r2.model_extra["kvlingo"]
    assert r2.model == "large" and kv2["conversation"] == kv["conversation"]
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

"""An OpenAI-compatible chat server over a ConversationStore (``mlx-kvlingo serve``).

A thin HTTP layer (the standard library's ThreadingHTTPServer): handler threads
parse, check and serialise; every model computation runs on the engine's one
worker thread (:mod:`.engine`), conversations and routing live in
:mod:`.conversations`. Endpoints: ``GET /health``, ``GET /v1/models``,
``POST /v1/chat/completions`` and ``POST /v1/completions`` (streamed as
server-sent events or not), and ``OPTIONS`` for CORS preflights.

Nothing a request says can load a model or read a file: ``model`` must be one of
the names given on the command line (or ``auto``).
"""

import hmac
import ipaddress
import json
import os
import queue
import select
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence

from ..switching.gate import QualityGate
from ..chat.session import finish_thread
from ..errors import KvlingoError
from ..pairs.assemble import build_session, describe_session
from .conversations import (
    AUTO,
    AutoRoute,
    CompletionRequest,
    ConversationStore,
    Sampling,
    TurnRequest,
    UnknownModel,
)
from .engine import Engine, QueueFull

API_KEY_ENV = "MLX_KVLINGO_API_KEY"
_DRAIN_LIMIT = 64 << 20  # unread bodies up to this size are read and dropped before an error
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}
# Request fields this server knows and cannot honour: a clear 400, not silence.
UNSUPPORTED = {
    "audio": "audio output", "modalities": "output modalities other than text",
    "prediction": "predicted outputs", "functions": "'functions' (give 'tools')",
    "function_call": "'function_call' (give 'tools')", "adapters": "adapters",
    "draft_model": "draft models", "num_draft_tokens": "draft models",
    "role_mapping": "role mappings", "chat_template_kwargs": "chat template arguments",
    "suffix": "suffixes", "echo": "echoing the prompt", "best_of": "best_of",
    "web_search_options": "web search",
}


class RequestError(Exception):
    """An error answered with OpenAI's error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class RequestTimeout(Exception):
    """The request ran past the server's request timeout."""


class ServerConfig:
    def __init__(self, api_key: Optional[str] = None, max_body: int = 4 << 20,
                 max_tokens: int = 2048, default_max_tokens: int = 512,
                 retry_after: int = 2, request_timeout: float = 600.0,
                 keepalive: float = 10.0, allowed_origins: Sequence[str] = ("*",)):
        self.api_key = api_key
        self.max_body = max_body
        self.max_tokens = max_tokens
        self.default_max_tokens = min(default_max_tokens, max_tokens)
        self.retry_after = retry_after
        self.request_timeout = request_timeout
        self.keepalive = keepalive  # seconds between ": keepalive" comments of a waiting stream
        self.allowed_origins = list(allowed_origins)


def parse_chat_request(body: dict, store: ConversationStore, config: ServerConfig) -> TurnRequest:
    """A TurnRequest from an OpenAI chat-completions body, or RequestError."""
    model = _common(body, store.model_names)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list.", param="messages")
    out = [_message(m, i) for i, m in enumerate(messages)]
    tools = _tools(body, store)
    logprobs, top = _logprobs(body)
    return TurnRequest(model=model, messages=out, max_tokens=_max_tokens(body, config),
                       sampling=parse_sampling(body), stop=_stop(body), logprobs=logprobs,
                       top_logprobs=top, tools=tools)


def parse_completion_request(body: dict, store: ConversationStore,
                             config: ServerConfig) -> CompletionRequest:
    """A CompletionRequest from an OpenAI completions body, or RequestError."""
    model = _common(body, store.base.model_names)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError(400, "'prompt' must be a non-empty string.", param="prompt")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool)
                                 or not 0 <= logprobs <= 5):
        raise RequestError(400, "'logprobs' is an integer in [0, 5] for completions.",
                           param="logprobs")
    return CompletionRequest(model=model, prompt=prompt, max_tokens=_max_tokens(body, config),
                             sampling=parse_sampling(body), stop=_stop(body),
                             logprobs=logprobs is not None, top_logprobs=logprobs or 0)


def _common(body, models) -> str:
    """Checks shared by both endpoints; returns the model name."""
    if not isinstance(body, dict):
        raise RequestError(400, "The body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "'model' is required (a string).", param="model")
    if model not in models:
        raise RequestError(404, f"The model {model!r} does not exist; models: "
                           f"{', '.join(models)}.", param="model", code="model_not_found")
    for key, what in UNSUPPORTED.items():
        if body.get(key) not in (None, False, [], {}) and not (
                key == "modalities" and body[key] == ["text"]):
            raise RequestError(400, f"This server does not support {what} ('{key}').",
                               param=key, code="unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise RequestError(400, "Only response_format {'type': 'text'} is supported.",
                           param="response_format", code="unsupported_parameter")
    if body.get("n", 1) not in (1, None):
        raise RequestError(400, "Only n = 1 is supported.", param="n")
    if not isinstance(body.get("stream", False), (bool, type(None))):
        raise RequestError(400, "'stream' must be a boolean.", param="stream")
    if body.get("stream") and (body.get("logprobs") or body.get("top_logprobs")):
        raise RequestError(400, "logprobs are given in replies that are not streamed only.",
                           param="logprobs", code="unsupported_parameter")
    return model


def _message(m, i: int) -> dict:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise RequestError(400, f"messages[{i}] needs a role among {sorted(ROLES)}.",
                           param=f"messages[{i}].role")
    out = {"role": ROLES[m["role"]], "content": _content(m.get("content"), i)}
    calls = m.get("tool_calls")
    if calls:
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise RequestError(400, f"messages[{i}].tool_calls: a list, on an assistant message.",
                               param=f"messages[{i}].tool_calls")
        out["tool_calls"] = [_tool_call_in(c, i) for c in calls]
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def _tool_call_in(call, i: int) -> dict:
    """A tool call an assistant message carries, with its arguments as a mapping
    (what chat templates expect; OpenAI sends them as a JSON string)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(400, f"messages[{i}].tool_calls: each has a function name.",
                           param=f"messages[{i}].tool_calls")
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise RequestError(400, f"messages[{i}].tool_calls: arguments are not JSON.",
                               param=f"messages[{i}].tool_calls") from None
    return {**call, "function": {**fn, "arguments": args}}


def _tools(body: dict, store: ConversationStore) -> Optional[list]:
    tools = body.get("tools") or None
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise RequestError(400, "'tool_choice' needs 'tools'.", param="tool_choice")
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RequestError(400, "'tools' must be a list of objects.", param="tools")
    if choice not in (None, "auto"):
        raise RequestError(400, "Only tool_choice 'auto' is supported: the model decides.",
                           param="tool_choice", code="unsupported_parameter")
    if not store.tools_supported():
        raise RequestError(400, "A model here has no chat template, so it cannot be given "
                           "tools.", param="tools", code="unsupported_parameter")
    return tools


def _logprobs(body: dict):
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, (bool, type(None))):
        raise RequestError(400, "'logprobs' must be a boolean.", param="logprobs")
    top = body.get("top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool)
                            or not 0 <= top <= 20):
        raise RequestError(400, "'top_logprobs' is an integer in [0, 20].",
                           param="top_logprobs")
    return bool(logprobs) or bool(top), top or 0


def _max_tokens(body: dict, config: ServerConfig) -> int:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = config.default_max_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RequestError(400, "'max_tokens' must be a positive integer.", param="max_tokens")
    if max_tokens > config.max_tokens:
        raise RequestError(400, f"'max_tokens' is at most {config.max_tokens} on this server.",
                           param="max_tokens")
    return max_tokens


def _stop(body: dict) -> list:
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop):
        raise RequestError(400, "'stop' is a string or a list of at most 4 strings.", param="stop")
    return stop


def parse_sampling(body: dict) -> Sampling:
    """mlx-lm's sampling and logits-processing fields (``mlx_lm.server``'s names
    and defaults)."""
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise RequestError(400, "'seed' must be an integer.", param="seed")
    return Sampling(
        temperature=_number(body, "temperature", 0.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=_integer(body, "top_k", 0),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        xtc_probability=_number(body, "xtc_probability", 0.0, 0.0, 1.0),
        xtc_threshold=_number(body, "xtc_threshold", 0.1, 0.0, 0.5),
        repetition_penalty=_number(body, "repetition_penalty", None, 0.0, 10.0),
        repetition_context_size=_integer(body, "repetition_context_size", 20),
        presence_penalty=_number(body, "presence_penalty", None, -2.0, 2.0),
        presence_context_size=_integer(body, "presence_context_size", 20),
        frequency_penalty=_number(body, "frequency_penalty", None, -2.0, 2.0),
        frequency_context_size=_integer(body, "frequency_context_size", 20),
        logit_bias=_logit_bias(body),
        seed=seed,
    )


def _logit_bias(body: dict) -> Optional[dict]:
    bias = body.get("logit_bias")
    if bias is None:
        return None
    try:
        if not isinstance(bias, dict):
            raise ValueError
        out = {int(k): float(v) for k, v in bias.items()}
    except (TypeError, ValueError):
        raise RequestError(400, "'logit_bias' maps token ids to numbers.",
                           param="logit_bias") from None
    if any(not -100 <= v <= 100 for v in out.values()):
        raise RequestError(400, "'logit_bias' values are in [-100, 100].", param="logit_bias")
    return out or None


def _content(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise RequestError(400, f"messages[{i}]: only text content parts are supported.",
                                   param=f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    if content is None:
        return ""
    raise RequestError(400, f"messages[{i}].content must be a string.",
                       param=f"messages[{i}].content")


def _number(body: dict, key: str, default, lo: float, hi: float):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise RequestError(400, f"'{key}' must be a number in [{lo}, {hi}].", param=key)
    return float(v)


def _integer(body: dict, key: str, default: int) -> int:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise RequestError(400, f"'{key}' must be a non-negative integer.", param=key)
    return v


def kvlingo_headers(stats) -> dict:
    return {
        "X-Kvlingo-Model": stats.model,
        "X-Kvlingo-Route": "auto-escalated" if stats.route.get("escalated") else (
            "auto" if stats.route.get("requested") == AUTO else "named"),
        "X-Kvlingo-Conversation": str(stats.conversation),
        "X-Kvlingo-Translated-Tokens": str(stats.translated_tokens),
        "X-Kvlingo-Prefilled-Tokens": str(stats.prefilled_tokens),
        "X-Kvlingo-Cached-Tokens": str(stats.cached_tokens),
        "X-Kvlingo-Translate-Ms": f"{stats.translate_ms:.1f}",
        "X-Kvlingo-Fallback": stats.fallback or "none",
    }


class ChatServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, store: ConversationStore, engine: Engine, config: ServerConfig):
        super().__init__(address, Handler)
        self.store, self.engine, self.config = store, engine, config

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def close(self):
        self.shutdown()
        self.server_close()
        self.engine.close()

    def handle_error(self, request, client_address):
        """A client that drops a kept-alive connection is normal, not an error
        worth a traceback (socketserver prints one for every exception)."""
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return
        super().handle_error(request, client_address)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ChatServer

    def log_message(self, format, *args):  # quiet unless asked
        if os.environ.get("MLX_KVLINGO_SERVE_LOG"):
            super().log_message(format, *args)

    # -- plumbing --------------------------------------------------------------

    def _send_json(self, status: int, obj, headers=None):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self._cors_headers()
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _cors_headers(self):
        """Browser apps on another origin may call the API (as mlx_lm.server:
        every origin unless ``allowed_origins`` names some)."""
        allowed = self.server.config.allowed_origins
        origin = self.headers.get("Origin")
        if "*" in allowed:
            self.send_header("Access-Control-Allow-Origin", "*")
        elif origin in allowed:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")
        self.send_header("Access-Control-Allow-Methods", "*")
        self.send_header("Access-Control-Allow-Headers", "*")

    def _error(self, e: RequestError):
        self._send_json(e.status, e.body(), e.headers)

    def _authorized(self) -> bool:
        key = self.server.config.api_key
        if not key:
            return True
        got = self.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {key}".encode())

    def _guard(self, fn):
        self._body_read = False
        try:
            if not self._authorized():
                raise RequestError(401, "Missing or wrong API key (Authorization: Bearer ...).",
                                   type_="authentication_error", code="invalid_api_key")
            fn()
        except RequestError as e:
            if not self._discard_body():
                # The body's end is unknown: say so, or a client that reuses the
                # connection sends its next request into a socket we are closing.
                self.close_connection = True
                e.headers = {**(e.headers or {}), "Connection": "close"}
            self._error(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _discard_body(self) -> bool:
        """Read and drop an unread request body (up to a bound) before answering an
        error: closing a socket with unread data resets the connection, and the
        client would see no answer. True when the connection is at the start of the
        next request again (it can be kept alive)."""
        if self._body_read:
            return True
        length = self.headers.get("Content-Length", "")
        if self.headers.get("Transfer-Encoding") or (length and not length.isdigit()):
            return False
        left = int(length or 0)
        if left > _DRAIN_LIMIT:
            return False
        while left > 0:
            got = self.rfile.read(min(left, 1 << 16))
            if not got:
                return False
            left -= len(got)
        return True

    def do_OPTIONS(self):
        """CORS preflight: no key needed (browsers send none with it)."""
        self.send_response(204)
        self._cors_headers()
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        self._guard(self._get)

    def do_POST(self):
        self._guard(self._post)

    def _get(self):
        store, engine = self.server.store, self.server.engine
        if self.path == "/health":
            self._send_json(200, {"status": "ok", "models": store.model_names,
                                  "conversations": len(store), "waiting": engine.waiting,
                                  "busy": engine.running is not None})
        elif self.path == "/v1/models":
            now = int(time.time())
            self._send_json(200, {"object": "list", "data": [
                {"id": n, "object": "model", "created": now, "owned_by": "mlx-kvlingo"}
                for n in store.model_names]})
        else:
            raise RequestError(404, f"No route {self.path}.", code="not_found")

    def _read_body(self) -> dict:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise RequestError(411, "A Content-Length header is required.")
        if int(length) > self.server.config.max_body:
            raise RequestError(413, f"The body is over {self.server.config.max_body} bytes.",
                               code="request_too_large")
        raw = self.rfile.read(int(length))
        self._body_read = True
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise RequestError(400, "The body is not valid JSON.") from None

    def _post(self):
        if self.path not in ("/v1/chat/completions", "/v1/completions"):
            raise RequestError(404, f"No route {self.path}.", code="not_found")
        body = self._read_body()
        store, config = self.server.store, self.server.config
        chat = self.path == "/v1/chat/completions"
        if chat:
            request = parse_chat_request(body, store, config)
            work = lambda cancelled: store.run(request, cancelled)  # noqa: E731
        else:
            request = parse_completion_request(body, store, config)
            work = lambda cancelled: store.complete(request, cancelled)  # noqa: E731
        reply = Reply(chat, request.model)
        try:
            job = self.server.engine.submit(work)
        except QueueFull as e:
            raise RequestError(503, str(e), type_="server_error", code="queue_full",
                               headers={"Retry-After": str(config.retry_after)})
        try:
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                self._stream(job, reply, include_usage)
            else:
                self._complete(job, reply)
        finally:
            if not job.finished.is_set():
                job.cancel()  # this thread left early: stop the job

    def _next(self, job, deadline: float, idle: Callable[[], None] = lambda: None):
        """The job's next event. While none comes: ``idle()`` every tick; the job is
        cancelled when the client hangs up (ConnectionResetError) or the request
        runs past its deadline (RequestTimeout)."""
        while True:
            try:
                return job.next_event(timeout=0.1)
            except queue.Empty:
                if self._client_gone():
                    job.cancel()
                    raise ConnectionResetError("client gone") from None
                if time.monotonic() > deadline:
                    job.cancel()
                    raise RequestTimeout() from None
                idle()

    def _client_gone(self) -> bool:
        try:
            ready, _, _ = select.select([self.connection], [], [], 0)
            if ready:
                return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True
        return False

    def _failure(self, e: Exception) -> RequestError:
        if isinstance(e, RequestTimeout):
            limit = self.server.config.request_timeout
            # Not retried by OpenAI clients: the same request would time out again.
            return RequestError(504, f"The request took longer than the server's request "
                                f"timeout ({limit:g} s); it was stopped.", type_="server_error",
                                code="timeout", headers={"x-should-retry": "false"})
        if isinstance(e, UnknownModel):
            return RequestError(404, str(e), code="model_not_found")
        if isinstance(e, KvlingoError):
            return RequestError(400, str(e))
        return RequestError(500, f"{type(e).__name__}: {e}", type_="server_error")

    def _complete(self, job, reply: "Reply"):
        deadline = time.monotonic() + self.server.config.request_timeout
        try:
            while True:
                try:
                    kind, value = self._next(job, deadline)
                except StopIteration:
                    break
                reply.add(kind, value)
        except ConnectionResetError:
            return
        except Exception as e:  # the job failed or timed out
            raise self._failure(e) from None
        self._send_json(200, reply.whole(), kvlingo_headers(reply.stats))

    def _stream(self, job, reply: "Reply", include_usage: bool):
        """Server-sent events. The headers go out with the answering model's first
        event, or earlier when the request waits longer than the keepalive
        interval (in the queue, or while its model catches up): the client then
        gets ``: keepalive`` comments meanwhile instead of silence."""
        config = self.server.config
        deadline = time.monotonic() + config.request_timeout
        state = {"headers": False, "last": time.monotonic()}

        def start(stats=None):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self._cors_headers()
            for k, v in (kvlingo_headers(stats) if stats is not None else {}).items():
                self.send_header(k, v)
            self.end_headers()
            state["headers"] = True

        def idle():
            if time.monotonic() - state["last"] < config.keepalive:
                return
            if not state["headers"]:
                start()
            self._write_chunk(b": keepalive\n\n")
            state["last"] = time.monotonic()

        try:
            while True:
                try:
                    kind, value = self._next(job, deadline, idle)
                except StopIteration:
                    break
                except ConnectionResetError:
                    return
                except Exception as e:
                    err = self._failure(e)
                    if not state["headers"]:
                        raise err from None
                    self._event(err.body())  # a failure mid-way: an error event, then the end
                    self._end_stream()
                    return
                if kind == "start" and not state["headers"]:
                    start(value)
                for event in reply.stream_events(kind, value, include_usage):
                    self._event(event)
                state["last"] = time.monotonic()
            self._write_chunk(b"data: [DONE]\n\n")
            self._end_stream()
        except (BrokenPipeError, ConnectionResetError, OSError):
            job.cancel()
            self.close_connection = True

    def _event(self, obj):
        self._write_chunk(f"data: {json.dumps(obj)}\n\n".encode())

    def _write_chunk(self, data: bytes):
        self.wfile.write(f"{len(data):X}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _end_stream(self):
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class Reply:
    """One reply in OpenAI's shapes (chat or text completion), built from the
    store's events: whole, or as stream chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        prefix = "chatcmpl" if chat else "cmpl"
        self.id, self.created = f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time())
        self.model = model
        self.text, self.tool_calls, self.logprobs = "", [], None
        self.stats = None

    def add(self, kind: str, value):
        if kind == "start":
            self.stats, self.model = value, value.model
        elif kind == "delta":
            self.text += value
        elif kind == "tool_calls":
            self.tool_calls = value
        elif kind == "logprobs":
            self.logprobs = value
        elif kind == "done":
            self.stats, self.model = value, value.model

    def _object(self, chunk: bool) -> str:
        if not self.chat:
            return "text_completion"
        return "chat.completion.chunk" if chunk else "chat.completion"

    def _logprobs(self):
        if self.logprobs is None:
            return None
        if self.chat:
            return {"content": self.logprobs}
        return {"tokens": [e["token"] for e in self.logprobs],
                "token_logprobs": [e["logprob"] for e in self.logprobs],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]}
                                 for e in self.logprobs],
                "text_offset": _offsets([e["token"] for e in self.logprobs])}

    def whole(self) -> dict:
        stats = self.stats
        choice = {"index": 0, "finish_reason": _finish(stats.finish_reason),
                  "logprobs": self._logprobs()}
        if self.chat:
            message = {"role": "assistant",
                       "content": self.text if self.text or not self.tool_calls else None}
            if self.tool_calls:
                message["tool_calls"] = self.tool_calls
            choice["message"] = message
        else:
            choice["text"] = self.text
        return {"id": self.id, "object": self._object(False), "created": self.created,
                "model": stats.model, "choices": [choice], "usage": stats.usage(),
                "kvlingo": stats.to_dict()}

    def _chunk(self, delta: dict, finish=None, **extra) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta.get("content", ""), "finish_reason": finish,
                      "logprobs": None}
        return {"id": self.id, "object": self._object(True), "created": self.created,
                "model": self.model, "choices": [choice], **extra}

    def stream_events(self, kind: str, value, include_usage: bool) -> Iterator[dict]:
        self.add(kind, value)
        if kind == "start" and self.chat:
            yield self._chunk({"role": "assistant", "content": ""})
        elif kind == "delta":
            yield self._chunk({"content": value})
        elif kind == "tool_calls":
            yield self._chunk({"tool_calls": [dict(c, index=i) for i, c in enumerate(value)]})
        elif kind == "done":
            yield self._chunk({}, _finish(value.finish_reason), kvlingo=value.to_dict())
            if include_usage:
                yield {"id": self.id, "object": self._object(True), "created": self.created,
                       "model": value.model, "choices": [], "usage": value.usage()}


def _offsets(tokens: Sequence[str]) -> List[int]:
    out, at = [], 0
    for t in tokens:
        out.append(at)
        at += len(t)
    return out


def _finish(reason: Optional[str]) -> str:
    if reason == "tool_calls":
        return reason
    return "length" if reason in (None, "length") else "stop"


# ---------------------------------------------------------------------------
# Building and running


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_server(store: ConversationStore, host: str = "127.0.0.1", port: int = 0,
                config: Optional[ServerConfig] = None, max_queue: int = 8,
                allow_insecure_bind: bool = False) -> ChatServer:
    """A ready (not yet serving) server; ``port`` 0 picks a free one."""
    config = config or ServerConfig()
    if not is_loopback(host) and not config.api_key and not allow_insecure_bind:
        raise KvlingoError(
            f"Refusing to serve on {host} without an API key: anyone who can reach it could "
            f"use the models. Give --api-key (or ${API_KEY_ENV}), or --allow-insecure-bind."
        )
    engine = Engine(max_queue, on_exit=finish_thread)
    try:
        return ChatServer((host, port), store, engine, config)
    except OSError:
        engine.close()
        raise


@dataclass
class ServeOptions:
    """What ``mlx-kvlingo serve`` is given (see its ``--help``)."""

    models: Sequence[str] = ()  # NAME=PATH or PATH; none: the built-in pair
    translators: Sequence[str] = ()  # SOURCE:TARGET=FILE or FILE
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    allow_insecure_bind: bool = False
    auto: Optional[str] = None  # SMALL:LARGE for model 'auto'
    auto_entropy: float = 2.5
    auto_probe: int = 8
    gate: bool = False
    gate_threshold: Optional[float] = None
    fit_missing: bool = False
    fit_tokens: int = 10_000
    max_queue: int = 8
    max_tokens: int = 2048
    default_max_tokens: int = 512
    max_body_kb: int = 4096
    max_conversations: int = 32
    max_cache_mb: int = 4096
    request_timeout: float = 600.0
    keepalive: float = 10.0
    allowed_origins: Sequence[str] = ("*",)
    cache_dir: Optional[Path] = None
    # Share of translated positions recomputed (fact-like words), and the most
    # positions per catch-up; None: the translators' defaults.
    recompute: Optional[float] = None
    recompute_max: Optional[int] = None
    # Catch-ups translating fewer positions prefill instead; None: measured per pair
    # on this machine (switching.break_even), else the translator file's.
    break_even: Optional[int] = None


def start(options: ServeOptions, log: Callable[[str], None] = print) -> ChatServer:
    """Load the models and translators and bind the server (not yet serving)."""
    key = options.api_key or os.environ.get(API_KEY_ENV) or None
    if not is_loopback(options.host) and not key and not options.allow_insecure_bind:
        raise KvlingoError(
            f"Refusing to serve on {options.host} without an API key; give --api-key (or "
            f"${API_KEY_ENV}), or --allow-insecure-bind.")
    base = build_session(options.models, options.translators, options.fit_missing,
                         options.fit_tokens, options.cache_dir, None, log=log,
                         recompute=options.recompute, recompute_max=options.recompute_max)
    if options.gate:
        base.gate = QualityGate(threshold=options.gate_threshold)
    if options.break_even is not None:
        base.break_even = options.break_even
    names = base.model_names
    small, _, large = (options.auto or f"{names[0]}:{names[1]}").partition(":")
    route = AutoRoute(small, large, options.auto_probe, options.auto_entropy)
    store = ConversationStore(base, options.max_conversations, options.max_cache_mb << 20, route)
    config = ServerConfig(key, options.max_body_kb << 10, options.max_tokens,
                          options.default_max_tokens, request_timeout=options.request_timeout,
                          keepalive=options.keepalive,
                          allowed_origins=options.allowed_origins)
    server = make_server(store, options.host, options.port, config, options.max_queue,
                         options.allow_insecure_bind)
    log(describe_session(base))
    log(f"  auto: {small} -> {large} when mean entropy > {options.auto_entropy} nats")
    log(f"Serving on {server.url}/v1 (Ctrl-C stops)" + (" — API key required" if key else ""))
    return server


def run(options: ServeOptions, log: Callable[[str], None] = print):
    """Serve until interrupted (Ctrl-C), then close the worker and the socket."""
    server = start(options, log)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        log("Stopping.")
    finally:
        server.close()

"""An OpenAI-compatible chat server over a ConversationStore (``mlx-kvlingo serve``).

A thin HTTP layer (the standard library's ThreadingHTTPServer): handler threads
parse, check and serialise; every model computation runs on the engine's one
worker thread (:mod:`.engine`), conversations and routing live in
:mod:`.conversations`. Endpoints: ``GET /health``, ``GET /v1/models``,
``POST /v1/chat/completions`` (streamed as server-sent events or not).

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
from typing import Callable, Optional, Sequence

from ..chat.gate import QualityGate
from ..chat.session import finish_thread
from ..errors import KvlingoError
from ..pairs.assemble import build_session, describe_session
from .conversations import AUTO, AutoRoute, ConversationStore, TurnRequest, UnknownModel
from .engine import Engine, QueueFull

API_KEY_ENV = "MLX_KVLINGO_API_KEY"
_DRAIN_LIMIT = 64 << 20  # unread bodies up to this size are read and dropped before an error
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


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


class ServerConfig:
    def __init__(self, api_key: Optional[str] = None, max_body: int = 4 << 20,
                 max_tokens: int = 2048, default_max_tokens: int = 512,
                 retry_after: int = 2, request_timeout: float = 600.0):
        self.api_key = api_key
        self.max_body = max_body
        self.max_tokens = max_tokens
        self.default_max_tokens = min(default_max_tokens, max_tokens)
        self.retry_after = retry_after
        self.request_timeout = request_timeout


def parse_chat_request(body: dict, store: ConversationStore, config: ServerConfig) -> TurnRequest:
    """A TurnRequest from an OpenAI chat-completions body, or RequestError."""
    if not isinstance(body, dict):
        raise RequestError(400, "The body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "'model' is required (a string).", param="model")
    if model not in store.model_names:
        raise RequestError(404, f"The model {model!r} does not exist; models: "
                           f"{', '.join(store.model_names)}.", param="model",
                           code="model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list.", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(400, f"messages[{i}] needs a role among {sorted(ROLES)}.",
                               param=f"messages[{i}].role")
        out.append({"role": ROLES[m["role"]], "content": _content(m.get("content"), i)})
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = config.default_max_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RequestError(400, "'max_tokens' must be a positive integer.", param="max_tokens")
    if max_tokens > config.max_tokens:
        raise RequestError(400, f"'max_tokens' is at most {config.max_tokens} on this server.",
                           param="max_tokens")
    if body.get("n", 1) != 1:
        raise RequestError(400, "Only n = 1 is supported.", param="n")
    temperature = _number(body, "temperature", 0.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise RequestError(400, "'seed' must be an integer.", param="seed")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop):
        raise RequestError(400, "'stop' is a string or a list of at most 4 strings.", param="stop")
    return TurnRequest(model=model, messages=out, max_tokens=max_tokens,
                       temperature=temperature, top_p=top_p, seed=seed, stop=stop)


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


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise RequestError(400, f"'{key}' must be a number in [{lo}, {hi}].", param=key)
    return float(v)


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
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

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

    def _post(self):
        if self.path != "/v1/chat/completions":
            raise RequestError(404, f"No route {self.path}.", code="not_found")
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise RequestError(411, "A Content-Length header is required.")
        if int(length) > self.server.config.max_body:
            raise RequestError(413, f"The body is over {self.server.config.max_body} bytes.",
                               code="request_too_large")
        raw = self.rfile.read(int(length))
        self._body_read = True
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise RequestError(400, "The body is not valid JSON.") from None
        request = parse_chat_request(body, self.server.store, self.server.config)
        stream = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        store = self.server.store
        try:
            job = self.server.engine.submit(lambda cancelled: store.run(request, cancelled))
        except QueueFull as e:
            raise RequestError(503, str(e), type_="server_error", code="queue_full",
                               headers={"Retry-After": str(self.server.config.retry_after)})
        try:
            if stream:
                self._stream(job, request, include_usage)
            else:
                self._complete(job, request)
        finally:
            if not job.finished.is_set():
                job.cancel()  # this thread left early: stop the job

    def _next(self, job, deadline: float):
        """The job's next event, cancelling it when the client hangs up meanwhile."""
        while True:
            try:
                return job.next_event(timeout=0.1)
            except queue.Empty:
                if self._client_gone() or time.monotonic() > deadline:
                    job.cancel()
                    raise ConnectionResetError("client gone or request timed out")

    def _client_gone(self) -> bool:
        try:
            ready, _, _ = select.select([self.connection], [], [], 0)
            if ready:
                return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True
        return False

    def _failure(self, e: Exception) -> RequestError:
        if isinstance(e, UnknownModel):
            return RequestError(404, str(e), code="model_not_found")
        if isinstance(e, KvlingoError):
            return RequestError(400, str(e))
        return RequestError(500, f"{type(e).__name__}: {e}", type_="server_error")

    def _complete(self, job, request):
        deadline = time.monotonic() + self.server.config.request_timeout
        text, stats = "", None
        try:
            while True:
                try:
                    kind, value = self._next(job, deadline)
                except StopIteration:
                    break
                if kind == "delta":
                    text += value
                elif kind == "done":
                    stats = value
        except ConnectionResetError:
            return
        except Exception as e:  # the job failed
            raise self._failure(e) from None
        reply = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion",
            "created": int(time.time()), "model": stats.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": _finish(stats.finish_reason)}],
            "usage": stats.usage(), "kvlingo": stats.to_dict(),
        }
        self._send_json(200, reply, kvlingo_headers(stats))

    def _stream(self, job, request, include_usage: bool):
        deadline = time.monotonic() + self.server.config.request_timeout
        cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        started, model = False, request.model

        def chunk(model, delta, finish=None, **extra):
            return {"id": cid, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": [{"index": 0, "delta": delta,
                                                 "finish_reason": finish}], **extra}

        try:
            while True:
                try:
                    kind, value = self._next(job, deadline)
                except StopIteration:
                    break
                except ConnectionResetError:
                    return
                except Exception as e:
                    err = self._failure(e)
                    if not started:
                        raise err from None
                    self._event(err.body())  # a failure mid-way: an error event, then the end
                    self._end_stream()
                    return
                if kind == "start":
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Cache-Control", "no-cache")
                    self.send_header("Transfer-Encoding", "chunked")
                    for k, v in kvlingo_headers(value).items():
                        self.send_header(k, v)
                    self.end_headers()
                    started, model = True, value.model
                    self._event(chunk(model, {"role": "assistant", "content": ""}))
                elif kind == "delta":
                    self._event(chunk(model, {"content": value}))
                elif kind == "done":
                    self._event(chunk(value.model, {}, _finish(value.finish_reason),
                                      kvlingo=value.to_dict()))
                    if include_usage:
                        self._event({"id": cid, "object": "chat.completion.chunk",
                                     "created": created, "model": value.model, "choices": [],
                                     "usage": value.usage()})
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


def _finish(reason: Optional[str]) -> str:
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
    cache_dir: Optional[Path] = None
    # Share of translated positions recomputed (fact-like words), and the most
    # positions per catch-up; None: the translators' defaults.
    recompute: Optional[float] = None
    recompute_max: Optional[int] = None


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
    names = base.model_names
    small, _, large = (options.auto or f"{names[0]}:{names[1]}").partition(":")
    route = AutoRoute(small, large, options.auto_probe, options.auto_entropy)
    store = ConversationStore(base, options.max_conversations, options.max_cache_mb << 20, route)
    config = ServerConfig(key, options.max_body_kb << 10, options.max_tokens,
                          options.default_max_tokens)
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

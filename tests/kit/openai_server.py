"""A small OpenAI-compatible HTTP server for tests, used through the real ``openai`` client.

::

    with OpenAIServer() as server:
        server.reply("a summary")                                  # queue scripted answers
        server.reply(tool_calls=[("cmd_run", {"command": "ls"})])  # ... with tool calls
        server.fail(500, times=2)                                  # ... or HTTP errors
        server.fail(429, retry_after=2)                            # ... with a Retry-After header
        server.drop(after=1.5)                                     # ... or a connection closed mid-answer
        server.respond(lambda request: {"content": "computed"})    # ... or a function of the request
        client = server.client()                                   # AsyncOpenAI, max_retries=0
        ...
        server.requests[-1]["messages"]                            # what was sent

``POST /v1/chat/completions`` pops the next scripted answer (FIFO); when the queue is empty it
answers 500 and counts the request in ``unexpected``.  ``POST /v1/embeddings`` answers with
deterministic unit vectors (``dimensions`` from the request, else ``embedding_dim``).
Usage counts about four characters a token and reports as ``cached_tokens`` the messages a
request shares, from the start, with the previous one (a prompt cache).
``GET /v1/models`` lists ``model``.  Every request body is recorded in ``requests`` (chat) or
``embedding_requests``; ``most_in_flight`` is the most chat requests it was answering at once.
With a ``window`` (tokens), a chat request whose prompt (four characters a token) and
``max_tokens`` do not fit is answered 400 ``context_length_exceeded`` in llama-cpp-python's
server's words (counted in ``context_errors``), before any scripted answer is taken.
The server runs in a thread on 127.0.0.1 and a free port.
"""

from __future__ import annotations

import hashlib
import json
import socket
import ssl
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from openai import AsyncOpenAI

ToolCall = tuple[str, Mapping[str, Any]] | Mapping[str, Any]
Responder = Callable[[dict[str, Any]], Mapping[str, Any]]


@dataclass
class Scripted:
    """One scripted answer: a completion, an HTTP error, or a function of the request."""

    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    status: int = 200
    error: str = "scripted failure"
    delay: float = 0.0
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    responder: Responder | None = None
    retry_after: float | None = None
    code: str | None = None
    drop: bool = False
    """send part of the answer and close the connection"""


def tool_call(name: str, arguments: Mapping[str, Any] | str, call_id: str | None = None) -> dict[str, Any]:
    """A tool call in the OpenAI wire format (arguments JSON-encoded)."""
    args = arguments if isinstance(arguments, str) else json.dumps(dict(arguments))
    return {
        "id": call_id or f"call_{hashlib.sha1(f'{name}{args}{time.monotonic_ns()}'.encode()).hexdigest()[:12]}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


class OpenAIServer:
    def __init__(
        self,
        *,
        model: str = "test-model",
        embedding_dim: int = 8,
        window: int | None = None,
        reports: bool = False,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``tls``: served over HTTPS with that context (its certificate for 127.0.0.1)."""
        self.tls = tls
        self.model = model
        self.window = window
        self.reports = reports
        """``GET /props`` reports ``window`` as llama.cpp's server does (else 404, as llama-cpp-python's)"""
        self.context_errors = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self.embedding_dim = embedding_dim
        self.requests: list[dict[str, Any]] = []
        self.received: list[float] = []
        """When each chat request arrived (unix seconds), in the order of ``requests``."""
        self.embedding_requests: list[dict[str, Any]] = []
        self.unexpected = 0
        self._previous: list[Any] = []
        self._queue: deque[Scripted] = deque()
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- scripting ------------------------------------------------------------------------

    def reply(
        self,
        content: str | None = None,
        *,
        tool_calls: Iterable[ToolCall] = (),
        delay: float = 0.0,
        finish_reason: str | None = None,
        usage: dict[str, int] | None = None,
    ) -> list[dict[str, Any]]:
        """Queue a completion; returns its tool calls in wire form (with their ids)."""
        calls = [tool_call(c[0], c[1]) if isinstance(c, tuple) else dict(c) for c in tool_calls]
        self._push(Scripted(content=content, tool_calls=calls, delay=delay, finish_reason=finish_reason, usage=usage))
        return calls

    def fail(
        self,
        status: int = 500,
        message: str = "scripted failure",
        *,
        times: int = 1,
        retry_after: float | None = None,
        code: str | None = None,
    ) -> None:
        """Queue ``times`` HTTP errors (with a ``Retry-After`` header, an error ``code``)."""
        for _ in range(times):
            self._push(Scripted(status=status, error=message, retry_after=retry_after, code=code))

    def drop(self, *, after: float = 0.0, times: int = 1) -> None:
        """Queue ``times`` answers cut short: ``after`` seconds, the status line, headers announcing
        a whole body and the start of it, then the connection is closed."""
        for _ in range(times):
            self._push(Scripted(drop=True, delay=after))

    def respond(self, responder: Responder, *, times: int = 1) -> None:
        """Queue answers computed from the request body: the function returns ``reply`` keywords."""
        for _ in range(times):
            self._push(Scripted(responder=responder))

    def clear(self) -> None:
        """Drop every queued answer."""
        with self._lock:
            self._queue.clear()

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def _push(self, item: Scripted) -> None:
        with self._lock:
            self._queue.append(item)

    def _pop(self) -> Scripted | None:
        with self._lock:
            return self._queue.popleft() if self._queue else None

    # --- inspection -----------------------------------------------------------------------

    @property
    def last_request(self) -> dict[str, Any]:
        return self.requests[-1]

    def prompts(self) -> list[str]:
        """Every message content of every chat request, joined per request."""
        return ["\n".join(str(m.get("content") or "") for m in r.get("messages", [])) for r in self.requests]

    # --- lifecycle ------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        assert self._httpd is not None, "the server is not started"
        host, port = self._httpd.server_address[:2]
        return f"{'https' if self.tls else 'http'}://{host!s}:{port}/v1"

    def client(self, **kwargs: Any) -> AsyncOpenAI:
        """A real OpenAI client pointed at this server (no retries, short timeout)."""
        options: dict[str, Any] = {"api_key": "test-key", "max_retries": 0, "timeout": 10.0}
        options.update(kwargs)
        return AsyncOpenAI(base_url=self.base_url, **options)

    def start(self) -> OpenAIServer:
        handler = type("Handler", (_Handler,), {"server_state": self})
        self._httpd = _QuietServer(("127.0.0.1", 0), handler)
        if self.tls is not None:
            self._httpd.socket = self.tls.wrap_socket(self._httpd.socket, server_side=True)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, name="openai-test-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- answers --------------------------------------------------------------------------

    def _chat(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]] | Scripted:
        with self._lock:
            self.requests.append(body)
            self.received.append(time.time())
        too_long = self._over_window(body)
        if too_long is not None:
            return too_long
        item = self._pop()
        if item is None:
            self.unexpected += 1
            return 500, _error("no scripted response is queued for this request", "server_error")
        if item.responder is not None:
            item = Scripted(**_scripted_kwargs(item.responder(body)))
        if item.delay:
            time.sleep(item.delay)
        if item.drop or item.retry_after is not None:
            return item
        if item.status != 200:
            kind = "server_error" if item.status >= 500 else "invalid_request_error"
            return item.status, _error(item.error, kind, item.code)
        message: dict[str, Any] = {"role": "assistant", "content": item.content}
        if item.tool_calls:
            message["tool_calls"] = item.tool_calls
        finish = item.finish_reason or ("tool_calls" if item.tool_calls else "stop")
        messages = body.get("messages", [])
        sizes = [len(json.dumps(m)) // 4 for m in messages]
        prompt_tokens = sum(sizes)
        completion_tokens = len(item.content or "") // 4
        usage = item.usage or {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            # A prompt cache: the messages this request shares, from the start, with the previous one.
            "prompt_tokens_details": {"cached_tokens": sum(sizes[: shared_prefix(self._previous, messages)])},
        }
        self._previous = messages
        return 200, {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", self.model),
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": usage,
        }

    def _over_window(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        """The context-length error for a request that does not fit ``window`` (None: it fits)."""
        if self.window is None:
            return None
        prompt = sum(len(json.dumps(m)) for m in body.get("messages", [])) // 4
        prompt += len(json.dumps(body.get("tools", []))) // 4
        answer = int(body.get("max_tokens") or 0)
        if prompt + answer <= self.window:
            return None
        with self._lock:
            self.context_errors += 1
        message = (
            f"This model's maximum context length is {self.window} tokens. However, you requested "
            f"{prompt + answer} tokens ({prompt} in the messages, {answer} in the completion). "
            "Please reduce the length of the messages or completion."
        )
        return 400, _error(message, "invalid_request_error", "context_length_exceeded")

    def _embeddings(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self.embedding_requests.append(body)
        inputs = body.get("input", [])
        texts = [inputs] if isinstance(inputs, str) else list(inputs)
        dim = int(body.get("dimensions") or self.embedding_dim)
        data = [{"object": "embedding", "index": i, "embedding": _vector(str(t), dim)} for i, t in enumerate(texts)]
        tokens = sum(len(str(t)) // 4 for t in texts)
        return 200, {
            "object": "list",
            "data": data,
            "model": body.get("model", self.model),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


@pytest.fixture
def server() -> Iterator[OpenAIServer]:
    """A scripted server for model ``test-model``, with nothing queued yet."""
    with OpenAIServer(model="test-model") as server:
        yield server


def shared_prefix(before: Sequence[Any], now: Sequence[Any]) -> int:
    """How many items, from the first, two sequences have in common (two requests' messages,
    two prompts' characters)."""
    count = 0
    for a, b in zip(before, now, strict=False):
        if a != b:
            break
        count += 1
    return count


def _scripted_kwargs(raw: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(raw)
    calls = out.get("tool_calls") or ()
    out["tool_calls"] = [tool_call(c[0], c[1]) if isinstance(c, tuple) else dict(c) for c in calls]
    return out


def _error(message: str, kind: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _vector(text: str, dim: int) -> list[float]:
    digest = b""
    counter = 0
    while len(digest) < dim:
        digest += hashlib.sha256(f"{counter}:{text}".encode()).digest()
        counter += 1
    raw = [b / 255.0 - 0.5 for b in digest[:dim]]
    norm = sum(x * x for x in raw) ** 0.5 or 1.0
    return [x / norm for x in raw]


class _QuietServer(ThreadingHTTPServer):
    """A client that hangs up mid-response (a timeout test, a cancelled call) is expected:
    no "Exception occurred during processing of request" traceback on stderr for it."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    server_state: OpenAIServer

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests read ``requests`` instead."""

    def do_GET(self) -> None:
        state = self.server_state
        if self.path.rstrip("/") == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": state.model, "object": "model"}]})
        elif self.path.rstrip("/") == "/props" and state.reports and state.window is not None:
            self._send(200, {"default_generation_settings": {"n_ctx": state.window}, "total_slots": 1})
        else:
            self._send(404, _error(f"no route {self.path}", "invalid_request_error"))

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if len(raw) < length:  # the client died while sending (a SIGKILLed worker): no request was made
            self.close_connection = True
            return
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError:
            self._send(400, _error("the body is not JSON", "invalid_request_error"))
            return
        path = self.path.rstrip("/")
        if path == "/v1/chat/completions" and body.get("stream"):
            self._send(400, _error("this test server does not stream", "invalid_request_error"))
        elif path == "/v1/chat/completions":
            state = self.server_state
            with state._lock:
                state.in_flight += 1
                state.most_in_flight = max(state.most_in_flight, state.in_flight)
            self._answering = True
            try:
                answer = state._chat(body)
                if isinstance(answer, Scripted):
                    self._scripted(answer)
                else:
                    self._send(*answer)
            finally:
                self._answered()
        elif path == "/v1/embeddings":
            self._send(*self.server_state._embeddings(body))
        else:
            self._send(404, _error(f"no route {self.path}", "invalid_request_error"))

    def _answered(self) -> None:
        """The chat request being answered is answered: it counts in flight no more.  Called as
        its answer's body goes out, not after it: the client may have read the answer and sent
        its next request before this thread runs again."""
        if getattr(self, "_answering", False):
            self._answering = False
            state = self.server_state
            with state._lock:
                state.in_flight -= 1

    def _send(self, status: int, payload: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self._answered()
        self.wfile.write(data)

    def _scripted(self, item: Scripted) -> None:
        """An error with a ``Retry-After``, or an answer cut short by a closed connection."""
        if not item.drop:
            kind = "rate_limit_error" if item.status == 429 else "server_error"
            self._send(item.status, _error(item.error, kind, item.code), {"Retry-After": f"{item.retry_after:g}"})
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "4096")
        self.end_headers()
        self.wfile.write(b'{"id": "chatcmpl-cut", "object": "chat.completion", "choices": [')
        self.wfile.flush()
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)

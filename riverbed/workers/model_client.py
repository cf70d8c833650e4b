"""The agent role's model client: a request is made only while its run is still this worker's.

A worker paused past its lease (a GC stall, a frozen VM, SIGSTOP) and then resumed must not
ask the model again for a step a peer has taken over and may have recorded already.  So the
role checks its lease for every model call, and the check has to come right before the
request is complete: a check made earlier (before the client prepares the request, before it
connects, or before its first bytes leave) leaves a window in which a pause lets a stale
request out, or finishes one whose headers had left, once the worker resumes.

The check therefore sits in the request's sending itself.  The role sets the check for the
task that makes the call (:func:`checked_by`).  Every byte of the request but its last one is
sent, and the last is held back; a server cannot answer a request it has not received whole.
The held byte goes out once the check passed, with no await in between.  A check that raises
closes the connection instead, so the server sees a request cut short and answers nothing.
When the role knows the check passes without asking (its lease renewals are fresh), it says so
as the request's last part is about to be written, and that part goes whole in that write.

:meth:`CheckedClient.chat_completion`, the agent role's call, sends its body on aiohttp, the
last byte held by the body itself (:class:`_Body`).  The client library's own calls
(``client.library.chat.completions.create`` and the rest) go through httpx2, with the stream put
under the client by giving the HTTP transport's connection pool a network backend of ours
(:class:`CheckedTransport`): the one place this module reaches into httpx2, a pool's
``_network_backend`` (httpx2 and httpcore2 2.16, as in httpx 0.28 and httpcore 1.0); the stream
awaits the check when the client turns to read the answer.

The OpenAI client library itself (a second of CPU to load on these VMs, and 30 MiB) is loaded
only for those calls, or to make one of its errors from a failed answer: an agent worker that
only asks through :meth:`CheckedClient.chat_completion` and gets answers never loads it.
"""

from __future__ import annotations

import contextlib
import ssl
import urllib.request
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import aiohttp
import aiohttp.abc
import httpcore2
import httpx2
import msgspec

from riverbed.agent.prompt import EncodedMessages
from riverbed.agent.retry import ModelError
from riverbed.bus.faults import armed, crashpoint

if TYPE_CHECKING:
    from openai import AsyncOpenAI

__all__ = [
    "CheckedClient",
    "CheckedTransport",
    "checked_by",
    "connections_for",
    "proxy_for",
    "request_body",
    "request_parts",
]

_encode = msgspec.json.Encoder().encode
Check = Callable[[], Awaitable[None]]
Known = Callable[[], bool]
_check: ContextVar[Check | None] = ContextVar("riverbed_model_check", default=None)
_known: ContextVar[Known | None] = ContextVar("riverbed_model_check_known", default=None)

OPENAI_URL = "https://api.openai.com/v1"
"""The model server when none is configured."""

CONNECTIONS = 1000
"""The connections a client keeps to model servers at least: what the client library allows by
default (more for a worker that may make more calls at once: :func:`connections_for`)."""


def connections_for(calls: int) -> int:
    """The connections :meth:`CheckedClient.chat_completion` keeps open for a client that makes up
    to ``calls`` model calls at once (an agent worker: one per run it holds, ``RIVERBED_CONCURRENCY``).

    A run's next call follows its last one within seconds, so a connection closed after a call
    is opened again for the next: with the library's default of 100 kept open, 250 runs of a
    model answering in 2 s made the model server accept a connection for every other call, and
    past 1,000 calls in flight the rest waited for a connection, unseen by the model's latency
    (``python -m bench agents --latency 2.0``).  Every connection is kept open between calls."""
    return max(CONNECTIONS, calls)


MAX_RESPONSE_BYTES = 8 * 1024 * 1024
"""The largest model answer read by default (``RIVERBED_LLM_MAX_RESPONSE_BYTES``)."""


@contextlib.contextmanager
def checked_by(check: Check, known: Known | None = None) -> Iterator[None]:
    """Make ``check`` the last step before each request of this task is complete.  ``known``,
    when given, says without suspending that the check would pass: a request whose body finds
    it true as it is written goes out whole in one write (:meth:`CheckedClient.chat_completion`)."""
    token, known_token = _check.set(check), _known.set(known)
    try:
        yield
    finally:
        _check.reset(token)
        _known.reset(known_token)


class _CheckedStream(httpcore2.AsyncNetworkStream):
    """A connection that completes a checked request only once its check passed.

    While a check is set for the writing task, each write leaves all but its last byte, which
    goes out with the next write.  The first read (the client waits for the answer, so the
    request is all written) awaits the check, then writes the held byte: the connection's
    buffer is below its limit after the write before, so nothing makes the write wait.  (One
    case is left: when the kernel's send buffer was full, a server slow to read, bytes still
    queued in the process hold the byte behind them, and a pause after the check delays it.)"""

    def __init__(self, inner: httpcore2.AsyncNetworkStream) -> None:
        self._inner = inner
        self._check: Check | None = None
        self._held = b""

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        check = self._check or _check.get()
        if check is None:
            await self._inner.write(buffer, timeout)
            return
        self._check = check
        data = self._held + buffer
        self._held = data[-1:]
        await self._inner.write(data[:-1], timeout)
        crashpoint("model_sending")

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        check, held = self._check, self._held
        if check is not None:
            self._check, self._held = None, b""
            try:
                await check()
            except BaseException:
                await self._inner.aclose()  # (the request stays incomplete: nothing is asked)
                raise
            await self._inner.write(held, timeout)
        return await self._inner.read(max_bytes, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore2.AsyncNetworkStream:
        return _CheckedStream(await self._inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _CheckedBackend(httpcore2.AsyncNetworkBackend):
    """The pool's own backend, with every connection it makes a :class:`_CheckedStream`."""

    def __init__(self, inner: httpcore2.AsyncNetworkBackend) -> None:
        self._inner = inner

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore2.AsyncNetworkStream:
        stream = await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        crashpoint("model_connected")
        return _CheckedStream(stream)

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore2.AsyncNetworkStream:
        return _CheckedStream(await self._inner.connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class CheckedTransport(httpx2.AsyncHTTPTransport):
    """httpx2's transport, its connections (through a proxy too) checked."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        pool = getattr(self, "_pool", None)
        backend = getattr(pool, "_network_backend", None)
        if not isinstance(backend, httpcore2.AsyncNetworkBackend):
            raise TypeError(
                f"httpx2 {httpx2.__version__} keeps its connection pool's network backend elsewhere than "
                "riverbed's model client expects (written for httpx2 2.16); pin httpx2 to 2.16"
            )
        pool._network_backend = _CheckedBackend(backend)  # type: ignore[union-attr]


def proxy_for(base_url: str) -> str | None:
    """The proxy the environment names for ``base_url`` (``HTTPS_PROXY``, ``HTTP_PROXY``,
    ``ALL_PROXY``, ``NO_PROXY``: what an HTTP client would use by default), None for none."""
    url = httpx2.URL(base_url)
    if urllib.request.proxy_bypass(url.host):
        return None
    proxies = urllib.request.getproxies()
    return proxies.get(url.scheme) or proxies.get("all")


Part = bytes | memoryview
"""A part of a request's body: a view into a prompt's buffer for its kept messages' JSON."""
WRITE_APART = 128 * 1024
"""Kept messages' JSON of this many bytes or more is written from the prompt's buffer as it is;
a shorter one is copied into the body, which then goes in one write.  Against the scripted model
server of ``bench.agents`` (CPU a call, 300 calls a round, rounds alternating), joining cost 6 to
8 µs less a call than writing the parts from 7 to 128 KB, and 13 to 30 µs more from 160 to 318 KB."""


def request_parts(body: Mapping[str, Any], *, write_apart: int = WRITE_APART) -> list[Part]:
    """``body``'s JSON, as :meth:`CheckedClient.chat_completion` sends it, in parts: its
    ``messages`` first.  When they are a prompt's :class:`~riverbed.agent.prompt.EncodedMessages`
    the kept messages' JSON of ``write_apart`` bytes or more is a view into the prompt's
    buffer, between what comes before and after it, written as they are (joining them copied the
    whole prompt at every step; msgspec would copy a ``Raw`` of them again).  A prompt that changes
    while a view is still held (a transport still sending it) starts a buffer of its own."""
    messages = body.get("messages")
    if not isinstance(messages, EncodedMessages):
        return [_encode(body)]
    rest = _encode({key: value for key, value in body.items() if key != "messages"})
    after = b"," + rest[1:] if len(rest) > 2 else b"}"
    parts = messages.parts()
    if len(parts) == 1 or len(parts[1]) < write_apart:
        return [b"".join([b'{"messages":', *parts, after])]
    first, kept, *last = parts
    return [b'{"messages":' + first, kept, b"".join([*last, after])]


def request_body(body: Mapping[str, Any]) -> bytes:
    """:func:`request_parts` joined."""
    return b"".join(request_parts(body))


class CheckedClient:
    """A model client whose requests pass the check set by :func:`checked_by` (no retries:
    they are the role's own).  Any other client makes its requests unchecked.

    :meth:`chat_completion` is the agent role's way to ask: the request body goes out as the
    role built it and the answer comes back as plain JSON.  The client library's own pass over
    a request and its response objects were about a sixth of the role's CPU per step
    (``python -m bench agents``); its errors are kept, made from the response as it makes them.
    :attr:`library` is the client library's client for any other call, checked the same way."""

    def __init__(
        self, *, api_key: str, base_url: str | None, max_response_bytes: int = MAX_RESPONSE_BYTES, calls: int = 0
    ) -> None:
        """``calls``: the model calls it may have in flight at once (:func:`connections_for`)."""
        self.max_response_bytes = max_response_bytes
        self.api_key = api_key
        self.base_url = base_url or OPENAI_URL  # (``OPENAI_BASE_URL`` is read by the settings)
        # (read once, not on every request: aiohttp's ``trust_env`` reading of it cost three
        # times the rest of a call)
        self._proxy = proxy_for(self.base_url)
        self._completions = self.base_url.rstrip("/") + "/chat/completions"
        self._headers = {
            "Authorization": f"Bearer {api_key}",
            "Content-Type": "application/json",
            "Accept": "application/json",
        }
        self._calls = calls
        self._aio: aiohttp.ClientSession | None = None
        self._library: AsyncOpenAI | None = None

    @property
    def library(self) -> AsyncOpenAI:
        """The client library's client for the same server (its requests checked too, no retries),
        made at its first use."""
        if self._library is None:
            from openai import AsyncOpenAI  # noqa: PLC0415  (see the module docstring)

            http = httpx2.AsyncClient(transport=CheckedTransport(proxy=self._proxy), follow_redirects=True)
            self._library = AsyncOpenAI(api_key=self.api_key, base_url=self.base_url, max_retries=0, http_client=http)
        return self._library

    def _pool(self) -> aiohttp.ClientSession:
        """The connections :meth:`chat_completion` asks on (made in the running event loop)."""
        if self._aio is None or self._aio.closed:
            traces = []
            if armed("model_connected"):  # (a trace costs a call 11 µs of CPU: only for the fault suite)
                trace = aiohttp.TraceConfig()
                trace.on_connection_create_end.append(_connected)
                traces.append(trace)
            # (the certificates the library's own client trusts: certifi's, or SSL_CERT_FILE / SSL_CERT_DIR;
            # loaded only for a server on TLS: a tenth of a second of CPU)
            tls = httpx2.create_ssl_context() if self._completions.startswith("https:") else True
            connector = aiohttp.TCPConnector(limit=connections_for(self._calls), limit_per_host=0, ssl=tls)
            # (no time limit of its own: aiohttp's default of 5 minutes would end a longer call
            # that the caller's RIVERBED_LLM_TIMEOUT allows)
            self._aio = aiohttp.ClientSession(
                connector=connector, trace_configs=traces, timeout=aiohttp.ClientTimeout(total=None)
            )
        return self._aio

    async def close(self) -> None:
        if self._library is not None:
            await self._library.close()
        if self._aio is not None:
            await self._aio.close()

    async def chat_completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """The server's answer to the chat completion ``body`` (its JSON, decoded).

        No time limit of its own (the caller sets one).  A status of 400 or more raises the
        client library's error for it (``openai.RateLimitError``, ``InternalServerError``...), a
        connection that fails ``openai.APIConnectionError``, an answer that is not a JSON object
        ``openai.APIResponseValidationError``.

        It goes out on aiohttp rather than the client library's httpx2: its C parser and lean
        request path cost about a quarter of the CPU a call (0.15 against 0.52 to 0.54 ms with
        the check set, 25 calls at once against the scripted model server of ``bench.agents``).  With a check set
        (:func:`checked_by`), the body's last byte waits for it, as on the library's path, unless
        the check is known to pass as the body is written (:class:`_Body`).  A body's
        ``messages`` may be a prompt's :class:`~riverbed.agent.prompt.EncodedMessages`, whose
        kept JSON is written from the prompt's buffer as it is (:func:`request_parts`)."""
        parts = request_parts(body)
        failed: list[BaseException] = []
        data = _Body(parts, _check.get(), _known.get(), failed)
        headers = {**self._headers, "Content-Length": str(data.size)}
        try:
            async with self._pool().post(self._completions, data=data, headers=headers, proxy=self._proxy) as response:
                content = await self._read_bounded(response)
                status, answered = response.status, response.headers
        except aiohttp.ClientError as exc:
            if failed:
                raise failed[0] from None  # the check's own error (the request was cut short)
            import openai  # noqa: PLC0415  (see the module docstring)

            raise openai.APIConnectionError(request=self._request()) from exc
        if failed:
            raise failed[0]
        if status >= 400:
            raise self.library._make_status_error_from_response(self._as_read(status, answered, content))
        try:
            answer = msgspec.json.decode(content)
        except msgspec.DecodeError:
            answer = None
        if not isinstance(answer, dict):
            import openai  # noqa: PLC0415  (see the module docstring)

            raise openai.APIResponseValidationError(
                self._as_read(status, answered, content), None, message="the model server's answer is not a JSON object"
            )
        return answer

    def _request(self) -> httpx2.Request:
        """The request, as the client library's errors carry it."""
        return httpx2.Request("POST", self._completions, headers=self._headers)

    def _as_read(self, status: int, headers: Mapping[str, str], content: bytes) -> httpx2.Response:
        """The answer, as the client library's errors carry it."""
        return httpx2.Response(status, headers=list(headers.items()), content=content, request=self._request())

    async def _read_bounded(self, response: aiohttp.ClientResponse) -> bytes:
        """The body, refused (:class:`ResponseTooLarge`) as soon as it is known to be over the
        cap: by its ``Content-Length``, else while it is read, before anything is parsed."""
        cap = self.max_response_bytes
        declared = response.headers.get("content-length", "")
        if cap and declared.isdigit() and int(declared) > cap:
            raise ResponseTooLarge(int(declared), cap)
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.content.iter_any():
            size += len(chunk)
            if cap and size > cap:
                raise ResponseTooLarge(None, cap)
            chunks.append(chunk)
        return b"".join(chunks)


class _Body(aiohttp.Payload):
    """A request body written as its parts (:func:`request_parts`), whose last byte, under a
    check, is written only once ``check`` passed (what failed is kept in ``failed``: the HTTP
    client reports a body that failed as a connection error of its own).  The client writes the
    request's head on its own first, and nothing suspends between the check's end and the last
    byte's write.

    Every part but the last is written first.  Without a check, or when ``known`` then says the
    check passes, the last part goes whole right after that answer (the last byte's write of its
    own cost a call 14 µs of its 112 µs of CPU: 25 calls at once, 2 KB bodies, medians of 8 runs)."""

    _value: list[Part]

    def __init__(
        self, parts: list[Part], check: Check | None, known: Known | None, failed: list[BaseException]
    ) -> None:
        super().__init__(parts, content_type="application/json")
        self._size = sum(map(len, parts))
        self._check, self._known, self._failed = check, known, failed

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._value).decode(encoding, errors)

    async def write(self, writer: aiohttp.abc.AbstractStreamWriter) -> None:
        parts, check = self._value, self._check
        if check is not None:
            crashpoint("model_sending")  # (about to write: nothing of the request has left yet)
        # The head as a buffer of its own: the client would join it with the body's first part
        # (a copy, on Pythons before 3.12.9); the event loop still sends both in one turn.
        # (aiohttp 3.12 and later hold the head back until this is called.)
        writer.send_headers()
        *first, last = parts
        for part in first:  # (no request yet: its last part completes it)
            await writer.write(part)
        if check is None or (self._known is not None and self._known()):
            await writer.write(last)
            return
        if len(last) > 1:
            await writer.write(memoryview(last)[:-1])  # (not copied: the client writes any buffer)
        crashpoint("model_sending")
        try:
            await check()
        except BaseException as exc:
            self._failed.append(exc)
            raise
        await writer.write(last[-1:])


async def _connected(_session: aiohttp.ClientSession, _context: Any, _params: Any) -> None:
    crashpoint("model_connected")


class ResponseTooLarge(ModelError):
    """The model server's answer was over the cap (``RIVERBED_LLM_MAX_RESPONSE_BYTES``): refused
    before it was parsed, and not asked again (the same request would bring the same answer)."""

    def __init__(self, size: int | None, cap: int) -> None:
        said = f"{size:,} bytes" if size is not None else "more bytes"
        super().__init__(
            f"the model's answer was {said}, over RIVERBED_LLM_MAX_RESPONSE_BYTES ({cap:,}): refused before it was "
            "read (lower the run's --max-output-tokens)"
        )

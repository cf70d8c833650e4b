"""The agent role's model client (``riverbed/workers/model_client.py``): the lease check set for a
call runs once the whole request but its last byte has left, and that byte follows it, so a
worker paused while connecting or sending completes no request once it resumes for a run a peer
took over.  (The same check under a real pause: ``test_fault_agent.py``, ``model_connected`` and
``model_sending``.)"""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar
from urllib.parse import urlsplit

import openai
import pytest
import trustme

from riverbed.agent.prompt import EncodedMessages, Prompt
from riverbed.errors import FencedError
from riverbed.events import Event, Message, with_id
from riverbed.memory.view import ViewBuilder
from riverbed.workers.model_client import (
    CONNECTIONS,
    CheckedClient,
    checked_by,
    connections_for,
    proxy_for,
    request_parts,
)
from tests.kit.openai_server import OpenAIServer, server  # noqa: F401  (fixture)

pytestmark = pytest.mark.anyio

ASK = {"model": "test-model", "messages": [{"role": "user", "content": "hello"}]}
LONG_ASK = {"model": "test-model", "messages": [{"role": "user", "content": "a long prompt " * 20_000}]}
"""A body of 280 KB: written, but for its last byte, before the check (``_held_back``)."""


def prompt_ask() -> dict[str, object]:
    """A body whose messages are a prompt's kept JSON (``EncodedMessages``), long enough to be
    written from the prompt's buffer as it is, in parts (``request_parts``)."""
    prompt = Prompt(system="sys")
    log: list[Event] = [with_id(Message(content=f"turn {i} " + "x" * 20_000, source="user"), i) for i in range(1, 11)]
    builder = ViewBuilder(log)
    prompt.update(log, builder.view())
    body: dict[str, object] = {"model": "test-model", "messages": prompt.encoded_parts(), "temperature": 0.5}
    assert len(request_parts(body)) == 3  # (the kept JSON a part of its own)
    return body


def sent(body: dict[str, object]) -> object:
    """``body`` as the server should read it: its messages a prompt's array, as that array makes it."""
    messages = body["messages"]
    return {**body, "messages": json.loads(messages.join())} if isinstance(messages, EncodedMessages) else body


def connected_to(port: int) -> int:
    """How many TCP connections to ``port`` on this host are established (``/proc/net/tcp``)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote, state = fields[2], fields[3]
        count += int(remote.rsplit(":", 1)[1], 16) == port and state == "01"
    return count


async def test_a_check_that_fails_sends_nothing(server: OpenAIServer) -> None:
    server.reply("never asked for")
    client = CheckedClient(api_key="k", base_url=server.base_url)

    async def taken_over() -> None:
        raise FencedError("s", "agent", 1)

    with checked_by(taken_over), pytest.raises(FencedError):
        await client.library.chat.completions.create(**ASK)  # type: ignore[call-overload]
    assert server.requests == []
    assert server.pending() == 1
    await client.close()


async def test_the_check_runs_once_a_request_with_the_connection_made(server: OpenAIServer) -> None:
    server.reply("one")
    server.reply("two")
    port = urlsplit(server.base_url).port
    assert port is not None
    client = CheckedClient(api_key="k", base_url=server.base_url)
    seen: list[int] = []

    async def holds() -> None:
        seen.append(connected_to(port))

    for _ in range(2):  # (the test server closes each connection after its answer)
        with checked_by(holds):
            reply = await client.library.chat.completions.create(**ASK)  # type: ignore[call-overload]
        assert reply.choices[0].message.content in ("one", "two")
    assert seen == [1, 1]
    assert len(server.requests) == 2
    await client.close()


class _RawServer:
    """A model server on a bare socket that counts the bytes of each request as they come, and
    answers a request once it is whole (its headers and ``Content-Length`` bytes of body)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.received = 0
        self.whole = 0
        """The length of the request being received, known from its headers (0 before)."""
        self.answered = 0
        self.bodies: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            data = b""
            while True:
                chunk = conn.recv(65536)
                if not chunk:
                    break  # (cut short: no request)
                data += chunk
                self.received = len(data)
                head, _, body = data.partition(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    None,
                )
                if length is not None:
                    self.whole = len(head) + 4 + length
                if length is not None and len(body) >= length:
                    self.bodies.append(body)
                    self.answered += 1
                    conn.sendall(_answer("whole"))
                    break
            conn.close()

    def close(self) -> None:
        self.listener.close()


def _answer(content: str) -> bytes:
    payload = json.dumps({
        "id": "c1", "object": "chat.completion", "created": 0, "model": "test-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
    }).encode()  # fmt: skip
    head = [
        "HTTP/1.1 200 OK",
        "Content-Type: application/json",
        f"Content-Length: {len(payload)}",
        "Connection: close",
    ]
    return "\r\n".join([*head, "", ""]).encode() + payload


def _settled(server: _RawServer) -> int:
    """The bytes the server has received, once no more came for a while."""
    seen = -1
    while seen != server.received:
        seen = server.received
        time.sleep(0.2)
    return seen


async def ask(client: CheckedClient, direct: bool, body: dict[str, object] = ASK) -> str | None:
    """The content of the answer to ``body``: through ``chat_completion`` (the agent role's
    way), or through the client library's ``create``."""
    if direct:
        answer = await client.chat_completion(body)
        content: str | None = answer["choices"][0]["message"]["content"]
        return content
    reply = await client.library.chat.completions.create(**body)  # type: ignore[call-overload]
    return reply.choices[0].message.content  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("direct", "body"),
    [(True, ASK), (False, ASK), (True, LONG_ASK), (True, "prompt")],
    ids=["chat_completion", "create", "chat_completion-long", "chat_completion-prompt"],
)
@pytest.mark.parametrize("passes", [True, False])
async def test_the_check_runs_with_all_of_the_request_but_its_last_byte_sent(
    passes: bool, direct: bool, body: dict[str, object] | str
) -> None:
    """A pause before the check (or during it) leaves the server with an incomplete request: it
    answers only once the byte that follows a passing check came, and nothing for a failing one.
    The body that arrives is the request's, byte for byte, short or long, or written in parts
    from a prompt's buffer."""
    body = prompt_ask() if body == "prompt" else body
    assert isinstance(body, dict)
    server = _RawServer()
    client = CheckedClient(api_key="k", base_url=server.base_url)
    at_check: list[tuple[int, int]] = []

    async def check() -> None:
        at_check.append((_settled(server), server.answered))
        if not passes:
            raise FencedError("s", "agent", 1)

    try:
        with checked_by(check):
            if passes:
                assert await ask(client, direct, body) == "whole"
            else:
                with pytest.raises(FencedError):
                    await ask(client, direct, body)
        assert server.whole > 0
        assert at_check == [(server.whole - 1, 0)]
        assert _settled(server) == (server.whole if passes else server.whole - 1)
        assert server.answered == (1 if passes else 0)
        assert [json.loads(b) for b in server.bodies] == ([sent(body)] if passes else [])
    finally:
        await client.close()
        server.close()


@pytest.mark.parametrize("body", [LONG_ASK, "prompt"], ids=["long", "prompt"])
@pytest.mark.parametrize("known", [True, False])
async def test_a_check_known_to_pass_as_the_body_is_written_sends_the_request_whole(
    known: bool, body: dict[str, object] | str
) -> None:
    """The agent role's lease check is known to pass without Redis while its renewals are fresh
    (``SessionContext.holds_now``): asked as the body is written (the connection made), a yes
    sends the request whole in that write and the awaited check is not made; a no holds the
    last byte for it, as before.  So for a body written in parts from a prompt's buffer."""
    body = prompt_ask() if body == "prompt" else body
    assert isinstance(body, dict)
    server = _RawServer()
    client = CheckedClient(api_key="k", base_url=server.base_url)
    port = int(server.base_url.split(":")[2].split("/")[0])
    asked: list[int] = []
    at_check: list[int] = []

    def now() -> bool:
        asked.append(connected_to(port))
        return known

    async def check() -> None:
        at_check.append(_settled(server))

    try:
        with checked_by(check, now):
            assert await ask(client, True, body) == "whole"
        assert asked == [1]
        assert at_check == ([] if known else [server.whole - 1])
        assert [json.loads(b) for b in server.bodies] == [sent(body)]
    finally:
        await client.close()
        server.close()


async def test_a_chat_completion_is_the_servers_json_and_its_errors_are_the_client_librarys(
    server: OpenAIServer,
) -> None:
    client = CheckedClient(api_key="secret-key", base_url=server.base_url)
    try:
        server.reply("hi there", usage={"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7})
        answer = await client.chat_completion({**ASK, "tools": [], "temperature": 0.5})
        assert answer["choices"][0]["message"]["content"] == "hi there"
        assert answer["usage"]["prompt_tokens"] == 5
        assert server.last_request == {**ASK, "tools": [], "temperature": 0.5}  # the body as it was built

        server.fail(500, "the GPU caught fire")
        with pytest.raises(openai.InternalServerError) as failed:
            await client.chat_completion(ASK)
        assert failed.value.status_code == 500
        assert "the GPU caught fire" in failed.value.message

        server.fail(429, "slow down")
        with pytest.raises(openai.RateLimitError):
            await client.chat_completion(ASK)
        server.fail(401, "who are you")
        with pytest.raises(openai.AuthenticationError):
            await client.chat_completion(ASK)
    finally:
        await client.close()

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # (nothing listens on it once closed)
    nobody = CheckedClient(api_key="k", base_url=f"http://127.0.0.1:{port}/v1")
    try:
        with pytest.raises(openai.APIConnectionError):
            await nobody.chat_completion(ASK)
    finally:
        await nobody.close()


class _Forwarder(BaseHTTPRequestHandler):
    """A plain HTTP proxy for POSTs (the absolute URL in the request line), noting each one."""

    seen: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        self.seen.append(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection", "proxy-connection")}
        forwarded = urllib.request.Request(self.path, data=body, headers=headers, method="POST")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # (straight to the server)
        with opener.open(forwarded, timeout=10) as reply:
            payload = reply.read()
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.headers.get("Content-Type", "application/json"))
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    def log_message(self, format: str, *args: object) -> None:
        pass


async def test_requests_go_through_the_proxy_the_environment_names(
    server: OpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), _Forwarder)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        for name in ("NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.server_address[1]}")
        server.reply("through the proxy")
        client = CheckedClient(api_key="k", base_url=server.base_url)
        checks: list[bool] = []

        async def holds() -> None:
            checks.append(True)

        with checked_by(holds):
            reply = await client.library.chat.completions.create(**ASK)  # type: ignore[call-overload]
        assert reply.choices[0].message.content == "through the proxy"
        assert _Forwarder.seen == [f"{server.base_url}/chat/completions"]
        assert checks == [True]
        # the agent role's own call (on aiohttp) goes the same way
        server.reply("the role's call, through the proxy")
        with checked_by(holds):
            answer = await client.chat_completion(ASK)
        assert answer["choices"][0]["message"]["content"] == "the role's call, through the proxy"
        assert _Forwarder.seen == [f"{server.base_url}/chat/completions"] * 2
        assert checks == [True, True]
        await client.close()
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        assert proxy_for(server.base_url) is None
    finally:
        proxy.shutdown()
        proxy.server_close()


async def test_a_worker_that_holds_many_runs_keeps_a_connection_open_for_each(server: OpenAIServer) -> None:
    """A run's next call follows its last within seconds: a worker that may hold 2,500 runs keeps
    2,500 connections to the model server open and lets 2,500 calls be in flight, not the client
    library's 1,000; a small worker keeps the library's limit."""
    assert connections_for(0) == connections_for(50) == CONNECTIONS
    assert connections_for(2500) == 2500
    server.reply("hi")
    client = CheckedClient(api_key="k", base_url=server.base_url, calls=2500)
    try:
        assert (await client.chat_completion(ASK))["choices"][0]["message"]["content"] == "hi"
        pool = client._pool()  # (the connections the agent role's calls go out on)
        assert pool.connector is not None
        assert pool.connector.limit == 2500
        assert pool.connector.limit_per_host == 0  # (all of them to the one model server)
    finally:
        await client.close()


async def test_a_model_server_over_tls_is_trusted_as_the_client_librarys_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent role's calls trust the certificates the client library's do: certifi's, or the
    ones ``SSL_CERT_FILE`` names (a private CA in front of a local model server); a server whose
    certificate nothing vouches for is a connection error, not an answer."""
    authority = trustme.CA()
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("127.0.0.1").configure_cert(served)
    bundle = tmp_path / "ca.pem"
    authority.cert_pem.write_to_path(str(bundle))
    with OpenAIServer(tls=served) as server:
        assert server.base_url.startswith("https://")
        monkeypatch.delenv("SSL_CERT_DIR", raising=False)
        monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
        server.reply("over TLS")
        trusting = CheckedClient(api_key="k", base_url=server.base_url)
        try:
            answer = await trusting.chat_completion(ASK)
            assert answer["choices"][0]["message"]["content"] == "over TLS"
        finally:
            await trusting.close()
        monkeypatch.delenv("SSL_CERT_FILE")
        doubting = CheckedClient(api_key="k", base_url=server.base_url)
        try:
            with pytest.raises(openai.APIConnectionError):
                await doubting.chat_completion(ASK)
        finally:
            await doubting.close()

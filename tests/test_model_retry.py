"""The retry policy of model calls (``riverbed/agent/retry.py``): which errors are retried, how
long it waits, and that its budget starts at the first failure; then the agent role against the
scripted server: a connection closed mid-answer is retried like a server that is down, and a
429's ``Retry-After`` is waited out."""

from __future__ import annotations

import contextlib
import email.utils
import http.server
import threading
import time
from pathlib import Path

import anyio
import httpx2
import openai
import pytest

from riverbed import events
from riverbed.agent.hosted import open_run
from riverbed.agent.llm import AgentOptions
from riverbed.agent.retry import GaveUp, RetryPolicy, Saturated, retry_after, retryable, retrying
from riverbed.client.session import Bus
from riverbed.settings import Settings
from riverbed.workers.agent_run import run_llm_agent
from riverbed.workers.model_client import CheckedClient, ResponseTooLarge
from tests.kit.agent_role import (
    ended,
    roles,
    server,  # noqa: F401  (fixtures)
)
from tests.kit.openai_server import OpenAIServer

pytestmark = pytest.mark.anyio

REQUEST = httpx2.Request("POST", "http://model/v1/chat/completions")


def status_error(status: int, headers: dict[str, str] | None = None) -> openai.APIStatusError:
    response = httpx2.Response(status, headers=headers or {}, request=REQUEST, json={"error": {"message": "x"}})
    return openai.APIStatusError("x", response=response, body=None)


def test_which_model_errors_are_retried() -> None:
    retried = [
        TimeoutError(),
        openai.APIConnectionError(request=REQUEST),
        openai.APITimeoutError(request=REQUEST),
        Saturated("full", 0.1),
        *(status_error(s) for s in (408, 409, 429, 500, 502, 503, 504)),
    ]
    final = [status_error(s) for s in (400, 401, 403, 404, 422)]
    assert all(retryable(e) for e in retried)
    assert not any(retryable(e) for e in final)


def test_retry_after_is_read_in_seconds_milliseconds_and_dates() -> None:
    assert retry_after(status_error(429, {"Retry-After": "7"})) == 7.0
    assert retry_after(status_error(429, {"retry-after-ms": "1500", "Retry-After": "7"})) == 1.5
    now = time.time()
    date = email.utils.formatdate(now + 30, usegmt=True)
    assert 28 <= (retry_after(status_error(503, {"Retry-After": date}), now=now) or 0) <= 31
    assert retry_after(status_error(429)) is None
    assert retry_after(Saturated("full", 0.25)) == 0.25
    assert RetryPolicy().pause(status_error(429, {"Retry-After": "12"}), 1) == 12.0  # past the cap: as asked
    assert 0.25 <= RetryPolicy(first=0.5).pause(status_error(500), 1) <= 0.5


async def test_the_budget_starts_at_the_first_failure_not_the_first_try() -> None:
    # Each failing try takes longer than the whole budget (a slow model that drops the
    # connection): the tries still get their retries, as a server that fails at once does.
    tries: list[float] = []

    async def slow_then_ok() -> str:
        tries.append(time.monotonic())
        if len(tries) < 3:
            await anyio.sleep(0.3)
            raise openai.APIConnectionError(request=REQUEST)
        return "answer"

    policy = RetryPolicy(budget=0.5, first=0.05, cap=0.05)
    assert await retrying(policy, slow_then_ok) == "answer"
    assert len(tries) == 3


async def test_a_final_error_is_not_retried_and_a_spent_budget_gives_up() -> None:
    calls = 0

    async def refused() -> None:
        nonlocal calls
        calls += 1
        raise status_error(401)

    with pytest.raises(GaveUp) as final:
        await retrying(RetryPolicy(budget=10), refused)
    assert (final.value.why, final.value.tries, calls) == ("final", 1, 1)

    async def down() -> None:
        raise openai.APIConnectionError(request=REQUEST)

    started = time.monotonic()
    with pytest.raises(GaveUp) as spent:
        await retrying(RetryPolicy(budget=0.3, first=0.02, cap=0.05), down)
    assert spent.value.why == "budget"
    assert spent.value.tries > 3
    assert time.monotonic() - started < 2

    async def asks_too_long() -> None:
        raise status_error(429, {"Retry-After": "30"})

    with pytest.raises(GaveUp) as late:  # (the server's wait is past the budget: no sleep for nothing)
        await retrying(RetryPolicy(budget=5), asks_too_long)
    assert (late.value.why, late.value.tries, late.value.pause) == ("budget", 1, 30.0)


@pytest.mark.parametrize("checked", [True, False], ids=["worker-client", "library-client"])
async def test_a_connection_closed_mid_answer_is_retried(
    bus: Bus, workspace: Path, server: OpenAIServer, checked: bool
) -> None:
    # The server reads the request, sends the status line, headers and the start of the body,
    # then closes the connection, 1.5 s in: longer than the whole retry budget.  It answers on
    # the next try, and the run goes on.
    server.drop(after=1.5)
    server.reply("done")
    async with roles(bus, workspace, server, retry_seconds=1.0, checked=checked):
        opened = await open_run(bus, "s-drop", "try")
        seen = await ended(bus, "s-drop", opened.opened)
    assert isinstance(seen[-1], events.Finish), seen[-1]
    assert seen[-1].final_thought == "done"
    assert len(server.requests) == 2


async def test_a_429_with_retry_after_is_waited_out(bus: Bus, workspace: Path, server: OpenAIServer) -> None:
    server.fail(429, "slow down", retry_after=2)
    server.reply("done")
    async with roles(bus, workspace, server, retry_seconds=5.0, checked=True):
        opened = await open_run(bus, "s-429", "try")
        seen = await ended(bus, "s-429", opened.opened)
    assert isinstance(seen[-1], events.Finish), seen[-1]
    first, second = server.received
    assert 2.0 <= second - first < 4.0  # the server's wait, not the 0.25-0.5 s of the first backoff step


async def test_a_retry_after_past_the_budget_ends_the_run_at_once(
    bus: Bus, workspace: Path, server: OpenAIServer
) -> None:
    server.fail(429, "come back in an hour", retry_after=3600)
    async with roles(bus, workspace, server, retry_seconds=5.0, checked=True):
        opened = await open_run(bus, "s-429-late", "try")
        seen = await ended(bus, "s-429-late", opened.opened, timeout=10)
    last = seen[-1]
    assert isinstance(last, events.Error)
    assert last.reason == "llm_error"
    assert "HTTP 429" in last.content
    assert "come back in an hour" in last.content
    assert len(server.requests) == 1


async def test_the_in_process_loop_retries_by_the_same_policy(bus: Bus, server: OpenAIServer) -> None:
    # (no memory role: the context recalls time out at once, which the loop survives)
    server.drop(after=0.2)
    server.fail(503, "loading the model", retry_after=1.2)
    server.reply(tool_calls=[("finish", {"final_thought": "done"})])
    settings = Settings(llm_model="test-model", agent_llm_retry_seconds=3)
    options = AgentOptions(recall_timeout=0.2)
    final = await run_llm_agent(bus, "s-loop", "try", settings=settings, client=server.client(), options=options)
    assert isinstance(final, events.Finish), final
    assert len(server.requests) == 3
    assert server.received[2] - server.received[1] >= 1.2  # (the server's Retry-After, not a backoff step)


async def test_an_answer_over_the_cap_is_refused_before_it_is_read(
    bus: Bus, workspace: Path, server: OpenAIServer
) -> None:
    server.reply("x" * 200_000)  # (a 20 MB answer, scaled down with the cap)
    async with roles(bus, workspace, server, retry_seconds=5.0, checked=True, max_response_bytes=64 * 1024):
        opened = await open_run(bus, "s-big", "try")
        seen = await ended(bus, "s-big", opened.opened, timeout=10)
    last = seen[-1]
    assert isinstance(last, events.Error)
    assert last.reason == "llm_error"
    assert "over RIVERBED_LLM_MAX_RESPONSE_BYTES (65,536)" in last.content
    assert not any(isinstance(e, events.LlmResponse) for e in seen)
    assert len(server.requests) == 1  # the same request would bring the same answer: not asked again


async def test_an_answer_without_a_length_is_cut_off_at_the_cap() -> None:
    class Chunked(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            with contextlib.suppress(OSError):  # (the client hangs up at the cap)
                for _ in range(64):
                    chunk = b"x" * 16384
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.write(b"0\r\n\r\n")

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Chunked)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    client = CheckedClient(
        api_key="k", base_url=f"http://127.0.0.1:{httpd.server_address[1]}/v1", max_response_bytes=100_000
    )
    try:
        with pytest.raises(ResponseTooLarge, match="over RIVERBED_LLM_MAX_RESPONSE_BYTES"):
            await client.chat_completion({"model": "m", "messages": []})
    finally:
        await client.close()
        httpd.shutdown()
        httpd.server_close()

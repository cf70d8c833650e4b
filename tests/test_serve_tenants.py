"""Limits per tenant on the HTTP side, each attacked through a real ``riverbed serve``: a tenant
with many keys gets no more streams, waiting acts or requests than one with one key, the one
past the limit gets 429 naming it (never a 503), and another tenant keeps working.  ``/act``
under an ``Idempotency-Key`` runs its action once."""

from __future__ import annotations

import collections
from pathlib import Path

import anyio
import httpx
import pytest
from anyio.abc import SocketStream

from riverbed import events
from riverbed.client.session import Bus
from riverbed.serve import ServeConfig
from tests.kit.serve import assert_problem, bearer, new_key, running, serve_process
from tests.kit.workers import Spawn, ready, spawn, workers  # noqa: F401  (spawn, workers: fixtures)

pytestmark = pytest.mark.anyio

SSE = {"Accept": "text/event-stream"}
STREAMS = 2100
KEYS = 6
TENANT_STREAMS = 60
WAVE = 300


async def ask_stream(host: str, port: int, key: str, session: str) -> tuple[int, bytes, SocketStream | None]:
    """One SSE request on a raw socket: (status, what was read, the socket while the stream is open)."""
    sock = await anyio.connect_tcp(host, port)
    request = (
        f"GET /v1/sessions/{session}/events HTTP/1.1\r\nHost: {host}\r\nAccept: text/event-stream\r\n"
        f"Authorization: Bearer {key}\r\n\r\n"
    )
    await sock.send(request.encode())
    seen = b""
    with anyio.fail_after(60):
        while True:
            try:
                seen += await sock.receive()
            except anyio.EndOfStream:
                break
            if seen.startswith(b"HTTP/1.1 200") and b"retry: 1000" in seen:
                return 200, seen, sock
            if b"\r\n\r\n" in seen and not seen.startswith(b"HTTP/1.1 200"):
                head, _, body = seen.partition(b"\r\n\r\n")
                sizes = [
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                ]
                length = sizes[0] if sizes else None
                if length is not None and len(body) >= length:
                    break
    await sock.aclose()
    return int(seen[9:12] or b"0"), seen, None


@pytest.mark.security
async def test_a_tenants_keys_share_its_stream_limit_and_another_tenant_keeps_working(
    bus: Bus, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    keys = [await new_key(bus, "mallory") for _ in range(KEYS)]
    victim = await new_key(bus, "acme")
    await bus.session("flood", tenant="mallory").append(events.Think(thought="bait"))
    await bus.session("mine", tenant="acme").append(events.Think(thought="mine"))
    # A small tenant limit (the same code path as the default's 1,000), and per-key limits that
    # would let 6 keys hold 3,000.
    env = {
        "RIVERBED_SERVE_MAX_STREAMS_PER_TENANT": str(TENANT_STREAMS),
        "RIVERBED_SERVE_MAX_STREAMS_PER_KEY": "500",
        "RIVERBED_SERVE_RATE": "0",
        "RIVERBED_SERVE_TENANT_RATE": "0",
    }
    with serve_process(redis_url, prefix, tmp_path / "serve.log", env) as base:
        url = httpx.URL(base)
        assert url.port is not None
        host, port = url.host, url.port
        statuses: collections.Counter[int] = collections.Counter()
        refusals: list[bytes] = []
        held: list[SocketStream] = []
        try:
            for wave in range(0, STREAMS, WAVE):

                async def one(n: int) -> None:
                    status, seen, sock = await ask_stream(host, port, keys[n % KEYS], "flood")
                    statuses[status] += 1
                    if sock is not None:
                        held.append(sock)
                    elif len(refusals) < 5:
                        refusals.append(seen)

                async with anyio.create_task_group() as tg:
                    for n in range(wave, min(wave + WAVE, STREAMS)):
                        tg.start_soon(one, n)
            assert statuses == {200: TENANT_STREAMS, 429: STREAMS - TENANT_STREAMS}, statuses
            for seen in refusals:
                assert b"RIVERBED_SERVE_MAX_STREAMS_PER_TENANT=60" in seen, seen
                assert b"over all its keys" in seen
            # Another tenant streams and appends as before.
            status, _seen, mine = await ask_stream(host, port, victim, "mine")
            assert status == 200
            assert mine is not None
            held.append(mine)
            async with httpx.AsyncClient(base_url=base, headers=bearer(victim), timeout=30) as http:
                appended = await http.post("/v1/sessions/mine/events", json={"kind": "think", "thought": "x"})
                assert appended.status_code == 201, appended.text
            # A stream that ends gives the tenant its slot back, whichever key held it.
            await held.pop(0).aclose()
            with anyio.fail_after(10):
                while (again := await ask_stream(host, port, keys[5], "flood"))[0] != 200:
                    await anyio.sleep(0.05)
            assert again[2] is not None
            held.append(again[2])
        finally:
            for sock in held:
                await sock.aclose()


@pytest.mark.security
async def test_a_tenants_keys_share_its_waiting_acts_and_its_request_rate(bus: Bus) -> None:
    keys = [await new_key(bus, "mallory") for _ in range(3)]
    calm = await new_key(bus, "acme")
    config = ServeConfig(max_acts_per_tenant=2, max_acts_per_key=100, rate=0, tenant_rate=0)
    said = {"kind": "message", "content": "answered at once"}
    async with running(bus, config) as base, httpx.AsyncClient(base_url=base, timeout=30) as http:
        waiting: list[int] = []

        async def wait_for_nothing(key: str) -> None:  # no worker runs: it waits its whole timeout
            late = await http.post(
                "/v1/sessions/s/act?timeout=3", json={"kind": "cmd_run", "command": "true"}, headers=bearer(key)
            )
            waiting.append(late.status_code)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_for_nothing, keys[0])
            tg.start_soon(wait_for_nothing, keys[1])
            with anyio.fail_after(10):
                while await bus.session("s").last_id() < 2:
                    await anyio.sleep(0.02)
            with anyio.fail_after(10):
                while (
                    third := await http.post("/v1/sessions/s/act", json=said, headers=bearer(keys[2]))
                ).status_code < 429:
                    await anyio.sleep(0.05)
            assert_problem(third, 429, "tenant 'mallory' holds 2 acts", "RIVERBED_SERVE_MAX_ACTS_PER_TENANT=2")
            other = await http.post("/v1/sessions/t/act", json=said, headers=bearer(calm))
            assert other.status_code == 200, other.text
        assert waiting == [504, 504]

    config = ServeConfig(rate=1000, burst=1000, tenant_rate=1, tenant_burst=12)
    async with running(bus, config) as base, httpx.AsyncClient(base_url=base, timeout=30) as http:
        answers = [(await http.get("/v1/me", headers=bearer(keys[n % 3]))).status_code for n in range(24)]
        # The tenant's burst over its three keys (and a token or two refilled meanwhile), no more.
        assert 12 <= answers.count(200) <= 15, answers
        refused = await http.get("/v1/me", headers=bearer(keys[0]))
        assert_problem(refused, 429, "tenant 'mallory'", "RIVERBED_SERVE_TENANT_RATE")
        assert int(refused.headers["retry-after"]) >= 1
        assert (await http.get("/v1/me", headers=bearer(calm))).status_code == 200


@pytest.mark.security
async def test_act_with_an_idempotency_key_runs_its_action_once(bus: Bus, spawn: Spawn) -> None:
    key = await new_key(bus, "acme")
    await ready(spawn("w1", ["runtime"]))
    command = {"kind": "cmd_run", "command": "echo $RANDOM$RANDOM$RANDOM", "blocking": True}
    async with running(bus) as base, httpx.AsyncClient(base_url=base, headers=bearer(key), timeout=60) as http:
        once = {"Idempotency-Key": "order-1"}
        first = await http.post("/v1/sessions/s/act?timeout=30", json=command, headers=once)
        assert first.status_code == 200, first.text
        again = await http.post("/v1/sessions/s/act?timeout=30", json=command, headers=once)
        assert again.status_code == 200, again.text
        # The same answer: the command ran once (a second run would print other random digits).
        assert again.json() == first.json()
        assert first.json()["kind"] == "cmd_output"
        other = await http.post("/v1/sessions/s/act", json={**command, "command": "echo other"}, headers=once)
        body = assert_problem(other, 409, "idempotency key was used for another request")
        assert body["retryable"] is False
        # Without the key each act is its own.
        plain = await http.post("/v1/sessions/s/act?timeout=30", json=command)
        assert plain.json()["content"] != first.json()["content"]
    log = await bus.session("s").events()
    assert [e.kind for e in log if isinstance(e, events.CmdRun)] == ["cmd_run", "cmd_run"]

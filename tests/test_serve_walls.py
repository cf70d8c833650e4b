"""The walls between tenants on the HTTP side, each attacked through a real ``riverbed serve``:
streams that cost no Redis connection and are bounded per key, appends bounded in events,
request rates per key, a tenant's session list read from its own index, and answers that
tell a stranger nothing (free and foreign ids alike, idempotency keys bound to their body,
revoked keys' streams ended, tenants read again when a log is created again)."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import anyio
import httpx
import pytest
from anyio.abc import SocketStream

from riverbed import events
from riverbed.client.session import Bus
from riverbed.errors import InputError
from riverbed.serve import KeyStore, ServeConfig
from tests.kit.serve import assert_problem, bearer, new_key, running, serve_process

pytestmark = pytest.mark.anyio

SSE = {"Accept": "text/event-stream"}


# --- streams ---------------------------------------------------------------------------------


async def open_stream(host: str, port: int, key: str, session: str) -> SocketStream:
    """One SSE request on a raw socket (a few KiB each, so thousands fit in a test), read up to
    the stream's first line."""
    sock = await anyio.connect_tcp(host, port)
    request = (
        f"GET /v1/sessions/{session}/events HTTP/1.1\r\nHost: {host}\r\nAccept: text/event-stream\r\n"
        f"Authorization: Bearer {key}\r\n\r\n"
    )
    await sock.send(request.encode())
    seen = b""
    with anyio.fail_after(60):
        while b"retry: 1000" not in seen:
            seen += await sock.receive()
    assert seen.startswith(b"HTTP/1.1 200"), seen[:300]
    return sock


async def read_until(sock: SocketStream, needle: bytes, seconds: float = 30) -> bytes:
    seen = bytearray()
    with anyio.fail_after(seconds):
        while True:
            start = max(0, len(seen) - len(needle))
            seen += await sock.receive(1 << 20)
            if needle in seen[start:]:
                return bytes(seen)


async def redis_clients(bus: Bus) -> int:
    return int((await bus.redis.info("clients"))["connected_clients"])


STREAMS = 2000
SESSIONS = 50
WAVE = 250


@pytest.mark.fault
@pytest.mark.timeout(600)
async def test_thousands_of_streams_hold_no_redis_connection_and_another_tenant_keeps_its_latency(
    standalone_bus: Bus, standalone_redis_url: str, prefix: str, tmp_path: Path
) -> None:
    bus = standalone_bus
    attacker, victim = await new_key(bus, "mallory"), await new_key(bus, "acme")
    for n in range(SESSIONS):
        await bus.session(f"flood{n}", tenant="mallory").append(events.Think(thought="bait"))
    env = {
        "RIVERBED_SERVE_MAX_STREAMS_PER_KEY": str(2 * STREAMS),
        "RIVERBED_SERVE_MAX_STREAMS_PER_TENANT": str(2 * STREAMS),
        "RIVERBED_SERVE_RATE": "0",
        "RIVERBED_SERVE_TENANT_RATE": "0",
    }
    with serve_process(standalone_redis_url, prefix, tmp_path / "serve.log", env) as base:
        url = httpx.URL(base)
        host, port = url.host, url.port
        assert port is not None
        async with httpx.AsyncClient(base_url=base, headers=bearer(victim), timeout=30) as http:

            async def victim_round() -> float:
                started = time.monotonic()
                appended = await http.post("/v1/sessions/mine/events", json={"kind": "think", "thought": "x"})
                assert appended.status_code == 201, appended.text
                listed = await http.get("/v1/sessions/mine/events")
                assert listed.status_code == 200, listed.text
                return time.monotonic() - started

            before = sorted([await victim_round() for _ in range(10)])
            clients_before = await redis_clients(bus)
            sockets: dict[int, SocketStream] = {}
            try:
                for wave in range(0, STREAMS, WAVE):

                    async def one(n: int) -> None:
                        sockets[n] = await open_stream(host, port, attacker, f"flood{n % SESSIONS}")

                    async with anyio.create_task_group() as tg:
                        for n in range(wave, min(wave + WAVE, STREAMS)):
                            tg.start_soon(one, n)
                assert len(sockets) == STREAMS
                # The streams hold no Redis connection each: the server's pool grew with the requests
                # in flight at once (a wave), not with the streams open.
                grown = await redis_clients(bus) - clients_before
                assert grown < WAVE + 100, f"{STREAMS} open streams took {grown} Redis connections"
                during = sorted([await victim_round() for _ in range(10)])
                # Generous: a round takes milliseconds; the pool running dry answers 503 at once,
                # and a pool wait would take seconds.
                assert during[5] < max(1.0, 20 * before[5]), (before, during)
                # ... and the streams are live: an append reaches them.
                await bus.session("flood7", tenant="mallory").append(events.Think(thought="news"))
                sample = [s for n, s in sockets.items() if n % SESSIONS == 7]
                for sock in random.sample(sample, 20):
                    assert b"news" in await read_until(sock, b"news")
            finally:
                for sock in sockets.values():
                    await sock.aclose()


def ids_in(body: bytes) -> list[int]:
    return [int(line[4:]) for line in body.split(b"\n") if line.startswith(b"id: ")]


@pytest.mark.fault
async def test_streams_of_one_session_share_its_reader_and_a_slow_one_catches_up_in_order(bus: Bus) -> None:
    key = await new_key(bus, "acme")
    session = bus.session("s", tenant="acme")
    await session.append(events.Think(thought="1"), events.Think(thought="2"))
    async with running(bus, ServeConfig(rate=0)) as base:
        url = httpx.URL(base)
        assert url.port is not None
        fast = [await open_stream(url.host, url.port, key, "s") for _ in range(5)]
        slow = await open_stream(url.host, url.port, key, "s")  # read only at the end
        async with httpx.AsyncClient(base_url=base, headers=bearer(key), timeout=30) as http:
            async with http.stream("GET", "/v1/sessions/s/events?until=4", headers=SSE) as bounded:
                # More than every buffer between the reader and the slow client holds.
                for start in range(0, 3000, 500):
                    await session.append(
                        *(events.Think(thought=f"{n:05d}" + "x" * 2000) for n in range(start, start + 500))
                    )
                body = await bounded.aread()  # ``until`` beyond the log's end when it opened: ends at 4
            assert ids_in(body) == [1, 2, 3, 4]
        for sock in [*fast, slow]:
            body = await read_until(sock, b"id: 3002\n", 60)
            assert ids_in(body) == list(range(1, 3003))
            await sock.aclose()


@pytest.mark.fault
async def test_a_key_holds_a_bounded_number_of_streams_and_the_429_names_the_limit(bus: Bus) -> None:
    key, other = await new_key(bus, "acme"), await new_key(bus, "acme")
    await bus.session("s", tenant="acme").append(events.Think(thought="1"))
    async with running(bus, ServeConfig(max_streams_per_key=3)) as base:
        url = httpx.URL(base)
        assert url.port is not None
        held = [await open_stream(url.host, url.port, key, "s") for _ in range(3)]
        async with httpx.AsyncClient(base_url=base, timeout=10) as http:
            refused = await http.get("/v1/sessions/s/events", headers={**SSE, **bearer(key)})
            body = assert_problem(refused, 429, "RIVERBED_SERVE_MAX_STREAMS_PER_KEY=3")
            assert "3 event streams" in str(body["detail"])
            assert refused.headers["retry-after"]
            # Another key of the same tenant has slots of its own.
            fourth = await open_stream(url.host, url.port, other, "s")
            await fourth.aclose()
            # A closed stream gives its slot back.
            await held.pop().aclose()
            with anyio.fail_after(10):
                while True:
                    async with http.stream("GET", "/v1/sessions/s/events?until=1", headers={**SSE, **bearer(key)}) as r:
                        if r.status_code == 200:
                            assert b"id: 1" in await r.aread()
                            break
                    await anyio.sleep(0.05)
        for sock in held:
            await sock.aclose()


@pytest.mark.fault
async def test_a_key_has_a_bounded_number_of_acts_waiting_and_the_429_names_the_limit(bus: Bus) -> None:
    key, other = await new_key(bus, "acme"), await new_key(bus, "acme")
    async with (
        running(bus, ServeConfig(max_acts_per_key=2)) as base,
        httpx.AsyncClient(base_url=base, headers=bearer(key), timeout=30) as http,
    ):
        said = {"kind": "message", "content": "answered at once"}
        waiting: list[int] = []

        async def wait_for_nothing() -> None:  # no worker runs: it waits its whole timeout
            late = await http.post("/v1/sessions/s/act?timeout=3", json={"kind": "cmd_run", "command": "true"})
            waiting.append(late.status_code)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_for_nothing)
            tg.start_soon(wait_for_nothing)
            with anyio.fail_after(10):  # both hold their slot once their action is on the log
                while await bus.session("s").last_id() < 2:
                    await anyio.sleep(0.02)
            with anyio.fail_after(10):
                while (third := await http.post("/v1/sessions/s/act", json=said)).status_code != 429:
                    await anyio.sleep(0.05)
            assert_problem(third, 429, "2 acts waiting for their answer", "RIVERBED_SERVE_MAX_ACTS_PER_KEY=2")
            # Another key has slots of its own.
            assert (await http.post("/v1/sessions/s/act", json=said, headers=bearer(other))).status_code == 200
        assert waiting == [504, 504]
        assert (await http.post("/v1/sessions/s/act", json=said)).status_code == 200  # the slots came back


@pytest.mark.security
async def test_revoking_a_key_ends_its_open_streams_within_seconds(bus: Bus) -> None:
    store = KeyStore(bus.redis, bus.keys, bus.url)
    key, record = await store.create("acme")
    keep = await new_key(bus, "acme")
    await bus.session("s", tenant="acme").append(events.Think(thought="1"))
    async with running(bus) as base:
        url = httpx.URL(base)
        assert url.port is not None
        revoked = await open_stream(url.host, url.port, key, "s")
        kept = await open_stream(url.host, url.port, keep, "s")
        await store.revoke(record.id)
        with anyio.fail_after(10):  # the check runs every 2 s
            tail = b""
            while not tail.endswith(b"0\r\n\r\n"):  # the chunked body's end
                tail += await revoked.receive()
        await bus.session("s", tenant="acme").append(events.Think(thought="after"))
        assert b"after" in await read_until(kept, b"after", 10)
        await revoked.aclose()
        await kept.aclose()


# --- appends -----------------------------------------------------------------------------------


@pytest.mark.fault
async def test_an_append_is_bounded_in_events_413_on_http_and_an_input_error_in_the_client(bus: Bus) -> None:
    key = await new_key(bus, "acme")
    config = ServeConfig(max_events_per_append=100)
    async with running(bus, config) as base, httpx.AsyncClient(base_url=base, headers=bearer(key)) as http:
        many = [{"kind": "think", "thought": str(n)} for n in range(101)]
        refused = await http.post("/v1/sessions/s/events", json=many)
        assert_problem(refused, 413, "at most 100 events", "not 101")
        ok = await http.post("/v1/sessions/s/events", json=many[:100])
        assert ok.status_code == 201, ok.text
        assert ok.json()["ids"] == list(range(1, 101))
    small = Bus(bus.redis, prefix=bus.keys.prefix, url=bus.url, max_events_per_append=100)
    with pytest.raises(InputError, match="at most 100 events"):
        await small.session("s", tenant="acme").append(*(events.Think(thought=str(n)) for n in range(101)))
    assert await bus.session("s").last_id() == 100
    # The default holds an attack of 250,000 tiny events off in the client, before Redis.
    with pytest.raises(InputError, match="at most 10,000 events"):
        await bus.session("s", tenant="acme").append(*(events.Think(thought="") for _ in range(250_000)))
    assert await bus.session("s").last_id() == 100


# --- request rates ------------------------------------------------------------------------------


@pytest.mark.fault
async def test_a_keys_request_rate_is_limited_across_serve_processes_with_retry_after(
    bus: Bus, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    flooder, calm = await new_key(bus, "mallory"), await new_key(bus, "acme")
    env = {"RIVERBED_SERVE_RATE": "1", "RIVERBED_SERVE_BURST": "20"}
    with (
        serve_process(redis_url, prefix, tmp_path / "a.log", env) as first,
        serve_process(redis_url, prefix, tmp_path / "b.log", env) as second,
    ):
        async with httpx.AsyncClient(timeout=10) as http:
            started = time.monotonic()
            answers = [(await http.get(f"{first}/v1/me", headers=bearer(flooder))).status_code for _ in range(20)]
            answers += [(await http.get(f"{second}/v1/me", headers=bearer(flooder))).status_code for _ in range(20)]
            refilled = math.ceil(time.monotonic() - started) + 1  # (a token a second came back meanwhile)
            # One bucket for both processes: the burst of 20 and what refilled pass, no more.
            assert 20 <= answers.count(200) <= 20 + refilled, answers
            with anyio.fail_after(30):
                while (refused := await http.get(f"{second}/v1/me", headers=bearer(flooder))).status_code != 429:
                    pass
            assert_problem(refused, 429, "1 requests a second", "bursts of 20", "RIVERBED_SERVE_RATE")
            assert 1 <= int(refused.headers["retry-after"]) <= 2
            # Another key, even on the same process, is not held up.
            for base in (first, second):
                assert (await http.get(f"{base}/v1/me", headers=bearer(calm))).status_code == 200
            # The bucket refills.
            await anyio.sleep(float(refused.headers["retry-after"]) + 0.2)
            assert (await http.get(f"{first}/v1/me", headers=bearer(flooder))).status_code == 200


# --- the session list ---------------------------------------------------------------------------

OTHERS = 20_000


async def commands_processed(bus: Bus) -> int:
    return int((await bus.redis.info("stats"))["total_commands_processed"])


@pytest.mark.security
@pytest.mark.timeout(300)
async def test_a_tenant_lists_its_sessions_from_its_own_index_not_every_tenants(bus: Bus) -> None:
    small = await new_key(bus, "small")
    for name in ("a", "b", "c"):
        await bus.session(f"small-{name}", tenant="small").append(events.Think(thought="mine"))

    async def fill(start: int) -> None:
        for n in range(start, OTHERS, 50):
            await bus.session(f"big-{n}", tenant="big").append(events.Think(thought="theirs"))

    async with anyio.create_task_group() as tg:
        for start in range(50):
            tg.start_soon(fill, start)
    assert await bus.redis.zcard(bus.keys.sessions) == OTHERS + 3
    async with running(bus, ServeConfig(rate=0)) as base, httpx.AsyncClient(base_url=base, timeout=60) as http:
        before = await commands_processed(bus)
        listed = await http.get("/v1/sessions", headers=bearer(small))
        used = await commands_processed(bus) - before
        status = await http.get("/v1/status", headers=bearer(small))
    assert listed.status_code == 200, listed.text
    assert [s["session"] for s in listed.json()["sessions"]] == ["small-a", "small-b", "small-c"]
    assert status.json()["sessions"] == 3
    # Reading every tenant's sessions would take a command per session at least.
    assert used < 200, f"listing 3 sessions took {used} Redis commands"


async def test_sessions_older_than_the_tenant_indexes_are_indexed_once_when_serve_starts(bus: Bus) -> None:
    key = await new_key(bus, "acme")
    await bus.session("old", tenant="acme").append(events.Think(thought="before the index"))
    await bus.session("theirs", tenant="globex").append(events.Think(thought="x"))
    # As a session written by a version without the tenant indexes.
    await bus.redis.delete(bus.keys.tenant_sessions("acme"), bus.keys.tenant_sessions("globex"))
    async with running(bus) as base, httpx.AsyncClient(base_url=base, headers=bearer(key)) as http:
        listed = (await http.get("/v1/sessions")).json()["sessions"]
    assert [s["session"] for s in listed] == ["old"]
    assert await bus.redis.hget(bus.keys.tenant_index, "done") == b"2"


# --- answers that leak nothing ------------------------------------------------------------------

# (method, path, body, headers): requests that create nothing, so a free id and another tenant's
# id must answer them alike.
PROBES: list[tuple[str, str, object, dict[str, str]]] = [
    ("GET", "/v1/sessions/{id}/events", None, {}),
    ("GET", "/v1/sessions/{id}/events?from=2&until=3", None, {}),
    ("GET", "/v1/sessions/{id}/events", None, {**SSE, "Last-Event-ID": "1"}),
    ("POST", "/v1/sessions/{id}/events?expected_last=1", {"kind": "think", "thought": "x"}, {}),
    ("POST", "/v1/sessions/{id}/events?expected_last=7", [{"kind": "think", "thought": "x"}], {}),
    ("GET", "/v1/sessions/{id}/view", None, {}),
    ("GET", "/v1/sessions/{id}/view?until=1", None, {}),
    ("GET", "/v1/sessions/{id}/context", None, {}),
    ("POST", "/v1/sessions/{id}/context", {"op": "forget", "ranges": [[1, 1]]}, {}),
    ("POST", "/v1/sessions/{id}/context", {"op": "pin", "ranges": [[1, 1]], "dry_run": True}, {}),
    ("GET", "/v1/sessions/{id}/usage", None, {}),
    ("GET", "/v1/sessions/{id}/recall?q=secret", None, {}),
    ("POST", "/v1/sessions/{id}/fork", {"at": 1, "into": "copy-{n}"}, {}),
]


@pytest.mark.security
async def test_a_free_id_and_another_tenants_id_answer_alike_on_every_route(bus: Bus) -> None:
    stranger = await new_key(bus, "mallory")
    await bus.session("victim", tenant="acme").append(
        events.Message(content="secret", source="user"), events.Think(thought="t")
    )
    async with running(bus) as base, httpx.AsyncClient(base_url=base, headers=bearer(stranger)) as http:
        for n, (method, path, body, headers) in enumerate(PROBES):
            answers = []
            for target in ("victim", f"free{n}"):
                content = None if body is None else json.dumps(body).replace("{n}", f"{n}{target}").encode()
                response = await http.request(
                    method,
                    path.format(id=target),
                    content=content,
                    headers={**headers, "Content-Type": "application/json"},
                )
                answers.append((response.status_code, response.text.replace(target, "ID")))
            assert answers[0] == answers[1], (method, path, answers)
            assert answers[0][0] == 404, (method, path, answers)
    assert await bus.session("victim").last_id() == 2
    assert await bus.session("free3").last_id() == 0


@pytest.mark.security
async def test_an_idempotency_key_is_bound_to_its_body(bus: Bus) -> None:
    key = await new_key(bus, "acme")
    async with running(bus) as base, httpx.AsyncClient(base_url=base, headers=bearer(key)) as http:
        first = await http.post(
            "/v1/sessions/s/events", json={"kind": "think", "thought": "a"}, headers={"Idempotency-Key": "k"}
        )
        again = await http.post(
            "/v1/sessions/s/events", json={"kind": "think", "thought": "a"}, headers={"Idempotency-Key": "k"}
        )
        assert first.status_code == again.status_code == 201
        assert first.json()["ids"] == again.json()["ids"] == [1]
        other = await http.post(
            "/v1/sessions/s/events", json={"kind": "think", "thought": "b"}, headers={"Idempotency-Key": "k"}
        )
        body = assert_problem(other, 409, "idempotency key was used for another request")
        assert body["retryable"] is False
        assert await bus.session("s").last_id() == 1
        assert [e.thought for e in await bus.session("s").events() if isinstance(e, events.Think)] == ["a"]


@pytest.mark.security
async def test_serve_reads_the_tenant_of_a_log_created_again_under_the_same_id(bus: Bus) -> None:
    old, new = await new_key(bus, "old-owner"), await new_key(bus, "new-owner")
    async with running(bus) as base, httpx.AsyncClient(base_url=base) as http:
        created = await http.post("/v1/sessions/s/events", json={"kind": "think", "thought": "1"}, headers=bearer(old))
        assert created.status_code == 201
        assert (await http.get("/v1/sessions/s/events", headers=bearer(old))).status_code == 200
        url = httpx.URL(base)
        assert url.port is not None
        following = await open_stream(url.host, url.port, old, "s")  # open across the wipe
        await http.post("/v1/sessions/s/events", json={"kind": "think", "thought": "2"}, headers=bearer(old))
        await read_until(following, b"id: 2\n")  # (live on the old log)
        # Redis loses the session (a wipe, FLUSHALL without the keys); another tenant creates it again.
        await bus.redis.delete(bus.keys.log("s"), bus.keys.meta("s"))
        await bus.session("s", tenant="new-owner").append(events.Message(content="new secret", source="user"))
        await bus.session("s", tenant="new-owner").append(
            events.Think(thought="more"), events.Think(thought="new secret 2")
        )
        stale = await http.get("/v1/sessions/s/events", headers=bearer(old))
        assert_problem(stale, 404, "no session 's'")
        assert "new secret" in (await http.get("/v1/sessions/s/events", headers=bearer(new))).text
        # The stream opened on the old log ends (within the reader's poll) and never carries the new one.
        seen = b""
        with anyio.fail_after(15):
            while not seen.endswith(b"0\r\n\r\n"):
                seen += await following.receive()
        assert b"new secret" not in seen
        await following.aclose()

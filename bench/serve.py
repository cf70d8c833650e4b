"""The HTTP API against the Python client API, both on the same runtime worker, in one run.

- act: ``POST /v1/sessions/{id}/act`` (an HTTP/1.1 keep-alive client: httpx, and a minimal
  one that shows what httpx itself costs) against
  ``Session.act`` straight on Redis, the same action (``file_read`` of a 200-byte file)
  answered by the same ``python -m riverbed.workers runtime`` process, rounds alternating.
  ``riverbed serve`` runs as its own process, as deployed.  Target: the API adds at most
  1 ms at p50 (its p50 minus ``Session.act``'s).
- SSE follow: the time from the start of an append (``Session.append``) until a client
  following ``GET /v1/sessions/{id}/events`` with ``Accept: text/event-stream`` has parsed
  the event, against the same wait through ``Session.log(follow=True)`` on Redis.  Target:
  under 50 ms at p50.

Each client runs in this process; only the API key's check and the session's tenant (read
once, then remembered) sit between the HTTP request and the log.
Run alone: ``python -m bench.serve [--quick] [--repeats N] [--json]``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import httpx
from anyio.streams.buffered import BufferedByteStream

import riverbed
from bench.common import Result, percentile, run_alone
from bench.roundtrip import FILE_NAME, Workers, _prepare_workspace
from riverbed import events
from riverbed.serve import KeyStore

SAMPLES = 200  # per round and contender
LIMIT = 1_000_000
"""Requests a second allowed per API key and per tenant: the bench's thousands stay within it."""


@contextmanager
def serve_process(url: str, prefix: str, log_path: Path) -> Iterator[str]:
    env = {**os.environ, "RIVERBED_REDIS_URL": url, "RIVERBED_PREFIX": prefix, "RIVERBED_LOG_FORMAT": "json"}
    # The request rate limits stay on (their check is part of a request's cost), above the bench's rate.
    env |= {"RIVERBED_SERVE_RATE": str(LIMIT), "RIVERBED_SERVE_TENANT_RATE": str(LIMIT)}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "riverbed.cli", "serve", "--port", "0"], env=env, stdout=log, stderr=log
        )
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                found = re.search(rb"serving (http://\S+)", log_path.read_bytes())
                if found:
                    yield found.group(1).decode()
                    return
                if proc.poll() is not None:
                    break
                time.sleep(0.05)
            raise RuntimeError(f"riverbed serve did not start: {log_path.read_text()[-2000:]}")
        finally:
            proc.terminate()
            proc.wait(20)


class RawHttp:
    """A minimal HTTP/1.1 keep-alive client (one connection, Content-Length bodies): what the
    API costs without a general-purpose client library's own overhead."""

    def __init__(self, base: str, key: str) -> None:
        host, port = base.removeprefix("http://").rsplit(":", 1)
        self.host, self.port, self.key = host, int(port), key
        self.stream: BufferedByteStream | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.stream is None:
            self.stream = BufferedByteStream(await anyio.connect_tcp(self.host, self.port))
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {self.key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        await self.stream.send(head.encode() + body)
        status_line, *headers = (await self.stream.receive_until(b"\r\n\r\n", 65536)).split(b"\r\n")
        length = next(int(h.split(b":", 1)[1]) for h in headers if h.lower().startswith(b"content-length:"))
        return int(status_line.split()[1]), await self.stream.receive_exactly(length)

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()


async def _timed(fn: Callable[[], Awaitable[None]], count: int, out: list[float]) -> None:
    for _ in range(count):
        started = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - started) * 1000)


async def _sse_ids(http: httpx.AsyncClient, session: str, after: int) -> AsyncIterator[int]:
    """Ids of the events an SSE client parses, as they arrive."""
    headers = {"Accept": "text/event-stream", "Last-Event-ID": str(after)}
    async with http.stream("GET", f"/v1/sessions/{session}/events", headers=headers) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                yield events.decode_json(line[6:]).id or 0


async def _follow_latency(
    session: riverbed.Session, ids: Callable[[int], AsyncIterator[int]], count: int, out: list[float]
) -> None:
    """Append ``count`` events one by one; each time, wait until ``ids`` delivers it."""
    last = await session.last_id()
    tx, rx = anyio.create_memory_object_stream[int](count + 10)

    async def read() -> None:
        async for event_id in ids(last):
            await tx.send(event_id)

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        await anyio.sleep(0.2)  # the follower is connected and waiting
        for _ in range(count):
            started = time.perf_counter()
            (new_id,) = await session.append(events.Think(thought="x" * 100))
            with anyio.fail_after(10):
                while await rx.receive() != new_id:
                    pass
            out.append((time.perf_counter() - started) * 1000)
        tg.cancel_scope.cancel()


async def measure(url: str, args: argparse.Namespace) -> list[Result]:
    rounds = max(args.repeats, 1)
    per_round = SAMPLES // (2 if args.quick else 1)
    prefix = f"bsv{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="riverbed-bench-serve-") as tmp_name:
        tmp = Path(tmp_name)
        workspace = tmp / "ws"
        for sid in ("direct", "api"):
            _prepare_workspace(workspace, sid)
        workers = Workers(url, prefix, workspace, 1, 10, sandbox="process")
        try:
            await workers.wait_ready()
            with serve_process(url, prefix, tmp / "serve.log") as base:
                async with riverbed.connect(url, prefix=prefix) as bus:
                    key, _ = await KeyStore(bus.redis, bus.keys, bus.url).create("bench")
                    direct = bus.session("direct", tenant="bench")
                    limits = httpx.Limits(max_keepalive_connections=4)
                    async with httpx.AsyncClient(
                        base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60, limits=limits
                    ) as http:
                        read = events.FileRead(path=FILE_NAME)
                        body = events.encode_json(read)

                        async def via_client() -> None:
                            obs = await direct.act(read, timeout=60)
                            assert isinstance(obs, events.FileContent), obs

                        async def via_api() -> None:
                            response = await http.post(
                                "/v1/sessions/api/act?timeout=60",
                                content=body,
                                headers={"Content-Type": "application/json"},
                            )
                            assert response.status_code == 200, response.text
                            assert response.json()["kind"] == "file_content"

                        raw = RawHttp(base, key)

                        async def via_raw() -> None:
                            status, answer = await raw.post("/v1/sessions/api/act?timeout=60", body)
                            assert status == 200, answer
                            assert events.decode_json(answer).kind == "file_content"

                        for fn in (via_client, via_api, via_raw):  # warm up: the worker takes each session
                            await fn()
                        async with bus.redis.pipeline(transaction=False) as pipe:
                            for sid in ("direct", "api"):
                                pipe.hdel(bus.keys.meta(sid), "need:memory", "need:condenser")
                            await pipe.execute()
                        for fn in (via_client, via_api, via_raw):
                            await _timed(fn, 20, [])
                        client_ms: list[float] = []
                        api_ms: list[float] = []
                        raw_ms: list[float] = []
                        for _ in range(rounds):
                            await _timed(via_client, per_round, client_ms)
                            await _timed(via_api, per_round, api_ms)
                            await _timed(via_raw, per_round, raw_ms)
                        await raw.aclose()

                        follow_session = bus.session("follow", tenant="bench")
                        await follow_session.append(events.Message(content="follow me", source="user"))
                        redis_ms: list[float] = []
                        sse_ms: list[float] = []

                        async def redis_ids(after: int) -> AsyncIterator[int]:
                            async for event in follow_session.log(after + 1, follow=True):
                                yield event.id or 0

                        for _ in range(rounds):
                            await _follow_latency(follow_session, redis_ids, per_round // 2, redis_ms)
                            await _follow_latency(
                                follow_session, lambda after: _sse_ids(http, "follow", after), per_round // 2, sse_ms
                            )
        finally:
            workers.stop()

    p50_client, p50_api, p50_raw = percentile(client_ms, 50), percentile(api_ms, 50), percentile(raw_ms, 50)
    p99_client, p99_api = percentile(client_ms, 99), percentile(api_ms, 99)
    p50_redis, p50_sse = percentile(redis_ms, 50), percentile(sse_ms, 50)
    return [
        Result("act via HTTP API p50", "ms", p50_api, p50_client, "Session.act", p50_api / p50_client, None,
               len(api_ms), better="lower")
        ,
        Result("act via HTTP API: added p50", "ms", p50_api - p50_client, p50_client, "Session.act",
               p50_api / p50_client, 1.0, len(api_ms), better="lower", target_on="figure",
               note="POST /act (riverbed serve in its own process, httpx keep-alive client) minus Session.act, "
               "same runtime worker, rounds alternating")
        ,
        Result("act via HTTP API, lean client: added p50", "ms", p50_raw - p50_client, p50_client, "Session.act",
               p50_raw / p50_client, 1.0, len(raw_ms), better="lower", target_on="figure",
               note="the same requests through a 30-line keep-alive HTTP/1.1 client instead of httpx")
        ,
        Result("act via HTTP API p99", "ms", p99_api, p99_client, "Session.act", p99_api / p99_client, None,
               len(api_ms), better="lower")
        ,
        Result("SSE follow: append to client p50", "ms", p50_sse, p50_redis, "Session.log(follow=True)",
               p50_sse / p50_redis, 50.0, len(sse_ms), better="lower", target_on="figure",
               note="from the start of Session.append until the SSE client parsed the event")
        ,
        Result("SSE follow: append to client p99", "ms", percentile(sse_ms, 99), percentile(redis_ms, 99),
               "Session.log(follow=True)", percentile(sse_ms, 99) / percentile(redis_ms, 99), None, len(sse_ms),
               better="lower")
        ,
    ]  # fmt: skip


def main() -> int:
    return run_alone(measure, __doc__ or "")


if __name__ == "__main__":
    raise SystemExit(main())

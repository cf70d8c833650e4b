"""A worker's HTTP endpoints: ``/metrics``, ``/healthz``, ``/readyz``.

========  =====================================================================================
path      answers
========  =====================================================================================
metrics   the Prometheus text exposition of the worker's own registry
healthz   200 while the event loop runs: a ticker on the loop stamps the time every second, and
          a stamp older than ``stale_after`` means the loop was starved (503)
readyz    200 when every owner is ready, no role loop keeps failing (intake, reclaim, renew:
          each failing one is named with its last error and since when), the worker is not
          draining, and Redis answered recently (the worker's heartbeat or the metrics
          refresh); 503 otherwise.  The body is a short JSON object saying why.
========  =====================================================================================

The server is a small HTTP/1.1 responder on an anyio TCP listener, running in the worker's
own event loop and task group rather than prometheus_client's threaded server: it starts
with ``await tg.start(serve, ...)``, stops when its scope is cancelled (the listener is
closed on the way out, no thread to join), and, because it shares the loop, a loop that is
blocked cannot answer ``/healthz`` either, which is exactly what a liveness probe should see.
Each connection serves one request (``Connection: close``); reading the request is bounded
in size and time, and a failing connection never disturbs the worker.
"""

from __future__ import annotations

import json
import time
from typing import Protocol

import anyio
import structlog
from anyio.abc import SocketAttribute, SocketStream, TaskStatus

from riverbed.errors import ConfigError
from riverbed.workers.metrics import CONTENT_TYPE, Observed, WorkerMetrics

__all__ = ["Health", "Served", "serve"]

log = structlog.get_logger("riverbed.http")

MAX_REQUEST_BYTES = 8192
READ_TIMEOUT = 5.0
TICK_SECONDS = 1.0
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


class Served(Observed, Protocol):
    """A worker as the endpoints see it."""

    @property
    def ready(self) -> bool: ...


class Health:
    """Liveness and readiness evidence, stamped with :func:`time.monotonic`."""

    def __init__(self, *, stale_after: float = 10.0) -> None:
        self.stale_after = stale_after
        self.loop_beat = time.monotonic()
        self.redis_ok_at: float | None = None
        self.redis_error: str | None = "no Redis round trip yet"

    def alive(self) -> bool:
        return time.monotonic() - self.loop_beat < self.stale_after

    def redis_recent(self, worker: Served) -> bool:
        stamps = [s for s in (self.redis_ok_at, _worker_heartbeat(worker)) if s is not None]
        return bool(stamps) and time.monotonic() - max(stamps) < self.stale_after

    def readiness(self, worker: Served) -> tuple[bool, dict[str, object]]:
        owners = {role: bool(owner.ready) for role, owner in worker.owners.items()}
        reasons: list[str] = [f"{role} owner is not ready" for role, ok in owners.items() if not ok]
        for role, owner in worker.owners.items():
            reasons.extend(failure.reason(role, loop) for loop, failure in owner.failures.current().items())
        if bool(getattr(worker, "stopping", False)):
            reasons.append("draining")
        if not self.redis_recent(worker):
            reasons.append(f"Redis not reached recently ({self.redis_error or 'stale'})")
        ready = worker.ready and not reasons
        return ready, {"ready": ready, "worker": worker.name, "owners": owners, "reasons": reasons}


async def serve(
    worker: Served,
    port: int,
    *,
    host: str = "0.0.0.0",  # noqa: S104  (in a container the probes and Prometheus come from outside)
    metrics: WorkerMetrics | None = None,
    refresh_seconds: float = 5.0,
    health: Health | None = None,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the endpoints on ``port`` (0: any free port) until cancelled.

    Also refreshes the backlog gauges every ``refresh_seconds``.  ``task_status`` reports the
    port actually bound.
    """
    server = _Server(
        worker,
        metrics or WorkerMetrics(),
        health or Health(stale_after=max(10.0, 3 * refresh_seconds)),
        refresh_seconds,
    )
    server.metrics.bind(worker)
    try:
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    except OSError as exc:
        raise ConfigError(
            f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}); "
            "set RIVERBED_METRICS_PORT to a free port, or 0 to turn the endpoints off"
        ) from exc
    async with listener, anyio.create_task_group() as tg:
        bound = int(listener.extra(SocketAttribute.local_port))  # noqa: S610  (anyio typed attribute, not Django)
        tg.start_soon(server.tick)
        tg.start_soon(server.refresh_loop)
        tg.start_soon(listener.serve, server.handle)
        log.info("http.listening", host=host, port=bound, worker=worker.name)
        task_status.started(bound)


class _Server:
    def __init__(self, worker: Served, metrics: WorkerMetrics, health: Health, refresh_seconds: float) -> None:
        self.worker = worker
        self.metrics = metrics
        self.health = health
        self.refresh_seconds = refresh_seconds

    async def tick(self) -> None:
        while True:
            self.health.loop_beat = time.monotonic()
            await anyio.sleep(TICK_SECONDS)

    async def refresh_loop(self) -> None:
        while True:
            try:
                await self.metrics.refresh(self.worker, timeout=max(1.0, self.refresh_seconds))
            except Exception as exc:  # a scrape helper must never take the worker down
                self.health.redis_error = str(exc) or type(exc).__name__
                log.warning("metrics.refresh_failed", worker=self.worker.name, error=self.health.redis_error)
            else:
                self.health.redis_ok_at = time.monotonic()
                self.health.redis_error = None
            await anyio.sleep(self.refresh_seconds)

    async def handle(self, stream: SocketStream) -> None:
        try:
            async with stream:
                head = b""
                with anyio.move_on_after(READ_TIMEOUT):
                    head = await _read_head(stream)
                if not head:
                    return
                status, content_type, body = self.respond(head)
                await stream.send(_response(status, content_type, body, head_only=head.startswith(b"HEAD ")))
        except Exception as exc:  # a broken connection must not disturb the worker
            log.debug("http.connection_failed", error=str(exc))

    def respond(self, head: bytes) -> tuple[int, str, bytes]:
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _json(400, {"error": "malformed request line"})
        method, target = parts[0], parts[1].split("?", 1)[0]
        if target not in ("/metrics", "/healthz", "/readyz"):
            return _json(404, {"error": f"no such path {target}; try /metrics, /healthz or /readyz"})
        if method not in ("GET", "HEAD"):
            return _json(405, {"error": f"{method} is not allowed; use GET"})
        if target == "/metrics":
            return 200, CONTENT_TYPE, self.metrics.render()
        if target == "/healthz":
            alive = self.health.alive()
            age = round(time.monotonic() - self.health.loop_beat, 3)
            return _json(200 if alive else 503, {"alive": alive, "loop_beat_age_seconds": age})
        ready, body = self.health.readiness(self.worker)
        return _json(200 if ready else 503, body)


async def _read_head(stream: SocketStream) -> bytes:
    """The request line and headers (the endpoints take no body)."""
    data = b""
    while b"\r\n\r\n" not in data and b"\n\n" not in data:
        if len(data) > MAX_REQUEST_BYTES:
            return b""
        try:
            chunk = await stream.receive(4096)
        except anyio.EndOfStream:
            break
        data += chunk
    return data


def _json(status: int, body: dict[str, object]) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(body, separators=(",", ":")).encode()


def _response(status: int, content_type: str, body: bytes, *, head_only: bool) -> bytes:
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Cache-Control: no-store\r\n"
        "Connection: close\r\n\r\n"
    ).encode("latin-1")
    return head if head_only else head + body


def _worker_heartbeat(worker: Served) -> float | None:
    """The worker's last successful Redis heartbeat (monotonic), when it records one."""
    stamp = getattr(worker, "last_heartbeat", None)
    return float(stamp) if isinstance(stamp, int | float) else None

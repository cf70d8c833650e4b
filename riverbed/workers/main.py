"""A worker process: one :class:`Owner` per role, a heartbeat, signals, graceful drain.

``riverbed worker runtime memory condenser agent`` (or ``all``) runs :func:`run_worker`.
SIGTERM or SIGINT stops intake, lets in-flight work finish within ``drain_seconds`` (at most
the lease: a worker under load exits within its lease and a few seconds), then cancels and
releases every session so peers take them over at once.

With ``RIVERBED_DATABASE_URL`` set every role reads archived events through the Postgres
archive, and with ``RIVERBED_RETENTION_SECONDS`` > 0 a memory worker also runs retention
(``bus/archive.py``) over the sessions it owns.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import structlog
from anyio.abc import TaskStatus

from riverbed.agent.registry import Hosted, publish_fields
from riverbed.agent.secrets import SecretStore, TenantSecrets
from riverbed.bus.connection import RawClient, connect_redis
from riverbed.bus.consumer import Handler, HotReads, Owner
from riverbed.bus.keys import AGENT_ROLE, ROLES, Keys
from riverbed.bus.redis_client import RedisClient
from riverbed.bus.wakeups import Wakeups
from riverbed.errors import ConfigError, UnavailableError
from riverbed.settings import Settings
from riverbed.workers.http import serve as serve_http
from riverbed.workers.metrics import WorkerMetrics

if TYPE_CHECKING:
    from riverbed.bus.archive import Archive, Retention

__all__ = ["Worker", "default_name", "parse_roles", "run_process", "run_worker"]

T = TypeVar("T")

log = structlog.get_logger("riverbed.worker")

HEARTBEAT_SECONDS = 1.0
#: Connections per Redis node on which a worker's busy sessions wait for their next entry.
HOT_READERS = 4


def default_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def parse_roles(names: Sequence[str], *, model_configured: bool = False) -> list[str]:
    """The roles named (``all``: runtime, memory and condenser, and agent when a model server is
    configured: ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``)."""
    every = (*ROLES, AGENT_ROLE) if model_configured else ROLES
    roles: list[str] = []
    for name in names:
        for raw in name.split(","):
            part = raw.strip().lower()
            if part == "all":
                roles.extend(r for r in every if r not in roles)
            elif part in (*ROLES, AGENT_ROLE):
                if part not in roles:
                    roles.append(part)
            elif part:
                raise ConfigError(f"unknown role {part!r}: use runtime, memory, condenser, agent or all")
    if not roles:
        raise ConfigError("name at least one role: runtime, memory, condenser, agent or all")
    if AGENT_ROLE in roles and not model_configured:
        raise ConfigError("the agent role needs a model server: set OPENAI_BASE_URL and/or OPENAI_API_KEY")
    return roles


class Worker:
    """Owners for several roles sharing one Redis client (``redis``: the role loops take it
    as it is; :attr:`client` wraps it for the worker's own calls)."""

    def __init__(
        self,
        redis: RawClient,
        settings: Settings,
        roles: Sequence[str],
        *,
        name: str,
        handlers: dict[str, Handler],
        url: str = "redis",
        park_after: float = 60.0,
        archive: Archive | None = None,
        hot: HotReads | None = None,
    ) -> None:
        self.client = RedisClient(redis, url)
        self.settings = settings
        self.keys = Keys(settings.prefix)
        self.name = name
        self.roles = list(roles)
        self.started = time.time()
        self.wakeups = Wakeups(redis, self.keys)
        """One subscribed connection per Redis node wakes every role's session loops."""
        self.secrets = (
            TenantSecrets(SecretStore(self.client, self.keys, settings.secrets_key)) if settings.secrets_key else None
        )
        """The tenants' secrets: masked in everything every role appends, and handed to the
        sandboxes and Python tools of the runs that name them (none without a key)."""
        for handler in handlers.values():
            if hasattr(handler, "secrets"):
                setattr(handler, "secrets", self.secrets)  # noqa: B010  (a role's handler that uses them)
            if hasattr(handler, "wakeups"):
                setattr(handler, "wakeups", self.wakeups)  # noqa: B010  (the agent role's model calls in flight)
        self.owners = {
            role: Owner(
                redis,
                self.keys,
                handlers[role],
                worker=name,
                capacity=settings.concurrency,
                tenant_share=settings.tenant_share,
                lease_seconds=settings.lease_seconds,
                park_after=park_after,
                max_attempts=settings.max_attempts,
                url=url,
                wakeups=self.wakeups,
                hot=hot,
                masks=self.secrets,
            )
            for role in self.roles
        }
        for owner in self.owners.values():
            owner.log.archive = archive
        self.retention: Retention | None = None
        if archive is not None and settings.retention_seconds > 0 and "memory" in self.owners:
            from riverbed.bus.archive import Retention  # noqa: PLC0415  (asyncpg only with a database)

            self.retention = Retention(
                self.client,
                self.keys,
                archive,
                older_than_seconds=settings.retention_seconds,
                keep_last=settings.retention_keep_last,
            )
        self.metrics = WorkerMetrics()
        self.last_heartbeat: float | None = None  # monotonic time of the last heartbeat Redis took
        self._stop = anyio.Event()

    @property
    def ready(self) -> bool:
        return all(o.ready for o in self.owners.values())

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            if self.settings.metrics_port:
                # first, so /healthz answers (and /readyz says why not) while the owners start
                await tg.start(partial(serve_http, self, self.settings.metrics_port, metrics=self.metrics))
            await tg.start(self.wakeups.run)
            for owner in self.owners.values():
                background = getattr(owner.handler, "background", None)
                if background is not None:
                    await tg.start(background)
                await tg.start(owner.run)
            tg.start_soon(self._heartbeat)
            if self.retention is not None:
                await tg.start(self.retention.run, self.name)
            log.info("worker.ready", worker=self.name, roles=self.roles, sandbox=self._sandbox(), bwrap=self._bwrap())
            task_status.started()
            await self._stop.wait()
            deadline = min(self.settings.drain_seconds, self.settings.lease_seconds)
            log.info("worker.draining", worker=self.name, deadline=deadline)
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as drain:
                    for owner in self.owners.values():
                        drain.start_soon(owner.drain, deadline)
                await self._deregister()
            tg.cancel_scope.cancel()
        log.info("worker.stopped", worker=self.name)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "roles": self.roles,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": self.started,
            "owned": {role: sorted(o.owned) for role, o in self.owners.items()},
            "sandbox": self._sandbox(),
            "bwrap": self._bwrap(),
            "agents": [f"{a['name']}@{a['digest']}" for a in hosted.describe()] if (hosted := self._hosted()) else [],
            "stats": {
                role: {
                    "handled": o.stats.handled,
                    "redeliveries": o.stats.redeliveries,
                    "dead_letters": o.stats.dead_letters,
                    "takeovers": o.stats.takeovers,
                }
                for role, o in self.owners.items()
            },
            # Role loops failing right now, for `riverbed status` (a loop that keeps failing).
            "failing": {role: o.failures.as_json() for role, o in self.owners.items() if o.failures.current()},
        }

    def _sandbox(self) -> str | None:
        """``mode/network`` of the runtime role's sandboxes (``riverbed status`` shows it)."""
        sandbox = self._runtime_sandbox()
        return f"{sandbox.mode}/{sandbox.network}" if sandbox is not None else None

    def _bwrap(self) -> str | None:
        """The bubblewrap binary of the runtime role's sandboxes: version, origin and path."""
        sandbox = self._runtime_sandbox()
        if sandbox is None or not sandbox.confined:
            return None
        binary = sandbox.binary()
        return f"{binary.describe()} {binary.path}"

    def _hosted(self) -> Hosted | None:
        owner = self.owners.get(AGENT_ROLE)
        hosted = getattr(owner.handler, "hosted", None) if owner is not None else None
        return hosted if isinstance(hosted, Hosted) else None

    def _runtime_sandbox(self) -> Any:
        owner = self.owners.get("runtime")
        runtime = getattr(owner.handler, "runtime", None) if owner is not None else None
        return runtime.sandbox if runtime is not None else None

    async def _heartbeat(self) -> None:
        while True:
            try:
                async with self.client.pipeline() as pipe:
                    pipe.zadd(self.keys.workers, {self.name: time.time()})
                    pipe.set(self.keys.worker(self.name), json.dumps(self.describe()), ex=30)
                    hosted = self._hosted()
                    if hosted is not None:  # (the agent definitions it hosts: `riverbed agents`)
                        pipe.hset(self.keys.agents, mapping=publish_fields(hosted, self.name))
                    await pipe.execute()
                self.last_heartbeat = time.monotonic()
            except UnavailableError as exc:
                log.warning("heartbeat.unavailable", error=str(exc))
            await anyio.sleep(HEARTBEAT_SECONDS)

    async def _deregister(self) -> None:
        try:
            async with self.client.pipeline() as pipe:
                pipe.zrem(self.keys.workers, self.name)
                pipe.delete(self.keys.worker(self.name))
                await pipe.execute()
        except UnavailableError:
            pass


def build_handlers(roles: Sequence[str], settings: Settings) -> tuple[dict[str, Handler], list[Callable[[], Any]]]:
    """Concrete handlers for ``roles`` (only the adapters a role needs are loaded)."""
    handlers: dict[str, Handler] = {}
    closers: list[Callable[[], Any]] = []
    if "runtime" in roles:
        from riverbed.runtime import Runtime  # noqa: PLC0415
        from riverbed.workers.runtime_role import RuntimeHandler, checked_cgroups, checked_sandbox  # noqa: PLC0415

        sandbox, cgroups = checked_sandbox(settings), checked_cgroups(settings)
        runtime = Runtime(
            workspace_root=Path(settings.workspace),
            sandbox=sandbox,
            cgroups=cgroups,
            mcp_mounts=[path for path in settings.mcp_mounts.split(":") if path],
        )
        handlers["runtime"] = RuntimeHandler(runtime)
        closers.append(runtime.aclose)
    if "memory" in roles:
        from riverbed.workers.memory_role import build_memory_handler  # noqa: PLC0415

        handler, close = build_memory_handler(settings)
        handlers["memory"] = handler
        closers.append(close)
    if "condenser" in roles:
        from riverbed.workers.condenser_role import build_condenser_handler  # noqa: PLC0415

        handlers["condenser"] = build_condenser_handler(settings)
    if AGENT_ROLE in roles:
        from riverbed.workers.agent_role import build_agent_handler  # noqa: PLC0415

        agent = build_agent_handler(settings)
        handlers[AGENT_ROLE] = agent
        closers.append(agent.aclose)
    return handlers, closers


def run_process(fn: Callable[[], Awaitable[T]]) -> T:
    """Run a long-lived process's ``fn`` (a worker, ``riverbed serve``) under anyio, on uvloop
    where it is installed: its socket writes and callbacks cost less than the standard loop's
    (a worker's round trip p50 drops by about a fifth here)."""
    options: dict[str, Any] = {}
    with contextlib.suppress(ImportError):
        import uvloop  # noqa: F401, PLC0415

        options["use_uvloop"] = True
    return anyio.run(fn, backend_options=options)


#: Allocations of tracked objects between two young collections (CPython's default: 700).  A
#: step allocates thousands; each young collection in the middle of one moves what the step still
#: holds to an older generation, where it dies later and counts towards the next full collection.
YOUNG_COLLECTION_EVERY = 10_000


def tune_collector() -> None:
    """Set the cyclic garbage collector for a long-lived worker, once it started.

    What the process built to start (its modules, settings and handlers: over 100,000 objects)
    is collected once, then frozen (``gc.freeze``): left out of every later collection, where a
    full collection walks every tracked object, and one runs each time the objects that outlived
    the younger ones grow by a quarter.  A worker whose sessions' folds grow its heap walked the
    startup heap again at each (0.1 s a time on a 2-core machine: about half the CPU of taking
    a 2,000-event session, ``python -m bench agents --context 20,2000``).  Reference counting still
    frees what of it is let go; only a reference cycle made before this call stays."""
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_EVERY, middle, oldest)


async def run_worker(
    roles: Sequence[str],
    settings: Settings,
    *,
    name: str | None = None,
    park_after: float = 60.0,
    on_ready: Callable[[Worker], None] | None = None,
) -> None:
    """Run a worker process until SIGTERM/SIGINT; then drain and release."""
    from riverbed.client.session import resolve_redis_url  # noqa: PLC0415

    url = resolve_redis_url(settings)
    name = name or default_name()
    redis = await connect_redis(url, max_connections=settings.redis_connections, shared=True, name=f"riverbed:{name}")
    hot = await connect_redis(url, max_connections=HOT_READERS, shared=True, name=f"riverbed:{name}", spare=0)
    handlers, closers = build_handlers(roles, settings)
    archive: Archive | None = None
    if settings.database_url:
        from riverbed.bus.archive import Archive  # noqa: PLC0415  (asyncpg only with a database)

        archive = Archive(settings.database_url, schema=settings.prefix)
    if archive is not None:
        closers.append(archive.close)
    worker = Worker(
        redis,
        settings,
        roles,
        name=name,
        handlers=handlers,
        url=url,
        park_after=park_after,
        archive=archive,
        hot=HotReads(RedisClient(hot, url), anyio.CapacityLimiter(HOT_READERS)),
    )
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)  # also starts each handler's background task (the sandbox watchdog)
            tune_collector()
            if on_ready is not None:
                on_ready(worker)
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _sig in signals:
                    worker.stop()
                    break
    finally:
        with anyio.CancelScope(shield=True):
            for close in closers:
                await close()
            await redis.aclose()
            await hot.aclose()

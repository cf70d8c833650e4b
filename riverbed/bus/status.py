"""The status read model: backlogs, owners and workers read straight from Redis, for ``riverbed
status``, ``riverbed sessions``, ``GET /v1/status`` and the worker's metrics.

Everything here is a read; nothing is created or changed.  The numbers per role and session:

==========================  ===================================================================
number                      from
==========================  ===================================================================
lag                         meta ``last`` minus the id of the role's group ``last-delivered-id``
                            on the session log (event ids are ``<n>-0``); no group yet: ``last``
pending                     ``XPENDING`` summary of the role's group (delivered, not acknowledged)
oldest pending age          idle time of the first pending entry (``XPENDING - + 1``)
owner                       meta ``holder:<role>`` while ``expires:<role>`` is after Redis ``TIME``
directory lag / pending     the role's directory stream: sessions waiting for an owner / held
dead letters                ``XLEN`` of the dead-letter stream
live workers                the worker registry, heartbeat newer than a window
failing loops               each live worker's published record of role loops failing right now
==========================  ===================================================================

Only commands that Redis 6.2 has are used: the ``lag`` field of ``XINFO GROUPS`` (7.0+) is
ignored, and the directory lag is counted with an exclusive ``XRANGE`` after the group's
last-delivered id.  Per-session reads are pipelined in chunks, so a status over thousands
of sessions is a handful of round trips.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.exceptions as rexc

from riverbed.bus.keys import AGENT_ROLE, ON_DEMAND, ROLES, Keys
from riverbed.bus.redis_client import GroupInfo, PendingEntry, PendingSummary, RawClient, RedisClient, Reply, as_client

__all__ = [
    "DirectoryBacklog",
    "LoopFailure",
    "RoleBacklog",
    "SessionBacklog",
    "SessionMeta",
    "Status",
    "WorkerInfo",
    "dead_letter_count",
    "directory_backlog",
    "failing_loops",
    "list_sessions",
    "live_workers",
    "redis_time",
    "role_backlog",
    "session_backlogs",
    "session_metas",
    "status",
]

T = TypeVar("T")

CHUNK = 200
DIRECTORY_SCAN_LIMIT = 100_000
_MS_SCORES = 1e11  # heartbeat scores above this are milliseconds, below it seconds


@dataclass(frozen=True)
class SessionBacklog:
    """How far one role is behind on one session."""

    session: str
    role: str
    last: int
    delivered: int
    lag: int
    pending: int
    oldest_pending_seconds: float
    holder: str | None
    lease_seconds_left: float

    @property
    def owned(self) -> bool:
        return self.holder is not None


@dataclass(frozen=True)
class DirectoryBacklog:
    """A role's directory stream: ``lag`` sessions wait for an owner, ``pending`` are held."""

    role: str
    length: int
    lag: int
    pending: int
    consumers: int


@dataclass(frozen=True)
class RoleBacklog:
    role: str
    directory: DirectoryBacklog
    sessions: tuple[SessionBacklog, ...]

    @property
    def lag(self) -> int:
        return sum(s.lag for s in self.sessions)

    @property
    def pending(self) -> int:
        return sum(s.pending for s in self.sessions)

    @property
    def oldest_pending_seconds(self) -> float:
        return max((s.oldest_pending_seconds for s in self.sessions), default=0.0)


@dataclass(frozen=True)
class WorkerInfo:
    name: str
    heartbeat: float
    age_seconds: float
    description: dict[str, Any]


@dataclass(frozen=True)
class LoopFailure:
    """A worker's role loop that keeps failing: its last error, since when, how many rounds."""

    worker: str
    role: str
    loop: str
    error: str
    since: float
    attempts: int


@dataclass(frozen=True)
class Status:
    roles: tuple[RoleBacklog, ...]
    workers: tuple[WorkerInfo, ...]
    dead_letters: int
    sessions: int
    failing: tuple[LoopFailure, ...] = ()


async def redis_time(redis: RedisClient | RawClient, url: str = "redis") -> float:
    """The server's clock in seconds (leases are measured against it, not ours)."""
    return await as_client(redis, url).time()


@dataclass(frozen=True)
class SessionMeta:
    """A session's metadata hash: its last id, tenant (None: none recorded there) and
    creation time (ms since the epoch)."""

    session: str
    last: int
    tenant: str | None
    created_ms: int | None


async def session_metas(
    redis: RedisClient | RawClient, keys: Keys, names: Sequence[str], *, url: str = "redis"
) -> list[SessionMeta]:
    """The metadata of each of ``names``, in order (one pipelined read per :data:`CHUNK`); a
    session that does not exist has ``last`` 0."""
    client = as_client(redis, url)
    out: list[SessionMeta] = []
    for begin in range(0, len(names), CHUNK):
        part = list(names[begin : begin + CHUNK])
        async with client.pipeline() as pipe:
            rows = [pipe.hmget(keys.meta(name), ["last", "tenant", "created"]) for name in part]
            await pipe.execute()
        for name, row in zip(part, rows, strict=True):
            last, tenant, created = row.value
            out.append(
                SessionMeta(
                    session=name,
                    last=int(last or 0),
                    tenant=_text(tenant) if tenant else None,
                    created_ms=int(created) if created else None,
                )
            )
    return out


async def list_sessions(
    redis: RedisClient | RawClient, keys: Keys, *, limit: int | None = None, url: str = "redis"
) -> list[str]:
    """Every session, oldest first (``ZRANGE keys.sessions``)."""
    end = -1 if limit is None else max(limit, 1) - 1
    names = await as_client(redis, url).zrange(keys.sessions, 0, end)
    return [_text(n) for n in names]


async def session_backlogs(
    redis: RedisClient | RawClient,
    keys: Keys,
    role: str,
    sessions: Iterable[str],
    *,
    now: float | None = None,
    url: str = "redis",
) -> list[SessionBacklog]:
    """Lag, pending, oldest pending age and owner of ``role`` on each of ``sessions``."""
    names = list(sessions)
    if not names:
        return []
    client = as_client(redis, url)
    if now is None:
        now = await client.time()
    out: list[SessionBacklog] = []
    for start in range(0, len(names), CHUNK):
        chunk = names[start : start + CHUNK]
        async with client.pipeline() as pipe:
            queued = [
                (
                    session,
                    pipe.hmget(keys.meta(session), ["last", f"holder:{role}", f"expires:{role}", f"need:{role}"]),
                    pipe.xinfo_groups(keys.log(session)),
                    pipe.xpending(keys.log(session), role),
                    pipe.xpending_range(keys.log(session), role, count=1),
                )
                for session in chunk
            ]
            await pipe.execute(raise_on_error=False)
        for session, meta, groups, summary, first in queued:
            out.append(
                _session_backlog(
                    session,
                    role,
                    _unless_missing(meta),
                    _unless_missing(groups),
                    _unless_missing(summary),
                    _unless_missing(first),
                    now,
                )
            )
    return out


def _session_backlog(
    session: str,
    role: str,
    meta: list[bytes | None] | None,
    groups: list[GroupInfo] | None,
    summary: PendingSummary | None,
    first: list[PendingEntry] | None,
    now: float,
) -> SessionBacklog:
    """One session's replies (None: its key or group is missing): HMGET meta, XINFO GROUPS,
    XPENDING summary, first pending entry."""
    last_raw, holder_raw, expires_raw, need_raw = meta if meta is not None else (None, None, None, None)
    last = int(last_raw) if last_raw is not None else 0
    delivered = 0
    for group in groups or ():
        if _text(group.get("name", b"")) == role:
            delivered = _event_id(group.get("last-delivered-id", b"0-0"))
            break
    else:
        if role in ON_DEMAND and need_raw is None:
            delivered = last  # never asked for here: nothing waits for the role
    pending = int(summary.get("pending", 0)) if summary is not None else 0
    oldest = 0.0
    if first:
        oldest = int(first[0].get("time_since_delivered", 0)) / 1000
    holder = _text(holder_raw) if holder_raw else ""
    expires_ms = float(expires_raw) if expires_raw else 0.0
    left = expires_ms / 1000 - now
    live = bool(holder) and left > 0
    return SessionBacklog(
        session=session,
        role=role,
        last=last,
        delivered=delivered,
        lag=max(0, last - delivered),
        pending=pending,
        oldest_pending_seconds=oldest,
        holder=holder if live else None,
        lease_seconds_left=left if live else 0.0,
    )


def _unless_missing(reply: Reply[T]) -> T | None:
    """The reply, None where its key or group is missing (it reads as zero); any other server
    error is a real error."""
    error = reply.error
    if isinstance(error, rexc.ResponseError) and ("NOGROUP" in str(error) or "no such key" in str(error).lower()):
        return None
    return reply.value


async def directory_backlog(
    redis: RedisClient | RawClient, keys: Keys, role: str, *, url: str = "redis"
) -> DirectoryBacklog:
    """Sessions waiting for an owner of ``role`` (lag) and sessions held (pending): the
    directory's, and those of the tenants' set-aside streams (``bus/lease_loops.py``)."""
    client = as_client(redis, url)
    main = await _stream_backlog(client, role, keys.directory(role))
    for tenant in sorted(await client.smembers(keys.waiting_tenants(role))):
        aside = await _stream_backlog(client, role, keys.waiting(role, tenant))
        main = DirectoryBacklog(
            role=role,
            length=main.length + aside.length,
            lag=main.lag + aside.lag,
            pending=main.pending + aside.pending,
            consumers=max(main.consumers, aside.consumers),
        )
    return main


async def _stream_backlog(client: RedisClient, role: str, key: str) -> DirectoryBacklog:
    """One directory stream's backlog."""
    length = await client.xlen(key)
    if length == 0:
        return DirectoryBacklog(role=role, length=0, lag=0, pending=0, consumers=0)
    try:
        groups = await client.xinfo_groups(key)
    except rexc.ResponseError as exc:
        if "no such key" not in str(exc).lower():
            raise
        groups = []
    group = next((g for g in groups if _text(g.get("name", b"")) == role), None)
    if group is None:
        return DirectoryBacklog(role=role, length=length, lag=length, pending=0, consumers=0)
    after = _text(group.get("last-delivered-id", b"0-0"))
    waiting = await client.xrange(key, min=f"({after}", max="+", count=DIRECTORY_SCAN_LIMIT)
    return DirectoryBacklog(
        role=role,
        length=length,
        lag=len(waiting),
        pending=int(group.get("pending", 0)),
        consumers=int(group.get("consumers", 0)),
    )


async def dead_letter_count(redis: RedisClient | RawClient, keys: Keys, *, url: str = "redis") -> int:
    return await as_client(redis, url).xlen(keys.dlq)


async def live_workers(
    redis: RedisClient | RawClient, keys: Keys, *, window: float = 10.0, now: float | None = None, url: str = "redis"
) -> list[WorkerInfo]:
    """Workers whose heartbeat is newer than ``window`` seconds, with their self-description."""
    client = as_client(redis, url)
    if now is None:
        now = await client.time()
    scored = await client.zrange_scores(keys.workers)
    beats = {_text(name): _seconds(score) for name, score in scored}
    alive = sorted(name for name, beat in beats.items() if now - beat <= window)
    if not alive:
        return []
    async with client.pipeline() as pipe:
        blobs = [pipe.get(keys.worker(name)) for name in alive]
        await pipe.execute(raise_on_error=False)
    return [
        WorkerInfo(
            name=name,
            heartbeat=beats[name],
            age_seconds=max(0.0, now - beats[name]),
            description=_json(blob.value) if blob.error is None else {},
        )
        for name, blob in zip(alive, blobs, strict=True)
    ]


async def role_backlog(
    redis: RedisClient | RawClient,
    keys: Keys,
    role: str,
    sessions: Sequence[str],
    *,
    now: float | None = None,
    url: str = "redis",
) -> RoleBacklog:
    client = as_client(redis, url)
    return RoleBacklog(
        role=role,
        directory=await directory_backlog(client, keys, role),
        sessions=tuple(await session_backlogs(client, keys, role, sessions, now=now)),
    )


async def status(
    redis: RedisClient | RawClient,
    keys: Keys,
    *,
    roles: Sequence[str] | None = None,
    worker_window: float = 10.0,
    url: str = "redis",
) -> Status:
    """Everything ``riverbed status`` shows, in one snapshot (``roles`` None: runtime, memory,
    condenser, and agent when a live worker runs it)."""
    client = as_client(redis, url)
    now = await client.time()
    sessions = await list_sessions(client, keys)
    workers = tuple(await live_workers(client, keys, window=worker_window, now=now))
    if roles is None:
        agents = any(AGENT_ROLE in w.description.get("roles", []) for w in workers)
        roles = (*ROLES, AGENT_ROLE) if agents else ROLES
    backlogs = [await role_backlog(client, keys, role, sessions, now=now) for role in roles]
    return Status(
        roles=tuple(backlogs),
        workers=workers,
        dead_letters=await dead_letter_count(client, keys),
        sessions=len(sessions),
        failing=tuple(failing_loops(workers)),
    )


def failing_loops(workers: Iterable[WorkerInfo]) -> list[LoopFailure]:
    """The role loops that the workers' last heartbeats say keep failing."""
    out: list[LoopFailure] = []
    for worker in workers:
        by_role = worker.description.get("failing")
        if not isinstance(by_role, dict):
            continue
        for role, loops in sorted(by_role.items()):
            if not isinstance(loops, dict):
                continue
            for loop, record in sorted(loops.items()):
                if not isinstance(record, dict):
                    continue
                out.append(
                    LoopFailure(
                        worker=worker.name,
                        role=str(role),
                        loop=str(loop),
                        error=str(record.get("error", "")),
                        since=float(record.get("since", 0.0)),
                        attempts=int(record.get("attempts", 0)),
                    )
                )
    return out


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _event_id(raw: bytes | str) -> int:
    return int(_text(raw).split("-", 1)[0])


def _seconds(score: float) -> float:
    return score / 1000 if score > _MS_SCORES else score


def _json(blob: bytes | None) -> dict[str, Any]:
    if blob is None:
        return {}
    try:
        value = json.loads(blob)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}

"""Session metadata as the HTTP API needs it: a session's tenant, and the session list.

A row of the list also says where the session stands (:func:`status`) and what it was asked
(:func:`task_line`), both read from the log: its last :data:`TAIL` events and the run summary
the agent role keeps (``Keys.run``) give the status, its first :data:`HEAD` events the task.
Reading only the two ends keeps a page of the list cheap however long the logs are.

A session's tenant is fixed by its first append: the meta hash's ``tenant`` (written by the
append script when the log is created), else the ``tenant`` of event 1 (a session created by
a handle without a tenant but with tenant-stamped events).  It never changes while the log
exists, but a log can be deleted and created again under the same id, so :class:`Tenants`
reads it on every request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from cachetools import LRUCache

from riverbed import events
from riverbed.agent.runs import END_REASONS, RunSummary, saved_summary
from riverbed.bus import status as bus_status
from riverbed.bus.keys import PAYLOAD_FIELD, ROLES
from riverbed.bus.log import decode_entry, entry_id
from riverbed.client.session import Bus

__all__ = [
    "STATUSES",
    "SessionInfo",
    "SessionPage",
    "Tenants",
    "index_older_sessions",
    "page_sessions",
    "session_infos",
    "session_names",
    "status",
    "task_line",
]

CHUNK = 500
TAIL = 50
"""The newest events of a session read for its status."""
HEAD = 20
"""The first events of a session read for its task."""
TASK_CHARS = 200
"""The most characters of a task's first line a row shows."""

STATUSES = ("running", "finished", "step limit", "budget exhausted", "cancelled", "error", "open")
"""Where a session stands: a run open or ended (and how), or ``open``: no run and no end."""

_ENDED = {"step_limit": "step limit", "budget_exhausted": "budget exhausted", "cancelled": "cancelled"}


@dataclass(frozen=True)
class SessionInfo:
    """One row of the session list."""

    session: str
    tenant: str | None
    last: int
    created_ms: int | None
    last_ts: str | None = None
    roles: dict[str, dict[str, object]] = field(default_factory=dict)
    status: str | None = None
    """None: not read (the whole list, which reads one event per session)"""
    task: str | None = None

    def as_dict(self) -> dict[str, object]:
        row: dict[str, object] = {
            "session": self.session,
            "tenant": self.tenant,
            "last": self.last,
            "created_ms": self.created_ms,
            "last_ts": self.last_ts,
            "roles": self.roles,
        }
        if self.status is not None:
            row.update(status=self.status, task=self.task)
        return row


def status(tail: Sequence[events.Event], run: RunSummary | None = None) -> str:
    """Where a session stands, from its newest events (in id order) and the run summary the
    agent role saved: the newest of a ``finish``, an ``error`` that ends a run (from the
    agent), a ``run_started`` or a user's ``message`` decides; with none of them in ``tail``,
    the summary; with no summary, ``open``."""
    for event in reversed(tail):
        if isinstance(event, events.Finish):
            return "finished"
        if isinstance(event, events.Error) and event.source == "agent" and event.reason in END_REASONS:
            return _ENDED.get(event.reason, "error")
        if isinstance(event, events.RunStarted):
            return "running"
        if isinstance(event, events.Message) and event.source == "user":
            return "open"
    if run is None:
        return "open"
    if run.state == "failed":
        return _ENDED.get(run.reason or "", "error")
    return run.state


def task_line(head: Sequence[events.Event]) -> str | None:
    """The first line of the session's first user message (its task), shortened."""
    for event in head:
        if isinstance(event, events.Message) and event.source == "user":
            line = next((text for text in (ln.strip() for ln in event.content.splitlines()) if text), "")
            return line if len(line) <= TASK_CHARS else line[: TASK_CHARS - 1] + "\u2026"
    return None


class Tenants:
    """The tenant of each session, read from its meta hash on every request.

    The meta hash is read each time (one ``HMGET``), never remembered: a log that was deleted
    and created again (a Redis wipe, a new session under an old id) has a new tenant, and a
    remembered one would let its old tenant's key read it.  Only the fallback for logs whose
    meta hash names no tenant (event 1's) is remembered, keyed by the log's creation stamp.
    """

    def __init__(self, bus: Bus, *, size: int = 100_000) -> None:
        self.bus = bus
        self._first: LRUCache[tuple[str, bytes | None], str | None] = LRUCache(maxsize=size)

    async def of(self, session: str) -> tuple[bool, str | None]:
        """(whether the session exists, its tenant)."""
        bus = self.bus
        last, tenant, created = await bus.client.hmget(bus.keys.meta(session), ["last", "tenant", "created"])
        if not last or int(last) == 0:
            return False, None
        if tenant:
            return True, tenant.decode()
        stamp = (session, created)
        if stamp not in self._first:
            self._first[stamp] = await _first_event_tenant(bus, session)
        return True, self._first[stamp]


async def session_names(bus: Bus, tenant: str | None, *, admin: bool) -> list[str]:
    """The ids a key may list, oldest first: every session for an admin key, else its tenant's
    index only (``Keys.tenant_sessions``), so a tenant with few sessions reads few, however
    many other tenants have."""
    if admin:
        return await bus_status.list_sessions(bus.client, bus.keys)
    if tenant is None:
        return []
    return [name.decode() for name in await bus.client.zrange(bus.keys.tenant_sessions(tenant))]


async def index_older_sessions(bus: Bus) -> int:
    """Add the sessions created before the tenant indexes existed to their tenant's index, once
    per prefix (``Keys.tenant_index`` marks it done; running it twice adds nothing); how many
    sessions it read."""
    if await bus.client.hget(bus.keys.tenant_index, "done") is not None:
        return 0
    scores = {name.decode(): score for name, score in await bus.client.zrange_scores(bus.keys.sessions)}
    names = list(scores)
    for begin in range(0, len(names), CHUNK):
        metas = await bus_status.session_metas(bus.client, bus.keys, names[begin : begin + CHUNK])
        async with bus.client.pipeline() as pipe:
            for meta in metas:
                tenant = meta.tenant if meta.tenant is not None else await _first_event_tenant(bus, meta.session)
                if meta.last and tenant:
                    pipe.zadd(bus.keys.tenant_sessions(tenant), {meta.session: scores[meta.session]}, nx=True)
            await pipe.execute()
    await bus.client.hset(bus.keys.tenant_index, "done", len(names))
    return len(names)


async def _first_event_tenant(bus: Bus, session: str) -> str | None:
    async for event in bus.log_store.read(session, 1, 1):
        return event.tenant
    return None


async def session_infos(
    bus: Bus,
    names: Sequence[str],
    *,
    visible: Callable[[str | None], bool] = lambda _tenant: True,
    roles: Sequence[str] = ROLES,
    describe: bool = False,
) -> list[SessionInfo]:
    """The sessions among ``names`` whose tenant is ``visible``: tenant, last id, creation
    time, time of the last event, status and task (``describe``) and, per role, owner, lag
    and pending."""
    out: list[SessionInfo] = []
    for begin in range(0, len(names), CHUNK):
        part = list(names[begin : begin + CHUNK])
        rows: list[tuple[str, str | None, int, int | None]] = []
        for meta in await bus_status.session_metas(bus.client, bus.keys, part):
            if not meta.last:
                continue
            owner = meta.tenant if meta.tenant is not None else await _first_event_tenant(bus, meta.session)
            if visible(owner):
                rows.append((meta.session, owner, meta.last, meta.created_ms))
        if not rows:
            continue
        shown = [row[0] for row in rows]
        tails_count = TAIL if describe else 1
        async with bus.client.pipeline() as pipe:
            newest = [pipe.xrevrange(bus.keys.log(name), count=tails_count) for name in shown]
            heads = [pipe.xrange(bus.keys.log(name), count=HEAD) for name in shown] if describe else []
            saved = [pipe.get(bus.keys.run(name)) for name in shown] if describe else []
            await pipe.execute()
        backlogs = {role: await bus_status.session_backlogs(bus.client, bus.keys, role, shown) for role in roles}
        for i, (name, tenant, last, created) in enumerate(rows):
            tail = _decoded(newest[i].value)[::-1]
            info = SessionInfo(
                session=name,
                tenant=tenant,
                last=last,
                created_ms=created,
                last_ts=tail[-1].ts.isoformat() if tail else None,
                roles={role: {"owner": backlogs[role][i].holder, "lag": backlogs[role][i].lag} for role in roles},
            )
            if describe:
                info = replace(
                    info, status=status(tail, saved_summary(saved[i].value)), task=task_line(_decoded(heads[i].value))
                )
            out.append(info)
    return out


def _decoded(entries: Sequence[tuple[bytes, dict[bytes, bytes]]] | None) -> list[events.Event]:
    return [decode_entry(fields.get(PAYLOAD_FIELD, b""), entry_id(raw_id)) for raw_id, fields in entries or ()]


@dataclass(frozen=True)
class SessionPage:
    """One page of the session list, newest first."""

    sessions: list[SessionInfo]
    offset: int
    next_offset: int | None
    """the offset of the next page (None: this is the last)"""
    total: int | None
    """how many sessions match (None with a status filter: only the pages read are known)"""


async def page_sessions(
    bus: Bus,
    names: Sequence[str],
    *,
    visible: Callable[[str | None], bool],
    search: str = "",
    wanted: str | None = None,
    offset: int = 0,
    limit: int = 50,
) -> SessionPage:
    """The sessions among ``names`` (oldest first, as the indexes hold them) whose id contains
    ``search`` (case-insensitive) and whose status is ``wanted``, newest first, ``limit`` from
    ``offset``.  Without a status filter only the page's sessions are read; with one, pages are
    read newest first until ``limit`` matches past ``offset`` are found."""
    needle = search.casefold()
    newest = [name for name in reversed(names) if needle in name.casefold()]
    if wanted is None:
        infos = await session_infos(bus, newest[offset : offset + limit], visible=visible, describe=True)
        more = offset + limit < len(newest)
        return SessionPage(infos, offset, offset + limit if more else None, len(newest))
    matched: list[SessionInfo] = []
    read = 0
    while read < len(newest) and len(matched) <= offset + limit:
        part = newest[read : read + CHUNK]
        read += len(part)
        described = await session_infos(bus, part, visible=visible, describe=True)
        matched.extend(info for info in described if info.status == wanted)
    more = len(matched) > offset + limit
    total = None if more or read < len(newest) else len(matched)
    return SessionPage(matched[offset : offset + limit], offset, offset + limit if more else None, total)

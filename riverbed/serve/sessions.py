"""Session metadata as the HTTP API needs it: a session's tenant, and the session list.

A session's tenant is fixed by its first append: the meta hash's ``tenant`` (written by the
append script when the log is created), else the ``tenant`` of event 1 (a session created by
a handle without a tenant but with tenant-stamped events).  It never changes while the log
exists, but a log can be deleted and created again under the same id, so :class:`Tenants`
reads it on every request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cachetools import LRUCache

from riverbed.agent.client import Bus
from riverbed.bus import stats
from riverbed.bus.keys import PAYLOAD_FIELD, ROLES
from riverbed.bus.log import decode_entry, entry_id

__all__ = ["SessionInfo", "Tenants", "index_older_sessions", "session_infos", "session_names"]

CHUNK = 500


@dataclass(frozen=True)
class SessionInfo:
    """One row of the session list."""

    session: str
    tenant: str | None
    last: int
    created_ms: int | None
    last_ts: str | None = None
    roles: dict[str, dict[str, object]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {
            "session": self.session,
            "tenant": self.tenant,
            "last": self.last,
            "created_ms": self.created_ms,
            "last_ts": self.last_ts,
            "roles": self.roles,
        }


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
        return await stats.list_sessions(bus.client, bus.keys)
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
        metas = await stats.session_metas(bus.client, bus.keys, names[begin : begin + CHUNK])
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
) -> list[SessionInfo]:
    """The sessions among ``names`` whose tenant is ``visible``: tenant, last id, creation
    time, time of the last event and, per role, owner, lag and pending."""
    out: list[SessionInfo] = []
    for begin in range(0, len(names), CHUNK):
        part = list(names[begin : begin + CHUNK])
        rows: list[tuple[str, str | None, int, int | None]] = []
        for meta in await stats.session_metas(bus.client, bus.keys, part):
            if not meta.last:
                continue
            owner = meta.tenant if meta.tenant is not None else await _first_event_tenant(bus, meta.session)
            if visible(owner):
                rows.append((meta.session, owner, meta.last, meta.created_ms))
        if not rows:
            continue
        shown = [row[0] for row in rows]
        async with bus.client.pipeline() as pipe:
            newest = [pipe.xrevrange(bus.keys.log(name), count=1) for name in shown]
            await pipe.execute()
        backlogs = {role: await stats.session_backlogs(bus.client, bus.keys, role, shown) for role in roles}
        for i, (name, tenant, last, created) in enumerate(rows):
            last_ts = None
            if entries := newest[i].value:
                raw_id, fields = entries[0]
                last_ts = decode_entry(fields.get(PAYLOAD_FIELD, b""), entry_id(raw_id)).ts.isoformat()
            out.append(
                SessionInfo(
                    session=name,
                    tenant=tenant,
                    last=last,
                    created_ms=created,
                    last_ts=last_ts,
                    roles={role: {"owner": backlogs[role][i].holder, "lag": backlogs[role][i].lag} for role in roles},
                )
            )
    return out

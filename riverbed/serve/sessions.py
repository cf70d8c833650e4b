"""Session metadata as the HTTP API needs it: a session's tenant, and the session list.

A session's tenant is fixed by its first append: the meta hash's ``tenant`` (written by the
append script when the log is created), else the ``tenant`` of event 1 (a session created by
a handle without a tenant but with tenant-stamped events).  Because it never changes once the
log exists, :class:`Tenants` remembers it per session and answers later requests without a
round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cachetools import LRUCache

from riverbed.agent.client import Bus
from riverbed.bus import stats
from riverbed.bus.keys import PAYLOAD_FIELD, ROLES
from riverbed.bus.log import decode_entry, entry_id

__all__ = ["SessionInfo", "Tenants", "session_infos"]

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
    """The tenant of each session, read once per session (``None``: a tenant-less session)."""

    def __init__(self, bus: Bus, *, size: int = 100_000) -> None:
        self.bus = bus
        self._known: LRUCache[str, str | None] = LRUCache(maxsize=size)

    async def of(self, session: str) -> tuple[bool, str | None]:
        """(whether the session exists, its tenant)."""
        if session in self._known:
            return True, self._known[session]
        bus = self.bus
        last, tenant = await bus.client.hmget(bus.keys.meta(session), ["last", "tenant"])
        if not last or int(last) == 0:
            return False, None
        value = tenant.decode() if tenant else await _first_event_tenant(bus, session)
        self._known[session] = value
        return True, value

    def remember(self, session: str, tenant: str | None) -> None:
        """A session this process just created with ``tenant``."""
        self._known[session] = tenant


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

"""Leases taken by hand on new sessions, for the ownership tests."""

from __future__ import annotations

from riverbed import events
from riverbed.bus.leases import Leases
from riverbed.client.session import Bus

ROLE = "memory"
"""(A role every append announces: the runtime role is announced only for its actions.)"""


async def acquired(bus: Bus, names: list[str], lease_ms: int) -> tuple[Leases, dict[str, tuple[str, int]]]:
    """The memory role's leases of worker "w" on new sessions ``names``, and what it owns
    (session -> (entry, token)), as :meth:`Leases.renew` takes it."""
    for name in names:
        await bus.session(name).append(events.Think(thought="x"))
    leases = Leases(bus.redis, bus.keys, ROLE, worker="w", lease_ms=lease_ms, url=bus.url)
    await leases.ensure_group()
    owned: dict[str, tuple[str, int]] = {}
    for claim in await leases.read_new(20, 100):
        owned[claim.session] = (claim.entry, (await leases.acquire(claim)).token)
    assert sorted(owned) == sorted(names)
    return leases, owned


async def expiries(bus: Bus, names: list[str]) -> list[int]:
    """When the memory role's lease of each of ``names`` runs out (ms)."""
    return [int(await bus.redis.hget(bus.keys.meta(name), f"expires:{ROLE}")) for name in names]

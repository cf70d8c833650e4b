"""SIGTERM under load: a real worker process holding many sessions, each with a command in
flight, drains within its lease + 5 s, exits 0, and its sessions are handed over (a peer answers
them at once, without waiting for the leases to expire)."""

from __future__ import annotations

import time

import anyio
import pytest

from riverbed import events
from riverbed.bus.keys import Keys
from riverbed.client.session import Bus
from tests.kit.workers import Spawn, ready, spawn, workers  # noqa: F401  (spawn, workers: fixtures)

pytestmark = pytest.mark.anyio

SESSIONS = 40
LEASE = 2.0


async def holders(bus: Bus, keys: Keys, sessions: list[str]) -> list[str | None]:
    async with bus.client.pipeline() as pipe:
        replies = [pipe.hget(keys.meta(s), "holder:runtime") for s in sessions]
        await pipe.execute()
    return [None if r.value is None else r.value.decode() for r in replies]


@pytest.mark.fault
@pytest.mark.timeout(120)
async def test_sigterm_drains_a_worker_holding_many_sessions_within_its_lease_and_hands_them_over(
    bus: Bus, spawn: Spawn
) -> None:
    # Its commands never end by themselves, and its drain would wait 30 s for them: the lease bounds it.
    busy = spawn("busy", ["runtime"], lease=LEASE, RIVERBED_SANDBOX="process", RIVERBED_DRAIN_SECONDS="30")
    await ready(busy)
    sessions = [f"load-{n}" for n in range(SESSIONS)]
    for session in sessions:
        await bus.session(session).append(events.CmdRun(command="sleep 60", blocking=True, timeout=120))
    with anyio.fail_after(60):  # every session held by the busy worker, its command running
        while await holders(bus, bus.keys, sessions) != ["busy"] * SESSIONS:
            await anyio.sleep(0.1)
    peer = spawn("peer", ["runtime"], lease=LEASE, RIVERBED_SANDBOX="process")
    await ready(peer)
    asked = time.monotonic()
    code = await anyio.to_thread.run_sync(busy.terminate)
    took = time.monotonic() - asked
    assert code == 0, busy.log_path.read_text()[-3000:]
    assert took <= LEASE + 5, f"the worker took {took:.1f}s to drain"
    # Handed over: released before the worker exited (no lease of it left to run out) ...
    assert "busy" not in await holders(bus, bus.keys, sessions)
    # ... and the peer answers each session.
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for session in sessions:
                tg.start_soon(answered_by_peer, bus, session)
    assert set(await holders(bus, bus.keys, sessions)) == {"peer"}


async def answered_by_peer(bus: Bus, session: str) -> None:
    out = await bus.session(session).act(events.CmdRun(command="echo after"), timeout=20)
    assert isinstance(out, events.CmdOutput | events.Error), out

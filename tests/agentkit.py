"""In-process role workers for agent tests: a real Owner per role on the test's prefix."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import anyio

from riverbed import events
from riverbed.agent.client import Bus, Session
from riverbed.bus.consumer import Handler, Owner
from riverbed.errors import AlreadyAnswered
from riverbed.runtime import Runtime
from riverbed.workers.runtime_role import RuntimeHandler


@contextlib.asynccontextmanager
async def owners(bus: Bus, handlers: list[Handler], *, name: str = "w1") -> AsyncIterator[list[Owner]]:
    """Run an Owner for each handler until the block ends, then drain them."""
    started = [Owner(bus.redis, bus.keys, h, worker=f"{name}-{h.role}", url=bus.url, lease_seconds=5) for h in handlers]
    async with anyio.create_task_group() as tg:
        for owner in started:
            await tg.start(owner.run)
        try:
            yield started
        finally:
            with anyio.CancelScope(shield=True):
                for owner in started:
                    await owner.drain(2)


@contextlib.asynccontextmanager
async def runtime_worker(bus: Bus, workspace: Path, *, name: str = "w1") -> AsyncIterator[Runtime]:
    """A runtime role owner executing in ``workspace`` (one directory per session below it)."""
    runtime = Runtime(workspace_root=workspace)
    try:
        async with owners(bus, [RuntimeHandler(runtime)], name=name):
            yield runtime
    finally:
        with anyio.CancelScope(shield=True):
            await runtime.aclose()


async def record(session: Session, *batch: events.Event) -> list[int]:
    """Append ``batch`` as riverbed itself writes it (a role's observations, a condenser's
    condensation), stamped like the handle's own appends: through the log, since a handle
    acting for a tenant takes only what clients may append (``events.check_client``)."""
    result = await session.bus.log_store.append(session.id, [session.stamp(e) for e in batch], tenant=session.tenant)
    if isinstance(result, AlreadyAnswered):
        raise result
    return result

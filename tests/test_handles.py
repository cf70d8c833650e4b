"""A role's handler driven through a SessionContext made from the owner's handles alone.

No Owner runs here: the test takes the lease, reads the session's log and hands the batch to
the runtime role's handler itself, which is all a handler needs (``bus/handles.py``).
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from riverbed import events
from riverbed.bus.handles import Handles, Owned, OwnerState
from riverbed.bus.handling import Entry, SessionContext
from riverbed.bus.leases import Acquired, Claim
from riverbed.bus.wakeups import Wakeups
from riverbed.client.session import Bus, Session
from riverbed.errors import FencedError
from riverbed.runtime import Runtime
from riverbed.workers.runtime_role import RuntimeHandler

pytestmark = pytest.mark.anyio


async def test_the_runtime_handler_answers_through_a_context_made_from_handles(
    standalone_bus: Bus, workspace: Path
) -> None:
    bus = standalone_bus
    handles = Handles.open(bus.redis, bus.keys, "runtime", worker="bench-1", wakeups=Wakeups(bus.redis, bus.keys))
    await handles.leases.ensure_group()
    session = bus.session("s1")
    [action_id] = await session.append(events.CmdRun(command="echo from-the-handles"))

    # The lease, as the owner's intake takes it.
    with anyio.fail_after(10):
        claims = []
        while not claims:
            claims = await handles.leases.read_new(10, block_ms=200)
    got = await handles.leases.acquire(claims[0])
    assert got.token > 0
    ctx = SessionContext(handles, claims[0].session, got.token, got.meta, ignores_own_answers=True)

    # The batch, as the session loop reads it.
    key = handles.keys.log(ctx.session)
    await handles.client.xgroup_create(key, handles.role, "0-0")
    batch = [
        Entry.from_stream(raw, fields)
        for raw, fields in await handles.client.xreadgroup(handles.role, handles.worker, key, ">", count=100)
    ]
    assert [e.id for e in batch] == [action_id]

    runtime = Runtime(workspace_root=workspace)
    handler = RuntimeHandler(runtime)
    try:
        await handler.open(ctx)
        held = await handler.handle(ctx, batch)
        if held is not None:  # the answer the session loop would send with its next read
            await ctx.answer(*held)
        await handler.close(ctx)
    finally:
        await runtime.aclose()

    answers = [e async for e in handles.log.read(ctx.session) if isinstance(e, events.CmdOutput)]
    assert len(answers) == 1
    assert answers[0].cause == action_id
    assert "from-the-handles" in answers[0].content
    assert ctx.tenant is None
    assert not await handles.client.xpending_range(key, handles.role, min="-", max="+", count=10)

    # A context whose lease another worker took is fenced: its answer does not land.
    other = Handles.open(bus.redis, bus.keys, "runtime", worker="bench-2", wakeups=handles.wakeups)
    stale = SessionContext(other, ctx.session, got.token - 1)
    with pytest.raises(FencedError):
        await stale.append([events.Error(content="late", reason="test", retryable=False, source="system")])


async def test_append_events_returns_what_the_log_holds_and_nothing_on_a_repeat(standalone_bus: Bus) -> None:
    bus = standalone_bus
    handles = Handles.open(bus.redis, bus.keys, "memory", worker="w-1", wakeups=Wakeups(bus.redis, bus.keys))
    session = bus.session("s-events")
    _claim, got = await _task_taken(handles, session)
    ctx = SessionContext(handles, session.id, got.token, got.meta)
    note = events.Message(content="a note", source="agent")

    written = await ctx.append_events([note], idempotency_key="note-1")
    logged = [e async for e in handles.log.read(session.id)]
    assert [e.id for e in written] == [2]
    assert written == logged[1:]
    # A repeat under the same key appends nothing and returns nothing (the log holds the first try's).
    assert await ctx.append_events([note], idempotency_key="note-1") == []
    assert [e.id async for e in handles.log.read(session.id)] == [1, 2]


async def _task_taken(handles: Handles, session: Session) -> tuple[Claim, Acquired]:
    """A user's task appended to ``session``, and the session's lease taken as an owner's intake takes it."""
    await handles.leases.ensure_group()
    await session.append(events.Message(content="task", source="user"))
    with anyio.fail_after(10):
        claims: list[Claim] = []
        while not claims:
            claims = await handles.leases.read_new(10, block_ms=200)
    return claims[0], await handles.leases.acquire(claims[0])


async def test_an_owners_count_by_tenant_holds_only_the_tenants_it_holds_now() -> None:
    """Sessions of a thousand tenants owned and let go leave no count behind (an intake round
    copies the count: it must not grow with every tenant ever held), and a session owned again
    under a new lease counts once."""
    state = OwnerState()
    leases = [Owned(entry="e", token=1, scope=anyio.CancelScope(), meta=(f"t{i}", "c")) for i in range(1000)]
    for i, owned in enumerate(leases):
        state.own(f"s{i}", owned)
    again = Owned(entry="e", token=2, scope=anyio.CancelScope(), meta=("t0", "c"))
    state.own("s0", again)
    assert len(state.tenants) == 1000
    assert state.tenants["t0"] == 1
    state.disown("s0", leases[0])  # (a stale lease's end lets nothing go)
    assert state.tenants["t0"] == 1
    state.disown("s0", again)
    for i, owned in enumerate(leases[1:], start=1):
        state.disown(f"s{i}", owned)
    assert state.tenants == {}
    assert state.owned == {}

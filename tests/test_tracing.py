"""W3C trace context: actions carry their publisher's trace; answers continue it."""

from __future__ import annotations

from pathlib import Path

import pytest

from riverbed import events, tracing
from riverbed.client.session import Bus
from tests.kit.agents import runtime_worker

pytestmark = pytest.mark.anyio


def test_traceparent_helpers() -> None:
    root = tracing.new_trace()
    child = tracing.child_of(root)
    assert child is not None
    assert tracing.trace_id(child) == tracing.trace_id(root)
    assert child != root
    assert tracing.child_of("not a traceparent") is None
    assert tracing.trace_id(None) is None


async def test_one_trace_runs_from_the_agent_through_the_worker(bus: Bus, workspace: Path) -> None:
    session = bus.session("traced", agent="a1")
    async with runtime_worker(bus, workspace):
        first = await session.act(events.CmdRun(command="true"), timeout=20)
        second = await session.act(events.FileRead(path="missing.txt"), timeout=20)
    log = await session.events()
    actions = [e for e in log if isinstance(e, events.Action)]
    assert len({tracing.trace_id(a.trace) for a in actions}) == 1  # one handle, one trace
    for answer in (first, second):
        action = next(a for a in actions if a.id == answer.cause)
        assert tracing.trace_id(answer.trace) == tracing.trace_id(action.trace)
        assert answer.trace != action.trace  # a span of its own
    explicit = tracing.new_trace()
    (kept,) = await session.append(events.Think(thought="x", trace=explicit))
    assert (await session.events(kept, kept))[0].trace == explicit

"""The model's shared limits (``riverbed/agent/throttle.py``): calls in flight and calls a minute
per model, through Redis, fair among tenants, with leases; then real agent workers under them:
two worker processes with a limit of one never have two calls at the model server at once, and a
tenant flooding the model does not starve another tenant's run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from riverbed import events
from riverbed.agent.hosted import RunLimits, follow_run, open_run
from riverbed.agent.retry import Saturated
from riverbed.agent.throttle import Throttle
from riverbed.client.session import Bus
from tests.kit.agent_role import (
    ended,
    roles,
    server,  # noqa: F401  (fixtures)
)
from tests.kit.openai_server import OpenAIServer
from tests.kit.workers import Spawn, ready, spawn, workers  # noqa: F401  (fixtures)

pytestmark = pytest.mark.anyio

MODEL = "m-1"


async def take(throttle: Throttle, tenant: str, ticket: str) -> str | None:
    """One try for a permit, kept as a call in flight keeps it: None when granted, else why not."""
    return await take_model(throttle, MODEL, ticket, tenant)


async def take_model(throttle: Throttle, model: str, ticket: str, tenant: str = "") -> str | None:
    granted, _, why = await throttle.try_take(model, tenant, ticket)
    return None if granted else why


async def test_calls_in_flight_are_bounded_and_a_dead_holders_permit_comes_back(bus: Bus) -> None:
    throttle = Throttle(bus.client, bus.keys, max_in_flight=1, lease=0.5)
    assert await take(throttle, "a", "w1:s1") is None
    assert await take(throttle, "a", "w2:s2") == "concurrency"
    with pytest.raises(Saturated, match="RIVERBED_LLM_MAX_CONCURRENCY"):
        async with throttle.permit(MODEL, "a", "w2:s2"):
            pass
    # The holder dies (it never gives the permit back nor renews it): its lease ends, the permit comes back.
    died = time.monotonic()
    with anyio.fail_after(5):
        while await take(throttle, "a", "w2:s2") is not None:
            await anyio.sleep(0.05)
    assert time.monotonic() - died >= 0.3
    # A holder that renews keeps it; one that gives it back frees it at once.
    assert await throttle.renew(MODEL, "w2:s2")
    assert not await throttle.renew(MODEL, "w1:s1")  # (lost with its lease)
    await throttle.leave(MODEL, "w2:s2")
    assert await take(throttle, "b", "w3:s3") is None


async def test_calls_a_minute_are_bounded(bus: Bus) -> None:
    throttle = Throttle(bus.client, bus.keys, per_minute=2)
    for ticket in ("t1", "t2"):
        async with throttle.permit(MODEL, None, ticket):
            pass
    with pytest.raises(Saturated, match="RIVERBED_LLM_RPM") as refused:
        async with throttle.permit(MODEL, None, "t3"):
            pass
    assert 55 <= refused.value.wait <= 60  # until the first call of the minute leaves the window


async def test_a_pause_holds_every_caller(bus: Bus) -> None:
    throttle = Throttle(bus.client, bus.keys, max_in_flight=5)
    await throttle.pause(MODEL, 1.0)
    with pytest.raises(Saturated, match="Retry-After") as paused:
        async with throttle.permit(MODEL, "a", "t1"):
            pass
    assert 0.5 < paused.value.wait <= 1.0


async def test_tenants_take_turns(bus: Bus) -> None:
    throttle = Throttle(bus.client, bus.keys, max_in_flight=1)
    assert await take(throttle, "x", "holder") is None
    flood = [f"a{i}" for i in range(5)]
    for ticket in flood:  # tenant a waits with five calls, then tenant b with one
        assert await take(throttle, "a", ticket) == "concurrency"
    assert await take(throttle, "b", "b1") == "concurrency"
    holder, granted = "holder", []
    for _ in range(3):
        await throttle.leave(MODEL, holder)
        # Everyone asks again, tenant a's calls first each time: the permit still goes by turns.
        for ticket in [t for t in [*flood, "b1"] if t not in granted]:
            if await take(throttle, "b" if ticket == "b1" else "a", ticket) is None:
                holder = ticket
                granted.append(ticket)
                break
    assert granted == ["a0", "b1", "a1"]  # b's one call is served right after a's first


def finishing(delay: float) -> Any:
    def answer(_request: dict[str, Any]) -> dict[str, Any]:
        return {"content": "done", "delay": delay}

    return answer


async def test_two_workers_with_a_limit_of_one_never_call_the_model_twice_at_once(
    bus: Bus, spawn: Spawn, server: OpenAIServer
) -> None:
    server.respond(finishing(0.3), times=8)
    env = {
        "OPENAI_BASE_URL": server.base_url,
        "OPENAI_API_KEY": "test-key",
        "RIVERBED_LLM_MODEL": "test-model",
        "RIVERBED_LLM_MAX_CONCURRENCY": "1",
        "RIVERBED_AGENT_LLM_RETRY_SECONDS": "30",
        "RIVERBED_AGENT_PACE": "0",
        "RIVERBED_CONCURRENCY": "4",  # (each worker takes at most 4 of the 8 runs: both serve some)
    }
    started = [spawn(f"w-limit-{i}", ["agent"], **env) for i in range(2)]
    await ready(*started)
    sessions = [f"s-limit-{i}" for i in range(8)]
    for session in sessions:
        await open_run(bus, session, f"task for {session}", limits=RunLimits(max_steps=2))
    with anyio.fail_after(60):
        for session in sessions:
            async for event in follow_run(bus, session, 1):
                last = event
            assert isinstance(last, events.Finish), last
    assert len(server.requests) == 8
    assert server.most_in_flight == 1
    served = [worker.log_path.read_text().count('"event":"agent.opened"') for worker in started]
    assert sum(served) >= 8
    assert all(served), served  # (both workers served runs)


def working(delay: float, steps: int) -> Any:
    """Each run thinks ``steps`` times, then finishes; each answer takes ``delay`` seconds."""

    answered: dict[str, int] = {}

    def answer(request: dict[str, Any]) -> dict[str, Any]:
        task = next(str(m["content"]) for m in request["messages"] if m.get("role") == "user")
        done = answered[task] = answered.get(task, -1) + 1
        if done >= steps:
            return {"content": "done", "delay": delay}
        return {"tool_calls": [("think", {"thought": f"step {done}"})], "delay": delay}

    return answer


async def test_a_tenant_flooding_the_model_does_not_starve_another(
    bus: Bus, workspace: Path, server: OpenAIServer
) -> None:
    # Tenant "flood" keeps six runs of six steps each asking; a run's next step asks again the
    # moment its answer is in, so without turns the run that holds the permit keeps it.
    server.respond(working(0.1, 5), times=100)
    async with roles(bus, workspace, server, checked=True, retry_seconds=30, max_in_flight=1):
        flood = [f"s-flood-{i}" for i in range(6)]
        for session in flood:
            await open_run(bus, session, f"task for {session}", tenant="flood")
        counts = bus.keys.model_limit("test-model", "counts")
        with anyio.fail_after(10):  # until the flood's other five runs wait for their turn
            while int(await bus.client.raw.hget(counts, "flood") or 0) < 5:
                await anyio.sleep(0.02)
        before = len(server.requests)
        opened = await open_run(bus, "s-other", "task for s-other", tenant="other")
        seen = await ended(bus, "s-other", opened.opened)
        for session in flood:
            await ended(bus, session, 1)
    assert isinstance(seen[-1], events.Finish)
    other = next(i for i, r in enumerate(server.requests) if "task for s-other" in str(r["messages"]))
    # Served after at most one more of the flood's calls (whose turn may have come first), not
    # behind the steps of the flood's runs.
    assert other <= before + 2, (other, before)
    assert len(server.requests) == 7 * 6  # (every run made its six calls)
    assert server.most_in_flight == 1


async def test_a_run_that_waits_past_the_budget_ends_in_one_sentence(
    bus: Bus, workspace: Path, server: OpenAIServer
) -> None:
    held = Throttle(bus.client, bus.keys, max_in_flight=1, lease=30)
    assert await take_model(held, "test-model", "another worker's call") is None  # (it never gives it back)
    async with roles(bus, workspace, server, checked=True, retry_seconds=1.0, max_in_flight=1):
        opened = await open_run(bus, "s-starved", "try")
        seen = await ended(bus, "s-starved", opened.opened, timeout=10)
    end = seen[-1]
    assert isinstance(end, events.Error)
    assert end.reason == "llm_error"
    assert "waited for its turn past the retry budget" in end.content
    assert "RIVERBED_LLM_MAX_CONCURRENCY" in end.content
    assert server.requests == []

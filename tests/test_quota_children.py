"""A tenant's runs at once count its sub-agents' runs: a child that finds no free slot ends with
``budget_exhausted`` before any model call, and its parent reads that as the delegate's result
(real worker processes, the scripted model server of ``tests/test_delegate.py``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from riverbed import events
from riverbed.agent.hosted import RunLimits, open_run
from riverbed.agent.quotas import Quotas
from riverbed.agent.runs import child_session
from riverbed.client.session import Bus
from tests.kit.delegation import all_answered, model_env, ready, run_end, server, spawn, start, task_of, workers  # noqa: F401  (fixtures)
from tests.kit.openai_server import OpenAIServer
from tests.kit.workers import WorkerProcess

pytestmark = [pytest.mark.anyio]

__all__ = ["server", "start", "workers"]  # the fixtures this module shares


async def test_children_over_the_tenants_runs_at_once_are_refused(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer
) -> None:
    quotas = Quotas(bus.log_store)
    await quotas.set("acme", max_runs=1, tokens_per_day=None)
    runtime, agent = start("rt", ["runtime"]), start("a1", ["agent"])
    await ready(runtime, agent)
    await open_run(bus, "parent", "split q 2", limits=RunLimits(max_steps=5), tenant="acme")
    last = await run_end(bus, "parent")
    assert isinstance(last, events.Finish), last
    delegated = await all_answered(bus, "parent")
    assert len(delegated) == 2
    for action, (answer,) in delegated.items():
        assert isinstance(answer, events.DelegateResult), answer
        assert "quota of 1 at once" in answer.content
        child = await run_end(bus, child_session("parent", action))
        assert isinstance(child, events.Error)
        assert child.reason == "budget_exhausted"
    assert "quota of 1 at once" in last.final_thought  # the model read it
    assert not [r for r in server.requests if task_of(r).startswith("leaf")]  # no child called the model
    assert (await quotas.usage("acme")).running == 0  # every slot given back

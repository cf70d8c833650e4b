"""The agent role's Prometheus series after scripted runs: runs by state, model-call latency,
tokens and cost by tenant and model, and a run taken over from a worker that went away."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from riverbed import events
from riverbed.agent.hosted import RunLimits, open_run
from riverbed.agent.quotas import Quotas
from riverbed.client.session import Bus
from tests.kit.agent_role import ended, roles, scrape, server
from tests.kit.metrics import value
from tests.kit.openai_server import OpenAIServer

pytestmark = pytest.mark.anyio

__all__ = ["server"]  # the fixture this module shares

PRICES = '{"test-model": {"prompt": 1.0, "completion": 2.0}}'
USAGE = {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}


async def test_the_scrape_after_a_run_taken_over_mid_call(bus: Bus, workspace: Path, server: OpenAIServer) -> None:
    server.reply(tool_calls=[("think", {"thought": "first"})], usage=USAGE)
    server.reply(tool_calls=[("finish", {"final_thought": "late"})], usage=USAGE, delay=30)  # in flight at the stop
    server.reply(tool_calls=[("finish", {"final_thought": "done"})], usage=USAGE)
    async with roles(bus, workspace, server, prices=PRICES) as first:
        opened = await open_run(bus, "m1", "count me", limits=RunLimits(max_steps=5), tenant="acme")
        with anyio.fail_after(30):
            while len(server.requests) < 2:  # the second call is in flight
                await anyio.sleep(0.05)
        scraped = scrape(bus, first)
        assert value(scraped, "riverbed_agent_runs", state="running") == 1
        assert value(scraped, "riverbed_agent_runs", state="finished") == 0
        assert value(scraped, "riverbed_agent_tokens_total", tenant="acme", model="test-model", kind="prompt") == 100
        assert value(scraped, "riverbed_agent_model_latency_seconds_count", model="test-model") == 1
    async with roles(bus, workspace, server, prices=PRICES) as second:
        seen = await ended(bus, "m1", opened.opened)
        assert isinstance(seen[-1], events.Finish)
        with anyio.fail_after(10):  # (the handler folds its own append a moment after the log has it)
            while value(scraped := scrape(bus, second), "riverbed_agent_runs", state="finished") < 1:
                await anyio.sleep(0.05)
    assert value(scraped, "riverbed_agent_runs_taken_over_total") == 1
    assert value(scraped, "riverbed_agent_runs", state="running") == 0
    assert value(scraped, "riverbed_agent_runs", state="finished") == 1
    assert value(scraped, "riverbed_agent_runs", state="failed") == 0
    labels = {"tenant": "acme", "model": "test-model"}
    assert value(scraped, "riverbed_agent_tokens_total", kind="prompt", **labels) == 100
    assert value(scraped, "riverbed_agent_tokens_total", kind="completion", **labels) == 10
    assert value(scraped, "riverbed_agent_cost_usd_total", **labels) == pytest.approx((100 * 1.0 + 10 * 2.0) / 1e6)
    assert value(scraped, "riverbed_agent_model_latency_seconds_count", model="test-model") == 1
    assert value(scraped, "riverbed_agent_model_latency_seconds_bucket", model="test-model", le="+Inf") == 1
    assert value(scraped, "riverbed_agent_model_latency_seconds_sum", model="test-model") > 0


async def test_runs_by_state_count_what_this_worker_ended(bus: Bus, workspace: Path, server: OpenAIServer) -> None:
    server.reply(tool_calls=[("think", {"thought": "a"})], usage=USAGE)
    server.reply(tool_calls=[("think", {"thought": "b"})], usage=USAGE)
    async with roles(bus, workspace, server) as agent:
        one = await open_run(bus, "m2", "stop at one step", limits=RunLimits(max_steps=1))
        await ended(bus, "m2", one.opened)
        two = await open_run(bus, "m3", "stop at one step", limits=RunLimits(max_steps=1), tenant="globex")
        await ended(bus, "m3", two.opened)
        with anyio.fail_after(10):
            while value(scraped := scrape(bus, agent), "riverbed_agent_runs", state="failed") < 2:
                await anyio.sleep(0.05)
    assert value(scraped, "riverbed_agent_runs", state="failed") == 2
    assert value(scraped, "riverbed_agent_runs_ended_total", reason="step_limit") == 2
    assert value(scraped, "riverbed_agent_tokens_total", tenant="", kind="prompt") == 100
    assert value(scraped, "riverbed_agent_tokens_total", tenant="globex", kind="prompt") == 100
    assert ("riverbed_agent_cost_usd_total", frozenset({("worker", "w-agent")})) not in scraped  # no prices


async def test_a_tenant_naming_models_of_its_own_adds_no_series(
    bus: Bus, workspace: Path, server: OpenAIServer
) -> None:
    """A run's ``model`` is the client's choice; were it a label as it came, every run naming a
    new model would add series to every worker's scrape for as long as it lives.  Models the
    operator did not name (``RIVERBED_LLM_MODEL``, ``RIVERBED_PRICES``) are counted as ``other``."""
    for _ in range(3):
        server.reply(tool_calls=[("finish", {"final_thought": "done"})], usage=USAGE)
    # (the operator lets the tenant name them: `riverbed tenants set acme --models`)
    await Quotas(bus.log_store).set(
        "acme", max_runs=None, tokens_per_day=None, models=[f"made-up-{i}" for i in range(3)]
    )
    async with roles(bus, workspace, server, prices=PRICES) as agent:
        for i in range(3):
            opened = await open_run(bus, f"junk{i}", "go", limits=RunLimits(model=f"made-up-{i}"), tenant="acme")
            seen = await ended(bus, f"junk{i}", opened.opened)
            assert isinstance(seen[-1], events.Finish)
        scraped = scrape(bus, agent)
    models = {label for _name, labels in scraped for key, label in labels if key == "model"}
    assert models == {"other"}, models
    assert value(scraped, "riverbed_agent_model_latency_seconds_count", model="other") == 3
    assert value(scraped, "riverbed_agent_tokens_total", tenant="acme", model="other", kind="prompt") == 300

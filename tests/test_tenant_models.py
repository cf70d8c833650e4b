"""Tenants and models: a tenant's runs ask only for the models of its allow-list (by default the
deployment's model), refused when they open (CLI exit 2, HTTP 400) and by the agent role for a run
opened around that check; a cost limit on a model without a price is refused, not left
uncapped; and a tenant's daily tokens are overspent by at most one call, however many of its
runs call the model at once."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import httpx
import pytest

from riverbed import events
from riverbed.agent.hosted import RunLimits, open_run
from riverbed.agent.quotas import Quotas
from riverbed.client.session import Bus
from riverbed.errors import InputError
from tests.kit.agent_role import ended, roles, server
from tests.kit.cli import run as run_cli
from tests.kit.openai_server import OpenAIServer
from tests.kit.serve import assert_problem, bearer, new_key, running

pytestmark = pytest.mark.anyio

__all__ = ["server"]  # the fixture this module shares


def one_sentence(stderr: bytes) -> str:
    said = stderr.decode().strip()
    assert len(said.splitlines()) == 1, said
    assert "Traceback" not in said
    return said


@pytest.mark.security
async def test_a_tenants_models_are_an_allow_list_on_the_cli_and_the_api(bus: Bus, cli_env: dict[str, str]) -> None:
    env = {
        **cli_env,
        "RIVERBED_PREFIX": bus.keys.prefix,
        "RIVERBED_LLM_MODEL": "house-model",
        "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
    }
    # Without an allow-list: the deployment's model only.
    assert run_cli(env, "agent", "d1", "t", "--detach", "--tenant", "acme", "--model", "house-model").returncode == 0
    refused = run_cli(env, "agent", "d2", "t", "--detach", "--tenant", "acme", "--model", "gpt-huge")
    assert refused.returncode == 2
    assert "may use the model house-model, not 'gpt-huge'" in one_sentence(refused.stderr)
    assert await bus.session("d2").last_id() == 0

    assert run_cli(env, "tenants", "set", "acme", "--models", "m1, m2").returncode == 0
    shown = [json.loads(line) for line in run_cli(env, "tenants", "show", "acme", "--json").stdout.splitlines()]
    assert shown[0]["models"] == ["m1", "m2"]
    refused = run_cli(env, "agent", "d3", "t", "--detach", "--tenant", "acme", "--model", "m3")
    assert refused.returncode == 2
    assert "may use the models m1, m2, not 'm3'" in one_sentence(refused.stderr)
    assert run_cli(env, "agent", "d4", "t", "--detach", "--tenant", "acme", "--model", "m2").returncode == 0

    key = await new_key(bus, "acme")
    async with running(bus) as base, httpx.AsyncClient(base_url=base, headers=bearer(key)) as http:
        no = await http.post("/v1/sessions/h1/runs", json={"task": "t", "model": "m3"})
        assert_problem(no, 400, "may use the models m1, m2, not 'm3'")
        yes = await http.post("/v1/sessions/h2/runs", json={"task": "t", "model": "m1"})
        assert yes.status_code == 202, yes.text
    assert await bus.session("h1").last_id() == 0
    # Back to the default.
    assert run_cli(env, "tenants", "set", "acme", "--models", "").returncode == 0
    assert (await Quotas(bus.log_store).get("acme")).models is None


@pytest.mark.security
async def test_a_cost_limit_on_a_model_without_a_price_is_refused(bus: Bus, cli_env: dict[str, str]) -> None:
    env = {**cli_env, "RIVERBED_PREFIX": bus.keys.prefix, "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}
    refused = run_cli(env, "agent", "c1", "t", "--detach", "--max-cost", "1")
    assert refused.returncode == 2
    said = one_sentence(refused.stderr)
    assert "needs a price for the model 'gpt-4o-mini'" in said
    assert "RIVERBED_PRICES" in said
    priced = {**env, "RIVERBED_PRICES": '{"gpt-4o-mini": {"prompt": 0.15, "completion": 0.6}}'}
    assert run_cli(priced, "agent", "c1", "t", "--detach", "--max-cost", "1").returncode == 0
    with pytest.raises(InputError, match="needs a price for the model 'm9'"):
        await open_run(bus, "c2", "t", limits=RunLimits(model="m9", max_cost=1.0), prices={})


@pytest.mark.security
async def test_the_agent_role_refuses_a_run_opened_around_the_checks(
    bus: Bus, workspace: Path, server: OpenAIServer
) -> None:
    # Appended as plain events (as a client may), past the checks of opening a run.
    other_model = bus.session("sneak-model", tenant="acme")
    await other_model.append(events.Message(content="t", source="user"), events.RunStarted(model="gpt-huge"))
    uncapped = bus.session("sneak-cost", tenant="acme")
    await uncapped.append(events.Message(content="t", source="user"), events.RunStarted(model="m9", max_cost=0.5))
    server.reply(tool_calls=[("finish", {"final_thought": "should not run"})])
    async with roles(bus, workspace, server):
        refused_model = (await ended(bus, "sneak-model", 1))[-1]
        refused_cost = (await ended(bus, "sneak-cost", 1))[-1]
    assert isinstance(refused_model, events.Error)
    assert refused_model.source == "agent"
    assert "may use the model test-model, not 'gpt-huge'" in refused_model.content
    assert isinstance(refused_cost, events.Error)
    assert "needs a price for the model 'm9'" in refused_cost.content
    assert server.requests == []  # no model call was made for either


RUNS = 6
QUOTA = 1000
CALL = 400


@pytest.mark.security
async def test_a_tenants_daily_tokens_are_overspent_by_at_most_one_call_not_one_per_run(
    bus: Bus, workspace: Path, server: OpenAIServer
) -> None:
    quotas = Quotas(bus.log_store)
    await quotas.set("acme", max_runs=None, tokens_per_day=QUOTA)
    usage = {"prompt_tokens": CALL - 10, "completion_tokens": 10, "total_tokens": CALL}
    for _ in range(RUNS * 4):
        server.reply(tool_calls=[("think", {"thought": "spend"})], usage=usage, delay=0.3)
    async with roles(bus, workspace, server):
        sessions = [f"spend-{n}" for n in range(RUNS)]
        async with anyio.create_task_group() as tg:
            for session in sessions:
                tg.start_soon(
                    lambda s: open_run(bus, s, "spend", limits=RunLimits(max_steps=10), tenant="acme"), session
                )
        ends = [(await ended(bus, session, 1, timeout=60))[-1] for session in sessions]
    assert all(isinstance(e, events.Error) and e.reason == "budget_exhausted" for e in ends), ends
    spent = await quotas.tokens_today("acme")
    # Every run called the model as soon as it opened; the calls that went were the tenant's,
    # one at a time once they could no longer all fit: at most one call over the day's quota.
    assert QUOTA <= spent <= QUOTA + CALL, spent
    assert len(server.requests) * CALL == spent
    assert (await quotas.usage("acme")).running == 0
    assert await bus.redis.hlen(bus.keys.tenant_inflight("acme")) == 0  # every reservation settled

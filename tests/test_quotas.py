"""Per-tenant quotas: set by the operator, refused on the CLI (exit 2) and the API (429), held
across processes (the last slot goes to one of many racing opens), enforced by the agent role
(a run opened around the check, a run that spends the day's tokens), never raised by a tenant."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio
import httpx
import pytest

from riverbed import events
from riverbed.agent.hosted import RunLimits, cancel_run, open_run
from riverbed.agent.quotas import Quotas, seconds_to_midnight, today, today_and_before
from riverbed.client.session import Bus
from riverbed.errors import QuotaExceeded
from tests.kit.agent_role import ended, roles, server
from tests.kit.cli import run as run_cli
from tests.kit.cli import run_all
from tests.kit.openai_server import OpenAIServer
from tests.kit.serve import assert_problem, bearer, new_key, running

pytestmark = pytest.mark.anyio

__all__ = ["server"]  # the fixture this module shares


async def test_the_operator_sets_quotas_and_an_open_over_them_is_refused(bus: Bus, cli_env: dict[str, str]) -> None:
    env = {**cli_env, "RIVERBED_PREFIX": bus.keys.prefix, "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}
    result = run_cli(env, "tenants", "set", "acme", "--max-runs", "1", "--tokens-per-day", "500")
    assert result.returncode == 0, result.stderr.decode()
    assert b"at most 1 runs at once, 500 tokens a day" in result.stderr
    for bad, words in (
        (["tenants", "set", "acme"], b"--max-runs"),
        (["tenants", "set", "acme", "--max-runs", "-1"], b"from 0"),
    ):
        refused = run_cli(env, *bad)
        assert refused.returncode == 2, refused.stderr
        assert words in refused.stderr
        assert b"Traceback" not in refused.stderr
    shown = [json.loads(line) for line in run_cli(env, "tenants", "show", "--json").stdout.splitlines()]
    assert shown == [
        {"tenant": "acme", "max_runs": 1, "running": 0, "tokens_per_day": 500, "tokens_today": 0, "models": None}
    ]

    # one run at once: the CLI refuses the second with one sentence and exit 2, the API with 429
    first = run_cli(env, "agent", "a1", "first", "--detach", "--tenant", "acme")
    assert first.returncode == 0, first.stderr.decode()
    second = run_cli(env, "agent", "a2", "second", "--detach", "--tenant", "acme")
    assert second.returncode == 2
    said = second.stderr.decode().strip()
    assert "quota of 1 at once" in said
    assert len(said.splitlines()) == 1, said
    assert await bus.session("a2").last_id() == 0
    key = await new_key(bus, "acme")
    async with running(bus) as base, httpx.AsyncClient(base_url=base) as http:
        refused = await http.post("/v1/sessions/a3/runs", json={"task": "third"}, headers=bearer(key))
        body = assert_problem(refused, 429, "quota of 1 at once")
        assert "retry-after" not in refused.headers  # when a run ends is not known
        assert body["retryable"] is True
        # the run ends: its slot is free again (the log says it ended, so the slot is reclaimed)
        await cancel_run(bus, "a1")
        await bus.session("a1").append(
            events.Error(source="agent", reason="cancelled", content="cancelled", tenant="acme")
        )
        opened = await http.post("/v1/sessions/a3/runs", json={"task": "third"}, headers=bearer(key))
        assert opened.status_code == 202, opened.text

        # the day's tokens spent: refused until the next UTC day (Retry-After says when)
        await Quotas(bus.log_store).count_tokens("acme", "a3", 2, 600)
        await Quotas(bus.log_store).set("acme", max_runs=0, tokens_per_day=None)
        refused = await http.post("/v1/sessions/a4/runs", json={"task": "fourth"}, headers=bearer(key))
        assert_problem(refused, 429, "600 tokens today", "500 tokens a day")
        assert 0 < int(refused.headers["retry-after"]) <= seconds_to_midnight() + 1
    spent = run_cli(env, "agent", "a5", "fifth", "--detach", "--tenant", "acme")
    assert spent.returncode == 2
    assert b"tokens a day" in spent.stderr
    shown = [json.loads(line) for line in run_cli(env, "tenants", "show", "acme", "--json").stdout.splitlines()]
    assert shown == [
        {"tenant": "acme", "max_runs": None, "running": 1, "tokens_per_day": 500, "tokens_today": 600, "models": None}
    ]


def test_the_day_and_the_day_before_are_the_utc_calendar_s() -> None:
    """The day keys of the token counts: UTC days across month, year and leap-day ends (and the
    last second of a day, which belongs to it)."""
    for stamp in ["1970-01-01T00:00:00", "2024-02-28T23:59:59", "2024-02-29T00:00:00", "2024-03-01T00:00:00.5",
                  "2025-01-01T00:00:00", "2025-12-31T23:59:59.999", "2100-03-01T12:00:00"]:  # fmt: skip
        moment = datetime.fromisoformat(stamp).replace(tzinfo=UTC)
        now = moment.timestamp()
        assert today(now) == moment.strftime("%Y-%m-%d")
        before = moment - timedelta(days=1)
        assert today_and_before(now) == (moment.strftime("%Y-%m-%d"), before.strftime("%Y-%m-%d"))


async def test_a_token_report_counts_once(bus: Bus) -> None:
    quotas = Quotas(bus.log_store)
    assert await quotas.count_tokens("acme", "s", 2, 100) == 100
    assert await quotas.count_tokens("acme", "s", 2, 100) == 100  # a repeated report adds nothing
    assert await quotas.count_tokens("acme", "s", 2, 90) == 100  # nor an older one
    assert await quotas.count_tokens("acme", "s", 2, 150) == 150
    assert await quotas.count_tokens("acme", "t", 2, 10) == 160
    assert await quotas.tokens_today("acme") == 160
    assert await quotas.tokens_today("globex") == 0
    # The same report as a write sent along with others (the agent role's, with its next read).
    async with bus.client.pipeline() as pipe:
        for session, spent in (("s", 150), ("t", 30), ("t", 20)):
            pipe.command(*quotas.count_tokens_write("acme", session, 2, spent))
        await pipe.execute()
    assert await quotas.tokens_today("acme") == 180


async def test_the_last_slot_goes_to_exactly_one_of_racing_opens(bus: Bus, cli_env: dict[str, str]) -> None:
    quotas = Quotas(bus.log_store)
    await quotas.set("acme", max_runs=3, tokens_per_day=None)
    for session in ("held-1", "held-2"):
        await open_run(bus, session, "holds a slot", tenant="acme")
    outcomes: list[str] = []

    async def race(session: str) -> None:
        try:
            await open_run(bus, session, "wants the last slot", tenant="acme")
            outcomes.append(session)
        except QuotaExceeded:
            pass

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(race, f"racer-{i}")
    assert len(outcomes) == 1, outcomes
    assert (await quotas.usage("acme")).running == 3
    # across processes too: two CLI processes racing for one freed slot
    await quotas.set("acme", max_runs=4, tokens_per_day=None)
    env = {**cli_env, "RIVERBED_PREFIX": bus.keys.prefix, "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}
    jobs = [(env, ["agent", f"proc-{i}", "race", "--detach", "--tenant", "acme"]) for i in range(2)]
    codes = sorted(result.returncode for result in await anyio.to_thread.run_sync(run_all, jobs))
    assert codes == [0, 2]
    assert (await quotas.usage("acme")).running == 4


async def test_a_tenant_cannot_raise_its_quota_or_run_around_it(
    bus: Bus, workspace: Path, server: OpenAIServer
) -> None:
    quotas = Quotas(bus.log_store)
    await quotas.set("acme", max_runs=1, tokens_per_day=None)
    await open_run(bus, "busy", "holds the one slot", tenant="acme")
    key = await new_key(bus, "acme")
    async with running(bus) as base, httpx.AsyncClient(base_url=base) as http:
        for method, path, body in (
            ("POST", "/v1/tenants/acme", {"max_runs": 100}),
            ("PUT", "/v1/tenants/acme/quota", {"max_runs": 100}),
            ("POST", "/v1/quotas", {"tenant": "acme", "max_runs": 100}),
        ):
            answer = await http.request(method, path, json=body, headers=bearer(key))
            assert answer.status_code in (404, 405), answer.text
        # A run_started appended as a plain event skips the open's check: it is appended (the log
        # takes what a client may write), but the agent role takes the slot before any model call.
        sneaked = [{"kind": "message", "content": "sneak", "source": "user"}, {"kind": "run_started"}]
        appended = await http.post("/v1/sessions/sneak/events", json=sneaked, headers=bearer(key))
        assert appended.status_code == 201, appended.text
    assert await quotas.get("acme") == type(await quotas.get("acme"))(max_runs=1)
    server.reply(tool_calls=[("finish", {"final_thought": "should not run"})])
    async with roles(bus, workspace, server):
        seen = await ended(bus, "sneak", 1)
    last = seen[-1]
    assert isinstance(last, events.Error)
    assert (last.source, last.reason) == ("agent", "budget_exhausted")
    assert "quota of 1 at once" in last.content
    assert "sneak" not in json.dumps(server.requests)  # no model call was made for it (only for busy)


async def test_the_agent_role_stops_a_run_that_spends_the_days_tokens(
    bus: Bus, workspace: Path, server: OpenAIServer
) -> None:
    quotas = Quotas(bus.log_store)
    await quotas.set("acme", max_runs=5, tokens_per_day=1500)
    usage = {"prompt_tokens": 1000, "completion_tokens": 10, "total_tokens": 1010}
    for _ in range(4):
        server.reply(tool_calls=[("think", {"thought": "spend"})], usage=usage)
    async with roles(bus, workspace, server):
        opened = await open_run(bus, "spender", "spend", limits=RunLimits(max_steps=10), tenant="acme")
        seen = await ended(bus, "spender", opened.opened)
    last = seen[-1]
    assert isinstance(last, events.Error)
    assert last.reason == "budget_exhausted"
    assert "tenant 'acme' used 2020 tokens today" in last.content
    assert len(server.requests) == 2  # the second call went over the day's quota; no third
    usage_now = await quotas.usage("acme")
    assert (usage_now.running, usage_now.tokens_today) == (0, 2020)  # the slot was given back
    with pytest.raises(QuotaExceeded, match="tokens a day") as refused:
        await open_run(bus, "later", "more", tenant="acme")
    assert refused.value.retry_after is not None

"""Runs, quotas and sub-agents attacked by a hostile tenant through a real ``riverbed serve``
and real Redis: ids it may not choose, slots it may not free, runs it may not see."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import httpx
import pytest

from riverbed import events
from riverbed.agent.hosted import RunLimits, open_run
from riverbed.agent.quotas import Quotas
from riverbed.agent.runs import child_session
from riverbed.agent.usage import tokens
from riverbed.bus.status import dead_letter_count
from riverbed.client.session import Bus
from riverbed.errors import QuotaExceeded
from riverbed.serve import KeyStore
from tests.kit.delegation import all_answered, model_env, ready, run_end, server, spawn, start, workers  # noqa: F401  (fixtures)
from tests.kit.openai_server import OpenAIServer
from tests.kit.patience import within
from tests.kit.serve import assert_problem, bearer, new_key, running
from tests.kit.workers import WorkerProcess

pytestmark = pytest.mark.anyio

__all__ = ["server", "start", "workers"]  # the fixtures this module shares


async def test_a_client_cannot_take_the_id_of_a_sub_agent_before_the_agent_role_makes_it(bus: Bus) -> None:
    """A child's id is derived from its parent's and the ``delegate``'s id, so another tenant
    that knows a session's id could create the next children first, and every ``delegate`` of
    that session would be refused (the id is taken).  Such ids are the agent role's alone."""
    acme, globex = await new_key(bus, "acme"), await new_key(bus, "globex")
    async with running(bus) as base, httpx.AsyncClient(base_url=base, timeout=within(30)) as http:
        made = await http.post("/v1/sessions/work/events", json={"kind": "message", "content": "hi"},
                               headers=bearer(acme))  # fmt: skip
        assert made.status_code == 201, made.text
        squat = child_session("work", 5)
        long_parent = "p" * 125
        note = {"kind": "message", "content": "mine now"}
        for key in (globex, acme):
            for target in (squat, child_session(long_parent, 7), "work.sub0"):
                assert_problem(await http.post(f"/v1/sessions/{target}/events", json=note, headers=bearer(key)),
                               400, "sub-agent")  # fmt: skip
                assert_problem(await http.post(f"/v1/sessions/{target}/runs", json={"task": "x"}, headers=bearer(key)),
                               400, "sub-agent")  # fmt: skip
                act = {"kind": "cmd_run", "command": "true"}
                assert_problem(await http.post(f"/v1/sessions/{target}/act?timeout=1", json=act, headers=bearer(key)),
                               400, "sub-agent")  # fmt: skip
                assert await bus.session(target).last_id() == 0
        fork = {"at": 1, "into": squat}
        assert_problem(await http.post("/v1/sessions/work/fork", json=fork, headers=bearer(acme)), 400, "sub-agent")
        assert await bus.session(squat).last_id() == 0
        # ids that only look alike stay the clients'
        for fine in ("work.sub", "work.subx1", "work.sub1.notes", "sub5"):
            made = await http.post(f"/v1/sessions/{fine}/events", json=note, headers=bearer(globex))
            assert made.status_code == 201, made.text

        # a child the agent role made is its tenant's to use like any session
        header = events.Delegated(parent="work", parent_action=5, depth=1, tenant="acme")
        await bus.log_store.append(squat, [header, events.Message(content="task", tenant="acme")], tenant="acme")
        added = await http.post(f"/v1/sessions/{squat}/events", json=note, headers=bearer(acme))
        assert added.status_code == 201, added.text
        assert_problem(await http.post(f"/v1/sessions/{squat}/events", json=note, headers=bearer(globex)), 404)


async def test_a_tenants_tokens_today_count_each_model_call_once_across_a_tree_of_sub_agents(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer
) -> None:
    """A child's run reports its own tokens; the parent's run adds what its children spent to its
    own budget, and must not report them to the tenant's day a second time."""
    quotas = Quotas(bus.log_store)
    await quotas.set("acme", max_runs=None, tokens_per_day=10**9)
    runtime, agent = start("rt", ["runtime"]), start("a1", ["agent"])
    await ready(runtime, agent)
    await open_run(bus, "tree", "split t 2", limits=RunLimits(max_steps=5), tenant="acme")
    assert isinstance(await run_end(bus, "tree"), events.Finish)
    sessions = ["tree", *(child_session("tree", action) for action in await all_answered(bus, "tree"))]
    assert len(sessions) == 3
    spent = 0
    for session in sessions:
        for event in await bus.session(session).events():
            if isinstance(event, events.LlmResponse):
                prompt, _cached, completion = tokens(event.usage)
                spent += prompt + completion
    assert spent > 0
    with anyio.fail_after(within(10)):
        while await quotas.tokens_today("acme") < spent:  # (the last report follows the last append)
            await anyio.sleep(0.05)
    assert await quotas.tokens_today("acme") == spent


async def reads(bus: Bus) -> int:
    """How many reads of values and streams the Redis server has run so far."""
    stats = await bus.client.raw.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("get", "mget", "xrange", "xrevrange"))


async def test_a_tenants_run_list_reads_only_its_own_runs(bus: Bus) -> None:
    """``GET /v1/runs`` from a tenant's key costs Redis what that tenant's runs cost, however many
    runs other tenants opened (no reads of their summaries, no folds of their logs)."""
    acme, globex = await new_key(bus, "acme"), await new_key(bus, "globex")
    await open_run(bus, "mine", "a task", tenant="acme")
    with anyio.fail_after(within(60)):
        for i in range(300):
            await open_run(bus, f"theirs-{i}", "their task", tenant="globex")
    async with running(bus) as base, httpx.AsyncClient(base_url=base, timeout=within(30)) as http:
        await http.get("/v1/me", headers=bearer(acme))  # (the key's lookups cached alike)
        before = await reads(bus)
        listed = await http.get("/v1/runs", headers=bearer(acme))
        spent = await reads(bus) - before
        assert listed.status_code == 200, listed.text
        assert [r["session"] for r in listed.json()["runs"]] == ["mine"]
        assert spent < 30, spent
        pages = [(await http.get("/v1/runs?state=waiting&limit=200", headers=bearer(globex))).json()]
        assert len(pages[0]["runs"]) == 200  # (no agent worker holds them: waiting)
        cursor = pages[0]["next_cursor"]
        pages.append(
            (await http.get(f"/v1/runs?state=waiting&limit=200&cursor={cursor}", headers=bearer(globex))).json()
        )
        theirs = [r["session"] for page in pages for r in page["runs"]]
        assert len(theirs) == len(set(theirs)) == 300
        assert theirs[-1] == "theirs-0"  # newest first
        assert pages[1]["next_cursor"] is None


async def test_the_session_list_shows_a_tenant_nothing_of_another_whatever_it_asks(bus: Bus) -> None:
    """Filters, search, paging, a status filter, counts and ``?tenant=``: a tenant's key sees
    its own sessions only, and what a page costs does not grow with other tenants' sessions."""
    acme, globex = await new_key(bus, "acme"), await new_key(bus, "globex")
    for name in ("a-one", "a-two"):
        await bus.session(name, tenant="acme").append(events.Message(content=f"task of {name}"))
    await open_run(bus, "a-run", "acme's run", tenant="acme")
    await open_run(bus, "g-run", "globex's secret run", tenant="globex")
    with anyio.fail_after(within(60)):
        for i in range(300):
            await bus.session(f"g-{i}-a-one", tenant="globex").append(events.Message(content="globex secret"))
    async with running(bus) as base, httpx.AsyncClient(base_url=base, timeout=within(30)) as http:
        await http.get("/v1/me", headers=bearer(acme))

        async def page(query: str) -> dict[str, object]:
            answer = await http.get(f"/v1/sessions{query}", headers=bearer(acme))
            assert answer.status_code == 200, answer.text
            body = answer.json()
            assert all(row["tenant"] == "acme" for row in body["sessions"]), body
            assert "secret" not in answer.text
            return dict(body)

        assert {r["session"] for r in (await page(""))["sessions"]} == {"a-one", "a-two", "a-run"}
        assert (await page("?q=a-one"))["total"] == 1
        assert (await page("?q=g-"))["total"] == 0
        assert (await page("?tenant=globex"))["sessions"] == []
        assert (await page("?tenant=globex"))["total"] == 0
        assert [r["session"] for r in (await page("?status=running"))["sessions"]] == ["a-run"]
        assert (await page("?limit=1&offset=2"))["total"] == 3
        assert (await page("?limit=1&offset=2"))["next_offset"] is None
        before = await reads(bus)
        far = await page("?status=finished&offset=1000000&limit=200")
        assert far["sessions"] == []
        assert far["next_offset"] is None
        assert await reads(bus) - before < 30  # acme's three sessions read, none of globex's
        for bad in ("?limit=201", "?limit=0", "?offset=-1", "?status=sleeping", "?tenant=a%20b", "?offset=x"):
            assert_problem(await http.get(f"/v1/sessions{bad}", headers=bearer(acme)), 400)
        theirs = await http.get("/v1/sessions?q=a-one&limit=5", headers=bearer(globex))
        assert theirs.json()["total"] == 300
        assert all(row["tenant"] == "globex" for row in theirs.json()["sessions"])


async def test_a_run_opened_twice_at_once_keeps_its_slot(bus: Bus) -> None:
    """Two opens of one session racing: one run opens, the other is refused, and the refused one
    must not give back the slot the open run holds (slots are per session), else the tenant
    could open a run more than its quota allows."""
    quotas = Quotas(bus.log_store)
    await quotas.set("acme", max_runs=1, tokens_per_day=None)
    outcomes: list[object] = []

    async def one() -> None:
        try:
            outcomes.append(await open_run(bus, "twice", "a task", tenant="acme"))
        except Exception as exc:  # (the loser: the log moved, or a run is open already)
            outcomes.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one)
        tg.start_soon(one)
    assert sorted(type(o).__name__ for o in outcomes) == ["AppendConflict", "OpenedRun"], outcomes
    assert (await quotas.usage("acme")).running == 1
    with pytest.raises(QuotaExceeded):
        await open_run(bus, "another", "a second run at once", tenant="acme")


async def test_a_tenant_at_its_quota_that_keeps_asking_does_not_fold_its_runs_logs_each_time(bus: Bus) -> None:
    """Before refusing, the slots of runs that ended are given back (their logs say so).  A tenant
    at its limit that asks again and again (50 requests a second per key) must not have every
    running log folded from its first event each time: each is read on from where it was
    folded."""
    quotas = Quotas(bus.log_store)
    await quotas.set("acme", max_runs=1, tokens_per_day=None)
    await open_run(bus, "long", "a long run", tenant="acme")
    for _ in range(16):
        batch = [events.Message(content="x" * 100, tenant="acme") for _ in range(1000)]
        await bus.log_store.append("long", batch, tenant="acme")
    with pytest.raises(QuotaExceeded):
        await open_run(bus, "other-0", "refused", tenant="acme")
    before = await reads(bus)
    for i in range(1, 21):
        with pytest.raises(QuotaExceeded):
            await open_run(bus, f"other-{i}", "refused", tenant="acme")
        # (the tenant keeps its running log moving, so that nothing could be skipped as unchanged)
        await bus.log_store.append("long", [events.Message(content="more", tenant="acme")], tenant="acme")
    # each open reads its own (empty) session and the new event of the long log: a few reads; a
    # fold of the long log from its start would be 8 reads (of 2,000 events) more each time
    assert await reads(bus) - before < 4 * 20 + 10
    # the run ends (its worker died before giving the slot back): the next open gets the slot
    await bus.log_store.append(
        "long", [events.Error(source="agent", reason="cancelled", content="gone", tenant="acme")], tenant="acme"
    )
    await open_run(bus, "other-21", "now it opens", tenant="acme")
    assert (await quotas.usage("acme")).running == 1


async def test_a_parent_whose_childs_id_another_tenant_holds_answers_its_delegate_and_writes_nothing_there(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer
) -> None:
    """A session under a child's id may belong to another tenant (made before such ids were
    reserved, or by an operator).  A parent cancelled before its child was made must then answer
    its ``delegate`` itself, never append to that session, and not stall on it."""
    call = {"id": "c1", "type": "function", "function": {"name": "delegate", "arguments": '{"task": "t"}'}}
    head = [
        events.Message(content="split", tenant="acme"),
        events.RunStarted(max_steps=5, tenant="acme"),
        events.LlmResponse(model="test-model", tool_calls=[call], tenant="acme", agent="agent"),
    ]
    await bus.log_store.append("owner", head, tenant="acme")
    delegate = events.Delegate(task="t", cause=3, tool_call_id="c1", tenant="acme", agent="agent")
    cancel = events.RunCancel(note="stop", tenant="acme")
    await bus.log_store.append("owner", [delegate, cancel], tenant="acme")
    squatted = child_session("owner", 4)
    await bus.log_store.append(squatted, [events.Message(content="globex's own", tenant="globex")], tenant="globex")
    agent = start("a1", ["agent"])
    await ready(agent)
    ended = await run_end(bus, "owner", timeout=30)
    assert isinstance(ended, events.Error)
    assert ended.reason == "cancelled"
    answered = await all_answered(bus, "owner")
    assert [type(a).__name__ for a in answered[4]] == ["Error"]
    assert [e.kind for e in await bus.session(squatted).events()] == ["message"]
    assert await dead_letter_count(bus.client, bus.keys) == 0  # (the parent's events were handled)


async def test_a_revoked_key_neither_opens_nor_cancels_nor_lists_runs(bus: Bus) -> None:
    store = KeyStore(bus.redis, bus.keys, bus.url)
    key, record = await store.create("acme")
    async with running(bus) as base, httpx.AsyncClient(base_url=base, timeout=within(30)) as http:
        opened = await http.post("/v1/sessions/r/runs", json={"task": "work"}, headers=bearer(key))
        assert opened.status_code == 202, opened.text
        await store.revoke(record.id)
        assert_problem(await http.post("/v1/sessions/r/runs/cancel", headers=bearer(key)), 401)
        assert_problem(await http.post("/v1/sessions/r2/runs", json={"task": "more"}, headers=bearer(key)), 401)
        assert_problem(await http.get("/v1/runs", headers=bearer(key)), 401)
        assert_problem(await http.get("/v1/sessions?status=running", headers=bearer(key)), 401)
    assert [e.kind for e in await bus.session("r").events()] == ["message", "run_started"]
    assert await bus.session("r2").last_id() == 0

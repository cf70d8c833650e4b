"""The list of runs at scale: pages newest first behind an opaque cursor, filtered by state,
tenant and agent; the first page of 100,000 ended runs costs the same few Redis commands as
that of a handful; ended runs are trimmed after the retention, a bounded few per listing; a run
no agent worker holds is ``waiting``, and cancelling it ends it at once and frees its tenant's
slot, with no worker."""

from __future__ import annotations

import json
import time

import anyio
import httpx
import msgspec
import pytest

import riverbed
from riverbed import events
from riverbed.agent import run_index
from riverbed.agent.hosted import cancel_run, list_runs, open_run, page_runs
from riverbed.agent.quotas import Quotas
from riverbed.agent.runs import RunSummary
from riverbed.client.session import Bus
from riverbed.errors import InputError
from tests.kit.cli import run as run_cli
from tests.kit.serve import assert_problem, bearer, new_key, running

pytestmark = pytest.mark.anyio

MANY = 100_000
encode = msgspec.json.Encoder().encode


async def load_ended(bus: Bus, count: int, *, start: float, tenants: int = 10, ended_at: float | None = None) -> None:
    """``count`` ended runs in the index, each with its summary, as the agent role leaves them."""
    keys = bus.keys
    for begin in range(0, count, 10_000):
        part = range(begin, min(begin + 10_000, count))
        summaries = {
            keys.run(f"old{n:06d}"): encode(
                RunSummary(
                    session=f"old{n:06d}", tenant=f"t{n % tenants}", state="finished", steps=1, opened_at=start + n,
                    reason="finish",
                )
            )
            for n in part
        }  # fmt: skip
        if not bus.client.cluster:
            await bus.redis.mset(summaries)  # (one command: the keys are in several slots only on a cluster)
        async with bus.client.pipeline() as pipe:
            if bus.client.cluster:
                for key, value in summaries.items():
                    pipe.set(key, value)
            scores = {f"old{n:06d}": start + n for n in part}
            pipe.zadd(keys.runs, scores)
            pipe.zadd(keys.runs_ended, {s: ended_at or time.time() for s in scores})
            for t in range(tenants):
                pipe.zadd(keys.tenant_runs(f"t{t}"), {s: v for s, v in scores.items() if int(s[3:]) % tenants == t})
            await pipe.execute()


async def commands(bus: Bus) -> int:
    return int((await bus.redis.info("stats"))["total_commands_processed"])


async def cost(bus: Bus, **options: object) -> tuple[int, list[str]]:
    """Redis commands one page costs (the server's count, less what reading it costs), and its sessions."""
    idle = -(await commands(bus)) + await commands(bus)  # what reading the count costs
    before = await commands(bus)
    page = await page_runs(bus, **options)  # type: ignore[arg-type]
    return await commands(bus) - before - idle, [row.session for row in page.rows]


@pytest.mark.fault
async def test_the_first_page_of_100k_ended_runs_takes_a_few_commands(standalone_bus: Bus) -> None:
    bus = standalone_bus
    await load_ended(bus, 10, start=1_000.0)
    small, _ = await cost(bus, limit=50)
    await load_ended(bus, MANY, start=1_000.0)
    assert await bus.redis.zcard(bus.keys.runs) == MANY
    spent, sessions = await cost(bus, limit=50)
    assert sessions == [f"old{n:06d}" for n in range(MANY - 1, MANY - 51, -1)]
    # The trim check, one range, one round trip of 50 summaries and the agents' HMGET: no more
    # at 100,000 runs than at 10 (plus the 40 more summaries of a full page).
    assert spent <= 50 + 4, spent
    assert spent <= small + 40, (small, spent)
    spent, sessions = await cost(bus, limit=20, tenant="t3")
    assert spent <= 20 + 4, spent
    assert sessions[0] == "old099993"
    assert len(sessions) == 20
    spent, sessions = await cost(bus, limit=20, state="finished")
    assert spent <= 20 + 4, spent
    assert len(sessions) == 20
    spent, sessions = await cost(bus, limit=20, state="running")
    assert (spent, sessions) == (2, [])  # the trim check and the (empty) index of open runs


async def test_pages_follow_each_other_without_gaps_or_repeats_ties_included(bus: Bus) -> None:
    await load_ended(bus, 130, start=5_000.0, tenants=2)
    async with bus.client.pipeline() as pipe:  # ten more opened in the same instant as old000129
        for n in range(10):
            summary = RunSummary(session=f"tie{n}", tenant="t0", state="finished", opened_at=5_129.0)
            pipe.set(bus.keys.run(f"tie{n}"), msgspec.json.encode(summary))
        pipe.zadd(bus.keys.runs, {f"tie{n}": 5_129.0 for n in range(10)})
        await pipe.execute()
    seen: list[str] = []
    cursor = None
    for _ in range(20):
        page = await page_runs(bus, limit=7, cursor=cursor)
        seen.extend(row.session for row in page.rows)
        cursor = page.next_cursor
        if cursor is None:
            break
    assert len(seen) == len(set(seen)) == 140
    assert set(seen[:11]) == {"old000129", *(f"tie{n}" for n in range(10))}
    assert seen[11:] == [f"old{n:06d}" for n in range(128, -1, -1)]
    assert [row.session for row in await list_runs(bus, tenant="t1")] == [f"old{n:06d}" for n in range(129, 0, -2)]
    with pytest.raises(InputError, match="not one a runs page gave"):
        await page_runs(bus, cursor="bogus!")


async def test_ended_runs_are_trimmed_after_the_retention_a_bounded_few_per_listing(bus: Bus) -> None:
    await load_ended(bus, 500, start=1_000.0, ended_at=time.time() - 3_600)
    await load_ended(bus, 3, start=9_000.0, tenants=1)  # ended just now (sessions old000000..2 again)
    assert await bus.redis.zcard(bus.keys.runs) == 500
    kept = await page_runs(bus, limit=10, retention=7 * 24 * 3600)
    assert len(kept.rows) == 10
    assert await bus.redis.zcard(bus.keys.runs) == 500  # within the retention: all kept
    await page_runs(bus, limit=10, retention=600)
    left = await bus.redis.zcard(bus.keys.runs)
    assert left == 500 - run_index.TRIM_MOST  # bounded per call
    for _ in range(5):
        await page_runs(bus, limit=10, retention=600)
    assert await bus.redis.zcard(bus.keys.runs) == 3
    assert await bus.redis.zcard(bus.keys.tenant_runs("t7")) == 0


@pytest.mark.fault
async def test_a_run_no_worker_holds_is_waiting_and_its_cancel_ends_it_at_once_and_frees_the_slot(
    bus: Bus, cli_env: dict[str, str]
) -> None:
    await Quotas(bus.log_store).set("acme", max_runs=1, tokens_per_day=None)
    await open_run(bus, "q1", "queued", tenant="acme", agent=riverbed.Agent("reviewer", "You review."))
    (row,) = await list_runs(bus)
    assert (row.session, row.state, row.worker) == ("q1", "waiting", None)
    assert [r.session for r in await list_runs(bus, state="waiting", agent="reviewer")] == ["q1"]
    assert await list_runs(bus, state="running") == []
    assert await list_runs(bus, agent="other") == []
    env = {**cli_env, "RIVERBED_PREFIX": bus.keys.prefix}
    shown = run_cli(env, "runs")
    assert b"waiting" in shown.stdout
    assert b"running" not in shown.stdout
    asked = time.monotonic()
    await cancel_run(bus, "q1", note="changed my mind")
    took = time.monotonic() - asked
    assert took < 2, took
    log = await bus.session("q1").events()
    assert [e.kind for e in log] == ["message", "run_started", "run_cancel", "error"]
    end = log[-1]
    assert isinstance(end, events.Error)
    assert (end.source, end.reason) == ("agent", "cancelled")
    (row,) = await list_runs(bus)
    assert (row.state, row.reason) == ("cancelled", "cancelled")
    assert (await Quotas(bus.log_store).usage("acme")).running == 0
    # The slot is free at once: the next run of the tenant opens, with no worker having run.
    await open_run(bus, "q2", "next", tenant="acme")
    key = await new_key(bus, "acme")
    async with running(bus) as base, httpx.AsyncClient(base_url=base, headers=bearer(key)) as http:
        listed = await http.get("/v1/runs", params={"limit": 1})
        assert listed.status_code == 200, listed.text
        body = listed.json()
        assert [(r["session"], r["state"]) for r in body["runs"]] == [("q2", "waiting")]
        assert body["next_cursor"]
        after = await http.get("/v1/runs", params={"limit": 1, "cursor": body["next_cursor"]})
        assert [(r["session"], r["state"]) for r in after.json()["runs"]] == [("q1", "cancelled")]
        assert after.json()["next_cursor"] is None
        assert_problem(await http.get("/v1/runs", params={"cursor": "x"}), 400, "cursor")
        cancelled = await http.post("/v1/sessions/q2/runs/cancel")
        assert cancelled.status_code == 202
    with anyio.fail_after(2):
        while (await Quotas(bus.log_store).usage("acme")).running:
            await anyio.sleep(0.05)
    rows = [json.loads(line) for line in run_cli(env, "runs", "--json", "--state", "cancelled").stdout.splitlines()]
    assert [r["session"] for r in rows] == ["q2", "q1"]


async def test_detach_without_a_model_is_refused_and_without_an_agent_worker_says_it_waits(
    bus: Bus, cli_env: dict[str, str]
) -> None:
    env = {**cli_env, "RIVERBED_PREFIX": bus.keys.prefix}
    refused = run_cli(env, "agent", "n1", "do it", "--detach")
    assert refused.returncode == 2
    said = refused.stderr.decode().strip()
    assert len(said.splitlines()) == 1, said
    assert "no model server is configured" in said
    assert "OPENAI_BASE_URL" in said
    assert await bus.session("n1").last_id() == 0
    configured = {**env, "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}
    opened = run_cli(configured, "agent", "n1", "do it", "--detach")
    assert opened.returncode == 0, opened.stderr
    assert b"waiting for an agent worker" in opened.stderr
    rows = [json.loads(line) for line in run_cli(env, "runs", "--json").stdout.splitlines()]
    assert [(r["session"], r["state"]) for r in rows] == [("n1", "waiting")]


async def test_runs_listed_before_the_indexes_are_indexed_once(bus: Bus) -> None:
    now = time.time()
    old = {
        "was-open": RunSummary(session="was-open", tenant="a", state="running", opened_at=now - 30, updated=now - 1),
        "was-done": RunSummary(session="was-done", tenant="b", state="finished", opened_at=now - 20, updated=now - 10),
        "long-done": RunSummary(
            session="long-done", tenant="b", state="failed", opened_at=now - 9_000, updated=now - 8_000
        ),
    }
    async with bus.client.pipeline() as pipe:  # what the agent role wrote before: a summary and the runs set
        for session, summary in old.items():
            pipe.set(bus.keys.run(session), encode(summary))
            pipe.zadd(bus.keys.runs, {session: summary.opened_at})
        await pipe.execute()
    assert await list_runs(bus, tenant="b") == []
    assert await run_index.backfill(bus.client, bus.keys) == 3
    assert await run_index.backfill(bus.client, bus.keys) == 0  # once
    assert [r.session for r in await list_runs(bus, tenant="b")] == ["was-done", "long-done"]
    assert [(r.session, r.state) for r in await list_runs(bus, state="waiting")] == [("was-open", "waiting")]
    assert [r.session for r in await list_runs(bus, retention=3_600)] == ["was-done", "was-open"]


async def test_a_runs_later_summaries_write_its_index_only_when_it_stands_there_otherwise(bus: Bus) -> None:
    """An agent saves a run's summary at every step; the run's index entries are written with the
    first, when the run ends, when another run opens, and whenever the writer knows no summary it
    saved (a new owner): not again at each step, unchanged."""
    keys = bus.keys

    async def listed() -> dict[str, list[str]]:
        found = {}
        for name, key in (("all", keys.runs), ("open", keys.runs_open), ("ended", keys.runs_ended)):
            found[name] = [s.decode() for s in await bus.redis.zrange(key, 0, -1)]
        found["tenant"] = [s.decode() for s in await bus.redis.zrange(keys.tenant_runs("acme"), 0, -1)]
        return found

    first = RunSummary(session="s", tenant="acme", steps=1, opened=1, opened_at=100.0)
    writes = run_index.summary_writes(keys, first)
    assert [w[0] for w in writes] == ["SET", "ZADD", "ZADD", "ZADD", "ZREM"]
    await bus.client.send(writes)
    assert await listed() == {"all": ["s"], "open": ["s"], "ended": [], "tenant": ["s"]}

    later = RunSummary(session="s", tenant="acme", steps=2, tokens=900, opened=1, opened_at=100.0)
    writes = run_index.summary_writes(keys, later, saved=first)
    assert [w[0] for w in writes] == ["SET"]  # (the run stands in the index as it did)
    await bus.client.send(writes)
    assert msgspec.json.decode(await bus.redis.get(keys.run("s")), type=RunSummary).steps == 2

    ended = RunSummary(session="s", tenant="acme", state="finished", steps=3, opened=1, opened_at=100.0, ended=9)
    await bus.client.send(run_index.summary_writes(keys, ended, saved=later))
    assert await listed() == {"all": ["s"], "open": [], "ended": ["s"], "tenant": ["s"]}

    again = RunSummary(session="s", tenant="acme", steps=1, opened=11, opened_at=200.0)
    await bus.client.send(run_index.summary_writes(keys, again, saved=ended))
    assert await listed() == {"all": ["s"], "open": ["s"], "ended": [], "tenant": ["s"]}
    assert await bus.redis.zscore(keys.runs, "s") == 200.0

    # A new owner knows no summary it saved: it writes the index again, whatever stands there.
    await bus.redis.zrem(keys.runs_open, "s")
    await bus.client.send(run_index.summary_writes(keys, msgspec.structs.replace(again, steps=2)))
    assert await listed() == {"all": ["s"], "open": ["s"], "ended": [], "tenant": ["s"]}

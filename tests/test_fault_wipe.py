"""Redis loses its data under running workers: a FLUSHALL, and a restart with no persistence.

Two runtime worker processes serve sessions, then Redis forgets everything: the session logs,
the directory streams with their consumer groups, the leases and fencing tokens, the worker
registry.  Without restarting a worker:

- every old session id appended to again, and a new session, answer within 10 s;
- every action appended afterwards has exactly one answer, and no command ran twice;
- a client waiting for an action the wipe took with it hears so at once instead of waiting;
- no worker exits.

A role loop that keeps failing (here: Redis refuses ``XGROUP`` after the wipe, so no worker
can rebuild the directory group) turns each worker's ``/readyz`` red naming the loop, its
error and since when; ``riverbed status`` says the same; both clear once the loop recovers.

Each test wipes a standalone redis-server of its own.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path

import anyio
import pytest

import riverbed
from riverbed import events
from riverbed.client.session import Bus
from riverbed.errors import NotFoundError
from tests.kit.cli import ok
from tests.kit.faults import (
    Driver,
    PrivateRedis,
    assert_each_action_answered_once,
    driving,
    start_runtime_workers,
    wait_each_answered,
)
from tests.kit.metrics import get
from tests.kit.workers import WorkerProcess, workers  # noqa: F401  (workers: a fixture)

pytestmark = [pytest.mark.anyio, pytest.mark.fault]

LEASE = 2.0
OLD_SESSIONS = 4
#: The guarantee: old and new sessions answer again within this long after the wipe.
RECOVERY_SECONDS = 10.0


@pytest.fixture
def forgetful_redis(tmp_path: Path, standalone_selected: None) -> Iterator[PrivateRedis]:
    """A redis-server without AOF or snapshots: a restart brings it back empty."""
    with PrivateRedis(tmp_path / "redis", persistent=False) as server:
        yield server


@pytest.fixture
async def wiped_bus(forgetful_redis: PrivateRedis, prefix: str) -> AsyncIterator[Bus]:
    async with riverbed.connect(forgetful_redis.url, prefix=prefix) as bus:
        yield bus


async def readyz(port: int) -> tuple[int, dict[str, object]]:
    status, _type, body = await get(port, "/readyz")
    return status, json.loads(body)


async def wait_readyz(port: int, status: int, timeout: float, what: str) -> dict[str, object]:
    with anyio.move_on_after(timeout):
        while True:
            got, body = await readyz(port)
            if got == status:
                return body
            await anyio.sleep(0.1)
    raise AssertionError(f"{what}: /readyz on port {port} did not answer {status} within {timeout:g}s")


async def served_sessions(bus: Bus) -> list[riverbed.Session]:
    """Old sessions, each answered twice and held by a worker."""
    sessions = [bus.session(f"old{i}") for i in range(OLD_SESSIONS)]
    for session in sessions:
        for _ in range(2):
            answer = await session.act(events.CmdRun(command="echo before"), timeout=20)
            assert isinstance(answer, events.CmdOutput), answer
    return sessions


async def wait_delivered(bus: Bus, session: riverbed.Session) -> None:
    """Until a worker has read an entry of ``session`` and not acknowledged it yet."""
    key = bus.keys.log(session.id)
    with anyio.fail_after(20):
        while not (await bus.redis.xpending(key, "runtime"))["pending"]:
            await anyio.sleep(0.02)


Wipe = Callable[[], Awaitable[None]]
StartWorkers = Callable[..., Awaitable[dict[str, int]]]


@pytest.fixture
def start_workers(
    forgetful_redis: PrivateRedis, workers: list[WorkerProcess], prefix: str, workspace: Path, tmp_path: Path
) -> StartWorkers:
    """``await start_workers(metrics=...)``: the two runtime workers on this test's Redis."""
    return partial(start_runtime_workers, workers, forgetful_redis.url, prefix, workspace, tmp_path, lease=LEASE)


async def check_rebuilt(
    bus: Bus, start_workers: StartWorkers, workers: list[WorkerProcess], workspace: Path, wipe: Wipe
) -> None:
    """Serve sessions, ``wipe`` Redis while one command runs, then old and new sessions answer."""
    await start_workers()
    old = await served_sessions(bus)
    # A command in flight on its owner when Redis forgets it.
    (slow_id,) = await old[0].append(events.CmdRun(command="sleep 1; echo slow"))
    await wait_delivered(bus, old[0])

    await wipe()
    wiped_at = time.monotonic()

    with pytest.raises(NotFoundError, match="no longer in its log"):
        await old[0].wait_for_answer(slow_id, timeout=RECOVERY_SECONDS)
    drivers = [Driver(session) for session in old] + [Driver(bus.session("new0"))]
    async with driving(drivers):
        await wait_each_answered(drivers, 40)

    recovery = {d.session.id: round(min(d.answered_at.values()) - wiped_at, 2) for d in drivers}
    assert max(recovery.values()) < RECOVERY_SECONDS, f"sessions answered again only after {recovery}"
    assert all(w.proc.poll() is None for w in workers), "a worker exited when Redis lost its data"
    await assert_each_action_answered_once(drivers, workspace)


@pytest.fixture
def rebuilt(
    wiped_bus: Bus, start_workers: StartWorkers, workers: list[WorkerProcess], workspace: Path
) -> Callable[[Wipe], Awaitable[None]]:
    """``await rebuilt(wipe)``: :func:`check_rebuilt` on this test's Redis, workers and workspace."""
    return partial(check_rebuilt, wiped_bus, start_workers, workers, workspace)


async def test_flushall_under_running_workers(wiped_bus: Bus, rebuilt: Callable[[Wipe], Awaitable[None]]) -> None:
    async def flushall() -> None:
        await wiped_bus.redis.flushall()

    await rebuilt(flushall)


async def test_restart_without_data_under_running_workers(
    wiped_bus: Bus, forgetful_redis: PrivateRedis, rebuilt: Callable[[Wipe], Awaitable[None]]
) -> None:
    async def restart_empty() -> None:
        await anyio.to_thread.run_sync(forgetful_redis.stop)
        await anyio.to_thread.run_sync(forgetful_redis.start)
        assert not await wiped_bus.redis.exists(wiped_bus.keys.meta("old0")), "the restarted server kept data"

    await rebuilt(restart_empty)


async def test_a_loop_that_keeps_failing_turns_readyz_red_and_status_says_why(
    wiped_bus: Bus,
    forgetful_redis: PrivateRedis,
    workers: list[WorkerProcess],
    start_workers: StartWorkers,
    offline_env: dict[str, str],
) -> None:
    bus = wiped_bus
    ports = await start_workers(metrics=True)
    for port in ports.values():
        await wait_readyz(port, 200, 10, "workers started")
    session = bus.session("old0")
    assert isinstance(await session.act(events.CmdRun(command="echo before"), timeout=20), events.CmdOutput)

    # Redis loses its data and refuses XGROUP: no worker can rebuild the directory group.
    await bus.redis.execute_command("ACL", "SETUSER", "default", "-xgroup")
    try:
        await bus.redis.flushall()
        for name, port in ports.items():
            body = await wait_readyz(port, 503, 10, f"{name} cannot rebuild its directory group")
            reasons = body["reasons"]
            assert isinstance(reasons, list)
            named = [r for r in reasons if "runtime intake failing since" in r and "xgroup" in r.lower()]
            assert named, reasons
        env = {**offline_env, "RIVERBED_REDIS_URL": forgetful_redis.url}
        # The heartbeat carries the record to the worker registry within a second or so.
        with anyio.fail_after(10):
            while True:
                status = json.loads(await anyio.to_thread.run_sync(ok, env, "status", "--json"))
                failing = {(f["worker"], f["role"], f["loop"]) for f in status["failing"]}
                if failing >= {("wa", "runtime", "intake"), ("wb", "runtime", "intake")}:
                    break
                await anyio.sleep(0.2)
        assert all("xgroup" in f["error"].lower() and f["since"] > 0 for f in status["failing"])
        human = (await anyio.to_thread.run_sync(ok, env, "status")).decode()
        assert "failing" in human
        assert "intake" in human
    finally:
        await bus.redis.execute_command("ACL", "SETUSER", "default", "+xgroup")
    allowed_at = time.monotonic()

    for name, port in ports.items():
        await wait_readyz(port, 200, RECOVERY_SECONDS, f"{name} rebuilt its directory group")
    answer = await session.act(events.CmdRun(command="echo after"), timeout=RECOVERY_SECONDS)
    assert isinstance(answer, events.CmdOutput), answer
    assert time.monotonic() - allowed_at < RECOVERY_SECONDS
    assert all(w.proc.poll() is None for w in workers)

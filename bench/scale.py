"""What a worker holds for the sessions it owns: Redis connections and memory.

One ``python -m riverbed.workers runtime`` process (plain-process sandboxes, capacity 1,000)
takes 1,000 new sessions at once, each answering one ``file_read``; then:

- **connections**: the worker's connections to Redis, counted with ``CLIENT LIST`` by the
  name every connection of the worker carries.  The baseline is what a worker with a
  connection per session would hold (one per owned session); target: fewer than 20;
- **RSS per 1,000 sessions**: the worker's resident memory after taking them, less its
  resident memory when ready and idle (the baseline printed beside it);
- **holding them idle**: the worker's CPU per held session and second over the 30 s starting 2 s
  after the last answer (its renewals, its loops' stray checks and timers), Redis's in the note,
  against the worker's CPU per action of the answers before; the ratio is what a minute of
  holding a session costs against its action (a session is held for a minute after its last
  action, then parked).  ``--quick``: 10 s;
- **held by four workers**: the same 1,000 sessions taken by 4 workers with room for all of
  them, Redis's CPU per session held idle over the same window, against one worker's: each
  worker's reclaim rounds look for the sessions of peers that stopped among all those the role's
  workers hold, and should cost what the workers are, not what they hold (target: at most 1.5 times).

Then the roles that keep something per session for every event, memory and condenser: 10,000
new sessions of 3 events each (a message, a thought, a message) over 4 ``python -m
riverbed.workers memory condenser`` processes, until both roles have handled every event of
every session (the memory role indexed it in Postgres; the texts repeat, so the embedding
cache answers and the figure is about sessions, not the embedding model's speed).  Reported:
how long that took (the baseline: writing the 30,000 events), each worker's Redis connections
(the most of the 4; baseline: a connection per owned session and role) and RSS per 1,000
owned sessions.

Run alone: ``python -m bench.scale [--quick] [--json]`` (``--quick``: 250, 250 and 2,500 sessions).
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path

import anyio
import redis.asyncio as aioredis

import riverbed
from bench.common import Result, cpu_seconds, private_postgres, redis_cpu, run_alone
from bench.roundtrip import Workers, _prepare_workspace
from riverbed import events

MANY = 10_000
MANY_WORKERS = 4

TARGET_CONNECTIONS = 20
SPREAD_WORKERS = 4
TARGET_SPREAD = 1.5
"""an idle session's Redis cost with the role's workers four, against one: about the same"""
IDLE_FROM, IDLE_FOR = 2.0, 30.0
"""the window in which the worker's idle sessions are measured: from this many seconds after the
last answer, for this long (``--quick``: 10 s)"""


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


async def _connections_named(url: str, name: str) -> int:
    client = aioredis.Redis.from_url(url)
    try:
        return sum(1 for c in await client.client_list() if c.get("name") == name)
    finally:
        await client.aclose()


async def _settled(bus: riverbed.Bus, roles: tuple[str, ...], sessions: list[str]) -> None:
    """Wait until ``roles`` have read and acknowledged every event of every session.

    One ``XINFO GROUPS`` per session still unsettled, every second (a settled session stays
    settled: nothing more is written to it), so the waiting costs Redis little."""
    remaining = list(sessions)
    with anyio.fail_after(1800):
        while remaining:
            left: list[str] = []
            for start in range(0, len(remaining), 1000):
                chunk = remaining[start : start + 1000]
                async with bus.redis.pipeline(transaction=False) as pipe:
                    for session in chunk:
                        pipe.xinfo_groups(bus.keys.log(session))
                    replies = await pipe.execute(raise_on_error=False)
                for session, groups in zip(chunk, replies, strict=True):
                    done = {}
                    if isinstance(groups, list):
                        done = {_text(g["name"]): g["pending"] == 0 and g["lag"] == 0 for g in groups}
                    if not all(done.get(role) for role in roles):
                        left.append(session)
            remaining = left
            if remaining:
                await anyio.sleep(1.0)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def _many(url: str, database_url: str, count: int) -> list[Result]:
    """``count`` sessions over :data:`MANY_WORKERS` memory + condenser workers."""
    prefix = f"bmc{uuid.uuid4().hex[:6]}"
    roles = ("memory", "condenser")
    sessions = [f"many-{i}" for i in range(count)]
    with tempfile.TemporaryDirectory(prefix="riverbed-bench-many-") as tmp:
        workspace = Path(tmp) / "workspace"
        workspace.mkdir()
        workers = Workers(
            url, prefix, workspace, MANY_WORKERS, count, roles=roles, env={"RIVERBED_DATABASE_URL": database_url}
        )
        try:
            await workers.wait_ready(timeout=120)
            async with riverbed.connect(url, prefix=prefix) as bus:
                # One session per worker first, so that what every worker loads once (the
                # embedding model, the database pool) is in the idle figure.
                warm = [f"warm-{i}" for i in range(5 * MANY_WORKERS)]
                for name in warm:
                    await bus.session(name).append(events.Message(content="warming up", source="user"))
                await _settled(bus, roles, warm)
                await anyio.sleep(1.0)
                idle = [_rss_mib(p.pid) for p in workers.procs]
                limiter = anyio.CapacityLimiter(200)

                async def write(i: int) -> None:
                    async with limiter:
                        await bus.session(sessions[i]).append(
                            events.Message(content=f"please look at test case {i % 50}", source="user"),
                            events.Think(thought=f"case {i % 50} fails on the last line"),
                            events.Message(content="done for now", source="user"),
                        )

                started = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    for i in range(count):
                        tg.start_soon(write, i)
                wrote = time.perf_counter() - started
                await _settled(bus, roles, sessions)
                took = time.perf_counter() - started
                connections = [await _connections_named(url, f"riverbed:{name}") for name in workers.names]
                rss = [_rss_mib(p.pid) for p in workers.procs]
                found = [k async for k in bus.redis.scan_iter(match=f"{prefix}:*", count=1000)]
                for start in range(0, len(found), 500):
                    await bus.redis.delete(*found[start : start + 500])
        finally:
            workers.stop()
    owned = count / MANY_WORKERS
    per_thousand = sum(r - i for r, i in zip(rss, idle, strict=True)) / MANY_WORKERS * 1000 / owned
    most = max(connections)
    return [
        Result(
            f"memory + condenser roles: {count:,} new sessions (3 events each) over {MANY_WORKERS} workers, "
            "until every event is indexed and condensation-checked", "s", took, wrote,
            f"writing the {3 * count:,} events", took / wrote, None, 1, better="lower",
            baseline_unit="s",
        ),
        Result(
            f"Redis connections of one of those workers (the most of the {MANY_WORKERS})", "connections", most,
            2 * owned, "a connection per owned session and role", most / (2 * owned), TARGET_CONNECTIONS, 1,
            better="lower", target_on="figure", note=f"each worker: {connections}",
        ),
        Result(
            "their RSS per 1,000 owned sessions (memory + condenser)", "MiB", per_thousand,
            sum(idle) / MANY_WORKERS, "a worker's RSS idle, warm", per_thousand / (sum(idle) / MANY_WORKERS), None, 1,
            better="lower",
        ),
    ]  # fmt: skip


async def measure(url: str, args: argparse.Namespace) -> list[Result]:
    with private_postgres(args.database_url) as database_url:
        many = await _many(url, database_url, MANY // 4 if args.quick else MANY)
    alone, alone_redis = await _one_worker(url, args)
    return [*alone, *await _spread(url, args, alone_redis), *many]


async def _one_worker(url: str, args: argparse.Namespace) -> tuple[list[Result], float]:
    """The rows of one worker, and Redis's CPU a second per session it held idle."""
    count = 250 if args.quick else 1000
    prefix = f"bsc{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory(prefix="riverbed-bench-scale-") as tmp_name:
        sessions = [f"scale-{i}" for i in range(count)]
        workspace = _workspace(Path(tmp_name), sessions)
        workers = Workers(url, prefix, workspace, 1, count, sandbox="process")
        try:
            await workers.wait_ready()
            pid = workers.procs[0].pid
            await anyio.sleep(1.0)
            idle_rss = _rss_mib(pid)
            started = time.perf_counter()
            cpu_before = cpu_seconds([pid])
            async with riverbed.connect(url, prefix=prefix) as bus:
                await _first_answers(bus, sessions)
                took = time.perf_counter() - started
                per_action = (cpu_seconds([pid]) - cpu_before) / count
                connections = await _connections_named(url, f"riverbed:{workers.names[0]}")
                rss = _rss_mib(pid)
                window = 10.0 if args.quick else IDLE_FOR
                holding, holding_redis = await _held_idle(bus, [pid], count, window)
        finally:
            workers.stop()
    per_thousand = (rss - idle_rss) * 1000 / count
    rows = [
        Result(
            f"Redis connections of a worker owning {count:,} sessions", "connections", connections, count,
            "a connection per owned session", connections / count, TARGET_CONNECTIONS, 1, better="lower",
            target_on="figure",
            note=f"all {count:,} first answers took {took * 1000:,.0f} ms on one worker",
        ),
        Result(
            "worker RSS per 1,000 owned sessions", "MiB", per_thousand, idle_rss, "the worker's RSS idle",
            per_thousand / idle_rss, None, 1, better="lower",
        ),
        Result(
            f"worker CPU per session it holds idle, per second ({IDLE_FROM:.0f} s to {IDLE_FROM + window:.0f} s after "
            f"the {count:,} answers)", "µs/s", holding * 1e6, per_action * 1e6, "the worker's CPU per action",
            holding * 60 / per_action, None, 1, better="lower", baseline_unit="µs",
            note=f"Redis's {holding_redis * 1e6:.1f} µs a second per session; the ratio: a minute of holding a "
            "session against its action",
        ),
    ]  # fmt: skip
    return rows, holding_redis


def _workspace(tmp: Path, sessions: list[str]) -> Path:
    """A workspace under ``tmp`` with the file each of ``sessions`` reads."""
    workspace = tmp / "workspace"
    workspace.mkdir()
    for session in sessions:
        _prepare_workspace(workspace, session)
    return workspace


async def _first_answers(bus: riverbed.Bus, sessions: list[str]) -> None:
    """One ``file_read`` of each of ``sessions``, all at once, each answered."""

    async def act(session: str) -> None:
        obs = await bus.session(session).act(events.FileRead(path="small.txt"), timeout=120)
        assert isinstance(obs, events.FileContent), obs

    async with anyio.create_task_group() as tg:
        for session in sessions:
            tg.start_soon(act, session)


async def _held_idle(bus: riverbed.Bus, pids: list[int], count: int, window: float) -> tuple[float, float]:
    """The CPU seconds a second per session of the workers ``pids`` and of Redis, over ``window``
    seconds from :data:`IDLE_FROM` on (the sessions' actions were answered)."""
    await anyio.sleep(IDLE_FROM)
    worker_cpu, server_cpu, since = cpu_seconds(pids), await redis_cpu(bus.redis), time.perf_counter()
    await anyio.sleep(window)
    elapsed = time.perf_counter() - since
    return (cpu_seconds(pids) - worker_cpu) / elapsed / count, (
        await redis_cpu(bus.redis) - server_cpu
    ) / elapsed / count


async def _spread(url: str, args: argparse.Namespace, alone_redis: float) -> list[Result]:
    """The same sessions held idle by :data:`SPREAD_WORKERS` workers, each with room for them all:
    Redis's CPU per session against one worker's (each worker's reclaim rounds look for the
    sessions of peers that stopped, among all the sessions the role's workers hold)."""
    count = 250 if args.quick else 1000
    prefix = f"bsp{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory(prefix="riverbed-bench-scale-") as tmp_name:
        sessions = [f"spread-{i}" for i in range(count)]
        workspace = _workspace(Path(tmp_name), sessions)
        workers = Workers(url, prefix, workspace, SPREAD_WORKERS, count, sandbox="process")
        try:
            await workers.wait_ready()
            async with riverbed.connect(url, prefix=prefix) as bus:
                await _first_answers(bus, sessions)
                pids = [proc.pid for proc in workers.procs]
                holding, holding_redis = await _held_idle(bus, pids, count, 10.0 if args.quick else IDLE_FOR)
        finally:
            workers.stop()
    return [
        Result(
            f"Redis CPU per session {SPREAD_WORKERS} workers hold idle, per second ({count:,} sessions)", "µs/s",
            holding_redis * 1e6, alone_redis * 1e6, "the same with one worker", holding_redis / alone_redis,
            TARGET_SPREAD, 1, better="lower",
            note=f"the {SPREAD_WORKERS} workers' CPU: {holding * 1e6:.1f} µs a second per session",
        ),
    ]  # fmt: skip


def main() -> int:
    return run_alone(measure, "Redis connections and memory of a worker owning many sessions.")


if __name__ == "__main__":
    raise SystemExit(main())

"""What a worker holds for the sessions it owns: Redis connections and memory.

One ``python -m riverbed.workers runtime`` process (plain-process sandboxes, capacity 1,000)
takes 1,000 new sessions at once, each answering one ``file_read``; then:

- **connections**: the worker's connections to Redis, counted with ``CLIENT LIST`` by the
  name every connection of the worker carries.  The baseline is what a worker with a
  connection per session would hold (one per owned session); target: fewer than 20;
- **RSS per 1,000 sessions**: the worker's resident memory after taking them, less its
  resident memory when ready and idle (the baseline printed beside it).

Run alone: ``python -m bench.scale [--quick] [--json]`` (``--quick``: 250 sessions).
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
from bench.common import Result, run_alone
from bench.roundtrip import Workers, _prepare_workspace
from riverbed import events

TARGET_CONNECTIONS = 20


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


async def measure(url: str, args: argparse.Namespace) -> list[Result]:
    count = 250 if args.quick else 1000
    prefix = f"bsc{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory(prefix="riverbed-bench-scale-") as tmp_name:
        workspace = Path(tmp_name) / "workspace"
        workspace.mkdir()
        sessions = [f"scale-{i}" for i in range(count)]
        for session in sessions:
            _prepare_workspace(workspace, session)
        workers = Workers(url, prefix, workspace, 1, count, sandbox="process")
        try:
            await workers.wait_ready()
            pid = workers.procs[0].pid
            await anyio.sleep(1.0)
            idle_rss = _rss_mib(pid)
            started = time.perf_counter()
            async with riverbed.connect(url, prefix=prefix) as bus:

                async def act(session: str) -> None:
                    obs = await bus.session(session).act(events.FileRead(path="small.txt"), timeout=120)
                    assert isinstance(obs, events.FileContent), obs

                async with anyio.create_task_group() as tg:
                    for session in sessions:
                        tg.start_soon(act, session)
            took = time.perf_counter() - started
            connections = await _connections_named(url, f"riverbed:{workers.names[0]}")
            rss = _rss_mib(pid)
        finally:
            workers.stop()
    per_thousand = (rss - idle_rss) * 1000 / count
    return [
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
    ]  # fmt: skip


def main() -> int:
    return run_alone(measure, "Redis connections and memory of a worker owning many sessions.")


if __name__ == "__main__":
    raise SystemExit(main())

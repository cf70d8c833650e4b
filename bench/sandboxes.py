"""The runtime with many live sandboxes: what one costs, how many this machine holds, and the
round trip with all of them alive.

One ``python -m riverbed.workers runtime`` process (namespaces sandboxes: bubblewrap) takes N
sessions (2,000; ``--quick``: 100); each runs ``cmd_run true`` once, which starts its sandbox,
kept alive for the session's next command.  Then:

- **memory per sandbox**: the machine's ``MemAvailable`` before less after, over N (what the
  kernel gave: the sandbox's processes, page tables, its namespaces), and the worker's own
  RSS growth over N;
- **processes and open files per sandbox**: the worker's process tree and its file
  descriptors, over N;
- **how many this machine holds**: the smallest of ``MemAvailable`` at the start over memory
  per sandbox, ``kernel.pid_max`` over processes per sandbox and the worker's open-file
  limit over files per sandbox, stated with the bound that decides it;
- **round trip with N live sandboxes**: ``cmd_run true`` p50, one session after another
  through all N, against the same worker with one live sandbox (measured first).

Run alone: ``python -m bench.sandboxes [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path

import anyio
import psutil

import riverbed
from bench.common import Result, percentile, run_alone
from bench.roundtrip import Workers
from riverbed import events

SANDBOXES = 2000
ROUNDS = 3


def _available_mib() -> float:
    return psutil.virtual_memory().available / 2**20


def _limits(pid: int) -> tuple[int, int]:
    """(kernel.pid_max, the worker's soft open-file limit)."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    return pid_max, psutil.Process(pid).rlimit(psutil.RLIMIT_NOFILE)[0]


def _tree(pid: int) -> tuple[int, int, float]:
    """(processes under the worker, the worker's open files, the worker's RSS in MiB)."""
    worker = psutil.Process(pid)
    return len(worker.children(recursive=True)), worker.num_fds(), worker.memory_info().rss / 2**20


async def _round_trips(sessions: list[riverbed.Session], rounds: int) -> list[float]:
    took: list[float] = []
    for _ in range(rounds):
        for session in sessions:
            started = time.perf_counter()
            answer = await session.act(events.CmdRun(command="true"), timeout=60)
            took.append((time.perf_counter() - started) * 1000)
            assert isinstance(answer, events.CmdOutput), answer
    return took


async def measure(url: str, args: argparse.Namespace) -> list[Result]:
    count = 100 if args.quick else SANDBOXES
    prefix = f"bsx{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory(prefix="riverbed-bench-sandboxes-") as tmp:
        workspace = Path(tmp) / "workspace"
        workspace.mkdir()
        # Every session keeps its sandbox until the end: the worker gives back a session idle for
        # a minute (stopping its sandbox), and starting 2,000 can take longer than that.
        workers = Workers(url, prefix, workspace, 1, count + 1, "namespaces", options=("--park-after", "3600"))
        try:
            await workers.wait_ready()
            pid = workers.procs[0].pid
            async with riverbed.connect(url, prefix=prefix) as bus:
                one = [bus.session("alone")]
                await _round_trips(one, 1)  # (taking it and starting its sandbox are not timed)
                alone = await _round_trips(one, ROUNDS * 50)
                await anyio.sleep(0.5)
                available = _available_mib()
                procs0, fds0, rss0 = _tree(pid)
                sessions = [bus.session(f"sb-{i}") for i in range(count)]
                started = time.perf_counter()
                limiter = anyio.CapacityLimiter(16)

                async def start(session: riverbed.Session) -> None:
                    async with limiter:
                        await _round_trips([session], 1)

                async with anyio.create_task_group() as tg:
                    for session in sessions:
                        tg.start_soon(start, session)
                took = time.perf_counter() - started
                await anyio.sleep(1.0)
                used = available - _available_mib()
                procs1, fds1, rss1 = _tree(pid)
                pid_max, soft_files = _limits(pid)
                with_all = await _round_trips(sessions, ROUNDS)
                procs2, _, _ = _tree(pid)
                found = [k async for k in bus.redis.scan_iter(match=f"{prefix}:*", count=1000)]
                for first in range(0, len(found), 500):
                    await bus.redis.delete(*found[first : first + 500])
        finally:
            workers.stop()
    per_mib = max(used / count, 0.01)
    per_procs = max((procs1 - procs0) / count, 0.01)
    per_fds = max((fds1 - fds0) / count, 0.01)
    bounds = {
        f"memory ({available:,.0f} MiB available / {per_mib:.1f} MiB)": available / per_mib,
        f"processes (pid_max {pid_max:,} / {per_procs:.1f})": pid_max / per_procs,
        f"the worker's open files ({soft_files:,} / {per_fds:.1f})": soft_files / per_fds,
    }
    bound, holds = min(bounds.items(), key=lambda kv: kv[1])
    p_alone, p_all = percentile(alone, 50), percentile(with_all, 50)
    note = (
        f"{count:,} sandboxes started in {took:.1f} s; {per_procs:.1f} processes and {per_fds:.1f} open files in "
        f"the worker per sandbox ({procs2} processes after the rounds); worker RSS +{(rss1 - rss0) / count:.2f} MiB "
        f"per sandbox; this machine holds about {holds:,.0f}, bounded by {bound}"
    )
    return [
        Result(
            "memory per live namespaces sandbox (MemAvailable drop)", "MiB", per_mib, available,
            "MemAvailable at the start", per_mib / available, None, 1, better="lower", note=note,
        ),
        Result(
            f"cmd_run round trip p50 with {count:,} live sandboxes (each in turn)", "ms", p_all, p_alone,
            "the same worker with one live sandbox", p_all / p_alone, None, len(with_all), better="lower",
        ),
        Result(
            "live sandboxes this machine holds (the tightest bound)", "sandboxes", holds, count,
            "sandboxes measured", holds / count, None, 1,
        ),
    ]  # fmt: skip


def main() -> int:
    if sys.platform != "linux":
        print("bench.sandboxes needs Linux (namespaces sandboxes)", file=sys.stderr)
        return 2
    return run_alone(measure, "The runtime with many live namespaces sandboxes.")


if __name__ == "__main__":
    raise SystemExit(main())

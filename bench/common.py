"""Shared benchmark machinery: a result type, medians, percentiles, private Redis and Postgres,
and one table printer.

A benchmark module exposes ``async def measure(url, args) -> list[Result]`` (``url`` is the
Redis it may use, ``args`` the parsed :func:`options`); ``python -m bench`` runs every module
in :data:`MODULES` and prints one table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from riverbed import services

MODULES = (
    "bench.log",
    "bench.roundtrip",
    "bench.scale",
    "bench.view",
    "bench.memory",
    "bench.growth",
    "bench.takeover",
    "bench.sandboxes",
    "bench.serve",
    "bench.agents",
    "bench.model_request",
    "bench.prompt_step",
)


def process_cpu() -> float:
    """This process's CPU seconds so far, user and system (``getrusage``)."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def cpu_seconds(pids: Sequence[int], *, kernel: bool = False) -> float:
    """User + system CPU seconds the processes used so far (``kernel``: the system's alone)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total += (0 if kernel else int(fields[11])) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / tick


async def redis_cpu(client: Any) -> float:
    """The CPU seconds Redis used so far (``INFO cpu``: its main thread and the others); ``client``
    is any redis-py asyncio client."""
    info = await client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def redis_commands(client: Any) -> dict[str, float]:
    """The µs Redis spent running each command so far (``INFO commandstats``, by command name):
    a script's time holds the commands it called, which are counted under their own names too."""
    stats = await client.info("commandstats")
    return {name.removeprefix("cmdstat_"): float(fields["usec"]) for name, fields in stats.items()}


@dataclass(frozen=True)
class Result:
    """One figure of riverbed against its baseline measured in the same run (medians).

    ``ratio`` is figure/baseline (for throughputs, the median of the per-round ratios).
    ``better`` says which way is good for both the figure and the ratio; ``target_on`` says
    whether ``target`` bounds the ratio or the figure itself (an absolute goal such as
    "under 1 s").  ``target`` None: reported for information, no goal.
    """

    name: str
    unit: str
    figure: float
    baseline: float
    baseline_name: str
    ratio: float
    target: float | None
    samples: int
    better: str = "higher"
    target_on: str = "ratio"
    baseline_unit: str | None = None
    note: str = ""

    @property
    def passed(self) -> bool | None:
        if self.target is None:
            return None
        value = self.ratio if self.target_on == "ratio" else self.figure
        return value >= self.target if self.better == "higher" else value <= self.target

    def target_text(self) -> str:
        if self.target is None:
            return ""
        sign = ">=" if self.better == "higher" else "<="
        if self.target_on == "ratio":
            return f"{sign} {self.target:.2f}x"
        return f"{sign} {_number(self.target)} {self.unit}"

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "passed": self.passed}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between order statistics."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


async def _rate(fn: Callable[[], Awaitable[int]]) -> float:
    started = time.perf_counter()
    items = await fn()
    return items / (time.perf_counter() - started)


async def paired_rates(
    baseline: Callable[[], Awaitable[int]], figure: Callable[[], Awaitable[int]], repeats: int
) -> tuple[float, float, float]:
    """Median rates (items/s) of ``baseline`` and ``figure``, and the median of their per-round ratios.

    The two run alternately, so a load change on a shared machine hits both alike.
    Each function returns the number of items it handled.
    """
    base_rates, figure_rates, ratios = [], [], []
    for _ in range(repeats):
        base = await _rate(baseline)
        fig = await _rate(figure)
        base_rates.append(base)
        figure_rates.append(fig)
        ratios.append(fig / base)
    return statistics.median(base_rates), statistics.median(figure_rates), statistics.median(ratios)


@contextlib.contextmanager
def private_redis(url: str | None) -> Iterator[str]:
    """``url`` if given, else a private redis-server (no persistence) for the duration."""
    if url:
        yield url
        return
    with tempfile.TemporaryDirectory(prefix="riverbed-bench-") as tmp:
        started, pid = services.start_redis(Path(tmp) / "redis", appendonly=False)
        try:
            yield started
        finally:
            services.stop_redis(pid)


@contextlib.contextmanager
def private_postgres(url: str | None) -> Iterator[str]:
    """``url`` if given, else a private embedded Postgres (with pgvector) for the duration."""
    if url:
        yield url
        return
    with tempfile.TemporaryDirectory(prefix="riverbed-bench-pg-") as tmp:
        pgdata = Path(tmp) / "pg"
        try:
            yield services.start_postgres(pgdata)
        finally:
            services.stop_postgres(pgdata)


def options(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--redis-url", help="use this Redis instead of a private redis-server")
    parser.add_argument("--database-url", help="use this Postgres (with pgvector) instead of an embedded one")
    parser.add_argument("--repeats", type=int, default=5, help="runs per measurement (the median is reported)")
    parser.add_argument("--quick", action="store_true", help="smaller runs (fewer sessions, events and rows)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--no-peer", action="store_true", help="skip the peer in its own environment (bench.view: the OpenHands SDK)"
    )
    agents = parser.add_argument_group("bench.agents")
    agents.add_argument("--runs", type=int, help="detached runs opened at once (default 1,000; --quick: 100)")
    agents.add_argument("--steps", type=int, help="model calls per run (default 10)")
    agents.add_argument("--workers", type=int, help="agent worker processes (default 4)")
    agents.add_argument(
        "--runtime-workers", type=int, help="runtime worker processes answering the actions (default 2)"
    )
    agents.add_argument(
        "--tools", action="store_true", help="each step calls a Python tool of a hosted agent (bench/tool_agent.py)"
    )
    agents.add_argument(
        "--action", choices=("file_read", "cmd_run"), help="the tool each step calls (default file_read; cmd_run: true)"
    )
    agents.add_argument("--latency", type=float, help="seconds each model call takes (default 0.2)")
    agents.add_argument(
        "--tenants", type=int, help="spread the runs over this many tenants (default 0: sessions without a tenant)"
    )
    agents.add_argument(
        "--context",
        help="seed each run's session with about N events of earlier turns first, one round per size, "
        "e.g. 20,2000 (default runs: 100)",
    )
    return parser


def stop_on_sigterm() -> None:
    """Let SIGTERM (``timeout``, ``kill``) stop a benchmark as Ctrl-C does: its ``finally``
    blocks stop the workers, the model server and the private Redis it started, where the
    default action would leave them running."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def run_alone(module_measure: Callable[[str, argparse.Namespace], Awaitable[list[Result]]], description: str) -> int:
    """``main()`` of a benchmark module run alone: a private Redis, one table."""
    import anyio  # noqa: PLC0415

    stop_on_sigterm()
    args = options(description).parse_args()
    with private_redis(args.redis_url) as url:
        results = anyio.run(module_measure, url, args)
    print_results(results, as_json=args.json)
    return 0


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def print_results(results: list[Result], *, as_json: bool = False) -> None:
    if as_json:
        json.dump([r.as_dict() for r in results], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    header = ("figure", "riverbed", "baseline", "", "ratio", "target", "")
    rows = [
        (
            r.name,
            f"{_number(r.figure)} {r.unit}",
            f"{_number(r.baseline)} {r.baseline_unit or r.unit}",
            f"({r.baseline_name})",
            f"{r.ratio:.2f}",
            r.target_text(),
            {True: "pass", False: "MISS", None: ""}[r.passed],
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    for r in results:
        if r.note:
            print(f"* {r.name}: {r.note}")


def stop_processes(procs: Sequence[subprocess.Popen[Any]], grace: float) -> None:
    """SIGTERM each of ``procs``, then SIGKILL each one still running ``grace`` seconds into its
    wait; each is reaped."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def dump_instructions(dump: Path) -> int:
    """The instructions a callgrind dump counted: its ``totals:`` line, the sum of its costs.
    Its ``summary:`` line is that only in a worker's first dump: with the counting switched off
    and on between dumps, callgrind 3.19 writes there this dump's totals less the dump's before
    (which wraps below zero when a round counted fewer)."""
    summary = None
    for line in dump.read_text(errors="replace").splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
        if line.startswith("summary:") and summary is None:
            summary = int(line.split()[1])
    return summary or 0


class Callgrind:
    """Processes run under ``valgrind --tool=callgrind`` (:meth:`wrap`), counting instructions only
    between :meth:`start` and :meth:`stop`: the same code counts about the same whatever else the
    machine does, where CPU time on a shared VM moves by a fifth or more from one run to the next.
    Each process runs some fifty times slower meanwhile (wall-clock figures mean nothing then).
    The counts are in ``DIR/NAME.cg.N``, for ``callgrind_annotate``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def wrap(self, name: str) -> list[str]:
        """The command line's start that runs ``name`` under callgrind, counting nothing yet (the
        dumps of an earlier run in the directory go first: callgrind numbers them from 1 again)."""
        for stale in self.directory.glob(f"{name}.cg*"):
            stale.unlink()
        out = self.directory / f"{name}.cg"
        return ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]

    def start(self, pids: list[int]) -> None:
        for pid in pids:
            self._control("-i", "on", str(pid))

    def stop(self, pids: list[int]) -> int:
        """Dump each process's counts since :meth:`start` and stop counting: the instructions."""
        before = set(self.directory.glob("*.cg.*"))
        for pid in pids:
            self._control("-d", str(pid))
            self._control("-i", "off", str(pid))
        dumps = set(self.directory.glob("*.cg.*")) - before
        if len(dumps) < len(pids):
            raise SystemExit(f"bench: callgrind wrote no count into {self.directory} (callgrind_control -d failed)")
        return sum(dump_instructions(dump) for dump in dumps)

    @staticmethod
    def _control(*arguments: str) -> None:
        command = ["callgrind_control", *arguments]
        try:
            subprocess.run(command, capture_output=True, check=False, timeout=120)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"bench: {' '.join(command)} did not answer within 120 s") from None

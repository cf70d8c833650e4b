"""Shared benchmark machinery: a result type, medians, a private Redis, and one table printer.

A benchmark module exposes ``async def measure(options) -> list[Result]``; ``python -m bench``
runs every module in :data:`MODULES` and prints one table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from riverbed import services

MODULES = ("bench.log",)


@dataclass(frozen=True)
class Result:
    """One figure of riverbed against its baseline (medians); ``ratio`` is the median of the
    per-round figure/baseline ratios (higher is better)."""

    name: str
    unit: str
    figure: float
    baseline: float
    baseline_name: str
    ratio: float
    target: float
    samples: int

    @property
    def passed(self) -> bool:
        return self.ratio >= self.target

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "passed": self.passed}


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


def options(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--redis-url", help="use this Redis instead of a private redis-server")
    parser.add_argument("--repeats", type=int, default=5, help="runs per measurement (the median is reported)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser


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
            f"{_number(r.baseline)} {r.unit}",
            f"({r.baseline_name})",
            f"{r.ratio:.2f}",
            f">= {r.target:.2f}",
            "pass" if r.passed else "FAIL",
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())

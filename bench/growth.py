"""Memory growth of a worker: RSS per 10,000 events through an in-process condenser role.

A fresh child process runs an :class:`~riverbed.bus.consumer.Owner` with the condenser
handler (the role that keeps per-session state: an incremental ``ViewBuilder`` per session;
default config, so it condenses without an LLM whenever a view passes 100 events) over 10
sessions.  The warm-up is 31,000 events (``cmd_run`` / ``cmd_output`` pairs and messages,
~300-byte outputs; 11,000, then 10,000 twice, each waited for as below): besides the
allocator's arenas and the clients' buffers, it fills what a view keeps bounded (the tails of
its latest 1,024 units: about 2,600 events a session), so what follows is growth with the
log's length, not caches filling up.  Then 40,000 more are appended, 10,000 at a time, and
after each the child waits until the role has handled all of them (and its own
condensations).  The figure is the RSS growth per 10,000 events over those
40,000 (RSS read after a garbage collection; one stretch alone moves by a few hundred KiB
either way, as the allocator takes and returns whole arenas).

Baseline, first thing in the same fresh child: the RSS growth of holding 10,000 of those
events decoded in a list (what an unbounded in-memory history costs).  MiB per 10,000 events.

Run alone: ``python -m bench.growth``.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
import uuid
from typing import Any

import anyio
import psutil

import riverbed
from bench.common import Result, run_alone
from riverbed import events
from riverbed.bus.connection import connect_redis
from riverbed.bus.consumer import Owner
from riverbed.bus.keys import Keys
from riverbed.workers.condenser_role import CondenserHandler

SESSIONS = 10
STRETCH = 10_000
WARMUP = 1_000
WARMUP_STRETCHES = 3  # 11,000 events, then 10,000 twice
STRETCHES = 4
MIB = 1024 * 1024


def _rss() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / MIB


async def _feed(session: riverbed.Session, count: int, start: int) -> None:
    """``count`` events: pairs of cmd_run and its cmd_output, and a message every fifth."""
    sent = 0
    while sent < count:
        n = start + sent
        if n % 5 == 4:
            await session.append(events.Message(content=f"step {n}: the parser still drops the last line"))
            sent += 1
            continue
        (action,) = await session.append(events.CmdRun(command=f"pytest tests/test_parser.py -k case_{n}"))
        await session.append(
            events.CmdOutput(
                cause=action,
                source="runtime",
                command=f"pytest tests/test_parser.py -k case_{n}",
                content=f"case_{n} FAILED\nAssertionError: expected 3 tokens\n" + "." * 200,
                exit_code=1,
            )
        )
        sent += 2


async def _settled(bus: riverbed.Bus, sessions: list[str]) -> None:
    """Wait until the condenser group has read and acknowledged every entry of every session."""
    with anyio.fail_after(600):
        while True:
            done = 0
            for sid in sessions:
                key = bus.keys.log(sid)
                last = await bus.redis.xinfo_stream(key)
                for group in await bus.redis.xinfo_groups(key):
                    if group["name"] in (b"condenser", "condenser"):
                        delivered = group["last-delivered-id"]
                        if delivered == last["last-generated-id"] and group["pending"] == 0:
                            done += 1
            if done == len(sessions):
                return
            await anyio.sleep(0.2)


async def _baseline(bus: riverbed.Bus) -> tuple[float, int]:
    """RSS growth of 10,000 decoded events held in a list, in this (still fresh) process."""
    handle = bus.session("held")
    await _feed(handle, STRETCH, 0)
    before = _rss()
    held = await handle.events()
    grown = _rss() - before
    return grown, len(held)


async def child(url: str) -> dict[str, Any]:
    prefix = "bg" + uuid.uuid4().hex[:8]
    out: dict[str, Any] = {}
    async with riverbed.connect(url, prefix=prefix + "b") as bus:
        out["baseline"], out["held"] = await _baseline(bus)
    redis = await connect_redis(url)
    owner = Owner(redis, Keys(prefix), CondenserHandler(llm=None, model=None), worker="bench-growth", capacity=100)
    sessions = [f"g{i}" for i in range(SESSIONS)]
    async with riverbed.connect(url, prefix=prefix) as bus:
        handles = [bus.session(sid) for sid in sessions]

        async def stretch(count: int, start: int) -> float:
            async with anyio.create_task_group() as feeders:
                for handle in handles:
                    feeders.start_soon(_feed, handle, count // SESSIONS, start)
            await _settled(bus, sessions)
            return _rss()

        async with anyio.create_task_group() as tg:
            await tg.start(owner.run)
            rss0 = _rss()
            rss1 = await stretch(WARMUP + STRETCH, 0)
            for k in range(1, WARMUP_STRETCHES):
                rss1 = await stretch(STRETCH, WARMUP + k * STRETCH)
            started = time.perf_counter()
            each = []
            last = rss1
            for k in range(WARMUP_STRETCHES, WARMUP_STRETCHES + STRETCHES):
                rss = await stretch(STRETCH, WARMUP + k * STRETCH)
                each.append(rss - last)
                last = rss
            out["seconds"] = time.perf_counter() - started
            out["warmup"] = rss1 - rss0
            out["each"] = each
            out["steady"] = (last - rss1) / STRETCHES
            out["handled"] = owner.stats.handled
            await owner.drain(5)
    async with riverbed.connect(url) as bus:
        for namespace in (prefix, prefix + "b"):
            keys = [k async for k in bus.redis.scan_iter(match=f"{namespace}:*", count=1000)]
            for start in range(0, len(keys), 500):
                await bus.redis.delete(*keys[start : start + 500])
    await redis.aclose()
    return out


async def measure(url: str, args: argparse.Namespace) -> list[Result]:
    proc = await anyio.run_process([sys.executable, "-m", "bench.growth", "--child", url], stderr=subprocess.DEVNULL)
    got = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    base = got["baseline"]
    note = (
        f"condenser Owner in a fresh process, {SESSIONS} sessions; after a warm-up of "
        f"{WARMUP + WARMUP_STRETCHES * STRETCH:,} events ({got['warmup']:+.1f} MiB), "
        f"the next {STRETCHES} times 10,000: "
        f"{', '.join(f'{d:+.1f}' for d in got['each'])} MiB; baseline: {int(got['held']):,} decoded events "
        "held in a list, first thing in the same process"
    )
    return [
        Result(
            "worker RSS growth per 10k events (condenser)",
            "MiB",
            got["steady"],
            base,
            "10k decoded events in a list",
            got["steady"] / base if base > 0 else float("nan"),
            1.0,
            STRETCHES,
            better="lower",
            target_on="figure",
            note=note,
        )
    ]


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(anyio.run(child, sys.argv[2])))
        return 0
    return run_alone(measure, "RSS growth of a worker role per 10,000 events.")


if __name__ == "__main__":
    raise SystemExit(main())

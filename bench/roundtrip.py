"""Action round trips through real runtime worker processes against a raw Redis ping-pong.

The floor is what any Redis Streams RPC costs here: a client ``XADD``s a request to stream A
and blocks (``XREAD``) on stream B; a responder process blocks on A with ``XREADGROUP`` and,
for each request, ``XADD``s the reply to B and ``XACK``s A in one pipeline.  Requests and
replies carry the msgpack payloads of the riverbed events below, so both move the same bytes.

riverbed is ``Session.act(FileRead(path=<a 200-byte file>))`` answered by
``python -m riverbed.workers runtime`` processes: the append script, the worker's session
loop, the sandbox's file read (confined to the workspace), the answering append (fenced,
acknowledging) and the client's wait for the answer.  riverbed sends its append and its wait
in one write (the client: the append script and ``XREAD`` from ``$``; the worker: the answer
and its next ``XREADGROUP``), so it makes two trips to Redis per action where the floor, one
command at a time, makes four; the floor's responder does pipeline its ``XADD`` + ``XACK``.

- latency: one session, sequential round trips, rounds alternating floor/riverbed; p50
  and p99 over every sample (target: riverbed p50 <= 2x the floor's), and each round's p50
  against the floor's in the same round, with the worst of them (goal: 1.2x in every one;
  ``--repeats 10`` runs ten), and the CPU each side's processes (the client, the worker or
  responder, Redis) used per round trip over those rounds.  Only
  runtime workers run, so the sessions are marked as owned by the memory and condenser
  roles, as in a full deployment; one more row shows a runtime-only deployment, where the
  session stays announced to those roles (re-announced at most every 2 s);
- throughput: 200 concurrent sessions (closed loop, one action in flight each) over 2
  worker processes vs 200 ping-pong pairs over 2 responder processes: actions/s and p99; the
  ratio is the median over twice ``--repeats`` pairs of rounds (10 actions per session each),
  riverbed first in every other pair;
- scale: 1,000 concurrent sessions over 4 worker processes vs 1,000 pairs over 4
  responders: p99 and the slowest round trip (nobody starved); ``--quick`` runs 250;
- sandbox: ``act(CmdRun("true"))`` through a worker whose sandboxes are bubblewrap
  namespaces against one whose sandboxes are plain processes, rounds alternating (target:
  namespaces p50 within 10% of process).

Each session's first action (which makes a worker take the session) is a warm-up and is
not measured.  Run alone: ``python -m bench.roundtrip [--quick] [--repeats N] [--json]``.

With ``BENCH_ROUNDTRIP_CALLGRIND=DIR``, the latency rounds are followed by two rounds of each side
(100 round trips each) on a second private redis-server run under ``valgrind --tool=callgrind``,
which counts only while a side's round goes on: Redis's instructions per round trip of each side
(the dumps in ``DIR``, for ``callgrind_annotate``).  Redis's microseconds in ``INFO commandstats``
move with the VM; over five runs these counts moved by 8% for riverbed and by 14% for the floor
(the worker's own rounds, which take longer under callgrind, fall in both).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import redis.asyncio as aioredis

import riverbed
from bench.common import (
    Callgrind,
    Result,
    cpu_seconds,
    percentile,
    process_cpu,
    redis_commands,
    redis_cpu,
    run_alone,
    stop_processes,
)
from riverbed import events, services
from riverbed.bus.keys import Keys
from riverbed.bus.scripts import APPEND
from riverbed.errors import ServiceError
from riverbed.runtime.paths import workspace_name

FILE_NAME = "small.txt"
FILE_TEXT = "riverbed benchmark file\n" + "0123456789abcdef" * 11 + "\n"
GROUP = "responder"
LATENCY_SAMPLES = 300  # per round
CALLGRIND_SAMPLES = 100  # per round of each side, Redis under callgrind (some fifty times slower)
RUN_RATIO_GOAL = 1.2
"""The goal for each run (round) of the latency phase: its p50 at most this times the floor's."""
THROUGHPUT_ROUNDS_PER_REPEAT = 2
"""Throughput rounds (each a pair: floor and riverbed, under a second apiece) per ``--repeats``.
A round's ratio moves by up to ±0.3 on these machines as their speed drifts, so the figure is
the median of many short pairs rather than of a few."""


# --- the raw floor ----------------------------------------------------------------------


def _request_key(prefix: str, i: int) -> str:
    return f"{prefix}:req:{i}"


def _reply_key(prefix: str, i: int) -> str:
    return f"{prefix}:rep:{i}"


def _payloads() -> tuple[bytes, bytes]:
    request = events.encode(events.FileRead(path=FILE_NAME, agent="bench", tenant="acme"))
    reply = events.encode(events.FileContent(path=FILE_NAME, content=FILE_TEXT, cause=1, tenant="acme"))
    return request, reply


async def _respond(url: str, prefix: str, streams: list[int], one_write: bool) -> None:
    """One task per request stream: XREADGROUP (blocking), then XADD the reply + XACK; with
    ``one_write`` the reply and the ack go in one write with the next XREADGROUP."""
    client = aioredis.Redis.from_url(url, max_connections=len(streams) + 10)
    _request, reply = _payloads()

    async def serve(i: int) -> None:
        key, out = _request_key(prefix, i), _reply_key(prefix, i)
        got = None
        while True:
            if one_write and got:
                async with client.pipeline(transaction=False) as pipe:
                    for _stream, entries in got:
                        for entry_id, _fields in entries:
                            pipe.xadd(out, {b"e": reply})
                            pipe.xack(key, GROUP, entry_id)
                    pipe.xreadgroup(GROUP, "r", {key: ">"}, count=100, block=1000)
                    got = (await pipe.execute())[-1]
                continue
            got = await client.xreadgroup(GROUP, "r", {key: ">"}, count=100, block=1000)
            if one_write:
                continue
            for _stream, entries in got or ():
                async with client.pipeline(transaction=False) as pipe:
                    for entry_id, _fields in entries:
                        pipe.xadd(out, {b"e": reply})
                        pipe.xack(key, GROUP, entry_id)
                    await pipe.execute()

    async with anyio.create_task_group() as tg:
        for i in streams:
            tg.start_soon(serve, i)


def responder_main(argv: list[str]) -> None:
    """``python -m bench.roundtrip --responder URL PREFIX FIRST STEP COUNT [one-write]``."""
    url, prefix, first, step, count = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    anyio.run(_respond, url, prefix, list(range(first, count, step)), argv[5:6] == ["one-write"])


@contextmanager
def responders(
    url: str, prefix: str, processes: int, streams: int, *, one_write: bool = False
) -> Iterator[list[subprocess.Popen[bytes]]]:
    extra = ["one-write"] if one_write else []
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.roundtrip",
                "--responder",
                url,
                prefix,
                str(n),
                str(processes),
                str(streams),
                *extra,
            ]
        )
        for n in range(processes)
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


class PingPong:
    """The client half of the floor: one request stream and one reply stream per pair."""

    def __init__(self, client: aioredis.Redis, prefix: str, i: int, *, one_write: bool = False) -> None:
        self.client = client
        self.request_key = _request_key(prefix, i)
        self.reply_key = _reply_key(prefix, i)
        self.cursor = b"0-0"
        self.request, _reply = _payloads()
        self.one_write = one_write

    async def prepare(self) -> None:
        await self.client.xgroup_create(self.request_key, GROUP, id="0", mkstream=True)

    async def __call__(self) -> None:
        if self.one_write:  # the request and the wait for the reply in one write
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.xadd(self.request_key, {b"e": self.request})
                pipe.xread({self.reply_key: "$"}, count=1, block=1000)
                _added, got = await pipe.execute()
            for _stream, entries in got or ():
                self.cursor = entries[-1][0]
                return
        else:
            await self.client.xadd(self.request_key, {b"e": self.request})
        while True:
            got = await self.client.xread({self.reply_key: self.cursor}, count=1, block=1000)
            for _stream, entries in got or ():
                self.cursor = entries[-1][0]
                return


# --- riverbed ---------------------------------------------------------------------------


class Workers:
    """``python -m riverbed.workers ROLE…`` processes under one key prefix (the runtime role
    by default); ``env`` adds variables, ``options`` command-line options (``--park-after S``);
    with ``profile`` (a directory) each runs under ``cProfile`` timed by its CPU clock
    (``bench/cpu_profile.py``) and writes ``NAME.prof`` there when it stops; ``wrap(NAME)`` is
    a command each runs under (``valgrind …``)."""

    def __init__(
        self,
        url: str,
        prefix: str,
        workspace: Path,
        count: int,
        capacity: int,
        sandbox: str = "namespaces",
        *,
        roles: tuple[str, ...] = ("runtime",),
        env: dict[str, str] | None = None,
        profile: Path | None = None,
        wrap: Callable[[str], list[str]] | None = None,
        options: tuple[str, ...] = (),
    ) -> None:
        self.url = url
        self.keys = Keys(prefix)
        self.names = [f"bench-{'-'.join(roles)}-{uuid.uuid4().hex[:6]}" for _ in range(count)]
        env = {
            **os.environ,
            "RIVERBED_REDIS_URL": url,
            "RIVERBED_PREFIX": prefix,
            "RIVERBED_WORKSPACE": str(workspace),
            "RIVERBED_CONCURRENCY": str(capacity),
            "RIVERBED_LOG_FORMAT": "json",
            "RIVERBED_SANDBOX": sandbox,
            **(env or {}),
        }
        self.logs = [(workspace.parent / f"{name}.log").open("wb") for name in self.names]
        self.procs = [
            subprocess.Popen(
                [
                    *(wrap(name) if wrap is not None else []),
                    sys.executable,
                    *(["-m", "bench.cpu_profile", str(profile / f"{name}.prof")] if profile is not None else []),
                    *("-m", "riverbed.workers", *roles, "--name", name, *options),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            for name, log in zip(self.names, self.logs, strict=True)
        ]

    async def wait_ready(self, timeout: float = 30.0) -> None:
        client = aioredis.Redis.from_url(self.url)
        try:
            with anyio.fail_after(timeout):
                for name in self.names:
                    while not await client.exists(self.keys.worker(name)):
                        if any(p.poll() is not None for p in self.procs):
                            raise RuntimeError("a worker exited early; see its log beside the workspace")
                        await anyio.sleep(0.05)
        finally:
            await client.aclose()

    def stop(self) -> None:
        stop_processes(self.procs, 20)
        for log in self.logs:
            log.close()


def _prepare_workspace(root: Path, session: str) -> None:
    ws = root / workspace_name(session)
    ws.mkdir(parents=True, exist_ok=True)
    (ws / FILE_NAME).write_text(FILE_TEXT)


def _actor(session: riverbed.Session, action: events.Action | None = None) -> Callable[[], Awaitable[None]]:
    action = action or events.FileRead(path=FILE_NAME)
    answer = events.CmdOutput if isinstance(action, events.CmdRun) else events.FileContent

    async def act() -> None:
        obs = await session.act(action, timeout=60)
        if not isinstance(obs, answer):
            raise TypeError(f"the runtime answered {obs!r}")

    return act


# --- measuring --------------------------------------------------------------------------


async def _timed(fn: Callable[[], Awaitable[None]], count: int, out: list[float]) -> None:
    for _ in range(count):
        started = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - started)


async def _concurrent(fns: list[Callable[[], Awaitable[None]]], per_session: int) -> tuple[float, list[float]]:
    """Every fn runs ``per_session`` times in a closed loop, all at once; (actions/s, latencies)."""
    latencies: list[float] = []
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for fn in fns:
            tg.start_soon(_timed, fn, per_session, latencies)
    return len(latencies) / (time.perf_counter() - started), latencies


async def _warm(fns: list[Callable[[], Awaitable[None]]]) -> float:
    """Run each fn once, all at once; the time until the last one returned."""
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for fn in fns:
            tg.start_soon(fn)
    return time.perf_counter() - started


# The commands riverbed's append script calls, by ``INFO commandstats``' names ("xgroup|setid"),
# read off the script: on riverbed's side of a round trip, their time is inside its ``evalsha``.
SCRIPTED = frozenset(
    "|".join(filter(None, call)).lower() for call in re.findall(r"redis\.p?call\('(\w+)'(?:, '([A-Z]+)')?", APPEND)
)


@dataclass
class Cpu:
    """CPU seconds of a side's processes: the client (this process), the workers or responders,
    and Redis; Redis's µs in each command (``INFO commandstats``); and the round trips they made."""

    client: float = 0.0
    server: float = 0.0
    redis: float = 0.0
    trips: int = 0
    commands: dict[str, float] = field(default_factory=dict)

    @classmethod
    async def now(cls, pids: list[int], raw: aioredis.Redis) -> Cpu:
        return cls(process_cpu(), cpu_seconds(pids), await redis_cpu(raw), commands=await redis_commands(raw))

    async def since(self, pids: list[int], raw: aioredis.Redis) -> Cpu:
        # (less the ``INFO`` that :meth:`now` asked, which Redis counted after its own reply)
        commands = {name: us - self.commands.get(name, 0.0) for name, us in (await redis_commands(raw)).items()}
        commands.pop("info", None)
        return Cpu(
            process_cpu() - self.client,
            cpu_seconds(pids) - self.server,
            await redis_cpu(raw) - self.redis,
            commands={name: us for name, us in commands.items() if us > 0},
        )

    def add(self, used: Cpu, trips: int) -> None:
        self.client += used.client
        self.server += used.server
        self.redis += used.redis
        self.trips += trips
        for name, us in used.commands.items():
            self.commands[name] = self.commands.get(name, 0.0) + us

    def command_us(self, names: Callable[[str], bool] = lambda _name: True) -> float:
        """Redis's µs per round trip in the commands ``names`` picks."""
        return sum(us for name, us in self.commands.items() if names(name)) / max(self.trips, 1)

    def per_trip_us(self) -> tuple[float, float, float]:
        """(client, server, Redis) µs of CPU per round trip."""
        trips = max(self.trips, 1)
        return 1e6 * self.client / trips, 1e6 * self.server / trips, 1e6 * self.redis / trips


def _ms(values: list[float]) -> list[float]:
    return [v * 1000 for v in values]


@dataclass
class _Counted:
    """Redis under callgrind (``BENCH_ROUNDTRIP_CALLGRIND``): its counter and pid, and per side the
    instructions it ran during that side's rounds and their round trips."""

    counter: Callgrind
    pid: int
    instructions: dict[str, int] = field(default_factory=dict)
    trips: dict[str, int] = field(default_factory=dict)

    def per_trip(self, side: str) -> float:
        return self.instructions[side] / self.trips[side]


async def _phase(
    url: str,
    tmp: Path,
    sessions: int,
    processes: int,
    *,
    rounds: int,
    per_session: int,
    runtime_only: bool = False,
    one_write_lat: list[float] | None = None,
    cpu: dict[str, Cpu] | None = None,
    counted: _Counted | None = None,
) -> tuple[list[float], list[float], list[float], list[float], float]:
    """Floor and riverbed, ``rounds`` alternating rounds of ``sessions`` concurrent loops.

    Unless ``runtime_only``, the sessions are then marked as owned by the memory and
    condenser roles too, as in a full deployment (only runtime workers run here); otherwise
    the session stays announced to those roles (re-announced at most every 2 s).
    Returns (floor rates, riverbed rates, floor latencies, riverbed latencies, riverbed warm-up s);
    with ``one_write_lat``, a third contender alternates too (a floor sending each request and its
    wait in one write, as riverbed does) and its latencies go there.  With ``cpu``, the CPU each
    side's processes used over its rounds is added up under "floor" and "riverbed".  With
    ``counted`` (the Redis at ``url`` running under callgrind), the instructions it ran during
    each side's rounds and their round trips are added up there.
    """
    tag = uuid.uuid4().hex[:8]
    raw_prefix, rb_prefix = f"bpp{tag}", f"brt{tag}"
    workspace = tmp / f"ws-{tag}"
    session_ids = [f"s{i}" for i in range(sessions)]
    for sid in session_ids:
        _prepare_workspace(workspace, sid)
    raw = aioredis.Redis.from_url(url, max_connections=sessions + 20)
    pairs = [PingPong(raw, raw_prefix, i) for i in range(sessions)]
    ow_prefix = f"bow{tag}"
    ow_pairs = (
        [PingPong(raw, ow_prefix, i, one_write=True) for i in range(sessions)] if one_write_lat is not None else []
    )
    for pair in pairs + ow_pairs:
        await pair.prepare()
    capacity = -(-sessions // processes)
    workers = Workers(url, rb_prefix, workspace, processes, capacity)
    raw_rates: list[float] = []
    rb_rates: list[float] = []
    raw_lat: list[float] = []
    rb_lat: list[float] = []
    try:
        await workers.wait_ready()
        async with riverbed.connect(url, prefix=rb_prefix) as bus:
            actors = [_actor(bus.session(sid)) for sid in session_ids]
            with ExitStack() as stack:
                floor_procs = stack.enter_context(responders(url, raw_prefix, processes, sessions))
                if ow_pairs:
                    stack.enter_context(responders(url, ow_prefix, processes, sessions, one_write=True))
                    await _warm(list(ow_pairs))
                await _warm(list(pairs))
                warm = await _warm(actors)
                if not runtime_only:
                    async with raw.pipeline(transaction=False) as pipe:
                        for sid in session_ids:
                            pipe.hdel(bus.keys.meta(sid), "need:memory", "need:condenser")
                        await pipe.execute()
                sides = [
                    ("floor", [p.pid for p in floor_procs], list(pairs), raw_rates, raw_lat),
                    ("riverbed", [p.pid for p in workers.procs], actors, rb_rates, rb_lat),
                ]
                for index in range(rounds):
                    # Every other round riverbed goes first, so a machine slowing down or speeding
                    # up across a pair of rounds favours neither side.
                    for side, pids, fns, rates, latencies in sides if index % 2 == 0 else sides[::-1]:
                        used = None if cpu is None else await Cpu.now(pids, raw)
                        if counted is not None:
                            counted.counter.start([counted.pid])
                        rate, lat = await _concurrent(fns, per_session)
                        if counted is not None:
                            ran = counted.counter.stop([counted.pid])
                            counted.instructions[side] = counted.instructions.get(side, 0) + ran
                            counted.trips[side] = counted.trips.get(side, 0) + len(lat)
                        if cpu is not None and used is not None:
                            cpu.setdefault(side, Cpu()).add(await used.since(pids, raw), len(lat))
                        rates.append(rate)
                        latencies.extend(lat)
                    if one_write_lat is not None:
                        _rate, lat = await _concurrent(list(ow_pairs), per_session)
                        one_write_lat += lat
            keys = [k async for k in raw.scan_iter(match=f"{rb_prefix}:*", count=1000)]
            keys += [k async for k in raw.scan_iter(match=f"{raw_prefix}:*", count=1000)]
            keys += [k async for k in raw.scan_iter(match=f"{ow_prefix}:*", count=1000)]
            for start in range(0, len(keys), 500):
                await raw.delete(*keys[start : start + 500])
    finally:
        workers.stop()
        await raw.aclose()
    return raw_rates, rb_rates, raw_lat, rb_lat, warm


async def _sandboxes(url: str, tmp: Path, *, rounds: int, per_round: int) -> tuple[list[float], list[float]]:
    """``cmd_run`` round trips through a process-sandbox worker and a namespaces-sandbox worker,
    rounds alternating; (process latencies, namespaces latencies)."""
    tag = uuid.uuid4().hex[:8]
    sets = {mode: Workers(url, f"bsb{mode[0]}{tag}", tmp / f"ws-{mode}-{tag}", 1, 4, mode) for mode in ("process",
            "namespaces")}  # fmt: skip
    out: dict[str, list[float]] = {mode: [] for mode in sets}
    try:
        for workers in sets.values():
            await workers.wait_ready()
        async with (
            riverbed.connect(url, prefix=sets["process"].keys.prefix) as p_bus,
            riverbed.connect(url, prefix=sets["namespaces"].keys.prefix) as n_bus,
        ):
            actors = {
                mode: _actor(bus.session("s0"), events.CmdRun(command="true"))
                for mode, bus in (("process", p_bus), ("namespaces", n_bus))
            }
            for fn in actors.values():
                await fn()  # the take-over and the sandbox's start are not measured
            for _ in range(rounds):
                for mode, fn in actors.items():
                    await _timed(fn, per_round, out[mode])
    finally:
        for workers in sets.values():
            workers.stop()
    return out["process"], out["namespaces"]


async def _redis_instructions(tmp: Path, counter: Callgrind) -> Result:
    """Redis's instructions per act round trip against the floor's (``BENCH_ROUNDTRIP_CALLGRIND=DIR``):
    two rounds of each side, one session, on a second private redis-server under callgrind that
    counts only while a side's round goes on."""
    print("bench.roundtrip: counting Redis's instructions under callgrind", file=sys.stderr, flush=True)
    with _redis_under(counter) as (url, pid):
        counted = _Counted(counter, pid)
        await _phase(url, tmp, 1, 1, rounds=2, per_session=CALLGRIND_SAMPLES, counted=counted)
    rb, floor = counted.per_trip("riverbed"), counted.per_trip("floor")
    return Result(
        "act round trip, Redis's instructions per round trip (1 session, callgrind)",
        "instructions",
        rb,
        floor,
        "the floor's",
        rb / floor,
        None,
        counted.trips["riverbed"],
        better="lower",
        note=f"{counted.trips['riverbed']} round trips of each side, redis-server under callgrind counting only "
        "during a side's rounds (the runtime worker's own rounds, renewals and heartbeats, fall in both sides' "
        f"counts); the counts are in {counter.directory}, for callgrind_annotate",
    )


@contextmanager
def _redis_under(counter: Callgrind) -> Iterator[tuple[str, int]]:
    """A private redis-server under ``counter``'s callgrind, counting nothing yet: (its URL, its pid)."""
    port = services.free_port()
    command = [services.redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(counter.directory)]  # fmt: skip
    log = counter.directory / "redis.valgrind.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([*counter.wrap("redis"), *command], stdout=out, stderr=subprocess.STDOUT)
    try:
        try:
            services.wait_for_redis(port, 120, proc)
        except ServiceError as exc:
            raise SystemExit(
                f"bench.roundtrip: redis-server under callgrind did not start ({exc}); see {log}"
            ) from None
        yield f"redis://127.0.0.1:{port}/0", proc.pid
    finally:
        stop_processes([proc], 60)


async def measure(url: str, args: argparse.Namespace) -> list[Result]:
    repeats = max(args.repeats, 1)
    grind = os.environ.get("BENCH_ROUNDTRIP_CALLGRIND")
    if grind and shutil.which("valgrind") is None:
        raise SystemExit("bench.roundtrip: BENCH_ROUNDTRIP_CALLGRIND needs valgrind on PATH (apt install valgrind)")
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="riverbed-bench-rt-") as tmp_name:
        tmp = Path(tmp_name)

        # Latency: one session, one worker; alternating rounds of sequential round trips.
        per_round = LATENCY_SAMPLES // (2 if args.quick else 1)
        one_write: list[float] = []
        cpu: dict[str, Cpu] = {}
        _r, _b, raw_lat, rb_lat, _w = await _phase(
            url, tmp, 1, 1, rounds=repeats, per_session=per_round, one_write_lat=one_write, cpu=cpu
        )
        raw_ms, rb_ms = _ms(raw_lat), _ms(rb_lat)
        samples = len(rb_ms)
        floor = "XREADGROUP ping-pong"
        p50_raw, p50_rb = percentile(raw_ms, 50), percentile(rb_ms, 50)
        p99_raw, p99_rb = percentile(raw_ms, 99), percentile(rb_ms, 99)
        results.append(
            Result("act round trip p50 (1 session)", "ms", p50_rb, p50_raw, floor, p50_rb / p50_raw, 2.0, samples,
                   better="lower")
        )  # fmt: skip
        results.append(
            Result("act round trip p99 (1 session)", "ms", p99_rb, p99_raw, floor, p99_rb / p99_raw, None, samples,
                   better="lower")
        )  # fmt: skip
        # Each run is one round: its riverbed samples beside the floor's, taken just before or
        # after them (one session: a round adds ``per_round`` samples to each side).
        runs = [
            (percentile(rb_ms[i : i + per_round], 50), percentile(raw_ms[i : i + per_round], 50))
            for i in range(0, samples, per_round)
        ]
        for number, (rb, raw) in enumerate(runs, start=1):
            results.append(
                Result(f"act round trip p50, run {number} of {len(runs)}", "ms", rb, raw, floor, rb / raw,
                       RUN_RATIO_GOAL, per_round, better="lower")
            )  # fmt: skip
        rb, raw = max(runs, key=lambda run: run[0] / run[1])
        results.append(
            Result(f"act round trip p50, worst of {len(runs)} runs", "ms", rb, raw, floor, rb / raw, RUN_RATIO_GOAL,
                   len(runs), better="lower", note=f"the run whose p50 ratio is the highest, of {per_round} round "
                   "trips of each side")
        )  # fmt: skip
        rb_cpu, floor_cpu = cpu["riverbed"].per_trip_us(), cpu["floor"].per_trip_us()
        results.append(
            Result("act round trip, CPU of all the processes per round trip (1 session)", "µs", sum(rb_cpu),
                   sum(floor_cpu), floor, sum(rb_cpu) / sum(floor_cpu), None, cpu["riverbed"].trips, better="lower",
                   note="the client, the runtime worker and Redis: {:.0f}, {:.0f} and {:.0f} µs; the floor's client, "
                   "responder and Redis: {:.0f}, {:.0f} and {:.0f} µs".format(*rb_cpu, *floor_cpu))
        )  # fmt: skip
        rb_side, floor_side = cpu["riverbed"], cpu["floor"]
        scripts, inner = rb_side.command_us(lambda name: name == "evalsha"), rb_side.command_us(SCRIPTED.__contains__)
        rb_redis = rb_side.command_us(lambda name: name not in SCRIPTED)
        results.append(
            Result("act round trip, Redis's time in commands per round trip (1 session)", "µs", rb_redis,
                   floor_side.command_us(), "the floor's commands", rb_redis / floor_side.command_us(), None,
                   rb_side.trips, better="lower",
                   note=f"INFO commandstats over the same rounds: riverbed's append scripts {scripts:.1f} µs, of "
                   f"which the commands they call {inner:.1f} µs (the rest is Lua and calling: {scripts - inner:.1f} "
                   f"µs), its reads {rb_redis - scripts:.1f} µs; Redis runs one command at a time, so each µs is on "
                   "the round trip's path")
        )  # fmt: skip
        p50_ow = percentile(_ms(one_write), 50)
        results.append(
            Result("act round trip p50 vs a one-write floor", "ms", p50_rb, p50_ow, "one-write ping-pong",
                   p50_rb / p50_ow, None, samples, better="lower",
                   note="a floor that sends each request with its wait, and each reply with the next read, in one "
                   "write (two trips to Redis per round trip, as riverbed makes)")
        )  # fmt: skip
        if grind:
            results.append(await _redis_instructions(tmp, Callgrind(Path(grind))))
        _r, _b, raw_lat, rb_lat, _w = await _phase(
            url, tmp, 1, 1, rounds=max(repeats // 2, 1), per_session=per_round, runtime_only=True
        )
        p50_raw, p50_rb = percentile(_ms(raw_lat), 50), percentile(_ms(rb_lat), 50)
        results.append(
            Result("act round trip p50, runtime role only", "ms", p50_rb, p50_raw, floor, p50_rb / p50_raw, None,
                   len(rb_lat), better="lower",
                   note="no memory/condenser owner: the session stays announced to those roles "
                   "(re-announced at most every 2 s)")
        )  # fmt: skip

        # Throughput: 200 sessions over 2 workers.
        sessions = 100 if args.quick else 200
        raw_rates, rb_rates, raw_lat, rb_lat, _w = await _phase(
            url, tmp, sessions, 2, rounds=THROUGHPUT_ROUNDS_PER_REPEAT * repeats, per_session=10
        )
        ratios = [b / a for a, b in zip(raw_rates, rb_rates, strict=True)]
        results.append(
            Result(f"throughput, {sessions} sessions / 2 workers", "actions/s", statistics.median(rb_rates),
                   statistics.median(raw_rates), f"{sessions} ping-pongs / 2 procs", statistics.median(ratios), None,
                   len(rb_rates))
        )  # fmt: skip
        raw_ms, rb_ms = _ms(raw_lat), _ms(rb_lat)
        results.append(
            Result(f"round trip p99, {sessions} sessions / 2 workers", "ms", percentile(rb_ms, 99),
                   percentile(raw_ms, 99), f"{sessions} ping-pongs / 2 procs",
                   percentile(rb_ms, 99) / percentile(raw_ms, 99), None, len(rb_ms), better="lower")
        )  # fmt: skip

        # Scale: 1,000 sessions over 4 workers; nobody starved.
        sessions = 250 if args.quick else 1000
        _r, rb_rates, raw_lat, rb_lat, warm = await _phase(url, tmp, sessions, 4, rounds=1, per_session=5)
        raw_ms, rb_ms = _ms(raw_lat), _ms(rb_lat)
        label = f"{sessions} ping-pongs / 4 procs"
        results.append(
            Result(f"round trip p99, {sessions} sessions / 4 workers", "ms", percentile(rb_ms, 99),
                   percentile(raw_ms, 99), label, percentile(rb_ms, 99) / percentile(raw_ms, 99), None, len(rb_ms),
                   better="lower")
        )  # fmt: skip
        results.append(
            Result(f"round trip max, {sessions} sessions / 4 workers", "ms", max(rb_ms), max(raw_ms), label,
                   max(rb_ms) / max(raw_ms), None, len(rb_ms), better="lower")
        )  # fmt: skip
        results.append(
            Result(f"first answer of all {sessions} sessions (takeover)", "ms", warm * 1000, max(raw_ms),
                   label + " max", warm * 1000 / max(raw_ms), None, sessions, better="lower")
        )  # fmt: skip

        # Sandbox: cmd_run through namespaces against through plain processes.
        process_lat, ns_lat = await _sandboxes(url, tmp, rounds=repeats, per_round=per_round // 2)
        p50_p, p50_n = percentile(_ms(process_lat), 50), percentile(_ms(ns_lat), 50)
        results.append(
            Result("cmd_run round trip p50, namespaces sandbox", "ms", p50_n, p50_p, "process sandbox",
                   p50_n / p50_p, 1.1, len(ns_lat), better="lower")
        )  # fmt: skip
    return results


def main() -> int:
    if sys.argv[1:2] == ["--responder"]:
        responder_main(sys.argv[2:])
        return 0
    return run_alone(measure, "Action round trips through runtime workers against a Redis ping-pong.")


if __name__ == "__main__":
    raise SystemExit(main())

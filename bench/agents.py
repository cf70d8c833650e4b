"""Detached runs served by the agent role: its overhead per step, runs per second, Redis connections.

1,000 runs are opened at once (``open_run``: the task's ``message`` and a ``run_started``,
as ``riverbed agent SESSION TASK --detach`` does) over 4 agent worker processes (``python -m
riverbed.workers agent``, what ``riverbed worker agent`` runs), each owning a quarter of them,
and 2 runtime worker processes (plain-process sandboxes) that answer their actions.  The model
is ``bench/model_server.py`` in a process of its own: every chat completion takes 200 ms;
steps 1 to 9 of a run answer one tool call, step 10 answers a text, which the role appends as
the run's ``finish``.  The tool call (``--action``) is a ``file_read`` of a 200-byte file by
default: a real action round trip through the runtime role, and the cheapest (no process
runs); ``--action cmd_run`` makes it a ``cmd_run`` of ``true`` in the session's shell (a bash
per session, and on a busy machine several times the runtime's CPU per action).

Step ``k`` of a run is *due* when the log says it is the agent's move: its ``run_started``
for step 1, else the observation answering step ``k - 1``'s action.  It is done when the role
appended its action (the ``file_read``, or the ``finish``).  From the events' stamps and
the model server's journal (when each request's body was read, when its answer was written):

- **the agent role's overhead per step** = done - due - the model latency (the journal's
  written - read for that step).  It is everything the role does for a step: noticing the
  answer, folding it, building the prompt, the HTTP client on both sides of the call,
  recording the ``llm_response``, appending the action, and any wait for a CPU.  Step 1 is
  left out: it also holds the run's wait for a worker with room and taking the session (a
  worker takes on runs while its CPU keeps up with them: ``docs/agents.md``);
- **the floor** beside it, per step of the same run: the model latency plus the action round
  trip (the action appended -> its observation appended, the runtime role's work);
- **a run's time**, from its ``run_started`` to its ``finish`` (p50), beside its steps at the
  floor's median; its wait to start (``run_started`` -> its first model request) in the notes;
- **runs completed per second**: runs / (the last run's end - the first run's ``run_started``);
  beside it, the floor's rate: every run at once, each step taking the floor's median;
- **Redis connections per agent worker**: ``CLIENT LIST`` by the name every connection of a
  worker carries, sampled while the runs go on (the most of any sample, the most of the 4).

The CPU time the agent workers used during the runs, per step, is reported too (beside
it the runtime workers' per action): on a shared machine it says what the role costs where
the wall-clock figures also hold the waits for a CPU.  With ``BENCH_AGENTS_PROFILE=DIR`` the
agent workers run under ``cProfile`` and write ``DIR/NAME.prof`` when they stop.

Before them, one run per agent worker goes alone, and its overhead per step is reported
beside the big one's: the role's own latency, without the queue for a CPU that 1,000 runs at
once make.

A floor measured on idle workers before the runs (a client calling the model server, then
acting the same action) is in the notes.

With ``--tools`` each step's tool call is a Python tool of a hosted agent (``bench/tool_agent.py``,
which the agent workers host with ``RIVERBED_AGENTS``): the agent worker claims the call, runs it
and appends its ``tool_result``, so the action round trip is the agent role's own.

Run alone: ``python -m bench.agents [--runs N] [--steps N] [--workers N] [--action A] [--tools] [--json]``
(``--quick``: 100 runs).  Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import anyio
import msgspec
import redis.asyncio as aioredis
from openai import AsyncOpenAI

import riverbed
from bench.common import Result, percentile, run_alone
from bench.model_server import task_text
from bench.roundtrip import FILE_NAME, Workers, _prepare_workspace
from bench.tool_agent import bench_agent
from riverbed import events
from riverbed.agent.hosted import RunLimits, open_run
from riverbed.agent.runs import RunSummary

RUNS = 1000
STEPS = 10
WORKERS = 4
RUNTIME_WORKERS = 2
LATENCY = 0.2
MODEL = "bench-model"
TARGET_OVERHEAD_MS = 10.0
TARGET_CONNECTIONS = 20
IDLE_ROUNDS = 20


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class _ModelServer:
    """``python -m bench.model_server`` as a child process."""

    def __init__(self, log_dir: Path, steps: int, action: str) -> None:
        self.log = (log_dir / "model-server.log").open("wb")
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "bench.model_server", "--latency", str(LATENCY)),
                *("--steps", str(steps), "--action", action),
            ],
            stdout=subprocess.PIPE,
            stderr=self.log,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode().split()
        if len(line) != 2 or line[0] != "port":
            self.stop()
            raise RuntimeError(f"the model server did not start; see {self.log.name}")
        self.base_url = f"http://127.0.0.1:{line[1]}/v1"

    def journal(self) -> tuple[list[tuple[str | None, int, float, float]], int]:
        """Every chat request (session, step, read, written) and the connections accepted."""
        with urllib.request.urlopen(self.base_url.removesuffix("/v1") + "/journal", timeout=60) as reply:
            journal = json.loads(reply.read())
        return [tuple(row) for row in journal["calls"]], journal["connections"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


async def _connections(url: str, names: list[str]) -> dict[str, int]:
    client = aioredis.Redis.from_url(url)
    try:
        listed = await client.client_list()
    finally:
        await client.aclose()
    counts = dict.fromkeys(names, 0)
    for entry in listed:
        name = entry.get("name", "").removeprefix("riverbed:")
        if name in counts:
            counts[name] += 1
    return counts


async def _idle_floor(bus: riverbed.Bus, base_url: str, action: events.Action) -> tuple[float, float]:
    """Median seconds of a model call and of acting ``action`` from a client, workers idle."""
    client = AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0)
    session = bus.session("idle-floor")
    model, acted = [], []
    try:
        for _ in range(IDLE_ROUNDS):
            started = time.perf_counter()
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "floor"}])
            called = time.perf_counter()
            answer = await session.act(action, timeout=60)
            if isinstance(answer, events.Error) or (isinstance(answer, events.CmdOutput) and answer.exit_code != 0):
                raise RuntimeError(f"the runtime answered {answer!r}")
            model.append(called - started)
            acted.append(time.perf_counter() - called)
    finally:
        await client.close()
    return statistics.median(model[1:]), statistics.median(acted[1:])


async def _wait_for_runs(
    bus: riverbed.Bus, url: str, sessions: list[str], names: list[str], steps: int
) -> tuple[dict[str, RunSummary], dict[str, int]]:
    """Poll the run summaries until every run ended; sample the workers' connections meanwhile."""
    remaining = list(sessions)
    done: dict[str, RunSummary] = {}
    steps_seen: dict[str, int] = {}
    most = dict.fromkeys(names, 0)
    last_report = 0.0
    with anyio.fail_after(max(600.0, len(sessions) * steps * 0.5)):
        while remaining:
            await anyio.sleep(1.0)
            async with bus.redis.pipeline(transaction=False) as pipe:
                for session in remaining:
                    pipe.get(bus.keys.run(session))
                replies = await pipe.execute()
            left = []
            for session, raw in zip(remaining, replies, strict=True):
                summary = msgspec.json.decode(raw, type=RunSummary) if raw else None
                if summary is not None:
                    steps_seen[session] = summary.steps
                if summary is not None and summary.state != "running":
                    done[session] = summary
                else:
                    left.append(session)
            remaining = left
            for name, count in (await _connections(url, names)).items():
                most[name] = max(most[name], count)
            if time.monotonic() - last_report >= 5 or not remaining:
                last_report = time.monotonic()
                _progress(
                    f"agents: {len(done):,}/{len(sessions):,} runs ended, "
                    f"{sum(steps_seen.values()):,} model calls; connections now at most {max(most.values())}"
                )
    return done, most


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / tick


def _all_finished(summaries: dict[str, RunSummary]) -> None:
    unfinished = {s: m for s, m in summaries.items() if m.state != "finished"}
    if unfinished:
        session, summary = next(iter(unfinished.items()))
        raise RuntimeError(
            f"{len(unfinished)} runs did not finish; {session}: {summary.state} ({summary.reason}) {summary.detail}"
        )


def _ts(event: events.Event) -> float:
    return event.ts.timestamp()


class _Steps:
    """Per-step figures of every run, from the logs and the model server's journal."""

    def __init__(self) -> None:
        self.overhead: list[float] = []
        self.before_call: list[float] = []
        self.after_call: list[float] = []
        self.floor: list[float] = []
        self.model: list[float] = []
        self.action: list[float] = []
        self.first: list[float] = []
        self.opened: list[float] = []
        self.ended: list[float] = []
        self.waited: list[float] = []
        """per run: its run_started -> its first model request read (the wait for a worker with room)"""
        self.lasted: list[float] = []
        """per finished run: its run_started -> its finish"""
        self.unmatched = 0

    def add_run(self, session: str, log: list[events.Event], journal: dict[tuple[str, int], tuple[float, float]]):
        by_cause: dict[int, events.Event] = {}
        responses: list[events.LlmResponse] = []
        started: events.RunStarted | None = None
        for event in log:
            if isinstance(event, events.RunStarted):
                started = event
            elif isinstance(event, events.LlmResponse):
                responses.append(event)
            elif event.cause is not None and isinstance(event, events.Action | events.Observation):
                by_cause.setdefault(event.cause, event)  # (an action's cause: its response; an answer's: its action)
        if started is None:
            raise RuntimeError(f"session {session} has no run_started")
        self.opened.append(_ts(started))
        due = _ts(started)
        for step, response in enumerate(responses, start=1):
            assert response.id is not None
            action = by_cause.get(response.id)
            call = journal.get((session, step))
            if action is None or call is None:
                self.unmatched += 1
                break
            received, sent = call
            if step == 1:
                self.waited.append(received - _ts(started))
            model = sent - received
            overhead = _ts(action) - due - model
            answer = by_cause.get(action.id) if action.id is not None else None
            if step == 1:
                self.first.append(overhead)
            else:
                self.overhead.append(overhead)
                self.before_call.append(received - due)
                self.after_call.append(_ts(action) - sent)
            self.model.append(model)
            if isinstance(action, events.Finish):
                self.ended.append(_ts(action))
                self.lasted.append(_ts(action) - _ts(started))
                self.floor.append(model)
                break
            if answer is None:
                self.unmatched += 1
                break
            self.action.append(_ts(answer) - _ts(action))
            self.floor.append(model + _ts(answer) - _ts(action))
            due = _ts(answer)


async def _read_logs(bus: riverbed.Bus, sessions: list[str]) -> dict[str, list[events.Event]]:
    logs: dict[str, list[events.Event]] = {}
    limiter = anyio.CapacityLimiter(50)

    async def read(session: str) -> None:
        async with limiter:
            logs[session] = [e async for e in bus.log_store.read(session, 1)]

    async with anyio.create_task_group() as tg:
        for session in sessions:
            tg.start_soon(read, session)
    return logs


async def measure(url: str, args: argparse.Namespace) -> list[Result]:
    runs = getattr(args, "runs", None) or (100 if args.quick else RUNS)
    steps = getattr(args, "steps", None) or STEPS
    count = getattr(args, "workers", None) or WORKERS
    runtime_count = getattr(args, "runtime_workers", None) or RUNTIME_WORKERS
    tools = bool(getattr(args, "tools", False))
    kind = "note" if tools else getattr(args, "action", None) or "file_read"
    action: events.Action = events.FileRead(path=FILE_NAME) if kind != "cmd_run" else events.CmdRun(command="true")
    agent = bench_agent if tools else None
    if runs < 1 or steps < 2 or count < 1 or runtime_count < 1:
        print("bench.agents: --runs and the worker counts must be at least 1, --steps at least 2", file=sys.stderr)
        raise SystemExit(2)
    prefix = f"bag{uuid.uuid4().hex[:6]}"
    sessions = [f"run-{i}" for i in range(runs)]
    solo = [f"solo-{i}" for i in range(count)]
    with tempfile.TemporaryDirectory(prefix="riverbed-bench-agents-") as tmp:
        workspace = Path(tmp) / "workspace"
        workspace.mkdir()
        _progress(
            f"agents: the model server ({_ms(LATENCY):.0f} ms a call), {count} agent + {runtime_count} runtime workers"
        )
        for session in [*sessions, *solo, "idle-floor"]:
            _prepare_workspace(workspace, session)
        server = _ModelServer(Path(tmp), steps, kind)
        agents: Workers | None = None
        runtimes: Workers | None = None
        try:
            model_env = {"OPENAI_BASE_URL": server.base_url, "OPENAI_API_KEY": "bench", "RIVERBED_LLM_MODEL": MODEL}
            if tools:
                model_env["RIVERBED_AGENTS"] = "bench.tool_agent"
            capacity = math.ceil(runs / runtime_count) + len(solo) + 1
            runtimes = Workers(url, prefix, workspace, runtime_count, capacity, "process")
            profile = os.environ.get("BENCH_AGENTS_PROFILE")
            agents = Workers(
                url,
                prefix,
                workspace,
                count,
                math.ceil(runs / count),
                "process",
                roles=("agent",),
                env=model_env,
                profile=Path(profile) if profile else None,
            )
            await runtimes.wait_ready(timeout=120)
            await agents.wait_ready(timeout=120)
            async with riverbed.connect(url, prefix=prefix) as bus:
                idle_model, idle_action = await _idle_floor(bus, server.base_url, action)
                _progress(f"agents: idle floor: model call {_ms(idle_model):.1f} ms, {kind} {_ms(idle_action):.1f} ms")
                _progress(f"agents: {len(solo)} runs at once first, on workers otherwise idle")
                for session in solo:
                    await open_run(
                        bus, session, task_text(session, steps), limits=RunLimits(max_steps=steps), agent=agent
                    )
                _all_finished((await _wait_for_runs(bus, url, solo, agents.names, steps))[0])
                limiter = anyio.CapacityLimiter(50)
                agent_pids, runtime_pids = [p.pid for p in agents.procs], [p.pid for p in runtimes.procs]
                cpu_before = _cpu_seconds(agent_pids), _cpu_seconds(runtime_pids), _cpu_seconds([server.proc.pid])
                opening = time.perf_counter()

                async def start(session: str) -> None:
                    async with limiter:
                        await open_run(
                            bus, session, task_text(session, steps), limits=RunLimits(max_steps=steps), agent=agent
                        )

                async with anyio.create_task_group() as tg:
                    for session in sessions:
                        tg.start_soon(start, session)
                _progress(f"agents: {runs:,} runs opened in {time.perf_counter() - opening:.1f} s")
                summaries, most = await _wait_for_runs(bus, url, sessions, agents.names, steps)
                cpu_after = _cpu_seconds(agent_pids), _cpu_seconds(runtime_pids), _cpu_seconds([server.proc.pid])
                cpu = tuple(after - before for after, before in zip(cpu_after, cpu_before, strict=True))
                runtime_connections = await _connections(url, runtimes.names)
                _all_finished(summaries)
                _progress("agents: reading the logs and the model server's journal")
                logs = await _read_logs(bus, [*sessions, *solo])
                journal: dict[tuple[str, int], tuple[float, float]] = {}
                calls, connected = server.journal()
                for session, step, received, sent in calls:
                    if session is not None:
                        journal[(session, step)] = (received, sent)
                found = [k async for k in bus.redis.scan_iter(match=f"{prefix}:*", count=1000)]
                for begin in range(0, len(found), 500):
                    await bus.redis.delete(*found[begin : begin + 500])
        except BaseException:
            for workers in (agents, runtimes):
                for name in workers.names if workers is not None else []:
                    tail = (workspace.parent / f"{name}.log").read_bytes().splitlines()[-10:]
                    _progress(f"--- {name} (last lines) ---\n" + b"\n".join(tail).decode(errors="replace"))
            raise
        finally:
            for workers in (agents, runtimes):
                if workers is not None:
                    workers.stop()
            server.stop()
    figures, alone = _Steps(), _Steps()
    for session in sessions:
        figures.add_run(session, logs[session], journal)
    for session in solo:
        alone.add_run(session, logs[session], journal)
    http = (connected, len(calls))
    return _results(
        figures, runs, steps, count, most, runtime_connections, idle_model, idle_action, cpu, http, kind, alone
    )


def _ms(seconds: float) -> float:
    return seconds * 1000


def _results(
    figures: _Steps,
    runs: int,
    steps: int,
    count: int,
    most: dict[str, int],
    runtime_connections: dict[str, int],
    idle_model: float,
    idle_action: float,
    cpu: tuple[float, ...],
    http: tuple[int, int],
    kind: str,
    alone: _Steps,
) -> list[Result]:
    if not figures.overhead:
        raise RuntimeError("no step could be measured (the logs and the journal do not match)")
    over50, over99 = percentile(figures.overhead, 50), percentile(figures.overhead, 99)
    floor50, floor99 = percentile(figures.floor, 50), percentile(figures.floor, 99)
    window = max(figures.ended) - min(figures.opened)
    rate = runs / window
    floor_rate = runs / (steps * floor50)
    owned = math.ceil(runs / count)
    connections = max(most.values())
    lasted = percentile(figures.lasted, 50)
    where = (
        f"{len(figures.overhead):,} steps (step 1 of each run left out); before the model call (the answer on the log "
        f"-> the request read by the model server) p50 {_ms(percentile(figures.before_call, 50)):.1f} ms, after it "
        f"(the answer written -> the action on the log) p50 {_ms(percentile(figures.after_call, 50)):.1f} ms; "
        f"the floor's parts p50: model {_ms(percentile(figures.model, 50)):.1f} ms, action round trip "
        f"{_ms(percentile(figures.action, 50)):.1f} ms; idle floor (one client, workers idle): model call "
        f"{_ms(idle_model):.1f} ms + {kind} {_ms(idle_action):.1f} ms"
    )
    if figures.unmatched:
        where += f"; {figures.unmatched} steps without a journal entry or an action were left out"
    agent_cpu, runtime_cpu, server_cpu = cpu
    calls, actions = len(figures.model), len(figures.action)
    shape = f"{runs:,} detached runs of {steps} steps at once on {count} agent workers"
    return [
        Result(
            f"agent role overhead per step, p50 ({shape})", "ms", _ms(over50), _ms(floor50),
            "the floor: model latency + action round trip, p50", over50 / floor50, TARGET_OVERHEAD_MS,
            len(figures.overhead), better="lower", target_on="figure", note=where,
        ),
        Result(
            "agent role overhead per step, p99", "ms", _ms(over99), _ms(floor99), "the floor, p99", over99 / floor99,
            None, len(figures.overhead), better="lower",
            note=f"step 1 (run_started -> its action, taking the session included) p50 "
            f"{_ms(percentile(figures.first, 50)):.0f} ms, p99 {_ms(percentile(figures.first, 99)):.0f} ms",
        ),
        Result(
            f"same, p50, {count} runs at once first (the workers otherwise idle)", "ms",
            _ms(percentile(alone.overhead, 50)), _ms(percentile(alone.floor, 50)), "the floor of those steps, p50",
            percentile(alone.overhead, 50) / percentile(alone.floor, 50), None, len(alone.overhead), better="lower",
            note=f"p99 {_ms(percentile(alone.overhead, 99)):.1f} ms; before the model call p50 "
            f"{_ms(percentile(alone.before_call, 50)):.1f} ms, after it {_ms(percentile(alone.after_call, 50)):.1f} ms",
        ),
        Result(
            "agent workers' CPU time per step", "ms", _ms(agent_cpu / calls), _ms(runtime_cpu / actions),
            f"the runtime workers' per action ({kind})", agent_cpu / calls / (runtime_cpu / actions), None,
            calls, better="lower",
            note=f"during the runs: agent workers {agent_cpu:.1f} s, runtime workers {runtime_cpu:.1f} s, "
            f"the model server {server_cpu:.1f} s of CPU; it accepted {http[0]:,} connections for {http[1]:,} calls; "
            f"{os.getloadavg()[0]:.1f} load average (1 min) at the end",
        ),
        Result(
            "a run, run_started -> its finish, p50", "s", lasted, steps * floor50,
            f"its {steps} steps at the floor's p50, no wait to start", lasted / (steps * floor50),
            None, len(figures.lasted), better="lower",
            note=f"p99 {percentile(figures.lasted, 99):.1f} s; of which the wait for a worker with room (run_started "
            f"-> its first model request) p50 {percentile(figures.waited, 50):.1f} s, p99 "
            f"{percentile(figures.waited, 99):.1f} s: a worker takes on runs while its CPU keeps up (docs/agents.md)",
        ),
        Result(
            "runs completed per second", "runs/s", rate, floor_rate,
            f"every run at once, {steps} steps at the floor's p50", rate / floor_rate, None, runs,
            note=f"{runs:,} runs in {window:.1f} s from the first run_started to the last finish",
        ),
        Result(
            f"Redis connections per agent worker ({owned:,} runs each; the most of the {count})", "connections",
            connections, owned, "a connection per owned run", connections / owned, TARGET_CONNECTIONS, 1,
            better="lower", target_on="figure",
            note=f"each agent worker, most while the runs went on: {sorted(most.values())}; "
            f"each runtime worker at the end: {sorted(runtime_connections.values())}",
        ),
    ]  # fmt: skip


def main() -> int:
    return run_alone(measure, "Detached runs served by the agent role: overhead per step, runs/s, connections.")


if __name__ == "__main__":
    raise SystemExit(main())

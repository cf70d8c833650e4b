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
  worker carries, sampled while the runs go on (the most of any sample, the most of the 4);
- **RSS per agent worker**: ``VmRSS``, sampled with the connections (the most), beside the
  same worker idle after its first run;
- **the longest wait of a run to start** (``run_started`` -> its first model request; target
  5 s), beside the longest of the runs that went alone first; with ``--tenants N`` the runs
  are spread over N tenants in turn (each made as ``riverbed tenants set T --max-runs 0`` makes
  one, and each run opened for its tenant as the HTTP API opens a tenant key's run: the session
  belongs to the tenant, and a worker gives a tenant at most ``RIVERBED_TENANT_SHARE`` of its
  runs), and each tenant's p50 and longest wait are printed: the fairness among them.

``--latency S`` sets the model's time per call (default 0.2 s).  The speed issue's figure is
``python -m bench agents --runs 10000 --workers 4 --latency 2.0 --tenants 10 --steps 5``.  On a
2-core VM shared with other work (2026-11-29, ``docs/benchmarks.md``) it did not finish: the
CPU was the limit (a step cost about 27 ms of CPU in all there, agent, runtime, Redis and the
model server; 5,000 steps a second asked for), and the pace left runs waiting minutes to start.
1,000 runs: overhead p50 32 ms, p99 5.9 s, the longest wait to start 305 s, every tenant's p50
within 5% of the others', 17 Redis connections and 120 MiB per agent worker.

The CPU time the agent workers used during the runs, per step, is reported too (beside
it the runtime workers' per action; the model server's and Redis's in the note, with the agent
workers' CPU while idle just before): on a shared machine it says what the role costs where
the wall-clock figures also hold the waits for a CPU.  With ``BENCH_AGENTS_PROFILE=DIR`` the
agent workers run under ``cProfile`` timed by their CPU clock (``bench/cpu_profile.py``: a wait for a
CPU or the network counts nothing) and write ``DIR/NAME.prof`` when they stop.  With
``BENCH_AGENTS_PYSPY=DIR`` each round's runs are sampled instead by ``py-spy record`` (on
``PATH`` or beside the bench's Python; the stacks on a CPU only) into ``DIR/NAME-ROUND.txt``,
and the functions most on a CPU are printed with the progress.  With
``BENCH_AGENTS_CALLGRIND=DIR`` and ``--context``, the agent workers run under callgrind, which
counts their instructions between each round's gates (its later steps) and prints them per step
with the progress: a count that moves little from one run to the next, where CPU time on a
shared machine moves by a fifth (the workers run some fifty times slower meanwhile: with
``--workers 1 --runs 50``, a round takes a few minutes).

``--context 20,2000`` seeds each run's session first with about that many events of earlier
turns, as the agent writes them (a user message; three steps of an ``llm_response`` whose tool
call carries an id, the action with that ``tool_call_id`` and the response as its cause, and
its observation; a last response and its ``finish``).  Per size, one round of runs (100 by
default) goes on the same workers, each run on a session of its own.  The model server holds
each run's first model call until every run is at its first (each session taken: its whole log
read and its first prompt made), and each run's last call until every run is at its last:
between the two, the agent workers do the runs' later steps and nothing else, so their CPU then
per model call is a *later step's* own (its note says how much of it the kernel's was: the
socket writes and reads, which on one machine also carry the receiving side's loopback TCP), and
their CPU before it, per run, is taking a session.  With two sizes or more, a last round runs
the smallest size again with its first message padded so that its prompt is as long in bytes
as the largest size's: what a later step costs more at
the largest size than there is its events' cost, not its bytes'.  Then the largest size's
figures against the smallest's (goals: 1.2x for a later step's CPU, and 1 ms of CPU a step;
the overhead's ratio has none: at 2,000 events the round asks more of a 2-core machine's CPUs
than they have, so it holds the waits for one).  The seeded sessions' condenser config is
``noop`` (a ``session_config`` first): nothing is condensed, every prompt holds the whole context.
Every role's consumer group starts past the seeded events, as after the runs that wrote them, so
the runtime role does not run them again.  The model server reads only the fields it needs of a request (a 300 KB
prompt of 2,000 events had cost it 5 ms of CPU to parse whole, and the machine's CPU is shared).

Before them, one run per agent worker goes alone, and its overhead per step is reported
beside the big one's: the role's own latency, without the queue for a CPU that 1,000 runs at
once make.

A floor measured on idle workers before the runs (a client calling the model server, then
acting the same action) is in the notes.

With ``--tools`` each step's tool call is a Python tool of a hosted agent (``bench/tool_agent.py``,
which the agent workers host with ``RIVERBED_AGENTS``): the agent worker claims the call, runs it
and appends its ``tool_result``, so the action round trip is the agent role's own.

Run alone: ``python -m bench.agents [--runs N] [--steps N] [--workers N] [--action A] [--tools]
[--latency S] [--tenants N] [--context N,N] [--json]`` (``--quick``: 100 runs).  Progress goes to
stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import msgspec
import redis.asyncio as aioredis
from msgspec.structs import replace
from openai import AsyncOpenAI

import riverbed
from bench.common import Callgrind, Result, cpu_seconds, percentile, redis_cpu, run_alone, stop_processes
from bench.model_server import task_text
from bench.roundtrip import FILE_NAME, Workers, _prepare_workspace
from bench.tool_agent import bench_agent
from riverbed import events
from riverbed.agent.hosted import RunLimits, open_run
from riverbed.agent.prompt import Prompt
from riverbed.agent.quotas import Quotas
from riverbed.agent.runs import RunSummary
from riverbed.bus.keys import AGENT_ROLE, ROLES
from riverbed.memory.view import view

RUNS = 1000
STEPS = 10
WORKERS = 4
RUNTIME_WORKERS = 2
LATENCY = 0.2
MODEL = "bench-model"
TARGET_OVERHEAD_MS = 10.0
TARGET_OVERHEAD_P99_MS = 100.0
TARGET_RSS_MIB = 300.0
TARGET_START_WAIT = 5.0
TARGET_CONTEXT_RATIO = 1.2
TARGET_CPU_MS = 1.0
TARGET_CONNECTIONS = 20
IDLE_ROUNDS = 20
IDLE_SECONDS = 2.0
"""How long the agent workers' CPU is watched, idle, before a round's runs open."""


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class _ModelServer:
    """``python -m bench.model_server`` as a child process."""

    def __init__(self, log_dir: Path, steps: int, action: str, latency: float) -> None:
        self.log = (log_dir / "model-server.log").open("wb")
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "bench.model_server", "--latency", str(latency)),
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

    def _call(self, method: str, path: str) -> dict[str, int]:
        request = urllib.request.Request(self.base_url.removesuffix("/v1") + path, method=method)
        with urllib.request.urlopen(request, timeout=60) as reply:
            answer: dict[str, int] = json.loads(reply.read())
        return answer

    def gates(self, action: str) -> None:
        """``close``: hold each run's first and last model calls from now on; ``release``: answer
        the calls held; ``open``: answer them and hold no more (``bench/model_server.py``)."""
        self._call("POST", f"/gates/{action}")

    async def gathered(self, runs: int, *, most: float = 300.0) -> int:
        """Wait until ``runs`` calls are held at a gate; the chat requests received so far."""
        with anyio.fail_after(most):
            while (held := self._call("GET", "/gates"))["held"] < runs:  # noqa: ASYNC110 (another process's)
                await anyio.sleep(0.02)
        return held["received"]

    def stop(self) -> None:
        stop_processes([self.proc], 10)
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


class _Sampled:
    """The most of each worker's Redis connections and of its RSS (MiB), over the samples taken."""

    def __init__(self, names: list[str]) -> None:
        self.connections = dict.fromkeys(names, 0)
        self.rss = dict.fromkeys(names, 0.0)

    async def sample(self, url: str, pids: dict[str, int]) -> None:
        for name, count in (await _connections(url, list(self.connections))).items():
            self.connections[name] = max(self.connections[name], count)
        for name, pid in pids.items():
            self.rss[name] = max(self.rss[name], _rss_mib(pid))


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _wait_for_runs(
    bus: riverbed.Bus, url: str, sessions: list[str], sampled: _Sampled, pids: dict[str, int], steps: int
) -> dict[str, RunSummary]:
    """Poll the run summaries until every run ended; sample the workers' connections and RSS meanwhile."""
    remaining = list(sessions)
    done: dict[str, RunSummary] = {}
    steps_seen: dict[str, int] = {}
    last_report = 0.0
    pause = max(1.0, len(sessions) / 2000)  # (10,000 summaries read every second are work for Redis too)
    with anyio.fail_after(max(600.0, len(sessions) * steps * 0.5)):
        while remaining:
            await anyio.sleep(pause)
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
            await sampled.sample(url, pids)
            if time.monotonic() - last_report >= 5 or not remaining:
                last_report = time.monotonic()
                _progress(
                    f"agents: {len(done):,}/{len(sessions):,} runs ended, {sum(steps_seen.values()):,} model calls; "
                    f"connections now at most {max(sampled.connections.values())}, RSS at most "
                    f"{max(sampled.rss.values()):.0f} MiB; load {os.getloadavg()[0]:.1f}"
                )
    return done


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
        self.wait_of: dict[str, float] = {}
        """session -> its run's wait to start"""
        self.unmatched = 0

    def add_run(
        self, session: str, log: list[events.Event], journal: dict[tuple[str, int], tuple[float, float]]
    ) -> None:
        by_cause: dict[int, events.Event] = {}
        responses: list[events.LlmResponse] = []
        started: events.RunStarted | None = None
        for event in log:
            if isinstance(event, events.RunStarted):
                started, responses = event, []  # (the bench's run is the session's last)
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
                self.wait_of[session] = received - _ts(started)
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


SEED_BATCH = 100
"""Events per append while seeding a session's earlier turns."""
NO_CONDENSING = {"strategy": "noop"}
"""The seeded sessions' condenser config: the whole context is every prompt's, never condensed."""
PADDING = "The spec the tests follow: each function f<n>(x) returns x + n, and the tests check both.\n"
"""The text a padded session's first message repeats."""


def _earlier_turns(size: int, tenant: str | None, pad: int = 0) -> list[events.Event]:
    """About ``size`` events of earlier turns, as the agent role writes them: a ``session_config``
    that turns condensing off, then turns of a user message, three steps (an ``llm_response``
    whose tool call carries an id, the action with that ``tool_call_id`` and the response as its
    cause, its observation) and a last response with its ``finish``; ids from 1.  ``pad``: about
    that many bytes more in the first user message (a prompt as long as a longer context's)."""
    out: list[events.Event] = [events.SessionConfig(condenser=NO_CONDENSING, source="user")]
    usage = {"prompt_tokens": 2000, "completion_tokens": 40, "total_tokens": 2040}
    for turn in range(max(1, round((size - 1) / 12))):
        said = f"earlier turn {turn}: make tests/test_mod{turn}.py pass"
        if turn == 0 and pad:
            said += "\n" + PADDING * (pad // len(PADDING) + 1)
        out.append(events.Message(content=said, source="user"))
        for k in range(3):
            call = f"call_seed_{len(out) + 1}"
            action: events.Action
            answer: events.Observation
            if k % 2 == 0:
                path = f"src/mod{turn}_{k}.py"
                action = events.FileRead(path=path, end=40, tool_call_id=call)
                text = "".join(f"def f{line}(x):\n    return x + {line}\n" for line in range(12))
                answer = events.FileContent(path=path, content=text, source="runtime")
                arguments = {"path": path, "end": 40}
            else:
                command = f"pytest tests/test_mod{turn}.py -q"
                action = events.CmdRun(command=command, tool_call_id=call)
                text = f"F.F.\nFAILED tests/test_mod{turn}.py::test_{k} - AssertionError: expected 3, got 2\n" * 4
                answer = events.CmdOutput(content=text, exit_code=1, command=command, source="runtime")
                arguments = {"command": command}
            function = {"name": action.kind, "arguments": json.dumps(arguments)}
            response_id = len(out) + 1
            out.append(
                events.LlmResponse(
                    model=MODEL, tool_calls=[{"id": call, "type": "function", "function": function}], usage=usage,
                    cause=len(out), agent="llm",
                )
            )  # fmt: skip
            out.append(replace(action, cause=response_id, agent="llm"))
            out.append(replace(answer, cause=response_id + 1))
        out.append(events.LlmResponse(model=MODEL, content=f"tests/test_mod{turn}.py passes now.", usage=usage,
                                      cause=len(out), agent="llm"))  # fmt: skip
        out.append(events.Finish(final_thought=f"turn {turn} done", cause=len(out), agent="llm"))
    return out if tenant is None else [replace(e, tenant=tenant) for e in out]


def _padded(taken: _Round) -> str:
    return f" (their first message {taken.pad:,} bytes longer)" if taken.pad else ""


def _prompt_bytes(size: int, pad: int = 0) -> int:
    """The bytes of the ``messages`` of the prompt that :func:`_earlier_turns` make."""
    seeded = [replace(e, id=i) for i, e in enumerate(_earlier_turns(size, None, pad), 1)]
    prompt = Prompt(system=None)
    prompt.update(seeded, view(seeded))
    return len(msgspec.json.encode(prompt.encoded()))


async def _seed(
    bus: riverbed.Bus, session: str, taken: _Round, tenant: str | None, limiter: anyio.CapacityLimiter
) -> None:
    batch = _earlier_turns(taken.context, tenant, taken.pad)
    async with limiter:
        for begin in range(0, len(batch), SEED_BATCH):
            await bus.log_store.append(session, batch[begin : begin + SEED_BATCH], expected_last=begin, tenant=tenant)
        # Every role's group past the earlier turns, as after the runs that wrote them: the runtime
        # role, which the seeded actions announce, does not run them again.
        for role in (*ROLES, AGENT_ROLE):
            await bus.redis.xgroup_create(bus.keys.log(session), role, id=f"{len(batch)}-0")


async def _settle(pids: list[int], *, most: float = 120.0) -> None:
    """Wait until the processes use less than a tenth of a CPU (the runtime role done with the
    seeded sessions' actions, all answered already), for at most ``most`` seconds."""
    deadline = time.monotonic() + most
    while time.monotonic() < deadline:
        before = cpu_seconds(pids)
        await anyio.sleep(1.0)
        if cpu_seconds(pids) - before < 0.1:
            return


def _py_spy() -> str | None:
    """``py-spy``: on ``PATH``, else beside this Python (installed into its environment)."""
    return shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))


class _Sampler:
    """``py-spy record`` of each agent worker while a round's runs go on (``BENCH_AGENTS_PYSPY=DIR``):
    the stacks on a CPU, 100 a second, whatever the machine's load, in ``DIR/NAME-ROUND.txt``."""

    def __init__(self, directory: Path, pids: dict[str, int]) -> None:
        self.directory = directory
        self.pids = pids
        self.procs: list[subprocess.Popen[bytes]] = []
        self.files: list[Path] = []
        directory.mkdir(parents=True, exist_ok=True)

    def start(self, label: str) -> None:
        spy = _py_spy() or "py-spy"
        self.files = [self.directory / f"{name}-{label}.txt" for name in self.pids]
        self.procs = [
            subprocess.Popen(
                [spy, "record", "--pid", str(pid), "--rate", "100", "--nonblocking", "--format", "raw", "-o", str(out)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for pid, out in zip(self.pids.values(), self.files, strict=True)
        ]

    def stop(self, label: str) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGINT)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        _progress(f"agents: where the agent workers' CPU went ({label}):\n{_sampled_top(self.files)}")


def _sampled_top(files: list[Path], rows: int = 25) -> str:
    """The functions most on a CPU in ``py-spy``'s raw stacks: by their own samples, and riverbed's
    own functions by the samples they were on the stack for."""
    own: Counter[str] = Counter()
    within: Counter[str] = Counter()
    total = 0
    for path in files:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            samples = int(count)
            total += samples
            frames = [frame.rpartition(":")[0] + ")" if ":" in frame else frame for frame in stack.split(";")]
            own[frames[-1]] += samples
            for frame in set(frames):
                if "riverbed/" in frame:
                    within[frame] += samples
    if not total:
        return "  (no samples: is py-spy on PATH?)"
    lines = [f"  {total:,} samples; own:"]
    lines += [f"  {n / total:6.1%}  {frame}" for frame, n in own.most_common(rows)]
    lines.append("  riverbed's functions, on the stack:")
    lines += [f"  {n / total:6.1%}  {frame}" for frame, n in within.most_common(rows)]
    return "\n".join(lines)


@dataclass
class _Round:
    """Runs opened at once, each on a session seeded with ``context`` events first (0: none)."""

    sessions: list[str]
    context: int
    steps: int
    pad: int = 0
    """bytes more in each session's first message: its prompt as long as the largest context's"""
    cpu: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    """CPU seconds of the agent workers, the runtime workers, the model server and Redis during its runs"""
    idle: float = 0.0
    """the agent workers' CPU seconds per second just before its runs opened (the workers idle)"""
    opened_in: float = 0.0
    taking: float = 0.0
    """with ``--context``: the agent workers' CPU seconds from the runs' opening until each run
    was at its first model call (each session taken, its whole log read, and its first prompt)"""
    later: tuple[float, int, float] = (0.0, 0, 0.0)
    """with ``--context``: the agent workers' CPU seconds from each run at its first model call to
    each at its last, the model calls made in between (every run's later steps, exactly), and the
    part of those seconds spent in the kernel (the sockets' writes and reads)"""
    figures: _Steps = field(default_factory=_Steps)


def _context_sizes(raw: str | None) -> list[int]:
    try:
        sizes = [int(part) for part in (raw or "").split(",") if part.strip()]
    except ValueError:
        sizes = [-1]
    if any(size < 1 for size in sizes):
        print("bench.agents: --context takes event counts separated by commas, e.g. 20,2000", file=sys.stderr)
        raise SystemExit(2)
    return sizes


async def measure(url: str, args: argparse.Namespace) -> list[Result]:
    contexts = _context_sizes(getattr(args, "context", None))
    runs = getattr(args, "runs", None) or (100 if args.quick or contexts else RUNS)
    steps = getattr(args, "steps", None) or STEPS
    count = getattr(args, "workers", None) or WORKERS
    runtime_count = getattr(args, "runtime_workers", None) or RUNTIME_WORKERS
    latency = getattr(args, "latency", None) or LATENCY
    tenant_count = getattr(args, "tenants", None) or 0
    tools = bool(getattr(args, "tools", False))
    kind = "note" if tools else getattr(args, "action", None) or "file_read"
    action: events.Action = events.FileRead(path=FILE_NAME) if kind != "cmd_run" else events.CmdRun(command="true")
    agent = bench_agent if tools else None
    if runs < 1 or steps < 2 or count < 1 or runtime_count < 1 or tenant_count < 0 or latency <= 0:
        print(
            "bench.agents: --runs and the worker counts must be at least 1, --steps at least 2, --latency above 0",
            file=sys.stderr,
        )
        raise SystemExit(2)
    spy = os.environ.get("BENCH_AGENTS_PYSPY")
    if spy and _py_spy() is None:
        print("bench.agents: BENCH_AGENTS_PYSPY needs py-spy on PATH or beside this Python (pip install py-spy)",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    prefix = f"bag{uuid.uuid4().hex[:6]}"
    rounds = [_Round([f"c{size}-{i}" for i in range(runs)], size, steps) for size in contexts] or [
        _Round([f"run-{i}" for i in range(runs)], 0, steps)
    ]
    if len(set(contexts)) > 1:  # (the smallest context again, its prompt padded to the largest's bytes)
        small, large = min(contexts), max(contexts)
        pad = _prompt_bytes(large) - _prompt_bytes(small)
        rounds.append(_Round([f"p{small}-{i}" for i in range(runs)], small, steps, pad=pad))
    tenants = [f"tenant-{t}" for t in range(tenant_count)]

    def tenant_of(index: int) -> str | None:
        return tenants[index % len(tenants)] if tenants else None

    solo = [f"solo-{i}" for i in range(count)]
    with tempfile.TemporaryDirectory(prefix="riverbed-bench-agents-") as tmp:
        workspace = Path(tmp) / "workspace"
        workspace.mkdir()
        _progress(
            f"agents: the model server ({_ms(latency):.0f} ms a call), {count} agent + {runtime_count} runtime workers"
        )
        for session in [*(s for r in rounds for s in r.sessions), *solo, "idle-floor"]:
            _prepare_workspace(workspace, session)
        server = _ModelServer(Path(tmp), steps, kind, latency)
        agents: Workers | None = None
        runtimes: Workers | None = None
        try:
            async with riverbed.connect(url, prefix=prefix) as bus:
                quotas = Quotas(bus.log_store)
                seeding = anyio.CapacityLimiter(20)
                for tenant in tenants:  # (as `riverbed tenants set T --max-runs 0` makes one: no limit)
                    await quotas.set(tenant, max_runs=0, tokens_per_day=0)
                for seeded in (r for r in rounds if r.context):
                    _progress(
                        f"agents: seeding {runs:,} sessions with about {seeded.context:,} events each"
                        f"{_padded(seeded)} (for runs of {seeded.steps} steps)"
                    )
                    async with anyio.create_task_group() as tg:
                        for index, session in enumerate(seeded.sessions):
                            tg.start_soon(_seed, bus, session, seeded, tenant_of(index), seeding)
            model_env = {"OPENAI_BASE_URL": server.base_url, "OPENAI_API_KEY": "bench", "RIVERBED_LLM_MODEL": MODEL}
            if tools:
                model_env["RIVERBED_AGENTS"] = "bench.tool_agent"
            capacity = math.ceil(runs * len(rounds) / runtime_count) + len(solo) + 1
            runtimes = Workers(url, prefix, workspace, runtime_count, capacity, "process")
            profile = os.environ.get("BENCH_AGENTS_PROFILE")
            grind = os.environ.get("BENCH_AGENTS_CALLGRIND")
            counter = Callgrind(Path(grind)) if grind and contexts else None
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
                wrap=counter.wrap if counter is not None else None,
            )
            await runtimes.wait_ready(timeout=120)
            await agents.wait_ready(timeout=120 if counter is None else 900)
            pids = {name: proc.pid for name, proc in zip(agents.names, agents.procs, strict=True)}
            sampled = _Sampled(agents.names)
            async with riverbed.connect(url, prefix=prefix) as bus:
                idle_model, idle_action = await _idle_floor(bus, server.base_url, action)
                _progress(f"agents: idle floor: model call {_ms(idle_model):.1f} ms, {kind} {_ms(idle_action):.1f} ms")
                _progress(f"agents: {len(solo)} runs at once first, on workers otherwise idle")
                for session in solo:
                    await open_run(
                        bus, session, task_text(session, steps), limits=RunLimits(max_steps=steps), agent=agent
                    )
                _all_finished(await _wait_for_runs(bus, url, solo, sampled, pids, steps))
                idle_rss = {name: _rss_mib(pid) for name, pid in pids.items()}
                sampled = _Sampled(agents.names)
                agent_pids, runtime_pids = list(pids.values()), [p.pid for p in runtimes.procs]
                if contexts:
                    await _settle([*agent_pids, *runtime_pids])
                sampler = _Sampler(Path(spy), pids) if spy else None
                limiter = anyio.CapacityLimiter(50)
                for taken in rounds:
                    what = f" on sessions of about {taken.context:,} events{_padded(taken)}" if taken.context else ""
                    _progress(
                        f"agents: {runs:,} runs of {taken.steps} steps at once{what}; load {os.getloadavg()[0]:.1f}"
                    )
                    idle_from = cpu_seconds(agent_pids)
                    await anyio.sleep(IDLE_SECONDS)
                    taken.idle = (cpu_seconds(agent_pids) - idle_from) / IDLE_SECONDS
                    cpu_before = (
                        cpu_seconds(agent_pids),
                        cpu_seconds(runtime_pids),
                        cpu_seconds([server.proc.pid]),
                        await redis_cpu(bus.redis),
                    )
                    opening = time.perf_counter()

                    async def start(index: int, session: str, length: int) -> None:
                        async with limiter:
                            await open_run(
                                bus, session, task_text(session, length), limits=RunLimits(max_steps=length),
                                agent=agent, tenant=tenant_of(index),
                            )  # fmt: skip

                    label = f"{'p' if taken.pad else 'c'}{taken.context}-{taken.steps}" if taken.context else "runs"
                    if contexts:  # (each run's first and last model calls wait: between the two, its later steps alone)
                        server.gates("close")
                    if sampler is not None:
                        sampler.start(label)
                    async with anyio.create_task_group() as tg:
                        for index, session in enumerate(taken.sessions):
                            tg.start_soon(start, index, session, taken.steps)
                    taken.opened_in = time.perf_counter() - opening
                    _progress(f"agents: {runs:,} runs opened in {taken.opened_in:.1f} s")
                    if contexts:
                        first = await server.gathered(runs)
                        at_first = cpu_seconds(agent_pids)
                        kernel_at_first = cpu_seconds(agent_pids, kernel=True)
                        taken.taking = at_first - cpu_before[0]
                        if sampler is not None:
                            sampler.stop(label)
                            sampler.start(f"{label}-later")
                        _progress(
                            f"agents: every run at its first model call; measuring to each run's last ({taken.steps})"
                        )
                        if counter is not None:
                            counter.start(agent_pids)
                        server.gates("release")
                        last = await server.gathered(runs)
                        if sampler is not None:
                            sampler.stop(f"{label}-later")
                        if counter is not None:
                            counted = counter.stop(agent_pids)
                            _progress(
                                f"agents: the agent workers ran {counted / max(1, last - first):,.0f} instructions a "
                                f"later step ({label}: {counted:,} for {last - first:,} model calls, callgrind)"
                            )
                        taken.later = (
                            cpu_seconds(agent_pids) - at_first,
                            last - first,
                            cpu_seconds(agent_pids, kernel=True) - kernel_at_first,
                        )
                        server.gates("open")
                        if sampler is not None:
                            sampler.start(f"{label}-last")
                    summaries = await _wait_for_runs(bus, url, taken.sessions, sampled, pids, taken.steps)
                    if sampler is not None:
                        sampler.stop(f"{label}-last" if contexts else label)
                    cpu_after = (
                        cpu_seconds(agent_pids),
                        cpu_seconds(runtime_pids),
                        cpu_seconds([server.proc.pid]),
                        await redis_cpu(bus.redis),
                    )
                    taken.cpu = (
                        cpu_after[0] - cpu_before[0],
                        cpu_after[1] - cpu_before[1],
                        cpu_after[2] - cpu_before[2],
                        cpu_after[3] - cpu_before[3],
                    )
                    _all_finished(summaries)
                runtime_connections = await _connections(url, runtimes.names)
                _progress("agents: reading the logs and the model server's journal")
                logs = await _read_logs(bus, [*(s for r in rounds for s in r.sessions), *solo])
                journal: dict[tuple[str, int], tuple[float, float]] = {}
                calls, connected = server.journal()
                for called, step, received, sent in calls:
                    if called is not None:
                        journal[(called, step)] = (received, sent)
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
    alone = _Steps()
    for taken in rounds:
        for session in taken.sessions:
            taken.figures.add_run(session, logs[session], journal)
    for session in solo:
        alone.add_run(session, logs[session], journal)
    shape = _Shape(runs, steps, count, kind, latency, tenant_of)
    http = (connected, len(calls))
    idle = (idle_model, idle_action)
    if contexts:
        return _context_results(rounds, shape, sampled, idle_rss)
    figures = rounds[0].figures
    return [
        *_results(
            figures, shape, sampled.connections, runtime_connections, idle, rounds[0].cpu, rounds[0].idle, http, alone
        ),
        *_capacity_results(figures, shape, sampled, idle_rss, alone),
    ]


def _ms(seconds: float) -> float:
    return seconds * 1000


@dataclass(frozen=True)
class _Shape:
    """What the runs were: how many, their steps, the workers, the action, the model's latency."""

    runs: int
    steps: int
    workers: int
    kind: str
    latency: float
    tenant_of: Callable[[int], str | None]

    def text(self) -> str:
        model = f", the model {_ms(self.latency):,.0f} ms a call" if self.latency != LATENCY else ""
        return f"{self.runs:,} detached runs of {self.steps} steps at once on {self.workers} agent workers{model}"


def _results(
    figures: _Steps,
    shape: _Shape,
    most: dict[str, int],
    runtime_connections: dict[str, int],
    floor: tuple[float, float],
    cpu: tuple[float, ...],
    idle: float,
    http: tuple[int, int],
    alone: _Steps,
) -> list[Result]:
    runs, steps, count, kind = shape.runs, shape.steps, shape.workers, shape.kind
    idle_model, idle_action = floor
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
    agent_cpu, runtime_cpu, server_cpu, redis_cpu = cpu
    calls, actions = len(figures.model), len(figures.action)
    return [
        Result(
            f"agent role overhead per step, p50 ({shape.text()})", "ms", _ms(over50), _ms(floor50),
            "the floor: model latency + action round trip, p50", over50 / floor50, TARGET_OVERHEAD_MS,
            len(figures.overhead), better="lower", target_on="figure", note=where,
        ),
        Result(
            "agent role overhead per step, p99", "ms", _ms(over99), _ms(floor99), "the floor, p99", over99 / floor99,
            TARGET_OVERHEAD_P99_MS, len(figures.overhead), better="lower", target_on="figure",
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
            note=f"during the runs ({window:.0f} s): agent workers {agent_cpu:.1f} s, runtime workers "
            f"{runtime_cpu:.1f} s, the model server {server_cpu:.1f} s, Redis {redis_cpu:.1f} s of CPU (the bench's "
            f"polls included); the agent workers idle just before: {idle:.1%} of a CPU; the model server accepted "
            f"{http[0]:,} connections for {http[1]:,} calls; {os.getloadavg()[0]:.1f} load average (1 min) at the end",
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


def _capacity_results(
    figures: _Steps, shape: _Shape, sampled: _Sampled, idle_rss: dict[str, float], alone: _Steps
) -> list[Result]:
    """RSS per agent worker, the longest wait of a run to start and, with tenants, its spread per tenant."""
    rss, rss_idle = max(sampled.rss.values()), max(idle_rss.values())
    owned = math.ceil(shape.runs / shape.workers)
    longest, alone_longest = max(figures.waited), max(alone.waited)
    out = [
        Result(
            f"RSS per agent worker ({owned:,} runs each; the most of the {shape.workers}, the most of any sample)",
            "MiB", rss, rss_idle, "the same worker idle after a first run", rss / rss_idle, TARGET_RSS_MIB, 1,
            better="lower", target_on="figure",
            note=f"each agent worker, most while the runs went on: {[round(v) for v in sorted(sampled.rss.values())]} "
            f"MiB; idle: {[round(v) for v in sorted(idle_rss.values())]} MiB; "
            f"{(rss - rss_idle) / owned * 1000:.1f} MiB per 1,000 runs held",
        ),
        Result(
            "the longest wait of a run to start (run_started -> its first model request)", "s", longest,
            alone_longest, f"the longest of {shape.workers} runs at once on idle workers", longest / alone_longest,
            TARGET_START_WAIT, len(figures.waited), better="lower", target_on="figure",
            note=f"p50 {percentile(figures.waited, 50):.2f} s, p99 {percentile(figures.waited, 99):.2f} s",
        ),
    ]  # fmt: skip
    by_tenant: dict[str, list[float]] = {}
    for index in range(shape.runs):
        tenant = shape.tenant_of(index)
        wait = figures.wait_of.get(f"run-{index}")
        if tenant is not None and wait is not None:
            by_tenant.setdefault(tenant, []).append(wait)
    if by_tenant:
        middles = {tenant: percentile(waits, 50) for tenant, waits in by_tenant.items()}
        worst, best = max(middles.values()), min(middles.values())
        spread = "; ".join(
            f"{tenant} {middles[tenant]:.2f}/{max(waits):.2f}" for tenant, waits in sorted(by_tenant.items())
        )
        out.append(
            Result(
                f"a run's wait to start, p50 of the slowest of {len(by_tenant)} tenants", "s", worst, best,
                "p50 of the quickest tenant", worst / best if best else math.inf, None, len(by_tenant),
                better="lower", note=f"per tenant, p50/max s: {spread}",
            )
        )  # fmt: skip
    return out


def _context_results(
    rounds: list[_Round], shape: _Shape, sampled: _Sampled, idle_rss: dict[str, float]
) -> list[Result]:
    """Per context size: the overhead per step, the agent workers' CPU per step (taking the
    session included), taking a session, and a later step's CPU alone (between the model
    server's gates: every run at its first call, every run at its last); then the largest size's
    figures against the smallest's."""
    out: list[Result] = []
    per: list[tuple[int, float, float, float]] = []
    padded: tuple[int, int, float] | None = None
    for taken in rounds:
        figures = taken.figures
        if not figures.overhead:
            raise RuntimeError("no step could be measured (the logs and the journal do not match)")
        over50, floor50 = percentile(figures.overhead, 50), percentile(figures.floor, 50)
        agent_cpu, runtime_cpu, server_cpu, redis_cpu = taken.cpu
        calls = len(figures.model)
        cpu = agent_cpu / calls
        later_cpu, later_calls, later_kernel = taken.later
        expected = len(taken.sessions) * (taken.steps - 1)
        if later_calls != expected:
            raise RuntimeError(
                f"{later_calls:,} model calls between the gates, not {expected:,}: a run was retried or ended early"
            )
        later = later_cpu / later_calls
        if taken.pad:
            padded = (taken.context, taken.pad, later)
        else:
            per.append((taken.context, over50, cpu, later))
        size = f"{taken.context:,}-event context" + (
            ", its prompt padded to the largest one's bytes" if taken.pad else ""
        )
        out += [
            Result(
                f"agent role overhead per step, p50, {size} ({shape.text()})", "ms", _ms(over50), _ms(floor50),
                "the floor: model latency + action round trip, p50", over50 / floor50, TARGET_OVERHEAD_MS,
                len(figures.overhead), better="lower", target_on="figure",
                note=f"p99 {_ms(percentile(figures.overhead, 99)):.1f} ms; before the model call p50 "
                f"{_ms(percentile(figures.before_call, 50)):.1f} ms, after it "
                f"{_ms(percentile(figures.after_call, 50)):.1f} ms; runs opened in {taken.opened_in:.1f} s",
            ),
            Result(
                f"agent workers' CPU time per step, {size}, taking the session included", "ms", _ms(cpu),
                _ms(runtime_cpu / len(figures.action)), f"the runtime workers' per action ({shape.kind})",
                cpu / (runtime_cpu / len(figures.action)), TARGET_CPU_MS, calls, better="lower", target_on="figure",
                note=f"agent workers {agent_cpu:.1f} s, runtime workers {runtime_cpu:.1f} s, the model server "
                f"{server_cpu:.1f} s, Redis {redis_cpu:.1f} s of CPU for {calls:,} model calls (taking each session, "
                f"its whole log read once, included); the agent workers idle just before: {taken.idle:.1%} of a CPU; "
                f"{os.getloadavg()[0]:.1f} load average (1 min) at the end",
            ),
            Result(
                f"agent workers' CPU time per later step, {size} (every run at its first model call to every run "
                "at its last)", "ms", _ms(later), _ms(cpu), "per step, taking the session included",
                later / cpu, TARGET_CPU_MS, later_calls, better="lower", target_on="figure",
                note=f"{later_cpu:.2f} s for the {later_calls:,} model calls between the gates, "
                f"{later_kernel:.2f} s of it in the kernel: {_ms(later_kernel / later_calls):.2f} ms a step",
            ),
            Result(
                f"agent workers' CPU time to take a session of about {size} and make its first prompt, per run",
                "ms", _ms(taken.taking / len(taken.sessions)), _ms(later), "a later step's CPU",
                taken.taking / len(taken.sessions) / later, None, len(taken.sessions), better="lower",
                note=f"{taken.taking:.2f} s for {len(taken.sessions):,} runs, opened to each at its first model call",
            ),
        ]  # fmt: skip
    (small, small_over, small_cpu, small_later) = min(per)
    (large, large_over, large_cpu, large_later) = max(per)
    if large != small:
        out += [
            Result(
                f"overhead per step p50, {large:,}-event context / {small:,}-event context", "x",
                large_over / small_over, 1.0, "the same", large_over / small_over, None, 1,
                better="lower",
            ),
            Result(
                f"agent workers' CPU per step, taking the session included, {large:,}-event context / "
                f"{small:,}-event context", "x", large_cpu / small_cpu, 1.0, "the same", large_cpu / small_cpu,
                None, 1, better="lower",
                note=f"the seeded sessions' condenser config is {NO_CONDENSING} (a session_config first): "
                "every prompt holds the whole context",
            ),
            Result(
                f"agent workers' CPU per later step, {large:,}-event context / {small:,}-event context", "x",
                large_later / small_later, 1.0, "the same", large_later / small_later, TARGET_CONTEXT_RATIO, 1,
                better="lower",
            ),
        ]  # fmt: skip
    if padded is not None:
        context, pad, same_bytes = padded
        out.append(
            Result(
                f"agent workers' CPU per later step, {large:,}-event context / {context:,}-event context whose prompt "
                "is as long", "x", large_later / same_bytes, 1.0, "the same", large_later / same_bytes, None, 1,
                better="lower",
                note=f"the {context:,}-event sessions' first message {pad:,} bytes longer, their prompt "
                f"{_prompt_bytes(context, pad):,} bytes against {_prompt_bytes(large):,}: what is left is the "
                "context's events, not its bytes",
            )
        )  # fmt: skip
    rss = max(sampled.rss.values())
    out.append(
        Result(
            f"RSS per agent worker (the most of the {shape.workers}, the most of any sample)", "MiB", rss,
            max(idle_rss.values()), "the same worker idle after a first run", rss / max(idle_rss.values()),
            TARGET_RSS_MIB, 1, better="lower", target_on="figure",
        )
    )  # fmt: skip
    return out


def main() -> int:
    return run_alone(measure, "Detached runs served by the agent role: overhead per step, runs/s, connections.")


if __name__ == "__main__":
    raise SystemExit(main())

"""The runtime role under faults, with real worker processes and Redis.

- **Malformed input floods**: 10,000 raw stream entries that are not events at all, and
  1,000 malformed actions (unknown kinds, fields of the wrong type, a bad envelope), written
  straight into the streams of a few sessions while a worker serves them: every garbage entry
  is dead-lettered, every malformed action gets exactly one ``error`` answer and never runs,
  no worker exits, and the next normal action is answered.
- **Sandbox bounds through a worker**: paths that lead out of the workspace are refused; an
  output flood is capped; a command that never ends is stopped by its timeout; hundreds of
  background processes are killed by the process limit and the timeout and leave nothing
  behind; the session's shell keeps working.
- **Paused owners** (SIGSTOP past the lease, then SIGCONT) while agents keep acting and retry
  every ``runtime_lost``: nothing a peer answered starts afterwards, no command runs twice,
  every action has exactly one answer; an owner paused right after its claim runs nothing
  once resumed.
- **python_run in failover**: a cell in flight on a worker killed by SIGKILL is answered once,
  by the new owner: run there when the lost owner never claimed it, else with a retryable
  ``runtime_lost`` error; it never runs twice; a worker's late result for an action that was
  answered meanwhile is dropped (the one-answer guard).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from riverbed import events
from riverbed.bus.dlq import DeadLetters
from riverbed.client.session import Bus
from riverbed.runtime.limits import session_processes
from tests.kit.answers import check_exactly_one_answer
from tests.kit.faults import files_named
from tests.kit.workers import Spawn, WorkerProcess, close_all, ready, spawn  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.anyio, pytest.mark.fault]

LEASE = 1.0


@pytest.fixture
def workers(workspace: Path) -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    close_all(started)
    kill_orphans(workspace)


def kill_orphans(workspace: Path) -> None:
    """Kill sandbox processes a SIGKILLed worker left running in ``workspace`` (a shell, a cell)."""
    root = str(workspace.resolve())
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:
            continue
        if cwd == root or cwd.startswith(root + os.sep):
            with contextlib.suppress(OSError):
                os.kill(int(entry), signal.SIGKILL)


@pytest.fixture
def start(spawn: Spawn) -> Callable[..., WorkerProcess]:
    def start(
        name: str, crash_at: str | None = None, pause_at: str | None = None, sandbox: str | None = None
    ) -> WorkerProcess:
        env = {"RIVERBED_CRASH_AT": crash_at} if crash_at else {}
        if pause_at:
            env["RIVERBED_PAUSE_AT"] = pause_at
        if sandbox:
            env["RIVERBED_SANDBOX"] = sandbox
        return spawn(name, ["runtime"], lease=LEASE, **env)

    return start


# --- malformed input floods ------------------------------------------------------------------

GARBAGE = 10_000
MALFORMED = 1_000
FLOOD_SESSIONS = 4
CHUNK = 500


def garbage(i: int) -> dict[str, bytes]:
    """The fields of a stream entry that is not an event at all."""
    shapes: list[dict[str, bytes]] = [
        {"e": b"\xc1" + os.urandom(i % 40)},  # a byte msgpack never uses, then noise
        {"e": b""},
        {"e": msgspec.msgpack.encode(i)},
        {"e": msgspec.msgpack.encode([i, "kind", "cmd_run"])},
        {"e": msgspec.msgpack.encode("cmd_run")},
        {"e": b"\x85\xa4kind"},  # a map cut short
        {"e": b'{"kind": "cmd_run", "command": "echo ran >> flood-ran.txt"}'},  # JSON, not msgpack
        {"e": b"\xde\xff\xff"},  # a map claiming 65535 pairs, then nothing
        {"e": b"\xdb\xff\xff\xff\xff"},  # a string claiming 4 GiB
        {"payload": b"the field is not even called e"},
    ]
    return shapes[i % len(shapes)]


def malformed_action(i: int) -> dict[str, Any]:
    """A msgpack map from an agent that is not a valid action; ``echo ran`` must never run."""
    ran = "echo ran >> flood-ran.txt"
    shapes: list[dict[str, Any]] = [
        {"kind": f"teleport_{i % 7}", "source": "agent", "to": "mars"},
        {"kind": "cmd_run", "command": i, "source": "agent"},
        {"kind": "file_read", "path": ["a", i], "source": "agent"},
        {"kind": "python_run", "code": None, "source": "agent"},
        {"kind": "cmd_run", "command": ran, "timeout": "soon", "source": "agent"},
        {"kind": "file_edit", "command": "explode", "path": "x", "source": "agent"},
        {"kind": "cmd_run", "command": ran, "source": "robot"},
        {"kind": "teleport", "source": "agent", "ts": "yesterday", "tenant": 5},
        {"kind": "cmd_run", "command": ran, "v": 99, "source": "agent"},  # from a newer riverbed
        {"kind": "file_write", "path": "x", "content": {"nested": [i]}, "source": "user"},
        {"kind": 5, "source": "agent"},
        {"kind": ["cmd_run"], "source": "user"},
        {"kind": "cmd_run", "command": ran, "cause": "first", "source": "agent"},
    ]
    return shapes[i % len(shapes)]


#: KEYS: log, meta; ARGV: field, value pairs, one entry each.  Adds them with the next ids and
#: moves ``last`` in one step, as the append script would (a script: atomic on a cluster too).
XADD_RAW = """
local last = tonumber(redis.call('HGET', KEYS[2], 'last') or '0')
for i = 1, #ARGV, 2 do
  last = last + 1
  redis.call('XADD', KEYS[1], last .. '-0', ARGV[i], ARGV[i + 1])
end
redis.call('HSET', KEYS[2], 'last', last)
return last
"""


async def xadd_raw(bus: Bus, session: str, entries: list[dict[str, bytes]]) -> list[int]:
    """Write ``entries`` (one field each) straight into the session's stream with the next ids
    (``<n>-0``) and move ``last`` in the meta hash, atomically with respect to the worker's own appends."""
    pairs = [item for fields in entries for item in next(iter(fields.items()))]
    last = int(await bus.redis.eval(XADD_RAW, 2, bus.keys.log(session), bus.keys.meta(session), *pairs))
    return list(range(last - len(entries) + 1, last + 1))


async def test_malformed_floods_are_dead_lettered_or_answered_and_the_worker_goes_on(
    bus: Bus, start: Callable[..., WorkerProcess], workers: list[WorkerProcess], workspace: Path
) -> None:
    await ready(start("fa"), start("fb"))
    sessions = [bus.session(f"flood-{i}") for i in range(FLOOD_SESSIONS)]
    for session in sessions:  # created and owned before the flood
        assert isinstance(await session.act(events.CmdRun(command="echo ready"), timeout=20), events.CmdOutput)

    garbage_ids: dict[str, set[int]] = {s.id: set() for s in sessions}
    action_ids: dict[str, set[int]] = {s.id: set() for s in sessions}
    g = a = 0
    while g < GARBAGE or a < MALFORMED:
        session = sessions[(g + a) // CHUNK % FLOOD_SESSIONS]
        kinds: list[bool] = []  # True: a malformed action, False: garbage
        batch: list[dict[str, bytes]] = []
        while len(batch) < CHUNK and (g < GARBAGE or a < MALFORMED):
            if a < MALFORMED and (g >= GARBAGE or (g + a) % 11 == 0):
                batch.append({"e": msgspec.msgpack.encode(malformed_action(a))})
                kinds.append(True)
                a += 1
            else:
                batch.append(garbage(g))
                kinds.append(False)
                g += 1
        ids = await xadd_raw(bus, session.id, batch)
        for event_id, is_action in zip(ids, kinds, strict=True):
            (action_ids if is_action else garbage_ids)[session.id].add(event_id)

    for session in sessions:
        obs = await session.act(events.CmdRun(command="echo still-here"), timeout=50)
        assert isinstance(obs, events.CmdOutput), obs
        assert obs.content.strip() == "still-here"
    assert all(w.proc.poll() is None for w in workers), "a worker exited during the flood"

    letters = await DeadLetters(bus.redis, bus.keys).list(count=GARBAGE + MALFORMED + 100)
    lettered: dict[str, list[int]] = {}
    for letter in letters:
        assert letter.role == "runtime"
        lettered.setdefault(letter.session, []).append(letter.event_id)
    for session in sessions:
        here = lettered.get(session.id, [])
        assert len(here) == len(set(here)), "an entry was dead-lettered twice"
        assert garbage_ids[session.id] <= set(here), "garbage that was not dead-lettered"
        assert set(here) <= garbage_ids[session.id] | action_ids[session.id], "a valid entry was dead-lettered"
        lettered_actions = set(here) & action_ids[session.id]
        answers: dict[int, list[events.Event]] = {}
        async for event in session.log():
            if isinstance(event, events.Observation) and event.cause is not None:
                answers.setdefault(event.cause, []).append(event)
        for action_id in action_ids[session.id]:
            got = answers.get(action_id, [])
            assert len(got) == 1, f"{session.id}: malformed action {action_id} has {len(got)} answers"
            (answer,) = got
            assert isinstance(answer, events.Error), answer
            expected = "dead_letter" if action_id in lettered_actions else "unknown_kind"
            assert answer.reason == expected, answer
        assert not set(answers) & garbage_ids[session.id], "garbage was answered as if it were an action"
        info = await bus.redis.xpending(bus.keys.log(session.id), "runtime")
        assert info["pending"] == 0
    assert not list(workspace.rglob("flood-ran.txt")), "a malformed action was run"
    assert sum(len(v) for v in garbage_ids.values()) == GARBAGE
    assert sum(len(v) for v in action_ids.values()) == MALFORMED


# --- sandbox bounds through a worker ---------------------------------------------------------

#: The worker's defaults (riverbed.runtime.Limits).
MAX_OUTPUT_CHARS = 30_000
MAX_PROCESSES = 256


def sandbox_processes(shell_pid: int) -> list[int]:
    """Live processes of the sandbox whose shell is ``shell_pid``, the shell excluded."""
    return [pid for pid, _pgrp in session_processes(shell_pid) if pid != shell_pid]


async def until(condition: Callable[[], bool], timeout: float, message: str) -> None:
    with anyio.move_on_after(timeout):
        while not condition():
            await anyio.sleep(0.05)
        return
    raise AssertionError(message)


async def test_sandbox_bounds_hold_through_a_worker(
    bus: Bus, spawn: Spawn, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    # Process mode: its bounds are the process-count watcher's (a namespaces sandbox's are the
    # kernel's: RLIMIT_NPROC on its own uid, a PID namespace; see test_security_sandbox.py).  The
    # session's cgroup allows more processes here, so that the watcher is what is tested (the
    # cgroup's bound is attacked in test_security_cgroups.py).
    await ready(spawn("sandbox", ["runtime"], lease=LEASE, RIVERBED_SANDBOX="process", RIVERBED_SANDBOX_PIDS="1024"))
    session = bus.session("sandbox")

    async def run(action: events.Action, timeout: float = 30) -> events.Event:
        return await session.act(action, timeout=timeout)

    pid = await run(events.CmdRun(command="echo $$"))
    assert isinstance(pid, events.CmdOutput)
    shell = int(pid.content.strip())

    # Paths that lead out of the workspace, or are not paths at all.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret\n")
    links = await run(events.CmdRun(command=f"ln -s {outside} out && ln -s {outside}/secret.txt secret-link && ls"))
    assert isinstance(links, events.CmdOutput)
    assert links.exit_code == 0, links
    long_name = "n" * 300
    escapes: list[events.Action] = [
        events.FileRead(path="../../../../etc/passwd"),
        events.FileRead(path="/etc/passwd"),
        events.FileRead(path="out/secret.txt"),
        events.FileRead(path="secret-link"),
        events.FileRead(path=long_name),
        events.FileRead(path="d/" * 2100),
        events.FileRead(path="secret\x00.txt"),
        events.FileWrite(path="../escaped.txt", content="x"),
        events.FileWrite(path="out/new.txt", content="x"),
        events.FileWrite(path=str(outside / "absolute.txt"), content="x"),
        events.FileWrite(path="secret-link", content="overwritten"),
        events.FileWrite(path="nul\x00.txt", content="x"),
        events.FileWrite(path=long_name, content="x"),
        events.FileEdit(command="create", path="out/created.txt", file_text="x"),
        events.FileEdit(command="view", path="/etc"),
        events.FileEdit(command="str_replace", path="secret-link", old_str="secret", new_str="leaked"),
        events.FileEdit(command="insert", path="out/../out/secret.txt", insert_line=0, new_str="leaked"),
        events.CmdRun(command="pwd", cwd=".."),
        events.CmdRun(command="pwd", cwd="/"),
        events.CmdRun(command="pwd", cwd="out"),
        events.CmdRun(command="pwd", cwd="x\x00y"),
    ]
    for action in escapes:
        refused = await run(action)
        assert isinstance(refused, events.Error), f"{action!r} was not refused: {refused!r}"
        assert refused.reason in ("path_outside_workspace", "bad_path"), refused
        assert not refused.retryable
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    assert (outside / "secret.txt").read_text() == "secret\n"

    # An output flood is capped.
    flood = await run(events.CmdRun(command="yes | head -c 50000000; echo; echo flood-done"), timeout=50)
    assert isinstance(flood, events.CmdOutput), flood
    assert flood.truncated
    assert len(flood.content) < MAX_OUTPUT_CHARS + 1000
    assert flood.content.rstrip().endswith("flood-done")

    # Commands (and a cell) that never end are stopped by their timeouts.
    for action in (
        events.CmdRun(command="while :; do :; done", timeout=2),
        events.CmdRun(command="sleep 600", timeout=2),
        events.PythonRun(code="while True:\n    pass", timeout=2),
    ):
        started = anyio.current_time()
        stopped = await run(action)
        assert anyio.current_time() - started < 15, f"{action!r} took {anyio.current_time() - started:.1f}s"
        assert isinstance(stopped, events.CmdOutput | events.PythonOutput), stopped
        assert stopped.timed_out, stopped
    assert sandbox_processes(shell) == [], "a timed-out command left processes behind"

    # Many children: the process limit kills them, the timeout ends the command, nothing is left.
    over_since: float | None = None
    longest_over = 0.0  # the longest time the sandbox stayed above its process limit
    spawned: events.Event | None = None

    async def spawn_many() -> None:
        nonlocal spawned
        spawned = await run(events.CmdRun(command="for i in $(seq 500); do sleep 30 & done; wait", timeout=10))

    async with anyio.create_task_group() as tg:
        tg.start_soon(spawn_many)
        while spawned is None:
            count = len(await anyio.to_thread.run_sync(sandbox_processes, shell))
            now = anyio.current_time()
            if count > MAX_PROCESSES:
                over_since = now if over_since is None else over_since
                longest_over = max(longest_over, now - over_since)
            else:
                over_since = None
            await anyio.sleep(0.05)
    assert isinstance(spawned, events.CmdOutput), spawned
    assert longest_over < 3, f"the sandbox stayed above {MAX_PROCESSES} processes for {longest_over:.1f}s"
    await until(lambda: sandbox_processes(shell) == [], 5, "the process flood left processes behind")
    waited = await run(events.CmdRun(command="for i in $(seq 50); do sleep 30 & done; wait", timeout=3))
    assert isinstance(waited, events.CmdOutput), waited
    assert waited.timed_out
    await until(lambda: sandbox_processes(shell) == [], 5, "the timed-out children were left behind")
    # Left running in the background, over the limit: the worker's watcher kills them.
    await run(events.CmdRun(command="for i in $(seq 400); do sleep 30 & done; echo started"))
    await until(
        lambda: len(sandbox_processes(shell)) <= MAX_PROCESSES, 10, "background processes above the limit live on"
    )

    # The session, and its shell, stay usable.
    after = await run(events.CmdRun(command="echo $$; echo fine"))
    assert isinstance(after, events.CmdOutput)
    assert after.content.split() == [str(shell), "fine"]
    written = await run(events.FileWrite(path="inside.txt", content="ok"))
    assert isinstance(written, events.FileWritten), written
    assert all(w.proc.poll() is None for w in workers)


# --- paused owners ---------------------------------------------------------------------------

PAUSED_SESSIONS = 6
ACTIONS_EACH = 12


def stopped(worker: WorkerProcess) -> bool:
    """Whether the worker process is stopped (SIGSTOP): state ``T`` in /proc."""
    stat = Path(f"/proc/{worker.proc.pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0] in ("T", "t")


def runs_by_marker(workspace: Path) -> dict[str, list[float]]:
    """When each command's marker was written to its session's ``runs.txt`` (unix seconds)."""
    runs: dict[str, list[float]] = {}
    for path in files_named(workspace, "runs.txt"):
        for line in path.read_text().splitlines():
            marker, started = line.split()
            runs.setdefault(marker, []).append(float(started))
    return runs


def marked(marker: str) -> events.CmdRun:
    """A command that records its marker and start time, then prints the marker (the time is
    the shell's own clock, read with no fork: when the command began, not when a ``date`` ran)."""
    return events.CmdRun(command=f'echo "{marker} $EPOCHREALTIME" >> runs.txt; echo {marker}')


def assert_ran_before_answered(
    markers: dict[tuple[str, int], str], log: dict[str, list[events.Event]], runs: dict[str, list[float]]
) -> None:
    """Each action ran at most once, and only before its answer; its own output means it ran."""
    for session_id, session_log in log.items():
        for answer in session_log:
            if not isinstance(answer, events.Observation) or answer.cause is None:
                continue
            marker = markers[(session_id, answer.cause)]
            started = runs.get(marker, [])
            assert len(started) <= 1, f"{marker} ran {len(started)} times"
            if isinstance(answer, events.CmdOutput):
                assert answer.content.strip() == marker
                assert len(started) == 1
            else:
                assert isinstance(answer, events.Error), answer
                assert answer.reason == "runtime_lost", answer
                assert answer.retryable
            for at in started:
                late = at - answer.ts.timestamp()
                assert late < 0, f"{marker} started {late:.3f}s after it was answered ({answer.kind})"


async def test_an_owner_paused_past_its_lease_runs_nothing_a_peer_answered(
    bus: Bus, start: Callable[..., WorkerProcess], workspace: Path
) -> None:
    first, second = start("pa"), start("pb")
    await ready(first, second)
    markers: dict[tuple[str, int], str] = {}  # (session, action id) -> marker
    progress = dict.fromkeys((f"paused-{i}" for i in range(PAUSED_SESSIONS)), 0)

    async def agent(session_id: str) -> None:
        session = bus.session(session_id)
        for i in range(ACTIONS_EACH):
            for attempt in range(20):
                marker = f"{session_id}-{i}-{attempt}"
                (action_id,) = await session.append(marked(marker))
                markers[(session_id, action_id)] = marker
                answer = await session.wait_for_answer(action_id, timeout=60)
                progress[session_id] += 1
                if not (isinstance(answer, events.Error) and answer.reason == "runtime_lost" and answer.retryable):
                    assert isinstance(answer, events.CmdOutput), answer
                    break
            else:
                raise AssertionError(f"{session_id}: action {i} was lost 20 times")

    async def holders() -> dict[str, bytes | None]:
        return {s: await bus.redis.hget(bus.keys.meta(s), "holder:runtime") for s in progress}

    async with anyio.create_task_group() as tg:
        for session_id in progress:
            tg.start_soon(agent, session_id)
        with anyio.fail_after(60):  # a third of the way, with both workers known to hold sessions
            while min(progress.values()) < ACTIONS_EACH // 3:
                await anyio.sleep(0.02)
        held = await holders()
        victim, peer = (
            (first, second) if list(held.values()).count(b"pa") >= list(held.values()).count(b"pb") else (second, first)
        )
        paused = [s for s, h in held.items() if h == victim.name.encode()]
        assert paused
        victim.proc.send_signal(signal.SIGSTOP)
        at_stop = dict(progress)
        # Resume only once the peer has taken every paused session over and answered there.
        with anyio.fail_after(60):
            while True:
                now_held = await holders()
                if all(
                    now_held[s] == peer.name.encode() and progress[s] >= min(at_stop[s] + 2, ACTIONS_EACH)
                    for s in paused
                ):
                    break
                await anyio.sleep(0.05)
        assert stopped(victim)
        victim.proc.send_signal(signal.SIGCONT)
    assert victim.proc.poll() is None, "the paused worker exited"
    assert peer.proc.poll() is None, "the peer exited"

    log = {s: await check_exactly_one_answer(bus, s) for s in progress}
    assert_ran_before_answered(markers, log, runs_by_marker(workspace))
    assert set(markers.values()) >= set(runs_by_marker(workspace)), "a command nobody appended ran"


# after_claim: on the claim's reply; start_gate:4: at the shell's own check right before it
# starts the command (the runtime checks once, the shell once, per command); after_start_gate:4:
# right after that check let the command through, before the command is written to the shell
# (the shell itself refuses it then: its deadline has passed).
@pytest.mark.parametrize("pause_at", ["after_claim:2", "start_gate:4", "after_start_gate:4"])
async def test_an_owner_paused_right_after_its_claim_does_not_run_the_action(
    pause_at: str, bus: Bus, start: Callable[..., WorkerProcess], workspace: Path
) -> None:
    """The narrowest windows: the owner claimed the action and then froze for longer than its
    lease, before it started the command.  The peer that took over answers it ``runtime_lost``
    (it was claimed: it may have started); the resumed owner sees its claim is too old to
    trust, is fenced, and runs nothing."""
    frozen = start("frozen", pause_at=pause_at)  # the first action goes through
    await ready(frozen)
    session = bus.session("frozen")
    warm = await session.act(marked("warm"), timeout=30)
    assert isinstance(warm, events.CmdOutput), warm
    peer = start("peer")
    await ready(peer)
    (action_id,) = await session.append(marked("claimed-then-frozen"))
    await until(lambda: stopped(frozen), 20, "the owner did not pause after its claim")
    answer = await session.wait_for_answer(action_id, timeout=30)
    assert isinstance(answer, events.Error), answer
    assert (answer.reason, answer.retryable) == ("runtime_lost", True)
    frozen.proc.send_signal(signal.SIGCONT)
    await until(lambda: "session.fenced" in frozen.log_path.read_text(), 20, "the resumed owner was not fenced")
    retried = await session.act(marked("retried"), timeout=30)
    assert isinstance(retried, events.CmdOutput), retried
    log = await check_exactly_one_answer(bus, "frozen")
    markers = {("frozen", e.id): e.command.split()[1].strip('"') for e in log if isinstance(e, events.CmdRun) and e.id}
    assert_ran_before_answered(markers, {"frozen": log}, runs_by_marker(workspace))
    assert "claimed-then-frozen" not in runs_by_marker(workspace), "the stale owner ran the action once resumed"
    assert frozen.proc.poll() is None


# --- python_run in failover ------------------------------------------------------------------


def cell_runs(workspace: Path) -> int:
    return sum(p.read_text().count("ran") for p in files_named(workspace, "cells.txt"))


@pytest.mark.parametrize("crash", ["after_read", "after_side_effect", "after_append", "kill_mid_cell"])
async def test_python_cell_in_flight_on_a_killed_worker_is_answered_once_and_never_rerun(
    crash: str, bus: Bus, start: Callable[..., WorkerProcess], workspace: Path
) -> None:
    # ":2": the first cell (which starts the session's Python process) goes through.
    doomed = start("doomed", crash_at=None if crash == "kill_mid_cell" else f"{crash}:2")
    await ready(doomed)
    session = bus.session("cells")
    warm = await session.act(events.PythonRun(code="x = 41"), timeout=30)
    assert isinstance(warm, events.PythonOutput), warm
    assert warm.exception is None
    sleep = 60 if crash == "kill_mid_cell" else 0
    code = f"import time\nopen('cells.txt', 'a').write('ran\\n')\ntime.sleep({sleep})\nx + 1"
    (cell,) = await session.append(events.PythonRun(code=code))
    if crash == "kill_mid_cell":
        await until(lambda: cell_runs(workspace) == 1, 20, "the cell did not start")
        doomed.kill()
    await until(lambda: doomed.proc.poll() is not None, 20, "the worker did not crash")
    assert doomed.proc.returncode == -signal.SIGKILL

    rescuer = start("rescuer")
    await ready(rescuer)
    answer = await session.wait_for_answer(cell, timeout=30)
    if crash == "after_append":  # answered before the crash; the new owner only acknowledges
        assert isinstance(answer, events.PythonOutput), answer
        assert answer.result == "42"
    elif crash == "after_read":  # never claimed, so never started: the new owner runs it (no x there)
        assert isinstance(answer, events.PythonOutput), answer
        assert answer.exception is not None
        assert "NameError" in answer.exception
    else:
        assert isinstance(answer, events.Error), answer
        assert answer.reason == "runtime_lost"
        assert answer.retryable
        assert answer.source == "runtime"
    after = await session.act(events.PythonRun(code="'x' in globals()"), timeout=30)
    assert isinstance(after, events.PythonOutput), after
    assert after.result == "False", "the new owner's Python process is not a fresh one"

    log = await session.events()
    answers: dict[int, int] = {}
    for event in log:
        if isinstance(event, events.Observation) and event.cause is not None:
            answers[event.cause] = answers.get(event.cause, 0) + 1
    cells = [e.id for e in log if isinstance(e, events.PythonRun)]
    assert {c: answers.get(c, 0) for c in cells} == dict.fromkeys(cells, 1)
    assert cell_runs(workspace) == 1, "the cell ran twice (or never)"


async def test_an_action_answered_while_it_runs_gets_no_second_answer(
    bus: Bus, start: Callable[..., WorkerProcess], workspace: Path
) -> None:
    """The one-answer guard end to end: the worker's late result for an action that another
    writer answered meanwhile (a zombie's takeover, an operator) is dropped, and the action is
    acknowledged."""
    await ready(start("slow"))
    session = bus.session("raced")
    (cell,) = await session.append(
        events.PythonRun(code="import time\nopen('cells.txt', 'a').write('ran\\n')\ntime.sleep(3)\n'late'")
    )
    await until(lambda: cell_runs(workspace) == 1, 20, "the cell did not start")
    await session.append(events.Error(content="answered elsewhere", reason="cancelled", source="system", cause=cell))
    key = bus.keys.log(session.id)
    with anyio.fail_after(20):  # until the worker is done with the cell (its late result dropped)
        while await bus.redis.xpending_range(key, "runtime", min=f"{cell}-0", max=f"{cell}-0", count=1):
            await anyio.sleep(0.05)
    answers = [e for e in await session.events() if isinstance(e, events.Observation) and e.cause == cell]
    assert len(answers) == 1, answers
    assert isinstance(answers[0], events.Error)
    assert answers[0].reason == "cancelled"

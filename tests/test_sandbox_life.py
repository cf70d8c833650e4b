"""A sandbox's life and its share of the host: it lives as long as its session, has a uid,
a /tmp and a PATH of its own, and its workspace belongs to one log.

Each test runs a real runtime worker process (``tests/kit/workers.py``) or a real
:class:`~riverbed.runtime.Runtime` with real bubblewrap sandboxes.
"""

from __future__ import annotations

import ast
import gc
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from riverbed import events
from riverbed.client.session import Bus
from riverbed.runtime import Runtime, Sandbox
from riverbed.runtime.limits import kill_processes, wait_exit
from riverbed.runtime.paths import belongs_to, workspace_name
from riverbed.runtime.runtime import SANDBOX_PATH, STOPS_AT_ONCE, _Session
from tests.kit.faults import wait_for
from tests.kit.workers import (
    WorkerProcess,
    run_cell,
    run_command,
    standalone_worker,  # noqa: F401  (a fixture)
    sync_client,
)

pytestmark = [pytest.mark.anyio]


#: anyio retires a worker thread idle for ``WorkerThread.MAX_IDLE_TIME`` (10 s) when another
#: thread is handed work; a sandbox tied to such a thread died with it.  The worker under test
#: retires its threads after this long instead, so that three idle times take seconds.
_ANYIO_IDLE = 1.0
#: Runs the worker's command line (appended) in this interpreter with anyio's idle time set to
#: ``_ANYIO_IDLE``: ``-c CODE IDLE python -m riverbed.workers ROLE ...``.
_SHORT_IDLE = (
    sys.executable,
    "-c",
    "import runpy, sys; from anyio._backends._asyncio import WorkerThread; "
    "WorkerThread.MAX_IDLE_TIME = float(sys.argv[1]); sys.argv = [sys.argv[4], *sys.argv[5:]]; "
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)",
    str(_ANYIO_IDLE),
)


@pytest.fixture
def worker(standalone_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    return standalone_worker("lifer", lease=2.0, wrapper=_SHORT_IDLE)


async def sh(bus: Bus, session: str, command: str, timeout: float = 30) -> events.CmdOutput:
    return await run_command(bus, session, command, timeout=timeout, wait=timeout + 30)


async def py(bus: Bus, session: str, code: str) -> events.PythonOutput:
    return await run_cell(bus, session, code, wait=60)


# --- 1. a sandbox lives as long as its session ------------------------------------------------------


@pytest.mark.fault
@pytest.mark.timeout(300)
async def test_sandboxes_started_together_outlive_the_threads_that_started_them(
    standalone_bus: Bus, worker: WorkerProcess
) -> None:
    bus = standalone_bus
    sessions = [f"many-{i}" for i in range(8)]
    mark = str(50_000 + int.from_bytes(os.urandom(2)))

    async def begin(i: int, session: str) -> None:
        out = await sh(bus, session, f"export KEPT=v{i}; sleep {mark} & echo started")
        assert "started" in out.content, out
        cell = await py(bus, session, f"kept = {i} * 6")
        assert cell.exception is None, cell

    async with anyio.create_task_group() as tg:  # started at once: one thread each, then idle
        for i, session in enumerate(sessions):
            tg.start_soon(begin, i, session)
    await sh(bus, "long", "echo ready")

    async def long_command() -> None:  # running all along, in a shell started from an idle thread
        out = await sh(bus, "long", f"sleep {3 * _ANYIO_IDLE:g}; echo finished", timeout=120)
        assert out.content == "finished\n", out

    async with anyio.create_task_group() as tg:
        tg.start_soon(long_command)
        # Other work for three idle times over: every thread hop may retire the threads idle since.
        deadline = anyio.current_time() + 3 * _ANYIO_IDLE
        while anyio.current_time() < deadline:
            assert (await sh(bus, "busy", "echo ok")).content == "ok\n"
            await py(bus, "busy", "1")
            await anyio.sleep(0.5)
    for i, session in enumerate(sessions):
        out = await sh(bus, session, "echo $KEPT; jobs -r | wc -l")
        assert out.content == f"v{i}\n1\n", out
        cell = await py(bus, session, "kept")
        assert cell.result == str(i * 6), cell
        assert not cell.state_lost, cell


async def _mark(rt: Runtime, session: str, command: str) -> str:
    out = await rt.execute(session, events.CmdRun(id=1, command=command, blocking=True))
    assert isinstance(out, events.CmdOutput), out
    return out.content


async def test_a_session_given_back_keeps_its_sandbox_when_taken_again_before_its_stop(workspace: Path) -> None:
    others = set(_children(os.getpid()))  # (the test's Redis, say)

    def sandboxes() -> set[int]:
        return set(_children(os.getpid())) - others

    rt = Runtime(workspace_root=workspace)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(rt.watch)
            await rt.open_session("s", created="1000")
            assert await _mark(rt, "s", "export KEPT=yes; echo $KEPT") == "yes\n"
            await rt.release_session("s")  # parked: its stop waits for the event loop's next turn
            await rt.open_session("s", created="1000")
            assert await _mark(rt, "s", "echo $KEPT") == "yes\n"  # the same shell
            await rt.release_session("s")
            await wait_for(lambda: not sandboxes(), 5, "the given-back sandbox stopped once its turn came")
            await rt.open_session("s", created="1000")
            assert await _mark(rt, "s", "echo ${KEPT:-new}") == "new\n"  # a new shell
            tg.cancel_scope.cancel()
    finally:
        await rt.aclose()
    assert not sandboxes()


async def test_given_back_sessions_are_stopped_a_few_at_a_time_and_all_by_the_runtimes_close(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopping hundreds of parked sandboxes at once took every worker thread that starting a
    new one needs too: the stops are bounded (``STOPS_AT_ONCE``), and those still queued when
    the watchdog stops are done by :meth:`Runtime.aclose`."""
    stopping, most, stopped = 0, 0, 0
    close = _Session.close

    async def counted(session: _Session) -> None:
        nonlocal stopping, most, stopped
        with anyio.CancelScope(shield=True):  # (as the stop it wraps)
            stopping += 1
            most = max(most, stopping)
            await anyio.sleep(0.02)  # (long enough for every stop let through to overlap)
            await close(session)
            stopping -= 1
            stopped += 1

    monkeypatch.setattr(_Session, "close", counted)
    count = 4 * STOPS_AT_ONCE
    rt = Runtime(workspace_root=workspace)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(rt.watch)
            for i in range(count):
                await rt.open_session(f"p-{i}", created="1000")
            for i in range(count):
                await rt.release_session(f"p-{i}")
            for _ in range(500):
                await anyio.sleep(0.01)
                if stopped >= 2 * STOPS_AT_ONCE:
                    break
            assert most == STOPS_AT_ONCE
            assert stopped < count
            tg.cancel_scope.cancel()  # the worker stops: what is still queued waits for aclose
        await rt.aclose()
        assert stopped == count
    finally:
        await rt.aclose()


def test_a_kill_is_done_once_every_process_listed_was_signalled() -> None:
    """A killed process is listed until it has exited, and it forks no more: the kill lists the
    session again only while it finds processes not signalled yet (it had listed a dying
    sandbox until empty, each listing a read of every process's ``/proc`` entry)."""
    proc = subprocess.Popen(["sleep", "600"])
    listings = 0

    def dying(sid: int) -> list[tuple[int, int]]:  # the process, listed as if it took long to exit
        nonlocal listings
        listings += 1
        return [(proc.pid, proc.pid)]

    try:
        assert kill_processes(proc.pid, lister=dying) == 1
        assert proc.wait(timeout=10) == -9
        assert listings == 2
    finally:
        proc.kill()
        proc.wait()


# --- 4. a fixed PATH ---------------------------------------------------------------------------------


@pytest.mark.security
async def test_the_workers_path_does_not_reach_its_sandboxes(
    standalone_worker: Callable[..., WorkerProcess], tmp_path: Path, standalone_bus: Bus
) -> None:
    private = tmp_path / ("worker-only-" + os.urandom(4).hex())
    private.mkdir()
    standalone_worker("pathy", extra_env={"PATH": f"{private}:{os.environ['PATH']}"})
    shell = await sh(standalone_bus, "p", "echo $PATH")
    cell = await py(standalone_bus, "p", "import os; os.environ['PATH']")
    assert shell.content == f"{SANDBOX_PATH}\n"
    assert cell.result == repr(SANDBOX_PATH)
    assert private.name not in shell.content + (cell.result or "")


# --- 2. a uid of its own per session -------------------------------------------------------------


def _hashed_uid(workspace: Path) -> int:
    """The uid a root worker gave a session before uids were handed out: a hash of its path."""
    digest = hashlib.sha256(os.fsencode(os.path.abspath(workspace))).hexdigest()
    return Sandbox().uid_base + int(digest[:8], 16) % (1 << 20)


def _colliding_ids(root: Path) -> tuple[str, str]:
    """Two session ids whose workspaces hashed to the same uid (a birthday search)."""
    seen: dict[int, str] = {}
    for i in range(1 << 16):
        session = f"twin-{i}"
        uid = _hashed_uid(root / workspace_name(session))
        if uid in seen:
            return seen[uid], session
        seen[uid] = session
    raise AssertionError("no two ids share a hashed uid")


@pytest.mark.security
@pytest.mark.skipif(os.geteuid() != 0, reason="a non-root worker's sandboxes run in user namespaces of their own")
@pytest.mark.timeout(180)
async def test_a_session_id_chosen_to_share_a_uid_gets_its_own(
    standalone_bus: Bus, worker: WorkerProcess, workspace: Path, standalone_worker: Callable[..., WorkerProcess]
) -> None:
    bus = standalone_bus
    victim, attacker = _colliding_ids(workspace)
    assert (await sh(bus, victim, "echo ready")).content == "ready\n"
    # the attacker fills its process limit (RLIMIT_NPROC counts the processes of its uid)
    bomb = await py(
        bus,
        attacker,
        "import os, subprocess\nheld = []\ntry:\n    for _ in range(400):\n"
        "        held.append(subprocess.Popen(['sleep', '4321']))\nexcept OSError:\n    pass\n(len(held), os.getuid())",
    )
    assert bomb.result is not None, bomb
    held, uid_attacker = ast.literal_eval(bomb.result)  # (its own session is full: no shell of its own starts)
    assert 0 < held < 400, bomb
    forked = await sh(bus, victim, "/bin/true && echo forked; echo $UID", timeout=60)
    assert forked.content.startswith("forked\n"), forked
    uid_victim = int(forked.content.split()[-1])
    assert uid_victim != uid_attacker
    assert _hashed_uid(workspace / workspace_name(victim)) == _hashed_uid(workspace / workspace_name(attacker))
    # each session keeps its uid (kept in its meta: a takeover runs it as the same user)
    client = sync_client(worker.redis_url)
    try:
        numbers = [client.hget(worker.keys.meta(s), "uid") for s in (victim, attacker)]
    finally:
        client.close()
    assert None not in numbers
    assert len(set(numbers)) == 2
    # a takeover runs the session as the same user
    worker.kill()
    standalone_worker("heir")
    assert int((await sh(bus, victim, "echo $UID")).content) == uid_victim


# --- 5. a workspace belongs to one log -------------------------------------------------------------


@pytest.mark.security
async def test_a_log_made_again_under_the_same_id_starts_with_an_empty_workspace(
    standalone_bus: Bus, worker: WorkerProcess, workspace: Path
) -> None:
    bus = standalone_bus
    assert (await sh(bus, "again", "echo old-secret > secret.txt; echo kept > /tmp/t; echo ok")).content == "ok\n"
    assert (workspace / workspace_name("again") / "secret.txt").exists()
    client = sync_client(worker.redis_url)
    try:
        doomed = list(client.scan_iter(match=f"{worker.keys.prefix}:{{again}}:*"))
        assert doomed
        client.delete(*doomed)  # the log and everything of it, as a wipe leaves it
    finally:
        client.close()
    fresh = await sh(bus, "again", "ls -A; cat secret.txt /tmp/t 2>&1; echo end")
    assert "old-secret" not in fresh.content, fresh
    assert "kept" not in fresh.content, fresh
    assert fresh.content.endswith("end\n")
    assert not (workspace / workspace_name("again") / "secret.txt").exists()
    # the new log's workspace is its own from now on, and is kept
    assert (await sh(bus, "again", "echo new > mine.txt; cat mine.txt")).content == "new\n"


# --- 3. one bounded /tmp per session ------------------------------------------------------------------


def _tmpfs_mounts(pid: int) -> list[str]:
    """The tmpfs mounts a process sees, by device (``major:minor``) and mount point."""
    with open(f"/proc/{pid}/mountinfo", encoding="utf-8") as fh:
        rows = [line.split() for line in fh]
    return [f"{row[2]} {row[4]}" for row in rows if row[row.index("-") + 1] == "tmpfs"]


@pytest.mark.security
@pytest.mark.skipif(os.geteuid() != 0, reason="a non-root worker gives each sandbox process a tmpfs of its own")
async def test_a_session_has_one_bounded_tmp_and_writing_past_it_fails(
    standalone_worker: Callable[..., WorkerProcess], workspace: Path, standalone_bus: Bus
) -> None:
    bus = standalone_bus
    proc = standalone_worker("tmpy", extra_env={"RIVERBED_SANDBOX_TMP_BYTES": str(8 << 20)})
    try:
        shell = await sh(bus, "t", "head -c 6M /dev/zero > /tmp/from-shell && echo wrote; stat -c %d /tmp")
        assert shell.content.startswith("wrote\n"), shell
        cell = await py(
            bus,
            "t",
            "import os, errno\ntry:\n    with open('/tmp/from-cell', 'wb') as fh:\n"
            "        fh.write(b'x' * (4 << 20))\n    outcome = 'wrote'\nexcept OSError as exc:\n"
            "    outcome = errno.errorcode[exc.errno]\n"
            "(outcome, os.path.getsize('/tmp/from-shell'), os.stat('/tmp').st_dev)",
        )
        assert cell.exception is None, cell  # (the shell's file not found: another /tmp)
        outcome, seen, device = ast.literal_eval(cell.result or "")
        assert outcome == "ENOSPC", cell  # 6 MiB from the shell + 4 MiB from the cell > 8 MiB
        assert seen == 6 << 20  # the shell's file: the same /tmp
        assert device == int(shell.content.split()[1])
        again = await sh(bus, "t", "rm /tmp/from-shell /tmp/from-cell; head -c 9M /dev/zero > /tmp/big; echo rc=$?")
        assert "No space left on device" in again.content, again
        assert "rc=1" in again.content, again
        # seen from the host: no tmpfs of the session is mounted where the worker is; one holder
        # process keeps the session's, and it goes with a SIGKILLed worker
        assert not [m for m in _tmpfs_mounts(os.getpid()) if workspace.name in m or str(workspace) in m]
        (holder,) = [pid for pid in _children(proc.proc.pid) if _comm(pid) == "cat"]
    finally:
        proc.close()
    with anyio.fail_after(10):
        while _comm(holder) == "cat":
            await anyio.sleep(0.05)


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children", encoding="utf-8") as fh:
            found += [int(child) for child in fh.read().split()]
    return found


def _comm(pid: int) -> str | None:
    """A live process's name (None: gone, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            head, _, rest = fh.read().rpartition(")")
    except OSError:
        return None
    return None if rest.split()[0] == "Z" else head.partition("(")[2]


async def test_an_earlier_logs_workspace_is_put_away_and_not_read_for_context(workspace: Path) -> None:
    rt = Runtime(workspace_root=workspace)
    try:
        await rt.open_session("s", created="1000")
        wrote = await rt.execute("s", events.FileWrite(id=1, path="AGENTS.md", content="the old log's notes"))
        assert isinstance(wrote, events.FileWritten), wrote
        ws = rt.workspace("s")
        # what the memory role asks before it reads a workspace for context
        assert belongs_to(ws, "1000")
        assert not belongs_to(ws, "2000")
        await rt.close_session("s")
        await rt.open_session("s", created="2000")  # the same id, a new log
        assert not (ws / "AGENTS.md").exists()
        assert belongs_to(ws, "2000")
        listed = await rt.execute("s", events.CmdRun(id=1, command="ls -A | wc -l", blocking=True))
        assert isinstance(listed, events.CmdOutput), listed
        assert listed.content == "0\n"
    finally:
        await rt.aclose()


async def test_sandbox_user_numbers_are_one_per_session_and_kept(bus: Bus) -> None:
    log = bus.log_store
    for session in ("n-1", "n-2"):
        await bus.session(session).append(events.Message(content="hi", source="user"))
    first, second = await log.sandbox_user("n-1"), await log.sandbox_user("n-2")
    assert first != second
    assert await log.sandbox_user("n-1") == first  # kept in the session's meta
    # a session whose log is gone gets a number of its own, recorded nowhere
    lost = await log.sandbox_user("n-gone")
    assert lost not in (first, second)
    assert await bus.redis.hget(bus.keys.meta("n-gone"), "uid") is None


def test_a_killed_sandbox_slow_to_exit_is_reaped_when_it_goes(recwarn: pytest.WarningsRecorder) -> None:
    """A sandbox process that outlives the wait for its exit (a loaded machine) is not dropped
    while it runs: a thread reaps it when it goes, and no process is left unwaited for."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    assert not wait_exit(proc, 0.1)
    pid = proc.pid
    del proc
    gc.collect()  # (a Popen dropped while it runs warns here: ResourceWarning)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists():  # (a zombie still has its /proc entry)
        assert time.monotonic() < deadline, "the process was never reaped"
        time.sleep(0.05)
    assert not [w for w in recwarn if issubclass(w.category, ResourceWarning)]

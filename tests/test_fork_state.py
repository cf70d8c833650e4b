"""A fork continues where the source was: its sandbox is rebuilt by the runtime that serves it.

Real Redis, real runtime worker processes (namespaces sandboxes), the real ``riverbed fork``.
"""

from __future__ import annotations

import functools
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from riverbed import events
from riverbed.agent.replay import fork, wait_rebuilt
from riverbed.client.session import Bus, Session
from riverbed.errors import ActTimeout, InputError
from riverbed.runtime.paths import workspace_name
from tests.kit.cli import run
from tests.kit.workers import Spawn, WorkerProcess, spawn, workers  # noqa: F401  (fixtures)

pytestmark = pytest.mark.anyio


@pytest.fixture
def start_worker(spawn: Spawn) -> Callable[..., WorkerProcess]:
    def start(name: str = "fork-w1") -> WorkerProcess:
        worker = spawn(name, ["runtime"])
        worker.wait_ready()
        return worker

    return start


async def act(session: Session, action: events.Action) -> events.Event:
    answer = await session.act(action, timeout=30)
    assert not isinstance(answer, events.Error), answer
    return answer


async def state(session: Session) -> tuple[str, str, str | None]:
    """What the next file_read, `echo $VAR` and Python cell see."""
    notes = await act(session, events.FileRead(path="notes.txt"))
    shell = await act(session, events.CmdRun(command='echo "$VAR $(basename "$PWD")"'))
    cell = await act(session, events.PythonRun(code="x"))
    assert isinstance(notes, events.FileContent)
    assert isinstance(shell, events.CmdOutput)
    assert isinstance(cell, events.PythonOutput)
    return notes.content, shell.content.strip(), cell.result


async def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[bytes]:
    return await anyio.to_thread.run_sync(functools.partial(run, env, *args))


async def record_then_move_on(bus: Bus, session_id: str) -> int:
    """A session that wrote a file, exported a variable from a subdirectory and set a Python
    variable (the fork point: its last id), then changed all three."""
    source = bus.session(session_id, tenant="acme")
    await act(source, events.FileWrite(path="notes.txt", content="as of the fork\n"))
    await act(source, events.CmdRun(command="mkdir -p sub && cd sub && export VAR=early"))
    await act(source, events.PythonRun(code="x = 1"))
    at = await source.last_id()
    await act(source, events.FileWrite(path="notes.txt", content="later\n"))
    await act(source, events.CmdRun(command="cd .. && export VAR=late"))
    await act(source, events.PythonRun(code="x = 2"))
    return at


async def test_a_fork_sees_files_shell_and_python_state_as_of_the_fork_point(
    bus: Bus, cli_env: dict[str, str], start_worker: Callable[..., WorkerProcess]
) -> None:
    start_worker()
    at = await record_then_move_on(bus, "src")
    assert await state(bus.session("src", tenant="acme")) == ("later\n", f"late {workspace_name('src')}", "2")

    result = await cli(cli_env, "fork", "src", "--at", str(at), "--into", "branch", "--json")
    assert result.returncode == 0, result.stderr.decode()
    report = json.loads(result.stdout)
    assert report == {
        "session": "branch",
        "source": "src",
        "at": at,
        "forked_id": at + 1,
        "workspace": "replay",
        "actions": 3,
        "differences": [],
        "note": "",
    }
    branch = bus.session("branch", tenant="acme")
    assert await state(branch) == ("as of the fork\n", "early sub", "1")

    log = await branch.events()
    rebuilt = [e for e in log if isinstance(e, events.SandboxRebuilt)]
    assert len(rebuilt) == 1
    assert (rebuilt[0].id, rebuilt[0].cause, rebuilt[0].method, rebuilt[0].tenant) == (at + 2, at + 1, "replay", "acme")
    # The re-executed actions were not answered again: one answer per action, as copied.
    causes = [e.cause for e in log if isinstance(e, events.Observation)]
    assert len(causes) == len(set(causes))
    # The source is untouched by its fork.
    assert await state(bus.session("src", tenant="acme")) == ("later\n", f"late {workspace_name('src')}", "2")


async def test_differences_during_the_rebuild_are_reported_with_exit_3(
    bus: Bus, cli_env: dict[str, str], workspace: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    start_worker()
    source = bus.session("seeded")
    await act(source, events.CmdRun(command="true"))  # creates the workspace
    (workspace / workspace_name("seeded") / "given.txt").write_text("put there by hand\n")
    await act(source, events.CmdRun(command="cat given.txt"))
    at = await source.last_id()

    human = await cli(cli_env, "fork", "seeded", "--at", str(at), "--into", "seeded-2")
    err = human.stderr.decode()
    assert human.returncode == 3, err
    assert "forked seeded at event 4 into seeded-2" in err
    assert "replaying 2 actions: 2 differences from the recording" in err
    assert "action 3 (cmd_run): content was 'put there by hand\\n', now" in err
    assert "action 3 (cmd_run): exit_code was 0, now 1" in err

    scripted = await cli(cli_env, "fork", "seeded", "--at", str(at), "--into", "seeded-3", "--json")
    assert scripted.returncode == 3, scripted.stderr.decode()
    report = json.loads(scripted.stdout)
    assert {(d["action_id"], d["field"]) for d in report["differences"]} == {(3, "content"), (3, "exit_code")}


async def test_copy_takes_the_source_workspace_and_empty_takes_nothing(
    bus: Bus, cli_env: dict[str, str], start_worker: Callable[..., WorkerProcess]
) -> None:
    start_worker()
    at = await record_then_move_on(bus, "src")
    copied = await cli(cli_env, "fork", "src", "--at", str(at), "--into", "copied", "--workspace", "copy")
    assert copied.returncode == 0, copied.stderr.decode()
    assert "copied the source's workspace" in copied.stderr.decode()
    notes = await act(bus.session("copied", tenant="acme"), events.FileRead(path="notes.txt"))
    assert isinstance(notes, events.FileContent)
    assert notes.content == "later\n"  # the source's files now, not as of the fork point

    empty = await cli(cli_env, "fork", "src", "--at", str(at), "--into", "blank", "--workspace", "empty")
    assert empty.returncode == 0, empty.stderr.decode()
    listing = await act(bus.session("blank", tenant="acme"), events.CmdRun(command="ls -A"))
    assert isinstance(listing, events.CmdOutput)
    assert listing.content == ""
    assert not [e for e in await bus.session("blank", tenant="acme").events() if isinstance(e, events.SandboxRebuilt)]

    bad = await cli(cli_env, "fork", "src", "--at", str(at), "--into", "x", "--workspace", "clone")
    assert bad.returncode == 2
    assert "replay, copy or empty" in bad.stderr.decode()


async def test_a_worker_killed_during_the_rebuild_is_replaced_and_nothing_runs_twice(
    bus: Bus, workspace: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    first = start_worker("fork-w1")
    source = bus.session("slow")
    await act(source, events.CmdRun(command="echo once >> tally"))
    await act(source, events.CmdRun(command="sleep 2"))
    at = await source.last_id()
    forked_id = await fork(bus, "slow", at, "slow-fork")
    tally = workspace / workspace_name("slow-fork") / "tally"
    with anyio.fail_after(20):
        while not tally.exists():  # the rebuild has run the first action and sleeps in the second
            await anyio.sleep(0.02)
    first.kill()
    second = start_worker("fork-w2")
    built = await wait_rebuilt(bus, "slow-fork", forked_id, timeout=30)
    assert (built.actions, built.differences) == (2, [])
    assert tally.read_text() == "once\n"  # emptied and rebuilt, not appended to twice
    # Nor is the rebuild repeated by a worker that opens the fork afterwards.
    assert await anyio.to_thread.run_sync(second.terminate) == 0
    start_worker("fork-w3")
    check = await act(bus.session("slow-fork"), events.CmdRun(command="cat tally"))
    assert isinstance(check, events.CmdOutput)
    assert check.content == "once\n"
    assert len([e for e in await bus.session("slow-fork").events() if isinstance(e, events.SandboxRebuilt)]) == 1


async def test_without_a_runtime_worker_the_fork_is_made_and_the_wait_says_why(bus: Bus) -> None:
    await bus.session("alone").append(events.Message(content="hi", source="user"))
    forked_id = await fork(bus, "alone", 1, "alone-2")
    with pytest.raises(ActTimeout, match=r"no runtime worker rebuilt its sandbox within 0\.3s"):
        await wait_rebuilt(bus, "alone-2", forked_id, timeout=0.3)
    with pytest.raises(InputError, match="replay, copy or empty"):
        await fork(bus, "alone", 1, "alone-3", workspace="clone")  # type: ignore[arg-type]


async def test_a_message_only_fork_returns_at_once_without_a_runtime_worker(bus: Bus, cli_env: dict[str, str]) -> None:
    """Nothing to replay (no runtime action in 1..N): fork does not wait for a worker."""
    await bus.session("chat").append(*[events.Message(content=f"m{i}", source="user") for i in range(80)])
    # Even told to wait for a rebuild, it does not: there is nothing to rebuild.
    result = await cli(cli_env, "fork", "chat", "--at", "50", "--into", "chat-2", "--wait")
    err = result.stderr.decode()
    assert result.returncode == 0, err
    assert "forked chat at event 50 into chat-2" in err
    assert "hold no runtime action" in err
    scripted = await cli(cli_env, "fork", "chat", "--at", "50", "--into", "chat-3", "--json")
    assert scripted.returncode == 0, scripted.stderr.decode()
    assert json.loads(scripted.stdout)["rebuild"] == "not needed"


async def test_a_fork_to_replay_without_a_runtime_worker_says_when_it_is_rebuilt(
    bus: Bus, cli_env: dict[str, str], start_worker: Callable[..., WorkerProcess]
) -> None:
    worker = start_worker()
    at = await record_then_move_on(bus, "src")
    assert await anyio.to_thread.run_sync(worker.terminate) == 0  # (it leaves the registry)

    made = await cli(cli_env, "fork", "src", "--at", str(at), "--into", "later")
    err = made.stderr.decode()
    assert made.returncode == 0, err
    assert "its sandbox is rebuilt (replay) when a runtime worker takes later" in err
    assert "no runtime worker is running now" in err

    waited = await cli(cli_env, "fork", "src", "--at", str(at), "--into", "later-2", "--wait", "--timeout", "0.5")
    assert waited.returncode == 1, waited.stderr.decode()
    assert "no runtime worker rebuilt its sandbox within 0.5s" in waited.stderr.decode()

    # The rebuild happens when a worker takes the fork; --wait then reports it.
    start_worker("fork-w2")
    assert await state(bus.session("later", tenant="acme")) == ("as of the fork\n", "early sub", "1")
    rebuilt = [e for e in await bus.session("later", tenant="acme").events() if isinstance(e, events.SandboxRebuilt)]
    assert [(e.actions, e.differences) for e in rebuilt] == [(3, [])]


async def test_the_runtime_starts_from_saved_settings_and_reads_only_the_log_after_it(
    bus: Bus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from structlog.testing import capture_logs  # noqa: PLC0415

    from riverbed.bus.consumer import Owner  # noqa: PLC0415
    from riverbed.runtime import Runtime  # noqa: PLC0415
    from riverbed.workers import runtime_role  # noqa: PLC0415

    monkeypatch.setattr(runtime_role, "SAVE_EVERY", 20)
    monkeypatch.setattr(runtime_role, "SAVE_ON_CLOSE", 1)
    session = bus.session("settled")
    await session.append(events.SessionConfig(env={"GREETING": "hello", "DROPPED": "x"}, source="user"))
    await session.append(*[events.Message(content=f"m{i}", source="user") for i in range(30)])

    async def serve_once(worker: str, command: str) -> tuple[events.Event, list[dict[str, object]]]:
        runtime = Runtime(workspace_root=tmp_path / worker)
        owner = Owner(bus.redis, bus.keys, runtime_role.RuntimeHandler(runtime), worker=worker, url=bus.url)
        with capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                await tg.start(owner.run)
                answer = await session.act(events.CmdRun(command=command), timeout=20)
                await owner.drain(5)
        await runtime.aclose()
        return answer, logs

    answer, logs = await serve_once("r1", 'echo "$GREETING"')
    assert isinstance(answer, events.CmdOutput)
    assert answer.content.strip() == "hello"
    assert await bus.redis.hget(bus.keys.folds("settled"), "runtime") is not None

    # Settings after the save, then a new owner: it reads only the log after the saved fold.
    await session.append(events.SessionConfig(env={"DROPPED": None, "NAME": "riverbed"}, source="user"))
    answer, logs = await serve_once("r2", 'echo "$GREETING ${DROPPED:-unset} $NAME"')
    assert isinstance(answer, events.CmdOutput)
    assert answer.content.strip() == "hello unset riverbed"
    (opened,) = [e for e in logs if e["event"] == "runtime.opened"]
    assert opened["saved"] >= 30
    assert opened["folded"] <= 3

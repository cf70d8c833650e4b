"""The Runtime's public surface: dispatch, errors, env, custom kinds, sessions, logs."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
import structlog

from riverbed import events
from riverbed.errors import InputError, UnavailableError
from riverbed.runtime import HandlerContext, Limits, Runtime, Sandbox, handler

pytestmark = pytest.mark.anyio


@events.register
class Deploy(events.Action, frozen=True, kw_only=True, tag="test_runtime_deploy"):
    target: str


@events.register
class Ping(events.Action, frozen=True, kw_only=True, tag="test_runtime_ping"):
    pass


@events.register
class Orphan(events.Action, frozen=True, kw_only=True, tag="test_runtime_orphan"):
    pass


@handler(Ping)
async def ping(ctx: HandlerContext, action: Ping) -> events.Observation:
    return events.Error(content=f"pong from {ctx.session_id}", reason="pong", cause=None)


@pytest.fixture
async def rt(workspace: Path) -> AsyncIterator[Runtime]:
    runtime = Runtime(workspace_root=workspace, limits=Limits(soft_timeout=2.0))
    yield runtime
    await runtime.aclose()


async def test_kinds_the_runtime_does_not_run_are_errors(rt: Runtime) -> None:
    cases: list[events.Event] = [
        events.Message(id=1, content="hi", source="user"),
        events.Recall(id=2, query="x"),
        events.Think(id=3, thought="hmm"),
        events.Unknown(id=4, source="agent", original_kind="teleport", payload={"kind": "teleport"}),
        events.Unknown(id=5, source="user", original_kind="cmd_run", payload={"kind": "cmd_run", "v": 9}),
        events.CmdOutput(id=6, content="not an action"),
        Orphan(id=7),
    ]
    for event in cases:
        obs = await rt.execute("s", event)
        assert isinstance(obs, events.Error), event
        assert obs.reason == "unknown_kind"
        assert obs.cause == event.id
        assert not obs.retryable


async def test_env_reaches_bash_and_python(rt: Runtime) -> None:
    rt.set_env("s", {"RB_FOO": "one two", "RB_BAR": "x"})
    shell = await rt.execute("s", events.CmdRun(id=1, command='echo "$RB_FOO|$RB_BAR"'))
    assert isinstance(shell, events.CmdOutput)
    assert shell.content == "one two|x\n"
    py = await rt.execute(
        "s", events.PythonRun(id=2, code="import os\n(os.environ.get('RB_FOO'), os.environ.get('RB_BAR'))")
    )
    assert isinstance(py, events.PythonOutput)
    assert py.result == "('one two', 'x')"

    rt.set_env("s", {"RB_FOO": "it's changed", "RB_BAR": None})
    shell = await rt.execute("s", events.CmdRun(id=3, command='echo "$RB_FOO|${RB_BAR-unset}"'))
    assert isinstance(shell, events.CmdOutput)
    assert shell.content == "it's changed|unset\n"
    py = await rt.execute(
        "s", events.PythonRun(id=4, code="import os\n(os.environ.get('RB_FOO'), os.environ.get('RB_BAR'))")
    )
    assert isinstance(py, events.PythonOutput)
    assert py.result == '("it\'s changed", None)'
    sub = await rt.execute(
        "s", events.PythonRun(id=5, code="import subprocess\nsubprocess.run(['sh', '-c', 'echo $RB_FOO'])")
    )
    assert isinstance(sub, events.PythonOutput)
    assert sub.content == "it's changed\n"
    assert rt.env("s")["RB_FOO"] == "it's changed"
    assert "RB_BAR" not in rt.env("s")

    with pytest.raises(InputError):
        rt.set_env("s", {"BAD NAME": "x"})
    with pytest.raises(InputError):
        rt.set_env("s", {"OK": "nul\x00"})


async def test_the_worker_environment_does_not_leak(rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RB_SECRET_TOKEN", "hunter2")
    out = await rt.execute("s", events.CmdRun(id=1, command='echo "[${RB_SECRET_TOKEN-}] $HOME"'))
    assert isinstance(out, events.CmdOutput)
    assert out.content == f"[] {rt.workspace('s')}\n"


async def test_custom_action_kinds(rt: Runtime) -> None:
    seen: list[tuple[str, Path, str | None]] = []

    @rt.handler(Deploy)
    async def deploy(ctx: HandlerContext, action: Deploy) -> events.Observation:
        seen.append((ctx.session_id, ctx.workspace, ctx.env.get("RB_STAGE")))
        target = ctx.resolve(action.target)
        target.write_text("deployed")
        return events.FileWritten(path=action.target)

    rt.set_env("tenant/one", {"RB_STAGE": "prod"})
    obs = await rt.execute("tenant/one", Deploy(id=9, target="release.txt"))
    assert isinstance(obs, events.FileWritten)
    assert obs.cause == 9
    assert seen == [("tenant/one", rt.workspace("tenant/one"), "prod")]
    assert (rt.workspace("tenant/one") / "release.txt").read_text() == "deployed"

    escape = await rt.execute("tenant/one", Deploy(id=10, target="../../x"))
    assert isinstance(escape, events.Error)
    assert escape.reason == "path_outside_workspace"

    pong = await rt.execute("s", Ping(id=11))
    assert isinstance(pong, events.Error)
    assert (pong.reason, pong.content, pong.cause) == ("pong", "pong from s", 11)
    assert rt.handles(Deploy)
    assert rt.handles(Ping)
    assert not rt.handles(Orphan)


async def test_handler_failures_become_errors(rt: Runtime) -> None:
    @rt.handler(Deploy)
    async def deploy(ctx: HandlerContext, action: Deploy) -> events.Observation:
        if action.target == "flaky":
            raise UnavailableError("the deploy service is down; try again")
        if action.target == "wrong":
            return "not an event"  # type: ignore[return-value]
        raise RuntimeError("boom")

    flaky = await rt.execute("s", Deploy(id=1, target="flaky"))
    assert isinstance(flaky, events.Error)
    assert (flaky.reason, flaky.retryable) == ("handler_failed", True)
    broken = await rt.execute("s", Deploy(id=2, target="x"))
    assert isinstance(broken, events.Error)
    assert (broken.reason, broken.retryable) == ("handler_failed", False)
    assert "boom" in broken.content
    wrong = await rt.execute("s", Deploy(id=3, target="wrong"))
    assert isinstance(wrong, events.Error)
    assert wrong.reason == "bad_handler_result"


def test_registration_is_checked(workspace: Path) -> None:
    rt = Runtime(workspace_root=workspace)

    class NotRegistered(events.Action, frozen=True, kw_only=True, tag="test_runtime_unregistered"):
        pass

    with pytest.raises(ValueError, match="register"):
        rt.handler(NotRegistered)
    with pytest.raises(ValueError, match="answered_by"):
        rt.handler(events.Recall)
    with pytest.raises(TypeError):
        rt.handler(events.CmdOutput)  # type: ignore[arg-type]


async def test_sessions_run_concurrently_and_stay_apart(rt: Runtime) -> None:
    results: dict[str, events.Observation] = {}

    async def one(session: str) -> None:
        command = "date +%s.%N; sleep 1; pwd; date +%s.%N"
        results[session] = await rt.execute(session, events.CmdRun(id=1, command=command, blocking=True))

    async with anyio.create_task_group() as tg:
        for session in ("a", "b", "c"):
            tg.start_soon(one, session)
    spans = []
    for session in ("a", "b", "c"):
        obs = results[session]
        assert isinstance(obs, events.CmdOutput)
        began, where, ended = obs.content.splitlines()
        assert where == str(rt.workspace(session))
        spans.append((float(began), float(ended)))
    # Concurrently: every command had begun before any of them ended.
    assert max(b for b, _ in spans) < min(e for _, e in spans)
    assert sorted(rt.sessions()) == ["a", "b", "c"]


async def test_one_session_runs_its_actions_in_order(rt: Runtime) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(rt.execute, "s", events.CmdRun(id=1, command="sleep 0.3; echo first > order.txt", blocking=True))
        await anyio.sleep(0.1)
        tg.start_soon(rt.execute, "s", events.CmdRun(id=2, command="echo second >> order.txt", blocking=True))
    assert (rt.workspace("s") / "order.txt").read_text() == "first\nsecond\n"


async def test_one_log_line_per_action_and_closing(workspace: Path) -> None:
    rt = Runtime(workspace_root=workspace)
    with structlog.testing.capture_logs() as logs:
        await rt.execute("s", events.FileWrite(id=1, path="x", content="y"))
        await rt.execute("s", events.FileRead(id=2, path="../x"))
        await anyio.lowlevel.checkpoint()  # the line is written once the event loop turns (after the answer went out)
    handled = [entry for entry in logs if entry["event"] == "action handled"]
    assert [(e["event_id"], e["kind"], e["result"], e["reason"]) for e in handled] == [
        (1, "file_write", "file_written", None),
        (2, "file_read", "error", "path_outside_workspace"),
    ]
    await rt.execute("s", events.CmdRun(id=3, command="true"))
    await rt.close_session("s")
    assert rt.sessions() == []
    assert (rt.workspace("s") / "x").read_text() == "y"
    await rt.aclose()
    closed = await rt.execute("s", events.CmdRun(id=4, command="true"))
    assert isinstance(closed, events.Error)
    assert (closed.reason, closed.retryable, closed.cause) == ("runtime_closed", True, 4)


async def test_watch_enforces_the_process_limit_between_commands(workspace: Path) -> None:
    # The process-count watcher bounds process-mode sandboxes (a namespaces sandbox of a root
    # worker has RLIMIT_NPROC on a uid of its own instead: see test_security_sandbox.py).
    rt = Runtime(workspace_root=workspace, limits=Limits(max_processes=10), sandbox=Sandbox(mode="process"))
    try:
        out = await rt.execute("s", events.CmdRun(id=1, command="for i in $(seq 20); do sleep 323 & done"))
        assert isinstance(out, events.CmdOutput)
        with anyio.fail_after(5):
            while _count(b"sleep\x00323\x00") != 20:
                await anyio.sleep(0.05)
        async with anyio.create_task_group() as tg:
            await tg.start(lambda task_status: rt.watch(interval=0.2, task_status=task_status))
            with anyio.fail_after(5):
                while _count(b"sleep\x00323\x00"):
                    await anyio.sleep(0.1)
            tg.cancel_scope.cancel()
    finally:
        await rt.aclose()


def _count(cmdline: bytes) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    count += fh.read() == cmdline
            except OSError:
                pass
    return count

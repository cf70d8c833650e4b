"""The session shell: persistence, timeouts, input, interrupts, caps, process limits (real bash)."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from riverbed import events
from riverbed.runtime import Limits, Runtime, Sandbox
from tests.kit.patience import within

pytestmark = pytest.mark.anyio


@pytest.fixture
async def rt(workspace: Path) -> AsyncIterator[Runtime]:
    # (a command that takes Ctrl-C ends well within the grace, however busy the machine; only the
    # one that ignores it waits the grace out)
    runtime = Runtime(workspace_root=workspace, limits=Limits(soft_timeout=1.0, interrupt_grace=within(4.0)))
    yield runtime
    await runtime.aclose()


async def run(rt: Runtime, command: str, session: str = "s", **kw: object) -> events.CmdOutput:
    obs = await rt.execute(session, events.CmdRun(id=1, command=command, **kw))  # type: ignore[arg-type]
    assert isinstance(obs, events.CmdOutput), obs
    assert obs.cause == 1
    return obs


async def _until_count(needle: bytes, expected: int) -> None:
    with anyio.fail_after(5):
        while _count_cmdline(needle) != expected:
            await anyio.sleep(0.05)


def _count_cmdline(needle: bytes) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    if fh.read() == needle:
                        count += 1
            except OSError:
                pass
    return count


async def test_cwd_and_exports_persist(rt: Runtime) -> None:
    first = await run(rt, "mkdir -p sub/dir && cd sub/dir && export GREETING=hello && echo done")
    assert first.content == "done\n"
    assert first.exit_code == 0
    second = await run(rt, "pwd; echo $GREETING")
    assert second.content == f"{rt.workspace('s')}/sub/dir\nhello\n"


async def test_exit_codes_and_multiline_scripts(rt: Runtime) -> None:
    assert (await run(rt, "false")).exit_code == 1
    assert (await run(rt, "(exit 7)")).exit_code == 7
    script = await run(rt, "cat <<EOF\nline one\nEOF\nfor i in 1 2; do\n  echo n$i\ndone")
    assert script.content == "line one\nn1\nn2\n"
    assert script.exit_code == 0
    unbalanced = await run(rt, "echo 'oops")
    assert unbalanced.exit_code != 0
    assert (await run(rt, "echo fine")).content == "fine\n"


async def test_exit_ends_the_shell_and_the_next_command_gets_a_new_one(rt: Runtime) -> None:
    gone = await run(rt, "exit 3")
    assert gone.exit_code == 3
    assert "shell exited" in gone.content
    assert (await run(rt, "echo back")).content.startswith("back")


async def test_hard_timeout_interrupts_and_the_shell_keeps_its_state(rt: Runtime) -> None:
    await run(rt, "mkdir -p keep && cd keep && export KEPT=yes")
    hung = await run(rt, "echo start; sleep 60", timeout=1.0, blocking=True)
    assert hung.timed_out
    assert hung.content.startswith("start\n")
    assert "timed out" in hung.content
    after = await run(rt, "pwd; echo $KEPT")
    assert after.content == f"{rt.workspace('s')}/keep\nyes\n"
    assert not after.timed_out


async def test_a_command_that_ignores_ctrl_c_is_killed(rt: Runtime) -> None:
    stubborn = await run(rt, "trap '' INT; sh -c 'trap \"\" INT; sleep 50'", timeout=0.5, blocking=True)
    assert stubborn.timed_out
    assert (await run(rt, "echo alive")).content == "alive\n"


async def test_input_to_a_prompt_and_ctrl_c(rt: Runtime) -> None:
    prompt = await run(rt, "read -p 'name? ' who; echo hello $who")
    assert prompt.timed_out
    assert prompt.exit_code is None
    assert prompt.content.startswith("name? ")
    busy = await rt.execute("s", events.CmdRun(id=2, command="ls"))
    assert isinstance(busy, events.Error)
    assert busy.reason == "command_running"
    assert busy.retryable
    answered = await run(rt, "bob", is_input=True)
    assert answered.content == "hello bob\n"
    assert answered.exit_code == 0

    waiting = await run(rt, "cat")
    assert waiting.timed_out
    stopped = await run(rt, "C-c", is_input=True)
    assert stopped.exit_code == 130
    assert (await run(rt, "echo next")).content == "next\n"
    nothing = await rt.execute("s", events.CmdRun(id=3, command="more", is_input=True))
    assert isinstance(nothing, events.Error)
    assert nothing.reason == "no_running_command"


async def test_ctrl_c_interrupts_a_command_of_a_worker_that_ignores_it(workspace: Path) -> None:
    """A worker started by ``nohup`` or with ``&`` in a script ignores SIGINT and SIGQUIT, and an
    ignored signal stays ignored across ``exec``: its sandboxes still start with the defaults."""
    before = {number: signal.signal(number, signal.SIG_IGN) for number in (signal.SIGINT, signal.SIGQUIT)}
    rt = Runtime(workspace_root=workspace, limits=Limits(soft_timeout=1.0, interrupt_grace=within(4.0)))
    try:
        assert (await run(rt, "cat")).timed_out
        stopped = await run(rt, "C-c", is_input=True)
        assert stopped.exit_code == 130
        assert (await run(rt, "trap -p; echo next")).content == "next\n"  # (nothing left ignored)
    finally:
        await rt.aclose()
        for number, handler in before.items():
            signal.signal(number, handler)


async def test_an_empty_command_waits_for_more_output(rt: Runtime) -> None:
    slow = await run(rt, "echo a; sleep 1.5; echo b")
    assert slow.timed_out
    assert slow.content.startswith("a\n")
    rest = await run(rt, "", timeout=5)
    assert rest.content == "b\n"
    assert rest.exit_code == 0


async def test_output_flood_is_capped_in_the_middle(workspace: Path) -> None:
    rt = Runtime(workspace_root=workspace, limits=Limits(max_output_chars=2000))
    try:
        flood = await run(rt, "seq 1 200000")
    finally:
        await rt.aclose()
    assert flood.truncated
    assert flood.exit_code == 0
    assert len(flood.content) < 2100
    assert flood.content.startswith("1\n2\n3\n")
    assert flood.content.endswith("199999\n200000\n")
    assert "characters truncated" in flood.content


async def test_children_and_loops_are_bounded_by_the_timeout(rt: Runtime) -> None:
    spawner = "for i in $(seq 10); do (sleep 317 &); done; while :; do :; done"
    out = await run(rt, spawner, timeout=1.0, blocking=True)
    assert out.timed_out
    assert "killed" in out.content
    await _until_count(b"sleep\x00317\x00", 0)  # killed (a dying process may linger a moment)
    assert (await run(rt, "echo ok")).content == "ok\n"


async def test_too_many_processes_are_killed(workspace: Path) -> None:
    rt = Runtime(workspace_root=workspace, limits=Limits(max_processes=15), sandbox=Sandbox(mode="process"))
    try:
        out = await run(rt, "for i in $(seq 30); do sleep 319 & done; wait", timeout=8, blocking=True)
        assert not out.timed_out
        assert "over the limit" in out.content
        await _until_count(b"sleep\x00319\x00", 0)  # killed (a dying process may linger a moment)
    finally:
        await rt.aclose()


async def test_cwd_field_is_confined(rt: Runtime) -> None:
    (rt.workspace("s") / "sub").mkdir(parents=True)
    inside = await run(rt, "pwd", cwd="sub")
    assert inside.content == f"{rt.workspace('s')}/sub\n"
    for bad, reason in (("../..", "path_outside_workspace"), ("/", "path_outside_workspace"), ("x\x00", "bad_path")):
        refused = await rt.execute("s", events.CmdRun(id=4, command="pwd", cwd=bad))
        assert isinstance(refused, events.Error)
        assert refused.reason == reason
        assert not refused.retryable


async def test_background_server_survives_between_commands(rt: Runtime) -> None:
    await run(rt, "sleep 321 & echo started")
    await _until_count(b"sleep\x00321\x00", 1)
    await run(rt, "echo other")
    assert _count_cmdline(b"sleep\x00321\x00") == 1
    await rt.close_session("s")
    await _until_count(b"sleep\x00321\x00", 0)  # killed (a dying process may linger a moment)


async def test_sandbox_processes_carry_the_rlimits(workspace: Path) -> None:
    limits = Limits(file_size=1024 * 1024, address_space=2 * 1024**3, cpu_seconds=100, open_files=256)
    rt = Runtime(workspace_root=workspace, limits=limits)
    try:
        out = await run(rt, "ulimit -f; ulimit -v; ulimit -t; ulimit -n; ulimit -c")
        assert out.content.split() == ["1024", str(2 * 1024 * 1024), "100", "256", "0"]
        big = await run(rt, "head -c 2000000 /dev/zero > big.bin; echo $?; stat -c %s big.bin")
        assert big.content.split()[-1] == str(1024 * 1024)
        assert big.content.split()[0] != "0"
        py = await rt.execute(
            "s", events.PythonRun(id=1, code="import resource\nresource.getrlimit(resource.RLIMIT_NOFILE)")
        )
        assert isinstance(py, events.PythonOutput)
        assert py.result == "(256, 256)"
    finally:
        await rt.aclose()

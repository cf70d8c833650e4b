"""The start gate's deadline, enforced inside the sandbox (``riverbed.runtime.gate``).

A worker checks its claim right before it hands a command to the sandbox, but the sandbox may
get the command later: the worker was paused between the check and the write, or the machine
was too loaded for the shell to read its line in time.  The deadline travels with the command,
and the shell or the Python driver refuses to start it once the deadline has passed (a file
write or edit, made in a worker thread, checks it right before its rename); the sandbox then
asks the gate again.  Here the gate gives deadlines that have already passed, as
a late delivery would find them."""

from __future__ import annotations

import time

import pytest

from riverbed import events
from riverbed.runtime import Runtime
from riverbed.runtime.gate import LATE_TRIES, gated
from tests.kit.runtime import rt  # noqa: F401  (a fixture)

pytestmark = pytest.mark.anyio


class Gate:
    """A gate that gives the deadlines it was told to, one per check (a late one: passed)."""

    def __init__(self, *late: bool) -> None:
        self.late = iter(late)
        self.checks = 0

    async def __call__(self) -> float:
        self.checks += 1
        return time.monotonic() + (-1.0 if next(self.late, False) else 30.0)


def ran(rt: Runtime) -> list[str]:
    path = rt.workspace("s") / "ran.txt"
    return path.read_text().split() if path.exists() else []


ACTIONS = {
    "cmd_run": lambda marker: events.CmdRun(id=7, command=f"echo {marker} >> ran.txt; echo {marker}"),
    "python_run": lambda marker: events.PythonRun(id=7, code=f"open('ran.txt', 'a').write('{marker} ')"),
    # the worker's own side effects, made in a worker thread
    "file_write": lambda marker: events.FileWrite(id=7, path="ran.txt", content=marker),
    "file_edit": lambda marker: events.FileEdit(id=7, command="create", path="ran.txt", file_text=marker),
}


@pytest.fixture(params=sorted(ACTIONS))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_a_start_found_late_asks_the_gate_again_and_runs_once(rt: Runtime, kind: str) -> None:
    await rt.execute("s", events.CmdRun(id=1, command="true"))  # (the sandbox is up: the next check is the gate's)
    gate = Gate(False, True)  # the runtime's own check is in time; the sandbox's first one is not
    with gated(gate):
        answer = await rt.execute("s", ACTIONS[kind]("once"))
    assert not isinstance(answer, events.Error), answer
    assert gate.checks == 3
    assert ran(rt) == ["once"]
    if isinstance(answer, events.CmdOutput):
        assert (answer.content, answer.exit_code) == ("once\n", 0)


async def test_a_start_late_every_time_never_runs_and_says_so(rt: Runtime, kind: str) -> None:
    await rt.execute("s", events.CmdRun(id=1, command="export KEPT=yes; set -x"))  # (the shell traces)
    gate = Gate(False, *[True] * LATE_TRIES)
    with gated(gate):
        answer = await rt.execute("s", ACTIONS[kind]("never"))
    assert isinstance(answer, events.Error), answer
    assert answer.reason == "sandbox_unavailable"
    assert answer.retryable
    assert f"{LATE_TRIES} times" in answer.content
    assert gate.checks == 1 + LATE_TRIES
    assert ran(rt) == []
    # The sandbox goes on as it was, with nothing of the gate's left in the shell.
    after = await rt.execute("s", events.CmdRun(id=9, command="set +x; echo $KEPT; set | grep -c __rb_ || true"))
    assert isinstance(after, events.CmdOutput), after
    assert after.content.endswith("yes\n0\n"), after.content


async def test_a_gated_command_keeps_its_exit_code_and_working_directory(rt: Runtime) -> None:
    (rt.workspace("s") / "sub").mkdir(parents=True)
    with gated(Gate()):
        failed = await rt.execute("s", events.CmdRun(id=2, command="pwd; false"))
    assert isinstance(failed, events.CmdOutput), failed
    assert failed.exit_code == 1
    with gated(Gate()):
        moved = await rt.execute("s", events.CmdRun(id=3, command="pwd", cwd="sub"))
    assert isinstance(moved, events.CmdOutput), moved
    assert moved.content.strip().endswith("/sub")


async def test_an_undo_found_late_keeps_the_step_to_undo(rt: Runtime) -> None:
    await rt.execute("s", events.FileWrite(id=1, path="notes.txt", content="one\n"))
    await rt.execute("s", events.FileEdit(id=2, command="str_replace", path="notes.txt", old_str="one", new_str="two"))
    gate = Gate(False, *[True] * LATE_TRIES)
    with gated(gate):
        late = await rt.execute("s", events.FileEdit(id=3, command="undo_edit", path="notes.txt"))
    assert isinstance(late, events.Error), late
    assert (rt.workspace("s") / "notes.txt").read_text() == "two\n"
    undone = await rt.execute("s", events.FileEdit(id=4, command="undo_edit", path="notes.txt"))
    assert not isinstance(undone, events.Error), undone
    assert (rt.workspace("s") / "notes.txt").read_text() == "one\n"

"""Persistent Python cells (a real driver process per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from riverbed import events
from riverbed.runtime import Limits, Runtime
from tests.kit.runtime import rt  # noqa: F401  (a fixture)

pytestmark = pytest.mark.anyio


async def cell(rt: Runtime, code: str, *, timeout: float | None = None, session: str = "s") -> events.PythonOutput:
    obs = await rt.execute(session, events.PythonRun(id=5, code=code, timeout=timeout))
    assert isinstance(obs, events.PythonOutput), obs
    assert obs.cause == 5
    return obs


async def test_names_survive_cells_and_a_timeout(rt: Runtime) -> None:
    defined = await cell(rt, "def double(x):\n    return 2 * x\ncounter = 1")
    assert defined.exception is None
    assert defined.result is None
    called = await cell(rt, "counter += 1\ndouble(21)")
    assert called.result == "42"
    hung = await cell(rt, "import time\nwhile True:\n    time.sleep(0.05)", timeout=0.5)
    assert hung.timed_out
    assert hung.exception is not None
    assert "KeyboardInterrupt" in hung.exception
    after = await cell(rt, "double(counter)")
    assert after.result == "4"
    assert not after.state_lost
    assert not after.timed_out


async def test_output_is_interleaved_and_the_cell_runs_in_the_workspace(rt: Runtime) -> None:
    out = await cell(
        rt,
        "import os, sys, subprocess\nprint('one')\nprint('two', file=sys.stderr)\n"
        "subprocess.run(['echo', 'three'])\nprint('four')\nos.getcwd()",
    )
    assert out.content == "one\ntwo\nthree\nfour\n"
    assert out.result == repr(str(rt.workspace("s")))


async def test_exceptions_carry_a_traceback(rt: Runtime) -> None:
    out = await cell(rt, "print('before')\ndef inner():\n    raise ValueError('bad value')\ninner()")
    assert out.content == "before\n"
    assert out.exception is not None
    assert "Traceback" in out.exception
    assert "ValueError: bad value" in out.exception
    assert "raise ValueError('bad value')" in out.exception
    assert "_driver.py" not in out.exception
    syntax = await cell(rt, "def broken(:\n    pass")
    assert syntax.exception is not None
    assert "SyntaxError" in syntax.exception
    exited = await cell(rt, "raise SystemExit(2)")
    assert exited.exception is not None
    assert "SystemExit" in exited.exception
    assert (await cell(rt, "1 + 1")).result == "2"


async def test_a_dead_process_restarts_with_state_lost(rt: Runtime) -> None:
    await cell(rt, "kept = 'value'")
    died = await cell(rt, "import os\nprint('bye', flush=True)\nos._exit(3)")
    assert died.content == "bye\n"
    assert died.exception is not None
    assert "exited with code 3" in died.exception
    fresh = await cell(rt, "'kept' in globals()")
    assert fresh.state_lost
    assert fresh.result == "False"
    assert not (await cell(rt, "kept = 1")).state_lost


async def test_a_cell_that_ignores_sigint_is_killed(rt: Runtime) -> None:
    code = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(30)"
    stuck = await cell(rt, code, timeout=0.5)
    assert stuck.timed_out
    assert "killed" in stuck.content
    assert (await cell(rt, "2 * 3")).state_lost


async def test_new_images_are_listed(rt: Runtime) -> None:
    out = await cell(
        rt,
        "import os\nos.makedirs('plots', exist_ok=True)\n"
        "open('plots/chart.png', 'wb').write(b'png')\n"
        "open('fig.svg', 'w').write('<svg/>')\n"
        "open('notes.txt', 'w').write('x')",
    )
    assert out.files == ["fig.svg", "plots/chart.png"]
    again = await cell(rt, "1")
    assert again.files == []


async def test_output_and_results_are_capped(workspace: Path) -> None:
    rt = Runtime(workspace_root=workspace, limits=Limits(max_output_chars=1000))
    try:
        out = await cell(rt, "for i in range(20000):\n    print(i)\n'x' * 5000")
    finally:
        await rt.aclose()
    assert out.truncated
    assert out.content.startswith("0\n1\n2\n")
    assert out.content.endswith("19999\n")
    assert out.result is not None
    assert len(out.result) < 1100


async def test_a_late_answer_of_another_cell_is_never_taken_for_this_one(rt: Runtime) -> None:
    """Cells are keyed by id: an answer (and an end-of-output marker) that belongs to another
    cell, such as one left over from a cell whose wait was cut short, does not end this cell."""
    import json  # noqa: PLC0415
    import struct  # noqa: PLC0415

    from riverbed.runtime.output import write_all  # noqa: PLC0415

    assert (await cell(rt, "x = 1")).exception is None
    python = rt._session("s").python  # the session's driver, as the runtime holds it
    stale = json.dumps({"cell": 10_000, "code": "'stale answer'", "env": {}}).encode()
    await write_all(python._to_driver, struct.pack(">I", len(stale)) + stale)
    fresh = await cell(rt, "import time\ntime.sleep(0.3)\n'fresh answer'")
    assert fresh.result == "'fresh answer'"
    assert (await cell(rt, "x + 1")).result == "2"


async def test_a_cell_that_does_not_parse_reads_as_pythons_prompt_shows_it(rt: Runtime) -> None:
    # The model reads this: the cell's own line and caret, no frame of the driver or of `ast`.
    syntax = await cell(rt, "x = 1\ndef broken(:\n    pass")
    assert syntax.exception is not None
    assert syntax.exception.splitlines()[0] == '  File "<cell-1>", line 2'
    assert "def broken(:" in syntax.exception
    assert syntax.exception.rstrip().endswith("SyntaxError: invalid syntax")
    assert "ast.py" not in syntax.exception
    assert "_driver.py" not in syntax.exception
    assert "Traceback" not in syntax.exception  # no frame to show
    # The cell's own use of `ast` keeps its frames: only the driver's parse is left out.
    nested = await cell(rt, "import ast\nast.parse('(')")
    assert nested.exception is not None
    assert '<cell-2>", line 2' in nested.exception
    assert "ast.py" in nested.exception

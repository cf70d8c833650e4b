"""Log lines: JSON lines written once per turn of the event loop, warnings at once, in order."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import anyio
import pytest

from riverbed.logs import LineWriter

pytestmark = pytest.mark.anyio


class Counted(io.BytesIO):
    """A stream that counts its writes."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.writes += 1
        return super().write(data)


async def test_lines_of_one_turn_go_in_one_write_and_a_warning_at_once_after_them() -> None:
    stream = Counted()
    writer = LineWriter(stream)
    writer.info(b"one")
    writer.info(b"two")
    assert stream.writes == 0  # held until the turn ends
    writer.warning(b"three")  # at once, after what was held
    assert (stream.writes, stream.getvalue()) == (1, b"one\ntwo\nthree\n")
    writer.info(b"four")
    writer.debug(b"five")
    await anyio.lowlevel.checkpoint()  # the turn ends
    assert (stream.writes, stream.getvalue().splitlines()[-2:]) == (2, [b"four", b"five"])
    await anyio.to_thread.run_sync(writer.info, b"six")  # off the event loop: at once
    assert (stream.writes, stream.getvalue().splitlines()[-1]) == (3, b"six")


def test_a_line_off_any_event_loop_goes_at_once() -> None:
    stream = Counted()
    LineWriter(stream).info(b"alone")
    assert stream.getvalue() == b"alone\n"


def test_lines_still_held_when_the_process_exits_are_written() -> None:
    """A process whose event loop stops right after logging, with no turn left to write the line."""
    code = (
        "import asyncio, structlog\n"
        "from riverbed.logs import configure_logging\n"
        "configure_logging('json')\n"
        "loop = asyncio.new_event_loop()\n"
        "def last():\n"
        "    structlog.get_logger('t').info('last words', n=1)\n"
        "    loop.stop()\n"
        "loop.call_soon(last)\n"
        "loop.run_forever()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, check=True)
    (line,) = done.stderr.splitlines()
    assert json.loads(line)["event"] == "last words"

"""The Python driver: runs cells for one session, keeping their names between cells.

Run as ``python -u _driver.py IN_FD OUT_FD MARKER`` with the worker's own interpreter.
Stdlib only and no imports from riverbed (it runs inside the sandbox).

Protocol: frames of a 4-byte big-endian length and a UTF-8 JSON object.
The runtime sends ``{"cell": id, "code": str, "env": {name: value or null}}``; the driver
applies the environment changes to ``os.environ``, runs the cell with fds 1 and 2 going to
the runtime's output pipe (so stdout and stderr stay in the order they were written), writes
MARKER + ``<id>__\x1e`` to fd 1, and answers ``{"cell": id, "result": repr or null,
"exception": traceback or null}``.  Both carry the cell's id, so a late answer of an
earlier cell can never be taken for a later one's.  A request may carry ``start_by``: when
``time.monotonic()`` has passed it, the cell is not run and the answer is ``{"cell": id,
"late": true}`` (``riverbed.runtime.gate``).
The first frame it sends is ``{"ready": true}``.  SIGINT during a cell raises
KeyboardInterrupt in the cell; between cells it is ignored.
"""

import ast
import builtins
import contextlib
import json
import linecache
import os
import signal
import struct
import sys
import time
import traceback
import types
from typing import Any


def _read_exact(fd: int, size: int) -> bytes | None:
    chunks: list[bytes] = []
    while size:
        try:
            chunk = os.read(fd, size)
        except KeyboardInterrupt:
            continue
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int) -> dict[str, Any] | None:
    head = _read_exact(fd, 4)
    if head is None:
        return None
    body = _read_exact(fd, struct.unpack(">I", head)[0])
    if body is None:
        return None
    frame: dict[str, Any] = json.loads(body)
    return frame


def _write_frame(fd: int, obj: dict[str, Any]) -> None:
    body = json.dumps(obj).encode()
    data = struct.pack(">I", len(body)) + body
    while data:
        try:
            data = data[os.write(fd, data) :]
        except KeyboardInterrupt:
            continue


_OWN_FRAMES = frozenset((__file__, ast.__file__))
"""Where the driver's frames come from: itself, and ``ast`` as it parses a cell."""


def _format(exc: BaseException) -> str:
    """The cell's traceback from its own first frame: the driver's frames (and ``ast``'s, for a
    cell that does not parse) are left out, so a ``SyntaxError`` reads as Python's prompt shows it."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in _OWN_FRAMES:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


class Cells:
    def __init__(self) -> None:
        self.count = 0
        self.module = types.ModuleType("__main__")
        self.module.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = self.module

    def run(self, code: str) -> tuple[str | None, str | None]:
        self.count += 1
        name = f"<cell-{self.count}>"
        linecache.cache[name] = (len(code), None, code.splitlines(keepends=True), name)
        result: str | None = None
        exception: str | None = None
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            tree = ast.parse(code, name, "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body[-1].value)
                tree.body.pop()
            namespace = self.module.__dict__
            exec(compile(tree, name, "exec"), namespace)  # noqa: S102  (running the cell is the point)
            if last is not None:
                value = eval(compile(last, name, "eval"), namespace)  # noqa: S307
                if value is not None:
                    result = repr(value)
                    namespace["_"] = value
        except BaseException as exc:  # the cell's exception, KeyboardInterrupt and SystemExit too
            exception = _format(exc)
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return result, exception


def main(argv: list[str]) -> None:
    in_fd, out_fd, marker = int(argv[0]), int(argv[1]), argv[2].encode()
    sys.path[0] = ""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cells = Cells()
    _write_frame(out_fd, {"ready": True})
    while True:
        try:
            request = _read_frame(in_fd)
            if request is None:
                return
            cell = request.get("cell")
            start_by = request.get("start_by")
            if start_by is not None and time.monotonic() >= start_by:  # too late: a peer may have it
                os.write(1, marker + f"{cell}__\x1e".encode())
                _write_frame(out_fd, {"cell": cell, "late": True})
                continue
            for name, value in (request.get("env") or {}).items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            result, exception = cells.run(request.get("code", ""))
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):  # a cell may have replaced or closed a stream
                    stream.flush()
            os.write(1, marker + f"{cell}__\x1e".encode())
            _write_frame(out_fd, {"cell": cell, "result": result, "exception": exception})
        except KeyboardInterrupt:
            continue


if __name__ == "__main__":
    main(sys.argv[1:])

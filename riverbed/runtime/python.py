"""Persistent Python cells: one driver process per session.

Why our own driver and not a Jupyter kernel: a kernel needs ``ipykernel`` and
``jupyter_client`` (ZeroMQ, tornado, a connection file and five sockets) for what is here
a single client and a single stream of cells.  ``_driver.py`` is about a hundred lines of
stdlib run by the worker's own interpreter; it talks over two private pipes with
length-prefixed JSON frames, and its stdout and stderr share one pipe, so output arrives
interleaved exactly as written (subprocesses of the cell included).

Lifecycle: the driver starts lazily on the first cell, in the session's workspace, with
the session's environment and the sandbox limits (see :mod:`riverbed.runtime.limits`).
Environment changes made with ``Runtime.set_env`` travel with the next cell and are
applied to ``os.environ`` before it runs.  A cell past its timeout gets ``SIGINT``
(KeyboardInterrupt, names survive); one that ignores it is killed after the grace period.
A driver that dies (``os._exit``, a segfault, the kill above) is replaced on the next cell,
whose observation says ``state_lost``.  Images (png, jpg, gif, svg) that a cell creates or
rewrites in the workspace are listed in ``files``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import struct
import subprocess
import sys
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import structlog

from riverbed import events
from riverbed.runtime.gate import LATE_TRIES, before_start
from riverbed.runtime.limits import DRIVER, kill_processes
from riverbed.runtime.output import CappedText, MarkerScanner, StreamSource, read_some, write_all
from riverbed.runtime.sandbox import DRIVER_INSIDE, start_again_on_a_network_race
from riverbed.runtime.sandboxed import Placement, SandboxedProcess

log = structlog.get_logger("riverbed.runtime.python")

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".gif", ".svg"})
_SCAN_MAX_DEPTH = 32
"""How deep below the workspace a cell's saved images are looked for."""
_SCAN_MAX_FILES = 20_000
_WATCH_EVERY = 1.0


class PythonUnavailable(Exception):
    """The driver could not be started."""


class _Frames:
    """Length-prefixed JSON frames read from a non-blocking fd; survives cancellation."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf = b""

    async def read(self) -> dict[str, Any] | None:
        while True:
            if len(self._buf) >= 4:
                size = struct.unpack(">I", self._buf[:4])[0]
                if len(self._buf) >= 4 + size:
                    body, self._buf = self._buf[4 : 4 + size], self._buf[4 + size :]
                    frame: dict[str, Any] = json.loads(body)
                    return frame
            data = await read_some(self.fd)
            if not data:
                return None
            self._buf += data


class _Cell:
    """What one cell produced so far."""

    def __init__(self, limit: int, marker: bytes, masks: StreamSource | None = None) -> None:
        self.text = CappedText(limit, masks)
        self.scanner = MarkerScanner(marker, b"")
        self.reply: dict[str, Any] | None = None
        self.output_done = False
        self.reply_done = False
        self.eof = False
        """The process closed its output: it is exiting."""
        self.notes: list[str] = []

    @property
    def done(self) -> bool:
        return self.output_done and self.reply_done


class PythonProcess(SandboxedProcess):
    """The session's Python driver; not safe for concurrent use (the caller locks)."""

    def __init__(self, placement: Placement) -> None:
        super().__init__(placement)
        self._driver_pid = -1
        self._fds: list[int] = []
        self._to_driver = -1
        self._frames: _Frames | None = None
        self._out = -1
        self._marker = b""
        """the start of every cell's end-of-output marker; the cell's id and ``__\x1e`` follow"""
        self._cell_id = 0
        self._lost = False
        self._before: set[int] = set()
        self._waiting: anyio.CancelScope | None = None
        """the wait for the cell in flight (a cancel ends it)"""
        self._cancel_note: str | None = None

    async def start(self) -> None:
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        out_r, out_w = os.pipe()
        self._marker = f"\x1e__RB_CELL_{secrets.token_hex(8)}_".encode()
        driver = DRIVER_INSIDE if self._sandbox.confined else str(DRIVER)
        self._link = link = self._sandbox.link()
        try:
            if self._sandbox.confined:
                await anyio.to_thread.run_sync(self._sandbox.prepare_processes, self._workspace)
            tmp = await self._tmp.enter() if self._tmp is not None else None
            inner = self._sandbox.wrap(
                [sys.executable, "-u", driver, str(to_r), str(from_w), self._marker.decode()],
                workspace=self._workspace,
                readonly=[(str(DRIVER), DRIVER_INSIDE)],
                link=link,
                nproc=self._limits.max_processes,
                tmp=tmp,
            )
        except BaseException:
            for fd in (to_r, to_w, from_r, from_w, out_r, out_w):
                os.close(fd)
            await self._drop_link()
            raise
        env = {"MPLBACKEND": "Agg", **self._env}
        try:
            self._proc = await self._spawn(
                inner,
                stdin=subprocess.DEVNULL,
                stdout=out_w,
                stderr=out_w,
                pass_fds=(to_r, from_w, *(link.child_fds if link is not None else ())),
                cwd=self._workspace,
                env=env,
            )
            if link is not None:
                await anyio.to_thread.run_sync(link.attach)
        except BaseException:
            for fd in (to_w, from_r, out_r):
                os.close(fd)
            await self.close()
            raise
        finally:
            for fd in (to_r, from_w, out_w):
                os.close(fd)
        for fd in (to_w, from_r, out_r):
            os.set_blocking(fd, False)
        self._fds = [to_w, from_r, out_r]
        self._to_driver, self._out = to_w, out_r
        self._frames = _Frames(from_r)
        ready = None
        with anyio.move_on_after(self._limits.start_timeout):
            ready = await self._frames.read()
        if not ready or not ready.get("ready"):
            said = _pending_text(out_r)  # what the sandbox or the interpreter said before it gave up
            await self.close()
            raise PythonUnavailable("the Python driver did not start in time" + (f": {said}" if said else ""))
        self._core = frozenset(pid for pid, _ in await anyio.to_thread.run_sync(self._processes, self._proc.pid))
        self._driver_pid = _driver_pid(self._proc.pid, self._core)
        log.debug("python started", pid=self._proc.pid, workspace=str(self._workspace))

    async def close(self) -> None:
        await self._kill()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        self._frames = None

    async def run(self, action: events.PythonRun, env: Mapping[str, str | None]) -> events.PythonOutput:
        timeout = action.timeout if action.timeout is not None else self._limits.python_timeout
        state_lost = self._lost
        if self._proc is not None and not self.alive:
            state_lost = True
            await self.close()
        if self._proc is None:
            await start_again_on_a_network_race(self.start, "python")
        self._lost = False
        assert self._proc is not None
        images_before = await anyio.to_thread.run_sync(_images, self._workspace)
        self._before = {pid for pid, _ in await anyio.to_thread.run_sync(self._processes, self._proc.pid)}
        for _ in range(LATE_TRIES):
            self._cell_id += 1
            cell = _Cell(self._limits.max_output_chars, self._marker + f"{self._cell_id}__\x1e".encode(), self.masks)
            request = {"cell": self._cell_id, "code": action.code, "env": dict(env)}
            start_by = await before_start()  # nothing awaited from here to the write that starts the cell
            body = json.dumps({**request, "start_by": start_by}).encode()
            await write_all(self._to_driver, struct.pack(">I", len(body)) + body)
            timed_out = False
            self._cancel_note = None
            if not await self._wait(cell, timeout, cancellable=True):
                cancelled, self._cancel_note = self._cancel_note, None
                timed_out = cancelled is None
                await self._interrupt(cell, timeout, why=cancelled)
            if not (cell.reply_done and cell.reply is not None and cell.reply.get("late")):
                break
            log.info("python.late_start", session_workspace=str(self._workspace))
        else:
            raise PythonUnavailable(f"the Python process did not get the cell in time, {LATE_TRIES} times; not run")
        exception = cell.reply.get("exception") if cell.reply else None
        if not cell.reply_done or cell.reply is None:
            exception = (exception or "") + await self._death_note(exiting=cell.eof)
        images_after = await anyio.to_thread.run_sync(_images, self._workspace)
        files = sorted(path for path, stamp in images_after.items() if images_before.get(path) != stamp)
        content = cell.text.render()
        if (news := self._bounds_news()) is not None:
            cell.notes.append(news)
        if cell.notes:
            content = (content + "\n" if content and not content.endswith("\n") else content) + "\n".join(cell.notes)
        result = cell.reply.get("result") if cell.reply else None
        limit = self._limits.max_output_chars
        truncated = cell.text.truncated
        if result is not None and len(result) > limit:
            result = _cut(result, limit)
            truncated = True
        if exception is not None and len(exception) > limit:
            exception = _cut(exception, limit)
            truncated = True
        return events.PythonOutput(
            content=content,
            result=result,
            exception=exception,
            timed_out=timed_out,
            truncated=truncated,
            state_lost=state_lost,
            files=files,
            cause=action.id,
        )

    async def _death_note(self, *, exiting: bool) -> str:
        self._lost = True
        code = self._proc.poll() if self._proc is not None else None
        if self._proc is not None and exiting:
            # Its pipes close a moment before its exit status can be collected: wait a little.
            with anyio.move_on_after(1.0):
                while (code := self._proc.poll()) is None:  # noqa: ASYNC110  (a child's status, no event to await)
                    await anyio.sleep(0.01)
        if code is None:
            how = "stopped answering"
        elif code < 0:
            how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        return f"the Python process {how} during this cell; the next cell starts a new one and earlier names are lost"

    def cancel(self, note: str) -> bool:
        """Interrupt the cell an action waits for, as a timeout would; its observation says
        ``note``.  False when no cell runs."""
        if self._waiting is None:
            return False
        self._cancel_note = note
        self._waiting.cancel()
        return True

    async def _wait(self, cell: _Cell, seconds: float, *, cancellable: bool = False) -> bool:
        """Read output and the reply until both are done (True) or ``seconds`` pass (False);
        ``cancellable``: :meth:`cancel` ends the wait too (False)."""
        with anyio.move_on_after(seconds) as scope:
            if cancellable:
                self._waiting = scope
            async with anyio.create_task_group() as tg:

                async def pump() -> None:
                    while not cell.output_done:
                        data = await read_some(self._out)
                        if not data:
                            cell.text.feed_bytes(cell.scanner.flush(), final=True)
                            cell.output_done = cell.eof = True
                            break
                        cell.text.feed_bytes(cell.scanner.feed(data))
                        if cell.scanner.found:
                            cell.text.feed_bytes(b"", final=True)
                            cell.output_done = True
                    if cell.reply_done:
                        tg.cancel_scope.cancel()

                async def reply() -> None:
                    while not cell.reply_done:
                        assert self._frames is not None
                        frame = await self._frames.read()
                        # a late reply of an earlier cell is never taken for this cell's
                        if frame is None or frame.get("cell") == self._cell_id:
                            cell.reply = frame
                            cell.reply_done = True
                    if cell.output_done:
                        tg.cancel_scope.cancel()

                async def watch() -> None:
                    while True:
                        await anyio.sleep(_WATCH_EVERY)
                        if note := await self._check_processes():
                            cell.notes.append(note)

                tg.start_soon(pump)
                tg.start_soon(reply)
                tg.start_soon(watch)
        if cancellable:
            self._waiting = None
        return cell.done

    async def _interrupt(self, cell: _Cell, timeout: float, *, why: str | None = None) -> None:
        assert self._proc is not None
        sid = self._proc.pid
        cell.notes.append(why or f"[the cell timed out after {timeout:g} seconds and was interrupted]")
        with contextlib.suppress(OSError):
            if self._driver_pid == sid:
                os.killpg(sid, signal.SIGINT)  # the driver leads the session: its whole group
            else:
                os.kill(self._driver_pid, signal.SIGINT)  # not bubblewrap's processes: only the driver
        stopped = await self._wait(cell, self._limits.interrupt_grace)
        await anyio.to_thread.run_sync(
            partial(kill_processes, sid, keep=frozenset({sid}), only_new_since=self._before, lister=self._processes)
        )
        if not stopped:
            cell.notes.append("[the cell did not stop on KeyboardInterrupt; the Python process was killed]")
            await anyio.to_thread.run_sync(partial(kill_processes, sid, lister=self._processes))
            await self._wait(cell, self._limits.interrupt_grace)

    async def enforce_limits(self) -> None:
        """The process-count check, for a periodic watcher (between cells too)."""
        if self.alive:
            await self._check_processes()


def _pending_text(fd: int, limit: int = 2000) -> str:
    """The last line already written to a non-blocking pipe (without waiting), for an error."""
    try:
        data = os.read(fd, limit)
    except OSError:
        return ""
    lines = data.decode(errors="replace").strip().splitlines()
    return lines[-1][:300] if lines else ""


def _driver_pid(sid: int, core: frozenset[int]) -> int:
    """The driver's pid among a new sandbox's processes (bubblewrap's own come first)."""
    for pid in sorted(core):
        try:
            with open(f"/proc/{pid}/comm", encoding="utf-8") as fh:
                if fh.read().strip() != "bwrap":
                    return pid
        except OSError:
            continue
    return sid


def _cut(text: str, limit: int) -> str:
    capped = CappedText(limit)
    capped.feed(text)
    return capped.render()


def _images(workspace: Path) -> dict[str, int]:
    """Image files below ``workspace`` (relative path -> mtime_ns and size), skipping dot-dirs
    and anything deeper than :data:`_SCAN_MAX_DEPTH` (``os.walk`` recurses: a deeper tree
    would raise ``RecursionError``)."""
    found: dict[str, int] = {}
    seen = 0
    base = str(workspace).rstrip(os.sep).count(os.sep)
    for top, dirs, files in os.walk(workspace):
        if top.count(os.sep) - base >= _SCAN_MAX_DEPTH:
            dirs[:] = []
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in {"node_modules", "__pycache__"}]
        for name in files:
            seen += 1
            if seen > _SCAN_MAX_FILES:
                return found
            if os.path.splitext(name)[1].lower() in IMAGE_SUFFIXES:
                path = os.path.join(top, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                found[os.path.relpath(path, workspace)] = st.st_mtime_ns ^ (st.st_size << 1)
    return found

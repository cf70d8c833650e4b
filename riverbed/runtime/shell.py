"""The persistent bash of a session.

One interactive ``bash --norc --noprofile --noediting -i`` per session, on a pty that is
its controlling terminal (so Ctrl-C reaches the foreground job exactly as in a terminal,
and job control gives each job its own process group).  Echo and CR-LF translation are
turned off on the pty.  ``PROMPT_COMMAND`` prints a marker with a per-shell nonce and
``$?`` before every prompt, which is how the end of a command and its exit code are
seen; the prompts themselves are empty.

A command is written to a private file outside the workspace and run with ``source``, so
multi-line scripts, heredocs and unbalanced quotes end in exactly one marker, while
``cd``, ``export``, functions and aliases persist in the shell.  Input sent with
``is_input`` goes to the pty, where the running command reads it.

Timeouts: a *hard* timeout interrupts the command (Ctrl-C, then ``SIGKILL`` of its process
group) and kills every process the command started in the sandbox session; the shell,
its cwd and its variables survive.  A non-blocking command that prints nothing new for
the *soft* timeout returns what it has printed so far and keeps running; the next
``cmd_run`` may be input for it, ``C-c``, or an empty command to wait for more output.
If the shell itself dies or stops answering, it is replaced by a fresh one and the
observation says so.  Output that arrives while no command runs (job notices, late
output of background jobs) is discarded before the next command starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shlex
import shutil
import signal
import struct
import tempfile
import termios
from collections.abc import Mapping
from functools import partial
from pathlib import Path

import anyio
import structlog

from riverbed import events
from riverbed.runtime.gate import LATE_TRIES, before_start, boottime_centiseconds
from riverbed.runtime.limits import kill_processes, signal_group
from riverbed.runtime.output import CappedText, MarkerScanner, read_some, write_all
from riverbed.runtime.sandbox import start_again_on_a_network_race
from riverbed.runtime.sandboxed import Placement, SandboxedProcess

log = structlog.get_logger("riverbed.runtime.shell")

_KEYS = {"C-c": b"\x03", "C-d": b"\x04", "C-z": b"\x1a", "C-\\": b"\x1c"}
_WATCH_EVERY = 1.0


class ShellUnavailable(Exception):
    """The shell could not be started or does not answer."""


class Shell(SandboxedProcess):
    """A persistent bash in ``workspace``; not safe for concurrent use (the caller locks)."""

    def __init__(self, placement: Placement) -> None:
        super().__init__(placement)
        self._nonce = secrets.token_hex(8)
        self._late = f"__RB_{self._nonce}_late__"
        """what the shell prints instead of starting a command past its deadline"""
        self._scanner = MarkerScanner(f"\n__RB_{self._nonce}_".encode(), b"__\n")
        self._master = -1
        self._ctl_dir: str | None = None
        self._shell_pgrp = -1
        self._applied: dict[str, str | None] = {}
        self._running = False
        self._before: set[int] = set()
        self._command = ""
        self._collecting: anyio.CancelScope | None = None
        """the wait for output of the command in flight (a cancel ends it)"""
        self._cancel_note: str | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._ctl_dir = await anyio.to_thread.run_sync(self._make_ctl_dir)
        master, slave = os.openpty()
        try:
            attrs = termios.tcgetattr(slave)
            attrs[1] &= ~termios.ONLCR
            attrs[3] &= ~(termios.ECHO | termios.ECHONL)
            termios.tcsetattr(slave, termios.TCSANOW, attrs)
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
            env = dict(self._env)
            env.update(
                PS1="",
                PS2="",
                PROMPT_COMMAND=f"printf '\\n__RB_{self._nonce}_%s__\\n' \"$?\"",
                HISTFILE="",
            )
            bash = ["bash", "--norc", "--noprofile", "--noediting", "-i"]
            self._link = link = self._sandbox.link()
            readonly = [(self._ctl_dir, self._ctl_dir)]
            tmp = await self._tmp.enter() if self._tmp is not None else None
            inner = self._sandbox.wrap(
                bash,
                workspace=self._workspace,
                readonly=readonly,
                link=link,
                nproc=self._limits.max_processes,
                tmp=tmp,
            )
            self._proc = await self._spawn(
                inner,
                ctty=True,
                stdin=slave,
                stdout=slave,
                stderr=slave,
                cwd=self._workspace,
                env=env,
                pass_fds=link.child_fds if link is not None else (),
            )
            if link is not None:
                await anyio.to_thread.run_sync(link.attach)
        except BaseException:
            os.close(master)
            await self._release()
            raise
        finally:
            os.close(slave)
        os.set_blocking(master, False)
        self._master = master
        self._applied = {}
        self._running = False
        self._scanner.reset()
        said = CappedText(300)  # what the sandbox or bash said before it gave up
        ok = await self._hidden("export -n PS1 PS2 PROMPT_COMMAND HISTFILE; set +o history", first=True, said=said)
        if not ok:
            await self.close()
            last = said.render().strip().splitlines()
            raise ShellUnavailable("bash did not start in time" + (f": {last[-1]}" if last else ""))
        with contextlib.suppress(OSError):
            self._shell_pgrp = os.tcgetpgrp(master)
        self._core = frozenset(pid for pid, _ in await anyio.to_thread.run_sync(self._processes, self._sid()))
        log.debug("shell started", pid=self.pid, workspace=str(self._workspace))

    async def close(self) -> None:
        """Kill the shell and everything in its sandbox session (bounded)."""
        await self._release()
        if self._master >= 0:
            os.close(self._master)
            self._master = -1
        self._running = False

    async def _release(self) -> None:
        """Kill the shell and its sandbox; drop its network link and its command scripts."""
        await self._kill()
        self._remove_ctl_dir()

    def _make_ctl_dir(self) -> str:
        """A directory for the command scripts, outside the workspace; readable (not writable)
        from inside the sandbox, where it is mounted read-only at the same path."""
        if not self._sandbox.confined:
            return tempfile.mkdtemp(prefix="riverbed-sh-")
        self._sandbox.prepare_processes(self._workspace)
        path = tempfile.mkdtemp(prefix="sh-", dir=self._sandbox.state_dir(self._workspace))
        os.chmod(path, 0o755)  # noqa: S103  (the sandbox user reads its command scripts; nobody else sees them)
        return path

    def _remove_ctl_dir(self) -> None:
        if self._ctl_dir is not None:
            shutil.rmtree(self._ctl_dir, ignore_errors=True)
            self._ctl_dir = None

    # --- commands ------------------------------------------------------------------------------

    async def run(self, action: events.CmdRun, env: Mapping[str, str | None], cwd: Path | None) -> events.Observation:
        """Run (or feed, or wait for) a command; returns a CmdOutput or an Error."""
        timeout = action.timeout if action.timeout is not None else self._limits.cmd_timeout
        notes: list[str] = []
        if not self.alive:
            if self._proc is not None:
                notes.append("[the previous shell had exited; this is a new shell: cwd and variables were reset]")
                await self.close()
            await start_again_on_a_network_race(self.start, "shell")
        if action.is_input:
            if not self._running:
                return _error("no_running_command", "no command is running, so there is nothing to send input to")
            key = _KEYS.get(action.command)
            if key == b"\x03":
                return await self._interrupt_and_report(action.command)
            await write_all(self._master, key if key is not None else action.command.encode() + b"\n")
            return await self._collect(action, timeout, notes)
        if self._running:
            if action.command == "":
                return await self._collect(action, timeout, notes)
            return _error(
                "command_running",
                f"the previous command ({self._command!r}) is still running: send input with is_input=true, "
                "'C-c' with is_input=true to interrupt it, or an empty command to wait for more output",
                retryable=True,
            )
        if action.command.strip() == "":
            return _error("no_running_command", "the command is empty and no command is running")
        if not await self._apply_env(env):
            return _error("shell_unavailable", "the shell did not accept the session environment", retryable=True)
        self._drain()
        assert self._ctl_dir is not None
        script = Path(self._ctl_dir) / "command.sh"
        script.write_text(action.command + "\n", encoding="utf-8")
        script.chmod(0o644)
        line = f"builtin source {shlex.quote(str(script))}"
        if cwd is not None:
            line = f"builtin cd -- {shlex.quote(str(cwd))} && {line}"
        self._before = {pid for pid, _ in await anyio.to_thread.run_sync(self._processes, self._sid())}
        for _ in range(LATE_TRIES):
            start_by = await before_start()  # nothing awaited from here to the write that starts the command
            self._command = action.command
            self._running = True
            self._cancel_note = None
            self._scanner.reset()
            await write_all(self._master, self._by(start_by, line).encode() + b"\n")
            observation = await self._collect(action, timeout, list(notes))
            # (a line of its own, wherever: a shell tracing its commands, ``set -x``, prints them first)
            refused = isinstance(observation, events.CmdOutput) and self._late in observation.content.splitlines()
            if start_by is None or not refused:
                return observation
            log.info("shell.late_start", command=action.command[:80])
        return _error(
            "sandbox_unavailable",
            f"the shell did not get the command in time, {LATE_TRIES} times; the command did not run",
            retryable=True,
        )

    def _by(self, start_by: float | None, line: str) -> str:
        """``line``, started by the shell only before ``start_by`` (its own clock read, no fork);
        after it, the shell prints :attr:`_late` instead (see ``riverbed.runtime.gate``)."""
        if start_by is None:
            return line
        up = f"__rb_up_{self._nonce}"
        return (
            f"if builtin read -r {up} _ </proc/uptime && (( 10#${{{up}/./}} < {boottime_centiseconds(start_by)} )); "
            f"then builtin unset {up}; {line}; "
            f"else builtin unset {up}; builtin printf '%s\\n' {self._late}; fi"
        )

    def _sid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    async def _collect(self, action: events.CmdRun, timeout: float, notes: list[str]) -> events.Observation:
        text = CappedText(self._limits.max_output_chars, self.masks)
        loop_start = anyio.current_time()
        deadline = loop_start + timeout
        last_output = loop_start
        next_watch = loop_start + _WATCH_EVERY
        while True:
            now = anyio.current_time()
            wait = min(deadline, next_watch) - now
            if not action.blocking:
                wait = min(wait, last_output + self._limits.soft_timeout - now)
            data: bytes | None = None
            with anyio.move_on_after(max(wait, 0)) as self._collecting:
                data = await read_some(self._master)
            self._collecting = None
            now = anyio.current_time()
            if data == b"":
                self._running = False
                text.feed_bytes(self._scanner.flush(), final=True)
                notes.append("[the shell exited; the next command starts a new shell with a fresh state]")
                proc = self._proc
                await self.close()
                return self._output(action, text, proc.returncode if proc is not None else None, notes)
            if data:
                last_output = now
                text.feed_bytes(self._scanner.feed(data))
                if self._scanner.found:
                    self._running = False
                    text.feed_bytes(b"", final=True)
                    return self._output(action, text, _exit_code(self._scanner.payload), notes)
            if self._cancel_note is not None:
                cancelled, self._cancel_note = self._cancel_note, None
                code = await self._interrupt(text, notes)
                notes.append(cancelled)
                return self._output(action, text, code, notes)
            if now >= next_watch:
                next_watch = now + _WATCH_EVERY
                note = await self._check_processes()
                if note:
                    notes.append(note)
            if now >= deadline:
                code = await self._interrupt(text, notes)
                notes.append(f"[the command timed out after {timeout:g} seconds and was interrupted]")
                return self._output(action, text, code, notes, timed_out=True)
            if not action.blocking and now - last_output >= self._limits.soft_timeout:
                text.feed_bytes(self._scanner.flush())
                notes.append(
                    f"[no new output for {self._limits.soft_timeout:g} seconds; the command is still running: "
                    "send an empty command to wait for more, input with is_input=true, or 'C-c' to interrupt]"
                )
                return self._output(action, text, None, notes, timed_out=True)

    def _output(
        self,
        action: events.CmdRun,
        text: CappedText,
        code: int | None,
        notes: list[str],
        *,
        timed_out: bool = False,
    ) -> events.CmdOutput:
        content = text.render()
        if (news := self._bounds_news()) is not None:
            notes = [*notes, news]
        if notes:
            content = (content + "\n" if content and not content.endswith("\n") else content) + "\n".join(notes)
        return events.CmdOutput(
            content=content,
            exit_code=code,
            command=action.command,
            timed_out=timed_out,
            truncated=text.truncated,
            cause=action.id,
        )

    def cancel(self, note: str) -> bool:
        """Interrupt the command an action waits for, as a hard timeout would; its observation
        ends with ``note``.  False when no action waits for a command."""
        if self._collecting is None or not self._running:
            return False
        self._cancel_note = note
        self._collecting.cancel()
        return True

    async def stop_background(self, note: str) -> str | None:
        """Interrupt a command still running after its action was answered (the soft timeout):
        what it printed since, with ``note``; None when no command runs."""
        if not self._running or self._collecting is not None or not self.alive:
            return None
        text = CappedText(self._limits.max_output_chars, self.masks)
        notes: list[str] = []
        await self._interrupt(text, notes)
        return "\n".join([text.render().rstrip("\n"), *notes, note]).lstrip("\n")

    async def _interrupt_and_report(self, command: str) -> events.CmdOutput:
        text = CappedText(self._limits.max_output_chars, self.masks)
        notes: list[str] = []
        code = await self._interrupt(text, notes)
        action = events.CmdRun(command=command, is_input=True)
        return self._output(action, text, code, notes)

    async def _interrupt(self, text: CappedText, notes: list[str]) -> int | None:
        """Ctrl-C, then kill; leaves nothing the command started; restarts a stuck shell."""
        sid = self._sid()
        await write_all(self._master, b"\x03")
        found = await self._wait_marker(text, self._limits.interrupt_grace / 2)
        if not found:
            # A Ctrl-C that came while the command was still being started reached the shell, not
            # the command: the command, in the foreground now, is interrupted itself.
            with contextlib.suppress(OSError):
                fg = os.tcgetpgrp(self._master)
                if fg != self._shell_pgrp:
                    signal_group(fg, signal.SIGINT)
            found = await self._wait_marker(text, self._limits.interrupt_grace / 2)
        with contextlib.suppress(OSError):
            fg = os.tcgetpgrp(self._master)
            if not found and fg != self._shell_pgrp:
                signal_group(fg, signal.SIGKILL)
        killed = await anyio.to_thread.run_sync(
            partial(kill_processes, sid, keep=frozenset({sid}), only_new_since=self._before, lister=self._processes)
        )
        if killed:
            notes.append(f"[killed {killed} process(es) the command had started]")
        if not found:
            found = await self._wait_marker(text, self._limits.interrupt_grace)
        self._running = False
        if not found:
            notes.append(
                "[the shell did not recover from the interrupt; it was replaced: cwd and variables were reset]"
            )
            await self.close()
            return None
        return _exit_code(self._scanner.payload)

    async def _wait_marker(self, text: CappedText, seconds: float) -> bool:
        with anyio.move_on_after(seconds):
            while not self._scanner.found:
                data = await read_some(self._master)
                if not data:
                    return False
                text.feed_bytes(self._scanner.feed(data))
        return self._scanner.found

    async def enforce_limits(self) -> None:
        """The process-count check, for a periodic watcher (between commands too)."""
        if self.alive:
            await self._check_processes()

    # --- hidden helpers -----------------------------------------------------------------------

    async def _hidden(self, line: str, *, first: bool = False, said: CappedText | None = None) -> bool:
        """Run a line whose output nobody sees (but ``said``); True when the shell answered."""
        sink = said if said is not None else CappedText(1000)
        if first and not await self._wait_marker(sink, self._limits.start_timeout):
            return False
        self._scanner.reset()
        await write_all(self._master, line.encode() + b"\n")
        ok = await self._wait_marker(sink, self._limits.start_timeout)
        self._scanner.reset()
        return ok

    def _drain(self) -> None:
        """Discard what arrived while idle (job notices, late output of background jobs)."""
        while True:
            try:
                if not os.read(self._master, 65536):
                    return
            except OSError:
                return

    async def _apply_env(self, env: Mapping[str, str | None]) -> bool:
        parts: list[str] = []
        for name in sorted(set(env) | set(self._applied)):
            value = env.get(name)
            if name in self._applied and self._applied[name] == value:
                continue
            parts.append(f"unset {name}" if value is None else f"export {name}={shlex.quote(value)}")
        if not parts:
            return True
        ok = await self._hidden("; ".join(parts))
        if ok:
            self._applied = dict(env)
        return ok


def _exit_code(payload: str) -> int | None:
    try:
        return int(payload)
    except ValueError:
        return None


def _error(reason: str, content: str, *, retryable: bool = False) -> events.Error:
    return events.Error(content=content, reason=reason, retryable=retryable)

"""The Runtime: executes actions for many sessions, each in its own sandbox.

::

    rt = Runtime(workspace_root=Path("/srv/ws"), limits=Limits(cmd_timeout=60))
    obs = await rt.execute("s-42", CmdRun(id=7, command="ls"))   # never raises
    rt.set_env("s-42", {"FOO": "1", "BAR": None})                  # None unsets
    await rt.close_session("s-42")
    await rt.aclose()

A session's sandbox is its workspace directory (see :mod:`riverbed.runtime.paths`), a
persistent bash (:mod:`~riverbed.runtime.shell`) and a persistent Python process
(:mod:`~riverbed.runtime.python`) sharing one ``/tmp`` (:mod:`~riverbed.runtime.tmp`), both
started lazily and bounded as described in :mod:`~riverbed.runtime.limits`, and, given
``cgroups``, together in one cgroup of the session's (:mod:`~riverbed.runtime.cgroups`).  The runtime
role's owner binds a session to its log when it opens it (:meth:`Runtime.open_session`: the
workspace of that log, the sandbox user kept for the session).  Actions of one session run one at a time, in arrival
order; sessions run concurrently.

:meth:`Runtime.execute` turns every failure into an ``error`` observation whose
``reason`` names it and whose ``retryable`` says whether the same action may succeed
later (a busy or unavailable sandbox) or never will (a bad path, an unknown kind).

Custom action kinds: register the class with :func:`riverbed.events.register`, then its
handler with :func:`handler` (for every Runtime) or :meth:`Runtime.handler` (for one)::

    @runtime.handler(Deploy)
    async def deploy(ctx: HandlerContext, action: Deploy) -> events.Observation:
        ...

A handler gets a :class:`HandlerContext` (session id, workspace, environment, limits and
a path resolver confined to the workspace).  Its exceptions become ``error``
observations; ``cause`` is set to the action's id for it.

The sandbox environment starts from a small fixed base (``PATH`` = :data:`SANDBOX_PATH`,
``HOME`` = the workspace, ``LANG``, ``TERM=dumb``, ``PAGER=cat``), not from the worker's
environment, so the worker's secrets and paths do not leak into sandboxes; ``set_env`` adds to it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus
from msgspec.structs import replace

from riverbed import events, tracing
from riverbed.errors import RiverbedError
from riverbed.runtime import files
from riverbed.runtime.cgroups import Cgroups, SessionCgroup
from riverbed.runtime.gate import LATE_TRIES, LateStart, before_start, starting_by
from riverbed.runtime.limits import Limits
from riverbed.runtime.mcp import McpServers
from riverbed.runtime.output import StreamSource
from riverbed.runtime.paths import PathRefused, confine, stamp_file, stamp_of, workspace_name
from riverbed.runtime.python import PythonProcess, PythonUnavailable
from riverbed.runtime.sandbox import Sandbox, SandboxUnavailable
from riverbed.runtime.sandboxed import Placement
from riverbed.runtime.shell import Shell, ShellUnavailable
from riverbed.runtime.tmp import SessionTmp

log = structlog.get_logger("riverbed.runtime")

#: Sandboxes of given-back sessions stopped at once (:meth:`Runtime.release_session`).  Each
#: stop holds a worker thread of anyio's pool for its kills, waits and cgroup removal, which a
#: new session's first command needs too: hundreds of sessions parked together, stopped all at
#: once, took every thread and kept new sandboxes from starting for seconds.
STOPS_AT_ONCE = 8

A = TypeVar("A", bound=events.Action)
Handler = Callable[["HandlerContext", Any], Awaitable[events.Observation]]

_handlers: dict[type[events.Action], Handler] = {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class HandlerContext:
    """What a handler may use: its session's id, workspace, environment and limits."""

    session_id: str
    workspace: Path
    env: Mapping[str, str]
    limits: Limits

    def resolve(self, path: str) -> Path:
        """The real path ``path`` names inside the workspace; a path outside it raises
        :class:`~riverbed.runtime.paths.PathRefused` (which becomes an ``error``)."""
        return confine(self.workspace, path)


def handler(kind: type[A]) -> Callable[[Callable[[HandlerContext, A], Awaitable[events.Observation]]], Any]:
    """Register the handler of a custom action kind for every :class:`Runtime`."""
    _check_kind(kind)

    def deco(fn: Callable[[HandlerContext, A], Awaitable[events.Observation]]) -> Any:
        _handlers[kind] = fn
        return fn

    return deco


def _check_kind(kind: type[events.Action]) -> None:
    if not (isinstance(kind, type) and issubclass(kind, events.Action)):
        raise TypeError("a runtime handler is registered for an events.Action subclass")
    if kind.answered_by != "runtime":
        raise ValueError(f"{kind.__name__}.answered_by is {kind.answered_by!r}; the runtime only answers 'runtime'")
    if events.kinds().get(events.kind_of(kind)) is not kind:
        raise ValueError(f"register {kind.__name__} with riverbed.events.register first")


#: Every sandbox's ``PATH``: the system's directories, never the worker's own ``PATH`` (which may
#: name the worker's virtual environment, tool caches or home; ``set_env`` may change it).
#: Its last directory holds what the sandbox adds to the system (``python``, see ``runtime/sandbox.py``).
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/opt/riverbed/bin"

#: A ``file_read`` of a regular file up to this size runs on the event loop, not in a thread.
INLINE_READ_BYTES = 64 * 1024


async def _in_time(change: Callable[[], events.Observation]) -> events.Observation:
    """A file change, made in a worker thread only by the start gate's deadline (the thread may
    get to it late: a paused worker, a busy machine); gated again when it was late."""
    for _ in range(LATE_TRIES):
        with starting_by(await before_start()):
            try:
                return await anyio.to_thread.run_sync(change)
            except LateStart:
                log.info("file.late_start")
    raise SandboxUnavailable(f"the file change was not made in time, {LATE_TRIES} times; the file is as it was")


def _handled(session_id: str, action: events.Event, obs: events.Observation, seconds: float) -> None:
    """The worker's one line for a handled action."""
    log.info(
        "action handled",
        session=session_id,
        event_id=action.id,
        kind=action.kind,
        result=obs.kind,
        reason=obs.reason if isinstance(obs, events.Error) else None,
        seconds=round(seconds, 3),
        trace_id=tracing.trace_id(action.trace),
    )


def _error(reason: str, content: str, *, retryable: bool = False) -> events.Error:
    return events.Error(content=content, reason=reason, retryable=retryable)


class _Session:
    def __init__(
        self,
        session_id: str,
        workspace: Path,
        base_env: Mapping[str, str],
        limits: Limits,
        sandbox: Sandbox,
        cgroup: SessionCgroup | None,
        mcp_mounts: Sequence[str] = (),
    ) -> None:
        self.id = session_id
        self.workspace = workspace
        self.lock = anyio.Lock()
        self.overrides: dict[str, str | None] = {}
        self.tmp = SessionTmp(sandbox, workspace)
        self.cgroup = cgroup
        placement = Placement(workspace, base_env, limits, sandbox, self.tmp, cgroup)
        self.shell = Shell(placement)
        self.python = PythonProcess(placement)
        self.mcp = McpServers(placement, mcp_mounts)
        self.history = files.EditHistory(limits.edit_history)
        self.workspace_made = False
        self.created: str | None = None
        """the creation stamp of the log this session was opened for (None: opened by no owner)"""

    def started_processes(self) -> bool:
        """Whether the session's shell, Python process or an MCP server of it was started (and
        not dropped since): the watchdog's checks ask each whether it still runs."""
        return self.shell.started or self.python.started or self.mcp.started

    async def close(self) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(10):
            await self.shell.close()
            await self.python.close()
            await self.mcp.close()
            await self.tmp.close()
            if self.cgroup is not None and self.cgroup.made:  # what the sandboxes left (a setsid double fork): killed
                await anyio.to_thread.run_sync(self.cgroup.close)


class Runtime:
    """Executes runtime actions for many sessions; see the module docstring."""

    def __init__(
        self,
        workspace_root: Path | str,
        limits: Limits | None = None,
        *,
        base_env: Mapping[str, str] | None = None,
        sandbox: Sandbox | None = None,
        mcp_mounts: Sequence[str] = (),
        cgroups: Cgroups | None = None,
    ) -> None:
        """``mcp_mounts``: directories mounted read-only for stdio MCP servers and searched for
        their commands (``RIVERBED_MCP_MOUNTS``; see :mod:`riverbed.runtime.mcp`)."""
        self._root = Path(workspace_root)
        self._mcp_mounts = tuple(mcp_mounts)
        self._limits = limits or Limits()
        self._sandbox = sandbox or Sandbox()
        self._cgroups = cgroups
        self._sessions: dict[str, _Session] = {}
        self._leaving: dict[str, _Session] = {}
        """Sessions given back whose sandboxes are still to stop (:meth:`release_session`)."""
        self._stopping: dict[str, anyio.Event] = {}
        """Sessions whose sandboxes stop now: set when they have."""
        self._stops: TaskGroup | None = None
        """Where the stops of given-back sessions run (:meth:`watch`'s; None: it does not run)."""
        self._stop_slots = anyio.CapacityLimiter(STOPS_AT_ONCE)
        self._handlers: dict[type[events.Action], Handler] = {}
        self._closed = False
        self._base_env = dict(base_env) if base_env is not None else None
        self._builtin: dict[type[events.Action], Callable[[_Session, Any], Awaitable[events.Observation]]] = {
            events.CmdRun: self._cmd_run,
            events.PythonRun: self._python_run,
            events.FileRead: self._file_read,
            events.FileWrite: self._file_write,
            events.FileEdit: self._file_edit,
            events.McpList: self._mcp_list,
            events.ToolCall: self._tool_call,
        }

    @property
    def limits(self) -> Limits:
        return self._limits

    @property
    def sandbox(self) -> Sandbox:
        return self._sandbox

    # --- registration ----------------------------------------------------------------------

    def handler(self, kind: type[A]) -> Callable[[Callable[[HandlerContext, A], Awaitable[events.Observation]]], Any]:
        """Register the handler of a custom action kind for this Runtime only."""
        _check_kind(kind)

        def deco(fn: Callable[[HandlerContext, A], Awaitable[events.Observation]]) -> Any:
            self._handlers[kind] = fn
            return fn

        return deco

    def handles(self, kind: type[events.Event]) -> bool:
        """Whether :meth:`execute` has a handler for ``kind``."""
        return kind in self._handlers or kind in _handlers or kind in self._builtin

    # --- sessions ---------------------------------------------------------------------------

    def workspace(self, session_id: str) -> Path:
        """The workspace directory of a session (pure: nothing is created)."""
        return self._root / workspace_name(session_id)

    def workspace_owner(self, session_id: str) -> tuple[int, int] | None:
        """The uid/gid that owns a session's files (None: the worker's own user)."""
        return self._sandbox.owner(self.workspace(session_id))

    def sessions(self) -> list[str]:
        return list(self._sessions)

    def set_env(self, session_id: str, env: Mapping[str, str | None]) -> None:
        """Set (``None``: unset) sandbox variables; the next command and cell see them.

        Raises :class:`~riverbed.errors.InputError` for a name that is not a shell
        identifier or is one the shell depends on (``events.RESERVED_ENV``: ``PS1``,
        ``PROMPT_COMMAND``, ``IFS``…), or a value containing a NUL byte.
        """
        events.check_env(env)
        self._session(session_id).overrides.update(env)

    def set_masks(self, session_id: str, masks: StreamSource | None) -> None:
        """Mask a session's command and cell outputs as they are read (the tenant's secrets'
        values: ``agent/masking.py``); None: no masking."""
        session = self._session(session_id)
        session.shell.masks = session.python.masks = masks

    def env(self, session_id: str) -> dict[str, str]:
        """The environment a session's sandbox sees now."""
        return self._effective_env(self._session(session_id))

    def _base(self, workspace: Path) -> dict[str, str]:
        if self._base_env is not None:
            return {"HOME": str(workspace), **self._base_env}
        return {
            "PATH": SANDBOX_PATH,
            "HOME": str(workspace),
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "PAGER": "cat",
            "GIT_PAGER": "cat",
        }

    def _effective_env(self, session: _Session) -> dict[str, str]:
        env = self._base(session.workspace)
        for name, value in session.overrides.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        return env

    def _session(self, session_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is None and self._leaving:
            session = self._leaving.pop(session_id, None)  # taken again before its stop: it keeps its sandbox
            if session is not None:
                self._sessions[session_id] = session
        if session is None:
            ws = self.workspace(session_id)
            cgroup = self._cgroups.session() if self._cgroups is not None else None
            session = _Session(session_id, ws, self._base(ws), self._limits, self._sandbox, cgroup, self._mcp_mounts)
            self._sessions[session_id] = session
        return session

    async def open_session(
        self, session_id: str, *, created: str, user: Callable[[], Awaitable[int]] | None = None
    ) -> None:
        """Bind a session to its log, as its owner opens it: ``created`` is the log's creation
        stamp, ``user`` gives the number of the session's sandbox user (``Log.sandbox_user``).

        A workspace left by an earlier log under the same id (Redis wiped, the session deleted)
        is put away, so the new log starts with an empty one; sandboxes still running for that
        earlier log are closed first.
        """
        await self._stopped(session_id)
        session = self._sessions.get(session_id) or self._leaving.get(session_id)
        if session is not None and session.created is not None and session.created != created:
            await self.close_session(session_id)
        session = self._session(session_id)
        session.created = created
        if user is not None and self._sandbox.users_per_session:
            self._sandbox.assign(session.workspace, await user())
        if created and stamp_of(session.workspace) != created:
            put_away = await anyio.to_thread.run_sync(self._bind, session.workspace, created)
            if put_away:
                log.warning("workspace.put_away", session=session_id, detail="it belonged to an earlier log")

    def _bind(self, workspace: Path, created: str) -> bool:
        """Record that ``workspace`` belongs to the log created at ``created``; an earlier
        log's workspace (and sandbox state) is removed first.  Whether one was."""
        stamp, put_away = stamp_of(workspace), False
        if stamp is not None and stamp != created:
            trash = workspace.parent / ".trash"
            trash.mkdir(mode=0o700, exist_ok=True)
            for old in (workspace, self._sandbox.state_dir(workspace)):
                if old.exists() or old.is_symlink():
                    # (a rename is atomic: nothing of the old tree is seen at the path after it)
                    away = trash / f"{old.name}-{secrets.token_hex(6)}"
                    os.rename(old, away)
                    shutil.rmtree(away, ignore_errors=True)
                    put_away = True
        path = stamp_file(workspace)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        temp.write_text(created, encoding="utf-8")
        os.replace(temp, path)
        return put_away

    async def close_session(self, session_id: str) -> None:
        """Stop a session's shell and Python process (its workspace stays)."""
        await self._stopped(session_id)
        session = self._sessions.pop(session_id, None) or self._leaving.pop(session_id, None)
        if session is not None:
            await self._stop(session_id, session)

    async def release_session(self, session_id: str) -> None:
        """The session was given back (parked or retired by its owner): stop its sandbox soon,
        at most :data:`STOPS_AT_ONCE` at a time, in :meth:`watch`'s task group (without it, at
        once, as :meth:`close_session`).  Opened or run again before its turn, the session
        keeps its sandbox, as if it had never been given back."""
        if self._stops is None:
            await self.close_session(session_id)
            return
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self._leaving[session_id] = session
            self._stops.start_soon(self._stop_when_due, session_id, session)

    async def _stop_when_due(self, session_id: str, session: _Session) -> None:
        async with self._stop_slots:
            await self._stopped(session_id)  # (an earlier sandbox of the session, still stopping)
            if self._leaving.get(session_id) is session:  # (else taken again, or closed already)
                del self._leaving[session_id]
                await self._stop(session_id, session)

    async def _stop(self, session_id: str, session: _Session) -> None:
        """Stop ``session``'s sandbox; meanwhile the session is neither run nor opened again."""
        stopped = self._stopping[session_id] = anyio.Event()
        try:
            await session.close()
            self._sandbox.unassign(session.workspace)
        finally:
            if self._stopping.get(session_id) is stopped:
                del self._stopping[session_id]
            stopped.set()

    async def _stopped(self, session_id: str) -> None:
        """Wait for the stop of the session's sandbox, if one runs."""
        while (stopping := self._stopping.get(session_id)) is not None:
            await stopping.wait()

    async def aclose(self) -> None:
        """Stop every sandbox; later actions get a retryable ``runtime_closed`` error."""
        self._closed = True
        sessions = [*self._sessions.items(), *self._leaving.items()]
        self._sessions, self._leaving = {}, {}

        async def stop(session_id: str, session: _Session) -> None:
            await self._stopped(session_id)
            await self._stop(session_id, session)

        async with anyio.create_task_group() as tg:  # (all at once: the worker is going)
            for session_id, session in sessions:
                tg.start_soon(stop, session_id, session)
        for stopping in list(self._stopping.values()):
            await stopping.wait()

    async def watch(self, *, interval: float = 1.0, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Enforce the process limit of idle sandboxes too (a fork loop left in the
        background), and stop given-back sessions' sandboxes (:meth:`release_session`); run it
        in the worker's task group with ``await tg.start(rt.watch)``."""
        async with anyio.create_task_group() as stops:
            self._stops = stops
            try:
                task_status.started()
                await self._enforce_limits(interval)
            finally:
                self._stops = None

    async def _enforce_limits(self, interval: float) -> None:
        while not self._closed:
            await anyio.sleep(interval)
            for session in list(self._sessions.values()):
                if not session.started_processes():
                    continue  # (most of a worker's sessions: nothing to count, not even a scope to enter)
                with anyio.move_on_after(interval * 5):
                    await session.shell.enforce_limits()
                    await session.python.enforce_limits()
                    await session.mcp.enforce_limits()

    def knows_mcp(self, session_id: str, server: str) -> bool:
        """Whether the session's runtime has the spec of MCP server ``server`` (an ``mcp_list``
        it ran or was given with :meth:`learn_mcp`)."""
        session = self._sessions.get(session_id)
        return session is not None and session.mcp.knows(server)

    def learn_mcp(self, session_id: str, spec: events.McpList) -> None:
        """Give the session's runtime the spec of a stdio MCP server, from the log's latest
        ``mcp_list`` for it (a new owner's, or a fork's, first ``tool_call`` of that server)."""
        self._session(session_id).mcp.learn(spec)

    # --- cancel ------------------------------------------------------------------------------

    def cancel(self, session_id: str, note: str) -> bool:
        """Interrupt the command or Python cell an action of the session waits for (killing
        what it started, as a hard timeout does); its observation ends with ``note``.  False
        when none is in flight (nothing is remembered for a later one)."""
        session = self._sessions.get(session_id)
        if session is None:
            return False
        return session.shell.cancel(note) or session.python.cancel(note)

    async def stop_background(self, session_id: str, note: str) -> str | None:
        """Interrupt a command the session's shell still runs after its action was answered
        (the soft timeout let it go on): what it printed since, and ``note``.  None when the
        shell runs nothing, or an action is in flight (:meth:`cancel` is for that)."""
        session = self._sessions.get(session_id)
        if session is None or session.lock.locked():
            return None
        async with session.lock:
            return await session.shell.stop_background(note)

    # --- execution --------------------------------------------------------------------------

    async def execute(self, session_id: str, action: events.Event) -> events.Observation:
        """Run one action; returns its observation or an ``error`` (``cause`` = the action's id)."""
        started = time.perf_counter()  # (anyio.current_time asks which event loop runs, each time)
        obs = await self._execute(session_id, action)
        if obs.cause != action.id:
            obs = replace(obs, cause=action.id)
        # Written once the event loop turns, which is after the answer went out: the line costs
        # tens of microseconds, and an action's answer should not wait for the worker's own log
        # (nor for the line's fields to be worked out).
        asyncio.get_running_loop().call_soon(_handled, session_id, action, obs, time.perf_counter() - started)
        return obs

    async def _execute(self, session_id: str, action: events.Event) -> events.Observation:
        if self._closed:
            return _error("runtime_closed", "this runtime is shutting down", retryable=True)
        if isinstance(action, events.Unknown) or not isinstance(action, events.Action):
            name = action.original_kind if isinstance(action, events.Unknown) else action.kind
            return _error("unknown_kind", f"the runtime cannot run a {name!r} event")
        kind = type(action)
        if action.answering_role != "runtime":
            return _error("unknown_kind", f"{action.kind!r} is not an action the runtime runs")
        custom = self._handlers.get(kind) or _handlers.get(kind)
        builtin = self._builtin.get(kind)
        if custom is None and builtin is None:
            return _error("unknown_kind", f"no runtime handler is registered for {action.kind!r}")
        if self._stopping:
            await self._stopped(session_id)
        session = self._session(session_id)
        try:
            session.lock.acquire_nowait()
        except anyio.WouldBlock:
            try:
                with anyio.fail_after(self._limits.queue_timeout):
                    await session.lock.acquire()
            except TimeoutError:
                return _error("busy", "the session's sandbox is busy with earlier actions; try again", retryable=True)
        try:
            await before_start()  # the sandboxes check again right before they start a process
            if not session.workspace_made:
                # Every new session's first action: a thread hop costs more than the stat (a
                # thousand sessions taken at once), unless a whole tree changes owner.
                if not self._sandbox.prepare_quick(session.workspace):
                    await anyio.to_thread.run_sync(self._sandbox.prepare, session.workspace)
                session.workspace_made = True
            if custom is not None:
                ctx = HandlerContext(
                    session_id=session_id,
                    workspace=session.workspace,
                    env=MappingProxyType(self._effective_env(session)),
                    limits=self._limits,
                )
                result = await custom(ctx, action)
            else:
                assert builtin is not None
                result = await builtin(session, action)
        except (PathRefused, files.FileActionError) as exc:
            return _error(exc.reason, str(exc))
        except (ShellUnavailable, PythonUnavailable, SandboxUnavailable) as exc:
            return _error("sandbox_unavailable", str(exc), retryable=True)
        except RiverbedError as exc:
            return _error("handler_failed", str(exc), retryable=exc.retryable)
        except OSError as exc:
            log.warning("sandbox os error", session=session_id, kind=action.kind, error=str(exc))
            return _error("io_error", f"the sandbox hit an OS error: {exc}", retryable=True)
        except Exception as exc:
            log.exception("handler failed", session=session_id, kind=action.kind)
            return _error("handler_failed", f"the {action.kind} handler failed: {type(exc).__name__}: {exc}")
        finally:
            session.lock.release()
        if not isinstance(result, events.Observation):
            return _error(
                "bad_handler_result", f"the {action.kind} handler returned {type(result).__name__}, not an observation"
            )
        return result

    # --- built-in kinds ---------------------------------------------------------------------

    async def _cmd_run(self, session: _Session, action: events.CmdRun) -> events.Observation:
        cwd: Path | None = None
        if action.cwd is not None and not action.is_input:
            cwd = confine(session.workspace, action.cwd)
            if not cwd.is_dir():
                return _error("not_a_directory", f"cwd {action.cwd!r} is not a directory in the workspace")
        return await session.shell.run(action, session.overrides, cwd)

    async def _python_run(self, session: _Session, action: events.PythonRun) -> events.Observation:
        return await session.python.run(action, session.overrides)

    async def _mcp_list(self, session: _Session, action: events.McpList) -> events.Observation:
        if not action.command:
            return _error("not_a_stdio_server", f"the MCP server {action.server!r} has no command: the agent asks it")
        return await session.mcp.list(action, self._effective_env(session))

    async def _tool_call(self, session: _Session, action: events.ToolCall) -> events.Observation:
        if action.server is None:
            return _error("unknown_kind", f"the tool {action.tool!r} is not an MCP server's: the agent runs it")
        return await session.mcp.call(action, self._effective_env(session))

    async def _file_read(self, session: _Session, action: events.FileRead) -> events.Observation:
        # Reading a few KiB of a local file takes microseconds: less than the hop to a thread.
        small = files.read_small(session.workspace, action, self._limits, INLINE_READ_BYTES)
        if small is not None:
            return small
        return await anyio.to_thread.run_sync(files.read, session.workspace, action, self._limits)

    async def _file_write(self, session: _Session, action: events.FileWrite) -> events.Observation:
        owner = self._sandbox.owner(session.workspace)  # what the agent writes, its sandbox user can change
        write = partial(files.write, session.workspace, action, self._limits, session.history, owner=owner)
        return await _in_time(write)

    async def _file_edit(self, session: _Session, action: events.FileEdit) -> events.Observation:
        owner = self._sandbox.owner(session.workspace)
        edit = partial(files.edit, session.workspace, action, self._limits, session.history, owner=owner)
        return await _in_time(edit)

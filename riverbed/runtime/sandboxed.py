"""What the session's two long-lived programs, its bash (:mod:`~riverbed.runtime.shell`) and its
Python driver (:mod:`~riverbed.runtime.python`), share: one process started in the session's
sandbox with the session's environment and limits, the count of the processes it holds, and
the kill that ends it with everything it started.

Every sandbox process of a session starts through :meth:`SandboxedProcess._spawn`: the rlimits'
launcher, the session's cgroup joined before anything of the session runs
(:mod:`~riverbed.runtime.cgroups`), forked by the spawner thread.  A program of the session of
another kind (a tool server) starts through it too, and so shares the session's bounds.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import structlog

from riverbed.runtime.cgroups import SessionCgroup
from riverbed.runtime.limits import (
    Limits,
    Lister,
    kill_processes,
    launcher_argv,
    session_processes,
    tree_processes,
    wait_exit,
)
from riverbed.runtime.output import StreamSource
from riverbed.runtime.sandbox import Link, Sandbox
from riverbed.runtime.spawner import spawn
from riverbed.runtime.tmp import SessionTmp

__all__ = ["Placement", "SandboxedProcess"]

log = structlog.get_logger("riverbed.runtime.sandboxed")


@dataclass(frozen=True)
class Placement:
    """Where and within what a session's program runs (the same for its bash and its Python)."""

    workspace: Path
    env: Mapping[str, str]
    limits: Limits
    sandbox: Sandbox
    tmp: SessionTmp | None = None
    """the session's one /tmp (None: a private one)"""
    cgroup: SessionCgroup | None = None
    """the session's cgroup (None: no usable cgroups, the rlimits only)"""


class SandboxedProcess:
    """A session's program in its sandbox; subclasses start it (``_proc``, ``_link``, ``_core``)."""

    def __init__(self, placement: Placement) -> None:
        self._workspace = placement.workspace
        self._env = dict(placement.env)
        self._limits = placement.limits
        self._sandbox = sandbox = placement.sandbox
        self._tmp = placement.tmp
        self._cgroup = placement.cgroup
        self.masks: StreamSource | None = None
        """masks its outputs as they are read (the tenant's secrets; set by the runtime)"""
        self._kernel_nproc = sandbox.confined
        """the sandbox's own RLIMIT_NPROC bounds its processes: the kernel refuses the fork"""
        self._processes: Lister = tree_processes if sandbox.confined else session_processes
        self._proc: subprocess.Popen[bytes] | None = None
        self._link: Link | None = None
        self._core: frozenset[int] = frozenset()
        """the sandbox's own processes (bubblewrap's and the program), never killed as strays"""

    @property
    def started(self) -> bool:
        """Whether the program was started and not dropped since (it may have exited)."""
        return self._proc is not None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    async def _spawn(self, inner: list[str], *, ctty: bool = False, **popen: Any) -> subprocess.Popen[bytes]:
        """Start ``inner`` (a command line :meth:`Sandbox.wrap` made) as a process of the
        session: in a new POSIX session with the rlimits (``ctty``: its stdin, a pty, becomes
        its controlling terminal), in the session's cgroup before it runs, forked by the
        spawner thread (``popen``: ``subprocess.Popen``'s other arguments)."""
        argv = launcher_argv(self._limits, inner, ctty=ctty, confined=self._sandbox.confined)
        if self._cgroup is not None:
            if not self._cgroup.made:
                await anyio.to_thread.run_sync(self._cgroup.create)
            argv = self._cgroup.join_argv(argv)
        return await spawn(argv, **popen)

    def _bounds_news(self) -> str | None:
        """What the session's cgroup did since the last observation (an OOM kill, refused forks)."""
        return self._cgroup.news() if self._cgroup is not None else None

    async def _kill(self) -> None:
        """Kill the program and everything in its sandbox session (bounded); drop its network link."""
        proc, self._proc = self._proc, None
        if proc is not None:
            await anyio.to_thread.run_sync(partial(kill_processes, proc.pid, lister=self._processes))
            await anyio.to_thread.run_sync(wait_exit, proc, 2.0)
        await self._drop_link()

    async def _drop_link(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            await anyio.to_thread.run_sync(link.close)

    async def _check_processes(self) -> str | None:
        """Kill everything but the sandbox's own processes when it holds more than
        ``max_processes``: the note that says so (None: within the limit)."""
        if self._proc is None or self._kernel_nproc:
            return None
        sid = self._proc.pid
        count = len(await anyio.to_thread.run_sync(self._processes, sid))
        if count <= self._limits.max_processes:
            return None
        killed = await anyio.to_thread.run_sync(partial(kill_processes, sid, keep=self._core))
        log.warning("sandbox process limit", pid=sid, processes=count, killed=killed)
        return f"[the sandbox held {count} processes, over the limit of {self._limits.max_processes}: killed {killed}]"

"""One bounded ``/tmp`` per session, shared by its shell and its Python process.

A session's bash and its Python driver are two sandboxes (two bubblewrap mount namespaces),
and a ``--tmpfs /tmp`` in each gave a session two memory-backed ``/tmp`` mounts, each able
to hold its full size of the host's RAM.  Instead, a root worker gives each session one
tmpfs of ``Sandbox.tmp_bytes``: a small holder process (``unshare --mount``, then ``mount -t
tmpfs`` over the session's ``tmp`` state directory) keeps a private mount namespace with the
tmpfs in it, and every sandbox process of the session enters that namespace (``nsenter
--mount``) before bubblewrap builds its own from it, binding the tmpfs at ``/tmp``.  Writing
past the bound fails with ``ENOSPC``, in the shell and the cell alike.

The tmpfs is mounted in the holder's namespace only (``unshare`` makes its mounts private):
the host never sees it, and nothing is left mounted when the holder goes.  The holder reads
its stdin, a pipe whose other end only the worker holds, and exits when that closes: when
the session is closed (parked, released, lost), or the worker dies, SIGKILL included.  A
session's ``/tmp`` lives as long as the session's sandboxes do; a shell restarted after a
hang keeps it.

A non-root worker cannot mount a tmpfs outside a user namespace of its own, so its sandbox
processes keep a private tmpfs each (``Sandbox.tmp_bytes`` each).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from functools import partial
from pathlib import Path

import anyio
import structlog

from riverbed.runtime import tools
from riverbed.runtime.limits import wait_exit
from riverbed.runtime.output import read_some
from riverbed.runtime.sandbox import Sandbox, SandboxUnavailable, SharedTmp
from riverbed.runtime.spawner import spawn

__all__ = ["SessionTmp"]

log = structlog.get_logger("riverbed.runtime.tmp")

_READY = b"mounted\n"
_START_TIMEOUT = 10.0


class SessionTmp:
    """The holder of one session's ``/tmp`` (see the module docstring); not safe for
    concurrent use (the session's lock serialises its sandboxes' starts)."""

    def __init__(self, sandbox: Sandbox, workspace: Path) -> None:
        self._sandbox = sandbox
        self._workspace = workspace
        self._proc: subprocess.Popen[bytes] | None = None
        self._keep = -1
        """the worker's end of the holder's stdin: the holder lives while it is open"""

    @property
    def shared(self) -> bool:
        """Whether this session's sandboxes share one ``/tmp`` (a root worker's namespaces sandbox)."""
        return self._sandbox.users_per_session

    async def enter(self) -> SharedTmp | None:
        """The ``/tmp`` a new sandbox process of the session joins (the holder is started on the
        first call, and again if it died); None when each process gets its own."""
        if not self.shared:
            return None
        if self._proc is None or self._proc.poll() is not None:
            await self.close()
            await self._start()
        assert self._proc is not None
        return SharedTmp(namespace=f"/proc/{self._proc.pid}/ns/mnt", source=str(self._source()))

    def _source(self) -> Path:
        return self._sandbox.state_dir(self._workspace) / "tmp"

    async def _start(self) -> None:
        unshare, mount = _which("unshare"), _which("mount")
        if unshare is None or mount is None:
            raise SandboxUnavailable("unshare and mount (util-linux) must be installed: they mount the sessions' /tmp")
        source = self._source()
        source.mkdir(mode=0o755, exist_ok=True)
        script = (
            f'{mount} -t tmpfs -o size={self._sandbox.tmp_bytes},mode=1777,nosuid,nodev tmpfs "$0" '
            "&& printf 'mounted\\n' && exec cat >/dev/null"
        )
        keep_r, keep_w = os.pipe()
        ready_r, ready_w = os.pipe()
        try:
            self._proc = await spawn(
                [unshare, "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script, str(source)],
                stdin=keep_r,
                stdout=ready_w,
                stderr=ready_w,
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            )
        except BaseException:
            os.close(keep_w)
            raise
        finally:
            os.close(keep_r)
            os.close(ready_w)
        self._keep = keep_w
        said = b""
        try:
            os.set_blocking(ready_r, False)
            with anyio.move_on_after(_START_TIMEOUT):
                while not said.endswith(_READY) and (chunk := await read_some(ready_r)):
                    said += chunk
        finally:
            os.close(ready_r)
        if not said.endswith(_READY):
            await self.close()
            last = said.decode(errors="replace").strip().splitlines()
            raise SandboxUnavailable("the session's /tmp could not be mounted" + (f": {last[-1]}" if last else ""))

    async def close(self) -> None:
        """Let the holder go (its namespace and the tmpfs go with it)."""
        if self._keep >= 0:
            with contextlib.suppress(OSError):
                os.close(self._keep)
            self._keep = -1
        proc, self._proc = self._proc, None
        if proc is not None and not await anyio.to_thread.run_sync(partial(wait_exit, proc, 2.0, reap_later=False)):
            proc.kill()
            await anyio.to_thread.run_sync(partial(wait_exit, proc, 2.0))
            log.warning("tmp.holder_killed", workspace=str(self._workspace))


_which = tools.find

"""Where sandbox processes are started: one thread that lives as long as the worker.

bubblewrap's ``--die-with-parent`` is ``PR_SET_PDEATHSIG``, and the kernel sends that
signal when the *thread* that forked the child exits, not when its process does.  A
sandbox forked from an anyio worker thread (``to_thread.run_sync``) therefore died with
that thread, which anyio retires after about ten seconds idle: a session's shell and
Python driver, their variables and their background jobs, lost in ordinary operation.

So every sandbox process is forked by one thread of the process's own, started on the
first :func:`spawn` and never ended: the death signal fires when the worker process dies
(a SIGKILL included) and never because a thread ended.  A sandbox ends when its session
closes it (parked, released, lost) or when its worker dies.

Forking a big process takes milliseconds, so the thread also keeps that off the event
loop, as the worker thread did.  Requests are served one at a time, in order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import subprocess
import threading
from collections.abc import Callable
from typing import Any

import anyio

__all__ = ["spawn"]

_Started = concurrent.futures.Future[subprocess.Popen[bytes]]
_Request = tuple[Callable[[], subprocess.Popen[bytes]], _Started]


class _Spawner:
    """One long-lived thread forking the processes asked of it."""

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(
        self, start: Callable[[], subprocess.Popen[bytes]]
    ) -> concurrent.futures.Future[subprocess.Popen[bytes]]:
        future: concurrent.futures.Future[subprocess.Popen[bytes]] = concurrent.futures.Future()
        with self._lock:
            if self._thread is None:
                # a daemon: it never ends while the worker runs, and does not hold the exit up
                self._thread = threading.Thread(target=self._serve, name="riverbed-sandbox-spawner", daemon=True)
                self._thread.start()
        self._requests.put((start, future))
        return future

    def _serve(self) -> None:
        while True:
            start, future = self._requests.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(start())
            except BaseException as exc:  # handed to the caller, whatever it is
                future.set_exception(exc)


_spawner = _Spawner()


async def spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """Start a sandbox process from the spawner thread (``subprocess.Popen`` arguments).

    The wait is shielded: a process that is started belongs to its caller, which must not be
    cancelled away from it (nobody would then close it)."""

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, close_fds=True, **kwargs)

    future = _spawner.submit(start)
    with anyio.CancelScope(shield=True):
        proc = await asyncio.wrap_future(future)
    return proc  # noqa: RET504  (after the scope: a shielded scope may end without a value, says mypy)

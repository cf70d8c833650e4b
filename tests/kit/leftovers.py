"""What a test session left running, found by the session's own directories and ended.

An aborted run (a test past its hard timeout, Ctrl-C, a killed pytest-xdist worker) skips the
teardown of the fixtures that started its ``redis-server``, embedded Postgres and worker
processes, and they keep running: a Postgres even outlives its starter's SIGKILL.  So each test
process of a session marks what it starts: ``$RBTEST_SESSION`` names its own directory under the
session's (every child inherits it), and the services it starts live in that directory or in
pytest's temporary ones.  After the session, and as soon as a pytest-xdist worker dies,
:func:`sweep` ends every process that belongs there:

- its environment holds the mark of that directory (or one below it), or
- its working directory or its command line lies inside one of those directories
  (``redis-server --dir``, a Postgres data directory, a worker's workspace).

Nothing else is touched: other people's test sessions on the same machine have directories of
their own.  A Postgres is stopped with its own ``pg_ctl`` as the user it runs as
(:func:`riverbed.services.stop_postgres`); what is still left is killed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from riverbed import services

__all__ = ["MARK", "Leftover", "belongs", "find", "report", "sweep"]

MARK = "RBTEST_SESSION"
"""The environment variable that names the directory of the test process a process was started by."""


@dataclasses.dataclass(frozen=True)
class Leftover:
    pid: int
    parent: int
    command: str
    why: str
    pgdata: Path | None = None
    """The data directory of a Postgres server (its postmaster), to stop it with its ``pg_ctl``."""

    def __str__(self) -> str:
        return f"pid {self.pid}: {self.command[:120]} ({self.why})"


def report(ended: Sequence[Leftover]) -> list[str]:
    """One line per process that ``ended`` holds and whose parent it does not (a server with its
    own children, such as Postgres, is one line)."""
    pids = {left.pid for left in ended}
    lines = []
    for left in ended:
        if left.parent in pids:
            continue
        children = sum(1 for other in ended if other.parent == left.pid)
        lines.append(f"{left}" + (f", with {children} child processes" if children else ""))
    return lines


def belongs(pid: int, roots: Sequence[Path]) -> str | None:
    """Why process ``pid`` belongs to one of ``roots`` (None when it does not)."""
    base = f"/proc/{pid}"
    with contextlib.suppress(OSError):
        for entry in Path(f"{base}/environ").read_bytes().split(b"\0"):
            name, _, value = entry.partition(b"=")
            if name == MARK.encode() and _inside(os.fsdecode(value), roots):
                return f"started by this session (${MARK}={os.fsdecode(value)})"
    with contextlib.suppress(OSError):
        cwd = os.readlink(f"{base}/cwd")
        if _inside(cwd, roots):
            return f"runs in {cwd}"
    with contextlib.suppress(OSError):
        for arg in Path(f"{base}/cmdline").read_bytes().split(b"\0"):
            if arg.startswith(b"/") and _inside(os.fsdecode(arg), roots):
                return f"names {os.fsdecode(arg)}"
    return None


def find(roots: Sequence[Path], *, spare: Iterable[int] = ()) -> list[Leftover]:
    """The processes running now that belong to ``roots``; never this process, its ancestors,
    nor ``spare``."""
    keep = {*_ancestors(), *spare}
    found: list[Leftover] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in keep:
            continue
        pid = int(entry.name)
        why = belongs(pid, roots)
        if why is None:
            continue
        with contextlib.suppress(OSError):
            argv = [os.fsdecode(a) for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
            if argv:  # (a zombie has none, and nothing to end)
                found.append(Leftover(pid, _parent(pid), " ".join(argv), why, _postmaster_data(argv)))
    return found


def sweep(roots: Sequence[Path], *, spare: Iterable[int] = ()) -> list[Leftover]:
    """End every process that belongs to ``roots`` (see :func:`find`); what was ended."""
    spare = set(spare)
    found = find(roots, spare=spare)
    for left in found:  # (a test may have stopped one, a Postgres that hangs for instance)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(left.pid, signal.SIGCONT)
    for postmaster in found:
        if postmaster.pgdata is not None:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                services.stop_postgres(postmaster.pgdata)
    for left in find(roots, spare=spare):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(left.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while find(roots, spare=spare) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def _inside(path: str, roots: Sequence[Path]) -> bool:
    return any(path == str(root) or path.startswith(f"{root}/") for root in roots)


def _postmaster_data(argv: list[str]) -> Path | None:
    """The data directory of a Postgres postmaster's command line (``postgres -D <pgdata>``)."""
    if Path(argv[0]).name != "postgres" or "-D" not in argv[:-1]:
        return None
    return Path(argv[argv.index("-D") + 1])


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        pid = _parent(pid)
    return pids

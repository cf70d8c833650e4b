"""Sandbox limits and the process plumbing that enforces them.

How each sandbox process is bounded (the worker usually runs as root); what bounds a session's
processes together, where the host has cgroups, is :mod:`~riverbed.runtime.cgroups`:

- **Per-process rlimits.**  Every sandbox process (the session's bash, its Python driver)
  is started through util-linux's ``setsid`` + ``prlimit`` when installed (a few ms), else
  through ``_launch.py``, a stdlib-only script run with the worker's own interpreter; either
  way the sandbox becomes one POSIX session of its own, the pty becomes its controlling
  terminal when asked, the rlimits are applied and then the real program is ``exec``\\ ed.
  The limits: address space (``RLIMIT_AS``), file size (``RLIMIT_FSIZE``), CPU seconds per
  process (``RLIMIT_CPU``), open files
  (``RLIMIT_NOFILE``), no core dumps, and ``RLIMIT_NPROC`` when the worker is *not* root
  (the kernel ignores it for root, and it counts every process of the user, not just ours).
  Using a launcher rather than ``preexec_fn`` keeps spawning safe in a threaded worker;
  the fork itself happens on the worker's one spawner thread (:mod:`~riverbed.runtime.spawner`).
- **Process count.**  Because ``RLIMIT_NPROC`` does nothing for root, the runtime counts the
  processes of each sandbox session (``/proc/*/stat`` session id) while a command runs and
  from :meth:`Runtime.watch`; above ``max_processes`` every process of the sandbox except
  its shell is killed.
- **Time.**  A command past its hard timeout is interrupted (Ctrl-C through the pty); if that
  is not enough, its process group and every process it started in the sandbox session are
  killed with ``SIGKILL`` (a stop pass first, so a fork loop cannot outrun the kill).

A program that calls ``setsid()`` itself leaves the sandbox session and escapes the count;
the session's cgroup (:mod:`~riverbed.runtime.cgroups`) still holds it, and kills it when the
session's sandbox ends.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

LAUNCHER = Path(__file__).with_name("_launch.py")
DRIVER = Path(__file__).with_name("_driver.py")

_MIB = 1024 * 1024


class Limits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Bounds of every sandbox.  Times are seconds; sizes bytes; ``None`` means no limit."""

    cmd_timeout: float = 120.0
    """hard timeout of a ``cmd_run`` whose ``timeout`` is not set"""
    soft_timeout: float = 10.0
    """a non-blocking command with no new output for this long returns (it keeps running)"""
    python_timeout: float = 120.0
    """hard timeout of a ``python_run`` whose ``timeout`` is not set"""
    interrupt_grace: float = 2.0
    """after Ctrl-C / SIGINT, how long to wait before killing"""
    start_timeout: float = 15.0
    """how long a new shell or Python process may take to become ready"""
    max_output_chars: int = 30_000
    """output above this is cut in the middle, with a marker"""
    max_read_bytes: int = 5 * _MIB
    """largest file ``file_read`` and ``file_edit view`` will load"""
    max_processes: int = 256
    """processes one sandbox session may hold; above it they are killed"""
    address_space: int | None = 8 * 1024 * _MIB
    """RLIMIT_AS of each sandbox process"""
    file_size: int | None = 1024 * _MIB
    """RLIMIT_FSIZE: the largest file a sandbox process may write"""
    cpu_seconds: int | None = 3600
    """RLIMIT_CPU of each sandbox process (CPU time, not wall time)"""
    open_files: int | None = 4096
    """RLIMIT_NOFILE of each sandbox process"""
    edit_history: int = 20
    """``undo_edit`` steps kept per file"""
    queue_timeout: float = 900.0
    """how long an action may wait for the earlier actions of its session"""

    def rlimits(self, *, confined: bool = False) -> dict[str, int]:
        """The ``resource.RLIMIT_*`` names and values the launcher applies.

        ``confined``: a namespaces sandbox counts its processes on its own: a root worker's on
        the session's uid (the limit set here passes to it), a non-root worker's in its user
        namespace (set inside, see :meth:`Sandbox.wrap`)."""
        out: dict[str, int] = {"RLIMIT_CORE": 0}
        for name, value in (
            ("RLIMIT_AS", self.address_space),
            ("RLIMIT_FSIZE", self.file_size),
            ("RLIMIT_CPU", self.cpu_seconds),
            ("RLIMIT_NOFILE", self.open_files),
        ):
            if value is not None:
                out[name] = int(value)
        if confined:
            if os.geteuid() == 0:  # inherited by the session's own uid once the sandbox drops to it
                out["RLIMIT_NPROC"] = self.max_processes
        elif os.geteuid() != 0:
            out["RLIMIT_NPROC"] = _user_process_count() + self.max_processes
        return out


_PRLIMIT_FLAGS = {
    "RLIMIT_CORE": "--core",
    "RLIMIT_AS": "--as",
    "RLIMIT_FSIZE": "--fsize",
    "RLIMIT_CPU": "--cpu",
    "RLIMIT_NOFILE": "--nofile",
    "RLIMIT_NPROC": "--nproc",
}


@functools.cache
def _util_linux() -> tuple[str, str] | None:
    """``setsid`` and ``prlimit`` (util-linux), when both are installed."""
    setsid, prlimit = shutil.which("setsid"), shutil.which("prlimit")
    return (setsid, prlimit) if setsid and prlimit else None


def launcher_argv(limits: Limits, argv: list[str], *, ctty: bool = False, confined: bool = False) -> list[str]:
    """The command line that runs ``argv`` as a new limited sandbox session.

    With util-linux's ``setsid`` and ``prlimit`` (two small execs, a few ms) when present,
    else our stdlib launcher script (a Python start-up, tens of ms: it adds up when a
    worker takes over many sessions at once).  The launcher script too when this process
    ignores SIGINT or SIGQUIT (started by ``nohup`` or with ``&`` in a script): an ignored signal
    stays ignored across ``exec``, and the script gives the sandbox's programs the default back
    (else a Ctrl-C never interrupts a command).
    """
    tools = _util_linux()
    if tools is None or _ignores_interrupts():
        flags = ["--ctty"] if ctty else []
        rlimits = json.dumps(limits.rlimits(confined=confined))
        return [sys.executable, "-I", "-S", str(LAUNCHER), rlimits, *flags, "--", *argv]
    setsid, prlimit = tools
    bounds = []
    for name, wanted in limits.rlimits(confined=confined).items():
        _soft, hard = resource.getrlimit(getattr(resource, name))
        value = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        bounds.append(f"{_PRLIMIT_FLAGS[name]}={value}")
    return [setsid, *(["--ctty"] if ctty else []), prlimit, *bounds, "--", *argv]


def _ignores_interrupts() -> bool:
    return any(signal.getsignal(number) == signal.SIG_IGN for number in (signal.SIGINT, signal.SIGQUIT))


def _user_process_count() -> int:
    uid = os.geteuid()
    count = 0
    for entry in _proc_entries():
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{entry}").st_uid == uid:
                count += 1
    return count


def _proc_entries() -> list[str]:
    try:
        return [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def proc_stat(pid: int | str) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command's name (the state first), None when
    the process is gone; the name is skipped whole, whatever parentheses or spaces it holds."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[-1].split()
    except OSError:
        return None


def session_processes(sid: int) -> list[tuple[int, int]]:
    """``(pid, pgrp)`` of every live process in POSIX session ``sid`` (zombies excluded)."""
    found: list[tuple[int, int]] = []
    for entry in _proc_entries():
        fields = proc_stat(entry)
        if fields is None or len(fields) < 4 or fields[0] == b"Z":
            continue
        if int(fields[3]) == sid:
            found.append((int(entry), int(fields[2])))
    return found


def tree_processes(root: int) -> list[tuple[int, int]]:
    """``(pid, pgrp)`` of ``root`` and every live descendant, read through
    ``/proc/<pid>/task/<tid>/children``: a namespaces sandbox's processes (all of them live
    under its bubblewrap, even after ``setsid`` or a double fork), found without reading the
    whole of ``/proc`` (which costs milliseconds per command on a host with many sandboxes)."""
    found: list[tuple[int, int]] = []
    queue, seen = [root], set()
    while queue:
        pid = queue.pop()
        if pid in seen:
            continue
        seen.add(pid)
        fields = proc_stat(pid)
        if fields is None or len(fields) < 4 or fields[0] == b"Z":
            continue
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        found.append((pid, int(fields[2])))
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                    queue.extend(int(child) for child in fh.read().split())
            except OSError:
                continue
    return found


Lister = Callable[[int], list[tuple[int, int]]]


def kill_processes(
    sid: int,
    *,
    keep: frozenset[int] = frozenset(),
    only_new_since: set[int] | None = None,
    lister: Lister = session_processes,
    settle: float = 2.0,
) -> int:
    """SIGKILL processes of session ``sid`` (as ``lister`` finds them) except ``keep`` (and,
    when given, except those in ``only_new_since``).  Stops them first so a fork loop cannot
    outrun us: done once a listing finds none not signalled already (a killed process is
    listed until it has exited, and it forks no more).  Returns how many were killed, once
    they are gone (a zombie at most) or ``settle`` seconds have passed: a SIGKILLed process
    still runs until the kernel schedules its exit, which on a loaded machine can be after
    the sandbox's own process was reaped, so a stopped sandbox would otherwise still show a
    command running."""
    killed: set[int] = set()
    for _ in range(20):
        targets = [
            pid
            for pid, _pg in lister(sid)
            if pid not in keep and pid not in killed and (only_new_since is None or pid not in only_new_since)
        ]
        if not targets:
            break
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in targets:
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
        killed.update(targets)
    deadline = time.monotonic() + settle
    pending = sorted(killed)
    while pending := [pid for pid in pending if not _exited(pid)]:
        if time.monotonic() > deadline:
            break
        time.sleep(0.005)
    return len(killed)


def _exited(pid: int) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie left for its parent to reap)."""
    fields = proc_stat(pid)
    return fields is None or fields[:1] in ([b"Z"], [b"X"])


def wait_exit(proc: subprocess.Popen[bytes], seconds: float, *, reap_later: bool = True) -> bool:
    """Reap ``proc`` (blocking, call it in a thread); True when it has exited.

    One still running after ``seconds`` (a killed process can take a while to go on a loaded
    machine) is waited for by a thread of its own, so it is reaped whenever it exits: none is
    left a zombie, or dropped while it runs (``reap_later=False``: the caller waits again)."""
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        if reap_later:
            threading.Thread(target=proc.wait, name=f"riverbed-reap-{proc.pid}", daemon=True).start()
        return False
    return True


def signal_group(pgrp: int, sig: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pgrp, sig)

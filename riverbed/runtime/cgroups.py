"""One cgroup per session: the CPU, memory and process count of everything a session runs.

rlimits bound one process each, so a session of many processes was bounded by none of them: a
background fork bomb held its 256 processes at full CPU, and three processes of 1 GiB took
3 GiB.  So every sandbox process of a session (its bash, its Python driver, what they start,
and any other program started through :meth:`SandboxedProcess._spawn
<riverbed.runtime.sandboxed.SandboxedProcess._spawn>`) runs in one cgroup of the session's own,
with:

- **CPU**: at most :attr:`Bounds.cpu` CPUs (``cpu.max`` / ``cpu.cfs_quota_us`` over a 100 ms
  period), and the same weight as every other session (``cpu.weight`` 100 / ``cpu.shares``
  1024), so a busy session takes at most its quota and an equal share below it;
- **memory**: at most :attr:`Bounds.memory` bytes for all its processes together, swap
  included (``memory.max`` with ``memory.swap.max`` 0 / ``memory.limit_in_bytes`` and
  ``memory.memsw.limit_in_bytes``); past it the kernel's OOM killer kills one of them;
- **processes**: at most :attr:`Bounds.pids` tasks (``pids.max``); past it ``fork`` fails.

The process joins before it runs anything of the session's: the command line starts with a
``/bin/sh`` that writes its own pid into the cgroup's ``cgroup.procs`` (each hierarchy's, in
v1) and then ``exec``\\ s the launcher (:meth:`SessionCgroup.join_argv`); if a write fails, it
exits 125 and nothing runs.  An OOM kill or a refused fork is told in the next observation of the
session, one sentence each (:meth:`SessionCgroup.news`, from ``memory.events`` or
``memory.oom_control`` and ``pids.events``).  When the session's sandbox ends
(:meth:`SessionCgroup.close`), every process left in its cgroup is killed (``cgroup.kill``,
else frozen, SIGKILLed and thawed) and the cgroup is removed: a ``setsid`` double fork does not
outlive its session, in ``process`` mode either.

Which cgroups (:func:`detect`): cgroup v2 when the worker's own cgroup has the ``cpu``,
``memory`` and ``pids`` controllers (a delegated subtree); else the v1 controllers ``cpu``,
``memory``, ``pids`` and ``freezer`` when they are mounted.  Session cgroups are made below the
worker's own cgroup in each hierarchy, so whatever bounds the worker (a container, a systemd
unit) bounds them too.  In v2 the controllers must be enabled in that cgroup's
``cgroup.subtree_control``, which the kernel allows only while it holds no process: a worker
alone in its cgroup moves itself into a leaf of its own (``…-worker``) first, as systemd asks of
a delegated service.  Without usable cgroups (a non-root worker without delegation) the worker
says so once at start, and each sandbox process keeps its rlimits only.

Names: ``riverbed-<pid namespace>-<pid>-<start time>-<n>``, the worker's identity and a counter,
so two workers (and two openings of one session) never share one, and a worker that starts
removes those of workers of its PID namespace that are gone (:meth:`Cgroups.sweep`): a
SIGKILLed worker's cgroups do not pile up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Literal

import structlog

from riverbed.runtime.limits import proc_stat

__all__ = ["Bounds", "Cgroups", "CgroupsUnusable", "SessionCgroup", "detect"]

log = structlog.get_logger("riverbed.runtime.cgroups")

_GIB = 1024**3
PERIOD_US = 100_000
"""The CPU quota's period (100 ms, the kernel's default)."""
V1_CONTROLLERS = ("cpu", "memory", "pids", "freezer")
V2_CONTROLLERS = ("cpu", "memory", "pids")
_NAME = re.compile(r"^riverbed-(\d+)-(\d+)-(\d+)-(\d+|worker)$")
_JOINED_OR_EXIT = 'while [ "$1" != -- ]; do echo $$ >"$1" || exit 125; shift; done; shift; exec "$@"'
"""The shell that joins the cgroup: its own pid into each ``cgroup.procs`` given, then the command."""
_KILL_SECONDS = 5.0


class CgroupsUnusable(Exception):
    """The cgroups of this host cannot bound sessions (the message says why)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Bounds:
    """What one session's cgroup allows all its processes together."""

    cpu: float = 1.0
    """CPUs (``RIVERBED_SANDBOX_CPU``)"""
    memory: int = 2 * _GIB
    """bytes of memory, swap included (``RIVERBED_SANDBOX_MEMORY``)"""
    pids: int = 256
    """tasks: processes and threads (``RIVERBED_SANDBOX_PIDS``)"""


@dataclasses.dataclass(frozen=True)
class Hierarchy:
    """Where this worker's cgroup is: ``dirs`` maps each v1 controller (v2: ``"unified"``) to
    the directory of the worker's cgroup in its hierarchy."""

    version: Literal[1, 2]
    dirs: dict[str, Path]


def _unescape(field: str) -> str:
    """A mountinfo path, its octal escapes (``\\040`` for a space) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """``(fs type, root, mount point, super options)`` of every cgroup mount in ``mountinfo``."""
    found = []
    for line in mountinfo.splitlines():
        before, sep, after = line.partition(" - ")
        fields, rest = before.split(), after.split()
        if not sep or len(fields) < 5 or len(rest) < 3 or rest[0] not in ("cgroup", "cgroup2"):
            continue
        found.append((rest[0], _unescape(fields[3]), _unescape(fields[4]), set(rest[2].split(","))))
    return found


def _below(mountpoint: str, root: str, path: str) -> Path | None:
    """The directory of cgroup ``path`` in a hierarchy mounted at ``mountpoint`` from ``root``."""
    if root not in ("/", path) and not path.startswith(root.rstrip("/") + "/"):
        return None
    rel = path[len(root) :] if root != "/" else path
    return Path(mountpoint) / rel.lstrip("/")


def find(mountinfo: str, self_cgroup: str) -> Hierarchy | str:
    """Which hierarchy to use (see the module docstring), from ``/proc/self/mountinfo`` and
    ``/proc/self/cgroup``; a sentence saying why none, when none is usable."""
    mounts = _mounts(mountinfo)
    paths: dict[str, str] = {}
    for line in self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for name in parts[1].split(",") if parts[1] else [""]:
                paths[name] = parts[2]
    for fstype, root, mountpoint, _opts in mounts:
        if fstype == "cgroup2" and "" in paths:
            where = _below(mountpoint, root, paths[""])
            if where is not None and set(V2_CONTROLLERS) <= set(_read(where / "cgroup.controllers").split()):
                return Hierarchy(2, {"unified": where})
    dirs: dict[str, Path] = {}
    for controller in V1_CONTROLLERS:
        for fstype, root, mountpoint, opts in mounts:
            if fstype == "cgroup" and controller in opts and controller in paths:
                where = _below(mountpoint, root, paths[controller])
                if where is not None:
                    dirs[controller] = where
                    break
    if len(dirs) == len(V1_CONTROLLERS):
        return Hierarchy(1, dirs)
    missing = [c for c in V1_CONTROLLERS if c not in dirs]
    return (
        "no cgroup v2 subtree with the cpu, memory and pids controllers is delegated to this worker, "
        f"and the cgroup v1 controllers {', '.join(missing)} are not mounted"
    )


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii")
    except OSError:
        return ""


def _write(path: Path, value: str) -> None:
    with open(path, "w", encoding="ascii") as fh:  # one write(2): what a cgroup file wants
        fh.write(value)


def _counter(text: str, key: str) -> int:
    """The value of ``key`` in a flat-keyed cgroup file (``oom_kill 3``); 0 when absent."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _identity(pid: int | str = "self") -> tuple[int, int] | None:
    """``(pid namespace inode, start time)`` of a process (None: it does not exist)."""
    fields = proc_stat(pid)
    if fields is None:
        return None
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino, int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


class Cgroups:
    """The session cgroups of one worker (see the module docstring); :func:`detect` makes it."""

    def __init__(self, hierarchy: Hierarchy, bounds: Bounds, *, tag: str | None = None) -> None:
        self.hierarchy = hierarchy
        self.bounds = bounds
        if tag is None:
            ident = _identity()
            assert ident is not None
            tag = f"riverbed-{ident[0]}-{os.getpid()}-{ident[1]}"
        self.tag = tag
        self._numbers = itertools.count(1)

    @property
    def version(self) -> int:
        return self.hierarchy.version

    def describe(self) -> str:
        """``cgroup v1 (cpu, memory, pids, freezer) below /sys/fs/cgroup/memory/…``: the worker's start line."""
        names = ", ".join(self.hierarchy.dirs) if self.version == 1 else ", ".join(V2_CONTROLLERS)
        return f"cgroup v{self.version} ({names}) below {', '.join(str(d) for d in self.hierarchy.dirs.values())}"

    def session(self) -> SessionCgroup:
        """A new session's cgroup (made when its first process starts: :meth:`SessionCgroup.create`)."""
        return SessionCgroup(self, f"{self.tag}-{next(self._numbers)}")

    def prepare(self) -> None:
        """Make the hierarchy ready for session cgroups (v2: its controllers enabled for the
        worker's cgroup's children, the worker moved into a leaf first when it must be);
        :class:`CgroupsUnusable` when that cannot be done."""
        if self.version == 1:
            return
        base = self.hierarchy.dirs["unified"]
        wanted = set(V2_CONTROLLERS)
        if wanted <= set(_read(base / "cgroup.subtree_control").split()):
            return
        enable = " ".join(f"+{c}" for c in V2_CONTROLLERS)
        try:
            _write(base / "cgroup.subtree_control", enable)
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise CgroupsUnusable(f"the controllers of {base} cannot be enabled for its children: {exc}") from exc
        # It holds processes (no cgroup with enabled controllers may): this worker alone may move.
        others = {int(p) for p in _read(base / "cgroup.procs").split()} - {os.getpid()}
        if others:
            raise CgroupsUnusable(
                f"the worker's cgroup {base} holds {len(others)} other process(es), so its controllers cannot be "
                "given to sessions: run the worker alone in a delegated cgroup (systemd: Delegate=yes)"
            )
        leaf = base / f"{self.tag}-worker"
        try:
            leaf.mkdir(exist_ok=True)
            _write(leaf / "cgroup.procs", str(os.getpid()))
            _write(base / "cgroup.subtree_control", enable)
        except OSError as exc:
            raise CgroupsUnusable(f"the worker could not move into {leaf} to delegate {base}: {exc}") from exc

    def probe(self) -> None:
        """Make a session cgroup, run ``true`` in it the way every sandbox process joins, and
        remove it; :class:`CgroupsUnusable` when any of that fails."""
        group = self.session()
        try:
            group.create()
            done = subprocess.run(
                group.join_argv(["/bin/true"]), capture_output=True, timeout=15, check=False, stdin=subprocess.DEVNULL
            )
            if done.returncode != 0:
                said = done.stderr.decode(errors="replace").strip().splitlines()
                raise CgroupsUnusable("a process cannot join a session cgroup" + (f": {said[-1]}" if said else ""))
        except OSError as exc:
            raise CgroupsUnusable(f"a session cgroup cannot be made: {exc}") from exc
        finally:
            with contextlib.suppress(OSError):
                group.close()

    def sweep(self) -> int:
        """Kill what is left in, and remove, the session cgroups of this PID namespace's
        workers that are gone (a SIGKILLed worker's); how many were removed."""
        ours = _identity()
        removed = 0
        names: set[str] = set()
        for base in self.hierarchy.dirs.values():
            if not os.access(base, os.W_OK):
                return 0  # (a worker that cannot make cgroups here cannot remove any either)
            with contextlib.suppress(OSError):
                names.update(entry.name for entry in os.scandir(base) if entry.is_dir(follow_symlinks=False))
        for name in sorted(names):
            match = _NAME.match(name)
            if match is None or ours is None or int(match.group(1)) != ours[0]:
                continue
            pid, start = int(match.group(2)), int(match.group(3))
            alive = _identity(pid)
            if alive is not None and alive == (ours[0], start):
                continue  # a live worker's (this one's too)
            if SessionCgroup(self, name, made=True).close():
                removed += 1
        return removed


class SessionCgroup:
    """The cgroup of one session (see the module docstring); its methods block (files of the
    cgroup filesystem, microseconds each; :meth:`close` waits for its processes to die)."""

    def __init__(self, owner: Cgroups, name: str, *, made: bool = False) -> None:
        self.name = name
        self._version = owner.version
        self._bounds = owner.bounds
        self._dirs = {controller: base / name for controller, base in owner.hierarchy.dirs.items()}
        self.made = made
        self._reported = (0, 0)
        """OOM kills and refused forks already told"""

    def create(self) -> None:
        """Make the cgroup (in every hierarchy) and set its bounds; nothing when it is made."""
        if self.made:
            return
        bounds = self._bounds
        quota = max(1000, round(bounds.cpu * PERIOD_US))
        if self._version == 2:
            where = self._dirs["unified"]
            where.mkdir(exist_ok=True)
            _write(where / "cpu.max", f"{quota} {PERIOD_US}")
            _write(where / "cpu.weight", "100")
            _write(where / "memory.max", str(bounds.memory))
            if (where / "memory.swap.max").exists():
                _write(where / "memory.swap.max", "0")
            _write(where / "pids.max", str(bounds.pids))
        else:
            for path in self._dirs.values():
                path.mkdir(exist_ok=True)
            cpu, memory = self._dirs["cpu"], self._dirs["memory"]
            _write(cpu / "cpu.cfs_period_us", str(PERIOD_US))
            _write(cpu / "cpu.cfs_quota_us", str(quota))
            _write(cpu / "cpu.shares", "1024")
            _write(memory / "memory.limit_in_bytes", str(bounds.memory))
            if (memory / "memory.memsw.limit_in_bytes").exists():  # (swap accounting on: no swap past it)
                _write(memory / "memory.memsw.limit_in_bytes", str(bounds.memory))
            _write(self._dirs["pids"] / "pids.max", str(bounds.pids))
        self.made = True
        self._reported = self._counters()

    def join_argv(self, argv: list[str]) -> list[str]:
        """``argv`` run by a process that first joins this cgroup (or exits 125 without running it)."""
        files = [str(path / "cgroup.procs") for path in self._dirs.values()]
        return ["/bin/sh", "-c", _JOINED_OR_EXIT, "riverbed-cgroup", *files, "--", *argv]

    def _counters(self) -> tuple[int, int]:
        if self._version == 2:
            where = self._dirs["unified"]
            oom = _counter(_read(where / "memory.events"), "oom_kill")
            pids = _read(where / "pids.events")
        else:
            oom = _counter(_read(self._dirs["memory"] / "memory.oom_control"), "oom_kill")
            pids = _read(self._dirs["pids"] / "pids.events")
        return oom, _counter(pids, "max")

    def news(self) -> str | None:
        """What the session's bounds did since the last time this was asked: one sentence each
        for processes the OOM killer killed and forks refused (None: nothing)."""
        if not self.made:
            return None
        now = self._counters()
        killed, refused = now[0] - self._reported[0], now[1] - self._reported[1]
        self._reported = now
        notes = []
        if killed > 0:
            notes.append(
                f"[the session's memory limit ({_size(self._bounds.memory)} for all its processes together) was "
                f"reached: the kernel killed {killed} of its processes]"
            )
        if refused > 0:
            notes.append(
                f"[the session's process limit ({self._bounds.pids} processes and threads) was reached: "
                f"{refused} fork(s) were refused]"
            )
        return "\n".join(notes) or None

    def pids(self) -> set[int]:
        """Every process in the cgroup (in any of its hierarchies)."""
        found: set[int] = set()
        for path in self._dirs.values():
            found.update(int(p) for p in _read(path / "cgroup.procs").split())
        return found

    def close(self) -> bool:
        """Kill every process in the cgroup and remove it; whether it is gone (a removal the
        kernel still refuses is left for :meth:`Cgroups.sweep`)."""
        if not self.made:
            return True
        self._kill_all()
        deadline = time.monotonic() + _KILL_SECONDS
        left = dict(self._dirs)
        while left:
            for controller, path in list(left.items()):
                try:
                    path.rmdir()
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        log.warning("cgroup.not_removed", cgroup=str(path), error=str(exc))
                        return False
                    continue
                del left[controller]
            if left:
                time.sleep(0.005)
        self.made = False
        return True

    def _kill_all(self) -> None:
        """SIGKILL everything in the cgroup, frozen first so that nothing forks meanwhile."""
        if self._version == 2:
            where = self._dirs["unified"]
            if (where / "cgroup.kill").exists():
                with contextlib.suppress(OSError):
                    _write(where / "cgroup.kill", "1")
                    self._wait_empty()
                    return
            freeze, frozen, thawed = where / "cgroup.freeze", "1", "0"
        else:
            freeze, frozen, thawed = self._dirs["freezer"] / "freezer.state", "FROZEN", "THAWED"
        deadline = time.monotonic() + _KILL_SECONDS
        while (targets := self.pids()) and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                _write(freeze, frozen)
                self._wait_frozen(freeze, frozen)
            for pid in self.pids() | targets:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                _write(freeze, thawed)  # a frozen task dies of its SIGKILL only once thawed
            self._wait_empty(0.5)

    def _wait_frozen(self, freeze: Path, frozen: str) -> None:
        """Until the kernel says every task of the cgroup is frozen (bounded)."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            if self._version == 1:
                done = _read(freeze).strip() == frozen
            else:
                done = _counter(_read(freeze.parent / "cgroup.events"), "frozen") == 1
            if done:
                return
            time.sleep(0.001)

    def _wait_empty(self, seconds: float = _KILL_SECONDS) -> None:
        deadline = time.monotonic() + seconds
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.002)


def _size(n: int) -> str:
    for unit, scale in (("GiB", _GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"


def detect(bounds: Bounds, *, proc_self: Path = Path("/proc/self")) -> Cgroups:
    """This worker's :class:`Cgroups`, ready for sessions (swept of gone workers' cgroups and
    probed with a real process); :class:`CgroupsUnusable` saying why when there are none."""
    found = find(_read(proc_self / "mountinfo"), _read(proc_self / "cgroup"))
    if isinstance(found, str):
        raise CgroupsUnusable(found)
    cgroups = Cgroups(found, bounds)
    cgroups.prepare()
    cgroups.sweep()
    cgroups.probe()
    return cgroups

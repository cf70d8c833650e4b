"""Attacks on the sandbox boundary, made the way a prompt-injected model would make them.

Each test runs commands through a real runtime worker process (``riverbed.workers
runtime``, default settings: namespaces, no network) and asserts that the attack fails and
that ordinary work in the same session still works.  Protections broken once to watch
these tests fail: ``--unshare-pid`` (the worker's environ and pid appear, the nohup job
survives a SIGKILLed worker), ``--unshare-net`` (Redis answers), the workspace-only mount
(another session's file is read), the uid drop (``id -u`` is 0), ``RLIMIT_NPROC`` (the
fork loop passes the limit).
"""

from __future__ import annotations

import base64
import errno
import functools
import io
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import anyio
import pytest

from riverbed import events
from riverbed.client.session import Bus
from riverbed.runtime import Limits, Runtime, Sandbox, SandboxUnavailable
from riverbed.runtime.paths import workspace_name
from riverbed.runtime.sandbox import NetworkSetupFailed, Outbound, probe
from tests.kit.workers import WorkerProcess, run_cell, run_command, standalone_worker  # noqa: F401  (standalone_worker: a fixture)

pytestmark = [pytest.mark.anyio, pytest.mark.security]

CANARY = "canary-" + os.urandom(6).hex()


@pytest.fixture
def worker(standalone_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    """A default runtime worker whose environment holds secrets a sandbox must not see."""
    return standalone_worker(
        "guarded",
        lease=2.0,
        extra_env={"OPENAI_API_KEY": CANARY, "RIVERBED_DATABASE_URL": f"postgresql://u:{CANARY}@127.0.0.1/x"},
    )


async def sh(bus: Bus, session: str, command: str, timeout: float = 20) -> events.CmdOutput:
    return await run_command(bus, session, command, timeout=timeout, wait=timeout + 15)


async def py(bus: Bus, session: str, code: str) -> events.PythonOutput:
    return await run_cell(bus, session, code, wait=40)


async def test_another_sessions_workspace_is_not_there(
    standalone_bus: Bus, worker: WorkerProcess, workspace: Path
) -> None:
    bus = standalone_bus
    await sh(bus, "victim", "echo top-secret > secret.txt")
    victim = workspace / workspace_name("victim")
    assert (victim / "secret.txt").read_text() == "top-secret\n"
    attack = await sh(
        bus,
        "attacker",
        f"cat ../{victim.name}/secret.txt {victim}/secret.txt; echo LISTING $(ls -a ..) END; "
        f"echo pwned > {victim}/secret.txt; ln -sf /etc/passwd {victim}/secret.txt; "
        # everywhere but the kernel's files and the read-only system and interpreter trees
        "grep -rsI top-secre[t] / --exclude-dir=proc --exclude-dir=sys --exclude-dir=usr --exclude-dir='python3*'; "
        "echo done",
        timeout=60,
    )
    assert "top-secret" not in attack.content
    listing = attack.content.split("LISTING", 1)[1].split("END", 1)[0].split()
    assert victim.name not in listing
    assert (victim / "secret.txt").read_text() == "top-secret\n"
    assert not (victim / "secret.txt").is_symlink()
    # the victim's own work goes on
    assert (await sh(bus, "victim", "cat secret.txt")).content == "top-secret\n"


async def test_the_worker_its_environment_and_its_services_are_out_of_reach(
    standalone_bus: Bus, worker: WorkerProcess, standalone_redis_url: str
) -> None:
    bus = standalone_bus
    port = urlparse(standalone_redis_url).port
    snoop = await sh(
        bus,
        "snoop",
        "cat /proc/$PPID/environ /proc/1/environ /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; "
        "ps -eo pid,user,args; env; ls / /run /tmp; cat /etc/shadow",
    )
    assert CANARY not in snoop.content
    assert "riverbed.workers" not in snoop.content
    assert str(worker.proc.pid) not in snoop.content.split()
    probe_redis = await sh(
        bus, "snoop", f"(exec 3<>/dev/tcp/127.0.0.1/{port} && echo REDIS-REACHED) 2>&1; echo exit=$?"
    )
    assert "REDIS-REACHED" not in probe_redis.content
    cell = await py(
        bus,
        "snoop",
        "import os, socket\n"
        "hits = []\n"
        f"for host in ('127.0.0.1', 'localhost'):\n"
        "    s = socket.socket()\n"
        "    s.settimeout(2)\n"
        f"    hits.append(s.connect_ex((host, {port})))\n"
        "    s.close()\n"
        f"print('env', {CANARY!r} in repr(dict(os.environ)), 'hits', hits)",
    )
    assert "env False" in cell.content
    hits = cell.content.split("hits", 1)[1]
    assert " 0" not in hits.replace(",", " ").replace("[", " ")  # connect_ex() == 0: connected


async def test_a_session_cannot_stop_or_kill_its_worker(standalone_bus: Bus, worker: WorkerProcess) -> None:
    bus = standalone_bus
    pid = worker.proc.pid
    await sh(bus, "bully", f"kill -STOP {pid}; kill -9 {pid}; kill -STOP $PPID; kill -9 -1; echo tried", timeout=10)
    assert worker.proc.poll() is None
    # the worker is not stopped: other sessions (and this one, in a new shell) are answered
    with anyio.fail_after(20):
        assert (await sh(bus, "bystander", "echo alive")).content == "alive\n"
        again = await sh(bus, "bully", "echo back")
    assert "back" in again.content


def _cmdline_count(needle: bytes) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    count += needle in fh.read()
            except OSError:
                pass
    return count


async def test_nothing_outlives_a_sigkilled_worker(standalone_bus: Bus, worker: WorkerProcess) -> None:
    bus = standalone_bus
    marks = [str(40_000 + int.from_bytes(os.urandom(2)) + i) for i in range(3)]  # this run's own sleeps
    needles = [f"sleep\x00{mark}\x00".encode() for mark in marks]
    await sh(bus, "leaver", f"nohup sleep {marks[0]} >/dev/null 2>&1 & setsid sleep {marks[1]} & disown; echo ok")
    await py(bus, "leaver", f"import subprocess; p = subprocess.Popen(['sleep', '{marks[2]}'], start_new_session=True)")
    assert [_cmdline_count(n) for n in needles] == [1, 1, 1]
    worker.proc.send_signal(signal.SIGKILL)
    worker.proc.wait(10)
    with anyio.fail_after(10):
        while any(_cmdline_count(n) for n in needles):
            await anyio.sleep(0.05)


async def test_the_sandbox_user_is_unprivileged_and_bounded(standalone_bus: Bus, worker: WorkerProcess) -> None:
    bus = standalone_bus
    who = await sh(bus, "who", "id -u; grep Cap /proc/self/status; cat /proc/self/status | grep NoNewPrivs")
    uid = int(who.content.split()[0])
    if os.geteuid() == 0:
        assert uid != 0
    assert "CapEff:\t0000000000000000" in who.content
    assert "NoNewPrivs:\t1" in who.content


async def test_ordinary_work_still_works(standalone_bus: Bus, worker: WorkerProcess, workspace: Path) -> None:
    bus = standalone_bus
    session = bus.session("dev")
    assert (await sh(bus, "dev", "mkdir -p src && cd src && export GREETING=hi && pwd")).exit_code == 0
    assert (await sh(bus, "dev", "echo $GREETING from $(basename $PWD)")).content == "hi from src\n"
    written = await session.act(events.FileWrite(path="src/app.py", content="print('app ran')\n"), timeout=20)
    assert isinstance(written, events.FileWritten)
    assert (await sh(bus, "dev", "python3 app.py && echo data > out.txt")).content == "app ran\n"
    assert (await sh(bus, "dev", "python app.py")).content == "app ran\n"  # models call `python`
    read = await session.act(events.FileRead(path="src/out.txt"), timeout=20)
    assert isinstance(read, events.FileContent)
    assert read.content == "data\n"
    edited = await session.act(
        events.FileEdit(command="str_replace", path="src/out.txt", old_str="data", new_str="more"), timeout=20
    )
    assert isinstance(edited, events.FileEdited)
    assert (await sh(bus, "dev", "cat out.txt; echo tmp > /tmp/t && cat /tmp/t")).content == "more\ntmp\n"
    # background jobs inside the session
    await sh(bus, "dev", "(sleep 1; echo later > bg.txt) & echo queued")
    with anyio.fail_after(15):
        while "later" not in (await sh(bus, "dev", "cat bg.txt 2>/dev/null; true")).content:
            await anyio.sleep(0.2)
    # a package installed into the workspace (no network: a local wheel) and imported by a cell
    wheel = base64.b64encode(_wheel()).decode()
    install = await sh(
        bus,
        "dev",
        f"cd /; cd ~ && echo {wheel} | base64 -d > tinypkg-1.0-py3-none-any.whl && "
        "python3 -m pip install -q --no-index --no-cache-dir --disable-pip-version-check --target site "
        "tinypkg-1.0-py3-none-any.whl && echo installed",
        timeout=90,
    )
    assert "installed" in install.content, install.content
    cell = await py(bus, "dev", "import sys; sys.path.insert(0, 'site'); import tinypkg; tinypkg.VALUE")
    assert cell.result == "42", cell
    x = await py(bus, "dev", "x = 7")
    assert x.exception is None
    assert (await py(bus, "dev", "x * 6")).result == "42"


def _wheel() -> bytes:
    """A minimal pure-Python wheel, built in memory."""
    files = {
        "tinypkg/__init__.py": "VALUE = 42\n",
        "tinypkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
        "tinypkg-1.0.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = "".join(f"{name},,\n" for name in files) + "tinypkg-1.0.dist-info/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
        zf.writestr("tinypkg-1.0.dist-info/RECORD", record)
    return buf.getvalue()


# --- without a worker: the kernel's limits and the refusal to run unconfined ---------------------


async def test_the_kernel_refuses_forks_past_the_process_limit(workspace: Path) -> None:
    rt = Runtime(workspace_root=workspace, limits=Limits(max_processes=12))
    try:
        spawner = (
            "import subprocess\nstarted = refused = 0\nfor _ in range(40):\n    try:\n"
            "        subprocess.Popen(['sleep', '331'])\n        started += 1\n"
            "    except OSError:\n        refused += 1\nprint(started, refused)"
        )
        out = await rt.execute("s", events.PythonRun(id=1, code=spawner, timeout=60))
        assert isinstance(out, events.PythonOutput)
        started, refused = map(int, out.content.split())
        assert refused > 0
        assert started < 12
        assert 0 < _cmdline_count(b"sleep\x00331") < 12
    finally:
        await rt.aclose()
    assert _cmdline_count(b"sleep\x00331") == 0


def test_a_sandbox_that_cannot_be_built_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "bwrap").write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
    (fake / "bwrap").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    from riverbed.runtime import sandbox as module  # noqa: PLC0415

    module._which.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="could not be started"):
            probe(Sandbox(), tmp_path / "ws")
    finally:
        monkeypatch.undo()
        module._which.cache_clear()
    probe(Sandbox(), tmp_path / "ws")  # the real one works


def test_a_worker_refuses_to_start_without_its_sandbox(
    standalone_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "bwrap").write_text("#!/bin/sh\nexit 1\n")
    (fake / "bwrap").chmod(0o755)
    proc = standalone_worker("refuser", ready_within=None, extra_env={"PATH": f"{fake}:{os.environ['PATH']}"})
    try:
        assert proc.proc.wait(30) != 0
    finally:
        proc.close()
    text = proc.log_path.read_text()
    assert "RIVERBED_SANDBOX=process" in text
    assert "Traceback" not in text


@pytest.fixture
def cli_status(standalone_redis_url: str, prefix: str) -> Callable[[], str]:
    def status() -> str:
        env = {**os.environ, "RIVERBED_REDIS_URL": standalone_redis_url, "RIVERBED_PREFIX": prefix}
        done = subprocess.run(
            [sys.executable, "-m", "riverbed.cli", "status", "--json"],
            env=env,
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.decode()

    return status


@pytest.fixture
def process_worker(standalone_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    return standalone_worker("unconfined", extra_env={"RIVERBED_SANDBOX": "process"})


async def test_process_mode_is_explicit_warned_and_shown(
    standalone_bus: Bus, process_worker: WorkerProcess, cli_status: Callable[[], str]
) -> None:
    assert (await sh(standalone_bus, "p", "echo ok")).content == "ok\n"
    assert "sandbox.unconfined" in process_worker.log_path.read_text()
    status = cli_status()
    assert "process/host" in status, status


async def test_outbound_network_reaches_out_but_not_this_hosts_services(
    workspace: Path, standalone_redis_url: str
) -> None:
    if shutil.which("slirp4netns") is None:
        pytest.skip("slirp4netns is not installed (.ci/run installs it)")
    port = urlparse(standalone_redis_url).port
    rt = Runtime(workspace_root=workspace, sandbox=Sandbox(network="outbound"))
    try:
        out = await rt.execute(
            "s",
            events.CmdRun(
                id=1,
                command="cat /proc/net/route; "
                f"for host in 127.0.0.1 10.0.2.2; do (exec 3<>/dev/tcp/$host/{port} && echo REACHED $host) 2>&1; done",
                timeout=20,
                blocking=True,
            ),
        )
        assert isinstance(out, events.CmdOutput)
        assert "tap0\t00000000\t0202000A" in out.content  # a default route through slirp4netns's gateway
        assert "REACHED" not in out.content
        cell = await rt.execute(
            "s", events.PythonRun(id=2, code=f"import socket\nsocket.socket().connect_ex(('10.0.2.2', {port}))")
        )
        assert isinstance(cell, events.PythonOutput)
        assert cell.result not in (None, "0")
    finally:
        await rt.aclose()
    assert not _our_slirp4netns()


async def test_outbound_sandboxes_started_at_once_under_load_get_their_network_on_the_first_try(
    workspace: Path,
) -> None:
    """Many outbound sandboxes start at once, CPU hogs running, each the way the shell and the
    Python driver start theirs (a link, the wrapped command, ``Link.attach``): every one gets
    its network on the first try.  Each is started and attached in a thread of its own, with
    no hop in between, where the race with bubblewrap's loopback was lost most: when
    slirp4netns started as soon as the sandbox's pid was known, about one sandbox in ten lost
    it here ("loopback: Failed RTM_NEWADDR", or gone before its network was up).  Run by a
    non-root user, about one in three failed then, most because slirp4netns came after
    bubblewrap's nested user namespace and could not join the network namespace."""
    if shutil.which("slirp4netns") is None:
        pytest.skip("slirp4netns is not installed (.ci/run installs it)")
    sandbox = Sandbox(network="outbound")
    lost: list[str] = []

    def start(n: int) -> None:
        home = workspace / f"s{n}"
        sandbox.prepare_processes(home)
        link = sandbox.link()
        assert link is not None
        argv = sandbox.wrap(["/bin/sh", "-c", "grep -c tap0 /proc/net/route"], workspace=home, link=link)
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=link.child_fds
        )
        try:
            try:
                link.attach()
            except NetworkSetupFailed as exc:
                failed = str(exc)
            else:
                failed = ""
            out, err = proc.communicate(timeout=30)
        finally:
            link.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if failed or out != b"2\n":  # tap0's default route and its network's
            lost.append(failed or err.decode(errors="replace").strip())

    at_once = anyio.CapacityLimiter(16)
    hogs = [await anyio.open_process([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        async with anyio.create_task_group() as tg:
            for n in range(64):
                tg.start_soon(functools.partial(anyio.to_thread.run_sync, start, n, limiter=at_once))
    finally:
        for hog in hogs:
            hog.kill()
            await hog.wait()
    assert not lost, f"{len(lost)} of 64 sandboxes lost their network's setup: {lost[:3]}"


async def _runs_a_command_and_a_cell(rt: Runtime, before_each: Callable[[str], None]) -> None:
    """A session of ``rt`` runs a shell command and a Python cell (then ``rt`` is closed);
    ``before_each`` is told which process ("shell", then "python") the next action starts."""
    try:
        before_each("shell")
        out = await rt.execute("s", events.CmdRun(id=1, command="echo up", timeout=20, blocking=True))
        assert isinstance(out, events.CmdOutput), out
        assert out.content == "up\n"
        before_each("python")
        cell = await rt.execute("s", events.PythonRun(id=2, code="6 * 7"))
        assert isinstance(cell, events.PythonOutput), cell
        assert cell.result == "42"
    finally:
        await rt.aclose()


def test_the_network_set_up_is_the_reported_sandboxs_even_if_its_pid_went_to_another_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """slirp4netns is given the sandbox's namespace by an fd, opened by the pid that bubblewrap
    reported while that process is pinned: a sandbox gone meanwhile, its pid given to another
    process, is refused rather than that process's namespace getting the network."""
    from riverbed.runtime import sandbox as sandbox_module  # noqa: PLC0415

    sandboxed = subprocess.Popen(["sleep", "30"])  # (stands for the sandbox bubblewrap reported)
    other = subprocess.Popen(["sleep", "30"])  # (stands for a process given its pid later)
    try:
        net = sandbox_module._network_of(sandboxed.pid)
        try:
            assert os.fstat(net).st_ino == os.stat(f"/proc/{sandboxed.pid}/ns/net").st_ino
        finally:
            os.close(net)
        opened = os.open

        def reused(path: Any, *args: Any, **kwargs: Any) -> int:
            if path == f"/proc/{sandboxed.pid}/ns/net":
                sandboxed.kill()  # the sandbox dies and its pid names another process now
                sandboxed.wait()
                path = f"/proc/{other.pid}/ns/net"
            return opened(path, *args, **kwargs)

        monkeypatch.setattr(sandbox_module.os, "open", reused)
        with pytest.raises(NetworkSetupFailed, match="exited while its network was set up"):
            sandbox_module._network_of(sandboxed.pid)
        monkeypatch.undo()

        def refused(pid: int) -> int:
            raise OSError(errno.ENOSYS, "Function not implemented")

        monkeypatch.setattr(sandbox_module.os, "pidfd_open", refused)  # (a host whose seccomp policy refuses pidfds)
        net = sandbox_module._network_of(other.pid)
        try:
            assert os.fstat(net).st_ino == os.stat(f"/proc/{other.pid}/ns/net").st_ino
        finally:
            os.close(net)
    finally:
        for proc in (sandboxed, other):
            proc.kill()
            proc.wait()


async def test_a_sandbox_that_exits_while_its_network_is_set_up_is_started_once_more(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under load, bubblewrap may exit while slirp4netns configures its namespace: the shell and
    the Python driver then start a fresh sandbox, and the action runs."""
    if shutil.which("slirp4netns") is None:
        pytest.skip("slirp4netns is not installed (.ci/run installs it)")
    attach = Outbound.attach
    attempts: dict[str, list[str]] = {}  # each process's tries, in order
    starting: list[str] = []  # the process the next action starts, while its first try is to fail

    def flaky(self: Outbound, timeout: float = 10.0) -> None:
        # The first try of the shell, then the first of the Python driver: armed per action, so
        # a real race lost on a busy machine (a further try) shifts nothing.
        if starting:
            attempts[starting.pop()] = ["failed"]
            raise NetworkSetupFailed(errno.EPIPE, "the sandbox exited while its network was set up")
        tries = list(attempts.values())[-1]  # (the process this action starts)
        try:
            attach(self, timeout)
        except NetworkSetupFailed:
            tries.append("raced")  # (the real race, lost)
            raise
        tries.append("attached")

    monkeypatch.setattr(Outbound, "attach", flaky)
    rt = Runtime(workspace_root=workspace, sandbox=Sandbox(network="outbound"))
    await _runs_a_command_and_a_cell(rt, starting.append)
    # each forced failure was followed by a fresh sandbox (more when a real race was lost too)
    for process in ("shell", "python"):
        tries = attempts[process]
        assert (tries[0], tries.count("failed"), tries[-1]) == ("failed", 1, "attached"), attempts
    assert not _our_slirp4netns()


async def test_a_sandbox_whose_loopback_setup_failed_is_started_once_more(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same race caught earlier: bubblewrap says it failed to bring up the namespace's
    loopback and exits.  The shell and the Python driver start a fresh sandbox, and the
    action runs; any other start failure is the action's, with what the sandbox said."""
    wrap = Sandbox.wrap
    attempts: list[str] = []
    complaint = "bwrap: loopback: Failed RTM_NEWADDR: Operation not permitted"

    starting: list[str] = []  # armed before each action: its process's first sandbox fails

    def flaky(self: Sandbox, argv: Sequence[str], **kw: Any) -> list[str]:
        attempts.append("failed" if starting else "started")
        if starting:  # the first sandbox of the shell, then of the Python driver
            starting.pop()
            return ["/bin/sh", "-c", f"echo '{complaint}' >&2; exit 1"]
        return wrap(self, argv, **kw)

    monkeypatch.setattr(Sandbox, "wrap", flaky)
    rt = Runtime(workspace_root=workspace, sandbox=Sandbox())
    await _runs_a_command_and_a_cell(rt, starting.append)
    # each forced failure was followed by a fresh sandbox (more when a real race was lost too)
    assert (attempts[:2], attempts.count("failed"), attempts[-1]) == (["failed", "started"], 2, "started"), attempts

    def broken(self: Sandbox, argv: Sequence[str], **kw: Any) -> list[str]:
        return ["/bin/sh", "-c", "echo 'bwrap: No permissions to create new namespace' >&2; exit 1"]

    monkeypatch.setattr(Sandbox, "wrap", broken)
    rt = Runtime(workspace_root=workspace / "other", sandbox=Sandbox())
    try:
        out = await rt.execute("t", events.CmdRun(id=1, command="echo up", timeout=20, blocking=True))
    finally:
        await rt.aclose()
    assert isinstance(out, events.Error), out
    assert out.reason == "sandbox_unavailable"
    assert out.content.endswith("bash did not start in time: bwrap: No permissions to create new namespace"), out


async def test_a_loopback_race_lost_on_every_try_is_the_actions_retryable_error(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two races lost in a row start a third sandbox; losing all three is the action's
    retryable ``sandbox_unavailable`` with what bubblewrap said, never a hang or a crash."""
    wrap = Sandbox.wrap
    complaint = "bwrap: loopback: Failed RTM_NEWADDR: No child processes"
    losses: list[int] = [2]  # races to lose before a sandbox starts

    def flaky(self: Sandbox, argv: Sequence[str], **kw: Any) -> list[str]:
        if losses[0] > 0:
            losses[0] -= 1
            return ["/bin/sh", "-c", f"echo '{complaint}' >&2; exit 1"]
        return wrap(self, argv, **kw)

    monkeypatch.setattr(Sandbox, "wrap", flaky)
    rt = Runtime(workspace_root=workspace, sandbox=Sandbox())
    try:
        out = await rt.execute("s", events.CmdRun(id=1, command="echo up", timeout=20, blocking=True))
        assert isinstance(out, events.CmdOutput), out
        assert losses == [0]
        losses[0] = 3
        cell = await rt.execute("s", events.PythonRun(id=2, code="6 * 7"))
    finally:
        await rt.aclose()
    assert isinstance(cell, events.Error), cell
    assert (cell.reason, cell.retryable) == ("sandbox_unavailable", True)
    assert complaint in cell.content
    assert losses == [0]


def _our_slirp4netns() -> list[str]:
    """The pids of the slirp4netns processes this test process started that still run (the
    suite's other processes run outbound sandboxes of their own at the same time)."""
    return [p for p in os.listdir("/proc") if p.isdigit() and _comm(p) == "slirp4netns" and _parent(p) == os.getpid()]


def _parent(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return int(fh.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _comm(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        return ""


@pytest.fixture
def worker_all(standalone_worker: Callable[..., WorkerProcess], database_url: str) -> WorkerProcess:
    """Every role in one default worker (`riverbed worker all`), with secrets in its environment."""
    return standalone_worker(
        "all-roles",
        ["all"],
        ready_within=60,
        lease=2.0,
        extra_env={"OPENAI_API_KEY": CANARY, "RIVERBED_DATABASE_URL": database_url},
    )


async def test_workspace_context_cannot_be_pointed_at_the_memory_workers_secrets(
    standalone_bus: Bus, worker_all: WorkerProcess
) -> None:
    """A command links AGENTS.md (and a microagent) to the worker's own environment and to a
    file outside; the memory role's workspace context must bring back none of it."""
    bus = standalone_bus
    planted = await sh(
        bus,
        "plant",
        "ln -s /proc/self/environ AGENTS.md && mkdir -p .openhands/microagents && "
        "ln -s /proc/1/environ .openhands/microagents/leak.md && ln -s /etc/hostname .git && echo planted",
    )
    assert "planted" in planted.content
    answer = await bus.session("plant").act(events.Recall(recall_type="workspace_context"), timeout=40)
    assert isinstance(answer, events.RecallResult), answer
    text = events.encode_json(answer).decode()
    assert CANARY not in text
    assert "RIVERBED_" not in text
    assert "OPENAI_API_KEY" not in text

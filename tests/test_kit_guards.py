"""The suite's own guards, attacked: bounds that follow the load, a timeout that fails one test
and not the run, a readiness wait that reports a dead worker at once, and the sweep that ends
what an aborted run left running (docs/testing.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from riverbed import services
from tests.kit import leftovers
from tests.kit.patience import ENV, MOST, patience, within
from tests.kit.workers import WorkerProcess

REPO = Path(__file__).resolve().parent.parent


def test_bounds_follow_the_load_or_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert 1.0 <= patience() <= MOST
    monkeypatch.setenv(ENV, "2.5")
    assert within(10) == 25.0
    for bad in ("soon", "0", "-1"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=ENV):
            patience()


def test_a_worker_that_exits_is_reported_at_once_whatever_the_bound(
    standalone_redis_url: str, prefix: str, workspace: Path, tmp_path: Path
) -> None:
    worker = WorkerProcess(
        ["runtime"],
        name="doomed",
        redis_url=standalone_redis_url,
        prefix=prefix,
        workspace=workspace,
        extra_env={"RIVERBED_SANDBOX": "nonsense"},
        log_dir=tmp_path,
    )
    try:
        asked = time.monotonic()
        with pytest.raises(RuntimeError, match="exited with code 1 before it was ready") as failed:
            worker.wait_ready(timeout=3600)  # an hour: only the exit can end the wait early
        assert time.monotonic() - asked < within(60)
        assert "RIVERBED_SANDBOX='nonsense'" in str(failed.value)  # with the worker's own words
    finally:
        worker.close()


def test_the_sweep_ends_what_belongs_to_a_run_and_nothing_else(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    _url, redis_pid = services.start_redis(ours / "redis", appendonly=False)  # daemonised: runs in its dir
    marked = subprocess.Popen(["sleep", "300.5171"], env={**os.environ, leftovers.MARK: str(ours / "gw7")})
    other = subprocess.Popen(["sleep", "300.5172"], env={**os.environ, leftovers.MARK: str(theirs)})
    try:
        ended = leftovers.sweep([ours])
        assert {left.pid for left in ended} == {redis_pid, marked.pid}
        assert marked.wait(10) == -signal.SIGKILL
        assert other.poll() is None  # another run's
        lines = leftovers.report(ended)
        assert any("redis-server" in line and f"runs in {ours / 'redis'}" in line for line in lines), lines
        assert any("sleep 300.5171" in line and "started by this session" in line for line in lines), lines
        assert leftovers.find([ours]) == []
    finally:
        for proc in (marked, other):
            proc.kill()
            proc.wait(10)
        services.stop_redis(redis_pid)


@pytest.mark.slow
def test_a_test_past_its_timeout_fails_alone_and_the_run_reaches_its_summary(tmp_path: Path) -> None:
    """The real configuration (pyproject.toml, tests/conftest.py) under pytest-xdist, with the
    bounds scaled down: an async test stuck in an await fails at its timeout, a sync one stuck in
    a call is stopped past it, and the run goes on and ends with its summary."""
    (tmp_path / "test_stuck.py").write_text(
        "import time\n"
        "import anyio\n"
        "import pytest\n\n"
        "@pytest.mark.anyio\n"
        "@pytest.mark.timeout(20)\n"
        "async def test_stuck_in_an_await():\n"
        "    await anyio.sleep(600)\n\n"
        "@pytest.mark.timeout(20)\n"
        "def test_stuck_in_a_call():\n"
        "    time.sleep(600)\n\n"
        "def test_fine():\n"
        "    pass\n"
    )
    # the timeout: 20 s x 0.05 = 1 s; the hard stop 30 s x 0.05 = 1.5 s later (both scaled by this
    # machine's load now: a starved event loop must not let the hard stop come first)
    env = {**os.environ, ENV: f"{0.05 * patience():.3f}", "COLUMNS": "300"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(REPO),
         "-p", "tests.conftest", "-p", "no:cacheprovider", "-n", "1", str(tmp_path / "test_stuck.py")],
        cwd=REPO, env=env, capture_output=True, timeout=within(120), check=False,
    )  # fmt: skip
    out = done.stdout.decode(errors="replace")
    assert done.returncode == 1, out[-3000:]
    assert "INTERNALERROR" not in out
    assert "2 failed, 1 passed" in out, out[-3000:]
    assert "FAILED ::test_stuck_in_an_await[asyncio] - TimeoutError: the test ran past its timeout" in out, out[-3000:]
    assert "FAILED ::test_stuck_in_a_call - worker 'gw0' crashed while running" in out


@pytest.mark.slow
def test_a_run_ended_by_sigterm_leaves_nothing_running(tmp_path: Path) -> None:
    """The real configuration under pytest-xdist: a run killed by SIGTERM (a CI job's time limit)
    while a test's process runs ends as Ctrl-C does, and the sweep ends that process."""
    (tmp_path / "test_long.py").write_text(
        "import subprocess\n"
        "import time\n\n"
        "def test_starts_a_process_and_waits():\n"
        "    subprocess.Popen(['sleep', '300.7391'])\n"
        "    time.sleep(600)\n"
    )
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(REPO),
         "-p", "tests.conftest", "-p", "no:cacheprovider", "-n", "1", str(tmp_path / "test_long.py")],
        cwd=REPO, env={**os.environ, "COLUMNS": "300"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + within(60)
        while not _running("sleep 300.7391"):
            assert time.monotonic() < deadline, "the inner test never started its process"
            assert inner.poll() is None, inner.communicate()[0].decode(errors="replace")[-3000:]
            time.sleep(0.1)
        inner.send_signal(signal.SIGTERM)
        out = inner.communicate(timeout=within(60))[0].decode(errors="replace")
    finally:
        inner.kill()
        inner.wait(10)
    assert not _running("sleep 300.7391"), out[-3000:]
    assert "processes this session left running, now ended" in out, out[-3000:]
    assert "sleep 300.7391" in out, out[-3000:]


def _running(command: str) -> bool:
    """Whether a process of this machine runs exactly ``command``."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().replace(b"\0", b" ").strip() == command.encode():
                        return True
            except OSError:
                continue
    return False

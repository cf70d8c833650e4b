"""Nothing left running by a failure: a ``riverbed demo`` that stops early stops the Redis and
Postgres it started, and ``riverbed services down`` stops what runs in its directory even when the
state file says nothing does.  Real ``riverbed`` processes, real services."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kit import leftovers
from tests.kit.cli import riverbed_command, run, run_process
from tests.kit.patience import within


@pytest.fixture
def services_dir(tmp_path: Path) -> Iterator[Path]:
    """A services directory with a short path (the embedded Postgres's socket lives in it), in
    this test process's own directory (so a run that stops before the test's end sweeps it)."""
    where = Path(os.environ[leftovers.MARK]) / tmp_path.name
    yield where
    run({**os.environ, "RIVERBED_SERVICES_DIR": str(where)}, "services", "down", "--dir", str(where))


@pytest.fixture
def demo_env(offline_env: dict[str, str], services_dir: Path, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in offline_env.items() if k != "RIVERBED_REDIS_URL"}
    env.update(RIVERBED_SERVICES_DIR=str(services_dir), RIVERBED_WORKSPACE=str(tmp_path / "ws"))
    return env


def running_in(where: Path) -> list[leftovers.Leftover]:
    """The processes that run in ``where`` (a redis-server, a Postgres and its children)."""
    return leftovers.find([where])


@pytest.mark.slow
def test_a_demo_that_fails_midway_stops_the_services_it_started(demo_env: dict[str, str], services_dir: Path) -> None:
    """The runtime role cannot build its sandbox (a bubblewrap that fails): the demo ends with
    one sentence, after it had started Redis and Postgres, and stops them."""
    done = run_process({**demo_env, "RIVERBED_BWRAP": "/bin/false"}, "demo", timeout=120)
    said = done.stderr.decode()
    assert done.returncode == 2, said
    assert "starting the embedded services" in said  # (they were started)
    assert f"the demo stopped early: stopped the Redis and Postgres it started in {services_dir}" in said
    assert "a namespaces sandbox could not be started" in said
    assert "Traceback" not in said
    assert running_in(services_dir) == []


@pytest.mark.slow
def test_a_demo_stopped_by_ctrl_c_stops_the_services_it_started(
    demo_env: dict[str, str], services_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "demo.out"
    with out.open("wb") as sink:
        demo = subprocess.Popen(
            [*riverbed_command(), "demo"], env={**demo_env, "RIVERBED_SANDBOX": "process"}, stdout=sink, stderr=sink
        )
    try:
        deadline = time.monotonic() + within(90)
        while "▸ session" not in out.read_text(errors="replace"):  # the services are up, the demo runs
            assert demo.poll() is None, out.read_text(errors="replace")
            assert time.monotonic() < deadline, out.read_text(errors="replace")
            time.sleep(0.1)
        assert running_in(services_dir) != []
        demo.send_signal(signal.SIGINT)
        assert demo.wait(within(60)) == 130, out.read_text(errors="replace")
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(10)
    said = out.read_text(errors="replace")
    assert "the demo stopped early: stopped the Redis and Postgres it started" in said, said
    assert running_in(services_dir) == []


@pytest.mark.slow
def test_services_down_stops_what_runs_in_its_directory_whatever_its_state_file_says(
    offline_env: dict[str, str], services_dir: Path
) -> None:
    env = {**offline_env, "RIVERBED_SERVICES_DIR": str(services_dir)}
    up = run_process(env, "services", "up", "--dir", str(services_dir), timeout=60)
    assert up.returncode == 0, up.stderr.decode()
    assert running_in(services_dir) != []
    (services_dir / "services.json").unlink()  # (as when `up` was killed before it wrote it)
    down = run(env, "services", "down", "--dir", str(services_dir))
    assert down.returncode == 0, down.stderr.decode()
    assert f"stopped the services in {services_dir} (Redis and Postgres)" in down.stderr.decode()
    assert running_in(services_dir) == []
    again = run(env, "services", "down", "--dir", str(services_dir))
    assert f"no services were running in {services_dir}" in again.stderr.decode()

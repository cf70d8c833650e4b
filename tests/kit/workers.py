"""Real worker processes for tests: start, wait until ready, kill, stop; the fixtures that close
them; commands and cells acted through a runtime worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis

from riverbed import events
from riverbed.bus.keys import Keys
from riverbed.client.session import Bus
from tests.kit.patience import within

READY = 20.0
"""Seconds a worker process takes at most to register on a quiet machine (scaled by the load)."""


def sync_client(url: str) -> redis.Redis | redis.RedisCluster:
    """A blocking client for ``url``: a cluster client when the server is a Redis Cluster node."""
    client = redis.Redis.from_url(url)
    try:
        if not client.info("cluster").get("cluster_enabled"):
            return client
    except BaseException:
        client.close()
        raise
    client.close()
    return redis.RedisCluster.from_url(url)


class WorkerProcess:
    def __init__(
        self,
        roles: list[str],
        *,
        name: str,
        redis_url: str,
        prefix: str,
        workspace: Path,
        lease: float = 1.0,
        extra_env: dict[str, str] | None = None,
        log_dir: Path | None = None,
        wrapper: Sequence[str] = (),
    ) -> None:
        """``wrapper``: a command line that the worker's is appended to, and that ends by exec-ing it."""
        self.name = name
        self.redis_url = redis_url
        self.keys = Keys(prefix)
        env = {
            **os.environ,
            "RIVERBED_REDIS_URL": redis_url,
            "RIVERBED_PREFIX": prefix,
            "RIVERBED_WORKSPACE": str(workspace),
            "RIVERBED_LEASE_SECONDS": str(lease),
            "RIVERBED_DRAIN_SECONDS": "5",
            "RIVERBED_LOG_FORMAT": "json",
            **(extra_env or {}),
        }
        log_path = (log_dir or workspace) / f"{name}.log"
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "riverbed.workers", *roles, "--name", name],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = READY) -> None:
        """Until the worker has registered; ``timeout`` is scaled by the machine's load
        (:func:`~tests.kit.patience.within`).  A worker that exits meanwhile is reported at once."""
        bound = within(timeout)
        client = sync_client(self.redis_url)
        try:
            deadline = time.monotonic() + bound
            while time.monotonic() < deadline:
                if client.exists(self.keys.worker(self.name)):
                    return
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"worker {self.name} exited with code {self.proc.returncode} before it was ready:\n"
                        f"{self.log_path.read_text()[-3000:]}"
                    )
                time.sleep(0.05)
        finally:
            client.close()
        raise RuntimeError(
            f"worker {self.name} not ready in {bound:.1f}s ({timeout:g}s on a quiet machine):\n"
            f"{self.log_path.read_text()[-3000:]}"
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(within(timeout))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


async def ready(*started: WorkerProcess) -> None:
    """Until each of ``started`` has registered (off the event loop: the wait blocks)."""
    for worker in started:
        await anyio.to_thread.run_sync(worker.wait_ready)


def close_all(started: Sequence[WorkerProcess]) -> None:
    for worker in started:
        worker.close()


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    """The worker processes a test starts; those still running at its end are killed."""
    started: list[WorkerProcess] = []
    yield started
    close_all(started)


def starter(
    started: list[WorkerProcess], redis_url: str, prefix: str, workspace: Path, log_dir: Path
) -> Callable[..., WorkerProcess]:
    """``start(name, roles, **options)``: a worker process on ``redis_url`` with ``prefix`` and
    ``workspace``, its log in ``log_dir`` (``options`` as :class:`WorkerProcess` takes them),
    added to ``started``."""

    def start(name: str, roles: Sequence[str], **options: Any) -> WorkerProcess:
        worker = WorkerProcess(
            list(roles), name=name, redis_url=redis_url, prefix=prefix, workspace=workspace, log_dir=log_dir, **options
        )
        started.append(worker)
        return worker

    return start


Spawn = Callable[..., WorkerProcess]


@pytest.fixture
def spawn(workers: list[WorkerProcess], redis_url: str, prefix: str, workspace: Path, tmp_path: Path) -> Spawn:
    """``spawn(name, roles, lease=1.0, **env)``: a worker process on the suite's Redis with this
    test's prefix and workspace, its log in ``tmp_path``, added to ``workers`` (which a module
    may override to clean up more)."""
    start = starter(workers, redis_url, prefix, workspace, tmp_path)

    def spawn(name: str, roles: list[str], *, lease: float = 1.0, **env: str) -> WorkerProcess:
        return start(name, roles, lease=lease, extra_env=env)

    return spawn


@pytest.fixture
def standalone_worker(
    standalone_redis_url: str, prefix: str, workspace: Path, tmp_path: Path
) -> Iterator[Callable[..., WorkerProcess]]:
    """``standalone_worker(name, roles=["runtime"], ready_within=READY, **options)``: a worker
    process on the standalone Redis with this test's prefix and workspace, its log in
    ``tmp_path``, registered when it is returned unless ``ready_within`` is None (``options``
    as :class:`WorkerProcess` takes them); each is closed at the end of the test."""
    started: list[WorkerProcess] = []
    start = starter(started, standalone_redis_url, prefix, workspace, tmp_path)

    def start_ready(
        name: str, roles: Sequence[str] = ("runtime",), *, ready_within: float | None = READY, **options: Any
    ) -> WorkerProcess:
        worker = start(name, roles, **options)
        if ready_within is not None:
            worker.wait_ready(ready_within)
        return worker

    yield start_ready
    close_all(started)


async def run_command(bus: Bus, session: str, command: str, *, timeout: float, wait: float) -> events.CmdOutput:
    """``command`` run blocking in ``session``'s shell with its own ``timeout``; its output,
    which must come within ``wait``."""
    action = events.CmdRun(command=command, timeout=timeout, blocking=True)
    out = await bus.session(session).act(action, timeout=within(wait))
    assert isinstance(out, events.CmdOutput), out
    return out


async def run_cell(bus: Bus, session: str, code: str, *, wait: float) -> events.PythonOutput:
    """``code`` run as a cell of ``session``'s Python; its output, which must come within ``wait``."""
    out = await bus.session(session).act(events.PythonRun(code=code), timeout=within(wait))
    assert isinstance(out, events.PythonOutput), out
    return out

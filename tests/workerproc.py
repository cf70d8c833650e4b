"""Real worker processes for tests: start, wait until ready, kill, stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from riverbed.bus.keys import Keys


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

    def wait_ready(self, timeout: float = 20.0) -> None:
        client = sync_client(self.redis_url)
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if client.exists(self.keys.worker(self.name)):
                    return
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker {self.name} exited early:\n{self.log_path.read_text()[-3000:]}")
                time.sleep(0.05)
        finally:
            client.close()
        raise RuntimeError(f"worker {self.name} not ready in {timeout}s:\n{self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()

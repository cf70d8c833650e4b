"""The HTTP server for tests: in-process on a free port, or ``riverbed serve`` as a subprocess."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import httpx

from riverbed.client.session import Bus
from riverbed.memory.recall import Memory
from riverbed.serve import Api, KeyStore, ServeConfig, serve
from tests.kit.cli import riverbed_command
from tests.kit.patience import within


@contextlib.asynccontextmanager
async def running(bus: Bus, config: ServeConfig | None = None, *, memory: Memory | None = None) -> AsyncIterator[str]:
    """``riverbed.serve`` in this event loop on a free port; yields its base URL."""
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve, Api(bus, config, memory=memory), "127.0.0.1", 0)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            tg.cancel_scope.cancel()


async def new_key(bus: Bus, tenant: str | None, *, admin: bool = False) -> str:
    key, _record = await KeyStore(bus.redis, bus.keys, bus.url).create(tenant, admin=admin)
    return key


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@contextlib.contextmanager
def serve_process(
    redis_url: str, prefix: str, log_path: Path, extra_env: dict[str, str] | None = None
) -> Iterator[str]:
    """``riverbed serve --port 0`` as a subprocess; yields its base URL once it listens."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RIVERBED_")}
    env.update(RIVERBED_REDIS_URL=redis_url, RIVERBED_PREFIX=prefix, RIVERBED_LOG_FORMAT="json", **(extra_env or {}))
    with log_path.open("wb") as log:
        proc = subprocess.Popen([*riverbed_command(), "serve", "--port", "0"], env=env, stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + within(20)
            while time.monotonic() < deadline:
                found = re.search(rb"serving (http://\S+)", log_path.read_bytes())
                if found:
                    yield found.group(1).decode().rstrip(" (")
                    return
                if proc.poll() is not None:
                    break
                time.sleep(0.05)
            raise RuntimeError(f"riverbed serve did not start:\n{log_path.read_text()[-3000:]}")
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


PROBLEM = "application/problem+json"


def assert_problem(response: httpx.Response, status: int, *words: str) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    body = response.json()
    assert body["status"] == status
    assert body["title"]
    detail = str(body["detail"])
    assert "Traceback" not in detail
    for word in words:
        assert word in detail, detail
    return dict(body)

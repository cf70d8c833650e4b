"""Shared fixtures: real services on private ports, one key prefix (and schema) per test."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import riverbed
from riverbed import services
from riverbed.agent.client import Bus


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def service_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="riverbed-test-"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_url(service_root: Path) -> Iterator[str]:
    """A private redis-server for the whole run (or RIVERBED_TEST_REDIS_URL)."""
    given = os.environ.get("RIVERBED_TEST_REDIS_URL")
    if given:
        yield given
        return
    url, pid = services.start_redis(service_root / "redis", appendonly=False)
    yield url
    services.stop_redis(pid)


@pytest.fixture(scope="session")
def redis_cluster_url(service_root: Path) -> Iterator[str]:
    """A private 3-master Redis Cluster for the whole run (or RIVERBED_TEST_REDIS_CLUSTER_URL)."""
    given = os.environ.get("RIVERBED_TEST_REDIS_CLUSTER_URL")
    if given:
        yield given
        return
    url, pids = services.start_redis_cluster(service_root / "redis-cluster", masters=3)
    yield url
    services.stop_redis_cluster(pids)


@pytest.fixture(params=["standalone", "cluster"])
def backend(request: pytest.FixtureRequest) -> str:
    """The Redis deployment a contract test runs against."""
    name: str = request.param
    return name


@pytest.fixture
def bus_url(backend: str, request: pytest.FixtureRequest) -> str:
    """The URL of the Redis of ``backend``: contract tests run once per backend."""
    url: str = request.getfixturevalue("redis_url" if backend == "standalone" else "redis_cluster_url")
    return url


@pytest.fixture(scope="session")
def database_url(service_root: Path) -> Iterator[str]:
    """A private embedded Postgres with pgvector for the whole run (or RIVERBED_TEST_DATABASE_URL)."""
    given = os.environ.get("RIVERBED_TEST_DATABASE_URL")
    if given:
        yield given
        return
    pgdata = service_root / "pg"
    url = services.start_postgres(pgdata)
    yield url
    services.stop_postgres(pgdata)


@pytest.fixture
def prefix() -> str:
    """A key prefix (and Postgres schema name) of this test's own."""
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    root = tmp_path / "workspace"
    root.mkdir()
    return root


@pytest.fixture
async def bus(redis_url: str, prefix: str) -> AsyncIterator[Bus]:
    """A bus on the standalone test Redis under this test's own prefix (contract tests override it)."""
    async with riverbed.connect(redis_url, prefix=prefix) as bus:
        yield bus

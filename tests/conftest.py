"""Shared fixtures: real services on private ports, one key prefix (and schema) per test."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import structlog

import riverbed
from riverbed import services
from riverbed.client.session import Bus
from riverbed.logs import processors
from tests.kit import guards

if TYPE_CHECKING:
    from riverbed.memory.embedders import LocalEmbedder


def _cache_bytecode() -> None:
    """Let the tests' Python processes keep their compiled modules, in a directory of their own.

    A worker, a ``riverbed`` command or ``riverbed serve`` that a test starts compiles riverbed's
    modules again when nothing may write their bytecode (``PYTHONDONTWRITEBYTECODE``, set in many
    container images): about a third of a second of CPU a process, and a suite starts some
    three hundred.  With it set, the processes this run starts (its xdist workers too) write
    their bytecode under a directory of the temp dir (``PYTHONPYCACHEPREFIX``) instead, never in
    the source tree, and read it there."""
    if "PYTHONDONTWRITEBYTECODE" not in os.environ or "PYTHONPYCACHEPREFIX" in os.environ:
        return
    prefix = Path(tempfile.gettempdir()) / f"riverbed-tests-pycache-{os.getuid()}"
    prefix.mkdir(mode=0o700, exist_ok=True)
    if prefix.stat().st_uid != os.getuid():
        return  # (someone else's directory: compile as asked)
    del os.environ["PYTHONDONTWRITEBYTECODE"]
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)


_cache_bytecode()

BACKENDS = ("standalone", "cluster")
_SERVER_FIXTURES = {"standalone": "standalone_redis_url", "cluster": "redis_cluster_url"}
_BACKENDS_ENV = "RIVERBED_TEST_REDIS"

#: The modules about the Redis layer (the log, its scripts, ownership, wake-ups, connections,
#: the keys a session spreads over slots): they run on both deployments.  Every other test that
#: uses Redis runs on the standalone one, unless the run asks for ``--redis all`` (every test on
#: both) or ``--redis cluster``; what is about the cluster alone asks for it by name.
REDIS_LAYER = {
    "test_archive",
    "test_backends",
    "test_claims",
    "test_connection",
    "test_exchange",
    "test_failover",
    "test_fault_redis",
    "test_fork_state",
    "test_grouped",
    "test_log",
    "test_ownership",
    "test_redis_client",
    "test_serve",
    "test_tenants",
    "test_wakeups",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--redis",
        choices=[*BACKENDS, "both", "all"],
        default=None,
        help=(
            "the Redis deployment(s) the tests run against: both (the default, or $"
            f"{_BACKENDS_ENV}) runs the Redis layer's tests on standalone and cluster and the "
            "rest on standalone; all runs every test on both"
        ),
    )


def _chosen(config: pytest.Config) -> str:
    chosen: str = config.getoption("--redis") or os.environ.get(_BACKENDS_ENV) or "both"
    if chosen not in (*BACKENDS, "both", "all"):
        raise pytest.UsageError(f"{_BACKENDS_ENV}={chosen!r}: expected standalone, cluster, both or all")
    return chosen


def selected_backends(config: pytest.Config) -> list[str]:
    """The backends of this run: ``--redis``, else ``$RIVERBED_TEST_REDIS``, else both."""
    chosen = _chosen(config)
    return list(BACKENDS) if chosen in ("both", "all") else [chosen]


def backends_of(metafunc: pytest.Metafunc) -> list[str]:
    """The backends one test runs on: both for the Redis layer's modules (and for every test
    with ``--redis all``), else the standalone one of those selected."""
    selected = selected_backends(metafunc.config)
    if _chosen(metafunc.config) == "all" or metafunc.module.__name__.rpartition(".")[2] in REDIS_LAYER:
        return selected
    return selected[:1]


def pytest_configure(config: pytest.Config) -> None:
    selected_backends(config)  # a bad RIVERBED_TEST_REDIS is one usage error, before collection
    # What runs in the test process logs as a worker's console does: a traceback as text, not
    # structlog's default rich one with every frame's locals, which takes a busy machine seconds.
    structlog.configure(processors=processors(structlog.dev.ConsoleRenderer(colors=False)))
    guards.configure(config)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run every test that uses Redis (through ``redis_url``) once per selected backend."""
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", backends_of(metafunc), indirect=True, scope="session")


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def service_root(pytestconfig: pytest.Config) -> Iterator[Path]:
    """This test process's directory for its services (see :mod:`tests.kit.guards`)."""
    root = guards.own_directory(pytestconfig) / "services"
    root.mkdir(mode=0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _only_when_selected(request: pytest.FixtureRequest, name: str) -> None:
    """Skip a test that asks for a deployment by name when this run leaves that deployment out."""
    if name not in selected_backends(request.config):
        pytest.skip(f"about the {name} deployment, left out of this run (--redis / ${_BACKENDS_ENV})")


@pytest.fixture(scope="session")
def standalone_selected(request: pytest.FixtureRequest) -> None:
    _only_when_selected(request, "standalone")


@pytest.fixture(scope="session")
def cluster_selected(request: pytest.FixtureRequest) -> None:
    _only_when_selected(request, "cluster")


@pytest.fixture(scope="session")
def standalone_redis_url(service_root: Path, standalone_selected: None) -> Iterator[str]:
    """A private standalone redis-server for the whole run (or RIVERBED_TEST_REDIS_URL).

    Ask for it by name only in a test that is about a standalone deployment; every other test
    takes ``redis_url`` and runs on both backends.
    """
    given = os.environ.get("RIVERBED_TEST_REDIS_URL")
    if given:
        yield given
        return
    url, pid = services.start_redis(service_root / "redis", appendonly=False)
    yield url
    services.stop_redis(pid)


@pytest.fixture(scope="session")
def redis_cluster_url(service_root: Path, cluster_selected: None) -> Iterator[str]:
    """A private 3-master Redis Cluster for the whole run (or RIVERBED_TEST_REDIS_CLUSTER_URL).

    Ask for it by name only in a test that is about a cluster deployment; every other test
    takes ``redis_url`` and runs on both backends.
    """
    given = os.environ.get("RIVERBED_TEST_REDIS_CLUSTER_URL")
    if given:
        yield given
        return
    url, pids = services.start_redis_cluster(service_root / "redis-cluster", masters=3)
    yield url
    services.stop_redis_cluster(pids)


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> str:
    """The Redis deployment this test runs against: ``standalone`` or ``cluster``.

    Parametrized in :func:`pytest_generate_tests` for every test that uses Redis, at session
    scope, so pytest runs all tests of one backend together and starts each deployment once.
    """
    name: str = request.param
    return name


@pytest.fixture(scope="session")
def redis_url(backend: str, request: pytest.FixtureRequest) -> str:
    """The URL of the Redis of ``backend``: every test that takes it runs once per backend."""
    url: str = request.getfixturevalue(_SERVER_FIXTURES[backend])
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


@pytest.fixture(scope="session")
def local() -> LocalEmbedder:
    """The local embedder, loaded once per test process (it keeps no state of a test's)."""
    from tests.kit.embedder import shared_local  # noqa: PLC0415  (numpy and the model: only when asked)

    return shared_local()


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
    """A bus on the test Redis of ``backend`` under this test's own prefix."""
    async with riverbed.connect(redis_url, prefix=prefix) as bus:
        yield bus


@pytest.fixture
async def standalone_bus(standalone_redis_url: str, prefix: str) -> AsyncIterator[Bus]:
    """A bus on the standalone test Redis, for a test that is about that deployment only."""
    async with riverbed.connect(standalone_redis_url, prefix=prefix) as bus:
        yield bus


#: Nothing listens there: a command that must not need Redis fails loudly if it tries.
NO_REDIS = "redis://127.0.0.1:1"


@pytest.fixture
def offline_env(prefix: str, tmp_path: Path) -> dict[str, str]:
    """The environment of a command that needs no test Redis (so the test runs once, not per backend)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RIVERBED_")}
    env.update(
        RIVERBED_REDIS_URL=NO_REDIS,
        RIVERBED_PREFIX=prefix,
        RIVERBED_SERVICES_DIR=str(tmp_path / "services"),
        COLUMNS="200",
    )
    return env


@pytest.fixture
def cli_env(offline_env: dict[str, str], redis_url: str) -> dict[str, str]:
    """The environment of a command against the test Redis of this backend."""
    return {**offline_env, "RIVERBED_REDIS_URL": redis_url}

"""Shared fixtures: real services on private ports, one key prefix (and schema) per test."""

from __future__ import annotations

import faulthandler
import functools
import inspect
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import pytest_timeout
import structlog

import riverbed
from riverbed import services
from riverbed.client.session import Bus
from riverbed.logs import processors
from tests.kit import leftovers
from tests.kit.patience import ENV as PATIENCE_ENV
from tests.kit.patience import patience, within

if TYPE_CHECKING:
    from riverbed.memory.embedders import LocalEmbedder

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
    _mark_session(config)
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_Workers(), "riverbed-test-workers")


def pytest_report_header(config: pytest.Config) -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return (
        f"riverbed: waits and timeouts x{patience():.1f} (load {load:.1f}, or ${PATIENCE_ENV}), "
        f"session directory {config.stash[_SESSION]}"
    )


# --- one session's processes: its directories, and what is left running at its end -------------

_SESSION = pytest.StashKey[Path]()
"""The session's directory (the same in every test process of a pytest-xdist run)."""
_MINE = pytest.StashKey[Path]()
"""This test process's directory in it: its services live there, and ``$RBTEST_SESSION`` names it."""
_ENDED = pytest.StashKey[list[str]]()
_WORKER_INPUT = "riverbed_session"


def _mark_session(config: pytest.Config) -> None:
    """The session's directory (made by the first process, handed to pytest-xdist's workers) and
    this process's own in it, named in the environment every process it starts inherits."""
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    if workerinput is None:
        session = Path(tempfile.mkdtemp(prefix="riverbed-test-"))
        session.chmod(0o755)  # (the embedded Postgres runs as a user of its own)
        mine = session / "main"
    else:
        session = Path(workerinput[_WORKER_INPUT])
        mine = session / workerinput["workerid"]
    mine.mkdir(mode=0o755, exist_ok=True)
    config.stash[_SESSION], config.stash[_MINE], config.stash[_ENDED] = session, mine, []
    os.environ[leftovers.MARK] = str(mine)


def _basetemp(config: pytest.Config) -> Path | None:
    factory = getattr(config, "_tmp_path_factory", None)
    return None if factory is None else Path(factory.getbasetemp())


def _sweep(config: pytest.Config, roots: list[Path], where: str) -> None:
    ended = leftovers.sweep(roots)
    config.stash[_ENDED] += [f"{where}: {line}" for line in leftovers.report(ended)]


class _Workers:
    """The controller's hooks of a pytest-xdist run."""

    @pytest.hookimpl
    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput[_WORKER_INPUT] = str(node.config.stash[_SESSION])

    @pytest.hookimpl
    def pytest_testnodedown(self, node: Any, error: object | None) -> None:
        """A worker that died (a test past its hard timeout, a kill) left its services and
        worker processes running: end them now, before its replacement starts."""
        if error is None:
            return
        name = node.workerinput["workerid"]
        roots = [node.config.stash[_SESSION] / name]
        if (base := _basetemp(node.config)) is not None:
            roots.append(base / f"popen-{name}")
        _sweep(node.config, roots, f"left by the crashed worker {name}")


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> Generator[None, None, None]:
    """After the session (the fixtures torn down, pytest-xdist's workers gone, however the run
    ended): end what is still running in the session's directories."""
    try:
        return (yield)
    finally:
        config = session.config
        if not hasattr(config, "workerinput"):  # (the controller sweeps for the whole run)
            roots = [config.stash[_SESSION]]
            if (base := _basetemp(config)) is not None:
                roots.append(base)
            _sweep(config, roots, "left running")
            shutil.rmtree(config.stash[_SESSION], ignore_errors=True)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    ended = config.stash.get(_ENDED, [])
    if ended:
        terminalreporter.section("processes this session left running, now ended", sep="-", yellow=True)
        for line in ended:
            terminalreporter.line(line)


# --- per-test bounds: a failure of the test, never of the run ----------------------------------

_DEADLINE = pytest.StashKey[float]()
GRACE = 30.0
"""Seconds (scaled by the load) between a test's timeout and its hard stop: the time its
teardown has after an async test failed at its timeout."""


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool:
    """pytest-timeout's ``timeout`` (ini, ``--timeout`` or marker), scaled by the machine's load.

    An async test fails at that bound inside its own event loop (:func:`pytest_pyfunc_call`):
    a ``TimeoutError`` at the await it was stuck in, its fixtures torn down as after any failure.
    Past it by :data:`GRACE` too (a sync test, or a loop blocked in a call), a timer thread prints
    every thread's stack and ends the test process: pytest-xdist reports that one test failed
    ("worker crashed while running …"), starts another worker, and the run goes on to its summary;
    what the dead worker left running is ended (:class:`_Workers`).  (pytest-timeout's ``signal``
    method raised wherever the alarm landed, once inside pytest writing a report: the run ended in
    INTERNALERROR.)
    """
    bound = within(settings.timeout)
    item.stash[_DEADLINE] = time.monotonic() + bound
    hard = bound + within(GRACE)
    timer = threading.Timer(hard, _hard_stop, (item, settings, hard))
    timer.name = f"timeout {item.nodeid}"
    timer.daemon = True

    def cancel() -> None:
        timer.cancel()
        timer.join()

    item.cancel_timeout = cancel  # (what pytest-timeout's own cancel hook calls)
    timer.start()
    return True


def _hard_stop(item: pytest.Item, settings: Any, hard: float) -> None:
    if not settings.disable_debugger_detection and pytest_timeout.is_debugging():
        return
    capture = item.config.pluginmanager.getplugin("capturemanager")
    try:
        if capture is not None:
            capture.suspend_global_capture(in_=True)
        sys.stderr.write(f"\n+++ {item.nodeid} ran past its hard timeout of {hard:.0f}s; its threads:\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    finally:
        os._exit(1)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Generator[None, object, object]:
    """An async test runs under its timeout (:func:`pytest_timeout_set_timer`) in its own loop."""
    test = pyfuncitem.obj
    deadline = pyfuncitem.stash.get(_DEADLINE, None)
    if deadline is None or not inspect.iscoroutinefunction(test) or hasattr(test, "hypothesis"):
        return (yield)
    pyfuncitem.obj = _bounded(test, deadline)
    try:
        return (yield)
    finally:
        pyfuncitem.obj = test


def _bounded(test: Callable[..., Awaitable[object]], deadline: float) -> Callable[..., Awaitable[object]]:
    @functools.wraps(test)
    async def bounded(**kwargs: object) -> object:
        try:
            with anyio.fail_after(max(deadline - time.monotonic(), 0.0)):
                return await test(**kwargs)
        except TimeoutError as exc:
            if time.monotonic() < deadline:
                raise  # one of the test's own bounds
            raise TimeoutError(
                f"the test ran past its timeout (pytest-timeout's, x{patience():.1f} for this machine's load); "
                "the await it was in is in the traceback above"
            ) from exc

    return bounded


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run every test that uses Redis (through ``redis_url``) once per selected backend."""
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", backends_of(metafunc), indirect=True, scope="session")


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def service_root(pytestconfig: pytest.Config) -> Iterator[Path]:
    """This test process's directory for its services (see :func:`_mark_session`)."""
    root = pytestconfig.stash[_MINE] / "services"
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

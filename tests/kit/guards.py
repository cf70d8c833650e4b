"""The run's guards, as pytest hooks (registered by ``tests/conftest.py``): bounds that follow the
machine's load, a timeout that fails its test and not the run, and nothing left running after it.

- **Bounds.** pytest-timeout's ``timeout`` (ini, ``--timeout`` or a marker) is scaled by
  :func:`~tests.kit.patience.within`, as every wait of the kit is.  An async test fails at that
  bound inside its own event loop (:func:`pytest_pyfunc_call`): a ``TimeoutError`` at the await it
  was stuck in, its fixtures torn down as after any failure.  Past it by :data:`GRACE` too (a sync
  test, or a loop blocked in a call), a timer thread prints every thread's stack and ends the test
  process: pytest-xdist reports that one test failed ("worker crashed while running …"), starts
  another worker, and the run goes on to its summary.  (pytest-timeout's ``signal`` method raised
  wherever the alarm landed, once inside pytest writing a report: the run ended in INTERNALERROR.)
- **Leftovers.** Each test process has a directory of its own under the run's, named by
  ``$RBTEST_SESSION`` in the environment of everything it starts (:mod:`tests.kit.leftovers`).
  After the run, however it ended (SIGTERM ends it as Ctrl-C does), and as soon as a pytest-xdist
  worker dies, what still runs there (or in pytest's temporary directories) is ended, and the
  summary lists it.
"""

from __future__ import annotations

import faulthandler
import functools
import inspect
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from pathlib import Path
from typing import Any

import anyio
import pytest
import pytest_timeout

from tests.kit import leftovers
from tests.kit.patience import ENV as PATIENCE_ENV
from tests.kit.patience import patience, within

__all__ = ["GRACE", "configure", "own_directory"]


def configure(config: pytest.Config) -> None:
    """Mark this test process's directory and register the hooks (from ``pytest_configure``)."""
    _mark_session(config)
    config.pluginmanager.register(sys.modules[__name__], "riverbed-test-guards")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_Workers(), "riverbed-test-workers")
    if (
        not hasattr(config, "workerinput")
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    ):
        # A run ended by SIGTERM (a CI job's time limit, ``kill``) ends as Ctrl-C does: the
        # session finishes, and what it left running is swept (by default it would just die).
        signal.signal(signal.SIGTERM, _terminated)


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def own_directory(config: pytest.Config) -> Path:
    """This test process's directory: its services live there, and ``$RBTEST_SESSION`` names it."""
    return config.stash[_MINE]


def pytest_report_header(config: pytest.Config) -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return (
        f"riverbed: waits and timeouts x{patience():.1f} (load {load:.1f}, or ${PATIENCE_ENV}), "
        f"session directory {config.stash[_SESSION]}"
    )


# --- one run's processes: its directories, and what is left running at its end -----------------

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
    """pytest-timeout's ``timeout``, scaled by the machine's load: the deadline of an async test
    (:func:`pytest_pyfunc_call`), and :data:`GRACE` later the hard stop of any test (see the
    module's docstring)."""
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

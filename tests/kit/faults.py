"""Fault-test drivers: sessions driven like agents through outages, and a private Redis to break."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from riverbed import events, services
from riverbed.client.session import Session
from riverbed.errors import ActTimeout, UnavailableError
from tests.kit.answers import answers_of, assert_answered_once
from tests.kit.patience import within
from tests.kit.workers import WorkerProcess, ready, starter


class PrivateRedis:
    """A redis-server of this test's own that can be stopped and started on the same port.

    ``persistent=False``: no AOF and no snapshot, so a restart comes back empty.
    """

    def __init__(self, directory: Path, *, persistent: bool = True) -> None:
        self.directory = directory
        self.persistent = persistent
        self.port = services.free_port()
        self.pid = 0
        self.url = ""

    def start(self) -> None:
        self.url, self.pid = services.start_redis(
            self.directory, port=self.port, appendonly=self.persistent, appendfsync="always"
        )

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (Redis syncs its AOF, if it keeps one, and exits), then wait until it is gone."""
        os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.02)
        raise AssertionError(f"redis-server {self.pid} did not exit on SIGTERM within {timeout}s")

    def close(self) -> None:
        services.stop_redis(self.pid)

    def __enter__(self) -> PrivateRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def start_runtime_workers(
    workers: list[WorkerProcess],
    url: str,
    prefix: str,
    workspace: Path,
    log_dir: Path,
    *,
    lease: float,
    metrics: bool = False,
) -> dict[str, int]:
    """Two runtime workers, ``wa`` and ``wb``, on ``url``, each registered when this returns.

    ``metrics``: each also serves its metrics and ``/readyz``; returns name -> that port."""
    start = starter(workers, url, prefix, workspace, log_dir)
    ports = {}
    for name in ("wa", "wb"):
        env = {}
        if metrics:
            ports[name] = services.free_port()
            env["RIVERBED_METRICS_PORT"] = str(ports[name])
        start(name, ["runtime"], lease=lease, extra_env=env)
    await ready(*workers)
    return ports


@dataclass
class Driver:
    """One session driven like an agent would: act, wait, act again; retrying through outages."""

    session: Session
    appended: dict[int, str] = field(default_factory=dict)  # event id -> command
    answers: dict[int, events.Event] = field(default_factory=dict)
    answered_at: dict[int, float] = field(default_factory=dict)  # action id -> monotonic time
    appended_at: dict[int, float] = field(default_factory=dict)

    async def append(self, action: events.CmdRun, key: str) -> int:
        """Append with an idempotency key, retrying until Redis answers: a retry after a lost
        reply returns the first id instead of appending twice."""
        backoff = 0.05
        while True:
            try:
                (action_id,) = await self.session.append(action, idempotency_key=key)
                return action_id
            except UnavailableError:
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 0.5)

    async def answer(self, action_id: int) -> events.Event:
        backoff = 0.05
        with anyio.fail_after(within(60)):
            while True:
                try:
                    return await self.session.wait_for_answer(action_id, timeout=5)
                except (UnavailableError, ActTimeout):
                    await anyio.sleep(backoff)
                    backoff = min(backoff * 2, 0.5)

    async def wait_turn(self) -> None:
        """Before each action: a subclass may hold the next one back."""

    async def run(self, stop: anyio.Event) -> None:
        i = 0
        while not stop.is_set():
            await self.wait_turn()
            marker = f"{self.session.id}-{i}"
            command = f"echo {marker} >> runs.txt; echo {marker}"
            action_id = await self.append(events.CmdRun(command=command), key=marker)
            self.appended[action_id] = command
            self.appended_at[action_id] = time.monotonic()
            self.answers[action_id] = await self.answer(action_id)
            self.answered_at[action_id] = time.monotonic()
            i += 1

    def answered_since(self, moment: float) -> list[float]:
        """Answer times of the actions appended at or after ``moment``."""
        return sorted(t for a, t in self.answered_at.items() if self.appended_at[a] >= moment)


@contextlib.asynccontextmanager
async def driving(drivers: Sequence[Driver]) -> AsyncIterator[None]:
    """The drivers act while the block runs; at its end each finishes the action it has begun."""
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        for driver in drivers:
            tg.start_soon(driver.run, stop)
        yield
        stop.set()


async def wait_each_answered(
    drivers: Sequence[Driver], timeout: float, *, since: float | None = None, after: str = ""
) -> None:
    """Until every driver has three answers; with ``since``, to actions appended at or after it
    (``after`` names that moment in the failure message)."""
    if since is None:
        await wait_for(
            lambda: all(len(d.answers) >= 3 for d in drivers), timeout, "every session answered three actions"
        )
    else:
        await wait_for(
            lambda: all(len(d.answered_since(since)) >= 3 for d in drivers),
            timeout,
            f"every session answered three actions appended after {after}",
        )


async def assert_in_log(session: Session, appended: dict[int, str]) -> list[events.Event]:
    """Every event id an append returned holds the action that was appended; returns the log."""
    log = await session.events()
    by_id = {e.id: e for e in log}
    for action_id, command in appended.items():
        event = by_id.get(action_id)
        assert isinstance(event, events.CmdRun), f"{session.id}: appended event {action_id} is lost: {event}"
        assert event.command == command
    return log


def files_named(root: Path, name: str) -> list[Path]:
    """Every file called ``name`` below ``root``.  Unlike ``Path.rglob``, the walk skips a
    directory that goes away under it (a worker still closing a sandbox removes its own)."""
    return [Path(where) / name for where, _dirs, files in os.walk(root) if name in files]


async def assert_each_action_answered_once(drivers: Sequence[Driver], workspace: Path) -> None:
    """Every driver's log holds exactly the actions it appended, each with one answer: its own
    output (and the command ran once) or a retryable ``runtime_lost`` (and it ran at most once)."""
    runs: dict[str, int] = {}
    for path in files_named(workspace, "runs.txt"):
        for line in path.read_text().split():
            runs[line] = runs.get(line, 0) + 1
    for driver in drivers:
        log = await assert_in_log(driver.session, driver.appended)
        actions = answers_of(log, lambda e: isinstance(e, events.CmdRun))
        assert list(actions) == sorted(driver.appended), "the log holds actions nobody appended (a duplicated append?)"
        once = assert_answered_once(log, lambda e: isinstance(e, events.CmdRun), where=driver.session.id)
        for action_id, answer in once.items():
            marker = driver.appended[action_id].split()[1]
            if isinstance(answer, events.CmdOutput):
                assert answer.content.strip() == marker
                assert runs.get(marker) == 1, f"{marker} ran {runs.get(marker, 0)} times"
            else:
                assert isinstance(answer, events.Error), answer
                assert answer.reason == "runtime_lost", answer
                assert answer.retryable
                assert runs.get(marker, 0) <= 1, f"{marker} ran {runs[marker]} times"


async def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    bound = within(timeout)
    with anyio.move_on_after(bound):
        while not condition():
            await anyio.sleep(0.02)
        return
    raise AssertionError(f"{what}: not reached within {bound:.1f}s")

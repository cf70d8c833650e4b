"""The application: the Typer app and its groups, the shared options, and what every command
needs (settings, a connected bus, running a coroutine under anyio with signals)."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any, TypeVar

import anyio
import redis.asyncio as aioredis
import typer
import typer.core
import typer.main
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from riverbed.bus.connection import redact
from riverbed.bus.keys import require_session
from riverbed.bus.redis_client import RedisClient
from riverbed.cli.output import err_console
from riverbed.client.session import Bus, connect, resolve_redis_url
from riverbed.errors import (
    ConfigError,
    InputError,
    NotFoundError,
    UnavailableError,
)
from riverbed.settings import Settings

T = TypeVar("T")

CONNECT_TIMEOUT = 5.0
"""Seconds a command waits for Redis before it gives up (no minute of retries)."""

#: The order of ``riverbed --help``: a first look, daily work, then operations and plumbing.
#: Commands not named here follow, in the order they are registered (commands before groups).
COMMAND_ORDER = (
    "demo",
    "services",
    "worker",
    "act",
    "append",
    "log",
    "view",
    "fork",
    "rerun",
    "sessions",
    "status",
    "export",
    "import",
    "archive",
    "dlq",
    "schema",
    "serve",
    "context",
    "usage",
    "agent",
    "keys",
)


class _OrderedGroup(typer.core.TyperGroup):
    def list_commands(self, ctx: Any) -> list[str]:
        names = super().list_commands(ctx)
        known = [n for n in COMMAND_ORDER if n in names]
        return known + [n for n in names if n not in known]


def _plain_help(command: Any) -> Any:
    """Help without type placeholders (``<str>``, ``<float>``): an option shows its metavar
    (``--at N``) or nothing, an argument its name in capitals (``SESSION``)."""
    for param in command.params:
        shown = param.metavar
        if param.param_type_name == "argument":
            param.metavar = param.metavar or (param.name or "").upper()
            shown = None  # the name column shows it already
        param.display_type_rich = lambda ctx, shown=shown: shown  # (a method, per parameter)
    make_help = command.get_help_option

    def help_option(ctx: Any) -> Any:
        option = make_help(ctx)
        if option is not None:
            option.display_type_rich = lambda ctx: None
        return option

    command.get_help_option = help_option
    for sub in getattr(command, "commands", {}).values():
        _plain_help(sub)
    return command


app = typer.Typer(
    cls=_OrderedGroup,
    name="riverbed",
    help="riverbed: an event-sourced runtime for AI agents (Redis Streams log, workers, pgvector memory).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(asked: bool) -> None:
    if asked:
        typer.echo(f"riverbed {metadata.version('riverbed')}")
        raise typer.Exit


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", help="Print riverbed's version and exit.", callback=_version, is_eager=True)
    ] = False,
) -> None:
    pass


def command_name() -> str:
    """How a user's shell runs this ``riverbed``: ``riverbed`` when that is the one on PATH,
    else its full path (a virtual environment that is not activated)."""
    me = Path(sys.argv[0])
    if me.name != "riverbed":
        return f"{shlex.quote(sys.executable)} -m riverbed.cli"
    found = shutil.which("riverbed")
    if found is not None and Path(found).resolve() == me.resolve():
        return "riverbed"
    return shlex.quote(str(me.absolute()))


services_app = typer.Typer(help="Embedded Redis + Postgres for development.", no_args_is_help=True)
app.add_typer(services_app, name="services")

PrefixOption = Annotated[
    str | None,
    typer.Option("--prefix", help="Key namespace in Redis (default RIVERBED_PREFIX, else rb).", show_default=False),
]
SessionArg = Annotated[str, typer.Argument(help="Session id.", callback=require_session)]
JsonOption = Annotated[bool, typer.Option("--json", help="One JSON object per line.")]
DirOption = Annotated[
    Path | None,
    typer.Option(
        "--dir",
        help="Where the embedded services keep their data (default RIVERBED_SERVICES_DIR).",
        show_default=False,
        file_okay=False,
    ),
]


# --- what every command works with --------------------------------------------------------


def _progress(message: str) -> None:
    err_console.print(message, style="dim")


FLAGS = {
    "prefix": "--prefix",
    "concurrency": "--concurrency",
    "metrics_port": "--metrics-port",
    "serve_host": "--host",
    "serve_port": "--port",
    "retention_keep_last": "--keep-last",
    "llm_model": "--model",
    "llm_max_output_tokens": "--max-output-tokens",
    "llm_temperature": "--temperature",
    "llm_timeout": "--llm-timeout",
}
"""The flag that overrides each setting, for the sentence that refuses a bad value."""


class Invocation:
    """One run of a command, built once at its start: the configuration (``RIVERBED_*``
    variables, overridden by the command's flags) and the bus, connected on first use inside
    :meth:`run` and closed when the run ends.  Every command goes through one::

        cli = Invocation(prefix)

        async def go() -> int:
            bus = await cli.bus()
            ...

        result = cli.run(go)
    """

    def __init__(self, prefix: str | None = None, **overrides: object) -> None:
        self._prefix = prefix
        self._overrides = overrides
        self.settings = Settings.from_env(os.environ, flags=FLAGS, prefix=prefix, **overrides)
        self._url: str | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._bus: Bus | None = None

    def with_settings(self, **overrides: object) -> None:
        """Override more of the configuration (before the bus is connected)."""
        assert self._bus is None, "the bus is connected with the settings it had"
        self._overrides = {**self._overrides, **overrides}
        self.settings = Settings.from_env(os.environ, flags=FLAGS, prefix=self._prefix, **self._overrides)

    def redis_url(self) -> str:
        """``RIVERBED_REDIS_URL``, or the embedded services' (started now if they are not running)."""
        if self._url is None:
            self._url = resolve_redis_url(self.settings, progress=_progress)
        return self._url

    async def bus(self) -> Bus:
        """The connected bus (the same one for the whole run); an unreachable Redis fails
        within :data:`CONNECT_TIMEOUT` seconds."""
        if self._bus is None:
            if self._stack is None:
                raise RuntimeError("Invocation.bus() is for the coroutine that Invocation.run runs")
            url = self.redis_url()
            try:
                with anyio.fail_after(CONNECT_TIMEOUT):
                    await _probe(url)
                    self._bus = await self._stack.enter_async_context(connect(url, settings=self.settings))
            except TimeoutError as exc:
                raise UnavailableError(
                    f"cannot reach Redis at {redact(url)}: no answer within {CONNECT_TIMEOUT:g}s"
                ) from exc
        return self._bus

    def run(self, fn: Callable[[], Awaitable[T]], *, interrupt_code: int | None = None, server: bool = False) -> T:
        """Run ``fn`` under anyio (see :func:`_run`), then close the bus if it connected.
        A ``server`` handles SIGINT/SIGTERM itself and runs on uvloop where installed."""

        async def within() -> T:
            async with contextlib.AsyncExitStack() as stack:
                self._stack = stack
                try:
                    return await fn()
                finally:
                    self._stack = self._bus = None

        if server:
            return _serve(within)
        return _run(within, interrupt_code=interrupt_code)


async def _probe(url: str) -> None:
    """One PING without retries, so an unreachable Redis fails at once with the real reason
    (the bus client itself retries with backoff, which suits workers, not a command line)."""
    try:
        client = aioredis.Redis.from_url(
            url, socket_connect_timeout=CONNECT_TIMEOUT, socket_timeout=CONNECT_TIMEOUT, retry=Retry(NoBackoff(), 0)
        )
    except ValueError as exc:
        raise ConfigError(f"the Redis URL {redact(url)!r} is not valid: {exc}") from exc
    probe = RedisClient(client, url)
    try:
        await probe.ping()
    finally:
        await probe.aclose()


def _run(fn: Callable[[], Awaitable[T]], *, interrupt_code: int | None = None) -> T:
    """Run ``fn`` under anyio; SIGINT/SIGTERM cancel it and exit with ``interrupt_code``
    (default 130 for Ctrl-C, 143 for SIGTERM).  Called off the main thread (a command run by
    another program's thread), it runs without watching signals, which only that thread gets.

    Signals cancel through an anyio cancel scope, which re-delivers the cancellation until
    the work stops (a plain task cancel can be swallowed inside the Redis client).
    """
    received: list[int] = []
    results: list[T] = []

    async def guarded() -> None:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        received.append(signum)
                        tg.cancel_scope.cancel()
                        return

            if threading.current_thread() is threading.main_thread():  # (signals reach that one only)
                tg.start_soon(watch)
            try:
                results.append(await fn())
            finally:
                tg.cancel_scope.cancel()

    try:
        anyio.run(guarded)
    except KeyboardInterrupt:
        received.append(signal.SIGINT)
    except BaseExceptionGroup as group:
        raise _leaf(group) from None
    if received:
        raise typer.Exit(interrupt_code if interrupt_code is not None else 128 + received[0])
    return results[0]


def _serve(fn: Callable[[], Awaitable[T]]) -> T:
    """Run a server's ``fn`` under anyio on uvloop where installed (it takes a tenth to a
    quarter off every HTTP request), leaving signals to it."""
    from riverbed.workers.main import run_process  # noqa: PLC0415

    try:
        return run_process(fn)
    except BaseExceptionGroup as group:
        raise _leaf(group) from None


def _leaf(exc: BaseException) -> BaseException:
    """The one real error inside (nested) exception groups, if there is exactly one."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _check_range(start: int, until: int | None) -> None:
    if start < 1:
        raise InputError(f"--from must be 1 or more, not {start}")
    if until is not None and until < start:
        raise InputError(f"--until ({until}) must not be before --from ({start})")


async def _require_events(bus: Bus, session: str) -> None:
    if not await bus.session(session).last_id():
        raise NotFoundError(f"session {session!r} has no events (`riverbed sessions` lists the sessions)")

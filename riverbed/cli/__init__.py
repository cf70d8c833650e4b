"""The ``riverbed`` command: this entry module (:func:`main` and the exit codes) and its rooms.

::

    app.py        the Typer app and groups, shared options, the Invocation (settings, the bus, anyio)
    output.py     events as readable lines, control-character escapes, JSON lines, errors on stderr
    commands/     one module per subject (log and view, context, usage, actions, transfer,
                  sessions and status, services, dlq, archive, serve and keys, schema, agent, tenants);
                  importing a module registers its commands

Domain logic lives in the packages that own it (``riverbed.agent.transfer`` parses and copies
imports, ``riverbed.bus.dlq`` requeues, ``riverbed.bus.status`` reads session metadata), where
``riverbed serve`` shares it.  Every command follows the same shape, so adding one (in the
``commands`` module of its subject) is a few lines::

    @app.command()
    def thing(session: str, prefix: PrefixOption = None) -> None:
        cli = Invocation(prefix)

        async def go() -> None:
            bus = await cli.bus()
            ...

        cli.run(go)

- :class:`~riverbed.cli.app.Invocation` is built once per run: the configuration
  (environment + flags), and the bus, connected on first use with a bound on the
  connection time and closed when the run ends;
- :meth:`~riverbed.cli.app.Invocation.run` runs a coroutine function under anyio, where
  SIGINT/SIGTERM cancel it;
- :func:`main` turns every error into one sentence on stderr and an exit code:
  2 for bad input or configuration, 1 when a service is unavailable or timed out.
  ``RIVERBED_DEBUG=1`` shows the traceback of an unexpected error.

Machine-readable output goes to stdout (JSON lines); progress and errors go to stderr.
"""

from __future__ import annotations

import contextlib
import os
import sys

import typer.main

from riverbed.cli.app import _leaf, _plain_help, app
from riverbed.cli.commands import (  # noqa: F401  (importing a command module registers its commands)
    actions,
    agent,
    agents,
    archive,
    context,
    dlq,
    log,
    people,
    schema,
    secrets,
    serve,
    services,
    sessions,
    tenants,
    transfer,
    usage,
)
from riverbed.cli.output import _fail
from riverbed.errors import ActTimeout, RiverbedError, ServiceError, UnavailableError
from riverbed.extras import missing_extra
from riverbed.logs import configure_logging
from riverbed.settings import Settings

__all__ = ["app", "exit_code", "main"]


def exit_code(exc: BaseException) -> int:
    """1 when a service is unavailable (or timed out), 2 for bad input or configuration."""
    if isinstance(exc, UnavailableError | ServiceError | ActTimeout):
        return 1
    return 2


def _hint(exc: RiverbedError) -> str:
    if isinstance(exc, UnavailableError) and "Redis" in str(exc):
        return ' (start one with: eval "$(riverbed services up)", or set RIVERBED_REDIS_URL)'
    return ""


def _debugging() -> bool:
    """``RIVERBED_DEBUG``: an unexpected error shows its traceback."""
    try:
        return bool(Settings.one("debug"))
    except RiverbedError:
        return False


def main() -> None:
    """Entry point of the ``riverbed`` console script."""
    # Commands log warnings only (to stderr); `worker` reconfigures for its own service logs.
    try:
        configure_logging(level=Settings.one("log_level") or "warning")
        _plain_help(typer.main.get_command(app))()
    except SystemExit:
        raise
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away: stop quietly.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0) from None
    except BaseException as raw:
        exc = _leaf(raw)
        if isinstance(exc, KeyboardInterrupt):
            raise SystemExit(130) from None
        if isinstance(exc, SystemExit):
            raise exc from None
        exc = missing_extra(exc) or exc
        if isinstance(exc, RiverbedError):
            _fail(f"{exc}{_hint(exc)}", exit_code(exc))
        if isinstance(exc, UnicodeEncodeError | UnicodeDecodeError):  # an argument or a file met on the way
            _fail(f"an argument or input is not UTF-8 text ({exc.reason} at character {exc.start})", 2)
        if _debugging():
            raise
        _fail(f"unexpected error ({type(exc).__name__}: {exc}); set RIVERBED_DEBUG=1 to see the traceback", 1)

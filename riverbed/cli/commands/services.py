"""`riverbed services up|down`, `worker`, `demo`."""

from __future__ import annotations

import datetime as dt
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
import typer.core
import typer.main

from riverbed import services
from riverbed.cli.app import DirOption, Invocation, PrefixOption, _leaf, _progress, app, command_name, services_app
from riverbed.cli.output import out_console
from riverbed.logs import configure_logging

# --- services ------------------------------------------------------------------------------


def _services_dir(directory: Path | None) -> Path:
    return directory if directory is not None else Path(Invocation().settings.services_dir)


@services_app.command("up")
def services_up(directory: DirOption = None) -> None:
    """Start embedded Redis + Postgres; prints `export …` lines, so `eval "$(riverbed services up)"` works."""
    where = _services_dir(directory)
    if services.load(where) is None:
        _progress(f"starting Redis and Postgres in {where} …")
    else:
        _progress(f"services already running in {where}")
    running = services.up(where)
    sys.stdout.write(running.exports())
    sys.stdout.flush()
    _progress(f"ready: Redis at {running.redis_url}, Postgres at {running.database_url}")


@services_app.command("down")
def services_down(directory: DirOption = None) -> None:
    """Stop the embedded services started by `services up` in the same directory."""
    where = _services_dir(directory)
    stopped = services.down(where)
    if stopped:
        _progress(f"stopped the services in {where} ({' and '.join(stopped)})")
    else:
        _progress(f"no services were running in {where}")


# --- workers and actions -------------------------------------------------------------------


@app.command("worker")
def worker_command(
    roles: Annotated[
        list[str],
        typer.Argument(help="runtime, memory, condenser, agent, or all (with agent when a model is configured)."),
    ],
    concurrency: Annotated[
        int | None,
        typer.Option("--concurrency", help="Sessions owned at most per role (default RIVERBED_CONCURRENCY)."),
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="Worker name (default host-pid).")] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option("--metrics-port", help="Serve /metrics, /healthz, /readyz (default RIVERBED_METRICS_PORT)."),
    ] = None,
    prefix: PrefixOption = None,
    agents: Annotated[
        list[str] | None,
        typer.Option(
            "--agents",
            help="A module whose riverbed.Agent definitions the agent role hosts (repeatable; RIVERBED_AGENTS).",
        ),
    ] = None,
) -> None:
    """Run a long-lived worker for the given roles until SIGTERM/SIGINT (then drain and hand over)."""
    from riverbed.workers.main import parse_roles, run_process, run_worker  # noqa: PLC0415

    modules = ",".join(agents) if agents else None
    cli = Invocation(prefix, concurrency=concurrency, metrics_port=metrics_port, agents=modules)
    chosen = parse_roles(roles, model_configured=cli.settings.model_configured)
    if not cli.settings.redis_url:
        cli.with_settings(redis_url=cli.redis_url())
    settings = cli.settings
    configure_logging(settings.log_format, settings.log_level)
    try:
        run_process(lambda: run_worker(chosen, settings, name=name))
    except BaseExceptionGroup as group:
        raise _leaf(group) from None


@app.command("demo")
def demo_command(prefix: PrefixOption = None) -> None:
    """Start embedded services if needed, run every role in-process and drive a demo session."""
    from riverbed.workers.demo import run_demo  # noqa: PLC0415

    started = dt.datetime.now(dt.UTC)
    cli = Invocation(prefix)
    settings = cli.settings
    embedded = not settings.redis_url or not settings.database_url
    ours = embedded and services.load(_services_dir(None)) is None  # (started by this demo)
    try:
        url = cli.redis_url()
        if not settings.database_url:
            _progress("RIVERBED_DATABASE_URL is not set: using the embedded Postgres")
        configure_logging(settings.log_format, level=settings.log_level or "warning")
        console = out_console()

        async def go() -> Any:
            return await run_demo(settings, console, redis_url=url)

        result = cli.run(go)
    except BaseException:  # an error, Ctrl-C or SIGTERM: what the demo started must not keep running
        if ours:
            _stop_early(_services_dir(None))
        raise
    me = command_name()  # the command that works in the user's shell (a venv may not be activated)
    console.print()
    for check, passed in result.checks.items():
        console.print(("[green]✔[/] " if passed else "[red]✘[/] ") + check)
    seconds = (dt.datetime.now(dt.UTC) - started).total_seconds()
    console.print(
        f"\nsession [bold]{result.session}[/] ({result.events} events, view {result.view_size}), "
        f"fork [bold]{result.fork}[/]; done in {seconds:.1f}s.\n"
        f"\nLook at it:\n"
        f"  {me} log {result.session}                 every event\n"
        f"  {me} view {result.session} --until 8      the agent's context right after event 8\n"
        f"  {me} log {result.fork}            the fork, rebuilt at event 12"
        + (f"\n  {me} usage {result.agent_session}    the LLM agent's tokens and cost" if result.agent_session else "")
    )
    if embedded:
        where = shlex.quote(str(_services_dir(None)))
        console.print(
            f"\nThe demo started Redis and Postgres in {where}; they keep running for the commands above.\n"
            f"Stop them: {me} services down --dir {where}"
        )
    if not result.ok:
        raise typer.Exit(1)


def _stop_early(where: Path) -> None:
    """The demo stopped before its end: stop the services it started in ``where``, or say the
    one command that does."""
    command = f"{command_name()} services down --dir {shlex.quote(str(where))}"
    try:
        stopped = services.down(where)
    except BaseException:
        _progress(f"the demo stopped early; stop the services it started with: {command}")
        raise
    if stopped:
        _progress(f"the demo stopped early: stopped the {' and '.join(stopped)} it started in {where}")

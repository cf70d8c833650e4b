"""`riverbed log` and `riverbed view`: the raw events and the condensed view."""

from __future__ import annotations

from typing import Annotated

import typer
import typer.core
import typer.main

from riverbed import events
from riverbed.cli.app import Invocation, JsonOption, PrefixOption, SessionArg, _check_range, _require_events, app
from riverbed.cli.output import _stdout_lines, json_bytes, out_console, render
from riverbed.errors import (
    InputError,
)


@app.command("log")
def log_cmd(
    session: SessionArg,
    *,
    start: Annotated[int, typer.Option("--from", help="First event id.")] = 1,
    until: Annotated[int | None, typer.Option("--until", help="Last event id.", show_default=False)] = None,
    as_json: JsonOption = False,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep tailing new events (Ctrl-C stops).")] = False,
    prefix: PrefixOption = None,
) -> None:
    """The raw events of a session (readable, or JSON lines with --json)."""
    cli = Invocation(prefix)
    _check_range(start, until)
    console = out_console()

    async def go() -> None:
        bus = await cli.bus()
        handle = bus.session(session)
        if not follow:
            await _require_events(bus, session)
        async for event in handle.log(start, until, follow=follow):
            if as_json:
                _stdout_lines([json_bytes(event)], flush_each=follow)
            else:
                console.print(render(event))

    cli.run(go, interrupt_code=0 if follow else None)


@app.command("view")
def view_command(
    session: SessionArg,
    until: Annotated[
        int | None, typer.Option("--until", help="The view right after this event.", metavar="N", show_default=False)
    ] = None,
    json_out: JsonOption = False,
    prefix: PrefixOption = None,
) -> None:
    """The condensed view: the context exactly as the agent saw it after event N."""
    cli = Invocation(prefix)

    async def go() -> list[events.Event]:
        bus = await cli.bus()
        await _require_events(bus, session)
        last = await bus.session(session).last_id()
        if until is not None and not 1 <= until <= last:
            raise InputError(f"cannot view session {session!r} at {until}: choose an event id from 1 to {last}")
        return list(await bus.session(session).view(until=until))

    context = cli.run(go)
    if json_out:
        _stdout_lines(json_bytes(e) for e in context)
        return
    console = out_console()
    for event in context:
        console.print(render(event))

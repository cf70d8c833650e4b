"""`riverbed approvals` and `riverbed approve`: the calls that wait for a person, and the decision."""

from __future__ import annotations

import getpass
from typing import Annotated, Any

import msgspec
import typer
from rich.table import Table

from riverbed.cli.app import Invocation, JsonOption, PrefixOption, SessionArg, _progress, app
from riverbed.cli.output import _fail, _stdout_lines, json_bytes, out_console


@app.command("approvals")
def approvals_command(
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant's runs.", show_default=False)] = None,
    as_json: JsonOption = False,
    prefix: PrefixOption = None,
) -> None:
    """The calls that wait for a person's approval, oldest first: session, action, tool, risk
    and why, and the call's arguments.  `riverbed approve SESSION [ACTION...]` decides."""
    from riverbed.agent.hosted import awaiting_approval  # noqa: PLC0415

    cli = Invocation(prefix)

    async def go() -> Any:
        return await awaiting_approval(await cli.bus(), tenant=tenant)

    rows = cli.run(go)
    if as_json:
        _stdout_lines(
            json_bytes({"session": row.session, "tenant": row.tenant, **msgspec.to_builtins(call)})
            for row, call in rows
        )
        return
    if not rows:
        _progress("no call waits for approval")
        return
    table = Table("session", "action", "tool", "risk", "why", "arguments", box=None, header_style="bold")
    for row, call in rows:
        table.add_row(row.session, str(call.action), call.tool, call.level, call.reason, call.arguments)
    out_console().print(table)


@app.command("approve")
def approve_command(
    session: SessionArg,
    actions: Annotated[
        list[int] | None,
        typer.Argument(help="The calls (event ids) to decide; none: every call of the run that waits.", min=1),
    ] = None,
    reject: Annotated[bool, typer.Option("--reject", help="Reject the calls instead (the model reads why).")] = False,
    reason: Annotated[str, typer.Option("--reason", help="Why (the model reads it on a rejection).")] = "",
    tenant: Annotated[str | None, typer.Option("--tenant", help="The session's tenant.", show_default=False)] = None,
    as_json: JsonOption = False,
    prefix: PrefixOption = None,
) -> None:
    """Approve (or --reject) calls of SESSION's open run that wait for a person, as one `approval`
    event on its log.  A call answered or decided already exits 2, and so does one that does
    not wait."""
    from riverbed.agent.hosted import decide  # noqa: PLC0415

    if reason and not reject:
        _fail("--reason goes with --reject (an approval needs no reason)", 2)
    cli = Invocation(prefix)

    async def go() -> tuple[int, list[int]]:
        bus = await cli.bus()
        return await decide(bus, session, actions or [], approve=not reject, reason=reason, by=_who(), tenant=tenant)

    approval, decided = cli.run(go)
    if as_json:
        _stdout_lines([json_bytes({"session": session, "approval": approval, "actions": decided, "reject": reject})])
        return
    what = "rejected" if reject else "approved"
    _progress(f"{what} {', '.join(map(str, decided))} of {session} (event {approval})")


def _who() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):
        return "cli"

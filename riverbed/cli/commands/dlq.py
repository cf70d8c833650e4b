"""`riverbed dlq list|requeue`."""

from __future__ import annotations

from typing import Annotated, Any

import typer
import typer.core
import typer.main
from rich.table import Table

from riverbed.cli.app import Invocation, JsonOption, PrefixOption, app
from riverbed.cli.output import _cell, _stdout_lines, err_console, json_bytes, out_console

dlq_app = typer.Typer(help="Dead letters: entries a role could not handle.", no_args_is_help=True)
app.add_typer(dlq_app, name="dlq")


@dlq_app.command("list")
def dlq_list(json_out: JsonOption = False, prefix: PrefixOption = None) -> None:
    """List dead letters (oldest first)."""
    from riverbed.bus.dlq import DeadLetters  # noqa: PLC0415

    cli = Invocation(prefix)

    async def go() -> list[Any]:
        bus = await cli.bus()
        return list(await DeadLetters(bus.client, bus.keys).list())

    letters = cli.run(go)
    if json_out:
        _stdout_lines(json_bytes(letter.as_dict()) for letter in letters)
        return
    table = Table("id", "session", "event", "role", "attempts", "reason")
    for letter in letters:
        table.add_row(
            letter.id, letter.session, str(letter.event_id), letter.role, str(letter.attempts), _cell(letter.reason)
        )
    out_console().print(table)


@dlq_app.command("requeue")
def dlq_requeue(
    letter_id: Annotated[str, typer.Argument(help="Dead letter id (from `riverbed dlq list`).")],
    prefix: PrefixOption = None,
) -> None:
    """Append the dead-lettered event to its session again (a new id) and remove the dead letter."""
    from riverbed.bus.dlq import DeadLetters  # noqa: PLC0415

    cli = Invocation(prefix)

    async def go() -> int:
        bus = await cli.bus()
        return await DeadLetters(bus.client, bus.keys).requeue(letter_id, bus.log_store)

    new_id = cli.run(go)
    err_console.print(f"requeued dead letter {letter_id} as event {new_id}")

"""`riverbed archive`: retention of one session now."""

from __future__ import annotations

from typing import Annotated

import typer
import typer.core
import typer.main

from riverbed.cli.app import Invocation, PrefixOption, SessionArg, _require_events, app
from riverbed.cli.output import err_console
from riverbed.errors import (
    ConfigError,
)


@app.command("archive")
def archive_command(
    session: SessionArg,
    older_than: Annotated[
        float | None,
        typer.Option(
            "--older-than",
            help="Only events older than this many seconds (default RIVERBED_RETENTION_SECONDS, else 0).",
            show_default=False,
        ),
    ] = None,
    keep_last: Annotated[
        int | None,
        typer.Option(
            "--keep-last",
            help="Events always left in Redis (default RIVERBED_RETENTION_KEEP_LAST, else 1000).",
            show_default=False,
        ),
    ] = None,
    prefix: PrefixOption = None,
) -> None:
    """Copy the old events every role has finished with to the Postgres archive, then trim them from Redis."""
    from riverbed.bus.archive import retain  # noqa: PLC0415

    cli = Invocation(prefix, retention_keep_last=keep_last)
    if not cli.settings.database_url:
        raise ConfigError("riverbed archive needs RIVERBED_DATABASE_URL: the Postgres database that keeps the archive")
    age = older_than if older_than is not None else cli.settings.retention_seconds

    async def go() -> tuple[int, str]:
        bus = await cli.bus()
        await _require_events(bus, session)
        assert bus.archive is not None
        trimmed = await retain(
            bus.client,
            bus.keys,
            bus.archive,
            session,
            older_than_seconds=age,
            keep_last=cli.settings.retention_keep_last,
        )
        return trimmed, (await bus.log_store.meta(session)).get("archived_to", "0")

    trimmed, archived_to = cli.run(go)
    err_console.print(_said(session, trimmed, int(archived_to), age, cli.settings.retention_keep_last), markup=False)


def _said(session: str, trimmed: int, archived_to: int, age: float, keep_last: int) -> str:
    """What ``archive`` did, as a sentence."""
    if trimmed:
        noun = "event" if trimmed == 1 else "events"
        return (
            f"Moved {trimmed} {noun} of session {session} from Redis to the Postgres archive, "
            f"which now holds its events 1 to {archived_to}; the rest stay in Redis."
        )
    old = f"older than {age:g} seconds, " if age else ""
    if archived_to:
        return (
            f"Nothing more was archived: the archive already holds events 1 to {archived_to} of session "
            f"{session}, and no later event is {old}outside the last {keep_last} and done with by every role."
        )
    return (
        f"Nothing was archived: session {session} has no event {old}outside its last {keep_last} "
        "that every role is done with."
    )

"""`riverbed sessions` and `riverbed status`."""

from __future__ import annotations

import datetime as dt
from typing import Any

from rich.table import Table
from rich.text import Text

from riverbed.bus import status
from riverbed.cli.app import Invocation, JsonOption, PrefixOption, _progress, app
from riverbed.cli.output import _cell, _stdout_lines, json_bytes, out_console

# --- sessions, schema ------------------------------------------------------------------------


def _iso_ms(value: str | None) -> str | None:
    if not value:
        return None
    return dt.datetime.fromtimestamp(int(value) / 1000, dt.UTC).isoformat(timespec="milliseconds")


@app.command("sessions")
def sessions_cmd(as_json: JsonOption = False, prefix: PrefixOption = None) -> None:
    """Every session: its last event id, tenant and creation time."""
    cli = Invocation(prefix)

    async def go() -> list[dict[str, Any]]:
        bus = await cli.bus()
        metas = await status.session_metas(bus.client, bus.keys, await bus.sessions())
        return [
            {
                "session": meta.session,
                "last": meta.last,
                "tenant": meta.tenant,
                "created": _iso_ms(str(meta.created_ms) if meta.created_ms is not None else None),
            }
            for meta in metas
        ]

    rows = cli.run(go)
    if as_json:
        _stdout_lines(json_bytes(row) for row in rows)
        return
    if not rows:
        _progress("no sessions yet")
        return
    table = Table("session", "last id", "tenant", "created", box=None, header_style="bold")
    for row in rows:
        table.add_row(row["session"], str(row["last"]), _cell(row["tenant"] or ""), row["created"] or "")
    out_console().print(table)


# --- operations ----------------------------------------------------------------------------


@app.command("status")
def status_command(json_out: JsonOption = False, prefix: PrefixOption = None) -> None:
    """Roles, workers, owners, lag, pending and dead letters."""
    cli = Invocation(prefix)

    async def go() -> Any:
        bus = await cli.bus()
        return await status.status(bus.client, bus.keys)

    snapshot = cli.run(go)
    if json_out:
        _stdout_lines([json_bytes(snapshot)])
        return
    console = out_console()
    table = Table("role", "lag", "pending", "oldest pending (s)", "owned sessions", "waiting for an owner")
    for role in snapshot.roles:
        owned = sum(1 for s in role.sessions if s.owned)
        table.add_row(
            role.role,
            str(role.lag),
            str(role.pending),
            f"{role.oldest_pending_seconds:.1f}",
            str(owned),
            str(role.directory.lag),
        )
    console.print(table)
    workers = Table("worker", "roles", "heartbeat age (s)", "owned", "sandbox")
    for w in snapshot.workers:
        owned_by_role = w.description.get("owned", {})
        sandbox = " ".join(str(w.description[key]) for key in ("sandbox", "bwrap") if w.description.get(key))
        workers.add_row(
            _cell(w.name),
            ",".join(w.description.get("roles", [])),
            f"{w.age_seconds:.1f}",
            ", ".join(f"{r}:{len(s)}" for r, s in owned_by_role.items()),
            _cell(sandbox),
        )
    console.print(workers)
    for failure in snapshot.failing:  # a loop that keeps failing says so (and /readyz is red)
        since = dt.datetime.fromtimestamp(failure.since, dt.UTC).isoformat(timespec="seconds")
        line = Text("failing: ", style="bold red")
        line.append(
            f"worker {failure.worker}, {failure.role} {failure.loop} loop, since {since} "
            f"({failure.attempts} attempts): {failure.error}"
        )
        console.print(line)
    console.print(f"sessions: {snapshot.sessions}   dead letters: {snapshot.dead_letters}")

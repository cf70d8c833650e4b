"""`riverbed act` and `riverbed append`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
import typer.core
import typer.main

from riverbed import events
from riverbed.cli.app import Invocation, PrefixOption, SessionArg, app
from riverbed.cli.output import _stdout_lines, json_bytes
from riverbed.errors import (
    InputError,
)


def _json_argument(text: str) -> bytes:
    """The JSON an argument gives: the text itself, ``@FILE`` (a file's contents) or ``-`` (stdin)."""
    if text == "-":
        return sys.stdin.buffer.read()
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            return path.read_bytes()
        except OSError as exc:
            raise InputError(f"cannot read {text[1:]}: {exc.strerror or exc}") from exc
    return text.encode("utf-8", "surrogateescape")


def _action_from_json(text: str) -> events.Action:
    event = events.from_json(_json_argument(text))
    if not isinstance(event, events.Action):
        raise InputError(
            f"{event.kind!r} is not an action (see `riverbed schema`); `riverbed append` appends other events"
        )
    events.check_client(event)
    return event


EventArg = Annotated[
    str,
    typer.Argument(
        help='JSON, e.g. \'{"kind": "cmd_run", "command": "ls"}\'; @FILE reads it from a file, - from stdin.',
        show_default=False,
    ),
]
TenantOption = Annotated[
    str | None,
    typer.Option(
        "--tenant", help="Tenant of a new session; on an existing one, checked against its own (default: its own)."
    ),
]
AgentOption = Annotated[str | None, typer.Option("--agent", help="Agent name recorded on the events.")]


@app.command("act")
def act_command(
    session: SessionArg,
    action: EventArg,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for the observation.")] = 60.0,
    tenant: TenantOption = None,
    agent: AgentOption = None,
    prefix: PrefixOption = None,
) -> None:
    """Append one action, wait for its observation and print it as one JSON line.

    A kind nothing answers (message, think, finish) prints the appended action at once.
    """
    parsed = _action_from_json(action)
    cli = Invocation(prefix)

    async def go() -> bytes:
        bus = await cli.bus()
        handle = await bus.operate(session, tenant=tenant, agent=agent)
        answer = await handle.act(parsed, timeout=timeout)
        return json_bytes(answer)

    _stdout_lines([cli.run(go)])


@app.command("append")
def append_command(
    session: SessionArg,
    event: Annotated[
        str,
        typer.Argument(
            help="An event as JSON, or an array of events appended together; @FILE reads a file, - stdin.",
            show_default=False,
        ),
    ],
    expected_last: Annotated[
        int | None,
        typer.Option("--expected-last", help="Refuse unless the session's last event id is this.", show_default=False),
    ] = None,
    idempotency_key: Annotated[
        str | None,
        typer.Option("--idempotency-key", help="A retry with the same key appends nothing.", show_default=False),
    ] = None,
    tenant: TenantOption = None,
    agent: AgentOption = None,
    as_json: Annotated[bool, typer.Option("--json", help='Print {"session": …, "ids": […]}.')] = False,
    prefix: PrefixOption = None,
) -> None:
    """Append event(s) without waiting for an answer; prints the new id(s), one a line.

    Events only riverbed writes (forked, sandbox_rebuilt, a role's observations) are refused.
    """
    batch = events.events_from_json(_json_argument(event))
    for one in batch:
        events.check_client(one)
    cli = Invocation(prefix)

    async def go() -> list[int]:
        bus = await cli.bus()
        handle = await bus.operate(session, tenant=tenant, agent=agent)
        return await handle.append(*batch, expected_last=expected_last, idempotency_key=idempotency_key)

    ids = cli.run(go)
    if as_json:
        _stdout_lines([json_bytes({"session": session, "ids": ids})])
    else:
        _stdout_lines(str(i).encode() for i in ids)

"""A session's events brought in from an export: parsing and validating the file, then
copying the events into a new session with the same ids (``riverbed import``).

:func:`parse_import` is pure and checks every line before anything is written;
:func:`import_session` appends them in batches with ``expected_last``, keeping ids,
timestamps and sources, after telling the runtime role where to start (so an imported
action that was answered already never runs again).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass

from msgspec.structs import replace

from riverbed import events
from riverbed.agent.replay import RuntimeStart, start_runtime_after, write_copies
from riverbed.bus.log import answered_cause
from riverbed.client.session import Bus
from riverbed.errors import AppendConflict, InputError

__all__ = ["IMPORT_BATCH", "ImportRow", "import_session", "normalise_ts", "parse_import"]

IMPORT_BATCH = 1000
"""Events per append when importing (one Lua call each)."""


@dataclass(frozen=True)
class ImportRow:
    """One validated line of an export: its line number, the encoded event, the action it
    answers (0: none), its tenant and the event with its id."""

    line: int
    payload: bytes
    cause: int
    tenant: str | None
    event: events.Event


def normalise_ts(event: events.Event) -> events.Event:
    """Timestamps are UTC; a naive one in a hand-written file is taken as UTC."""
    ts = event.ts
    if ts.tzinfo is None:
        return replace(event, ts=ts.replace(tzinfo=dt.UTC))
    if ts.utcoffset() != dt.timedelta(0):
        return replace(event, ts=ts.astimezone(dt.UTC))
    return event


def parse_import(
    lines: Iterable[bytes], name: str, *, keep_unknown: bool = False, max_bytes: int | None = None
) -> list[ImportRow]:
    """Validate every line of an export and encode it; raises InputError naming the first bad line.

    Ids, when present, must be 1, 2, 3… in file order; missing ids are assigned by position.
    A line is read as the log reads it (fields a newer version wrote are ignored), then
    checked like any appended event: the schema's bounds, nesting, ``max_bytes``, reserved
    environment names.
    """
    rows: list[ImportRow] = []
    answered: dict[int, int] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line:
            continue
        where = f"{name} line {number}"
        try:
            event = events.decode_json(line, keep_id=True)
        except events.DecodeError as exc:
            raise InputError(f"{where}: {exc}") from exc
        expected_id = len(rows) + 1
        if event.id is not None and event.id != expected_id:
            raise InputError(
                f"{where}: event id {event.id} out of order (expected {expected_id}; ids must be 1, 2, 3… or absent)"
            )
        if isinstance(event, events.Unknown):
            payload = event.payload
            if "kind" not in payload:
                raise InputError(f"{where}: the object has no 'kind' field")
            if not keep_unknown:
                raise InputError(
                    f"{where}: unknown event kind {event.original_kind!r} or version "
                    "(`riverbed schema` lists the kinds; --keep-unknown imports it as it is)"
                )
            event = events.Unknown(payload={k: v for k, v in payload.items() if k != "id"})
        else:
            event = normalise_ts(replace(event, id=None))
        cause = answered_cause(event)
        if cause:
            if cause in answered:
                raise InputError(
                    f"{where}: action {cause} is already answered by event {answered[cause]} "
                    "(an action gets exactly one observation)"
                )
            answered[cause] = expected_id
        try:
            payload_bytes = events.check(event, max_bytes=max_bytes)
        except InputError as exc:
            raise InputError(f"{where}: {exc}") from exc
        rows.append(ImportRow(number, payload_bytes, cause, event.tenant, events.with_id(event, expected_id)))
    if not rows:
        raise InputError(f"{name} holds no events")
    return rows


async def import_session(bus: Bus, session: str, rows: Sequence[ImportRow], *, batch_size: int = IMPORT_BATCH) -> int:
    """Append ``rows`` (from :func:`parse_import`) to the new session ``session`` with their
    ids; refuses a session that has events.  Returns the number of events written."""
    start = RuntimeStart()
    for row in rows:
        start.see(row.event)
    store = bus.log_store
    store.check_session(session)
    existing = await store.last_id(session)
    if existing:
        raise InputError(
            f"session {session!r} already has {existing} events; import only into a new session (choose another --into)"
        )
    # Imported actions are answered already: a running runtime worker must not run them
    # again (as for a fork); one still unanswered in the file runs in the new session.
    await start_runtime_after(bus, session, start.after(len(rows)))

    async def copies() -> AsyncIterator[tuple[bytes, int]]:
        for row in rows:
            yield row.payload, row.cause

    try:
        return await write_copies(bus, session, copies(), tenant=rows[0].tenant, page_size=batch_size)
    except AppendConflict as exc:
        if exc.expected == 0:
            raise InputError(
                f"session {session!r} already has {exc.actual} events; import only into a new "
                "session (choose another --into)"
            ) from exc
        raise InputError(
            f"session {session!r} was written to by someone else during the import "
            f"(after event {exc.expected}); the import stopped there"
        ) from exc

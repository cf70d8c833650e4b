"""What the agent's context holds, what is hidden from it and why, and a user's edits of it.

Pure functions over a log's events (the I/O is in :mod:`riverbed.client.context`):

- :func:`report` folds the log like :func:`~riverbed.memory.view.view` and also says which
  events are hidden, by which ``condensation`` or ``context_edit``, and which are pinned;
- :func:`context_edit` builds a checked :class:`~riverbed.events.ContextEdit`;
- :func:`change` compares two reports: what an edit hid, showed again, pinned or unpinned;
- :func:`preview` is what an edit would change if it were appended now (nothing is appended);
- :func:`document` is a report's JSON form (``riverbed context --json`` and the HTTP API);
- :func:`parse_range` reads the CLI's ``12-40`` and ``7``.

An edit applies to whole units of the View (a tool call with its result, a model response
with its batch), so forgetting one error can hide the command it answers as well; the
change says exactly which events moved.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from riverbed.errors import InputError
from riverbed.events import Condensation, ContextEdit, Event, kinds, with_id
from riverbed.memory.view import View, ViewBuilder

__all__ = [
    "ContextChange",
    "ContextReport",
    "Hidden",
    "change",
    "context_edit",
    "describe",
    "document",
    "parse_range",
    "preview",
    "report",
]

Op = Literal["forget", "restore", "pin", "unpin"]


@dataclass(frozen=True, slots=True)
class Hidden:
    """A log event the agent does not see, and the condensation or edit that hid it."""

    event: Event
    by: Event


@dataclass(frozen=True, slots=True)
class ContextReport:
    """The context right after event ``view.last_id``: the view, the hidden events (in id
    order) and the ids of the pinned ones."""

    view: View
    hidden: tuple[Hidden, ...]
    pinned: frozenset[int]

    def hidden_ids(self) -> set[int]:
        return {h.event.id for h in self.hidden if h.event.id is not None}


@dataclass(frozen=True, slots=True)
class ContextChange:
    """What one edit changed: event ids newly hidden, shown again, pinned and unpinned."""

    edit: int
    hidden: tuple[int, ...] = ()
    shown: tuple[int, ...] = ()
    pinned: tuple[int, ...] = ()
    unpinned: tuple[int, ...] = ()


def report(events: Iterable[Event], until: int | None = None) -> ContextReport:
    """The context of a log (events with ids, in order) as it was right after ``until``."""
    builder = ViewBuilder()
    by_id: dict[int, Event] = {}
    for event in events:
        if until is not None and event.id is not None and event.id > until:
            break
        builder.append(event)
        if event.id is not None:
            by_id[event.id] = event
    hidden = tuple(Hidden(by_id[i], by_id[by]) for i, by in sorted(builder.hidden().items()))
    view = builder.view()
    return ContextReport(view, hidden, view.pinned)


def change(before: ContextReport, after: ContextReport, edit: int) -> ContextChange:
    """What happened between two reports of the same log (``edit`` appended in between)."""
    was, now = before.hidden_ids(), after.hidden_ids()
    return ContextChange(
        edit=edit,
        hidden=tuple(sorted(now - was)),
        shown=tuple(sorted(was - now)),
        pinned=tuple(sorted(after.pinned - before.pinned)),
        unpinned=tuple(sorted(before.pinned - after.pinned)),
    )


def preview(log: Sequence[Event], edit: ContextEdit) -> ContextChange:
    """What ``edit`` would change if it were appended right after ``log`` (the whole log, with
    ids, in order): the fold of the log with and without the hypothetical edit.  Pure: nothing
    is appended, and the change's ``edit`` is the id the edit would get."""
    edit_id = max((e.id for e in log if e.id is not None), default=0) + 1
    return change(report(log), report([*log, with_id(edit, edit_id)]), edit_id)


def document(session: str, context: ContextReport) -> dict[str, Any]:
    """A report's JSON form: visible ids, hidden ones with what hid each, pinned, summary."""
    view = context.view
    return {
        "session": session,
        "last_id": view.last_id,
        "visible": view.ids(),
        "summary": view.summary.content if view.summary is not None else None,
        "hidden": [
            {"id": h.event.id, "kind": h.event.kind, "by": h.by.id, "by_kind": h.by.kind, "why": describe(h.by)}
            for h in context.hidden
        ],
        "pinned": sorted(context.pinned),
    }


def describe(by: Event) -> str:
    """What hid an event, in words: ``condensation 20`` or ``forget --kind error (edit 25)``."""
    if isinstance(by, ContextEdit):
        what = [f"{start}-{end}" if start != end else str(start) for start, end in by.ranges]
        what += [f"--kind {kind}" for kind in by.kinds]
        note = f": {by.note}" if by.note else ""
        return f"user edit {by.id} ({by.op} {' '.join(what)}){note}"
    if isinstance(by, Condensation):
        summary = " with a summary" if by.summary else ""
        return f"{by.source} condensation {by.id}{summary}"
    return f"{by.kind} {by.id}"


def parse_range(text: str) -> tuple[int, int]:
    """``"12-40"`` is (12, 40), ``"7"`` is (7, 7); anything else is an :class:`InputError`."""
    start, sep, end = text.strip().partition("-")
    try:
        first = int(start)
        last = int(end) if sep else first
    except ValueError:
        raise InputError(f"{text!r} is not an event id or a range of them like 12-40") from None
    if first < 1 or last < first:
        raise InputError(f"{text!r} is not a range of event ids: ids start at 1 and a range is FIRST-LAST")
    return first, last


def context_edit(
    op: Op, ranges: Sequence[tuple[int, int]] = (), kinds_: Sequence[str] = (), *, note: str | None = None
) -> ContextEdit:
    """A checked edit: at least one range or kind, valid ranges, known kinds."""
    if not ranges and not kinds_:
        raise InputError(f"say which events to {op}: give event ids (12-40, 7) or a kind (--kind error)")
    for start, end in ranges:
        if start < 1 or end < start:
            raise InputError(f"[{start}, {end}] is not a range of event ids: ids start at 1 and a range is FIRST-LAST")
    known = set(kinds())
    unknown = sorted(set(kinds_) - known)
    if unknown:
        raise InputError(f"unknown event kind {unknown[0]!r} (known: {', '.join(sorted(known - {'unknown'}))})")
    return ContextEdit(op=op, ranges=[(s, e) for s, e in ranges], kinds=list(kinds_), note=note)

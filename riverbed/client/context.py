"""A user's control of the agent's context, on the session handle (``session.context``).

::

    async with riverbed.connect() as bus:
        context = bus.session("s-42").context
        report = await context.show()                 # visible, hidden (and why), pinned
        change = await context.forget(kinds=["error"])  # every error so far
        await context.restore(12, 40)                  # what a condenser or a forget hid
        await context.pin(7)                           # no condenser drops event 7
        await context.unpin(7)
        proposal = await context.suggest("drop the docker detour", client=client, model="gpt-4o-mini")
        await context.apply(proposal)                  # the proposal as a user condensation

Each operation appends one ``context_edit`` event (so edits are in the log: auditable,
replayed, forked, undone by the opposite edit, visible to ``view --until``) and returns the
:class:`~riverbed.memory.context.ContextChange` it made.  The edit is appended with the log's
last id as ``expected_last``, so the change reported is exactly the edit's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from riverbed import events
from riverbed.errors import AppendConflict, InputError
from riverbed.memory.context import ContextChange, ContextReport, Op, change, context_edit, preview, report
from riverbed.memory.suggest import Proposal, suggest

if TYPE_CHECKING:
    from openai import AsyncOpenAI

__all__ = ["ContextControl"]


class _Session(Protocol):
    """What the context operations use of a session handle (``client.session.Session``)."""

    id: str

    def stamp(self, event: events.Event) -> events.Event: ...

    async def append(
        self, *batch: events.Event, expected_last: int | None = None, idempotency_key: str | None = None
    ) -> list[int]: ...

    async def events(self, start: int = 1, end: int | None = None) -> list[events.Event]: ...


_ATTEMPTS = 5


class ContextControl:
    """The context operations of one session (see the module docstring)."""

    def __init__(self, session: _Session) -> None:
        self.session = session

    async def show(self, until: int | None = None) -> ContextReport:
        """The context right after event ``until`` (default: now), with what is hidden and why."""
        return report(await self.session.events(1, until), until)

    async def forget(
        self, start: int | None = None, end: int | None = None, *, kinds: Sequence[str] = (), note: str | None = None
    ) -> ContextChange:
        """Hide events ``start``..``end`` (``end`` defaults to ``start``), or every event of
        ``kinds`` so far (both: those of the kinds in the range)."""
        return await self.edit("forget", start, end, kinds=kinds, note=note)

    async def restore(
        self, start: int | None = None, end: int | None = None, *, kinds: Sequence[str] = (), note: str | None = None
    ) -> ContextChange:
        """Show again what a condensation or a forget hid (one id adds a recalled event back)."""
        return await self.edit("restore", start, end, kinds=kinds, note=note)

    async def pin(
        self, start: int | None = None, end: int | None = None, *, kinds: Sequence[str] = (), note: str | None = None
    ) -> ContextChange:
        """Keep these events out of every later condensation's reach."""
        return await self.edit("pin", start, end, kinds=kinds, note=note)

    async def unpin(
        self, start: int | None = None, end: int | None = None, *, kinds: Sequence[str] = (), note: str | None = None
    ) -> ContextChange:
        return await self.edit("unpin", start, end, kinds=kinds, note=note)

    async def preview(
        self,
        op: Op,
        *,
        ranges: Sequence[tuple[int, int]] = (),
        kinds: Sequence[str] = (),
        note: str | None = None,
    ) -> ContextChange:
        """What :meth:`edit` would change if made now, appending nothing (a dry run); refused
        as :meth:`edit` refuses it."""
        log = await self.session.events()
        self._within(log, ranges)
        return preview(log, context_edit(op, ranges, kinds, note=note))

    def _within(self, log: Sequence[events.Event], spans: Sequence[tuple[int, int]]) -> None:
        """:class:`InputError` when a range starts beyond the log: an edit names events that exist."""
        last = log[-1].id if log else 0
        beyond = [first for first, _ in spans if first > (last or 0)]
        if beyond:
            raise InputError(
                f"event {min(beyond)} is beyond the log of {self.session.id!r} (its last event is {last}): "
                "an edit names events that exist"
            )

    async def suggest(self, request: str, *, client: AsyncOpenAI, model: str, timeout: float = 120.0) -> Proposal:
        """Ask ``model`` what to drop for ``request`` (see :mod:`riverbed.memory.suggest`);
        nothing is appended until :meth:`apply`."""
        return await suggest(await self.session.events(), request, client=client, model=model, timeout=timeout)

    async def apply(self, proposal: Proposal) -> ContextChange:
        """Append the proposal's ``condensation`` (source user), only if the log has not moved
        since the proposal was made (so what was shown is exactly what happens)."""
        try:
            (event_id,) = await self.session.append(proposal.condensation, expected_last=proposal.last_id)
        except AppendConflict as exc:
            raise InputError(
                f"the session moved on since the proposal (it was made after event {proposal.last_id}): ask again"
            ) from exc
        return replace(proposal.change, edit=event_id)

    async def edit(
        self,
        op: Op,
        start: int | None = None,
        end: int | None = None,
        *,
        ranges: Sequence[tuple[int, int]] = (),
        kinds: Sequence[str] = (),
        note: str | None = None,
    ) -> ContextChange:
        """Append one ``context_edit`` and return what it changed."""
        spans = list(ranges)
        if start is not None:
            spans.append((start, start if end is None else end))
        edit = context_edit(op, spans, kinds, note=note)
        for attempt in range(_ATTEMPTS):
            log = await self.session.events()
            last = log[-1].id if log else 0
            self._within(log, spans)
            try:
                (edit_id,) = await self.session.append(edit, expected_last=last)
            except AppendConflict:
                if attempt == _ATTEMPTS - 1:
                    raise
                continue
            stamped = self.session.stamp(edit)
            before = report(log)
            after = report([*log, events.with_id(stamped, edit_id)])
            return change(before, after, edit_id)
        raise AssertionError("unreachable")  # pragma: no cover

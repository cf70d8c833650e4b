"""The View: the agent's context as a pure fold of a session's log.

The fold, event by event in id order:

- ``condensation`` and ``condensation_request`` events never appear, and neither do
  observations answering a ``condensation_request``.
- A :class:`~riverbed.events.Condensation` forgets every visible event whose id lies in one
  of its ``forgotten`` ranges (inclusive ``[start, end]``; only ids below the condensation's
  own id count, a range never reaches into the future; ranges with ``start > end`` are
  ignored).  Forgetting is permanent: a forgotten event never comes back.
- **Pairs stay whole, by dropping both.**  An action that expects an answer
  (``answered_by`` not None: not a message, think or finish) and the observations answering
  it (``observation.cause == action.id``) form a group: a tool call and its result.  When a
  condensation forgets any member of a group, it forgets the whole group; an observation
  that arrives for an action that is already forgotten is forgotten too.  Forgetting
  therefore only ever grows, which keeps the kept prefix stable.
- **The summary** is one synthetic :class:`Summary` event (``kind == "summary"``,
  ``id`` None, ``cause`` the id of the condensation that wrote it, ``source`` condenser).
  A condensation whose ``summary`` is not None replaces the previous summary (an empty
  string removes it); one whose ``summary`` is None keeps the previous one where it is.
  ``summary_offset`` is an index into the condensed view right after the condensation
  (clamped to its length); None means "where the first forgotten event was".  The position
  is then anchored to the event that followed it: the summary always sits just before the
  first visible event whose id is at least that anchor, so a later condensation that
  forgets the anchor moves the summary to the next surviving event, and events appended
  later come after it.

:class:`ViewBuilder` folds incrementally (amortized O(1) per event, plus O(log n) per
observation; each event is removed at most once), and :func:`view` is the full fold.
:class:`Masked` is the synthetic observation that observation masking puts in place of an
old observation's content (see ``riverbed.memory.condensers.mask_observations``); it keeps the original id and
cause, so pairs stay whole.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

from riverbed.errors import InputError
from riverbed.events import Action, Condensation, CondensationRequest, Event, Observation, Source

__all__ = ["Masked", "Summary", "View", "ViewBuilder", "view"]


class Summary(Event, frozen=True, kw_only=True, tag="summary"):
    """The current summary of forgotten events; lives only in views, never in a log."""

    source: Source = "condenser"

    content: str


class Masked(Observation, frozen=True, kw_only=True, tag="masked"):
    """An observation whose content is hidden from the model; lives only in views."""

    original_kind: str
    content: str


@dataclass(frozen=True, slots=True)
class View(Sequence[Event]):
    """The condensed context: visible events in order, the summary (if any) among them.

    ``last_id`` is the id of the last event folded (0 for an empty log), whether or not it
    is visible.
    """

    events: tuple[Event, ...] = ()
    last_id: int = 0
    summary_index: int | None = None

    @property
    def summary(self) -> Summary | None:
        if self.summary_index is None:
            return None
        item = self.events[self.summary_index]
        assert isinstance(item, Summary)
        return item

    def real_events(self) -> list[Event]:
        """The visible log events, without the summary."""
        if self.summary_index is None:
            return list(self.events)
        i = self.summary_index
        return [*self.events[:i], *self.events[i + 1 :]]

    def ids(self) -> list[int]:
        return [e.id for e in self.events if e.id is not None]

    def __len__(self) -> int:
        return len(self.events)

    @overload
    def __getitem__(self, index: int) -> Event: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Event]: ...
    def __getitem__(self, index: int | slice) -> Event | Sequence[Event]:
        return self.events[index]

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)


class ViewBuilder:
    """Incremental fold: ``append`` events in id order, read :meth:`view` at any time."""

    __slots__ = (
        "_actions",
        "_anchor",
        "_events",
        "_forgotten_actions",
        "_ids",
        "_last",
        "_obs_of",
        "_requests",
        "_summary",
    )

    def __init__(self, events: Iterable[Event] = ()) -> None:
        self._ids: list[int] = []  # visible event ids, ascending
        self._events: list[Event] = []  # visible events, parallel to _ids
        self._actions: set[int] = set()  # answerable actions ever seen (kept or forgotten)
        self._forgotten_actions: set[int] = set()
        self._obs_of: dict[int, list[int]] = {}  # kept action id -> its kept observations
        self._requests: set[int] = set()  # condensation_request ids (hidden)
        self._summary: Summary | None = None
        self._anchor = 0
        self._last = 0
        self.extend(events)

    @property
    def last_id(self) -> int:
        return self._last

    def __len__(self) -> int:
        return len(self._ids) + (self._summary is not None)

    def extend(self, events: Iterable[Event]) -> None:
        for event in events:
            self.append(event)

    def append(self, event: Event) -> None:
        eid = event.id
        if eid is None:
            raise InputError(f"a {event.kind} event without an id cannot be folded into a view; read it from a log")
        if eid <= self._last:
            raise InputError(
                f"event {eid} arrived after event {self._last}: a view folds events in increasing id order"
            )
        self._last = eid
        if isinstance(event, Observation):
            if isinstance(event, Condensation):
                self._condense(event, eid)
                return
            cause = event.cause
            if cause is not None:
                if cause in self._requests:
                    return
                if cause in self._actions:
                    if cause in self._forgotten_actions:
                        return
                    self._obs_of.setdefault(cause, []).append(eid)
        elif isinstance(event, Action):
            if isinstance(event, CondensationRequest):
                self._requests.add(eid)
                return
            if event.answered_by is not None:
                self._actions.add(eid)
        self._ids.append(eid)
        self._events.append(event)

    def view(self) -> View:
        if self._summary is None:
            return View(tuple(self._events), self._last, None)
        pos = bisect_left(self._ids, self._anchor)
        events = (*self._events[:pos], self._summary, *self._events[pos:])
        return View(events, self._last, pos)

    # --- condensation -------------------------------------------------------------------

    def _condense(self, cond: Condensation, cid: int) -> None:
        ids, events = self._ids, self._events
        ranges = _merge(cond.forgotten, cid - 1)
        removed: list[Event] = []
        for start, end in reversed(ranges):
            lo, hi = bisect_left(ids, start), bisect_right(ids, end)
            if lo < hi:
                removed.extend(events[lo:hi])
                del ids[lo:hi], events[lo:hi]
        first_removed = min((e.id for e in removed if e.id is not None), default=None)
        work = removed
        while work:
            partners: set[int] = set()
            for event in work:
                eid = event.id
                assert eid is not None
                if eid in self._actions:
                    self._forgotten_actions.add(eid)
                    partners.update(self._obs_of.pop(eid, ()))
                elif isinstance(event, Observation) and event.cause in self._obs_of:
                    partners.add(event.cause)
            work = self._remove(partners)
            if work:
                low = min(e.id for e in work if e.id is not None)
                first_removed = low if first_removed is None else min(first_removed, low)
        if cond.summary is None:
            return
        if not cond.summary:
            self._summary = None
            return
        if cond.summary_offset is None:
            self._anchor = cid if first_removed is None else first_removed
        else:
            offset = min(max(cond.summary_offset, 0), len(ids))
            self._anchor = ids[offset] if offset < len(ids) else cid
        self._summary = Summary(content=cond.summary, cause=cid, ts=cond.ts, agent=cond.agent, tenant=cond.tenant)

    def _remove(self, wanted: set[int]) -> list[Event]:
        """Remove the visible events with these ids; return the ones that were visible."""
        ids, events = self._ids, self._events
        out: list[Event] = []
        if len(wanted) > 64:
            keep_ids: list[int] = []
            keep_events: list[Event] = []
            for i, e in zip(ids, events, strict=True):
                if i in wanted:
                    out.append(e)
                else:
                    keep_ids.append(i)
                    keep_events.append(e)
            ids[:], events[:] = keep_ids, keep_events
            return out
        for wid in sorted(wanted, reverse=True):
            pos = bisect_left(ids, wid)
            if pos < len(ids) and ids[pos] == wid:
                out.append(events[pos])
                del ids[pos], events[pos]
        return out


def _merge(ranges: Iterable[tuple[int, int]], limit: int) -> list[tuple[int, int]]:
    """Valid ranges clipped to ``limit``, sorted and merged."""
    clipped = sorted((s, min(e, limit)) for s, e in ranges if s <= e and s <= limit)
    merged: list[tuple[int, int]] = []
    for s, e in clipped:
        if merged and s <= merged[-1][1] + 1:
            if e > merged[-1][1]:
                merged[-1] = (merged[-1][0], e)
        else:
            merged.append((s, e))
    return merged


def view(events: Iterable[Event], until: int | None = None) -> View:
    """The condensed view of a log (events with ids, in order), as it was right after ``until``."""
    builder = ViewBuilder()
    for event in events:
        if until is not None and event.id is not None and event.id > until:
            break
        builder.append(event)
    return builder.view()

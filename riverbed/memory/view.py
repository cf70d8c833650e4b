"""The View: the agent's context as a pure fold of a session's log.

The fold, event by event in id order:

- ``condensation``, ``condensation_request`` and ``context_edit`` events never appear, and
  neither do observations answering a ``condensation_request``.
- **Units.**  Events that must be shown together form a unit, kept whole or hidden whole:

  - an action that expects an answer (``answered_by`` not None: not a message, think or
    finish) and the observations answering it (``observation.cause == action.id``): a tool
    call and its result;
  - a model response's batch: an ``llm_response``, the actions and observations whose
    ``cause`` is the response, and the actions that name one of its tool calls in
    ``tool_call_id`` (without a ``cause``; the latest earlier response with that call id).

  Every event joins at most one earlier event's unit, so units are trees; an event that
  joins a hidden unit is hidden too.
- A :class:`~riverbed.events.Condensation` hides every unit with a visible member whose id
  lies in one of its ``forgotten`` ranges (inclusive ``[start, end]``; only ids below the
  condensation's own id count, a range never reaches into the future; ranges with
  ``start > end`` are ignored), except pinned units.
- A :class:`~riverbed.events.ContextEdit` (a user's edit) targets the earlier events in its
  ranges and of its kinds: ``forget`` hides their units (pinned ones too), ``restore`` shows
  hidden ones again (whoever hid them), ``pin`` protects their units from every later
  condensation and ``unpin`` ends that.  Without edits, forgetting only ever grows, which
  keeps the kept prefix stable.
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

:class:`ViewBuilder` folds incrementally (amortized O(1) per event; a condensation costs
O(view), column by column, and a user's edit O(n)), and :func:`view` is the full fold.
``append`` checks the id and queues the event; the queue is folded in one pass when anything
is read (or when a builder that lets hidden events go is given a user's edit);
:meth:`ViewBuilder.hidden` says which condensation or edit hid each hidden event.
:class:`Masked` is the synthetic observation that observation masking puts in place of an
old observation's content (see ``riverbed.memory.condensers.mask_observations``); it keeps the original id and
cause, so pairs stay whole.
"""

from __future__ import annotations

import zlib
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import compress, islice, takewhile
from operator import attrgetter, lt
from typing import TYPE_CHECKING, overload

import msgspec

from riverbed.errors import InputError
from riverbed.events import (
    Action,
    Condensation,
    CondensationRequest,
    ContextEdit,
    Event,
    LlmResponse,
    Observation,
    Source,
    kind_of,
)
from riverbed.events import kinds as event_kinds
from riverbed.memory.units import ANSWERABLE, CALL_IDS_KEPT, RESPONSE, CallOwners, unit_links

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["HistoryReleased", "Masked", "Summary", "View", "ViewBuilder", "id_runs", "unit_links", "view"]


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
    is visible; ``pinned`` holds the ids of the events a user pinned (no condenser drops them).
    """

    events: tuple[Event, ...] = ()
    last_id: int = 0
    summary_index: int | None = None
    pinned: frozenset[int] = frozenset()

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


# How the fold treats an event class (ViewBuilder._learn); the two kinds of actions first.
_ACTION = 0  # joins the response it names; nothing joins it
_ANSWERABLE_ACTION = 1  # joins the response it names; its observations join it
_OBSERVATION = 2
_LLM_RESPONSE = 3
_CONDENSATION = 4
_REQUEST = 5
_OTHER = 6
_EDIT = 7  # (a builder that lets hidden events go folds a ContextEdit itself when appended)
_id_of = attrgetter("id")
_BATCH = 1024  # events appended to the last batch kept rather than starting one


class HistoryReleased(Exception):
    """A ``restore`` needs hidden events that a builder made with ``keep_hidden=False`` let
    go: fold the log again from its start with one that keeps them (nothing was changed)."""


_KIND_CODES: dict[str, int] = {}


def _kind_code(kind: str) -> int:
    code = _KIND_CODES.get(kind)
    if code is None:
        code = _KIND_CODES[kind] = len(_KIND_CODES) + 1
        if code > 255:
            raise InputError(f"more than 255 kinds of events folded; {kind!r} is one too many")
    return code


FROZEN_VERSION = 1


def _column(raw: bytes, itemsize: int) -> npt.NDArray[np.int64]:
    import numpy as np  # noqa: PLC0415  (a tenth of a second to load: only a frozen fold and pins read columns)

    return np.frombuffer(raw, dtype=np.int32 if itemsize == 4 else np.int64).astype(np.int64)


def _packed(values: npt.NDArray[np.int64], itemsize: int) -> bytes:
    import numpy as np  # noqa: PLC0415  (see _column)

    return values.astype(np.int32 if itemsize == 4 else np.int64).tobytes()


def _numbers(column: list[int], first: int = 0) -> npt.NDArray[np.int64]:
    import numpy as np  # noqa: PLC0415  (see _column)

    return np.fromiter(islice(column, first, None), dtype=np.int64, count=max(0, len(column) - first))


class _Frozen(msgspec.Struct, array_like=True):
    """A lean :class:`ViewBuilder` without its events (see :meth:`ViewBuilder.freeze`)."""

    version: int
    last: int
    kinds: list[str]  # kind code - 1 -> kind (codes are this process's)
    kind: bytes
    itemsize: int
    root: bytes  # id - root (-1: not folded), compressed
    next: bytes  # next member - id (0: none), compressed (written for earlier readers; read from root)
    hidden_by: bytes
    visible: list[int]
    pinned: list[int]
    requests: list[int]
    summary: int  # the condensation whose summary the view shows (0: none)
    anchor: int
    units_base: int
    units_flags: bytes
    call_owner: list[tuple[str, int]]
    tails: list[tuple[int, int]]  # (for earlier readers: written empty, not read)


class ViewBuilder:
    """Incremental fold: ``append`` events in id order, read :meth:`view` at any time.

    Per folded event it keeps a few bytes (kind, unit, what hid it: arrays indexed by id)
    and the visible events themselves.  Hidden events are kept too (the events as they were
    appended: a ``restore`` shows them again) unless ``keep_hidden`` is False: then a long
    session costs a role only its visible context, and a restore of released events raises
    :class:`HistoryReleased`.
    """

    __slots__ = (
        "_anchor",
        "_batches",
        "_calls",
        "_changes",
        "_events",
        "_firsts",
        "_flag_of",
        "_hidden_by",
        "_ids",
        "_keep_hidden",
        "_kind",
        "_last",
        "_pending",
        "_pinned",
        "_pinned_ids",
        "_requests",
        "_root",
        "_summary",
        "_summary_from",
        "_types",
    )

    def __init__(self, events: Iterable[Event] = (), *, keep_hidden: bool = True) -> None:
        self._keep_hidden = keep_hidden
        self._ids: list[int] = []  # visible event ids, ascending
        self._events: list[Event] = []  # visible events, parallel to _ids
        # The columns, indexed by event id: lists, which Python reads and writes fastest.
        self._kind = [0]  # event id -> kind code (0: not folded, e.g. a condensation)
        self._root = [0]  # event id -> its unit's first event id (0: itself, or not folded)
        self._hidden_by = [0]  # unit root -> the condensation or edit hiding it (0: none)
        self._batches: list[list[Event]] = []  # every event folded, as appended (with keep_hidden)
        self._firsts: list[int] = []  # the id of each batch's first event
        self._pinned: set[int] = set()  # pinned unit roots
        self._pinned_ids: tuple[frozenset[int], int] | None = None  # their members, folded up to an id
        self._calls = CallOwners()
        self._requests: set[int] = set()  # condensation_request ids (hidden)
        self._summary: Summary | None = None
        self._summary_from = 0  # (a thawed builder: the condensation whose summary it awaits)
        self._anchor = 0
        self._last = 0
        self._pending: list[Event] = []  # appended, not folded yet (see _fold)
        self._types: dict[type[Event], tuple[int, int]] = {}  # event class -> its kind code and fold role
        self._changes = 0  # the folds that changed the view other than at its end (see changes)
        self._flag_of = [0] * 256  # kind code -> ANSWERABLE | RESPONSE: what other events join
        self.extend(events)

    @property
    def last_id(self) -> int:
        return self._last

    def __len__(self) -> int:
        self._flush()
        return len(self._ids) + (self._summary is not None)

    @property
    def changes(self) -> int:
        """How many times the view changed other than by events added at its end (a
        condensation, a context edit, :meth:`fill`).  While it stays the same, the view is the
        one read before with :meth:`shown_since`'s events after it: a reader that keeps what it
        made of the view reads only those (``agent/prompt.py``) instead of the whole view."""
        self._flush()
        return self._changes

    def shown_since(self, count: int) -> list[Event]:
        """The visible events after the first ``count`` of them (the summary not counted): the
        events added to the view since it showed ``count``, while :attr:`changes` stays."""
        self._flush()
        return self._events[count:]

    def pinned_ids(self) -> frozenset[int]:
        """The view's ``pinned``, without making the view."""
        self._flush()
        return self._pinned_members()

    def extend(self, events: Iterable[Event]) -> None:
        if isinstance(events, list) and events:
            # At once when every id is new and increasing and no event is a context edit.
            ids = list(map(_id_of, events))
            if (
                None not in ids
                and ids[0] > self._last
                and all(map(lt, ids, islice(ids, 1, None)))
                and (self._keep_hidden or ContextEdit not in set(map(type, events)))
            ):
                self._pending += events
                self._last = ids[-1]
                return
        pending, last = self._pending, self._last
        for event in events:
            eid = event.id
            if eid is None or eid <= last or (not self._keep_hidden and type(event) is ContextEdit):
                self._last = last
                self.append(event)  # (raises, or folds the edit at once)
                pending, last = self._pending, self._last
                continue
            last = eid
            pending.append(event)
        self._last = last

    # --- saving a fold: a lean builder without its events, and back ----------------------

    def freeze(self) -> bytes:
        """This fold without any event (a few bytes per event, compressed): :meth:`thaw` and
        :meth:`fill` with the visible events and the summary's condensation make it again."""
        import numpy as np  # noqa: PLC0415  (see _column)

        self._flush()
        kinds = bytes(self._kind)
        size = 4 if len(kinds) <= 2**31 else 8
        ids = np.arange(len(kinds), dtype=np.int64)
        root = _numbers(self._root)
        folded = np.frombuffer(kinds, dtype=np.uint8) > 0
        root = np.where(root > 0, root, np.where(folded, ids, 0))  # (a unit's first event: 0 in the column)
        # Each member's next one in its unit, in id order (what readers before this one walk).
        members = np.flatnonzero(folded)
        chained = members[np.argsort(root[members], kind="stable")]
        same = root[chained[1:]] == root[chained[:-1]]
        nxt = np.zeros_like(ids)
        nxt[chained[:-1][same]] = chained[1:][same]
        frozen = _Frozen(
            version=FROZEN_VERSION,
            last=self._last,
            kinds=list(_KIND_CODES),
            kind=zlib.compress(kinds, 1),
            itemsize=size,
            root=zlib.compress(_packed(np.where(root > 0, ids - root, -1), size), 1),
            next=zlib.compress(_packed(np.where(nxt > 0, nxt - ids, 0), size), 1),
            hidden_by=zlib.compress(_packed(_numbers(self._hidden_by), size), 1),
            visible=list(self._ids),
            pinned=sorted(self._pinned),
            requests=sorted(self._requests),
            summary=self._summary.cause or 0 if self._summary is not None else 0,
            anchor=self._anchor,
            units_base=0,
            units_flags=zlib.compress(kinds.translate(bytes(self._flag_of)), 1),
            call_owner=self._calls.items(),
            tails=[],
        )
        return msgspec.msgpack.encode(frozen)

    @classmethod
    def thaw(cls, blob: bytes) -> tuple[ViewBuilder, list[int]]:
        """A lean builder from :meth:`freeze`'s bytes, and the ids of the events it still
        needs (:meth:`fill`).  :class:`InputError` when the bytes are not such a fold."""
        import numpy as np  # noqa: PLC0415  (see _column)

        try:
            frozen = msgspec.msgpack.decode(blob, type=_Frozen)
            if frozen.version != FROZEN_VERSION or frozen.itemsize not in (4, 8):
                raise InputError(f"a saved view of format {frozen.version} cannot be read by this version")
            codes = bytes([0, *(_kind_code(k) for k in frozen.kinds)])
            kind = bytearray(zlib.decompress(frozen.kind).translate(codes.ljust(256, b"\0")))
            size = frozen.itemsize
            ids = np.arange(len(kind), dtype=np.int64)
            root_delta = _column(zlib.decompress(frozen.root), size)
            next_delta = _column(zlib.decompress(frozen.next), size)
            hidden_by = zlib.decompress(frozen.hidden_by)
            if not len(root_delta) == len(next_delta) == len(hidden_by) // size == len(kind):
                raise InputError("a saved view's columns differ in length")
        except (msgspec.DecodeError, zlib.error, ValueError) as exc:
            raise InputError(f"a saved view cannot be read: {exc}") from exc
        builder = cls(keep_hidden=False)
        builder._last = frozen.last
        builder._kind = list(kind)
        builder._root = np.where(root_delta >= 0, ids - root_delta, 0).tolist()
        builder._hidden_by = _column(hidden_by, size).tolist()
        builder._ids = list(frozen.visible)
        builder._pinned = set(frozen.pinned)
        builder._requests = set(frozen.requests)
        builder._anchor = frozen.anchor
        builder._calls = CallOwners(frozen.call_owner)
        known = event_kinds()
        for name in frozen.kinds:  # (what joins what follows from the kinds, see _learn)
            if name in known:
                builder._learn(known[name])
        builder._summary_from = frozen.summary
        wanted = [*frozen.visible, frozen.summary] if frozen.summary else list(frozen.visible)
        return builder, sorted(set(wanted))

    def fill(self, events: Iterable[Event]) -> None:
        """Give a thawed builder the events it named (more are ignored); :class:`InputError`
        when one is missing."""
        self._flush()
        by_id = {e.id: e for e in events if e.id is not None}
        missing = [i for i in self._ids if i not in by_id]
        if missing:
            raise InputError(f"a saved view needs events the log did not give: {missing[:5]}")
        self._events = [by_id[i] for i in self._ids]
        self._changes += 1
        if self._summary_from:
            cond = by_id.get(self._summary_from)
            if not isinstance(cond, Condensation) or not cond.summary:
                raise InputError(f"a saved view's summary is not in condensation {self._summary_from}")
            cid = self._summary_from
            self._summary = Summary(content=cond.summary, cause=cid, ts=cond.ts, agent=cond.agent, tenant=cond.tenant)
        self._summary_from = 0

    def release_hidden(self) -> None:
        """From now on keep no hidden event (see :class:`HistoryReleased`)."""
        self._flush()
        self._keep_hidden = False
        self._batches.clear()
        self._firsts.clear()

    def append(self, event: Event) -> None:
        """Queue ``event`` (:class:`InputError` for one without an id or out of order).  A
        builder that lets hidden events go folds a user's edit at once: a restore it cannot
        do raises :class:`HistoryReleased` here and changes nothing (one that keeps them
        folds an edit in its turn, with the same result)."""
        eid = event.id
        if eid is None or eid <= self._last or (not self._keep_hidden and type(event) is ContextEdit):
            self._append_slowly(event)
            return
        self._pending.append(event)
        self._last = eid

    def _append_slowly(self, event: Event) -> None:
        """An event ``append`` does not only queue: it raises, or folds a context edit now."""
        eid = event.id
        if eid is None:
            raise InputError(f"a {event.kind} event without an id cannot be folded into a view; read it from a log")
        if eid <= self._last:
            raise InputError(
                f"event {eid} arrived after event {self._last}: a view folds events in increasing id order"
            )
        self._flush()
        self._edit(event, eid)  # type: ignore[arg-type]  # (first: a restore that cannot be done changes nothing)
        self._last = eid

    def _flush(self) -> None:
        if self._pending:
            batch, self._pending = self._pending, []
            self._fold(batch)

    def _learn(self, cls: type[Event]) -> tuple[int, int]:
        """The kind code and fold role of an event class (this builder's table: kind codes
        are this process's, see :meth:`thaw`)."""
        if issubclass(cls, ContextEdit):
            role = _EDIT
        elif issubclass(cls, Condensation):
            role = _CONDENSATION
        elif issubclass(cls, CondensationRequest):
            role = _REQUEST
        elif issubclass(cls, Observation):
            role = _OBSERVATION
        elif issubclass(cls, Action):
            role = _ANSWERABLE_ACTION if cls.answered_by is not None else _ACTION
        elif issubclass(cls, LlmResponse):
            role = _LLM_RESPONSE
        else:
            role = _OTHER
        code = _kind_code(kind_of(cls))
        self._flag_of[code] = ANSWERABLE if role == _ANSWERABLE_ACTION else RESPONSE if role == _LLM_RESPONSE else 0
        info = self._types[cls] = (code, role)
        return info

    def _fold(self, batch: list[Event]) -> None:
        """Fold appended events (ids increasing) in one pass.

        The unit rule is :mod:`riverbed.memory.units`' (an observation joins the action or response it
        answers; an action joins the response it names), inlined here over the builder's
        columns (whether an event can be joined follows from its kind: ``_flag_of``): a
        member of a unit records the unit's first event (``_root``), and responses only
        queue their tool call ids (``_calls``).  Folding is most of the CPU an agent's step
        spends on its context.
        """
        last = batch[-1].id
        assert last is not None
        self._grow(last)
        flag_of, types, requests, calls = self._flag_of, self._types, self._requests, self._calls
        kind, root, hidden_by = self._kind, self._root, self._hidden_by
        show_id, show = self._ids.append, self._events.append
        queue = calls.queued.append
        if self._keep_hidden:  # (hidden events are found there: nothing is copied when they hide)
            if self._batches and len(self._batches[-1]) < _BATCH:
                self._batches[-1] += batch  # (a step's few events: one list for many steps)
            else:
                self._batches.append(batch)
                self._firsts.append(batch[0].id)  # type: ignore[arg-type]
        n_kind = len(kind)
        # (The roles are written as numbers in the loop: see the constants above.)
        for event in batch:
            eid: int = event.id  # type: ignore[assignment]
            try:
                code, role = types[type(event)]
            except KeyError:
                code, role = self._learn(type(event))
            if role == 2:  # _OBSERVATION
                parent = event.cause
                if parent is None or not (0 < parent < n_kind and flag_of[kind[parent]]):
                    if parent is not None and parent in requests:
                        continue  # the answer to a condensation request
                    parent = 0
            elif role < 2:  # _ACTION, _ANSWERABLE_ACTION
                parent = event.cause
                if parent is None:
                    call_id = event.tool_call_id  # type: ignore[attr-defined]
                    parent = calls.get(call_id) if isinstance(call_id, str) else 0
                elif not (0 < parent < n_kind and flag_of[kind[parent]] == 2):  # _RESPONSE
                    parent = 0
            elif role == 3:  # _LLM_RESPONSE
                queue(event)  # type: ignore[arg-type]
                parent = 0
            elif role == 4:  # _CONDENSATION
                self._condense(event, eid)  # type: ignore[arg-type]
                continue
            elif role == 5:  # _REQUEST
                requests.add(eid)
                continue
            elif role == 7:  # _EDIT
                self._edit(event, eid)  # type: ignore[arg-type]
                continue
            else:
                parent = 0
            kind[eid] = code
            if not parent:
                show_id(eid)
                show(event)
                continue
            top = root[parent] or parent
            root[eid] = top
            if not hidden_by[top]:
                show_id(eid)
                show(event)
        # Queued responses are read back only as far as the ids kept (a long queue saves
        # work); they stay alive until then, so a builder that lets hidden events go keeps few.
        if len(calls.queued) >= (4 * CALL_IDS_KEPT if self._keep_hidden else 256):
            calls.settle()

    def _grow(self, eid: int) -> None:
        """Make room for ids up to ``eid``."""
        grow = eid + 1 - len(self._kind)
        if grow <= 0:
            return
        zeros = [0] * grow
        self._kind += zeros
        self._root += zeros
        self._hidden_by += zeros

    def view(self) -> View:
        self._flush()
        pinned = self._pinned_members()
        if self._summary is None:
            return View(tuple(self._events), self._last, None, pinned)
        pos = bisect_left(self._ids, self._anchor)
        events = (*self._events[:pos], self._summary, *self._events[pos:])
        return View(events, self._last, pos, pinned)

    def hidden(self) -> dict[int, int]:
        """Every hidden event's id, mapped to the id of the condensation or context edit that hid it."""
        self._flush()
        kind, root, hidden_by = self._kind, self._root, self._hidden_by
        return {i: hidden_by[root[i] or i] for i in range(1, len(kind)) if kind[i] and hidden_by[root[i] or i]}

    def _pinned_members(self) -> frozenset[int]:
        """The ids of the pinned units' members (kept: a step only adds what it folded)."""
        if not self._pinned:
            return frozenset()
        known, upto = self._pinned_ids if self._pinned_ids is not None else (frozenset(), 0)
        if upto < self._last:
            known = known.union(self._members(self._pinned, upto + 1))
            self._pinned_ids = (known, self._last)
        return known

    def _members(self, roots: Iterable[int], first: int = 1) -> list[int]:
        """The folded events from id ``first`` on whose unit is one of those that start at ``roots``."""
        import numpy as np  # noqa: PLC0415  (see _column)

        wanted = np.fromiter(roots, dtype=np.int64)
        if not len(wanted) or first >= len(self._kind):
            return []
        root = _numbers(self._root, first)
        ids = np.arange(first, first + len(root))
        tops = np.where(root > 0, root, ids)
        folded = _numbers(self._kind, first) > 0
        found: list[int] = ids[folded & np.isin(tops, wanted)].tolist()
        return found

    # --- condensations and edits ----------------------------------------------------------

    def _condense(self, cond: Condensation, cid: int) -> None:
        self._changes += 1
        ids = self._ids
        spans = [(bisect_left(ids, start), bisect_right(ids, end)) for start, end in _merge(cond.forgotten, cid - 1)]
        if self._pinned:
            root, pinned = self._root, self._pinned
            roots = [r for lo, hi in spans for r in [root[i] or i for i in ids[lo:hi]] if r not in pinned]
            removed = self._hide(roots, cid)
        else:
            removed = self._hide_spans([(lo, hi) for lo, hi in spans if lo < hi], cid)
        if cond.summary is None:
            return
        if not cond.summary:
            self._summary = None
            return
        if cond.summary_offset is None:
            self._anchor = removed or cid
        else:
            offset = min(max(cond.summary_offset, 0), len(ids))
            self._anchor = ids[offset] if offset < len(ids) else cid
        self._summary = Summary(content=cond.summary, cause=cid, ts=cond.ts, agent=cond.agent, tenant=cond.tenant)

    def _targets(self, edit: ContextEdit, eid: int) -> set[int]:
        """The unit roots of the events before ``eid`` in the edit's ranges and of its kinds."""
        if not edit.ranges and not edit.kinds:
            return set()
        kind = self._kind
        limit = min(eid - 1, len(kind) - 1)
        candidates: Iterable[int]
        if edit.ranges:
            candidates = (i for start, end in _merge(edit.ranges, limit) for i in range(max(start, 1), end + 1))
        else:
            candidates = range(1, limit + 1)
        if edit.kinds:
            codes = {_KIND_CODES[k] for k in edit.kinds if k in _KIND_CODES}
            return {self._root[i] or i for i in candidates if kind[i] in codes}
        return {self._root[i] or i for i in candidates if kind[i]}

    def _edit(self, edit: ContextEdit, eid: int) -> None:
        self._changes += 1
        roots = self._targets(edit, eid)
        if edit.op == "forget":
            self._hide(roots, eid)
        elif edit.op == "restore":
            self._show({r for r in roots if self._hidden_by[r]})
        elif edit.op == "pin":
            self._pinned |= roots
            self._pinned_ids = None
        elif edit.op == "unpin":
            self._pinned -= roots
            self._pinned_ids = None

    def _hide(self, roots: Iterable[int], by: int) -> int:
        """Hide these units (the visible ones); return the smallest id that was visible (0: none)."""
        hidden_by = self._hidden_by
        fresh = False
        for root in roots:
            if not hidden_by[root]:
                hidden_by[root] = by
                fresh = True
        return self._remove_hidden() if fresh else 0

    def _show(self, roots: set[int]) -> None:
        back = self._members(roots)
        if not back:
            return
        if not self._keep_hidden:
            raise HistoryReleased(f"restoring {len(back)} events needs them folded again from the log")
        for root in roots:
            self._hidden_by[root] = 0
        if len(back) > 64:
            by_id = dict(zip(self._ids, self._events, strict=True))
            by_id.update((i, self._folded(i)) for i in back)
            self._ids[:] = sorted(by_id)
            self._events[:] = [by_id[i] for i in self._ids]
            return
        for i in back:
            pos = bisect_left(self._ids, i)
            self._ids.insert(pos, i)
            self._events.insert(pos, self._folded(i))

    def _folded(self, eid: int) -> Event:
        """The event ``eid`` as it was folded (with keep_hidden)."""
        batch = self._batches[bisect_right(self._firsts, eid) - 1]
        return batch[bisect_left(batch, eid, key=_id_of)]

    def _hide_spans(self, spans: list[tuple[int, int]], by: int) -> int:
        """Hide the units of the visible events ``ids[lo:hi]`` of each span (a condensation's
        ranges, nothing pinned); return the smallest id that was visible (0: none).  Every
        event in a span goes; outside them only the other members of those units (few) are
        looked for."""
        if not spans:
            return 0
        ids, events, root, hidden_by = self._ids, self._events, self._root, self._hidden_by
        for lo, hi in spans:
            for i in ids[lo:hi]:
                top = root[i] or i
                if not hidden_by[top]:
                    hidden_by[top] = by
        first = ids[spans[0][0]]
        kept_ids: list[int] = []
        kept_events: list[Event] = []
        at = 0
        for lo, hi in [*spans, (len(ids), len(ids))]:
            if at < lo:  # between spans: members of a hidden unit go too
                stays = [not hidden_by[root[i] or i] for i in ids[at:lo]]
                kept_ids += compress(ids[at:lo], stays)
                kept_events += compress(events[at:lo], stays)
                if at == 0 and not all(stays):  # (a member before the first span)
                    first = ids[stays.index(False)]
            at = hi
        ids[:], events[:] = kept_ids, kept_events
        return first

    def _remove_hidden(self) -> int:
        """Remove the visible events whose unit is hidden, in one pass; return the smallest id removed (0: none)."""
        ids, events, root, hidden_by = self._ids, self._events, self._root, self._hidden_by
        stays = [not hidden_by[root[i] or i] for i in ids]
        if all(stays):
            return 0
        first = ids[stays.index(False)]
        ids[:], events[:] = compress(ids, stays), compress(events, stays)
        return first


def id_runs(ids: Iterable[int]) -> list[tuple[int, int]]:
    """Ascending ids as runs of consecutive ones, (first, last) each: 1, 2, 3, 7 is (1, 3), (7, 7)."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


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
    if until is None:
        builder.extend(events)
    else:
        builder.extend(takewhile(lambda e: e.id is None or e.id <= until, events))
    return builder.view()

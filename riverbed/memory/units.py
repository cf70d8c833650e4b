"""Which earlier event's unit each event joins: the rule of :mod:`riverbed.memory.view`'s
units, shared by the fold (which inlines it over its columns) and the condensers' planning
(:func:`unit_links`).

An observation joins the action that expects it (``answered_by`` not None) or the model
response it answers (its ``cause``); an action joins the response it names, by ``cause``, or,
without one, by ``tool_call_id`` (the latest earlier response that made that call, among
the latest :data:`CALL_IDS_KEPT` call ids).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import islice

from riverbed.events import Action, Event, LlmResponse, Observation

__all__ = ["ANSWERABLE", "CALL_IDS_KEPT", "RESPONSE", "CallOwners", "unit_links"]

ANSWERABLE = 1
"""An event's flag: an action its observations join."""
RESPONSE = 2
"""An event's flag: a model response its actions (and observations answering it) join."""
CALL_IDS_KEPT = 4096
"""Tool call ids remembered (the latest responses'): an action names a call of a recent response."""


class CallOwners:
    """The latest :data:`CALL_IDS_KEPT` tool call ids, each with the latest response that
    made it.  Responses are queued as they are folded and read into the table only when an
    id is looked up (an action naming a call without a ``cause``: few logs have them) or
    the queue is long, so a response costs the fold one list append, and a long queue is
    read from its newest response back, only as far as the ids kept."""

    __slots__ = ("_owners", "queued")

    def __init__(self, owners: Iterable[tuple[str, int]] = ()) -> None:
        # tool call id -> the latest response naming it, the id named longest ago first
        self._owners: OrderedDict[str, int] = OrderedDict(owners)
        self.queued: list[LlmResponse] = []  # responses not read into _owners yet

    def get(self, call_id: str) -> int:
        """The id of the latest response that made this call (0: none remembered)."""
        if self.queued:
            self.settle()
        return self._owners.get(call_id, 0)

    def items(self) -> list[tuple[str, int]]:
        self.settle()
        return list(self._owners.items())

    def settle(self) -> None:
        """Read the queued responses into the table: the same ids and owners, in the same
        order, as adding each response's ids in turn and dropping the oldest id whenever
        there is one too many."""
        newest: dict[str, int] = {}  # call id -> its latest response, the newest first
        for response in reversed(self.queued):
            eid: int = response.id  # type: ignore[assignment]
            for call in reversed(response.tool_calls):
                call_id = call.get("id") if isinstance(call, dict) else None
                if isinstance(call_id, str) and call_id not in newest:
                    newest[call_id] = eid
            if len(newest) >= CALL_IDS_KEPT:
                break
        self.queued.clear()
        latest = list(islice(newest, CALL_IDS_KEPT))
        latest.reverse()
        if len(latest) == CALL_IDS_KEPT:
            self._owners = OrderedDict(zip(latest, map(newest.__getitem__, latest), strict=True))
            return
        owners = self._owners
        for call_id in latest:
            owners.pop(call_id, None)
            owners[call_id] = newest[call_id]
        while len(owners) > CALL_IDS_KEPT:
            owners.popitem(last=False)


class _Units:
    """Which earlier event's unit each event joins (see the module docstring): the rule
    shared by the fold and the condensers' planning.  A byte of flags per event id (from
    the first one added), and the latest :data:`CALL_IDS_KEPT` tool call ids."""

    __slots__ = ("_base", "_calls", "_flags")

    def __init__(self) -> None:
        self._base = -1
        self._flags = bytearray()  # event id - base -> ANSWERABLE | RESPONSE
        self._calls = CallOwners()

    def _flag(self, eid: int) -> int:
        at = eid - self._base
        return self._flags[at] if 0 <= at < len(self._flags) and self._base >= 0 else 0

    def parent(self, event: Event) -> int | None:
        """The id of the earlier event whose unit ``event`` joins (None: it starts its own)."""
        cause = event.cause
        if isinstance(event, Observation):
            if cause is not None and self._flag(cause):
                return cause
        elif isinstance(event, Action):
            if cause is not None:
                return cause if self._flag(cause) & RESPONSE else None
            if isinstance(event.tool_call_id, str):
                return self._calls.get(event.tool_call_id) or None
        return None

    def add(self, event: Event) -> None:
        eid = event.id
        assert eid is not None
        if isinstance(event, Action) and event.answered_by is not None:
            flag = ANSWERABLE
        elif isinstance(event, LlmResponse):
            flag = RESPONSE
            self._calls.queued.append(event)
        else:
            return
        if self._base < 0:
            self._base = eid
        at = eid - self._base
        if at >= len(self._flags):
            self._flags.extend(bytes(at + 1 - len(self._flags)))
        self._flags[at] = flag


def unit_links(events: Sequence[Event]) -> list[tuple[int, int]]:
    """Index pairs ``(parent, child)`` of ``events`` (in id order) that belong to one unit."""
    units = _Units()
    index: dict[int, int] = {}
    links = []
    for i, event in enumerate(events):
        if event.id is None:
            continue
        parent = units.parent(event)
        if parent is not None and parent in index:
            links.append((index[parent], i))
        units.add(event)
        index[event.id] = i
    return links

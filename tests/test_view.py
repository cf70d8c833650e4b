"""The View fold against a deliberately naive reference, incremental vs full, time travel."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from riverbed.errors import InputError
from riverbed.events import (
    Action,
    CmdOutput,
    CmdRun,
    Condensation,
    CondensationRequest,
    ContextEdit,
    Error,
    Event,
    LlmResponse,
    Message,
    Observation,
    Think,
    with_id,
)
from riverbed.memory import view as view_module
from riverbed.memory.view import HistoryReleased, Summary, View, ViewBuilder, view

# --- the naive reference ----------------------------------------------------------------


def naive_parent(x: Event, seen: list[Event], machinery: set[int]) -> int | None:
    """The earlier event whose unit ``x`` joins, restated from the module docstring."""
    earlier = {y.id: y for y in seen if y.id < x.id and y.id not in machinery}
    cause = earlier.get(x.cause) if x.cause is not None else None
    if isinstance(x, Observation) and not isinstance(x, Condensation) and cause is not None:
        answerable = isinstance(cause, Action) and cause.answered_by is not None
        return cause.id if answerable or isinstance(cause, LlmResponse) else None
    if isinstance(x, Action) and not isinstance(x, CondensationRequest):
        if x.cause is not None:
            return cause.id if isinstance(cause, LlmResponse) else None
        if isinstance(x.tool_call_id, str):
            owners = [y.id for y in earlier.values() if isinstance(y, LlmResponse) and any(
                c.get("id") == x.tool_call_id for c in y.tool_calls)]  # fmt: skip
            return max(owners) if owners else None
    return None


NaiveState = tuple[list[tuple[Any, ...]], dict[int, int], set[int]]


def naive_state(events: list[Event], until: int | None = None) -> NaiveState:
    """Quadratic, obviously-correct restatement of the fold's rules: the view's keys, the hidden
    events (id -> what hid them) and the pinned events."""
    seen: list[Event] = []
    machinery: set[int] = set()
    root: dict[int, int] = {}
    hidden: dict[int, int] = {}  # unit root -> what hid it
    pinned: set[int] = set()  # unit roots
    summary: tuple[int, str] | None = None
    anchor = 0

    def visible() -> list[Event]:
        return [y for y in seen if y.id not in machinery and root[y.id] not in hidden]

    def targets(x: Event, ranges: list[tuple[int, int]], kinds: list[str]) -> set[int]:
        out = set()
        for y in seen:
            if y.id >= x.id or y.id in machinery:
                continue
            if ranges and not any(s <= y.id <= e for s, e in ranges if s <= e):
                continue
            if kinds and y.kind not in kinds:
                continue
            out.add(root[y.id])
        return out

    for x in events:
        if until is not None and x.id > until:
            break
        seen.append(x)
        answers_request = isinstance(x, Observation) and any(
            isinstance(y, CondensationRequest) and y.id == x.cause for y in seen
        )
        if isinstance(x, Condensation | CondensationRequest | ContextEdit) or answers_request:
            machinery.add(x.id)
        else:
            parent = naive_parent(x, seen, machinery)
            root[x.id] = x.id if parent is None else root[parent]
        if isinstance(x, ContextEdit):
            chosen = targets(x, x.ranges, x.kinds) if x.ranges or x.kinds else set()
            if x.op == "forget":
                for r in chosen:
                    hidden.setdefault(r, x.id)
            elif x.op == "restore":
                for r in chosen:
                    hidden.pop(r, None)
            elif x.op == "pin":
                pinned |= chosen
            else:
                pinned -= chosen
            continue
        if not isinstance(x, Condensation):
            continue
        before = {y.id for y in visible()}
        for y in visible():
            if y.id < x.id and any(s <= y.id <= e for s, e in x.forgotten if s <= e) and root[y.id] not in pinned:
                hidden.setdefault(root[y.id], x.id)
        if x.summary is None:
            continue
        if x.summary == "":
            summary = None
            continue
        kept = visible()
        if x.summary_offset is None:
            new = before - {y.id for y in kept}
            anchor = min(new) if new else x.id
        else:
            off = min(max(x.summary_offset, 0), len(kept))
            anchor = kept[off].id if off < len(kept) else x.id
        summary = (x.id, x.summary)
    out: list[tuple[Any, ...]] = []
    placed = summary is None
    for y in visible():
        if not placed and y.id >= anchor:
            out.append(("summary", *summary))  # type: ignore[misc]
            placed = True
        out.append(key(y))
    if not placed:
        out.append(("summary", *summary))  # type: ignore[misc]
    hidden_events = {i: hidden[r] for i, r in root.items() if r in hidden}
    pinned_events = {i for i, r in root.items() if r in pinned}
    return out, hidden_events, pinned_events


def naive_view(events: list[Event], until: int | None = None) -> list[tuple[Any, ...]]:
    return naive_state(events, until)[0]


def key(e: Event) -> tuple[Any, ...]:
    if isinstance(e, Summary):
        return ("summary", e.cause, e.content)
    return (e.kind, e.id)


def keys(v: View) -> list[tuple[Any, ...]]:
    return [key(e) for e in v]


# --- generated logs ---------------------------------------------------------------------

op = st.one_of(
    st.tuples(st.just("msg"), st.sampled_from(["user", "agent"])),
    st.tuples(st.just("act"), st.sampled_from(["plain", "caused", "named"])),
    st.tuples(st.just("act"), st.sampled_from(["plain", "caused", "named"])),
    st.tuples(st.just("obs"), st.integers(0, 4), st.booleans()),
    st.tuples(st.just("obs"), st.integers(0, 10_000), st.booleans()),
    st.tuples(
        st.just("cond"),
        st.lists(st.tuples(st.integers(-2, 60), st.integers(-3, 12)), max_size=3),
        st.sampled_from([None, "", "s1", "s2"]),
        st.one_of(st.none(), st.integers(-1, 30)),
    ),
    st.tuples(
        st.just("edit"),
        st.sampled_from(["forget", "restore", "pin", "unpin"]),
        st.lists(st.tuples(st.integers(0, 60), st.integers(-3, 12)), max_size=2),
        st.sampled_from([[], ["error"], ["cmd_output", "think"]]),
    ),
    st.tuples(st.just("req")),
    st.tuples(st.just("think")),
    st.tuples(st.just("llm"), st.integers(0, 2)),
    st.tuples(st.just("err")),
)


@st.composite
def logs(draw: st.DrawFn, max_size: int = 60) -> list[Event]:
    size = draw(st.integers(0, max_size))
    ops = draw(st.lists(op, min_size=size, max_size=size))
    gaps = draw(st.lists(st.integers(1, 3), min_size=len(ops), max_size=len(ops)))
    events: list[Event] = []
    next_id = 0
    last_llm: int | None = None
    for o, gap in zip(ops, gaps, strict=True):
        next_id += gap
        ev: Event
        match o:
            case ("msg", source):
                ev = Message(content=f"m{next_id}", source=source)
            case ("act", "caused"):
                ev = CmdRun(command=f"c{next_id}", cause=last_llm)
            case ("act", "named"):
                ev = CmdRun(command=f"c{next_id}", tool_call_id=f"call_{last_llm}_0")
            case ("act", _):
                ev = CmdRun(command=f"c{next_id}")
            case ("obs", pick, has_cause):
                # Small picks answer one of the newest events, large ones any event.
                back = pick if pick < 5 else pick % max(len(events), 1)
                cause = events[-1 - back % len(events)].id if events and has_cause else None
                ev = CmdOutput(content=f"o{next_id}", cause=cause)
            case ("cond", ranges, summary, offset):
                # (distance back from here, length); negative lengths make invalid ranges
                spans = [(max(next_id - back, -1), max(next_id - back, -1) + length) for back, length in ranges]
                ev = Condensation(forgotten=spans, summary=summary, summary_offset=offset)
            case ("edit", edit_op, ranges, kinds):
                spans = [(max(next_id - back, 1), max(next_id - back, 1) + length) for back, length in ranges]
                ev = ContextEdit(op=edit_op, ranges=[(s, e) for s, e in spans if e >= 1], kinds=kinds)
            case ("req",):
                ev = CondensationRequest()
            case ("think",):
                ev = Think(thought="t")
            case ("llm", calls):
                last_llm = next_id
                ev = LlmResponse(model="m", content="x", tool_calls=[
                    {"id": f"call_{next_id}_{k}", "type": "function", "function": {"name": "cmd_run"}}
                    for k in range(calls)])  # fmt: skip
            case _:
                ev = Error(content="e")
        events.append(with_id(ev, next_id))
    return events


FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(logs())
def test_fold_matches_naive_reference_at_every_point(events: list[Event]) -> None:
    for e in events:
        assert keys(view(events, until=e.id)) == naive_view(events, until=e.id)
    assert keys(view(events)) == naive_view(events)


@FAST
@given(logs())
def test_incremental_equals_full_fold(events: list[Event]) -> None:
    builder = ViewBuilder()
    for e in events:
        builder.append(e)
        snapshot = builder.view()
        full = view(events, until=e.id)
        assert snapshot == full
        assert snapshot.last_id == e.id
        assert len(builder) == len(full)


@FAST
@given(logs())
def test_units_never_split_and_machinery_hidden(events: list[Event]) -> None:
    v = view(events)
    visible = set(v.ids())
    assert sum(isinstance(e, Summary) for e in v) <= 1
    for e in v:
        assert not isinstance(e, Condensation | CondensationRequest | ContextEdit)
    seen: list[Event] = []
    machinery = {e.id for e in events if isinstance(e, Condensation | CondensationRequest | ContextEdit)}
    for e in events:
        seen.append(e)
        if e.id in machinery:
            continue
        parent = naive_parent(e, seen, machinery)
        if parent is not None and any(isinstance(r, CondensationRequest) and r.id == e.cause for r in events):
            continue
        if parent is not None:
            assert (e.id in visible) == (parent in visible)


@FAST
@given(logs())
def test_hidden_and_pinned_match_naive_reference(events: list[Event]) -> None:
    builder = ViewBuilder(events)
    _, hidden, pinned = naive_state(events)
    assert builder.hidden() == hidden
    assert builder.view().pinned == pinned


@FAST
@given(logs())
def test_a_builder_that_releases_hidden_events_folds_the_same_or_says_it_cannot(events: list[Event]) -> None:
    """Without hidden events kept, every view is the same until a restore needs released
    events; that restore raises HistoryReleased and changes nothing, and a builder that
    kept them (released afterwards) goes on from there."""
    lean = ViewBuilder(keep_hidden=False)
    for n, e in enumerate(events):
        before = lean.view()
        try:
            lean.append(e)
        except HistoryReleased:
            assert isinstance(e, ContextEdit)
            assert e.op == "restore"
            assert lean.view() == before
            assert lean.last_id == before.last_id
            lean = ViewBuilder(events[: n + 1])
            lean.release_hidden()
        assert lean.view() == view(events, until=e.id)
    assert lean.hidden() == naive_state(events)[1]


@FAST
@given(logs(), st.integers(0, 60))
def test_a_frozen_fold_thawed_and_filled_goes_on_like_the_full_fold(events: list[Event], cut: int) -> None:
    """Freeze a fold after ``cut`` events, thaw it (in a fresh kind numbering too: codes are
    per process), give it the events it names, and fold the rest: every view is the full
    fold's, and what hid each event is the same."""
    head, tail = events[:cut], events[cut:]
    builder = ViewBuilder(head)
    blob = builder.freeze()
    saved_codes = dict(view_module._KIND_CODES)
    view_module._KIND_CODES.clear()  # another process numbers kinds in another order
    for kind in reversed(saved_codes):
        view_module._kind_code(kind)
    try:
        thawed, wanted = ViewBuilder.thaw(blob)
        by_id = {e.id: e for e in events}
        assert set(wanted) <= set(by_id)
        thawed.fill(by_id[i] for i in wanted)
        assert thawed.view() == builder.view()
        assert thawed.hidden() == builder.hidden()
        for n, e in enumerate(tail, start=cut):
            try:
                thawed.append(e)
            except HistoryReleased:
                thawed = ViewBuilder(events[: n + 1])
            assert thawed.view() == view(events, until=e.id)
        assert thawed.hidden() == naive_state(events)[1]
    finally:
        view_module._KIND_CODES.clear()
        view_module._KIND_CODES.update(saved_codes)


def test_a_saved_view_that_is_not_one_is_refused_in_one_sentence() -> None:
    with pytest.raises(InputError, match="cannot be read"):
        ViewBuilder.thaw(b"\x93\x01\x02")
    builder, wanted = ViewBuilder.thaw(ViewBuilder([with_id(Message(content="x"), 1)]).freeze())
    assert wanted == [1]
    with pytest.raises(InputError, match="did not give"):
        builder.fill([])


@FAST
@given(logs(), st.integers(0, 200))
def test_until_is_a_prefix_fold(events: list[Event], until: int) -> None:
    assert view(events, until=until) == view([e for e in events if e.id <= until])


# --- worked examples --------------------------------------------------------------------


def _log(*events: Event) -> list[Event]:
    return [with_id(e, i) for i, e in enumerate(events, start=1)]


def test_summary_inserted_at_offset_and_replaced_by_later_one() -> None:
    events = _log(
        Message(content="task", source="user"),  # 1
        CmdRun(command="ls"),  # 2
        CmdOutput(content="a b", cause=2),  # 3
        CmdRun(command="cat a"),  # 4
        CmdOutput(content="A", cause=4),  # 5
        Condensation(forgotten=[(2, 3)], summary="listed files", summary_offset=1),  # 6
        Message(content="next", source="user"),  # 7
        Condensation(forgotten=[(4, 5)], summary="listed and read a", summary_offset=1),  # 8
    )
    first = view(events, until=7)
    summary = ("summary", 6, "listed files")
    assert keys(first) == [("message", 1), summary, ("cmd_run", 4), ("cmd_output", 5), ("message", 7)]
    assert first.summary is not None
    assert first.summary.content == "listed files"
    assert first.summary_index == 1
    second = view(events)
    assert keys(second) == [("message", 1), ("summary", 8, "listed and read a"), ("message", 7)]
    assert [e.id for e in second.real_events()] == [1, 7]


def test_cut_through_a_pair_drops_both_members() -> None:
    events = _log(
        Message(content="task", source="user"),  # 1
        CmdRun(command="ls"),  # 2
        CmdOutput(content="x", cause=2),  # 3
        CmdRun(command="pwd"),  # 4
        CmdOutput(content="/", cause=4),  # 5
        Condensation(forgotten=[(3, 4)]),  # 6: would keep 2 and 5
    )
    assert keys(view(events)) == [("message", 1)]


def test_late_observation_of_forgotten_action_is_dropped() -> None:
    events = _log(
        CmdRun(command="sleep 5"),  # 1
        Message(content="meanwhile", source="user"),  # 2
        Condensation(forgotten=[(1, 1)]),  # 3
        CmdOutput(content="done", cause=1),  # 4
    )
    assert keys(view(events)) == [("message", 2)]


def test_condensation_request_and_its_answer_are_hidden() -> None:
    events = _log(
        Message(content="hi", source="user"),
        CondensationRequest(),
        Error(content="condenser down", cause=2),
        Error(content="standalone"),
    )
    assert keys(view(events)) == [("message", 1), ("error", 4)]


def test_observation_answering_a_message_is_not_a_pair() -> None:
    events = _log(
        Message(content="task", source="user"),
        CmdOutput(content="context for the task", cause=1),
        Condensation(forgotten=[(2, 2)]),
    )
    assert keys(view(events)) == [("message", 1)]


def test_ranges_never_reach_events_after_the_condensation() -> None:
    events = _log(Message(content="a"), Condensation(forgotten=[(1, 100)]), Message(content="b"))
    assert keys(view(events)) == [("message", 3)]


def test_summary_without_offset_goes_where_the_forgotten_events_were() -> None:
    events = _log(
        Message(content="a"),
        Message(content="b"),
        Message(content="c"),
        Condensation(forgotten=[(2, 2)], summary="b was said"),
    )
    assert keys(view(events)) == [("message", 1), ("summary", 4, "b was said"), ("message", 3)]


def test_empty_summary_removes_it_and_none_keeps_it() -> None:
    events = _log(
        Message(content="a"),
        Message(content="b"),
        Condensation(forgotten=[(1, 1)], summary="a", summary_offset=0),
        Message(content="c"),
        Condensation(forgotten=[(2, 2)]),
    )
    assert keys(view(events)) == [("summary", 3, "a"), ("message", 4)]
    cleared = [*events, with_id(Condensation(summary=""), 6)]
    assert keys(view(cleared)) == [("message", 4)]


def test_events_must_carry_increasing_ids() -> None:
    builder = ViewBuilder()
    with pytest.raises(InputError, match="without an id"):
        builder.append(Message(content="x"))
    builder.append(with_id(Message(content="x"), 5))
    with pytest.raises(InputError, match="increasing id order"):
        builder.append(with_id(Message(content="y"), 5))


def test_view_is_a_sequence() -> None:
    v = view(_log(Message(content="a"), Message(content="b")))
    assert len(v) == 2
    assert v[0].id == 1
    assert [e.id for e in v[1:]] == [2]
    assert v.summary is None
    assert v.last_id == 2
    assert view([]) == View()


# --- a long session ---------------------------------------------------------------------


def big_log(n: int = 100_000, condensations: int = 100) -> list[Event]:
    events: list[Event] = [with_id(Message(content="the task", source="user"), 1)]
    every = n // condensations
    eid = 1
    forgotten_to = 1
    while eid < n:
        eid += 1
        if eid % every == 0:
            # Forget everything but the first event and the newest ~200 events.
            end = eid - 200
            events.append(
                with_id(Condensation(forgotten=[(forgotten_to + 1, end)], summary=f"s{eid}", summary_offset=1), eid)
            )
            forgotten_to = end
        elif eid % 2 == 0:
            events.append(with_id(CmdRun(command="ls"), eid))
        else:
            events.append(with_id(CmdOutput(content="out", cause=eid - 1), eid))
    return events


def test_fold_of_100k_events_with_100_condensations() -> None:
    """The fold of a long condensed session, built event by event or at once (its speed is
    measured by ``python -m bench.view``, never asserted here)."""
    events = big_log()
    builder = ViewBuilder()
    for e in events:
        builder.append(e)
    v = view(events)
    assert builder.view() == v
    assert v[0].id == 1
    assert isinstance(v[1], Summary)
    assert len(v) < 1200


def test_fold_without_condensations_keeps_every_event() -> None:
    events = [with_id(Message(content="x"), i) for i in range(1, 100_001)]
    assert len(view(events)) == 100_000


def test_a_unit_of_100k_members_folds_in_linear_time() -> None:
    # One model response that 100,000 later actions name as their cause: every action joins
    # that unit. Finding the unit's last member by walking it would be quadratic (about
    # five minutes here, past the test timeout); the fold remembers the latest units' last
    # members, so this takes a second or two.
    response = with_id(LlmResponse(model="m", content="go"), 1)
    actions = [with_id(Think(thought=f"t{i}", cause=1), i) for i in range(2, 100_002)]
    builder = ViewBuilder([response, *actions])
    assert len(builder.view()) == 100_001
    builder.append(with_id(Condensation(forgotten=[(1, 1)]), 100_002))
    assert len(builder.view()) == 0  # the whole unit is hidden with its first member

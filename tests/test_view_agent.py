"""The View fold over logs shaped like the agent's, folded a chunk at a time as the agent
role folds them, against the full fold and the naive reference; the tool call ids a fold
remembers; the unit chains a saved fold writes for earlier readers."""

from __future__ import annotations

import itertools
import zlib
from typing import Any
from unittest import mock

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from riverbed.events import (
    CmdOutput,
    CmdRun,
    Condensation,
    CondensationRequest,
    ContextEdit,
    Error,
    Event,
    FileContent,
    FileRead,
    LlmResponse,
    Message,
    Think,
    with_id,
)
from riverbed.memory import units
from riverbed.memory import view as view_module
from riverbed.memory.view import ViewBuilder, view
from tests.test_view import keys, logs, naive_state

AGENT = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_OPS: dict[str, st.SearchStrategy[tuple[Any, ...]]] = {
    "step": st.tuples(
        st.integers(1, 3),  # tool calls
        st.sampled_from(["fresh", "fresh", "fresh", "reused"]),  # their ids
        st.booleans(),  # the model's text before them
        st.lists(st.sampled_from(["caused", "caused", "caused", "named", "plain"]), min_size=3, max_size=3),
        st.lists(st.sampled_from(["now", "now", "now", "later", "never"]), min_size=3, max_size=3),
    ),
    "late": st.tuples(st.integers(0, 5)),
    "user": st.tuples(),
    "reject": st.tuples(st.integers(1, 2)),
    "cond": st.tuples(
        st.lists(st.tuples(st.integers(0, 40), st.integers(-2, 25)), min_size=1, max_size=2),
        st.sampled_from([None, "", "s1", "s2"]),
        st.one_of(st.none(), st.integers(-1, 12)),
    ),
    "request": st.tuples(st.sampled_from(["condensation", "error"])),
    "edit": st.tuples(st.sampled_from(["forget", "restore", "pin", "unpin"]), st.integers(0, 40), st.integers(0, 10)),
}
_MIX = ["step"] * 6 + ["late"] * 2 + ["user", "reject", "cond", "cond", "request", "edit"]  # mostly steps


@st.composite
def agent_logs(draw: st.DrawFn, max_steps: int = 24) -> list[Event]:
    """A log as the agent and condenser roles write it: model responses with 1-3 tool calls
    (with ids, some reused), the actions they ask for in call order (``cause`` the response
    and ``tool_call_id`` the call; some name only the call, as other writers do, some
    neither), each answered now, later or never (a thought never is), user messages,
    rejected responses, condensation requests and their answers, condensations, and now
    and then a user's edit."""
    out: list[Event] = []
    waiting: list[int] = []  # actions not answered yet

    def add(event: Event) -> int:
        out.append(with_id(event, len(out) + 1))
        return len(out)

    def answer(action: int) -> None:
        asked = out[action - 1]
        if isinstance(asked, FileRead):
            add(FileContent(path=asked.path, content=f"text of {asked.path}", cause=action))
        else:
            add(CmdOutput(content=f"out of {action}", exit_code=0, cause=action))

    for what in draw(st.lists(st.sampled_from(_MIX), max_size=max_steps)):
        match (what, *draw(_OPS[what])):
            case ("step", n, ids, said, links, when):
                eid = len(out) + 1
                calls = [
                    {"id": f"call_{eid}_{k}" if ids == "fresh" else f"call_{k}", "type": "function",
                     "function": {"name": ("cmd_run", "file_read", "think")[(eid + k) % 3], "arguments": "{}"}}
                    for k in range(n)
                ]  # fmt: skip
                response = add(LlmResponse(model="m", content="looking" if said else None, tool_calls=calls))
                for call, link, at in zip(calls, links, when, strict=False):
                    name = call["function"]["name"]
                    action: Event = (
                        Think(thought="hm")
                        if name == "think"
                        else FileRead(path=f"f{eid}")
                        if name == "file_read"
                        else CmdRun(command=f"c{eid}")
                    )
                    named = {"tool_call_id": call["id"]} if link in ("caused", "named") else {}
                    caused = {"cause": response} if link == "caused" else {}
                    asked = add(msgspec.structs.replace(action, source="agent", **named, **caused))
                    if name == "think" or at == "never":
                        continue
                    if at == "now":
                        answer(asked)
                    else:
                        waiting.append(asked)
            case ("reject", n):
                calls = [{"id": f"bad_{len(out)}_{k}", "function": "not a dict"} for k in range(n)]
                response = add(LlmResponse(model="m", tool_calls=calls))
                add(Error(source="agent", content="bad tool call", reason="bad_tool_call", cause=response))
            case ("user",):
                add(Message(source="user", content=f"note {len(out) + 1}"))
            case ("late", pick) if waiting:
                answer(waiting.pop(pick % len(waiting)))
            case ("late", _):
                pass
            case ("cond", ranges, summary, offset):
                here = len(out) + 1
                spans = [(max(1, here - back), max(1, here - back) + length) for back, length in ranges]
                add(Condensation(source="condenser", forgotten=spans, summary=summary, summary_offset=offset))
            case ("request", how):
                request = add(CondensationRequest(source="agent", cause=len(out) or None))
                if how == "condensation":
                    add(Condensation(source="condenser", cause=request))
                else:
                    add(Error(source="condenser", content="condenser down", cause=request))
            case ("edit", op, back, length):
                start = max(1, len(out) + 1 - back)
                add(ContextEdit(op=op, ranges=[(start, start + length)]))
            case _:
                raise AssertionError(op)
    return out


@AGENT
@given(agent_logs(), st.lists(st.integers(1, 12), max_size=20), st.booleans())
def test_an_agent_log_folded_a_chunk_at_a_time_is_the_full_fold(
    events: list[Event], chunks: list[int], by_extend: bool
) -> None:
    """The agent role appends each step's new events and reads the view: at every step the
    view is the full fold of the log so far, and at the end the naive reference's."""
    builder = ViewBuilder()
    done = 0
    for size in [*chunks, len(events)]:
        chunk = events[done : done + size]
        if not chunk:
            continue
        if by_extend:
            builder.extend(chunk)
        else:
            for event in chunk:
                builder.append(event)
        done += len(chunk)
        assert builder.view() == view(events[:done])
        assert builder.last_id == done
    shown, hidden, pinned = naive_state(events)
    assert keys(builder.view()) == shown
    assert builder.hidden() == hidden
    assert builder.view().pinned == pinned


@AGENT
@given(agent_logs(), st.integers(0, 100))
def test_a_saved_agent_fold_goes_on_like_the_full_fold(events: list[Event], cut: int) -> None:
    head, tail = events[:cut], events[cut:]
    thawed, wanted = ViewBuilder.thaw(ViewBuilder(head).freeze())
    by_id = {e.id: e for e in events}
    thawed.fill(by_id[i] for i in wanted)
    for n, event in enumerate(tail, start=cut + 1):
        try:
            thawed.append(event)
        except view_module.HistoryReleased:
            thawed = ViewBuilder(events[:n])
        assert thawed.view() == view(events[:n])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.sampled_from(["a", "b", "c", "d", "e", "f", None]), max_size=4), st.booleans()),
        max_size=40,
    )
)
def test_the_tool_call_ids_kept_are_the_latest_whenever_they_are_read(
    steps: list[tuple[list[str | None], bool]],
) -> None:
    """Responses are queued and read into the table late (from the newest back when many
    are queued): whenever an id is looked up, the table is the one adding each response's
    ids in turn and dropping the oldest id when one too many would make."""
    with mock.patch.object(units, "CALL_IDS_KEPT", 3):
        owners = units.CallOwners()
        naive: dict[str, int] = {}
        for eid, (ids, look) in enumerate(steps, start=1):
            calls: list[dict[str, Any]] = [{"id": i} if i else {"type": "function"} for i in ids]
            owners.queued.append(with_id(LlmResponse(model="m", tool_calls=calls), eid))
            for call_id in ids:
                if call_id is not None:
                    naive.pop(call_id, None)
                    naive[call_id] = eid
            while len(naive) > 3:
                del naive[next(iter(naive))]
            if look:
                assert {k: owners.get(k) for k in "abcdef"} == {k: naive.get(k, 0) for k in "abcdef"}
        assert owners.items() == list(naive.items())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(logs())
def test_a_saved_fold_chains_each_unit_in_id_order_for_earlier_readers(events: list[Event]) -> None:
    """Readers of saved folds from before this version walk each unit through ``next``."""
    frozen = msgspec.msgpack.decode(ViewBuilder(events).freeze(), type=view_module._Frozen)
    root_delta = view_module._column(zlib.decompress(frozen.root), frozen.itemsize).tolist()
    next_delta = view_module._column(zlib.decompress(frozen.next), frozen.itemsize).tolist()
    members: dict[int, list[int]] = {}
    for i, delta in enumerate(root_delta):
        if delta >= 0:
            members.setdefault(i - delta, []).append(i)
    chained = [0] * len(root_delta)
    for unit in members.values():
        for this, after in itertools.pairwise(unit):
            chained[this] = after - this
    assert next_delta == chained


def test_a_restore_finds_the_hidden_events_in_whichever_batch_they_were_folded() -> None:
    events: list[Event] = [with_id(Message(content=f"m{i}", source="user"), i) for i in range(1, 3001)]
    events.append(with_id(Condensation(forgotten=[(1, 2999)]), 3001))
    events.append(with_id(ContextEdit(op="restore", ranges=[(5, 5), (1100, 1102), (2500, 2501)]), 3002))
    builder = ViewBuilder()
    for start, end in ((0, 1200), (1200, 1210), (1210, 1230), (1230, 2950), (2950, 3002)):
        builder.extend(events[start:end])
        assert builder.view() == view(events[:end])
    assert [e.id for e in builder.view()] == [5, 1100, 1101, 1102, 2500, 2501, 3000]

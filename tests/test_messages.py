"""Views as OpenAI chat messages: tool calls always matched, ids deterministic."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from riverbed.agent.llm import build_messages, over_budget
from riverbed.agent.messages import SUMMARY_PREFIX, to_messages, tool_call_id
from riverbed.events import (
    CmdOutput,
    CmdRun,
    Condensation,
    ContextEdit,
    Error,
    Event,
    FileContent,
    FileRead,
    Finish,
    LlmResponse,
    Message,
    RecallResult,
    Think,
    with_id,
)
from riverbed.memory.condensers import CondenserConfig, prepare
from riverbed.memory.view import ViewBuilder, view
from tests.kit.openai_server import OpenAIServer, tool_call


def log(*events: Event) -> list[Event]:
    return [with_id(e, i) for i, e in enumerate(events, start=1)]


def assert_well_formed(messages: list[dict[str, Any]]) -> None:
    """What a provider checks: every tool call answered right after it, every result matched."""
    seen: set[str] = set()
    i = 0
    while i < len(messages):
        m = messages[i]
        assert m["role"] in ("system", "user", "assistant"), f"stray {m}"
        assert isinstance(m["content"], str), f"content must be a string (strict servers refuse null): {m}"
        calls = m.get("tool_calls")
        if calls:
            assert m["role"] == "assistant"
            ids = [c["id"] for c in calls]
            assert len(set(ids)) == len(ids)
            assert not seen & set(ids)
            seen |= set(ids)
            for c in calls:
                assert c["type"] == "function"
                assert isinstance(json.loads(c["function"]["arguments"]), dict)
            answers = messages[i + 1 : i + 1 + len(ids)]
            assert [a["role"] for a in answers] == ["tool"] * len(ids)
            assert [a["tool_call_id"] for a in answers] == ids
            assert all(isinstance(a["content"], str) for a in answers)
            i += 1 + len(ids)
            continue
        assert isinstance(m["content"], str)
        i += 1
    json.dumps(messages)


def test_a_plain_session() -> None:
    events = log(
        Message(content="list the files", source="user"),
        CmdRun(command="ls"),
        CmdOutput(content="a.py", exit_code=0, cause=2),
        Think(thought="one file"),
        Message(content="There is a.py.", source="agent"),
        Finish(final_thought="done"),
    )
    messages = to_messages(view(events), system_prompt="You are helpful.")
    assert messages == [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "list the files"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_rb_2",
                    "type": "function",
                    "function": {
                        "name": "cmd_run",
                        "arguments": json.dumps(
                            {"command": "ls", "timeout": None, "is_input": False, "blocking": False, "cwd": None}
                        ),
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_rb_2", "content": "a.py\n[exit code 0]"},
        {"role": "assistant", "content": "one file"},
        {"role": "assistant", "content": "There is a.py."},
        {"role": "assistant", "content": "done"},
    ]
    assert tool_call_id(2) == "call_rb_2"


def test_recorded_tool_calls_keep_their_ids_and_results_are_pulled_forward() -> None:
    calls = [tool_call("execute_bash", {"command": "ls"}, "call_A"), tool_call("read", {"path": "a"}, "call_B")]
    events = log(
        Message(content="go", source="user"),  # 1
        LlmResponse(model="m", content="Running both.", tool_calls=calls),  # 2
        CmdRun(command="ls", cause=2),  # 3
        FileRead(path="a", cause=2),  # 4
        Message(content="also check b", source="user"),  # 5
        FileContent(path="a", content="A", cause=4),  # 6
        CmdOutput(content="a b", cause=3),  # 7
    )
    messages = to_messages(view(events))
    assert_well_formed(messages)
    assert messages[1] == {"role": "assistant", "content": "Running both.", "tool_calls": calls}
    assert messages[2] == {"role": "tool", "tool_call_id": "call_A", "content": "a b"}
    assert messages[3] == {"role": "tool", "tool_call_id": "call_B", "content": "A"}
    assert messages[4] == {"role": "user", "content": "also check b"}
    assert len(messages) == 5


def test_recorded_calls_match_following_actions_without_causes_only_one_to_one() -> None:
    calls = [tool_call("bash", {"command": "pwd"}, "call_X")]
    events = log(
        LlmResponse(model="m", tool_calls=calls),
        CmdRun(command="pwd"),
        CmdOutput(content="/", cause=2),
    )
    messages = to_messages(view(events))
    assert_well_formed(messages)
    assert [m["tool_calls"][0]["id"] for m in messages if m.get("tool_calls")] == ["call_X"]
    # Two actions for one call do not line up: both are shown under synthesised calls.
    events += [with_id(CmdRun(command="ls"), 4), with_id(CmdOutput(content="x", cause=4), 5)]
    messages = to_messages(view(events))
    assert_well_formed(messages)
    assert [m["tool_calls"][0]["id"] for m in messages if m.get("tool_calls")] == ["call_rb_2", "call_rb_4"]


def test_unanswered_calls_and_orphan_results_are_left_out() -> None:
    calls = [tool_call("bash", {"command": "sleep 9"}, "call_P")]
    events = log(
        Message(content="go", source="user"),  # 1
        LlmResponse(model="m", tool_calls=calls),  # 2
        CmdRun(command="sleep 9", cause=2),  # 3 pending
        CmdRun(command="ls"),  # 4
        CmdOutput(content="x", cause=4),  # 5
        Condensation(forgotten=[(4, 4)]),  # 6: drops 4 and 5 together
        CmdOutput(content="late", cause=99),  # 7: answers nothing in the view
        Error(content="disk full"),  # 8: no cause: a notice
    )
    messages = to_messages(view(events))
    assert_well_formed(messages)
    assert messages == [
        {"role": "user", "content": "go"},
        {"role": "user", "content": "[error]\nerror: disk full"},
    ]


def test_summary_and_context_observations_are_user_messages() -> None:
    events = log(
        Message(content="task", source="user"),  # 1
        RecallResult(recall_type="workspace_context", repo_name="acme/app", cause=1),  # 2
        Message(content="old", source="user"),  # 3
        Condensation(forgotten=[(3, 3)], summary="the user said old things", summary_offset=2),  # 4
    )
    messages = to_messages(view(events))
    assert messages == [
        {"role": "user", "content": "task"},
        {"role": "user", "content": "[recall_result]\nrepository: acme/app"},
        {"role": "user", "content": SUMMARY_PREFIX + "the user said old things"},
    ]


def test_response_content_is_not_repeated_by_the_message_it_caused() -> None:
    events = log(
        LlmResponse(model="m", content="Hello!"),
        Message(content="Hello!", source="agent", cause=1),
    )
    assert to_messages(view(events)) == [{"role": "assistant", "content": "Hello!"}]


def test_masked_observations_are_tool_results_with_the_placeholder() -> None:
    events: list[Event] = [Message(content="t", source="user")]
    for i in range(6):
        events += [CmdRun(command=f"c{i}"), CmdOutput(content="x" * 300, cause=len(events) + 1)]
    config = CondenserConfig.from_dict({"strategy": "masking", "mask_window": 2})
    messages = to_messages(prepare(view(log(*events)), config))
    assert_well_formed(messages)
    results = [m["content"] for m in messages if m["role"] == "tool"]
    assert results[0] == config.mask_placeholder
    assert results[-1] == "x" * 300


def test_duplicate_recorded_ids_are_made_unique() -> None:
    calls = [tool_call("bash", {"command": "a"}, "call_same")]
    events = log(
        LlmResponse(model="m", tool_calls=calls),
        CmdRun(command="a", cause=1),
        CmdOutput(content="1", cause=2),
        LlmResponse(model="m", tool_calls=calls),
        CmdRun(command="a", cause=4),
        CmdOutput(content="2", cause=5),
    )
    messages = to_messages(view(events))
    assert_well_formed(messages)
    assert [m["tool_call_id"] for m in messages if m["role"] == "tool"] == ["call_same", "call_rb_5"]


# --- property: whatever the log, the request is well formed ------------------------------

op = st.one_of(
    st.tuples(st.just("user")),
    st.tuples(st.just("say")),
    st.tuples(st.just("llm"), st.integers(0, 3), st.booleans(), st.booleans()),
    st.tuples(st.just("act"), st.booleans()),
    st.tuples(st.just("obs"), st.integers(0, 6)),
    st.tuples(st.just("obs"), st.integers(0, 6)),
    st.tuples(st.just("think")),
    st.tuples(st.just("notice")),
    st.tuples(st.just("cond"), st.integers(1, 8), st.integers(0, 5), st.booleans()),
)


@st.composite
def sessions(draw: st.DrawFn) -> list[Event]:
    size = draw(st.integers(0, 50))
    events: list[Event] = []
    last_llm: int | None = None
    for o in draw(st.lists(op, min_size=size, max_size=size)):
        eid = len(events) + 1
        match o:
            case ("user",):
                ev: Event = Message(content=f"u{eid}", source="user")
            case ("say",):
                ev = Message(content=f"a{eid}", source="agent", cause=last_llm)
            case ("llm", n, bad, same_ids):
                raw = [tool_call("bash", {"n": k}, "call_1" if same_ids else None) for k in range(n)]
                if bad:
                    raw.append({"function": "not a dict"})
                ev = LlmResponse(model="m", content=draw(st.sampled_from([None, "", "thinking"])), tool_calls=raw)
                last_llm = eid
            case ("act", linked):
                ev = CmdRun(command=f"c{eid}", cause=last_llm if linked else None)
            case ("obs", back):
                target = events[-1 - back % len(events)].id if events else None
                ev = CmdOutput(content=f"o{eid}", cause=target)
            case ("think",):
                ev = Think(thought="hm")
            case ("notice",):
                ev = Error(content="note")
            case ("cond", back, length, summary):
                start = max(1, eid - back)
                ev = Condensation(
                    forgotten=[(start, start + length)], summary="s" if summary else None, summary_offset=0
                )
            case _:
                raise AssertionError(o)
        events.append(with_id(ev, eid))
    return events


@settings(max_examples=200, deadline=None)
@given(sessions())
def test_messages_never_hold_unmatched_tool_calls_or_results(events: list[Event]) -> None:
    v = view(events)
    messages = to_messages(v, system_prompt="sys")
    assert messages[0] == {"role": "system", "content": "sys"}
    assert_well_formed(messages)
    # Every answered action in the view is a call; nothing else is.
    answered = {e.cause for e in v if isinstance(e, CmdOutput)} & {e.id for e in v if isinstance(e, CmdRun)}
    assert sum(len(m.get("tool_calls", ())) for m in messages) == len(answered)
    assert to_messages(v, system_prompt="sys") == messages  # deterministic


# --- a round trip through the real client and the test server ----------------------------


@pytest.fixture
def openai_server() -> Iterator[OpenAIServer]:
    with OpenAIServer() as server:
        yield server


@pytest.mark.anyio
async def test_round_trip_of_recorded_tool_calls(openai_server: OpenAIServer) -> None:
    sent = openai_server.reply("Let me look.", tool_calls=[("cmd_run", {"command": "ls"})])
    openai_server.reply("Found a.py.")
    events: list[Event] = [with_id(Message(content="what is here?", source="user"), 1)]
    async with openai_server.client() as client:
        first = await client.chat.completions.create(model="m", messages=to_messages(view(events)))  # type: ignore[arg-type]
        message = first.choices[0].message
        assert message.tool_calls is not None
        recorded = [c.model_dump(exclude_none=True) for c in message.tool_calls]
        events.append(with_id(LlmResponse(model="m", content=message.content, tool_calls=recorded), 2))
        args = json.loads(message.tool_calls[0].function.arguments)  # type: ignore[union-attr]
        events.append(with_id(CmdRun(command=args["command"], cause=2), 3))
        events.append(with_id(CmdOutput(content="a.py", exit_code=0, cause=3), 4))
        second = await client.chat.completions.create(model="m", messages=to_messages(view(events)))  # type: ignore[arg-type]
    assert second.choices[0].message.content == "Found a.py."
    replayed = openai_server.last_request["messages"]
    assert replayed[1]["tool_calls"][0]["id"] == sent[0]["id"]
    assert replayed[2] == {"role": "tool", "tool_call_id": sent[0]["id"], "content": "a.py\n[exit code 0]"}
    assert openai_server.unexpected == 0


@pytest.mark.anyio
async def test_server_failure_injection_and_embeddings(openai_server: OpenAIServer) -> None:
    openai_server.fail(503, "overloaded")
    async with openai_server.client() as client:
        with pytest.raises(openai.InternalServerError, match="overloaded"):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.InternalServerError, match="no scripted response"):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert openai_server.unexpected == 1
        vectors = await client.embeddings.create(model="e", input=["a", "b", "a"])
    data = [d.embedding for d in vectors.data]
    assert len(data[0]) == openai_server.embedding_dim
    assert data[0] == data[2] != data[1]
    assert len(openai_server.requests) == 2


def test_think_calls_in_a_response_do_not_shift_the_pairing() -> None:
    calls = [tool_call("think", {"thought": "first look"}, "call_t"), tool_call("cmd_run", {"command": "ls"}, "call_c")]
    events = log(
        LlmResponse(model="m", tool_calls=calls),
        Think(thought="first look", cause=1),
        CmdRun(command="ls", cause=1),
        CmdOutput(content="a.txt", cause=3),
    )
    messages = to_messages(view(events))
    assert_well_formed(messages)
    assert [m["tool_call_id"] for m in messages if m["role"] == "tool"] == ["call_c"]


# --- pairing by identity ----------------------------------------------------------------


def test_each_output_stays_under_its_own_call_when_a_condensation_forgets_the_first() -> None:
    """The issue's example: a response calls A (`ls A`) and B (`ls B`), both answered; a
    condensation then forgets A's output.  B's output must stay under B's call."""
    calls = [tool_call("cmd_run", {"command": "ls A"}, "call_A"), tool_call("cmd_run", {"command": "ls B"}, "call_B")]
    for named in (True, False):  # with the recorded tool_call_id, and a log from before it existed
        ids: dict[str, str] = {"tool_call_id": "call_A"} if named else {}
        events = log(
            Message(content="list both", source="user"),  # 1
            LlmResponse(model="m", tool_calls=calls),  # 2
            CmdRun(command="ls A", **ids),  # 3 (no cause: as an imported log may have it)
            CmdOutput(content="a-files", cause=3),  # 4
            CmdRun(command="ls B", **({"tool_call_id": "call_B"} if named else {})),  # 5
            CmdOutput(content="b-files", cause=5),  # 6
            Condensation(forgotten=[(3, 4)]),  # 7: A's call and output
        )
        messages = to_messages(view(events))
        assert_well_formed(messages)
        shown = [m["content"] for m in messages if m["role"] == "tool"]
        if named:  # the batch is one unit: forgetting A's part forgets the response and B too
            assert shown == []
            assert [m["role"] for m in messages] == ["user"]
            continue
        assert shown == ["b-files"]  # an old log: the fold cannot tell the batch, the pairing can
        (call,) = [c for m in messages for c in m.get("tool_calls", ())]
        assert json.loads(call["function"]["arguments"])["command"] == "ls B"
        assert call["id"] == "call_rb_5"


def test_an_action_after_a_response_whose_calls_never_ran_gets_its_own_call() -> None:
    calls = [tool_call("cmd_run", {"command": "rm -rf build"}, "call_R")]
    events = log(
        LlmResponse(model="m", tool_calls=calls),  # 1: its call was refused, never ran
        Error(source="agent", content="bad tool call", reason="bad_tool_call", cause=1),  # 2
        CmdRun(command="ls"),  # 3: a cause-less action from elsewhere
        CmdOutput(content="x", cause=3),  # 4
    )
    messages = to_messages(view(events))
    assert_well_formed(messages)
    (call,) = [c for m in messages for c in m.get("tool_calls", ())]
    assert call["id"] == "call_rb_3"
    assert json.loads(call["function"]["arguments"])["command"] == "ls"


def test_identity_wins_over_position_and_repeated_ids_stay_with_their_response() -> None:
    first = [tool_call("cmd_run", {"command": "one"}, "call_0"), tool_call("cmd_run", {"command": "two"}, "call_1")]
    second = [tool_call("cmd_run", {"command": "three"}, "call_0")]  # some servers count from 0 each time
    events = log(
        LlmResponse(model="m", tool_calls=first),  # 1
        CmdRun(command="two", cause=1, tool_call_id="call_1"),  # 2: ran out of order
        CmdOutput(content="out of 2", cause=2),  # 3
        CmdRun(command="one", cause=1, tool_call_id="call_0"),  # 4
        CmdOutput(content="out of 4", cause=4),  # 5
        LlmResponse(model="m", tool_calls=second),  # 6
        CmdRun(command="three", cause=6, tool_call_id="call_0"),  # 7
        CmdOutput(content="out of 7", cause=7),  # 8
    )
    messages = to_messages(view(events))
    assert_well_formed(messages)
    assert_pairing(messages, events)
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["out of 2", "out of 4", "out of 7"]
    # The recorded ids are used (the repeated one made unique, since a request needs distinct ids).
    assert [m["tool_call_id"] for m in messages if m["role"] == "tool"] == ["call_1", "call_0", "call_rb_7"]


def assert_pairing(messages: list[dict[str, Any]], events: list[Event]) -> None:
    """Every tool result is shown under the call that produced it: the call's name and
    arguments are those of the action whose output the result holds."""
    by_id = {e.id: e for e in events}
    current: dict[str, dict[str, Any]] = {}
    for m in messages:
        if m["role"] == "assistant":
            current = {c["id"]: c for c in m.get("tool_calls", ())}
        if m["role"] != "tool":
            continue
        call = current[m["tool_call_id"]]
        producers = {int(line.split()[-1]) for line in m["content"].splitlines() if line.startswith("out of ")}
        assert len(producers) == 1, m
        action = by_id[producers.pop()]
        assert isinstance(action, CmdRun)
        assert call["function"]["name"] == action.kind, (call, action)
        assert json.loads(call["function"]["arguments"])["command"] == action.command, (call, action)
        if isinstance(action.tool_call_id, str):  # its own recorded id, or a synthesised one when taken
            assert m["tool_call_id"] in (action.tool_call_id, tool_call_id(action.id or 0)), (m, action)


pairing_op = st.one_of(
    st.tuples(st.just("user")),
    st.tuples(st.just("llm"), st.integers(0, 3), st.booleans(), st.booleans()),
    st.tuples(st.just("run"), st.sampled_from(["named", "caused", "bare", "skip"])),
    st.tuples(st.just("run"), st.sampled_from(["named", "caused", "bare"])),
    st.tuples(st.just("foreign"), st.sampled_from(["agent", "user"])),
    st.tuples(st.just("obs"), st.integers(0, 5)),
    st.tuples(st.just("obs"), st.integers(0, 5)),
    st.tuples(st.just("reject")),
    st.tuples(st.just("cond"), st.integers(0, 30), st.integers(0, 6)),
    st.tuples(st.just("edit"), st.sampled_from(["forget", "restore"]), st.integers(0, 30), st.integers(0, 6)),
)


@st.composite
def paired_sessions(draw: st.DrawFn) -> list[Event]:
    """Sessions mixing the agent's logs of today and of before ``tool_call_id``, foreign
    actions, refused responses and arbitrary forgotten (and restored) ranges."""
    size = draw(st.integers(0, 45))
    events: list[Event] = []
    response: LlmResponse | None = None
    pending: list[dict[str, Any]] = []  # calls of the latest response not run yet
    unanswered: list[int] = []
    for o in draw(st.lists(pairing_op, min_size=size, max_size=size)):
        eid = len(events) + 1
        ev: Event
        match o:
            case ("user",):
                ev = Message(content=f"u{eid}", source="user")
            case ("llm", n, reuse_ids, with_think):
                raw = [tool_call("cmd_run", {"command": f"c{eid}.{k}"}, f"call_{k}" if reuse_ids else None)
                       for k in range(n)]  # fmt: skip
                if with_think:
                    raw.insert(0, tool_call("think", {"thought": "hm"}, f"call_t{eid}"))
                ev = response = LlmResponse(model="m", tool_calls=raw)
                pending = [c for c in raw if c["function"]["name"] == "cmd_run"]
            case ("run", how) if pending and response is not None:
                call = pending.pop(0)
                if how == "skip":
                    continue
                command = json.loads(call["function"]["arguments"])["command"]
                ev = CmdRun(
                    command=command,
                    cause=response.id if how in ("named", "caused") else None,
                    **({"tool_call_id": call["id"]} if how == "named" else {}),
                )
            case ("run", _) | ("foreign", _):
                source = o[1] if o[0] == "foreign" and o[1] == "user" else "agent"
                ev = CmdRun(command=f"x{eid}", source=source)
            case ("obs", back) if unanswered:
                target = unanswered.pop(back % len(unanswered))
                ev = CmdOutput(content=f"out of {target}", cause=target)
            case ("obs", _):
                ev = Message(content=f"a{eid}", source="agent")
            case ("reject",) if response is not None and response.id is not None:
                ev = Error(source="agent", content="bad tool call", reason="bad_tool_call", cause=response.id)
                pending = []
            case ("reject",):
                ev = Think(thought="t")
            case ("cond", back, length):
                start = max(1, eid - back)
                ev = Condensation(forgotten=[(start, start + length)])
            case ("edit", edit_op, back, length):
                start = max(1, eid - back)
                ev = ContextEdit(op=edit_op, ranges=[(start, start + length)])
            case _:
                raise AssertionError(o)
        ev = with_id(ev, eid)
        if isinstance(ev, LlmResponse):
            response = ev
        if isinstance(ev, CmdRun):
            unanswered.append(eid)
        events.append(ev)
    return events


@settings(max_examples=300, deadline=None)
@given(paired_sessions())
def test_every_result_is_shown_under_the_call_that_produced_it(events: list[Event]) -> None:
    messages = to_messages(view(events), system_prompt="sys")
    assert_well_formed(messages)
    assert_pairing(messages, events)


MASKING = {
    "strategy": "pipeline",
    "stages": [{"strategy": "masking", "mask_window": 2}, {"strategy": "recent", "max_events": 12}],
}
assert CondenserConfig.from_dict(MASKING).stages  # (a config the step honours, not one it drops)


@settings(max_examples=150, deadline=None)
@given(paired_sessions(), st.lists(st.integers(1, 8), max_size=12))
def test_a_step_folding_only_what_is_new_sends_the_prompt_a_fold_from_scratch_sends(
    events: list[Event], chunks: list[int]
) -> None:
    """The agent role keeps one view per session and folds each step's new events into it: at
    every step the prompt (and the budget check) is the one built from the whole log."""
    builder = ViewBuilder()
    seen: list[Event] = []
    rest = list(events)
    for size in [*chunks, len(rest)]:
        new, rest = rest[:size], rest[size:]
        seen += new
        builder.extend(new)
        kept = builder.view()
        assert build_messages(seen, system="sys", view=kept) == build_messages(seen, system="sys")
        masking = MASKING
        assert build_messages(seen, system="sys", view=kept, condenser_defaults=masking) == build_messages(
            seen, system="sys", condenser_defaults=masking
        )
        assert over_budget(seen, masking, view=kept) == over_budget(seen, masking)

"""A session's prompt kept between steps (riverbed.agent.prompt) is the one built from scratch."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any
from unittest.mock import Mock

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from riverbed.agent.llm import build_messages, over_budget
from riverbed.agent.messages import cache_breakpoints
from riverbed.agent.prompt import EncodedMessages, Prompt
from riverbed.events import (
    CmdOutput,
    CmdRun,
    Condensation,
    ContextEdit,
    Error,
    Event,
    Finish,
    LlmResponse,
    McpList,
    McpTools,
    Message,
    Recall,
    RecallResult,
    SessionConfig,
    Think,
    with_id,
)
from riverbed.memory.tokens import TokenCounter
from riverbed.memory.view import ViewBuilder
from riverbed.workers.model_client import Part, request_body, request_parts
from tests.kit.openai_server import tool_call

MASK_AND_FORGET = {
    "strategy": "pipeline",
    "stages": [{"strategy": "masking", "mask_window": 2}, {"strategy": "recent", "max_events": 40}],
}
MASK_TWICE = {
    "strategy": "pipeline",
    "stages": [
        {"strategy": "masking", "mask_window": 6},
        {"strategy": "amortized", "max_events": None, "budget_tokens": 400},
        {"strategy": "masking", "mask_window": 3, "mask_placeholder": "[hidden]"},
    ],
}
CONFIGS = [None, MASK_AND_FORGET, MASK_TWICE, {"strategy": "noop"}, {"strategy": "masking", "mask_window": 1}]

op = st.one_of(
    st.tuples(st.just("user")),
    st.tuples(st.just("llm"), st.integers(0, 3), st.booleans(), st.booleans(), st.booleans()),
    st.tuples(st.just("run"), st.sampled_from(["named", "caused", "bare", "skip"])),
    st.tuples(st.just("run"), st.sampled_from(["named", "caused"])),
    st.tuples(st.just("foreign"), st.sampled_from(["agent", "user"])),
    st.tuples(st.just("obs"), st.integers(0, 5), st.booleans()),
    st.tuples(st.just("obs"), st.integers(0, 5), st.booleans()),
    st.tuples(st.just("again"), st.integers(0, 5)),
    st.tuples(st.just("said"), st.sampled_from(["message", "think", "finish"])),
    st.tuples(st.just("recall")),
    st.tuples(st.just("recalled"), st.booleans()),
    st.tuples(st.just("ahead")),
    st.tuples(st.just("notice"), st.integers(1, 12)),
    st.tuples(st.just("mcp")),
    st.tuples(st.just("error")),
    st.tuples(st.just("config"), st.integers(0, len(CONFIGS) - 1)),
    st.tuples(st.just("cond"), st.integers(0, 30), st.integers(0, 6), st.sampled_from([None, "", "so far"])),
    st.tuples(
        st.just("edit"), st.sampled_from(["forget", "restore", "pin", "unpin"]), st.integers(0, 30), st.integers(0, 6)
    ),
)


@st.composite
def agent_logs(draw: st.DrawFn) -> list[Event]:
    """Logs as agents write them (responses of tool calls with ids, their actions and results,
    late and repeated results, words the agent says for a response, context recalls, MCP
    listings), with what changes a view in the middle: condensations, context edits, masking
    configs changed by a ``session_config``, and causes that name a later event."""
    size = draw(st.integers(0, 60))
    out: list[Event] = []
    response: LlmResponse | None = None
    pending: list[dict[str, Any]] = []
    unanswered: list[int] = []
    answered: list[int] = []
    recalls: list[int] = []
    user: int | None = None
    for o in draw(st.lists(op, min_size=size, max_size=size)):
        eid = len(out) + 1
        ev: Event
        match o:
            case ("user",):
                ev = Message(content=f"u{eid}", source="user")
                user = eid
            case ("llm", n, reuse_ids, with_think, said):
                raw = [tool_call("cmd_run", {"command": f"c{eid}.{k}"}, f"call_{k}" if reuse_ids else None)
                       for k in range(n)]  # fmt: skip
                if with_think:
                    raw.insert(0, tool_call("think", {"thought": "hm"}, f"call_t{eid}"))
                ev = response = LlmResponse(
                    model="m", tool_calls=raw, content=f"r{eid}" if said else None, cause=eid - 1 or None
                )
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
            case ("obs", back, long) if unanswered:
                target = unanswered.pop(back % len(unanswered))
                answered.append(target)
                ev = CmdOutput(content=("out " * 30 if long else "o") + str(target), cause=target)
            case ("again", back) if answered:
                ev = CmdOutput(
                    content=f"more of {answered[back % len(answered)]}", cause=answered[back % len(answered)]
                )
            case ("said", kind) if response is not None:
                ev = {
                    "message": Message(content=f"m{eid}", source="agent", cause=response.id),
                    "think": Think(thought=f"t{eid}", source="agent", cause=response.id),
                    "finish": Finish(final_thought=f"f{eid}", source="agent", cause=response.id),
                }[kind]
            case ("recall",) if user is not None:
                ev = Recall(recall_type="workspace_context", cause=user, source="agent")
                recalls.append(eid)
            case ("recalled", empty) if recalls:
                ev = RecallResult(
                    recall_type="workspace_context", repo_name=None if empty else "acme/app", cause=recalls.pop(0)
                )
            case ("notice", back) if eid > back:
                ev = CmdOutput(content="about an event that is no call", cause=eid - back)
            case ("ahead",):
                ev = CmdOutput(content="from the future", cause=eid + 2)
            case ("mcp",):
                ev = McpList(server="s", source="agent")
            case ("error",):
                ev = Error(source="agent", content=f"e{eid}")
            case ("config", which):
                ev = SessionConfig(condenser=CONFIGS[which])
            case ("cond", back, length, summary):
                start = max(1, eid - back)
                ev = Condensation(forgotten=[(start, start + length)], summary=summary, summary_offset=back % 3 or None)
            case ("edit", edit_op, back, length):
                start = max(1, eid - back)
                ev = ContextEdit(op=edit_op, ranges=[(start, start + length)])
            case _:
                ev = Think(thought=f"filler {eid}")
        ev = with_id(ev, eid)
        out.append(ev)
        if isinstance(ev, CmdRun):
            unanswered.append(eid)
        if isinstance(ev, McpList):
            out.append(with_id(McpTools(server="s", cause=eid), eid + 1))
    return out


@settings(max_examples=200, deadline=None)
@given(agent_logs(), st.lists(st.integers(1, 4), max_size=30), st.sampled_from(CONFIGS), st.booleans())
def test_a_prompt_kept_between_steps_is_the_prompt_built_from_the_whole_log(
    log: list[Event], chunks: list[int], defaults: dict[str, Any] | None, cached: bool
) -> None:
    """At every step (the log grown by a few events) the kept prompt's messages, their JSON
    (and the request body the model client makes of it) and the budget check are those of the
    pure functions over the whole log, whether it is given each step's view or follows the
    builder (reading only what the view added).  A step's messages lent in place still make
    their own array after the next step changed the prompt, and so do the parts of a request
    body still held as a transport sending it holds them (a view into the prompt's buffer)."""
    builder = ViewBuilder()
    given, following = (
        Prompt(system="sys", condenser_defaults=defaults),
        Prompt(system="sys", condenser_defaults=defaults),
    )
    seen: list[Event] = []
    rest = list(log)
    mode = "anthropic" if cached else "none"
    lent: list[tuple[EncodedMessages, bytes]] = []
    sending: list[tuple[list[Part], bytes]] = []
    for size in [*chunks, len(rest)]:
        new, rest = rest[:size], rest[size:]
        seen += new
        builder.extend(new)
        following.follow(seen, builder)
        given.update(seen, builder.view())
        for parts, array in lent:
            assert parts.join() == array
        for body_parts, sent in sending:
            assert b"".join(body_parts) == sent
        sending = []
        wanted = build_messages(seen, system="sys", condenser_defaults=defaults)
        lent = []
        for prompt in (given, following):
            assert prompt.messages() == wanted
            array = msgspec.json.encode(cache_breakpoints(wanted, mode))
            assert msgspec.json.encode(prompt.encoded(mode)) == array
            parts = prompt.encoded_parts(mode)
            body = {"model": "m", "messages": parts, "tools": [], "tool_choice": "auto"}
            assert json.loads(request_body(body)) == {**body, "messages": json.loads(array)}
            assert json.loads(request_body({"messages": parts})) == {"messages": json.loads(array)}
            lent += [(parts, array), (prompt.encoded_parts(mode), array)]  # (two lent at once: both kept)
            held = request_parts({"messages": prompt.encoded_parts(mode)}, write_apart=0)  # (however short)
            sending.append((held, request_body({"messages": prompt.encoded_parts(mode)})))
            assert prompt.over_budget() == over_budget(seen, defaults)


def test_a_prompt_goes_on_in_a_copy_of_its_json_only_while_a_request_still_sends_it() -> None:
    """While a view of the prompt's JSON is held (a connection still sending a request's body as
    ``request_parts`` lent it), the prompt's next change goes to a copy and the view's bytes stay
    as they were; with none held, the prompt keeps changing its one buffer, copying nothing."""
    log: list[Event] = [with_id(Message(content=f"turn {i}", source="user"), i) for i in range(1, 7)]
    builder, prompt = ViewBuilder(), Prompt(system="sys")
    builder.extend(log[:3])
    prompt.follow(log[:3], builder)
    buffer = prompt._messages.joined
    assert len(request_parts({"messages": prompt.encoded_parts()}, write_apart=0)) == 3  # (sent, let go)
    builder.extend(log[3:4])
    prompt.follow(log[:4], builder)
    assert prompt._messages.joined is buffer
    held = request_parts({"messages": prompt.encoded_parts()}, write_apart=0)
    sending = b"".join(held)
    builder.extend(log[4:])
    prompt.follow(log, builder)
    assert prompt._messages.joined is not buffer
    assert b"".join(held) == sending
    assert json.loads(sending)["messages"] == build_messages(log[:4], system="sys")
    assert json.loads(request_body({"messages": prompt.encoded_parts()}))["messages"] == build_messages(
        log, system="sys"
    )


def steps(log: list[Event], defaults: dict[str, Any] | None = None) -> None:
    """Fold ``log`` one event a step, comparing the kept prompt with the one from scratch."""
    builder, prompt = ViewBuilder(), Prompt(system="sys", condenser_defaults=defaults)
    following = Prompt(system="sys", condenser_defaults=defaults)
    for n, event in enumerate(log, start=1):
        builder.append(event)
        following.follow(log[:n], builder)
        prompt.update(log[:n], builder.view())
        wanted = build_messages(log[:n], system="sys", condenser_defaults=defaults)
        assert prompt.messages() == wanted, n
        assert following.messages() == wanted, n


def test_what_comes_after_a_new_turn_still_goes_with_the_response_before_it() -> None:
    """The places a step converts again from are before responses and user messages; an action,
    a result or the agent's words that go with a response before such a place take the
    conversion back to that response."""
    calls = [tool_call("cmd_run", {"command": "ls"}, "call_a"), tool_call("cmd_run", {"command": "pwd"}, "call_b")]
    steps(
        [
            with_id(e, i)
            for i, e in enumerate(
                [
                    Message(content="go", source="user"),
                    LlmResponse(model="m", tool_calls=calls, content="two things"),
                    Message(content="and hurry", source="user"),
                    CmdRun(command="ls", cause=2, tool_call_id="call_a"),  # (its response is before the message)
                    CmdOutput(content="a", cause=4),
                    Message(content="well?", source="user"),
                    CmdRun(command="pwd", cause=2, tool_call_id="call_b"),
                    Message(content="done soon", source="agent", cause=2),  # (speaks for the response)
                    CmdOutput(content="b", cause=7),
                    CmdOutput(content="more a", cause=4),  # (a second result of the first call)
                    Message(content="next", source="user"),
                    CmdOutput(content="about the user's words", cause=6),  # (a notice of an event that is no call)
                ],
                start=1,
            )
        ]
    )


def command_steps(log: list[Event], count: int, output: Callable[[int], str]) -> None:
    """Append ``count`` steps to ``log``: a response calling ``cmd_run``, its action and the
    result ``output(k)`` of step ``k``."""
    for k in range(count):
        eid = len(log) + 1
        call = tool_call("cmd_run", {"command": f"c{k}"}, f"call_{k}")
        log += [
            with_id(LlmResponse(model="m", tool_calls=[call]), eid),
            with_id(CmdRun(command=f"c{k}", cause=eid, tool_call_id=f"call_{k}"), eid + 1),
            with_id(CmdOutput(content=output(k), cause=eid + 1), eid + 2),
        ]


def test_masking_moving_its_boundary_changes_the_results_it_hides() -> None:
    """Each step adds a result; every other one, masking hides two more older ones."""
    log: list[Event] = [with_id(SessionConfig(condenser={"strategy": "masking", "mask_window": 4}), 1)]
    command_steps(log, 12, lambda k: "output " * 20)
    steps(log)


def test_a_result_joining_a_pinned_call_late_stays_shown_under_masking() -> None:
    """A pinned call's result that comes after other steps joins the pinned unit: masking never
    hides it, however far back it goes (a prompt that follows the builder sees the pin grow)."""
    log: list[Event] = [with_id(SessionConfig(condenser={"strategy": "masking", "mask_window": 2}), 1)]
    late = tool_call("cmd_run", {"command": "slow"}, "call_slow")
    log += [
        with_id(LlmResponse(model="m", tool_calls=[late]), 2),
        with_id(CmdRun(command="slow", cause=2, tool_call_id="call_slow"), 3),
        with_id(ContextEdit(op="pin", ranges=[(2, 3)]), 4),
        with_id(CmdOutput(content="slow output " * 20, cause=3), 5),
    ]
    command_steps(log, 6, lambda k: f"output {k} " * 20)
    steps(log)
    shown = str(build_messages(log, system="sys"))
    assert "slow output" in shown
    assert "output 0" not in shown  # (an older result is masked)


def test_a_step_cut_short_is_made_again_whole_at_the_next_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose update raised (here the condenser's token count, once) leaves nothing
    half-kept: the next step's budget check and messages are the whole log's, whether the
    prompt is given the view or follows the builder."""
    defaults = {"strategy": "amortized", "max_events": None, "budget_tokens": 100}
    log = [with_id(Message(content=f"message {i}: " + "word " * 30, source="user"), i) for i in (1, 2, 3)]
    count = TokenCounter.event
    for follows in (False, True):
        builder, prompt = ViewBuilder(), Prompt(system="sys", condenser_defaults=defaults)
        for n in (1, 2, 3):
            builder.extend(log[n - 1 : n])
            if n == 2:
                monkeypatch.setattr(TokenCounter, "event", Mock(side_effect=OSError("the tokenizer failed")))
            with pytest.raises(OSError, match="tokenizer failed") if n == 2 else contextlib.nullcontext():
                if follows:
                    prompt.follow(log[:n], builder)
                else:
                    prompt.update(log[:n], builder.view())
            monkeypatch.setattr(TokenCounter, "event", count)
        assert over_budget(log, defaults)  # (two messages are within the budget, three are not)
        assert prompt.over_budget(), follows
        assert prompt.messages() == build_messages(log, system="sys", condenser_defaults=defaults), follows

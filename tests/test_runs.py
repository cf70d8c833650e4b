"""The run fold and the agent's next move: pure functions of the log (no Redis); which roles a
worker runs."""

from __future__ import annotations

import json

import pytest
from msgspec.structs import replace

from riverbed import events
from riverbed.agent.define import Agent
from riverbed.agent.delegation import plan_child, refusal, result
from riverbed.agent.runs import (
    AppendAction,
    AppendDelegates,
    CallModel,
    EndRun,
    RejectCalls,
    Wait,
    child_session,
    fold_runs,
    next_move,
    planned_actions,
)
from riverbed.agent.toolbox import Toolbox, made_toolbox
from riverbed.agent.usage import Price
from riverbed.errors import ConfigError
from riverbed.workers.main import parse_roles


def numbered(*batch: events.Event) -> list[events.Event]:
    return [events.with_id(e, i) for i, e in enumerate(batch, start=1)]


def call(name: str, args: dict[str, object], call_id: str) -> dict[str, object]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


USAGE = {"prompt_tokens": 100, "completion_tokens": 20}


def opened(**limits: object) -> list[events.Event]:
    return [events.Message(content="list the files", source="user"), events.RunStarted(**limits)]  # type: ignore[arg-type]


@pytest.fixture
def parsed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the tool calls a toolbox turns into actions (a plan made), in order."""
    names: list[str] = []
    action = Toolbox.action

    def counted(self: Toolbox, name: str, arguments: str) -> events.Action:
        names.append(name)
        return action(self, name, arguments)

    monkeypatch.setattr(Toolbox, "action", counted)
    return names


def test_a_response_is_planned_once_for_the_moves_of_a_step(parsed: list[str]) -> None:
    """``next_move`` plans the run's response once per definition and listings; each caller gets
    lists of its own, and another response (or another cap on its calls) is planned anew."""
    agent = Agent("planner", tools=["cmd_run"])
    calls = [call("cmd_run", {"command": "ls"}, "c1"), call("cmd_run", {"command": "pwd"}, "c2")]
    log = [*opened(), events.LlmResponse(model="m", tool_calls=calls, usage=USAGE, cause=2)]
    fold = fold_runs(numbered(*log))
    first = next_move(fold.run, agent)
    assert isinstance(first, AppendAction)
    second = next_move(fold.run, agent)
    assert isinstance(second, AppendAction)
    assert second.action == replace(first.action, ts=second.action.ts)
    assert second.action.ts >= first.action.ts  # (stamped when asked for, as before)
    assert parsed == ["cmd_run", "cmd_run"]
    assert fold.run is not None
    assert fold.run.response is not None
    planned, _problems = planned_actions(fold.run.response, made_toolbox(agent))
    planned.clear()
    assert [a.tool_call_id for a in planned_actions(fold.run.response, made_toolbox(agent))[0]] == ["c1", "c2"]
    assert parsed == ["cmd_run", "cmd_run"]
    planned_actions(fold.run.response, made_toolbox(agent), max_calls=1)
    again = fold_runs([events.decode(events.encode(e), e.id) for e in numbered(*log)])  # (as the log gives it back)
    assert isinstance(next_move(again.run, agent), AppendAction)
    assert len(parsed) == 2
    other = replace(log[-1], tool_calls=[call("cmd_run", {"command": "id"}, "c1")])  # (same id and stamp, other calls)
    assert isinstance(next_move(fold_runs(numbered(*log[:-1], other)).run, agent), AppendAction)
    assert len(parsed) == 3


def test_the_steps_of_sessions_sharing_a_toolbox_keep_their_plans(parsed: list[str]) -> None:
    """The sessions of one agent share its toolbox: their steps, interleaved, each plan their
    response once, and the response as a step made it (before its append) and as the log gives it
    back (decoded again) share that plan."""
    agent = Agent("sharing", tools=["cmd_run", "file_read"])
    box = made_toolbox(agent)
    made = [
        events.LlmResponse(model="m", tool_calls=[call("cmd_run", {"command": "ls"}, "c1")], usage=USAGE, cause=2),
        events.LlmResponse(model="m", tool_calls=[call("file_read", {"path": "p"}, "c2")], usage=USAGE, cause=2),
    ]
    for response in made:  # (each step plans its response with the id it will have)
        planned_actions(replace(response, id=3), box)
    folds = [fold_runs([events.decode(events.encode(e), e.id) for e in numbered(*opened(), r)]) for r in made]
    for _ in range(3):
        for fold in folds:
            move = next_move(fold.run, agent)
            assert isinstance(move, AppendAction)
    assert parsed == ["cmd_run", "file_read"]
    assert [type(m.action) for m in (next_move(f.run, agent) for f in folds)] == [events.CmdRun, events.FileRead]  # type: ignore[union-attr]


def test_no_run_waits() -> None:
    fold = fold_runs(numbered(events.Message(content="hi", source="user")))
    assert fold.run is None
    assert next_move(fold.run) == Wait()


def test_an_open_run_calls_the_model_first() -> None:
    fold = fold_runs(numbered(*opened(max_steps=3)))
    assert fold.run is not None
    assert (fold.run.state, fold.run.opened, fold.run.task, fold.run.max_steps) == ("running", 2, 1, 3)
    assert next_move(fold.run) == CallModel()


def test_actions_are_appended_one_at_a_time_each_after_the_answer_before() -> None:
    response = events.LlmResponse(
        model="m",
        tool_calls=[call("cmd_run", {"command": "ls"}, "c1"), call("cmd_run", {"command": "pwd"}, "c2")],
        usage=USAGE,
        cause=2,
    )
    log = [*opened(), response]
    fold = fold_runs(numbered(*log))
    move = next_move(fold.run)
    assert isinstance(move, AppendAction)
    assert (move.response, move.index, move.action.tool_call_id, move.action.cause) == (3, 0, "c1", 3)
    first = events.CmdRun(command="ls", cause=3, tool_call_id="c1")
    fold = fold_runs(numbered(*log, first))
    assert next_move(fold.run) == Wait()  # its answer is owed
    assert fold.run is not None
    assert fold.run.unanswered == [4]
    answered = [*log, first, events.CmdOutput(content="a\n", exit_code=0, cause=4)]
    move = next_move(fold_runs(numbered(*answered)).run)
    assert isinstance(move, AppendAction)
    assert move.index == 1
    assert move.action.tool_call_id == "c2"
    done = [*answered, events.CmdRun(command="pwd", cause=3, tool_call_id="c2"), events.CmdOutput(content="/", cause=6)]
    fold = fold_runs(numbered(*done))
    assert next_move(fold.run) == CallModel()
    assert fold.run is not None
    assert (fold.run.steps, fold.run.tokens) == (1, 120)


def test_a_response_without_calls_finishes_with_its_text() -> None:
    log = [*opened(), events.LlmResponse(model="m", content="All done.", usage=USAGE)]
    move = next_move(fold_runs(numbered(*log)).run)
    assert isinstance(move, AppendAction)
    assert isinstance(move.action, events.Finish)
    assert move.action.final_thought == "All done."
    fold = fold_runs(numbered(*log, move.action))
    assert fold.run is not None
    assert (fold.run.state, fold.run.end_reason) == ("finished", "finish")
    assert next_move(fold.run) == Wait()


def test_bad_tool_calls_are_rejected_once() -> None:
    log = [*opened(), events.LlmResponse(model="m", tool_calls=[call("teleport", {}, "c1")], usage=USAGE)]
    move = next_move(fold_runs(numbered(*log)).run)
    assert isinstance(move, RejectCalls)
    assert "teleport" in move.content
    rejected = events.Error(source="agent", cause=3, content=move.content, reason="bad_tool_call")
    assert next_move(fold_runs(numbered(*log, rejected)).run) == CallModel()


def test_the_step_limit_is_checked_before_the_call() -> None:
    step = [
        events.LlmResponse(model="m", tool_calls=[call("think", {"thought": "hm"}, "c1")], usage=USAGE),
        events.Think(thought="hm", cause=3, tool_call_id="c1"),
    ]
    fold = fold_runs(numbered(*opened(max_steps=1), *step))
    move = next_move(fold.run)
    assert isinstance(move, EndRun)
    assert move.reason == "step_limit"


def test_tokens_and_cost_budgets() -> None:
    step = [events.LlmResponse(model="m", content=None, tool_calls=[call("think", {"thought": "x"}, "c")], usage=USAGE)]
    step.append(events.Think(thought="x", cause=3, tool_call_id="c"))
    over_tokens = next_move(fold_runs(numbered(*opened(max_tokens=120), *step)).run)
    assert isinstance(over_tokens, EndRun)
    assert over_tokens.reason == "budget_exhausted"
    assert next_move(fold_runs(numbered(*opened(max_tokens=121), *step)).run) == CallModel()
    prices = {"m": Price(prompt=1_000_000, completion=0)}  # 100 prompt tokens: 100 USD
    fold = fold_runs(numbered(*opened(max_cost=100.0), *step), prices)
    over_cost = next_move(fold.run)
    assert isinstance(over_cost, EndRun)
    assert over_cost.reason == "budget_exhausted"
    assert "USD" in over_cost.content
    unpriced = fold_runs(numbered(*opened(max_cost=100.0), *step))
    assert unpriced.run is not None
    assert not unpriced.run.priced
    assert next_move(unpriced.run) == CallModel()


def test_a_cancel_ends_the_run_and_the_end_is_folded() -> None:
    log = [*opened(), events.RunCancel(note="stop")]
    move = next_move(fold_runs(numbered(*log)).run)
    assert isinstance(move, EndRun)
    assert move.reason == "cancelled"
    fold = fold_runs(numbered(*log, events.Error(source="agent", content="x", reason="cancelled")))
    assert fold.run is not None
    assert fold.run.state == "cancelled"
    assert next_move(fold.run) == Wait()


def test_an_error_that_is_not_a_run_ending_leaves_the_run_open() -> None:
    log = [*opened(), events.Error(source="agent", content="x", reason="timeout")]
    fold = fold_runs(numbered(*log))
    assert fold.run is not None
    assert fold.run.open
    fold = fold_runs(numbered(*log, events.Error(source="runtime", content="x", reason="llm_error")))
    assert fold.run is not None
    assert fold.run.open


def test_a_second_run_starts_afresh_once_the_first_ended() -> None:
    first = [*opened(), events.Error(source="agent", content="x", reason="llm_error")]
    fold = fold_runs(numbered(*first, events.RunStarted(max_steps=5)))
    assert fold.run is not None
    assert fold.runs == 2
    assert fold.run.opened == 4
    assert fold.run.open
    assert fold.run.steps == 0
    assert fold.run.max_steps == 5
    # A run_started while a run is open does not open another.
    fold = fold_runs(numbered(*opened(), events.RunStarted(max_steps=5)))
    assert fold.run is not None
    assert fold.runs == 1
    assert fold.run.opened == 2


def test_worker_all_includes_the_agent_role_only_when_a_model_is_configured() -> None:
    assert parse_roles(["all"]) == ["runtime", "memory", "condenser"]
    assert parse_roles(["all"], model_configured=True) == ["runtime", "memory", "condenser", "agent"]
    assert parse_roles(["agent,runtime"], model_configured=True) == ["agent", "runtime"]
    with pytest.raises(ConfigError, match="OPENAI_BASE_URL"):
        parse_roles(["agent"])


def test_a_run_open_at_a_fork_point_is_not_continued_in_the_fork() -> None:
    fold = fold_runs(numbered(*opened(), events.Forked(source_session="s", at=2)))
    assert fold.run is not None
    assert (fold.run.state, fold.run.end_reason) == ("cancelled", "forked")
    assert next_move(fold.run) == Wait()
    again = fold_runs(numbered(*opened(), events.Forked(source_session="s", at=2), events.RunStarted()))
    assert again.run is not None
    assert again.run.open


# --- sub-agents ------------------------------------------------------------------------------


def delegating(*, calls: int = 3, **limits: object) -> list[events.Event]:
    """A run (limits) whose first response calls ``delegate`` ``calls`` times, then ``think``."""
    tool_calls = [call("delegate", {"task": f"part {i}", "max_tokens": 50_000}, f"d{i}") for i in range(calls)]
    tool_calls.append(call("think", {"thought": "meanwhile"}, "t"))
    return [*opened(**limits), events.LlmResponse(model="m", tool_calls=tool_calls, usage=USAGE)]


def test_delegate_calls_that_follow_one_another_are_appended_together() -> None:
    log = delegating(calls=3)
    move = next_move(fold_runs(numbered(*log)).run)
    assert isinstance(move, AppendDelegates)
    assert (move.response, move.index) == (3, 0)
    assert [a.task for a in move.actions] == ["part 0", "part 1", "part 2"]
    assert [a.tool_call_id for a in move.actions] == ["d0", "d1", "d2"]
    appended = [*log, *move.actions]
    fold = fold_runs(numbered(*appended))
    assert fold.run is not None
    assert fold.run.delegates == [4, 5, 6]
    assert [a.id for a in fold.run.waiting_delegates] == [4, 5, 6]
    assert next_move(fold.run) == Wait()  # the think waits until every child answered
    results = [
        events.DelegateResult(session=f"c{i}", content="ok", tokens=10, cost=None, cause=4 + i) for i in range(3)
    ]
    fold = fold_runs(numbered(*appended, *results))
    assert fold.run is not None
    move = next_move(fold.run)
    assert isinstance(move, AppendAction)
    assert (move.index, move.action.kind) == (3, "think")
    # The children's spend counts in the parent's run.
    assert (fold.run.child_tokens, fold.run.tokens) == (30, 150)
    assert not fold.run.priced


def test_budget_shares_depth_and_fanout_are_rules_of_the_fold() -> None:
    log = delegating(calls=3, max_tokens=30_120, max_cost=3.0, max_steps=7)
    move = next_move(fold_runs(numbered(*log)).run)
    assert isinstance(move, AppendDelegates)
    fold = fold_runs(numbered(*log, *move.actions))
    run = fold.run
    assert run is not None
    assert run.spent_at_response == (120, 0.0)
    first = run.waiting_delegates[0]
    plan = plan_child("s", fold, run, first)
    assert plan.session == child_session("s", 4) == "s.sub4"
    assert (plan.header.parent, plan.header.parent_action, plan.header.depth) == ("s", 4, 1)
    assert plan.task.content == "part 0"
    # A third of the 30,000 tokens left (the model asked for 50,000), a third of the cost.
    assert (plan.started.max_tokens, plan.started.max_cost, plan.started.max_steps) == (10_000, 1.0, 7)
    assert refusal(fold, run, first, max_depth=3, max_fanout=8) is None
    fanout = refusal(fold, run, run.waiting_delegates[2], max_depth=3, max_fanout=2)
    assert fanout is not None
    assert "handed out 2 tasks" in fanout
    depth = refusal(fold, run, first, max_depth=0, max_fanout=8)
    assert depth is not None
    assert "at most 0 levels deep" in depth
    # A child at depth 3 may not delegate with the default limit.
    child = numbered(events.Delegated(parent="p", parent_action=9, depth=3), *delegating(calls=1)[0:])
    child_fold = fold_runs(child)
    assert child_fold.depth == 3
    move = next_move(child_fold.run)
    assert isinstance(move, AppendDelegates)
    child_fold = fold_runs([*child, events.with_id(move.actions[0], len(child) + 1)])
    assert child_fold.run is not None
    why = refusal(child_fold, child_fold.run, child_fold.run.waiting_delegates[0], max_depth=3, max_fanout=8)
    assert why is not None
    assert "3 levels below" in why
    # Nothing left to share: refused.
    spent = delegating(calls=1, max_tokens=100)
    move = next_move(fold_runs(numbered(*spent)).run)
    assert isinstance(move, AppendDelegates)
    broke = fold_runs(numbered(*spent, *move.actions))
    assert broke.run is not None
    why = refusal(broke, broke.run, broke.run.waiting_delegates[0], max_depth=3, max_fanout=8)
    assert why is not None
    assert "no tokens left" in why


def test_a_child_answers_its_parent_from_its_first_run_unless_forked() -> None:
    header = events.Delegated(parent="p", parent_action=7)
    base = [header, events.Message(content="do it", source="user"), events.RunStarted()]
    ended = [*base, events.LlmResponse(model="m", content="it is done", usage=USAGE)]
    finished = [*ended, events.Finish(final_thought="it is done", cause=4)]
    fold = fold_runs(numbered(*finished))
    assert fold.reports_to == ("p", 7)
    assert fold.run is not None
    answer = result("p.sub7", fold.run, 7)
    assert (answer.session, answer.content, answer.state, answer.cause) == ("p.sub7", "it is done", "finished", 7)
    assert answer.tokens == 120
    cancelled = fold_runs(
        numbered(*base, events.RunCancel(), events.Error(source="agent", content="x", reason="cancelled"))
    )
    assert cancelled.run is not None
    failed = result("p.sub7", cancelled.run, 7)
    assert failed.state == "cancelled"
    assert failed.content.startswith("the sub-agent's run ended with cancelled")
    # A fork keeps the header (it shows where the work came from) but never answers the parent.
    forked = fold_runs(numbered(*finished, events.Forked(source_session="p.sub7", at=5)))
    assert forked.delegated == events.with_id(header, 1)
    assert forked.reports_to is None
    # A later run of the child is not the one the parent waits for.
    again = fold_runs(numbered(*finished, events.Message(content="more", source="user"), events.RunStarted()))
    assert again.reports_to is None
    # A header anywhere but event 1 means nothing.
    late = fold_runs(numbered(events.Message(content="x", source="user"), header, events.RunStarted()))
    assert (late.delegated, late.reports_to, late.depth) == (None, None, 0)


def test_child_ids_are_derived_and_valid() -> None:
    assert child_session("a", 3) == "a.sub3"
    long = "x" * 125
    derived = child_session(long, 12)
    assert derived == child_session(long, 12)
    assert derived.endswith(".sub12")
    assert len(derived) <= 128

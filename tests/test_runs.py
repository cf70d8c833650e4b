"""The run fold and the agent's next move: pure functions of the log (no Redis); which roles a
worker runs."""

from __future__ import annotations

import json

import pytest

from riverbed import events
from riverbed.agent.runs import (
    AppendAction,
    CallModel,
    EndRun,
    RejectCalls,
    Wait,
    fold_runs,
    next_move,
)
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

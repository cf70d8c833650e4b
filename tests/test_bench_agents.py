"""The agents bench's own parts that decide what it measures: the seeded context and how the
scripted model tells a run's step (pure, no Redis)."""

from __future__ import annotations

import json
from typing import Any

from bench.agents import NO_CONDENSING, _earlier_turns
from bench.model_server import _REQUEST, _run_step, task_text
from riverbed import events


def step_of(messages: list[dict[str, Any]]) -> tuple[str | None, int, int | None]:
    """``_run_step`` of a request holding ``messages``, decoded as the server decodes it."""
    return _run_step(_REQUEST.decode(json.dumps({"model": "m", "messages": messages})).messages)


def test_earlier_turns_are_shaped_as_the_agent_writes_them() -> None:
    seeded = [events.with_id(e, i) for i, e in enumerate(_earlier_turns(2000, "acme"), start=1)]
    assert 1900 <= len(seeded) <= 2100
    first = seeded[0]
    assert isinstance(first, events.SessionConfig)
    assert first.condenser == NO_CONDENSING
    assert all(e.tenant == "acme" for e in seeded)
    by_id = {e.id: e for e in seeded}
    actions = [e for e in seeded if isinstance(e, events.FileRead | events.CmdRun)]
    assert actions
    for action in actions:
        response = by_id[action.cause]
        assert isinstance(response, events.LlmResponse)
        assert [call["id"] for call in response.tool_calls] == [action.tool_call_id]
        assert response.tool_calls[0]["function"]["name"] == action.kind
        answer = by_id[action.id + 1]
        assert isinstance(answer, events.Observation)
        assert answer.cause == action.id
    finishes = [e for e in seeded if isinstance(e, events.Finish)]
    assert finishes
    assert all(isinstance(by_id[f.cause], events.LlmResponse) for f in finishes)


def test_a_step_is_counted_from_the_runs_own_task_which_says_its_steps() -> None:
    earlier = [
        {"role": "user", "content": "earlier turn 0: make the tests pass"},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "assistant", "content": "done"},
    ]
    task = {"role": "user", "content": task_text("s-1", 5)}
    assert step_of([{"role": "system", "content": "sys"}, *earlier, task]) == ("s-1", 1, 5)
    answered = [task, {"role": "assistant", "content": None}, {"role": "tool", "content": "x"}]
    assert step_of([*earlier, *answered]) == ("s-1", 2, 5)
    assert step_of([{"role": "user", "content": task_text("s-2", 2)}]) == ("s-2", 1, 2)
    assert step_of([{"role": "user", "content": "bench run s-3: anything"}]) == ("s-3", 1, None)
    assert step_of(earlier) == (None, 3, None)

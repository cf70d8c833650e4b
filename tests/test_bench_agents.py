"""The agents bench's own parts that decide what it measures: the seeded context and how the
scripted model tells a run's step and holds calls at its gates (pure, no Redis)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from bench.agents import NO_CONDENSING, _earlier_turns, _prompt_bytes
from bench.model_server import _REQUEST, ModelServer, _run_step, task_text
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


def test_a_padded_context_is_as_long_in_bytes_as_the_larger_one_with_its_own_events() -> None:
    pad = _prompt_bytes(2000) - _prompt_bytes(20)
    assert pad > 200_000
    assert abs(_prompt_bytes(20, pad) - _prompt_bytes(2000)) < _prompt_bytes(2000) // 50
    assert len(_earlier_turns(20, None, pad)) == len(_earlier_turns(20, None))


def test_the_gates_hold_each_runs_first_and_last_calls_until_released() -> None:
    """Between the two releases the runs make their later calls alone: none is held, none waits."""

    async def scenario() -> None:
        server = ModelServer(latency=0.0, steps=3, model="m")

        def ask(session: str, answered: int) -> bytes:
            messages = [{"role": "user", "content": task_text(session, 3)}]
            messages += [{"role": "assistant", "content": None}, {"role": "tool", "content": "x"}] * answered
            return json.dumps({"model": "m", "messages": messages}).encode()

        async def call(session: str, answered: int) -> Any:
            return (await server.answer("POST", "/v1/chat/completions", ask(session, answered)))[1]

        async def held() -> Any:
            return (await server.answer("GET", "/gates", b""))[1]

        await server.answer("POST", "/gates/close", b"")
        firsts = [asyncio.ensure_future(call(s, 0)) for s in ("a", "b")]
        await asyncio.sleep(0.05)
        assert await held() == {"held": 2, "received": 2}
        assert not any(f.done() for f in firsts)
        await server.answer("POST", "/gates/release", b"")
        assert [f["choices"][0]["finish_reason"] for f in await asyncio.gather(*firsts)] == ["tool_calls"] * 2
        assert (await call("a", 1))["choices"][0]["finish_reason"] == "tool_calls"  # (step 2: not held)
        last = asyncio.ensure_future(call("a", 2))
        await asyncio.sleep(0.05)
        assert await held() == {"held": 1, "received": 4}
        await server.answer("POST", "/gates/open", b"")
        assert (await last)["choices"][0]["message"]["content"] == "done"
        assert (await call("b", 2))["choices"][0]["message"]["content"] == "done"  # (open: not held)

    asyncio.run(scenario())

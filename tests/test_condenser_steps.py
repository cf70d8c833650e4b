"""The condenser as a user meets it: the worker's ``RIVERBED_CONDENSER_*`` defaults under each
session's ``session_config``, the run's task never condensed away, one condensation per step
(a ``condensation_request`` that raced a condensation gets no second, empty one) and none after
the run ended.  The pure policy first, then the condenser role in-process against real Redis."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from riverbed import events
from riverbed.bus.consumer import Owner
from riverbed.client.session import Bus
from riverbed.errors import ConfigError
from riverbed.memory.condensers import CondenserConfig, condense, config_from_log
from riverbed.memory.view import view as fold
from riverbed.settings import Settings
from riverbed.workers.condenser_role import CondenserHandler, build_condenser_handler
from tests.kit.openai_server import OpenAIServer

pytestmark = pytest.mark.anyio


def numbered(items: list[events.Event]) -> list[events.Event]:
    return [events.with_id(e, i) for i, e in enumerate(items, start=1)]


def work(turns: int) -> list[events.Event]:
    """``turns`` tool calls with their results."""
    out: list[events.Event] = []
    for i in range(turns):
        out += [events.CmdRun(command=f"step {i}"), events.CmdOutput(content=f"out {i}", exit_code=0)]
    return out


# --- defaults -----------------------------------------------------------------------------


def test_the_worker_defaults_hold_where_a_session_config_does_not_say() -> None:
    settings = Settings.from_env(
        {"RIVERBED_CONDENSER_STRATEGY": "recent", "RIVERBED_CONDENSER_MAX_EVENTS": "40", "RIVERBED_LLM_TIMEOUT": "300"}
    )
    defaults = settings.condenser_defaults()
    assert config_from_log([], defaults) == CondenserConfig(strategy="recent", max_events=40, llm_timeout=300)
    log = [events.SessionConfig(condenser={"max_events": 12, "keep_first": 2})]
    config = config_from_log(log, defaults)
    assert (config.strategy, config.max_events, config.keep_first, config.llm_timeout) == ("recent", 12, 2, 300)
    # Zero limits are no limits; the defaults alone are the built-in ones.
    assert Settings.from_env({"RIVERBED_CONDENSER_MAX_EVENTS": "0"}).condenser_defaults()["max_events"] is None
    assert config_from_log([], Settings().condenser_defaults()) == CondenserConfig()


def test_defaults_that_do_not_go_together_stop_the_worker_with_one_sentence() -> None:
    with pytest.raises(ConfigError, match=r"RIVERBED_CONDENSER_\* settings do not go together.*keep_first"):
        build_condenser_handler(
            Settings.from_env({"RIVERBED_CONDENSER_MAX_EVENTS": "3", "RIVERBED_CONDENSER_KEEP_FIRST": "2"})
        )
    with pytest.raises(ConfigError, match="RIVERBED_CONDENSER_STRATEGY"):
        Settings.from_env({"RIVERBED_CONDENSER_STRATEGY": "forget-all"})


# --- the task ---------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["recent", "amortized"])
async def test_the_task_message_is_never_condensed_away(strategy: str) -> None:
    config = CondenserConfig.from_dict({"strategy": strategy, "max_events": 10, "tokenizer": "estimate"})
    # A session configured first (so keep_first = 1 keeps the config, not the task), one run
    # done, then a second run with its own task in the middle of a long history.
    log = numbered(
        [
            events.SessionConfig(condenser={"max_events": 10}),
            events.Message(content="first task: fix app.py", source="user"),
            events.RunStarted(),
            *work(6),
            events.Finish(source="agent"),
            events.Message(content="second task: add a test", source="user"),
            events.RunStarted(),
            *work(8),
            events.Message(content="also keep it short", source="user"),
            *work(4),
        ]
    )
    condensation = await condense(fold(log), config)
    assert condensation is not None
    after = fold([*log, events.with_id(condensation, len(log) + 1)])
    said = [e.content for e in after if isinstance(e, events.Message) and e.source == "user"]
    assert said == ["first task: fix app.py", "second task: add a test", "also keep it short"]
    assert any(isinstance(e, events.CmdRun) and e.command == "step 0" for e in log)
    assert not any(isinstance(e, events.CmdRun) and e.command == "step 0" for e in after)  # it did condense


# --- one condensation per step, none after the run ----------------------------------------------


async def until(bus: Bus, session: str, predicate: Any, timeout: float = 15) -> list[events.Event]:
    with anyio.fail_after(timeout):
        while True:
            log = await bus.session(session).events()
            if predicate(log):
                return log
            await anyio.sleep(0.05)


async def settled(bus: Bus, session: str, role: str = "condenser", timeout: float = 15) -> None:
    """Until ``role`` has delivered and acknowledged every event of the session's log."""
    key = bus.keys.log(session)
    with anyio.fail_after(timeout):
        while True:
            last = await bus.session(session).last_id()
            groups = {g["name"].decode(): g for g in await bus.redis.xinfo_groups(key)}
            group = groups.get(role)
            if group is not None and group["last-delivered-id"].decode() == f"{last}-0" and group["pending"] == 0:
                return
            await anyio.sleep(0.05)


def condensations(log: list[events.Event]) -> list[events.Condensation]:
    return [e for e in log if isinstance(e, events.Condensation)]


async def test_a_request_that_raced_a_condensation_gets_no_second_one(bus: Bus) -> None:
    owner = Owner(bus.redis, bus.keys, CondenserHandler(llm=None, model=None), worker="c1", url=bus.url)
    session = bus.session("raced")
    await session.append(events.SessionConfig(condenser={"strategy": "amortized", "max_events": 12}))
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        # The agent saw this history over the limit and asks; the condenser, on its own, got
        # there first: the request arrives right after its condensation.
        (*_, seen) = await session.append(events.Message(content="the task", source="user"), *work(10))
        log = await until(bus, "raced", lambda log: len(condensations(log)) == 1)
        answer = await session.act(events.CondensationRequest(cause=seen), timeout=10)
        assert isinstance(answer, events.Error), answer
        assert answer.reason == "already_condensed"
        assert f"condensed by event {condensations(log)[0].id}" in answer.content
        # A request made on the condensed view is honoured, and so is one that names no view.
        answer = await session.act(events.CondensationRequest(cause=condensations(log)[0].id), timeout=10)
        assert isinstance(answer, events.Condensation)
        assert answer.forgotten
        await session.append(*work(4))
        answer = await session.act(events.CondensationRequest(), timeout=10)
        assert isinstance(answer, events.Condensation)
        assert answer.forgotten
        await owner.drain(2)
    log = await session.events()
    assert len(condensations(log)) == 3
    assert all(c.forgotten for c in condensations(log))  # no `forgot []`


async def test_a_request_made_while_the_condenser_works_is_answered_by_its_condensation(bus: Bus) -> None:
    with OpenAIServer() as server:
        # The condenser's own condensation takes a while (its summary); the agent's request lands
        # meanwhile, so the condensation is made again on the newer log and answers it.
        server.reply("TASK: the task. DONE: steps.", delay=1.0)
        server.reply("TASK: the task. DONE: steps.")
        server.reply("TASK: the task. DONE: a third summary nobody should ask for.")
        owner = Owner(
            bus.redis, bus.keys, CondenserHandler(llm=server.client(), model="test-model"), worker="c1", url=bus.url
        )
        session = bus.session("inflight")
        await session.append(
            events.SessionConfig(condenser={"strategy": "summarizing", "max_events": 12, "summary_tokens": 64})
        )
        async with anyio.create_task_group() as tg:
            await tg.start(owner.run)
            await session.append(events.Message(content="the task", source="user"), *work(10))
            with anyio.fail_after(10):
                while not server.requests:
                    await anyio.sleep(0.02)
            answer = await session.act(events.CondensationRequest(), timeout=15)
            await settled(bus, "inflight")
            await owner.drain(2)
    log = await bus.session("inflight").events()
    assert len(condensations(log)) == 1, [(c.id, c.cause, c.forgotten) for c in condensations(log)]
    assert isinstance(answer, events.Condensation)
    assert answer.forgotten


async def test_nothing_is_condensed_after_the_run_ended_until_the_session_goes_on(bus: Bus) -> None:
    owner = Owner(bus.redis, bus.keys, CondenserHandler(llm=None, model=None), worker="c1", url=bus.url)
    session = bus.session("ended")
    await session.append(events.SessionConfig(condenser={"strategy": "amortized", "max_events": 12}))
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        await session.append(events.Message(content="the task", source="user"), events.RunStarted())
        # The run's last step takes the view over the limit, and the run ends in the same batch.
        await session.append(*work(10), events.Finish(source="agent", final_thought="done"))
        await settled(bus, "ended")
        assert condensations(await session.events()) == []
        # The next run's task: now the view is condensed, before its first prompt.
        await session.append(events.Message(content="the next task", source="user"))
        log = await until(bus, "ended", lambda log: len(condensations(log)) == 1)
        await owner.drain(2)
    assert condensations(log)[0].id == len(log)
    assert isinstance(log[-2], events.Message)
    assert log[-2].content == "the next task"

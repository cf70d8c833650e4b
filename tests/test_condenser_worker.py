"""The condenser role in-process against real Redis: budgets held, requests answered, failures reported."""

from __future__ import annotations

import anyio
import pytest

from riverbed import events
from riverbed.bus.consumer import Owner
from riverbed.client.session import Bus
from riverbed.memory.view import view as fold
from riverbed.workers import condenser_role
from riverbed.workers.condenser_role import CondenserHandler
from tests.kit.openai_server import OpenAIServer
from tests.kit.patience import patience

pytestmark = pytest.mark.anyio


async def wait_for(bus: Bus, session: str, predicate: object, timeout: float = 10) -> list[events.Event]:
    with anyio.fail_after(timeout):
        while True:
            log = await bus.session(session).events()
            if predicate(log):  # type: ignore[operator]
                return log
            await anyio.sleep(0.05)


async def test_event_ceiling_holds_in_every_view_and_the_log_keeps_everything(bus: Bus) -> None:
    owner = Owner(bus.redis, bus.keys, CondenserHandler(llm=None, model=None), worker="c1", url=bus.url)
    session = bus.session("long")
    await session.append(events.SessionConfig(condenser={"strategy": "recent", "max_events": 12, "keep_first": 1}))
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        for i in range(60):
            await session.append(events.Message(content=f"message {i}", source="user"))
            await anyio.sleep(0.01)
        log = await wait_for(
            bus, "long", lambda log: len(fold(log)) <= 12 and any(isinstance(e, events.Condensation) for e in log)
        )
        await owner.drain(2)
    assert sum(isinstance(e, events.Message) for e in log) == 60  # nothing is ever deleted
    # Between condensations a view may grow past the ceiling by what arrived while the condenser
    # worked: 10 on a quiet machine, more on a busy one (the appends do not wait for it).
    slack = round(10 * patience())
    for n in range(1, len(log) + 1):
        assert len(fold(log, until=n)) <= 12 + slack


async def test_a_condensation_request_is_always_answered(bus: Bus) -> None:
    owner = Owner(bus.redis, bus.keys, CondenserHandler(llm=None, model=None), worker="c1", url=bus.url)
    session = bus.session("asks")
    await session.append(*[events.Message(content=f"m{i}", source="user") for i in range(8)])
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        answer = await session.act(events.CondensationRequest(), timeout=10)
        await owner.drain(2)
    assert isinstance(answer, events.Condensation)
    assert answer.forgotten


async def test_llm_failure_is_an_error_event_and_the_session_goes_on(bus: Bus) -> None:
    with OpenAIServer() as server:
        server.fail(500, times=1)
        handler = CondenserHandler(llm=server.client(), model="test-model")
        owner = Owner(bus.redis, bus.keys, handler, worker="c1", url=bus.url)
        session = bus.session("llm")
        await session.append(
            events.SessionConfig(condenser={"strategy": "summarizing", "max_events": 40, "keep_first": 1}),
            *[events.Message(content=f"m{i}", source="user") for i in range(10)],
        )
        async with anyio.create_task_group() as tg:
            await tg.start(owner.run)
            answer = await session.act(events.CondensationRequest(), timeout=10)
            assert isinstance(answer, events.Error)
            assert answer.reason == "condensation_failed"
            server.reply("Task: count messages. Decisions: none. Files: none.")
            answer = await session.act(events.CondensationRequest(), timeout=10)
            await owner.drain(2)
    assert isinstance(answer, events.Condensation)
    assert answer.summary
    assert "count messages" in answer.summary
    log = await bus.session("llm").events()
    assert not any(isinstance(e, events.Condensation) and e.cause is None for e in log)


async def test_a_log_that_moved_past_the_batch_is_still_condensed(bus: Bus) -> None:
    # The bad config makes the handler append an error before it condenses: the log has then
    # moved past the batch, and the condensation must be made on the newer history.
    owner = Owner(bus.redis, bus.keys, CondenserHandler(llm=None, model=None), worker="c1", url=bus.url)
    session = bus.session("moved")
    await session.append(
        events.SessionConfig(condenser={"strategy": "recent", "max_events": 12, "keep_first": 1}),
        *[events.Message(content=f"m{i}", source="user") for i in range(30)],
        events.SessionConfig(condenser={"strategy": "no-such-strategy"}),
    )
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        log = await wait_for(bus, "moved", lambda log: any(isinstance(e, events.Condensation) for e in log))
        await owner.drain(2)
    assert any(isinstance(e, events.Error) and e.reason == "bad_condenser_config" for e in log)
    assert len(fold(log)) <= 12


async def test_condensations_carry_the_sessions_tenant_and_trace(bus: Bus) -> None:
    from riverbed import tracing  # noqa: PLC0415

    owner = Owner(bus.redis, bus.keys, CondenserHandler(llm=None, model=None), worker="c1", url=bus.url)
    session = bus.session("tenanted", tenant="acme")
    await session.append(events.SessionConfig(condenser={"strategy": "recent", "max_events": 6, "keep_first": 1}))
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        await session.append(*[events.Message(content=f"m{i}", source="user") for i in range(12)])
        log = await wait_for(bus, "tenanted", lambda log: any(isinstance(e, events.Condensation) for e in log))
        request = events.CondensationRequest(trace=tracing.new_trace())
        answer = await session.act(request, timeout=10)
        await owner.drain(2)
    automatic = next(e for e in log if isinstance(e, events.Condensation))
    assert automatic.tenant == "acme"
    assert tracing.trace_id(automatic.trace) == tracing.trace_id(session.trace)
    assert isinstance(answer, events.Condensation)
    assert answer.tenant == "acme"
    assert tracing.trace_id(answer.trace) == tracing.trace_id(request.trace)


async def test_a_restore_of_events_the_condenser_let_go_is_folded_again_from_the_log(bus: Bus) -> None:
    # The condenser keeps no hidden event in memory; a user's restore brings some back into
    # the context, so it folds the log again and condenses the restored view within budget.
    owner = Owner(bus.redis, bus.keys, CondenserHandler(llm=None, model=None), worker="c1", url=bus.url)
    session = bus.session("restored")
    await session.append(events.SessionConfig(condenser={"strategy": "recent", "max_events": 12, "keep_first": 1}))
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        await session.append(*[events.Message(content=f"m{i}", source="user") for i in range(40)])
        log = await wait_for(
            bus, "restored", lambda log: len(fold(log)) <= 12 and any(isinstance(e, events.Condensation) for e in log)
        )
        condensed = sum(isinstance(e, events.Condensation) for e in log)
        (restore,) = await session.append(events.ContextEdit(op="restore", ranges=[(1, len(log))], source="user"))
        assert len(fold(await session.events())) > 12  # every message is back in the context
        log = await wait_for(
            bus,
            "restored",
            lambda log: sum(isinstance(e, events.Condensation) for e in log) > condensed and len(fold(log)) <= 12,
        )
        await owner.drain(2)
    assert max(e.id or 0 for e in log if isinstance(e, events.Condensation)) > restore
    assert owner.stats.dead_letters == 0


async def test_a_new_owner_starts_from_the_saved_fold_and_reads_only_the_log_after_it(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    from structlog.testing import capture_logs  # noqa: PLC0415

    monkeypatch.setattr(condenser_role, "SAVE_EVERY", 40)
    monkeypatch.setattr(condenser_role, "SAVE_ON_CLOSE", 1)
    session = bus.session("saved")
    await session.append(events.SessionConfig(condenser={"strategy": "recent", "max_events": 12, "keep_first": 1}))
    first = CondenserHandler(llm=None, model=None)
    owner = Owner(bus.redis, bus.keys, first, worker="c1", url=bus.url)
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        for i in range(150):
            await session.append(events.Message(content=f"m{i}", source="user"))
        await wait_for(bus, "saved", lambda log: len(fold(log)) <= 12 and len(log) > 150)
        await owner.drain(2)  # lets the session go: its fold is saved
    saved = await bus.redis.hget(bus.keys.folds("saved"), "condenser")
    assert saved is not None

    # Events after the save, then a new owner: it folds only those, and its view is the full fold's.
    await session.append(*[events.Message(content=f"late {i}", source="user") for i in range(5)])
    second = CondenserHandler(llm=None, model=None)
    owner = Owner(bus.redis, bus.keys, second, worker="c2", url=bus.url)
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            await tg.start(owner.run)
            answer = await session.act(events.CondensationRequest(), timeout=10)
            assert isinstance(answer, events.Condensation)
            log = await session.events()
            state = second.states["saved"]
            assert state.builder.view() == fold(log, until=state.builder.last_id)
            assert state.config.max_events == 12  # the settings came with the saved fold
            await owner.drain(2)
    (opened,) = [e for e in logs if e["event"] == "condenser.opened"]
    assert opened["saved"] > 100
    assert opened["folded"] <= len(log) - opened["saved"]

    # A log made again under the same id is not the one folded: its saved fold is ignored.
    await bus.redis.hset(bus.keys.meta("saved"), "created", "0")
    third = CondenserHandler(llm=None, model=None)
    owner = Owner(bus.redis, bus.keys, third, worker="c3", url=bus.url)
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            await tg.start(owner.run)
            await session.act(events.CondensationRequest(), timeout=10)
            await owner.drain(2)
    (opened,) = [e for e in logs if e["event"] == "condenser.opened"]
    assert opened["saved"] == 0


async def test_a_condensation_that_shrinks_the_view_saves_the_fold_so_a_new_owner_reads_only_the_view(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    from structlog.testing import capture_logs  # noqa: PLC0415

    monkeypatch.setattr(condenser_role, "SAVE_EVERY", 1_000)
    monkeypatch.setattr(condenser_role, "SAVE_ON_CLOSE", 10**9)  # only the saves under test
    monkeypatch.setattr(condenser_role, "SAVE_SHRUNK", 500)
    session = bus.session("shrunk")
    await session.append(events.SessionConfig(condenser={"strategy": "recent", "max_events": 60, "keep_first": 1}))
    for start in range(0, 1_500, 250):
        await session.append(*[events.Message(content=f"m{i}", source="user") for i in range(start, start + 250)])

    # The first owner folds the long log, saving it on the way (1,000 events shown), then
    # condenses it: the view shrinks, and the fold is saved again once the condensation is folded.
    first = CondenserHandler(llm=None, model=None)
    owner = Owner(bus.redis, bus.keys, first, worker="c1", url=bus.url)
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            await tg.start(owner.run)
            log = await wait_for(bus, "shrunk", lambda log: any(isinstance(e, events.Condensation) for e in log))
            condensed = next(e.id for e in log if isinstance(e, events.Condensation))
            assert condensed is not None
            with anyio.fail_after(10):
                while not any(e["event"] == "fold.saved" and e["last"] >= condensed for e in logs):
                    await anyio.sleep(0.02)
            await owner.drain(2)
    saves = [e for e in logs if e["event"] == "fold.saved"]
    assert saves[0]["shown"] >= 1_000
    assert saves[-1]["last"] >= condensed
    assert saves[-1]["shown"] <= 60

    # A new owner reads the events the saved view shows, not the log.
    second = CondenserHandler(llm=None, model=None)
    owner = Owner(bus.redis, bus.keys, second, worker="c2", url=bus.url)
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            await tg.start(owner.run)
            await session.append(events.Message(content="after the takeover", source="user"))
            with anyio.fail_after(10):
                while "shrunk" not in second.states:
                    await anyio.sleep(0.02)
            log = await session.events()
            state = second.states["shrunk"]
            assert state.builder.view() == fold(log, until=state.builder.last_id)
            await owner.drain(2)
    (opened,) = [e for e in logs if e["event"] == "condenser.opened"]
    assert opened["saved"] >= condensed
    assert opened["filled"] + opened["folded"] <= 60 + 2


async def test_an_idle_session_is_let_go_with_its_view_and_folded_again_when_it_wakes(bus: Bus) -> None:
    handler = CondenserHandler(llm=None, model=None)
    owner = Owner(bus.redis, bus.keys, handler, worker="c1", url=bus.url, park_after=0.3)
    session = bus.session("idle")
    await session.append(events.SessionConfig(condenser={"strategy": "recent", "max_events": 12, "keep_first": 1}))
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        await session.append(*[events.Message(content=f"m{i}", source="user") for i in range(30)])
        await wait_for(bus, "idle", lambda log: any(isinstance(e, events.Condensation) for e in log))
        with anyio.fail_after(5):
            while "idle" in owner.owned or "idle" in handler.states:
                await anyio.sleep(0.05)  # parked: nothing of the session is kept
        answer = await session.act(events.CondensationRequest(), timeout=10)
        assert isinstance(answer, events.Condensation)
        state = handler.states["idle"]  # taken again, folded from the log
        log = await session.events()
        assert state.builder.view() == fold(log, until=state.builder.last_id)
        await owner.drain(2)

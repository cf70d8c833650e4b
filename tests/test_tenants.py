"""Tenants pinned to sessions: the first append fixes a session's tenant (none is one too);
an append naming another is refused with TenantMismatch and appends nothing; answers keep the
session's tenant; a tenant-scoped recall from a session without a tenant sees only it."""

from __future__ import annotations

from pathlib import Path

import pytest

import riverbed
from riverbed import events
from riverbed.client.session import Bus
from riverbed.errors import InputError, TenantMismatch
from riverbed.memory.embedders import LocalEmbedder
from riverbed.memory.recall import Memory
from riverbed.memory.store import Store
from tests.kit.agents import runtime_worker
from tests.kit.memory import numbered

pytestmark = [pytest.mark.anyio]


def test_tenant_mismatch_is_an_exported_input_error() -> None:
    assert issubclass(TenantMismatch, InputError)
    assert riverbed.TenantMismatch is TenantMismatch
    assert "TenantMismatch" in riverbed.__all__


async def test_the_first_append_pins_the_tenant(bus: Bus) -> None:
    acme = bus.session("pinned", tenant="acme")
    (first,) = await acme.append(events.Message(content="hi", source="user"))
    assert (await bus.log_store.meta("pinned"))["tenant"] == "acme"
    for other in (bus.session("pinned", tenant="globex"), bus.session("pinned")):
        with pytest.raises(TenantMismatch) as refused:
            await other.append(events.Message(content="let me in", source="user"))
        assert refused.value.tenant == other.tenant
        assert "acme" not in str(refused.value), "the refusal names the session's tenant to a stranger"
        with pytest.raises(TenantMismatch):  # an action: refused before anything runs
            await other.act(events.CmdRun(command="cat secret"), timeout=1)
        with pytest.raises(TenantMismatch):  # a retried key does not slip through either
            await other.append(events.Think(thought="x"), idempotency_key="k1")
        with pytest.raises(TenantMismatch):  # nor an append that expects the right last id
            await other.append(events.Think(thought="x"), expected_last=first)
    assert await acme.last_id() == first
    assert await acme.append(events.Think(thought="mine"), idempotency_key="k1") == [first + 1]


async def test_a_session_without_a_tenant_stays_without(bus: Bus) -> None:
    await bus.session("open").append(events.Message(content="hi", source="user"))
    with pytest.raises(TenantMismatch) as refused:
        await bus.session("open", tenant="acme").append(events.Message(content="mine now", source="user"))
    assert "without a tenant" not in str(refused.value)
    assert await bus.session("open").last_id() == 1


async def test_an_event_may_not_name_another_tenant_than_its_handle(bus: Bus) -> None:
    with pytest.raises(InputError):
        await bus.session("e", tenant="acme").append(events.Think(thought="x", tenant="globex"))
    assert await bus.session("e").last_id() == 0
    # A handle without a tenant appends as the tenant its events name.
    await bus.session("e").append(events.Think(thought="x", tenant="acme"))
    assert (await bus.log_store.meta("e"))["tenant"] == "acme"
    with pytest.raises(InputError):
        await bus.session("f").append(events.Think(thought="x", tenant="acme"), events.Think(thought="y", tenant="b"))


async def test_answers_keep_the_sessions_tenant_and_a_stranger_gets_none(bus: Bus, workspace: Path) -> None:
    async with runtime_worker(bus, workspace):
        acme = bus.session("served", tenant="acme")
        obs = await acme.act(events.CmdRun(command="echo secret > s.txt; echo ok"), timeout=30)
        assert isinstance(obs, events.CmdOutput)
        assert obs.tenant == "acme"
        with pytest.raises(TenantMismatch):
            await bus.session("served", tenant="globex").act(events.FileRead(path="s.txt"), timeout=5)
        log = await acme.events()
    assert [e.kind for e in log] == ["cmd_run", "cmd_output"]
    assert {e.tenant for e in log} == {"acme"}


async def test_tenant_recall_from_a_session_without_a_tenant_sees_only_that_session(
    database_url: str, prefix: str
) -> None:
    async with Store(database_url, schema=prefix) as store:
        memory = Memory(store, LocalEmbedder())
        for session in ("loner", "stranger"):
            text = f"the deploy password of {session} is hunter2"
            await memory.index(session, numbered([events.Message(content=text, source="user")]), tenant=None)
        for session in ("acme-1", "acme-2"):
            text = f"the deploy password of {session} is swordfish"
            await memory.index(session, numbered([events.Message(content=text, source="user")]), tenant="acme")
        query = events.Recall(query="deploy password", scope="tenant", k=10)
        alone = await memory.recall(query, session="loner", tenant=None, workspace=None)
        assert {h.session for h in alone.hits} == {"loner"}
        shared = await memory.recall(query, session="acme-1", tenant="acme", workspace=None)
        assert {h.session for h in shared.hits} == {"acme-1", "acme-2"}  # a tenant's sessions share

"""In-process role workers for agent tests: a real Owner per role on the test's prefix."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from riverbed import events
from riverbed.agent.llm import AgentOptions
from riverbed.bus.consumer import Handler, Owner
from riverbed.client.session import Bus, Session
from riverbed.errors import AlreadyAnswered
from riverbed.memory.embedders import LocalEmbedder
from riverbed.memory.recall import Memory
from riverbed.memory.store import Store
from riverbed.runtime import Runtime
from riverbed.settings import Settings
from riverbed.workers.agent_run import run_llm_agent
from riverbed.workers.memory_role import MemoryHandler
from riverbed.workers.runtime_role import RuntimeHandler
from tests.kit.openai_server import OpenAIServer
from tests.kit.patience import within


@contextlib.asynccontextmanager
async def owners(bus: Bus, handlers: list[Handler], *, name: str = "w1") -> AsyncIterator[list[Owner]]:
    """Run an Owner for each handler until the block ends, then drain them."""
    started = [Owner(bus.redis, bus.keys, h, worker=f"{name}-{h.role}", url=bus.url, lease_seconds=5) for h in handlers]
    async with anyio.create_task_group() as tg:
        for owner in started:
            await tg.start(owner.run)
        try:
            yield started
        finally:
            with anyio.CancelScope(shield=True):
                for owner in started:
                    await owner.drain(2)


@contextlib.asynccontextmanager
async def runtime_worker(bus: Bus, workspace: Path, *, name: str = "w1") -> AsyncIterator[Runtime]:
    """A runtime role owner executing in ``workspace`` (one directory per session below it)."""
    runtime = Runtime(workspace_root=workspace)
    try:
        async with owners(bus, [RuntimeHandler(runtime)], name=name):
            yield runtime
    finally:
        with anyio.CancelScope(shield=True):
            await runtime.aclose()


async def record(session: Session, *batch: events.Event) -> list[int]:
    """Append ``batch`` as riverbed itself writes it (a role's observations, a condenser's
    condensation), stamped like the handle's own appends: through the log, since a handle
    acting for a tenant takes only what clients may append (``events.check_client``)."""
    result = await session.bus.log_store.append(session.id, [session.stamp(e) for e in batch], tenant=session.tenant)
    if isinstance(result, AlreadyAnswered):
        raise result
    return result


@contextlib.asynccontextmanager
async def roles(
    bus: Bus, workspace: Path, database_url: str, prefix: str, local: LocalEmbedder, *more: Handler
) -> AsyncIterator[None]:
    """Runtime and memory role owners, both on the test's workspace root, and one for each of ``more``."""
    runtime = Runtime(workspace_root=workspace)
    store = Store(database_url, schema=prefix)
    memory = MemoryHandler(Memory.cached(store, local), workspace_root=workspace)
    try:
        async with owners(bus, [RuntimeHandler(runtime), memory, *more]):
            yield
    finally:
        await runtime.aclose()
        await store.close()


@pytest.fixture
async def workers(
    bus: Bus, workspace: Path, database_url: str, prefix: str, local: LocalEmbedder
) -> AsyncIterator[None]:
    """Runtime and memory role owners on this test's workspace, database schema and prefix."""
    async with roles(bus, workspace, database_url, prefix, local):
        yield


async def run_scripted_agent(
    bus: Bus, server: OpenAIServer, session: str, task: str, commands: list[str], **settings: Any
) -> events.Event | None:
    """The LLM agent on ``session`` against ``server`` scripted to run ``commands``, one a step,
    and then finish; returns the event that ended the run."""
    for command in commands:
        server.reply(tool_calls=[("cmd_run", {"command": command})])
    server.reply(tool_calls=[("finish", {"final_thought": "done"})])
    return await run_llm_agent(
        bus,
        session,
        task,
        settings=Settings(llm_model="test-model", **settings),
        client=server.client(),
        max_steps=len(commands) + 2,
        options=AgentOptions(action_timeout=30, recall_timeout=within(15), condense_timeout=30),
    )

"""The agent role in-process for tests: the scripted model server, runtime and agent owners, scrapes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio

from riverbed import events
from riverbed.agent.hosted import follow_run
from riverbed.agent.usage import parse_prices
from riverbed.client.session import Bus
from riverbed.runtime import Runtime
from riverbed.settings import Settings
from riverbed.workers.agent_pace import Pace
from riverbed.workers.agent_role import AgentHandler
from riverbed.workers.main import Worker
from riverbed.workers.metrics import WorkerMetrics
from riverbed.workers.model_client import CheckedClient
from riverbed.workers.runtime_role import RuntimeHandler
from tests.kit.agents import owners
from tests.kit.metrics import samples
from tests.kit.openai_server import OpenAIServer, server  # noqa: F401  (server: a fixture)
from tests.kit.patience import within


@contextlib.asynccontextmanager
async def roles(
    bus: Bus,
    workspace: Path,
    server: OpenAIServer,
    *,
    retry_seconds: float = 5.0,
    prices: str | None = None,
    checked: bool = False,
    pace: Pace | None = None,
    **options: Any,
) -> AsyncIterator[AgentHandler]:
    """The runtime and agent roles in this process; ``checked``: the agent role asks the model as a
    worker does (``CheckedClient``), else through a plain client of the client library; ``pace``:
    how many runs it takes on at once (None: as many as come); ``options``: more of
    :class:`AgentHandler`'s keywords."""
    runtime = Runtime(workspace_root=workspace)
    cap = {"max_response_bytes": options.pop("max_response_bytes")} if "max_response_bytes" in options else {}
    client = CheckedClient(api_key="test-key", base_url=server.base_url, **cap) if checked else server.client()
    agent = AgentHandler(
        client=client,
        model="test-model",
        retry_seconds=retry_seconds,
        prices=parse_prices(prices),
        pace=pace,
        **options,
    )
    try:
        async with owners(bus, [RuntimeHandler(runtime), agent]):
            yield agent
    finally:
        with anyio.CancelScope(shield=True):
            await runtime.aclose()
            await agent.aclose()


def scrape(bus: Bus, agent: AgentHandler) -> list[tuple[str, dict[str, str]]]:
    """The agent role's series in a worker's Prometheus scrape."""
    worker = Worker(bus.redis, Settings(prefix=bus.keys.prefix), ["agent"], name="w-agent", handlers={"agent": agent})
    metrics = WorkerMetrics()
    metrics.bind(worker)
    return samples(metrics.render().decode())


async def ended(bus: Bus, session: str, start: int, timeout: float = 30.0) -> list[events.Event]:
    """The events from ``start`` until the run ends (the ending event last)."""
    with anyio.fail_after(within(timeout)):
        return [event async for event in follow_run(bus, session, start)]

"""Acceptance: a session driven past its token budget.

The LLM agent works a task whose commands print far more than the session's token budget.
Every prompt the model received stays within the budget, the log still holds every event,
`riverbed view --until N` equals the view the agent had at each model call, and a semantic
recall in plain words finds an event the condenser dropped.
"""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from riverbed import events
from riverbed.agent.llm import build_messages
from riverbed.bus.consumer import Entry, SessionContext
from riverbed.client.session import Bus
from riverbed.memory.condensers import CondenserConfig
from riverbed.memory.tokens import TokenCounter
from riverbed.memory.view import view as fold
from riverbed.workers.condenser_role import CondenserHandler
from tests.kit.agents import roles, run_scripted_agent
from tests.kit.embedder import shared_local
from tests.kit.openai_server import OpenAIServer, server  # noqa: F401  (server: a fixture)

pytestmark = pytest.mark.anyio

BUDGET = 1500
CONDENSER = {"strategy": "amortized", "budget_tokens": BUDGET, "headroom_tokens": 100, "max_events": None}


class LaggingCondenser(CondenserHandler):
    """A condenser that is always a little behind, as one on a busy worker can be."""

    async def handle(self, ctx: SessionContext, entries: list[Entry]) -> None:
        await anyio.sleep(0.5)
        await super().handle(ctx, entries)


def command(i: int) -> str:
    if i == 0:
        return "echo 'the deploy key lives in secrets/deploy.pem, rotated every 90 days'"
    return f"seq 1 120 | sed 's/^/build step {i} line /'"


async def test_the_budget_holds_in_every_prompt_and_nothing_is_lost(
    bus: Bus, server: OpenAIServer, workspace: Path, database_url: str, prefix: str
) -> None:
    steps = 12
    session = bus.session("budget")
    await session.append(events.SessionConfig(condenser=CONDENSER, source="user"))

    async with roles(bus, workspace, database_url, prefix, shared_local(), LaggingCondenser(llm=None, model=None)):
        ended = await run_scripted_agent(
            bus, server, "budget", "Run the build steps one by one.", [command(i) for i in range(steps)]
        )
        assert isinstance(ended, events.Finish)
        log = await session.events()

        # The condenser dropped the first command's output; recall brings it back.
        dropped = {
            i for e in log if isinstance(e, events.Condensation) for a, b in e.forgotten for i in range(a, b + 1)
        }
        first_output = next(e for e in log if isinstance(e, events.CmdOutput) and "deploy key" in e.content)
        assert first_output.id in dropped
        hit = await session.act(events.Recall(query="where is the deploy key kept?", k=3), timeout=30)
        assert isinstance(hit, events.RecallResult)
        assert first_output.id in [h.event_id for h in hit.hits]

    # Nothing is ever deleted: every command and every output is still in the log.
    assert sum(isinstance(e, events.CmdRun) for e in log) == steps
    assert sum(isinstance(e, events.CmdOutput) for e in log) == steps
    assert any(isinstance(e, events.Condensation) for e in log)

    # Every prompt the model got was within the budget, and is exactly the view at its point.
    limit = CondenserConfig.from_dict(CONDENSER).token_limit
    assert limit is not None
    counter = TokenCounter()
    responses = [e for e in log if isinstance(e, events.LlmResponse)]
    assert len(responses) == len(server.requests) == steps + 1
    for response, request in zip(responses, server.requests, strict=True):
        assert response.cause is not None
        prefix_events = [e for e in log if (e.id or 0) <= response.cause]
        context = fold(prefix_events, until=response.cause)
        assert counter.events(list(context)) <= limit
        rebuilt = json.loads(json.dumps(build_messages(prefix_events)))
        assert rebuilt == request["messages"]

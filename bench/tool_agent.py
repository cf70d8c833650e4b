"""The agent ``bench.agents --tools`` runs: one Python tool, so every step is a user tool call
(a ``tool_call`` the agent worker claims, runs and answers with a ``tool_result``)."""

from __future__ import annotations

import riverbed


@riverbed.tool
def note(text: str) -> str:
    """Keep a short note."""
    return f"noted {len(text)} characters"


bench_agent = riverbed.Agent("bench", "You use one tool per step.", tools=[note])

"""A researcher and a writer: the writer hands questions to researchers (sub-agents, each in a
session and sandbox of its own, running in parallel) and writes the report from their answers.

    riverbed worker all --agents examples.research_team.agents      # from the repository's root
    riverbed agent report-1 "Write report.md about the Python files here" --agent writer

``word_count`` is a Python tool: it runs in the agent worker, and its calls and results are on the
log like every other action.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

import riverbed


@riverbed.tool
def word_count(text: Annotated[str, msgspec.Meta(max_length=200_000)]) -> dict[str, int]:
    """Count the words and lines of a text (check a draft's length before finishing)."""
    return {"words": len(text.split()), "lines": text.count("\n") + 1}


researcher = riverbed.Agent(
    "researcher",
    "You answer one research question about the files in your workspace. Look with cmd_run and "
    "file_read, then finish with a short, factual answer that names the files you read.",
    tools=["cmd_run", "file_read", "think"],
    limits=riverbed.RunLimits(max_steps=8),
)

writer = riverbed.Agent(
    "writer",
    "You write short reports. Split the work into self-contained questions and delegate each to a "
    "researcher (several delegate calls in one answer run in parallel). Then write the report with "
    "file_write, check its length with word_count, and finish.",
    tools=["file_write", "think", word_count],
    sub_agents=["researcher"],
    limits=riverbed.RunLimits(max_steps=12),
)

"""Users' agents for the tests: tools that keep a journal (a file named by RIVERBED_TEST_JOURNAL),
fail, raise, overrun, or take bounded arguments.  Worker processes host this module with
``--agents tests.kit.user_agents``."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated

from msgspec import Meta

import riverbed


def _journal() -> Path:
    return Path(os.environ.get("RIVERBED_TEST_JOURNAL", "/nonexistent/journal"))


@riverbed.tool
def note(entry: str, ctx: riverbed.ToolContext) -> str:
    """Write one entry in the journal."""
    with _journal().open("a") as journal:
        journal.write(f"{ctx.idempotency_key} {entry}\n")
    return f"noted {entry}"


@riverbed.tool(idempotent=True)
def note_again(entry: str, ctx: riverbed.ToolContext) -> str:
    """Write one entry in the journal (safe to repeat under the same key)."""
    with _journal().open("a") as journal:
        journal.write(f"{ctx.idempotency_key} {entry}\n")
    return f"noted {entry}"


@riverbed.tool
async def add(a: Annotated[int, Meta(ge=0, le=100)], b: int = 1) -> dict[str, int]:
    """Add two numbers (a is 0 to 100)."""
    return {"sum": a + b}


@riverbed.tool
def refuse(reason: str) -> str:
    """Always refuses."""
    raise riverbed.ToolError(f"refused: {reason}")


@riverbed.tool
def crash() -> str:
    """Raises an unexpected exception."""
    raise ValueError("the disk is on fire")


@riverbed.tool(timeout=0.5)
def linger(seconds: float) -> str:
    """Sleeps."""
    time.sleep(seconds)
    return "awake"


scribe = riverbed.Agent(
    "scribe",
    "You keep a journal of what you are told.",
    tools=["think", note, note_again, add, refuse, crash, linger],
    stuck=riverbed.StuckLimits(repeats=3, errors=3, idle=3),
)


lead = riverbed.Agent(
    "lead",
    "You lead: hand the note-taking to the scribe.",
    tools=["think"],
    sub_agents=["scribe"],
)


handy = riverbed.Agent("handy", "You run commands and keep notes.", tools=["cmd_run", note])

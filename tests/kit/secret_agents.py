"""An agent that uses its tenant's secrets, for the masking tests: worker processes host this
module with ``RIVERBED_AGENTS=tests.kit.secret_agents``."""

from __future__ import annotations

import riverbed


@riverbed.tool
def peek(name: str, ctx: riverbed.ToolContext) -> str:
    """Say a secret's value (a careless tool: what it returns is masked before the log)."""
    return f"the value of {name} is {ctx.secret(name)}"


keeper = riverbed.Agent(
    "keeper",
    "You use the deploy token.",
    tools=["cmd_run", "python_run", peek],
    secrets=["GH_TOKEN"],
)

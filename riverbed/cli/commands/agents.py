"""`riverbed agents`: the agent definitions a deployment knows, and where each is hosted."""

from __future__ import annotations

from typing import Any

import msgspec
from rich.table import Table

from riverbed.cli.app import Invocation, JsonOption, PrefixOption, _progress, app
from riverbed.cli.output import _stdout_lines, json_bytes, out_console


@app.command("agents")
def agents_command(as_json: JsonOption = False, prefix: PrefixOption = None) -> None:
    """The agents this deployment knows (published by the workers that host them), newest
    first: name, digest, tools, MCP servers, where each is defined, and whether a live worker
    hosts it now.  `riverbed agent SESSION "task" --agent NAME` runs one."""
    from riverbed.agent.registry import known_agents  # noqa: PLC0415

    cli = Invocation(prefix)

    async def go() -> Any:
        bus = await cli.bus()
        return await known_agents(bus.client, bus.keys)

    rows = cli.run(go)
    if as_json:
        _stdout_lines(json_bytes({**msgspec.to_builtins(row), "live": row.live}) for row in rows)
        return
    if not rows:
        _progress("no agent worker has published its agents yet (`riverbed worker agent --agents MODULE` hosts them)")
        return
    table = Table("name", "digest", "tools", "mcp", "where", "hosted", box=None, header_style="bold")
    for row in rows:
        servers = ", ".join(str(s.get("name")) for s in row.mcp)
        hosted = f"live ({row.worker})" if row.live else "no live worker"
        table.add_row(row.name, row.digest, ", ".join(row.tools), servers, row.where, hosted)
    out_console().print(table)

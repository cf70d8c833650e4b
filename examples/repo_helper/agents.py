"""A repository helper: the official git MCP server (``mcp-server-git``, from PyPI) runs in the
session's sandbox on the workspace's repository, and a Python tool keeps the answers short.

    pip install mcp-server-git          # where riverbed is installed: the sandbox finds it there
    riverbed worker all --agents examples.repo_helper.agents      # from the repository's root
    riverbed agent repo-1 "Who made the last commit, and what did it change?" --agent repo-helper

The git server sees the session's workspace only (``--repository .`` is the workspace); its
tools are listed on the log the first time a run uses it (``mcp_tools``), so a replay, a fork
and the console show exactly what the model was offered.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

import riverbed


@riverbed.tool
def summarize_status(
    status: Annotated[str, msgspec.Meta(max_length=100_000)], ctx: riverbed.ToolContext
) -> dict[str, list[str]]:
    """Group the lines of `git status --porcelain` (or of git_status's answer) by what changed."""
    groups: dict[str, list[str]] = {"modified": [], "added": [], "deleted": [], "untracked": []}
    names = {"M": "modified", "A": "added", "D": "deleted", "?": "untracked"}
    for line in status.splitlines():
        code, _, path = line.strip().partition(" ")
        group = names.get(code[:1])
        if group is not None and path:
            groups[group].append(path.strip())
    ctx.log.info("status.summarized", files=sum(len(v) for v in groups.values()))
    return groups


repo_helper = riverbed.Agent(
    "repo-helper",
    "You answer questions about the git repository in your workspace. Use the git tools "
    "(git__git_status, git__git_log, git__git_show …) rather than guessing, and finish with a short answer.",
    tools=["file_read", "think", summarize_status],
    mcp=[riverbed.MCPServer(name="git", command=["mcp-server-git", "--repository", "."])],
    limits=riverbed.RunLimits(max_steps=10),
)

"""The examples in examples/ run as their docstrings say, against the scripted model server, with
the agent and runtime roles: each agent's tools, sub-agents and log are what a user would see."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from riverbed import events
from riverbed.agent.hosted import open_run
from riverbed.agent.registry import load
from riverbed.client.session import Bus
from riverbed.runtime.paths import workspace_name
from tests.kit.agent_role import ended, roles, server  # noqa: F401  (fixtures)
from tests.kit.openai_server import OpenAIServer, tool_call

pytestmark = pytest.mark.anyio


def _last(request: dict[str, Any]) -> dict[str, Any]:
    return request["messages"][-1]


async def test_the_research_team_writes_a_report_from_its_researchers_answers(
    bus: Bus, workspace: Path, server: OpenAIServer
) -> None:
    hosted = load(["examples.research_team.agents"], entry_point_group=None)
    writer = hosted.agents["writer"]

    def script(request: dict[str, Any]) -> dict[str, Any]:
        system = request["messages"][0]["content"]
        tools = [t["function"]["name"] for t in request["tools"]]
        last = _last(request)
        if system.startswith("You answer one research question"):
            assert tools == ["cmd_run", "file_read", "think", "finish"]
            if last["role"] == "tool":
                return {"tool_calls": [tool_call("finish", {"final_thought": f"found: {last['content'].strip()}"})]}
            return {"tool_calls": [tool_call("cmd_run", {"command": "echo the answer is 42"})]}
        assert tools == ["file_write", "think", "delegate", "word_count", "finish"]
        done = [m for m in request["messages"] if m["role"] == "tool"]
        if not done:
            asks = [{"task": f"question {n}", "agent": "researcher"} for n in (1, 2)]
            return {"tool_calls": [tool_call("delegate", a) for a in asks]}
        if len(done) == 2:
            report = "# Report\n\n" + "\n".join(m["content"].splitlines()[0] for m in done) + "\n"
            return {
                "tool_calls": [
                    tool_call("file_write", {"path": "report.md", "content": report}),
                    tool_call("word_count", {"text": report}),
                ]
            }
        return {"tool_calls": [tool_call("finish", {"final_thought": "report.md written"})]}

    server.respond(script, times=20)
    async with roles(bus, workspace, server, hosted=hosted):
        opened = await open_run(bus, "report-1", "Write report.md", agent=writer)
        seen = await ended(bus, "report-1", opened.task, timeout=60)
    assert seen[-1].kind == "finish", seen[-1]
    delegates = [e for e in seen if isinstance(e, events.Delegate)]
    assert [d.sub_agent for d in delegates] == ["researcher", "researcher"]
    results = [e for e in seen if isinstance(e, events.DelegateResult)]
    assert sorted(r.content.splitlines()[0] for r in results) == ["found: the answer is 42"] * 2
    (counted,) = [e for e in seen if isinstance(e, events.ToolResult)]
    assert json.loads(counted.content) == {"words": 12, "lines": 5}  # "# Report" and two lines of five
    report = (workspace / workspace_name("report-1") / "report.md").read_text()
    assert report.count("found: the answer is 42") == 2


@pytest.fixture
def repository(workspace: Path) -> Path:
    """The session repo-1's workspace: a git repository with one commit by Ada, a change and a new file."""
    root = workspace / workspace_name("repo-1")
    root.mkdir(parents=True)
    git = ["git", "-C", str(root), "-c", "user.name=Ada", "-c", "user.email=ada@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    (root / "a.txt").write_text("one\n")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "first file"], check=True)
    (root / "a.txt").write_text("two\n")
    (root / "b.txt").write_text("new\n")
    return root


async def test_the_repo_helper_asks_the_git_server_in_the_sandbox_and_its_python_tool(
    bus: Bus, workspace: Path, server: OpenAIServer, repository: Path
) -> None:
    hosted = load(["examples.repo_helper.agents"], entry_point_group=None)
    helper = hosted.agents["repo-helper"]

    def script(request: dict[str, Any]) -> dict[str, Any]:
        tools = [t["function"]["name"] for t in request["tools"]]
        assert {"git__git_status", "git__git_log", "summarize_status"} <= set(tools)
        done = [m for m in request["messages"] if m["role"] == "tool"]
        if not done:
            return {"tool_calls": [tool_call("git__git_log", {"repo_path": ".", "max_count": 1})]}
        if len(done) == 1:
            status = " M a.txt\n?? b.txt\n"
            return {"tool_calls": [tool_call("summarize_status", {"status": status})]}
        return {"tool_calls": [tool_call("finish", {"final_thought": "Ada made the last commit"})]}

    server.respond(script, times=10)
    async with roles(bus, workspace, server, hosted=hosted):
        opened = await open_run(bus, "repo-1", "Who made the last commit?", agent=helper)
        seen = await ended(bus, "repo-1", opened.task, timeout=90)
    assert seen[-1].kind == "finish", seen[-1]
    (listing,) = [e for e in seen if isinstance(e, events.McpTools)]
    assert "git_log" in [t.name for t in listing.tools]
    calls = [e for e in seen if isinstance(e, events.ToolCall)]
    assert [(c.tool, c.runs_in) for c in calls] == [("git.git_log", "runtime"), ("summarize_status", "agent")]
    results = [e for e in seen if isinstance(e, events.ToolResult)]
    assert not results[0].is_error, results[0]
    assert "Ada" in results[0].content
    assert "first file" in results[0].content
    assert json.loads(results[1].content) == {"modified": ["a.txt"], "added": [], "deleted": [], "untracked": ["b.txt"]}

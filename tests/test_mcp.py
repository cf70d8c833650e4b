"""MCP servers for hosted agents: stdio servers in the session's sandbox (the runtime role),
remote ones over streamable HTTP (the agent worker's client), the names the model sees.

Real processes throughout: a runtime worker process on the test Redis, real MCP servers nobody
here wrote (``mcp-server-git`` and ``mcp-server-time`` from PyPI, installed by the dev extra;
``@modelcontextprotocol/server-everything`` from npm, installed into ``.ci/npm`` by
``.ci/run``), and a tiny server of the tests' own that hangs, dies and pries
(``tests/mcp_servers/tiny_server.py``).  The actions are appended as the agent role appends
them: through the log itself, with the agent's source.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import pytest
from msgspec.structs import replace

import riverbed
from riverbed import events
from riverbed.agent.hosted import RunLimits, open_run
from riverbed.agent.mcp import (
    MCPServer,
    answer_remote,
    call_action,
    call_remote,
    list_action,
    list_remote,
    model_name,
    openai_tools,
    tool_of,
    url_refusal,
)
from riverbed.agent.quotas import Quotas
from riverbed.agent.registry import Hosted
from riverbed.agent.replay import fork, wait_rebuilt
from riverbed.agent.secrets import SecretStore, keygen
from riverbed.client.session import Bus
from riverbed.errors import InputError
from riverbed.runtime import Runtime
from riverbed.runtime.paths import workspace_name
from tests.kit.agent_role import ended, roles, server  # noqa: F401  (fixtures)
from tests.kit.cli import run
from tests.kit.openai_server import OpenAIServer
from tests.kit.workers import Spawn, WorkerProcess, spawn, workers  # noqa: F401  (fixtures)

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[1]
TINY_DIR = ROOT / "tests" / "mcp_servers"
TINY = [sys.executable, "-I", "-S", str(TINY_DIR / "tiny_server.py")]  # (the standard library only)
NPM_PREFIX = ROOT / ".ci" / "npm"
EVERYTHING = NPM_PREFIX / "node_modules" / ".bin" / "mcp-server-everything"

needs_everything = pytest.mark.skipif(
    not EVERYTHING.exists(),
    reason="@modelcontextprotocol/server-everything is not installed in .ci/npm "
    "(.ci/run installs it: npm install --prefix .ci/npm @modelcontextprotocol/server-everything)",
)


@pytest.fixture
def runtime_worker(spawn: Spawn) -> Callable[..., WorkerProcess]:
    """A runtime worker whose stdio MCP servers may come from the tiny server's directory and
    the npm prefix (``RIVERBED_MCP_MOUNTS``)."""

    def start(name: str = "mcp-w1") -> WorkerProcess:
        worker = spawn(name, ["runtime"], RIVERBED_MCP_MOUNTS=f"{TINY_DIR}:{NPM_PREFIX}")
        worker.wait_ready()
        return worker

    return start


async def ask(bus: Bus, session: str, action: events.Action, *, wait: float = 30.0) -> events.Event:
    """Append ``action`` as the agent role does (through the log, source agent) and wait for its answer."""
    ids = await bus.log_store.append(session, [action])
    assert isinstance(ids, list)
    return await bus.session(session).wait_for_answer(ids[0], timeout=wait)


async def listed(bus: Bus, session: str, server: MCPServer) -> events.McpTools:
    answer = await ask(bus, session, list_action(server))
    assert isinstance(answer, events.McpTools), answer
    return answer


async def call(
    bus: Bus, session: str, server: MCPServer, tool: str, arguments: dict | None = None, *, wait: float = 30.0
) -> events.ToolResult:
    answer = await ask(bus, session, call_action(server, tool, arguments or {}), wait=wait)
    assert isinstance(answer, events.ToolResult), answer
    return answer


# --- real servers in the sandbox ------------------------------------------------------------


async def test_real_stdio_servers_are_listed_and_called_in_the_sandbox_and_recorded(
    bus: Bus, runtime_worker: Callable[..., WorkerProcess]
) -> None:
    runtime_worker()
    git = MCPServer(name="git", command=["mcp-server-git", "--repository", "."])  # from the worker's venv
    clock = MCPServer(name="time", command=["mcp-server-time", "--local-timezone", "UTC"])
    init = await bus.session("git").act(
        events.CmdRun(command="git init -q -b main . && echo hello > a.txt && git add a.txt"), timeout=30
    )
    assert isinstance(init, events.CmdOutput), init
    assert init.exit_code == 0, init

    async def use_git() -> None:
        tools = await listed(bus, "git", git)
        assert {"git_status", "git_log", "git_diff_staged"} <= {t.name for t in tools.tools}
        status = await call(bus, "git", git, "git_status", {"repo_path": "."})
        assert not status.is_error, status
        assert "a.txt" in status.content, status.content
        assert "main" in status.content, status.content
        missing = await call(bus, "git", git, "git_log", {"repo_path": "/nowhere"})
        assert missing.is_error, missing  # the tool's own failure is the model's to read

    async def use_time() -> None:
        tools = await listed(bus, "time", clock)
        assert "get_current_time" in {t.name for t in tools.tools}
        now = await call(bus, "time", clock, "get_current_time", {"timezone": "Asia/Tokyo"})
        assert not now.is_error, now
        assert json.loads(now.content)["timezone"] == "Asia/Tokyo", now.content

    async with anyio.create_task_group() as tg:
        tg.start_soon(use_git)
        tg.start_soon(use_time)

    # On the log: each action and its one answer, the tools with their schemas as listed.
    log = await bus.session("git").events()
    kinds = [e.kind for e in log]
    assert kinds[-6:] == ["mcp_list", "mcp_tools", "tool_call", "tool_result", "tool_call", "tool_result"]
    recorded = next(e for e in log if isinstance(e, events.McpTools))
    status_schema = next(t for t in recorded.tools if t.name == "git_status").input_schema
    assert "repo_path" in status_schema["properties"]
    call_event = next(e for e in log if isinstance(e, events.ToolCall))
    assert call_event.tool == "git.git_status"
    assert call_event.runs_in == "runtime"
    assert next(e for e in log if isinstance(e, events.ToolResult)).cause == call_event.id


@needs_everything
async def test_the_npm_everything_server_runs_in_the_sandbox_with_only_the_names_it_was_given(
    bus: Bus, runtime_worker: Callable[..., WorkerProcess]
) -> None:
    runtime_worker()
    everything = MCPServer(name="everything", command=["mcp-server-everything"], env=["GREETING"])
    await bus.log_store.append(
        "every", [events.SessionConfig(env={"GREETING": "hello", "OTHER_SECRET": "s3cret"}, source="user")]
    )
    tools = await listed(bus, "every", everything)
    assert {"echo", "get-env", "get-tiny-image"} <= {t.name for t in tools.tools}
    echo = await call(bus, "every", everything, "echo", {"message": "riverbed"})
    assert echo.content == "Echo: riverbed"
    assert not echo.is_error
    env = json.loads((await call(bus, "every", everything, "get-env")).content)
    assert env["GREETING"] == "hello"  # named in the server's env
    assert "OTHER_SECRET" not in env  # the session's other variables are not the server's
    assert not [name for name in env if name.startswith("RIVERBED_")]  # nor the worker's
    assert env["HOME"].endswith(workspace_name("every"))
    image = await call(bus, "every", everything, "get-tiny-image")
    assert "[image: image/png" in image.content  # a block that is not text is described


@needs_everything
async def test_a_runs_secret_reaches_the_server_that_names_it_and_comes_back_masked(bus: Bus, spawn: Spawn) -> None:
    key = keygen()
    worker = spawn("mcp-secrets", ["runtime"], RIVERBED_MCP_MOUNTS=f"{TINY_DIR}:{NPM_PREFIX}", RIVERBED_SECRETS_KEY=key)
    value = "ghp_" + uuid.uuid4().hex
    await SecretStore(bus.client, bus.keys, key).set("acme", "GH_TOKEN", value)
    await open_run(bus, "msec", "deploy", tenant="acme", secrets=["GH_TOKEN"])  # (no agent role: the names only)
    worker.wait_ready()
    everything = MCPServer(name="everything", command=["mcp-server-everything"], env=["GH_TOKEN"])
    ids = await bus.log_store.append("msec", [list_action(everything)], tenant="acme")
    assert isinstance(ids, list)
    assert isinstance(await bus.session("msec").wait_for_answer(ids[0], timeout=30), events.McpTools)
    ids = await bus.log_store.append("msec", [call_action(everything, "get-env", {})], tenant="acme")
    assert isinstance(ids, list)
    answer = await bus.session("msec").wait_for_answer(ids[0], timeout=30)
    assert isinstance(answer, events.ToolResult), answer
    assert json.loads(answer.content)["GH_TOKEN"] == "[secret GH_TOKEN]"  # the server had it; the log has not
    assert value not in json.dumps([events.to_builtins(e) for e in await bus.session("msec").events()])


# --- a hosted agent's run, end to end ---------------------------------------------------------

clock_agent = riverbed.Agent(
    "clock",
    "You tell the time.",
    mcp=[riverbed.MCPServer(name="time", command=["mcp-server-time", "--local-timezone", "UTC"])],
)


async def test_a_hosted_agents_run_lists_its_server_and_calls_a_tool_in_the_sandbox(
    bus: Bus, workspace: Path, server: OpenAIServer
) -> None:
    server.reply(tool_calls=[("time__get_current_time", {"timezone": "Europe/Paris"})])
    server.reply(tool_calls=[("finish", {"final_thought": "told"})])
    hosted = Hosted(agents={"clock": clock_agent}, where={"clock": __name__})
    async with roles(bus, workspace, server, hosted=hosted):
        opened = await open_run(bus, "clock", "what time is it?", agent=clock_agent, limits=RunLimits(max_steps=4))
        seen = await ended(bus, "clock", opened.task)
    kinds = [e.kind for e in seen]
    assert kinds[kinds.index("mcp_list") :] == [
        "mcp_list",
        "mcp_tools",
        "llm_response",
        "tool_call",
        "tool_result",
        "llm_response",
        "finish",
    ], kinds
    offered = [t["function"]["name"] for t in server.requests[0]["tools"]]
    assert "time__get_current_time" in offered
    call_event = next(e for e in seen if isinstance(e, events.ToolCall))
    assert (call_event.tool, call_event.server, call_event.runs_in) == ("time.get_current_time", "time", "runtime")
    result = next(e for e in seen if isinstance(e, events.ToolResult))
    assert result.cause == call_event.id
    assert not result.is_error, result
    assert json.loads(result.content)["timezone"] == "Europe/Paris"
    tool_messages = [m for m in server.requests[1]["messages"] if m["role"] == "tool"]
    assert [m["content"] for m in tool_messages] == [result.content]  # what the model read next


# --- lifecycle --------------------------------------------------------------------------------


async def test_a_hanging_or_dead_server_answers_an_error_in_time_and_starts_again(
    bus: Bus, runtime_worker: Callable[..., WorkerProcess]
) -> None:
    runtime_worker()
    tiny = MCPServer(name="tiny", command=TINY, timeout=6)
    await listed(bus, "life", tiny)
    first = json.loads((await call(bus, "life", tiny, "where")).content)["token"]

    started = time.monotonic()
    hung = await call(bus, "life", tiny, "hang", wait=15)
    assert hung.is_error, hung
    assert "did not answer hang within 6 seconds" in hung.content, hung
    assert time.monotonic() - started < 14
    second = json.loads((await call(bus, "life", tiny, "where")).content)["token"]
    assert second != first  # the hung one was stopped; this call started another

    died = await call(bus, "life", tiny, "die")
    assert died.is_error, died
    assert "exited with code 3" in died.content, died  # and what it said on stderr:
    assert "tiny server starting" in died.content, died
    third = await call(bus, "life", tiny, "where")
    assert not third.is_error
    assert json.loads(third.content)["token"] not in (first, second)

    # A server that never finishes its handshake: the mcp_list gets an error in time.
    stuck = MCPServer(name="stuck", command=[*TINY, "--hang-at-start"], timeout=4)
    started = time.monotonic()
    answer = await ask(bus, "life", list_action(stuck), wait=15)
    assert isinstance(answer, events.Error), answer
    assert answer.reason == "mcp_failed", answer
    assert answer.retryable
    assert "did not complete its handshake within 4 seconds" in answer.content
    assert time.monotonic() - started < 12
    missing = await ask(bus, "life", list_action(MCPServer(name="nope", command=["no-such-mcp-server"])))
    assert isinstance(missing, events.Error)
    assert "'no-such-mcp-server' is not installed" in missing.content


async def test_a_new_owner_and_a_fork_start_the_server_again_from_the_logged_spec(
    bus: Bus, runtime_worker: Callable[..., WorkerProcess]
) -> None:
    first_worker = runtime_worker("mcp-w1")
    tiny = MCPServer(name="tiny", command=TINY)
    await listed(bus, "src", tiny)
    before = json.loads((await call(bus, "src", tiny, "where")).content)
    assert before["cwd"].endswith(workspace_name("src"))

    # The fork: its own sandbox, where the server is started again from the copied mcp_list.
    at = await bus.session("src").last_id()
    forked = await fork(bus, "src", at, "dst", workspace="copy")
    await wait_rebuilt(bus, "dst", forked, timeout=30)
    in_fork = json.loads((await call(bus, "dst", tiny, "where")).content)
    assert in_fork["cwd"].endswith(workspace_name("dst"))
    assert in_fork["token"] != before["token"]

    # A takeover: the new owner has never seen the mcp_list, and finds it on the log.
    first_worker.kill()
    runtime_worker("mcp-w2")
    after = await call(bus, "src", tiny, "where", wait=45)
    assert not after.is_error
    assert json.loads(after.content)["token"] != before["token"]


def _processes_with(marker: str) -> list[int]:
    """Host pids whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    if marker.encode() in fh.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


@pytest.fixture
async def rt(workspace: Path) -> AsyncIterator[Runtime]:
    """A runtime on its own (no worker) whose MCP servers may come from the tiny server's directory."""
    runtime = Runtime(workspace_root=workspace, mcp_mounts=[str(TINY_DIR)])
    yield runtime
    await runtime.aclose()


async def test_a_server_lives_as_long_as_the_sessions_sandbox(rt: Runtime) -> None:
    marker = f"--marker={uuid.uuid4().hex}"
    spec = list_action(MCPServer(name="tiny", command=[*TINY, marker]))
    listed = await rt.execute("life", replace(spec, id=1))
    assert isinstance(listed, events.McpTools), listed
    running = _processes_with(marker)  # the server, and bubblewrap's processes around it
    assert running
    where = await rt.execute("life", replace(call_action(MCPServer(name="tiny", command=TINY), "where", {}), id=2))
    assert isinstance(where, events.ToolResult)
    assert not where.is_error
    assert _processes_with(marker) == running  # the same server answered the call
    await rt.close_session("life")
    assert not _processes_with(marker)  # gone with the sandbox


# --- the sandbox's walls ------------------------------------------------------------------------


async def test_a_stdio_server_sees_its_workspace_and_nothing_else(
    bus: Bus, runtime_worker: Callable[..., WorkerProcess], workspace: Path, tmp_path: Path, redis_url: str
) -> None:
    runtime_worker()
    tiny = MCPServer(name="tiny", command=TINY)
    other = await bus.session("other").act(events.FileWrite(path="secret.txt", content="other's secret"), timeout=30)
    assert isinstance(other, events.FileWritten), other
    mine = await bus.session("mine").act(events.FileWrite(path="notes.txt", content="my notes"), timeout=30)
    assert isinstance(mine, events.FileWritten), mine
    beside = tmp_path / "worker-secret.txt"  # a file of the worker's, outside every workspace
    beside.write_text("the worker's secret")

    big = await bus.session("mine").act(events.FileWrite(path="big.txt", content="x" * 100_000), timeout=30)
    assert isinstance(big, events.FileWritten), big
    await listed(bus, "mine", tiny)

    capped = await call(bus, "mine", tiny, "read", {"path": "big.txt"})  # cut as a command's output is
    assert "[... 70000 characters truncated ...]" in capped.content
    assert len(capped.content) < 30_100
    own = await call(bus, "mine", tiny, "read", {"path": "notes.txt"})
    assert own.content == "my notes"
    assert not own.is_error
    for path in (
        str(workspace / workspace_name("other") / "secret.txt"),
        str(beside),
        "/etc/shadow",
        str(ROOT / "pyproject.toml"),
    ):
        pried = await call(bus, "mine", tiny, "read", {"path": path})
        assert pried.is_error, (path, pried)
        assert "FileNotFoundError" in pried.content, (path, pried)
        assert "'s secret" not in pried.content
        assert "[project]" not in pried.content
    env = json.loads((await call(bus, "mine", tiny, "env")).content)
    assert not [name for name in env if name.startswith(("RIVERBED_", "OPENAI_"))], env
    redis = urlsplit(redis_url)  # the worker's Redis, on this host's loopback: not the sandbox's
    assert redis.hostname in ("127.0.0.1", "localhost")
    reached = await call(bus, "mine", tiny, "connect", {"host": "127.0.0.1", "port": redis.port})
    assert reached.is_error, reached
    assert "ConnectionRefusedError" in reached.content, reached


# --- the agent's side: definitions, names, remote servers ------------------------------------


def test_a_server_definition_is_checked_in_one_sentence() -> None:
    assert MCPServer(name="git", command=["mcp-server-git"]).runs_in == "runtime"
    assert MCPServer(name="docs", url="http://localhost:1/mcp").runs_in == "agent"
    for bad, said in (
        ({"name": "git", "command": ["x"], "url": "http://h/mcp"}, "exactly one of"),
        ({"name": "git"}, "exactly one of"),
        ({"name": "g.it", "command": ["x"]}, "letters, digits"),
        ({"name": "a__b", "command": ["x"]}, "double underscore"),
        ({"name": "git", "command": "mcp-server-git"}, "list of strings"),
        ({"name": "git", "command": []}, "list of strings"),
        ({"name": "docs", "url": "ftp://h/x"}, "http:// or https://"),
        ({"name": "git", "command": ["x"], "timeout": 0}, "timeout"),
        ({"name": "git", "command": ["x"], "env": "TOKEN"}, "variable names"),
    ):
        with pytest.raises(InputError, match=said) as raised:
            MCPServer(**bad)
        assert "\n" not in str(raised.value)
    listed_action = list_action(MCPServer(name="git", command=["mcp-server-git"], env=["T"], timeout=5))
    assert (listed_action.command, listed_action.env, listed_action.timeout, listed_action.runs_in) == (
        ["mcp-server-git"],
        ["T"],
        5.0,
        "runtime",
    )
    assert list_action(MCPServer(name="docs", url="http://h/mcp")).runs_in == "agent"


def test_model_names_fit_openai_and_read_back() -> None:
    tools = events.McpTools(
        server="git",
        tools=[
            events.McpTool(name="git_status", input_schema={"type": "object", "properties": {"repo_path": {}}}),
            events.McpTool(name="weird.name/with spaces", description="odd"),
            events.McpTool(name="x" * 80),
        ],
    )
    entries = openai_tools(tools)
    names = [entry["function"]["name"] for entry in entries]
    assert names[0] == "git__git_status"
    for name in names:
        assert len(name) <= 64, name
        assert all(c.isalnum() or c in "_-" for c in name), name
    assert len(set(names)) == 3
    assert entries[1]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert entries[0]["function"]["parameters"]["properties"] == {"repo_path": {}}
    assert [tool_of(name, [tools]) for name in names] == [("git", t.name) for t in tools.tools]
    assert tool_of("git__nope", [tools]) is None
    assert model_name("git", "weird.name/with spaces") == names[1]  # the same pair, the same name


@pytest.fixture
def everything_http() -> Iterator[str]:
    """server-everything over streamable HTTP on a free port: its URL."""
    if not EVERYTHING.exists():
        pytest.skip("@modelcontextprotocol/server-everything is not installed in .ci/npm (.ci/run installs it)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [str(EVERYTHING), "streamableHttp"],
        env={**os.environ, "PORT": str(port)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.kill()
        proc.wait(10)


async def test_a_remote_server_is_listed_and_called_and_its_failures_are_answers(everything_http: str) -> None:
    docs = MCPServer(name="docs", url=everything_http, timeout=20)
    tools = await list_remote(docs)
    assert isinstance(tools, events.McpTools), tools
    assert "echo" in {t.name for t in tools.tools}
    echo = await call_remote(docs, "echo", {"message": "far"})
    assert echo.content == "Echo: far"
    assert not echo.is_error
    unknown = await call_remote(docs, "no-such-tool", {})
    assert unknown.is_error
    started = time.monotonic()
    slow = await call_remote(docs, "trigger-long-running-operation", {"duration": 30, "steps": 3}, timeout=1)
    assert slow.is_error
    assert "within 1 seconds" in slow.content
    assert time.monotonic() - started < 5

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    gone = MCPServer(name="gone", url=f"http://127.0.0.1:{closed}/mcp", timeout=5)
    refused = await list_remote(gone)
    assert isinstance(refused, events.Error)
    assert refused.reason == "mcp_failed"
    assert refused.retryable
    failed = await call_remote(gone, "echo", {"message": "x"})
    assert failed.is_error
    assert "gone" in failed.content


async def test_the_agent_worker_answers_a_remote_servers_actions_for_allowed_tenants_only(
    bus: Bus, everything_http: str
) -> None:
    quotas = Quotas(bus.log_store)
    docs = MCPServer(name="docs", url=everything_http, timeout=20)
    listing = replace(list_action(docs), id=7)
    echo = replace(call_action(docs, "echo", {"message": "allowed"}), id=9)

    refused = await answer_remote(listing, docs, quotas, "acme")
    assert isinstance(refused, events.Error), refused
    assert refused.reason == "mcp_refused"
    assert refused.cause == 7
    assert "riverbed tenants set acme --mcp-urls" in refused.content
    not_called = await answer_remote(echo, docs, quotas, "acme")
    assert isinstance(not_called, events.ToolResult)
    assert not_called.is_error
    assert "--mcp-urls" in not_called.content

    await quotas.set("acme", max_runs=None, tokens_per_day=None, mcp_urls=[everything_http])
    tools = await answer_remote(listing, docs, quotas, "acme")
    assert isinstance(tools, events.McpTools), tools
    assert tools.cause == 7
    assert "echo" in {t.name for t in tools.tools}
    called = await answer_remote(echo, docs, quotas, "acme")
    assert isinstance(called, events.ToolResult)
    assert (called.content, called.is_error, called.cause) == ("Echo: allowed", False, 9)


async def test_a_tenant_uses_only_the_urls_the_operator_allowed(bus: Bus, cli_env: dict[str, str], prefix: str) -> None:
    quotas = Quotas(bus.log_store)
    url = "http://docs.internal:8000/mcp"
    refusal = await url_refusal(quotas, "acme", url)
    assert refusal is not None
    assert "--mcp-urls" in refusal
    assert "acme" in refusal
    assert await url_refusal(quotas, None, url) is None  # the deployment's own sessions

    env = {**cli_env, "RIVERBED_PREFIX": prefix}
    done = await anyio.to_thread.run_sync(
        lambda: run(env, "tenants", "set", "acme", "--mcp-urls", f"{url}/,http://b/mcp")
    )
    assert done.returncode == 0, done.stderr
    assert await url_refusal(quotas, "acme", url) is None  # (a trailing / is no difference)
    assert await url_refusal(quotas, "acme", "http://docs.internal:8000/other") is not None
    assert await url_refusal(quotas, "other", url) is not None
    kept = await quotas.get("acme")
    assert kept.max_runs is None
    assert kept.mcp_urls == [f"{url}/", "http://b/mcp"]

    bad = await anyio.to_thread.run_sync(lambda: run(env, "tenants", "set", "acme", "--mcp-urls", "file:///etc"))
    assert bad.returncode == 2
    assert b"--mcp-urls takes http://" in bad.stderr
    assert b"Traceback" not in bad.stderr
    cleared = await anyio.to_thread.run_sync(lambda: run(env, "tenants", "set", "acme", "--mcp-urls", ""))
    assert cleared.returncode == 0, cleared.stderr
    assert await url_refusal(quotas, "acme", url) is not None


def test_npm_is_where_ci_installs_server_everything() -> None:
    """CI must run the npm server's tests: .ci/run installs it where they look."""
    script = (ROOT / ".ci" / "run").read_text()
    assert "npm install --prefix .ci/npm" in script
    assert "@modelcontextprotocol/server-everything" in script
    if os.environ.get("CI"):
        assert EVERYTHING.exists(), "CI runs the MCP tests with server-everything installed"
    assert shutil.which("node") or not EVERYTHING.exists()

"""A session's stdio MCP servers, run in its sandbox.

An ``mcp_list`` whose ``runs_in`` is ``runtime`` names a server by its command; the runtime
starts that command inside the session's sandbox (the same bubblewrap confinement, workspace,
limits, ``/tmp`` and network policy as the session's shell and Python), speaks MCP with it over
its stdin and stdout (newline-delimited JSON-RPC, the ``initialize`` handshake), and answers
with the tools it lists (``mcp_tools``).  A ``tool_call`` for that server is answered with a
``tool_result``: the text of what the tool returned, ``is_error`` when it says it failed.

Lifecycle, like the shell's: a server starts on first use and lives as long as the session's
sandbox (closed with it: the session let go, the worker stopping).  Its spec (command,
environment names, timeout) comes from the log's latest ``mcp_list`` for it, so a new owner
after a takeover, or a fork's rebuilt sandbox, starts it again on the first call.  Every
request is bounded by the server's timeout: a server that does not answer in time is stopped
and the call gets an error result; one that died gets an error result too; either way the next
call starts it again.

Where its command is found: a bare name (``mcp-server-git``) is looked up in the worker's own
Python environment (its ``bin``, mounted read-only in every sandbox), in each directory of
``RIVERBED_MCP_MOUNTS`` (``bin`` and ``node_modules/.bin``: those directories are mounted
read-only for the server) and on the sandbox's ``PATH`` (the system's directories).  The
protocol's messages are the official ``mcp`` package's types (``mcp.types``).

This module also turns the SDK's results into riverbed's events (:func:`tools_of`,
:func:`result_text`), for the agent worker's remote client too.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import structlog

from riverbed import events
from riverbed.runtime.output import CappedText, read_some, write_all
from riverbed.runtime.sandbox import start_again_on_a_network_race
from riverbed.runtime.sandboxed import Placement, SandboxedProcess

__all__ = ["McpFailed", "McpServers", "mcp_types", "result_text", "tools_of"]

log = structlog.get_logger("riverbed.runtime.mcp")

MAX_LINE = 16 * 1024 * 1024
"""The longest message a server may send (bytes of one JSON line)."""
MAX_PAGES = 50
"""How many pages of ``tools/list`` are read at most."""
STDERR_TAIL = 2000
EXIT_WAIT = 2.0
"""Seconds a server whose output closed is given to exit, for its status to be told."""
"""How much of what a server wrote on stderr an error quotes (the last characters)."""
STDERR_KEEP = 1024 * 1024
"""A server's stderr file is emptied at its next request once it holds more than this."""

MAX_RESULT_CHARS = 30_000
"""A tool result above this many characters is cut in the middle (a sandbox's ``max_output_chars``
for stdio servers)."""

_CLIENT_INFO = {"name": "riverbed", "version": "0.1.0"}
PROTOCOL_VERSION = "2025-11-25"
"""The MCP revision riverbed offers in the ``initialize`` handshake (a server that does not
speak it answers with one it does, as the protocol says)."""


class McpFailed(Exception):
    """A server could not be started, failed, or did not answer in time (one sentence)."""


async def mcp_types() -> Any:
    """``mcp.types`` (the worker extra), imported in a thread the first time: the SDK's models
    take a second or more to import, which would stall every session of the worker's loop."""
    module = sys.modules.get("mcp.types")
    if module is None:
        try:
            module = await anyio.to_thread.run_sync(importlib.import_module, "mcp.types")
        except ModuleNotFoundError as exc:
            raise McpFailed(
                f"the worker cannot speak MCP: {exc.name} is not installed (pip install 'riverbed[worker]')"
            ) from exc
    return module


# --- results as riverbed's events (shared with the agent worker's remote client) -----------


def tools_of(server: str, result: Any) -> events.McpTools:
    """The ``mcp_tools`` answer for a ``tools/list`` result (an ``mcp.types.ListToolsResult``,
    or several pages' tools as a list)."""
    listed = result if isinstance(result, list) else list(result.tools)
    return events.McpTools(
        server=server,
        tools=[
            events.McpTool(name=tool.name, description=tool.description or "", input_schema=dict(tool.input_schema))
            for tool in listed
        ],
    )


def result_text(result: Any, limit: int = MAX_RESULT_CHARS) -> str:
    """A ``tools/call`` result (``mcp.types.CallToolResult``) as the text the model reads: the
    text blocks joined by newlines, the other blocks described, the structured content as
    JSON when there is nothing else; above ``limit`` characters, cut in the middle with a
    marker (as a command's output is)."""
    parts: list[str] = []
    for block in result.content:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind}: {block.mime_type}, {len(block.data) * 3 // 4} bytes]")
        elif kind == "resource_link":
            parts.append(f"[resource link: {block.uri}" + (f" ({block.name})" if block.name else "") + "]")
        elif kind == "resource":
            resource = block.resource
            text = getattr(resource, "text", None)
            if text is not None:
                parts.append(text)
            else:
                mime = getattr(resource, "mime_type", None) or "binary"
                parts.append(f"[resource: {resource.uri}, {mime}]")
        else:
            parts.append(f"[{kind or 'unknown'} content]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    capped = CappedText(limit)
    capped.feed("\n".join(parts))
    return capped.render()


# --- one server --------------------------------------------------------------------------


def _scripts_dir() -> str:
    """The ``bin`` of the worker's Python environment (a virtual environment's own)."""
    return sysconfig.get_path("scripts") or os.path.dirname(sys.executable)


def resolve(command: Sequence[str], path: str, mounts: Sequence[str]) -> list[str]:
    """``command`` with its program found (see the module docstring); :class:`McpFailed` when
    it is nowhere.  A path (``./server.py``, ``/usr/bin/x``) is kept as it is."""
    program = command[0]
    if "/" in program:
        return list(command)
    dirs = [_scripts_dir()]
    for mount in mounts:
        dirs += [os.path.join(mount, "bin"), os.path.join(mount, "node_modules", ".bin")]
    dirs += path.split(os.pathsep)
    found = shutil.which(program, path=os.pathsep.join(dirs))
    if found is None:
        raise McpFailed(
            f"the command {program!r} is not installed where the sandbox can run it: not in the worker's Python "
            "environment, RIVERBED_MCP_MOUNTS or the system's PATH"
        )
    return [found, *command[1:]]


class McpProcess(SandboxedProcess):
    """One stdio server of a session, in its sandbox; not safe for concurrent use (the
    session's lock runs one action at a time)."""

    def __init__(
        self, placement: Placement, spec: events.McpList, env: Mapping[str, str], mounts: Sequence[str]
    ) -> None:
        super().__init__(placement)
        self.spec = spec
        self._server_env = dict(env)
        self._mounts = list(mounts)
        self._stdin = -1
        self._stdout = -1
        self._buf = b""
        self._next_id = 0
        self._stderr_path = self._sandbox.state_dir(self._workspace) / f"mcp-{spec.server}.stderr"

    async def start(self) -> None:
        """Start the server's process in the sandbox (the caller bounds the time, and then
        that of :meth:`initialize`)."""
        assert self.spec.command
        argv = resolve(self.spec.command, self._server_env.get("PATH", ""), self._mounts)
        self._link = link = self._sandbox.link()
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            await anyio.to_thread.run_sync(self._sandbox.prepare_processes, self._workspace)
            tmp = await self._tmp.enter() if self._tmp is not None else None
            inner = self._sandbox.wrap(
                argv,
                workspace=self._workspace,
                readonly=[(mount, mount) for mount in self._mounts],
                link=link,
                nproc=self._limits.max_processes,
                tmp=tmp,
            )
            self._stderr_path.write_bytes(b"")
            # appended to, so that emptying it (a chatty server) starts it again from the top
            stderr = open(self._stderr_path, "ab")  # noqa: ASYNC230, SIM115  (a local file, handed to the child)
        except BaseException:
            for fd in (in_r, in_w, out_r, out_w):
                os.close(fd)
            await self._drop_link()
            raise
        try:
            self._proc = await self._spawn(  # (in the session's cgroup, like its shell)
                inner,
                stdin=in_r,
                stdout=out_w,
                stderr=stderr,
                pass_fds=link.child_fds if link is not None else (),
                cwd=self._workspace,
                env=self._server_env,
            )
            if link is not None:
                await anyio.to_thread.run_sync(link.attach)
        except BaseException:
            os.close(in_w)
            os.close(out_r)
            await self.close()
            raise
        finally:
            os.close(in_r)
            os.close(out_w)
            stderr.close()
        os.set_blocking(in_w, False)
        os.set_blocking(out_r, False)
        self._stdin, self._stdout, self._buf = in_w, out_r, b""
        self._core = frozenset({self._proc.pid})

    async def initialize(self) -> None:
        """The ``initialize`` handshake, once the process started."""
        types = await mcp_types()

        params = {
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": {},
            "clientInfo": _CLIENT_INFO,
        }
        raw = await self._request("initialize", params)
        types.InitializeResult.model_validate(raw)
        await self._send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        log.info("mcp.started", server=self.spec.server, workspace=str(self._workspace))

    async def enforce_limits(self) -> None:
        """The process-count check, for the runtime's watcher."""
        if self.alive:
            await self._check_processes()

    async def close(self) -> None:
        await self._kill()
        for fd in (self._stdin, self._stdout):
            if fd >= 0:
                os.close(fd)
        self._stdin = self._stdout = -1
        self._buf = b""

    async def list_tools(self) -> list[Any]:
        types = await mcp_types()
        tools: list[Any] = []
        cursor: str | None = None
        for _ in range(MAX_PAGES):
            page = types.ListToolsResult.model_validate(
                await self._request("tools/list", {"cursor": cursor} if cursor else {})
            )
            tools += page.tools
            cursor = page.next_cursor
            if not cursor:
                break
        return tools

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        types = await mcp_types()
        return types.CallToolResult.model_validate(
            await self._request("tools/call", {"name": name, "arguments": arguments})
        )

    async def _send(self, message: dict[str, Any]) -> None:
        try:
            await write_all(self._stdin, json.dumps(message).encode() + b"\n")
        except OSError as exc:  # (a server that exited: EPIPE)
            raise McpFailed(f"{self._gone()} ({exc.strerror})") from exc

    async def _request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """Send one request and read until its response; answer what the server asks meanwhile
        (``ping``; anything else is refused as not supported)."""
        self._next_id += 1
        request_id = self._next_id
        with contextlib.suppress(OSError):
            if os.stat(self._stderr_path).st_size > STDERR_KEEP:
                os.truncate(self._stderr_path, 0)
        await self._send({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params})
        while True:
            message = await self._message()
            if "method" in message:
                if "id" in message:  # a request of the server's
                    reply: dict[str, Any] = {"jsonrpc": "2.0", "id": message["id"]}
                    if message["method"] == "ping":
                        reply["result"] = {}
                    else:
                        reply["error"] = {"code": -32601, "message": f"{message['method']} is not supported"}
                    await self._send(reply)
                continue  # (a notification: logging, progress, list changed)
            if message.get("id") != request_id:
                continue
            if "error" in message:
                error = message["error"] if isinstance(message["error"], dict) else {}
                said = error.get("message", error)
                raise McpFailed(f"the MCP server {self.spec.server!r} answered {method} with an error: {said}")
            result = message.get("result")
            if not isinstance(result, dict):
                raise McpFailed(f"the MCP server {self.spec.server!r} answered {method} without a result")
            return result

    async def _message(self) -> dict[str, Any]:
        """The next JSON-RPC message on the server's stdout (lines that are not JSON objects
        are skipped: a server's stray print)."""
        while True:
            line, sep, rest = self._buf.partition(b"\n")
            if sep:
                self._buf = rest
                with contextlib.suppress(ValueError):
                    message = json.loads(line)
                    if isinstance(message, dict):
                        return message
                continue
            if len(self._buf) > MAX_LINE:
                raise McpFailed(f"the MCP server {self.spec.server!r} sent a message over {MAX_LINE} bytes")
            data = await read_some(self._stdout)
            if not data:
                await self._exited(EXIT_WAIT)
                raise McpFailed(self._gone())
            self._buf += data

    async def _exited(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the server to exit once its output closed (it is exiting:
        its status says more than the closed pipe, and on a busy machine it may come later)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                await anyio.to_thread.run_sync(partial(proc.wait, seconds))

    def _gone(self) -> str:
        """Why the server stopped talking: its exit status and the end of its stderr."""
        code = self._proc.poll() if self._proc is not None else None
        how = "closed its output" if code is None else f"exited with code {code}"
        if code is not None and code < 0:
            how = f"was killed by signal {-code}"
        return f"the MCP server {self.spec.server!r} {how}{_tail(self._stderr_path)}"


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - STDERR_TAIL))
            said = fh.read().decode(errors="replace").strip()
    except OSError:
        return ""
    return f"; it said: {said}" if said else ""


# --- a session's servers -------------------------------------------------------------------


class McpServers:
    """A session's stdio servers by name: started on first use, closed with the session."""

    def __init__(self, placement: Placement, mounts: Sequence[str] = ()) -> None:
        self._placement = placement
        self._mounts = [mount for mount in mounts if os.path.isdir(mount)]  # (bwrap refuses a missing one)
        self._specs: dict[str, events.McpList] = {}
        self._running: dict[str, McpProcess] = {}

    def knows(self, server: str) -> bool:
        return server in self._specs

    @property
    def started(self) -> bool:
        """Whether a server of the session was started and not stopped since."""
        return bool(self._running)

    def learn(self, spec: events.McpList) -> None:
        """Remember ``spec`` (the log's latest ``mcp_list`` of its server); a running server
        whose spec changed is stopped at its next use and started anew."""
        self._specs[spec.server] = spec

    async def list(self, spec: events.McpList, env: Mapping[str, str]) -> events.Observation:
        """Answer an ``mcp_list``: the server's tools, or an ``error`` (retryable)."""
        self.learn(spec)
        try:
            await mcp_types()  # (the SDK's first import is not the server's time)
            server = await self._server(spec.server, env)
            with anyio.fail_after(spec.timeout):
                tools = await server.list_tools()
        except TimeoutError:
            await self._stop(spec.server)
            return _failed(spec.server, f"did not list its tools within {spec.timeout:g} seconds and was stopped")
        except McpFailed as exc:
            await self._stop(spec.server)
            return _failed(spec.server, str(exc))
        except ValueError as exc:  # (a message that is not what MCP says: pydantic's ValidationError)
            await self._stop(spec.server)
            return _failed(spec.server, f"sent what is not MCP: {type(exc).__name__}: {exc}")
        return tools_of(spec.server, tools)

    async def call(self, action: events.ToolCall, env: Mapping[str, str]) -> events.Observation:
        """Answer a ``tool_call``: the tool's result, or an error result (never raises for the
        server's failure)."""
        name = action.server or ""
        spec = self._specs.get(name)
        if spec is None or not spec.command:
            return _error_result(f"the MCP server {name!r} was never listed in this session (no mcp_list)")
        tool = action.tool.removeprefix(f"{name}.")
        try:
            await mcp_types()
            server = await self._server(name, env)
            with anyio.fail_after(spec.timeout):
                result = await server.call_tool(tool, action.arguments)
        except TimeoutError:
            await self._stop(name)
            return _error_result(
                f"the MCP server {name!r} did not answer {tool} within {spec.timeout:g} seconds; it was stopped "
                "and starts again on the next call"
            )
        except McpFailed as exc:
            await self._stop(name)
            return _error_result(f"{exc}; the next call starts it again")
        except ValueError as exc:  # (a message that is not what MCP says: pydantic's ValidationError)
            await self._stop(name)
            return _error_result(f"the MCP server {name!r} sent what is not MCP: {type(exc).__name__}: {exc}")
        text = result_text(result, self._placement.limits.max_output_chars)
        return events.ToolResult(content=text, is_error=bool(result.is_error), source="runtime")

    async def _server(self, name: str, env: Mapping[str, str]) -> McpProcess:
        spec = self._specs[name]
        server = self._running.get(name)
        if server is not None and (not server.alive or server.spec != spec):
            await self._stop(name)
            server = None
        if server is None:
            wanted = dict(self._placement.env)
            for variable in spec.env:
                if variable in env:
                    wanted[variable] = env[variable]
            server = McpProcess(self._placement, spec, wanted, self._mounts)
            try:
                try:
                    with anyio.fail_after(self._placement.limits.start_timeout):
                        await start_again_on_a_network_race(server.start, f"mcp {name}")
                except TimeoutError:
                    raise McpFailed(
                        f"the sandbox of the MCP server {name!r} did not start within "
                        f"{self._placement.limits.start_timeout:g} seconds"
                    ) from None
                await _handshake(server, spec.timeout)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await server.close()
                raise
            self._running[name] = server
        return server

    async def _stop(self, name: str) -> None:
        server = self._running.pop(name, None)
        if server is not None:
            with anyio.CancelScope(shield=True):
                await server.close()

    async def close(self) -> None:
        for name in list(self._running):
            await self._stop(name)

    async def enforce_limits(self) -> None:
        for server in list(self._running.values()):
            await server.enforce_limits()


async def _handshake(server: McpProcess, timeout: float) -> None:
    """The server's ``initialize`` handshake, within ``timeout`` (its program's start included)."""
    with anyio.move_on_after(timeout) as handshake:
        await server.initialize()
    if handshake.cancelled_caught:
        raise McpFailed(
            f"the MCP server {server.spec.server!r} did not complete its handshake within {timeout:g} seconds"
        )


def _failed(server: str, why: str) -> events.Error:
    text = why if why.startswith("the ") else f"the MCP server {server!r} {why}"
    return events.Error(content=text, reason="mcp_failed", retryable=True, source="runtime")


def _error_result(text: str) -> events.ToolResult:
    return events.ToolResult(content=text, is_error=True, source="runtime")

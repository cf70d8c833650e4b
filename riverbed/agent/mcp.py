"""MCP servers of a hosted agent: their definition, the events that ask them, the names the
model sees, and the client of remote (streamable HTTP) servers.

::

    git = MCPServer(name="git", command=["mcp-server-git", "--repository", "."])
    docs = MCPServer(name="docs", url="http://docs.internal:8000/mcp", timeout=20)

    list_action(git)                       # the mcp_list a run appends the first time it uses git
    openai_tools(listed)                   # the chat request's `tools` entries for its mcp_tools
    tool_of("git__git_status", [listed])   # ("git", "git_status"): whose tool the model called
    call_action(git, "git_status", {...})  # the tool_call for it
    await list_remote(docs)                # mcp_tools, or an error event: never raises
    await call_remote(docs, "search", {...})  # a tool_result (is_error when it failed): never raises
    await answer_remote(action, docs, quotas, tenant)  # the answer of its mcp_list or tool_call, URL checked

A stdio server (``command``) runs in the session's sandbox: the runtime role answers its
``mcp_list`` and ``tool_call`` (``runs_in`` runtime; :mod:`riverbed.runtime.mcp`).  A remote
one (``url``) is asked from the agent worker with :func:`list_remote` and :func:`call_remote`,
after :func:`url_refusal` said its tenant may use the URL (``riverbed tenants set T
--mcp-urls``).

Names the model sees: OpenAI takes tool names of ``[a-zA-Z0-9_-]``, 64 at most, so a server's
tool is offered as ``<server>__<tool>`` (:func:`model_name`); a tool whose name has other
characters, or a pair too long, gets a short hash in its name instead.  A server's name may not
hold ``__``, so a name that was not hashed reads back unambiguously; :func:`tool_of` reads any
back from the tools listed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

import anyio
import msgspec
import structlog

from riverbed import events
from riverbed.errors import InputError


class _Quota(Protocol):
    mcp_urls: list[str] | None


class Quotas(Protocol):
    """What :func:`url_refusal` reads of ``riverbed.agent.quotas.Quotas``: a tenant's allowed URLs."""

    async def get(self, tenant: str) -> _Quota: ...


# (``riverbed.runtime.mcp``, which turns the SDK's results into events, is imported where a remote
# server is asked: ``import riverbed`` exports MCPServer and stays light)

__all__ = [
    "MCPServer",
    "answer_remote",
    "call_action",
    "call_remote",
    "list_action",
    "list_remote",
    "model_name",
    "openai_tools",
    "tool_of",
    "url_allowed",
    "url_refusal",
]

log = structlog.get_logger("riverbed.agent.mcp")

_SERVER_NAME = re.compile(r"[A-Za-z0-9_-]+")
_MODEL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_NAME = 64
"""The longest tool name OpenAI's chat API takes."""
MAX_SERVER_NAME = 32


@dataclasses.dataclass(frozen=True)
class MCPServer:
    """An MCP server an agent uses: a stdio ``command`` run in the session's sandbox, or a
    streamable HTTP ``url`` asked from the agent worker (exactly one of the two).

    ``env`` names environment variables of the session's configuration (``session_config``)
    a stdio server gets, besides the sandbox's own ``PATH``, ``HOME`` and ``LANG``.  ``timeout``
    bounds each request in seconds: starting and listing, and each tool call.
    """

    name: str
    command: Sequence[str] | None = None
    url: str | None = None
    env: Sequence[str] = ()
    timeout: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _SERVER_NAME.fullmatch(self.name) or "__" in self.name:
            raise InputError(
                f"an MCP server's name is letters, digits, _ and - without a double underscore, not {self.name!r}"
            )
        if len(self.name) > MAX_SERVER_NAME:
            raise InputError(f"an MCP server's name is at most {MAX_SERVER_NAME} characters, not {len(self.name)}")
        if (self.command is None) == (self.url is None):
            raise InputError(f"MCP server {self.name!r} needs exactly one of command=[...] (stdio) or url='http...'")
        if self.command is not None:
            if isinstance(self.command, str) or not self.command or not all(isinstance(a, str) for a in self.command):
                raise InputError(
                    f"MCP server {self.name!r}: command is a non-empty list of strings, like ['mcp-server-git']"
                )
            object.__setattr__(self, "command", tuple(self.command))
        if self.url is not None:
            parts = urlsplit(self.url) if isinstance(self.url, str) else None
            if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
                raise InputError(f"MCP server {self.name!r}: url is an http:// or https:// URL, not {self.url!r}")
        if isinstance(self.env, str) or not all(isinstance(n, str) and n for n in self.env):
            raise InputError(f"MCP server {self.name!r}: env is a list of variable names, like ['GITHUB_TOKEN']")
        object.__setattr__(self, "env", tuple(self.env))
        if (
            not isinstance(self.timeout, int | float)
            or isinstance(self.timeout, bool)
            or not 0 < self.timeout <= events.MAX_TIMEOUT
        ):
            raise InputError(
                f"MCP server {self.name!r}: timeout is a number of seconds above 0, at most a day, not {self.timeout!r}"
            )

    @property
    def runs_in(self) -> str:
        """Where its tools run: ``runtime`` (the session's sandbox) or ``agent`` (the worker)."""
        return "runtime" if self.command is not None else "agent"


def list_action(server: MCPServer) -> events.McpList:
    """The ``mcp_list`` a run appends the first time it uses ``server``."""
    if server.command is not None:
        return events.McpList(
            server=server.name,
            command=list(server.command),
            env=list(server.env),
            timeout=float(server.timeout),
            runs_in="runtime",
        )
    return events.McpList(
        server=server.name, url=server.url, env=list(server.env), timeout=float(server.timeout), runs_in="agent"
    )


def call_action(
    server: MCPServer,
    tool: str,
    arguments: Mapping[str, Any],
    *,
    tool_call_id: str | msgspec.UnsetType = msgspec.UNSET,
) -> events.ToolCall:
    """The ``tool_call`` of ``server``'s ``tool`` (named ``<server>.<tool>`` on the log)."""
    return events.ToolCall(
        tool=f"{server.name}.{tool}",
        arguments=dict(arguments),
        server=server.name,
        runs_in="runtime" if server.command is not None else "agent",
        tool_call_id=tool_call_id,
    )


# --- the names the model sees ------------------------------------------------------------------


def model_name(server: str, tool: str) -> str:
    """The name the model calls ``server``'s ``tool`` by: ``<server>__<tool>`` when that is
    OpenAI's alphabet and at most 64 characters; else the characters kept, cut, and a hash of
    the pair added (the same pair always gets the same name)."""
    plain = f"{server}__{tool}"
    if _MODEL_NAME.fullmatch(plain):
        return plain
    digest = hashlib.sha256(f"{server}\x00{tool}".encode()).hexdigest()[:8]
    kept = re.sub(r"[^A-Za-z0-9_-]", "_", plain)[: MAX_NAME - len(digest) - 1]
    return f"{kept}_{digest}"


def tool_of(name: str, listed: Iterable[events.McpTools]) -> tuple[str, str] | None:
    """Whose tool the model called by ``name``: (server, tool) among the tools ``listed``
    (the run's ``mcp_tools``), or None when it is none of them."""
    for tools in listed:
        for tool in tools.tools:
            if model_name(tools.server, tool.name) == name:
                return tools.server, tool.name
    return None


def openai_tools(listed: events.McpTools) -> list[dict[str, Any]]:
    """The chat request's ``tools`` entries for the tools one server listed."""
    out: list[dict[str, Any]] = []
    for tool in listed.tools:
        schema = dict(tool.input_schema) if tool.input_schema else {}
        if schema.get("type") != "object":
            schema = {"type": "object", "properties": {}, **({"anyOf": [schema]} if schema else {})}
        schema.setdefault("properties", {})  # (some model servers refuse an object without it)
        out.append(
            {
                "type": "function",
                "function": {
                    "name": model_name(listed.server, tool.name),
                    "description": tool.description or f"{tool.name} (MCP server {listed.server})",
                    "parameters": schema,
                },
            }
        )
    return out


# --- who may use a remote server -----------------------------------------------------------


def url_allowed(allowed: Sequence[str], url: str) -> bool:
    """Whether ``url`` is one of the ``allowed`` URLs (a trailing ``/`` is not a difference)."""
    wanted = url.rstrip("/")
    return any(entry.rstrip("/") == wanted for entry in allowed)


async def url_refusal(quotas: Quotas, tenant: str | None, url: str) -> str | None:
    """Why a run of ``tenant`` may not use the remote MCP server at ``url`` (None: it may).

    A tenant may use the URLs the operator allowed it (``riverbed tenants set T --mcp-urls
    URL,...``) and no other; a session of no tenant is the deployment's own, and may use
    those its agents' definitions name."""
    if tenant is None:
        return None
    allowed = (await quotas.get(tenant)).mcp_urls or []
    if url_allowed(allowed, url):
        return None
    return (
        f"tenant {tenant!r} may not use the MCP server at {url}: the operator allows a tenant's remote MCP "
        f"servers with `riverbed tenants set {tenant} --mcp-urls URL,...`"
    )


# --- remote servers (streamable HTTP), asked from the agent worker ------------------------


async def list_remote(server: MCPServer) -> events.McpTools | events.Error:
    """The tools of the remote ``server`` as the ``mcp_tools`` answer of its ``mcp_list``, or
    the ``error`` answer (reason ``mcp_failed``, retryable) when it cannot be reached, fails or
    does not answer within its timeout.  Never raises for the server's failure."""
    assert server.url is not None, "list_remote asks a url server"
    from riverbed.runtime.mcp import mcp_types, tools_of  # noqa: PLC0415

    try:
        await mcp_types()  # (the SDK's first import is not the server's time)
        with anyio.fail_after(server.timeout):
            async with _connected(server.url) as session:
                tools: list[Any] = []
                cursor: str | None = None
                while True:
                    page = await session.list_tools(params=_page(cursor))
                    tools += page.tools
                    cursor = page.next_cursor
                    if not cursor:
                        break
    except TimeoutError:
        return _remote_error(server, f"did not list its tools within {server.timeout:g} seconds")
    except Exception as exc:
        return _remote_error(server, f"could not list its tools: {_reason(exc)}")
    return tools_of(server.name, tools)


async def call_remote(
    server: MCPServer, tool: str, arguments: Mapping[str, Any], timeout: float | None = None
) -> events.ToolResult:
    """Call ``tool`` of the remote ``server``: the ``tool_result`` answer of its ``tool_call``
    (``is_error`` when the tool says it failed, or the server cannot be reached, fails or does
    not answer within ``timeout``, the server's own when None).  Never raises for the server's
    failure."""
    assert server.url is not None, "call_remote asks a url server"
    from riverbed.runtime.mcp import mcp_types, result_text  # noqa: PLC0415

    seconds = timeout if timeout is not None else server.timeout
    try:
        await mcp_types()  # (the SDK's first import is not the server's time)
        with anyio.fail_after(seconds):
            async with _connected(server.url) as session:
                result = await session.call_tool(tool, dict(arguments))
    except TimeoutError:
        return events.ToolResult(
            content=f"the MCP server {server.name!r} did not answer {tool} within {seconds:g} seconds", is_error=True
        )
    except Exception as exc:
        return events.ToolResult(
            content=f"the MCP server {server.name!r} failed to run {tool}: {_reason(exc)}", is_error=True
        )
    return events.ToolResult(content=result_text(result), is_error=bool(result.is_error))


async def answer_remote(
    action: events.McpList | events.ToolCall, server: MCPServer, quotas: Quotas, tenant: str | None
) -> events.Observation:
    """The one answer of a remote ``server``'s ``mcp_list`` or ``tool_call`` (its ``cause`` set),
    for the agent worker to append: refused when ``tenant`` may not use the server's URL (an
    ``error`` with reason ``mcp_refused`` for a listing, an error result for a call: both name
    the setting), else what :func:`list_remote` or :func:`call_remote` said.  Never raises for
    the server's failure."""
    assert server.url is not None, "answer_remote asks a url server"
    refusal = await url_refusal(quotas, tenant, server.url)
    answer: events.Observation
    if isinstance(action, events.McpList):
        if refusal is not None:
            answer = events.Error(content=refusal, reason="mcp_refused", retryable=False, source="agent")
        else:
            answer = await list_remote(server)
    elif refusal is not None:
        answer = events.ToolResult(content=refusal, is_error=True)
    else:
        answer = await call_remote(server, action.tool.removeprefix(f"{server.name}."), action.arguments)
    return msgspec.structs.replace(answer, cause=action.id)


def _page(cursor: str | None) -> Any:
    if cursor is None:
        return None
    from mcp import types  # noqa: PLC0415  (the worker extra, imported by _connected already)

    return types.PaginatedRequestParams(cursor=cursor)


class _connected:
    """An initialized MCP client session over streamable HTTP (the ``mcp`` package's)."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._stack: Any = None

    async def __aenter__(self) -> Any:
        from contextlib import AsyncExitStack  # noqa: PLC0415

        from mcp import ClientSession  # noqa: PLC0415  (the worker extra)
        from mcp.client.streamable_http import streamable_http_client  # noqa: PLC0415

        self._stack = AsyncExitStack()
        try:
            read, write = await self._stack.enter_async_context(streamable_http_client(self._url))
            session = await self._stack.enter_async_context(ClientSession(read, write))
            await session.initialize()
        except BaseException:
            await self._stack.aclose()
            raise
        return session

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()


def _reason(exc: BaseException) -> str:
    """One line for what went wrong, the innermost cause of an exception group."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


def _remote_error(server: MCPServer, why: str) -> events.Error:
    log.info("mcp.remote_failed", server=server.name, url=server.url, why=why)
    content = f"the MCP server {server.name!r} ({server.url}) {why}"
    return events.Error(content=content, reason="mcp_failed", retryable=True, source="agent")

"""Agent definitions: what a hosted agent is told, which tools it has, and the digest of it all.

::

    import riverbed

    @riverbed.tool
    def count_lines(path: str) -> int:
        \"\"\"How many lines a file has.\"\"\"
        ...

    helper = riverbed.Agent(
        "repo-helper",
        "You answer questions about the repository in the workspace.",
        tools=["cmd_run", "file_read", count_lines],
        mcp=[riverbed.MCPServer(name="git", command=["mcp-server-git", "--repository", "."])],
    )

A worker hosts the definitions of the modules it is given (``riverbed worker agent --agents
mypkg.agents``; :mod:`riverbed.agent.registry`), and the reference agent (:data:`REFERENCE`),
which is one ``Agent`` like any other.  ``tools`` mixes the built-in tools by name
(:data:`BUILTIN_TOOLS`) with ``@riverbed.tool`` functions; ``finish`` is always offered, and
``delegate`` when the agent has ``sub_agents`` (or names ``"delegate"``: its sub-agents then
run its own definition).

The digest covers everything that decides what the agent does: its instructions, model, tools
(their schemas, options and code), MCP servers, sub-agents, limits, condenser and stuck
thresholds, and :data:`RULES_VERSION`, the version of the run rules every agent shares
(``riverbed.agent.runs``).  A run records the digest it opened under, and a worker whose
definition differs does not continue it (``riverbed agent SESSION --upgrade`` switches it).
"""

from __future__ import annotations

import hashlib
import inspect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import msgspec

from riverbed import events
from riverbed.agent.mcp import MCPServer
from riverbed.agent.risk import Analyzer
from riverbed.agent.tooling import Tool
from riverbed.errors import InputError

__all__ = ["BUILTIN_TOOLS", "REFERENCE", "RULES_VERSION", "Agent", "RunLimits", "StuckLimits"]

RULES_VERSION = 1
"""The version of the run rules (how a response becomes moves, what ends a run).  A change to
them that would make an open run go differently takes a new version: workers then leave older
runs to workers that still have the old rules, unless the run is upgraded."""

BUILTIN_TOOLS: dict[str, type[events.Action]] = {
    "cmd_run": events.CmdRun,
    "file_read": events.FileRead,
    "file_write": events.FileWrite,
    "file_edit": events.FileEdit,
    "python_run": events.PythonRun,
    "recall": events.Recall,
    "think": events.Think,
    "delegate": events.Delegate,
}
"""The built-in tools an agent may name in ``tools``, and the action each call becomes."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SECRET_NAME = re.compile(events.SECRET_NAME_PATTERN)


@dataclass(frozen=True, kw_only=True)
class RunLimits:
    model: str | None = None
    max_steps: int = 30
    max_tokens: int | None = None
    max_cost: float | None = None
    max_output_tokens: int | None = None
    """tokens one model answer may have (None: the worker's ``RIVERBED_LLM_MAX_OUTPUT_TOKENS``)"""
    temperature: float | None = None
    """None: the worker's ``RIVERBED_LLM_TEMPERATURE``"""
    llm_timeout: float | None = None
    """seconds one model call may take (None: the worker's ``RIVERBED_LLM_TIMEOUT``)"""


@dataclass(frozen=True)
class StuckLimits:
    """When a run counts as stuck (it then ends with reason ``stuck``): the same call with the
    same result ``repeats`` times in a row, the same error ``errors`` times in a row, or
    ``idle`` responses in a row that call nothing but ``think``.  0 turns a pattern off; ``idle``
    is off unless an agent sets it (a model may plan over several thoughts)."""

    repeats: int = 4
    errors: int = 4
    idle: int = 0


@dataclass(frozen=True, eq=False)
class Agent:
    """A hosted agent: ``riverbed.Agent(name, instructions, model=None, tools=[...], mcp=[...],
    sub_agents=[...], limits=None, condenser=None)``."""

    name: str
    instructions: str | None = None
    model: str | None = None
    """the model its runs use unless the run names one (None: the worker's ``RIVERBED_LLM_MODEL``)"""
    tools: Sequence[str | Tool] = ("cmd_run", "file_read", "file_write", "file_edit", "python_run", "think")
    mcp: Sequence[MCPServer] = ()
    sub_agents: Sequence[str] = ()
    limits: RunLimits | None = None
    """limits its runs open with unless the caller gives others"""
    condenser: Mapping[str, Any] | None = None
    """condenser settings (the fields of a ``session_config``'s ``condenser``) for its runs"""
    stuck: StuckLimits = field(default_factory=StuckLimits)
    confirm: str | Sequence[str] = "never"
    """which calls wait for a person's approval: ``never``, ``always``, ``risky`` (labelled high or
    unknown by the analyzer) or a list of tool names; a run may say otherwise (``--confirm``)"""
    analyzer: Analyzer | None = None
    """labels each call's risk (``riverbed.Risk``); None: the built-in rule-based analyzer"""
    approval_timeout: float | None = None
    """seconds a call may wait for approval before it is rejected, saying so (None: no limit)"""
    secrets: Sequence[str] = ()
    """names of its tenant's secrets its runs may use (``riverbed secrets set``): in the sandbox's
    environment, in its stdio MCP servers' and through ``ToolContext.secret``"""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise InputError(
                f"an agent's name is 1 to 64 letters, digits, '_', '-' or '.', starting with a letter or digit: "
                f"{self.name!r}"
            )
        if isinstance(self.tools, str | Tool):
            raise InputError(
                f"agent {self.name}: tools is a list (of built-in tool names and @riverbed.tool functions)"
            )
        seen: set[str] = set()
        for item in self.tools:
            if isinstance(item, str):
                if item not in BUILTIN_TOOLS:
                    raise InputError(
                        f"agent {self.name}: there is no built-in tool {item!r} "
                        f"(the built-in tools are {', '.join(BUILTIN_TOOLS)}; a function needs @riverbed.tool)"
                    )
                name = item
            elif isinstance(item, Tool):
                name = item.name
                if name in BUILTIN_TOOLS or name == "finish":
                    raise InputError(f"agent {self.name}: the tool {name!r} has the name of a built-in tool")
            else:
                raise InputError(
                    f"agent {self.name}: {item!r} is not a tool (name a built-in tool or decorate the function "
                    "with @riverbed.tool)"
                )
            if name in seen:
                raise InputError(f"agent {self.name}: the tool {name!r} is given twice")
            seen.add(name)
        servers: set[str] = set()
        for server in self.mcp:
            if not isinstance(server, MCPServer):
                raise InputError(f"agent {self.name}: mcp is a list of riverbed.MCPServer, not {server!r}")
            if server.name in servers:
                raise InputError(f"agent {self.name}: two MCP servers are named {server.name!r}")
            servers.add(server.name)
        check_policy(self.confirm, f"agent {self.name}")
        if self.approval_timeout is not None and not self.approval_timeout > 0:
            raise InputError(f"agent {self.name}: approval_timeout is a number of seconds above 0, or None")
        for sub in self.sub_agents:
            if not isinstance(sub, str) or not _NAME.fullmatch(sub):
                raise InputError(f"agent {self.name}: sub_agents names other agents by name, not {sub!r}")
        if isinstance(self.secrets, str):
            raise InputError(f"agent {self.name}: secrets is a list of secret names, not {self.secrets!r}")
        for secret in self.secrets:
            if not isinstance(secret, str) or not SECRET_NAME.fullmatch(secret):
                raise InputError(
                    f"agent {self.name}: {secret!r} is not a secret name (capital letters, digits and '_', "
                    "starting with a letter or '_')"
                )

    # --- what the model is offered ---------------------------------------------------------

    @cached_property
    def builtin_kinds(self) -> tuple[type[events.Action], ...]:
        """The built-in actions it may call, ``finish`` last."""
        named = [BUILTIN_TOOLS[t] for t in self.tools if isinstance(t, str)]
        if self.sub_agents and events.Delegate not in named:
            named.append(events.Delegate)
        return (*named, events.Finish)

    @cached_property
    def user_tools(self) -> dict[str, Tool]:
        return {t.name: t for t in self.tools if isinstance(t, Tool)}

    @property
    def delegates(self) -> bool:
        return events.Delegate in self.builtin_kinds

    # --- the digest ------------------------------------------------------------------------

    def definition(self) -> dict[str, Any]:
        """The definition as plain data: what the digest covers (and ``riverbed agents`` shows)."""
        return {
            "name": self.name,
            "instructions": self.instructions,
            "model": self.model,
            "tools": [t if isinstance(t, str) else t.digest_parts() for t in self.tools],
            "mcp": [_server(s) for s in self.mcp],
            "sub_agents": list(self.sub_agents),
            "limits": msgspec.to_builtins(self.limits) if self.limits is not None else None,
            "condenser": dict(self.condenser) if self.condenser is not None else None,
            "stuck": msgspec.to_builtins(self.stuck),
            "confirm": self.confirm if isinstance(self.confirm, str) else list(self.confirm),
            "analyzer": _where(self.analyzer),
            "approval_timeout": self.approval_timeout,
            "rules": RULES_VERSION,
            # (only when named: the digests of definitions without secrets stay what they were)
            **({"secrets": sorted(set(self.secrets))} if self.secrets else {}),
        }

    @cached_property
    def digest(self) -> str:
        """sha256 of the canonical JSON of :meth:`definition` (the first 16 hex digits)."""
        encoded = msgspec.json.encode(self.definition(), order="sorted")
        return hashlib.sha256(encoded).hexdigest()[:16]

    def describe(self, where: str = "") -> dict[str, Any]:
        """What ``riverbed agents`` lists of it."""
        return {
            "name": self.name,
            "digest": self.digest,
            "rules": RULES_VERSION,
            "model": self.model,
            "tools": [t if isinstance(t, str) else t.name for t in self.tools],
            "mcp": [_server(s) for s in self.mcp],
            "sub_agents": list(self.sub_agents),
            "limits": msgspec.to_builtins(self.limits) if self.limits is not None else None,
            "secrets": sorted(set(self.secrets)),
            "where": where,
        }


def check_policy(policy: object, whose: str) -> None:
    """:class:`InputError` unless ``policy`` is an approval policy."""
    if isinstance(policy, str):
        if policy not in ("never", "always", "risky"):
            raise InputError(f"{whose}: confirm is never, always, risky or a list of tool names, not {policy!r}")
        return
    if not isinstance(policy, list | tuple) or not all(isinstance(t, str) for t in policy):
        raise InputError(f"{whose}: confirm is never, always, risky or a list of tool names, not {policy!r}")


def _where(fn: Any) -> str | None:
    if fn is None:
        return None
    name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
    try:
        return f"{name}#{hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:12]}"
    except (OSError, TypeError):
        return name


def _server(server: Any) -> dict[str, Any]:
    return {
        "name": getattr(server, "name", None),
        "command": list(getattr(server, "command", None) or []) or None,
        "url": getattr(server, "url", None),
    }


REFERENCE = Agent(
    "llm",
    None,
    tools=("cmd_run", "file_read", "file_write", "file_edit", "python_run", "recall", "think", "delegate"),
)
"""riverbed's reference agent: every built-in tool and sub-agents of its own kind, with the
software-engineering system prompt (``prompts/system.j2``)."""

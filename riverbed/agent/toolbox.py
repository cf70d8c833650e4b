"""What one agent offers the model in a step, and the way back from a tool call to its action.

:class:`Toolbox` joins an agent's three kinds of tools under the names the model sees:

- built-in tools (``cmd_run`` …, ``delegate``, ``finish``): a call is that action
  (:func:`riverbed.agent.tools.action_from_call`);
- ``@riverbed.tool`` functions: a call is a ``tool_call`` (``runs_in`` agent) whose arguments
  were checked against the function's schema;
- MCP servers' tools, as their server listed them on the log (``mcp_tools``): a call of
  ``<server>__<tool>`` (the model-facing name: OpenAI allows only ``[a-zA-Z0-9_-]``) is a
  ``tool_call`` named ``<server>.<tool>`` (``runs_in`` runtime for a stdio server, which runs in
  the session's sandbox; agent for a remote one).

A call the toolbox cannot turn into an action raises :class:`InputError` with a sentence for
the model; nothing of that response runs (``riverbed.agent.runs``).
"""

from __future__ import annotations

import copy
import datetime as dt
import functools
import re
from collections.abc import Mapping
from typing import Any

import msgspec

from riverbed import events
from riverbed.agent.define import Agent
from riverbed.agent.llm import OVERSIZED
from riverbed.agent.mcp import model_name, openai_tools
from riverbed.agent.tooling import check_arguments
from riverbed.agent.tools import action_from_call, tools
from riverbed.errors import InputError

__all__ = ["Toolbox", "made_toolbox"]

_UNSAFE = re.compile(r"[^a-zA-Z0-9_-]")
_arguments = msgspec.json.Decoder(dict[str, Any])


def _agent_as_sub_agent(arguments: str) -> str:
    """``delegate``'s arguments with the model's ``agent`` choice as the action's ``sub_agent``
    (the action's own ``agent`` is the name of whoever wrote it)."""
    try:
        raw = _arguments.decode(arguments or "{}")
    except msgspec.DecodeError:
        return arguments  # (action_from_call says what is wrong with them)
    if "agent" not in raw:
        return arguments
    raw["sub_agent"] = raw.pop("agent")
    return msgspec.json.encode(raw).decode()


Plan = tuple[events.LlmResponse, list[events.Action], list[str]]
"""A response, the actions its tool calls ask for, and what is wrong with those that do not parse."""


class Toolbox:
    """The tools of ``agent`` in one step, with the MCP listings recorded on the log so far
    (``listed``: server -> its latest ``mcp_tools``)."""

    def __init__(
        self, agent: Agent, listed: Mapping[str, events.McpTools] | None = None, *, sub_agents: bool = True
    ) -> None:
        self.agent = agent
        self.plans: dict[tuple[int | None, dt.datetime, int], Plan] = {}
        """The responses planned with this toolbox lately (``runs.planned_actions``: each step of
        each session asks for its response's plan several times) by their id, stamp and
        ``max_calls``, and what the plan was: a response as the step made it and as the log gave
        it back (decoded again) share it when their tool calls are the same, and the sessions of
        one agent share a toolbox."""
        kinds = agent.builtin_kinds
        if not sub_agents:
            kinds = tuple(k for k in kinds if k is not events.Delegate)
        self.kinds = kinds
        self._builtin = {events.kind_of(k) for k in kinds}
        self._mcp: dict[str, tuple[str, events.McpTool, str]] = {}
        """model-facing name -> (server, tool, runs_in)"""
        servers = {s.name: s for s in agent.mcp}
        self._listings = [listing for name, listing in (listed or {}).items() if name in servers]
        for listing in self._listings:
            runs_in = "agent" if servers[listing.server].url else "runtime"
            for tool in listing.tools:
                self._mcp[model_name(listing.server, tool.name)] = (listing.server, tool, runs_in)

    @functools.cached_property
    def offered(self) -> list[dict[str, Any]]:
        """:meth:`openai`, made once (a schema per tool is a few milliseconds to build)."""
        return self.openai()

    @functools.cached_property
    def offered_json(self) -> msgspec.Raw:
        """:attr:`offered` as JSON, encoded once: a request of the agent role's own client
        embeds it as it is (the reference agent's tools are about 500 JSON objects, which cost
        a step about a twentieth of its CPU to encode again each time)."""
        return msgspec.Raw(msgspec.json.encode(self.offered))

    def openai(self) -> list[dict[str, Any]]:
        """The request's ``tools``: built-ins (``finish`` last), the agent's functions, MCP tools."""
        out = tools(self.kinds)
        for entry in out:
            if entry["function"]["name"] == "delegate":
                entry["function"]["parameters"] = self._delegate_parameters(entry["function"]["parameters"])
        finish = out.pop()
        out.extend(t.openai() for t in self.agent.user_tools.values())
        for listing in self._listings:
            out.extend(openai_tools(listing))
        out.append(finish)
        return out

    def _delegate_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        schema = copy.deepcopy(parameters)
        properties = schema.get("properties", {})
        if self.agent.sub_agents:
            properties["agent"] = {
                "enum": list(self.agent.sub_agents),
                "description": "Which agent works on the task: "
                + ", ".join(self.agent.sub_agents)
                + " (omitted: one like you).",
            }
        return schema

    def action(self, name: str, arguments: str) -> events.Action:
        """The action the call ``name(arguments)`` asks for; :class:`InputError` says what is wrong."""
        if arguments.startswith(OVERSIZED):
            raise InputError(f"{name} was not run: {arguments.removeprefix(OVERSIZED).rstrip(']')}; call it with less")
        if name in self._builtin:
            if name == "delegate" and self.agent.sub_agents:
                arguments = _agent_as_sub_agent(arguments)
            action = action_from_call(name, arguments, self.kinds)
            asked = action.sub_agent if isinstance(action, events.Delegate) else None
            if isinstance(asked, str) and asked not in self.agent.sub_agents:
                known = ", ".join(self.agent.sub_agents) or "none"
                raise InputError(f"there is no sub-agent {asked!r}; the sub-agents are {known}")
            return action
        user = self.agent.user_tools.get(name)
        mcp = self._mcp.get(name)
        if user is None and mcp is None:
            names = [*self._builtin, *self.agent.user_tools, *self._mcp]
            raise InputError(f"there is no tool {name!r}; the tools are {', '.join(sorted(names))}")
        try:
            raw = _arguments.decode(arguments or "{}")
        except msgspec.DecodeError as exc:
            raise InputError(f"the arguments of {name} are not a JSON object: {exc}") from exc
        if user is not None:
            check_arguments(user, raw)
            return events.ToolCall(tool=name, arguments=raw, runs_in="agent")
        assert mcp is not None
        server, tool, runs_in = mcp
        return events.ToolCall(
            tool=f"{server}.{tool.name}",
            arguments=raw,
            server=server,
            runs_in="agent" if runs_in == "agent" else "runtime",
        )


_MADE: dict[tuple[str, bool, tuple[tuple[str, int], ...]], Toolbox] = {}


def made_toolbox(
    agent: Agent, listed: Mapping[str, events.McpTools] | None = None, *, sub_agents: bool = True
) -> Toolbox:
    """``Toolbox(agent, listed, sub_agents=...)``, made once per definition (its digest), MCP
    listings and ``sub_agents`` (the newest 256 kept): a toolbox keeps its request ``tools``
    (:attr:`Toolbox.offered`) and its last plan (``runs.planned_actions``), which a run's
    steps ask for again and again."""
    key = (agent.digest, sub_agents, tuple(sorted((name, tools.id or 0) for name, tools in (listed or {}).items())))
    made = _MADE.get(key)
    if made is None:
        made = _MADE[key] = Toolbox(agent, listed, sub_agents=sub_agents)
        if len(_MADE) > 256:  # (listings of many sessions: keep the newest)
            _MADE.pop(next(iter(_MADE)))
    return made

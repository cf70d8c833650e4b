"""Which agents a deployment knows: the definitions a worker hosts, and what Redis says of them.

A worker hosts the reference agent and the :class:`~riverbed.agent.define.Agent` objects found
in the modules it is given (``riverbed worker agent --agents mypkg.agents``, repeatable) and
in the entry-point group ``riverbed.agents`` (an entry point names a module, an ``Agent``, or a
list of them).  While it runs it publishes each definition it hosts in the ``agents`` hash
(``keys.agents``: field ``<name>@<digest>``, a JSON description with ``seen``), so that
``riverbed agents``, ``GET /v1/agents`` and anyone opening a run know every name and its digest,
also while no worker hosting it is up.  A run opened on a name takes the digest of the
definition seen most recently (:func:`resolve`).  A module is imported as ``python -m`` would
find it: the worker's current directory is on the path.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any

import msgspec

from riverbed.agent.define import REFERENCE, RULES_VERSION, Agent
from riverbed.bus.keys import Keys
from riverbed.errors import ConfigError, InputError

__all__ = ["ENTRY_POINT_GROUP", "LIVE_SECONDS", "Hosted", "Known", "known_agents", "load", "publish_fields", "resolve"]

ENTRY_POINT_GROUP = "riverbed.agents"
LIVE_SECONDS = 30.0
"""A definition published within this many seconds has a live worker hosting it."""


@dataclass(frozen=True)
class Hosted:
    """The definitions one worker hosts, by name, and where each was found."""

    agents: dict[str, Agent]
    where: dict[str, str]

    def get(self, name: str) -> Agent | None:
        return self.agents.get(name)

    def describe(self) -> list[dict[str, Any]]:
        return [agent.describe(self.where.get(name, "")) for name, agent in sorted(self.agents.items())]


def load(modules: Sequence[str] = (), *, entry_point_group: str | None = ENTRY_POINT_GROUP) -> Hosted:
    """The reference agent, the agents of ``modules`` and of the entry points; :class:`ConfigError`
    (one sentence) for a module that does not import or two definitions of one name."""
    agents: dict[str, Agent] = {REFERENCE.name: REFERENCE}
    where: dict[str, str] = {REFERENCE.name: load_where(REFERENCE)}

    def add(found: Iterable[Agent], origin: str) -> None:
        for agent in found:
            other = agents.get(agent.name)
            if other is not None and other is not agent:
                raise ConfigError(f"two agents are named {agent.name!r}: one in {where[agent.name]}, one in {origin}")
            agents[agent.name] = agent
            where[agent.name] = origin

    if modules and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # (a module of the directory the worker runs in, as `python -m` finds it)
    for name in modules:
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            raise ConfigError(f"the agents module {name!r} does not import: {type(exc).__name__}: {exc}") from exc
        found = _agents_of(module)
        if not found:
            raise ConfigError(f"the module {name!r} defines no riverbed.Agent at its top level")
        add(found, name)
    if entry_point_group is not None:
        for point in entry_points(group=entry_point_group):
            try:
                value = point.load()
            except Exception as exc:
                raise ConfigError(
                    f"the entry point {point.name!r} of {entry_point_group} does not load: {type(exc).__name__}: {exc}"
                ) from exc
            add(_agents_in(value), f"entry point {point.name} ({point.value})")
    return Hosted(agents, where)


def load_where(agent: Agent) -> str:
    return "riverbed (the reference agent)" if agent is REFERENCE else ""


def _agents_of(module: ModuleType) -> list[Agent]:
    return [value for value in vars(module).values() if isinstance(value, Agent)]


def _agents_in(value: Any) -> list[Agent]:
    if isinstance(value, Agent):
        return [value]
    if isinstance(value, ModuleType):
        return _agents_of(value)
    if isinstance(value, list | tuple):
        return [v for v in value if isinstance(v, Agent)]
    return []


class Known(msgspec.Struct, kw_only=True):
    """One definition a deployment knows (one line of ``riverbed agents``)."""

    name: str
    digest: str
    rules: int = RULES_VERSION
    model: str | None = None
    tools: list[str] = msgspec.field(default_factory=list)
    mcp: list[dict[str, Any]] = msgspec.field(default_factory=list)
    sub_agents: list[str] = msgspec.field(default_factory=list)
    limits: dict[str, Any] | None = None
    secrets: list[str] = msgspec.field(default_factory=list)
    """the names of its tenant's secrets its runs may use"""
    where: str = ""
    worker: str | None = None
    """the worker that said so last"""
    seen: float = 0.0
    """when a worker last said it hosts it (unix seconds)"""

    @property
    def live(self) -> bool:
        return time.time() - self.seen < LIVE_SECONDS


def publish_fields(hosted: Hosted, worker: str) -> dict[str, bytes]:
    """The ``agents`` hash fields that say ``worker`` hosts these definitions now."""
    now = time.time()
    out: dict[str, bytes] = {}
    for description in hosted.describe():
        known = msgspec.convert({**description, "worker": worker, "seen": now}, Known)
        out[f"{known.name}@{known.digest}"] = msgspec.json.encode(known)
    return out


async def known_agents(redis: Any, keys: Keys) -> list[Known]:
    """Every definition the deployment's workers published, the most recently seen first."""
    raw = await redis.hgetall(keys.agents)
    out: list[Known] = []
    for value in raw.values():
        try:
            out.append(msgspec.json.decode(value, type=Known))
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
    out.sort(key=lambda k: (-k.seen, k.name))
    return out


def resolve(known: Sequence[Known], name: str) -> Known:
    """The definition a new run of agent ``name`` opens on: the one seen most recently;
    :class:`InputError` naming the known agents when there is none."""
    for k in known:
        if k.name == name:
            return k
    if name == REFERENCE.name:
        return msgspec.convert(REFERENCE.describe(load_where(REFERENCE)), Known)
    names = sorted({k.name for k in known} | {REFERENCE.name})
    raise InputError(f"there is no agent {name!r}; the agents this deployment knows are {', '.join(names)}")

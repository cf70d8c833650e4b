"""``riverbed agent``: the reference LLM agent on one task, its progress shown as the log grows.

::

    ended = await run_agent(settings, redis_url, "s-1", "list the files", on_event=print)

The agent needs the runtime and memory roles (and the condenser when the session's
policy condenses).  Either workers are already running (``riverbed worker all``): the
run checks that a runtime worker is alive and refuses at once otherwise, rather than
waiting for answers that never come; or ``in_process=True`` runs the three roles in this
process for the run, as ``riverbed demo`` does.

Before anything is appended, the model server is checked: no ``OPENAI_API_KEY`` /
``OPENAI_BASE_URL`` is a :class:`ConfigError`, a server that does not answer is an
:class:`UnavailableError`, each one sentence.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import openai
from openai import AsyncOpenAI

from riverbed import events
from riverbed.agent.define import REFERENCE, Agent, RunLimits
from riverbed.agent.hosted import follow_run, open_run
from riverbed.agent.llm import AgentOptions, make_client, render
from riverbed.agent.registry import Hosted
from riverbed.agent.secrets import SecretStore, TenantSecrets
from riverbed.agent.usage import UsageReport, parse_prices, usage
from riverbed.bus.connection import connect_redis
from riverbed.bus.consumer import Owner
from riverbed.bus.status import live_workers
from riverbed.client.session import Bus
from riverbed.errors import ConfigError, InputError, UnavailableError
from riverbed.settings import Settings
from riverbed.workers.agent_role import build_agent_handler, recall_setting
from riverbed.workers.main import Worker, build_handlers

__all__ = [
    "AGENT_SEEN_SECONDS",
    "AgentRun",
    "agent_workers",
    "check_model_server",
    "require_workers",
    "run_agent",
    "run_llm_agent",
]

PROBE_TIMEOUT = 10.0
"""Seconds the model server has to answer the first check."""


@dataclass(frozen=True)
class AgentRun:
    """How a run ended: the event that ended it (``finish``, the agent's ``message``, or an
    ``error`` with reason ``step_limit`` or ``llm_error``) and the run's token usage."""

    session: str
    ended: events.Event | None
    usage: UsageReport

    @property
    def ok(self) -> bool:
        """Finished, asked the user, or stopped at its step limit (a model failure is not ok)."""
        return not (isinstance(self.ended, events.Error) and self.ended.reason != "step_limit")


async def check_model_server(client: AsyncOpenAI, settings: Settings) -> None:
    """Fail in one sentence when the model server cannot be reached or refuses the key.

    ``GET /models`` is the probe; a server that does not offer that route (404) but answers
    is reachable, which is all this checks."""
    where = settings.openai_base_url or "the OpenAI API"
    try:
        with anyio.fail_after(PROBE_TIMEOUT):
            await client.models.list()
    except TimeoutError as exc:
        raise UnavailableError(f"the model server at {where} did not answer within {PROBE_TIMEOUT:g}s") from exc
    except openai.AuthenticationError as exc:
        raise ConfigError(f"the model server at {where} refused the key (OPENAI_API_KEY): {exc.message}") from exc
    except openai.APIConnectionError as exc:
        raise UnavailableError(f"cannot reach the model server at {where} ({exc.message})") from exc
    except openai.APIStatusError:
        return  # it answered: reachable


AGENT_SEEN_SECONDS = 10.0
"""An agent worker whose heartbeat is older than this is not counted on (``bus/status.py``)."""


async def agent_workers(bus: Bus) -> list[str]:
    """The live workers that serve the agent role (a heartbeat within :data:`AGENT_SEEN_SECONDS`)."""
    workers = await live_workers(bus.client, bus.keys, window=AGENT_SEEN_SECONDS)
    return [w.name for w in workers if "agent" in w.description.get("roles", [])]


async def require_workers(bus: Bus, roles: Sequence[str] = ("runtime",)) -> None:
    """:class:`UnavailableError` unless a live worker serves each of ``roles``."""
    workers = await live_workers(bus.client, bus.keys)
    for role in roles:
        if not any(role in w.description.get("roles", []) for w in workers):
            needs = " with a model configured (OPENAI_BASE_URL / OPENAI_API_KEY)" if role == "agent" else ""
            raise UnavailableError(
                f"no {role} worker is running: start workers{needs} (riverbed worker all) or pass --in-process"
            )


async def run_agent(
    settings: Settings,
    redis_url: str,
    session_id: str,
    task: str,
    *,
    max_steps: int = 30,
    in_process: bool = False,
    tenant: str | None = None,
    options: AgentOptions | None = None,
    client: AsyncOpenAI | None = None,
    on_event: Callable[[events.Event], None] | None = None,
    images: Sequence[str] = (),
) -> AgentRun:
    """Run the LLM agent on ``task`` in ``session_id``; ``on_event`` sees every event the
    session's log gets from the run's start on, in order, before this returns."""
    if client is None:
        own = make_client(settings)
        try:
            await check_model_server(own, settings)
            return await run_agent(
                settings, redis_url, session_id, task, max_steps=max_steps, in_process=in_process, tenant=tenant,
                options=options, client=own, on_event=on_event, images=images,
            )  # fmt: skip
        finally:
            with anyio.CancelScope(shield=True):
                await own.close()
    redis = await connect_redis(redis_url)
    bus = Bus(redis, prefix=settings.prefix, url=redis_url)
    closers: list[Callable[[], Any]] = []
    try:
        session = await bus.operate(session_id, tenant=tenant)  # an existing session's own tenant by default
        tenant = session.tenant
        start = await session.last_id() + 1
        async with anyio.create_task_group() as tg:
            if in_process:
                roles = ["runtime", "memory", "condenser"]
                handlers, closers = build_handlers(roles, settings)
                worker = Worker(
                    redis, settings, roles, name=f"agent-{uuid.uuid4().hex[:6]}", handlers=handlers, url=redis_url
                )
                await tg.start(worker.run)
            else:
                await require_workers(bus)
            shown = _Follower(bus, session_id, start, on_event)
            if on_event is not None:
                tg.start_soon(shown.run)
            ended = await run_llm_agent(
                bus, session_id, task, settings=settings, client=client, max_steps=max_steps, options=options,
                tenant=tenant, images=images,
            )  # fmt: skip
            if on_event is not None:
                await shown.until(await session.last_id())
            shown.scope.cancel()
            if in_process:
                worker.stop()
        log_events = await session.events(start)
    finally:
        with anyio.CancelScope(shield=True):
            for close in closers:
                await close()
            await redis.aclose()
    return AgentRun(session=session_id, ended=ended, usage=usage(log_events, parse_prices(settings.prices)))


class _Follower:
    """Tails the log and hands each event to ``on_event``; :meth:`until` waits for an id."""

    def __init__(self, bus: Bus, session_id: str, start: int, on_event: Callable[[events.Event], None] | None) -> None:
        self.session = bus.session(session_id)
        self.start = start
        self.on_event = on_event
        self.seen = start - 1
        self.moved = anyio.Event()
        self.scope = anyio.CancelScope()

    async def run(self) -> None:
        with self.scope:
            async for event in self.session.log(self.start, follow=True):
                if self.on_event is not None:
                    self.on_event(event)
                self.seen = event.id or self.seen
                self.moved.set()
                self.moved = anyio.Event()

    async def until(self, last_id: int, timeout: float = 10.0) -> None:
        with anyio.move_on_after(timeout):
            while self.seen < last_id:
                await self.moved.wait()


# --- one run, served by the agent role in this process ------------------------------------


async def run_llm_agent(
    bus: Bus,
    session_id: str,
    task: str,
    *,
    settings: Settings,
    client: AsyncOpenAI | None = None,
    max_steps: int = 30,
    options: AgentOptions | None = None,
    tenant: str | None = None,
    images: Sequence[str] = (),
    agent: Agent | None = None,
    secrets: Sequence[str] = (),
) -> events.Event | None:
    """Work on ``task`` (with ``images``: URLs or workspace paths) in session ``session_id``
    until ``finish``, an LLM failure, a limit or ``max_steps`` model calls; returns the event
    that ended the run.

    It is a run like any other (the task message and ``run_started``, then the agent role's
    moves), served by the agent role's own step in this process while it is open: the rules,
    the log it writes and what a crash costs are the role's.  ``agent`` is the definition
    (None: the reference agent; ``options.instructions`` add to its prompt); ``secrets`` names
    the tenant's secrets the run may use besides the agent's own."""
    if max_steps < 1:
        raise InputError("max_steps must be at least 1")
    if client is not None:
        return await _serve(bus, session_id, task, settings, client, max_steps, options, tenant, images, agent, secrets)
    own = make_client(settings)  # made here, closed here
    try:
        return await _serve(bus, session_id, task, settings, own, max_steps, options, tenant, images, agent, secrets)
    finally:
        with anyio.CancelScope(shield=True):
            await own.close()


def _definition(options: AgentOptions, agent: Agent | None) -> Agent:
    if agent is not None:
        return agent
    if options.name == REFERENCE.name and not options.instructions:
        return REFERENCE
    prompt = render("system.j2", agent=options.name, instructions=options.instructions)
    return Agent(options.name, prompt, tools=REFERENCE.tools)


async def _serve(
    bus: Bus,
    session_id: str,
    task: str,
    settings: Settings,
    client: AsyncOpenAI,
    max_steps: int,
    options: AgentOptions | None,
    tenant: str | None,
    images: Sequence[str],
    agent: Agent | None,
    secrets: Sequence[str],
) -> events.Event | None:
    options = (options or AgentOptions()).resolved(settings)
    definition = _definition(options, agent)
    handler = build_agent_handler(
        settings,
        client=client,
        pace=None,  # (one run)
        hosted=Hosted({definition.name: definition}, {definition.name: "this process"}),
        action_timeout=options.action_timeout,
        context_recalls=recall_setting(settings, default=True),  # (in a process that runs the memory role)
        recall_timeout=options.recall_timeout,
        only_session=session_id,
    )
    limits = RunLimits(
        max_steps=max_steps,
        max_output_tokens=options.max_output_tokens,
        temperature=options.temperature,
        llm_timeout=options.llm_timeout,
    )
    masks = TenantSecrets(SecretStore(bus.client, bus.keys, settings.secrets_key)) if settings.secrets_key else None
    handler.secrets = masks
    owner = Owner(
        bus.redis,
        bus.keys,
        handler,
        worker=f"agent-{uuid.uuid4().hex[:8]}",
        url=bus.url,
        capacity=4,
        lease_seconds=settings.lease_seconds,
        masks=masks,
    )
    ended: events.Event | None = None
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        try:
            opened = await open_run(
                bus, session_id, task, limits=limits, tenant=tenant, agent=definition, images=images, secrets=secrets
            )
            async for event in follow_run(bus, session_id, opened.task):
                ended = event
        finally:
            with anyio.CancelScope(shield=True):
                await owner.drain(5)
            tg.cancel_scope.cancel()
    return ended

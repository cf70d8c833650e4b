"""Runs handed to the agent role: open one, cancel it, follow it, list them.

::

    async with riverbed.connect() as bus:
        opened = await open_run(bus, "s-42", "Fix the failing test", limits=RunLimits(max_steps=20))
        async for event in follow_run(bus, "s-42", opened.opened):   # until the run ends
            ...
        await cancel_run(bus, "s-42")
        for row in await list_runs(bus, state="running"):
            ...

A run is two events on the session's log, appended in one write: the task as the user's
``message`` and a ``run_started`` holding the limits and model.  That append announces the
session to the agent role (``bus/scripts.py``), which works on the run from then on; the
caller may go away.  Whether a run is open is read from the log (:mod:`riverbed.agent.runs`).
``riverbed runs`` reads the summaries the agent role keeps (``keys.run``), and folds the log
of a run that no agent worker has picked up yet.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec

from riverbed import events
from riverbed.agent.define import RULES_VERSION, Agent, RunLimits
from riverbed.agent.quotas import Quotas
from riverbed.agent.registry import known_agents, resolve
from riverbed.agent.runs import RunFold, RunState, RunSummary, fold_runs, saved_summary, summarize
from riverbed.agent.usage import Price
from riverbed.client.session import Bus
from riverbed.errors import InputError

__all__ = [
    "STATES",
    "OpenedRun",
    "RunLimits",
    "RunRow",
    "cancel_run",
    "follow_run",
    "list_runs",
    "open_run",
    "upgrade_run",
]

STATES: tuple[RunState, ...] = ("running", "finished", "failed", "cancelled")


@dataclass(frozen=True)
class OpenedRun:
    session: str
    task: int
    """the id of the task's ``message``"""
    opened: int
    """the id of the ``run_started``"""


class RunRow(msgspec.Struct, kw_only=True):
    """One line of ``riverbed runs``."""

    session: str
    tenant: str | None
    state: str
    steps: int
    tokens: int
    cost: float | None
    worker: str | None
    age: float
    """seconds since the run opened"""
    reason: str | None = None
    started_at: float = 0.0
    """when it opened (unix seconds)"""
    model: str | None = None
    parent: str | None = None
    """the session a sub-agent's run works for"""
    children: list[str] = msgspec.field(default_factory=list)
    """the sessions of the run's sub-agents"""
    agent: str = "llm"
    """the hosted agent that works on it"""
    detail: str = ""
    """how it ended, or what an open run waits for (a worker that hosts its agent's definition)"""


async def _fold(bus: Bus, session: str, prices: dict[str, Price] | None = None) -> RunFold:
    return fold_runs([e async for e in bus.log_store.read(session, 1)], prices)


async def open_run(
    bus: Bus,
    session_id: str,
    task: str,
    *,
    limits: RunLimits | None = None,
    tenant: str | None = None,
    agent: str | Agent | None = None,
    images: Sequence[str] = (),
) -> OpenedRun:
    """Record a run on the log (task message + ``run_started``) and return at once.

    ``agent`` names the hosted agent that works on it (a name the deployment knows, or an
    :class:`~riverbed.agent.define.Agent`; None: the reference agent); the run records its
    definition's digest and the run rules' version, and without ``limits`` opens with the
    agent's own.  :class:`InputError` when the session has a run open already, the task is
    empty or the agent is unknown (the sentence names the known ones);
    :class:`~riverbed.errors.QuotaExceeded` when the session's tenant is at a quota
    (:mod:`riverbed.agent.quotas`)."""
    if not task.strip():
        raise InputError("the task is empty: say what the agent should do")
    chosen: dict[str, Any] = {}
    if isinstance(agent, Agent):
        chosen = {"agent_name": agent.name, "digest": agent.digest, "rules": RULES_VERSION}
        limits = limits or agent.limits
    elif agent is not None:
        known = resolve(await known_agents(bus.client, bus.keys), agent)
        chosen = {"agent_name": known.name, "digest": known.digest, "rules": known.rules}
        if limits is None and known.limits:
            limits = msgspec.convert(known.limits, RunLimits)
    limits = limits or RunLimits()
    session = await bus.operate(session_id, tenant=tenant)
    fold = await _fold(bus, session_id)
    if fold.run is not None and fold.run.open:
        raise InputError(
            f"session {session_id} has a run open already (event {fold.run.opened}): wait for it to end, "
            f"or cancel it with `riverbed agent {session_id} --cancel`"
        )
    started = events.RunStarted(
        model=limits.model,
        max_steps=limits.max_steps,
        max_tokens=limits.max_tokens,
        max_cost=limits.max_cost,
        max_output_tokens=limits.max_output_tokens,
        temperature=limits.temperature,
        llm_timeout=limits.llm_timeout,
        **chosen,
    )
    quotas = Quotas(bus.log_store) if session.tenant is not None else None
    if quotas is not None and session.tenant is not None:
        await quotas.admit(session.tenant, session_id)
    try:
        # expected_last: two callers opening a run at once cannot both succeed.
        message = events.Message(content=task, source="user", images=list(images)) if images else None
        task_id, opened = await session.append(
            message or events.Message(content=task, source="user"), started, expected_last=fold.last
        )
    except BaseException:
        if quotas is not None and session.tenant is not None:
            with anyio.CancelScope(shield=True):
                # Slots are per session: one that a racing open's run now holds is not given back.
                now = await _fold(bus, session_id)
                if now.run is None or not now.run.open:
                    await quotas.release(session.tenant, session_id)
        raise
    async with bus.client.pipeline() as pipe:  # (the agent role adds it too, when it picks the run up)
        pipe.zadd(bus.keys.runs, {session_id: time.time()}, nx=True)
        await pipe.execute()
    return OpenedRun(session_id, task_id, opened)


async def cancel_run(bus: Bus, session_id: str, *, note: str = "", tenant: str | None = None) -> int:
    """Ask the agent role to end the session's open run; returns the ``run_cancel``'s id.
    :class:`InputError` when no run is open."""
    fold = await _fold(bus, session_id)
    if fold.run is None or not fold.run.open:
        raise InputError(f"session {session_id} has no open run to cancel")
    session = await bus.operate(session_id, tenant=tenant)
    (cancel_id,) = await session.append(events.RunCancel(note=note))
    return cancel_id


async def upgrade_run(bus: Bus, session_id: str, *, tenant: str | None = None) -> int:
    """Let the session's open run continue on the definition of its agent seen most recently
    and the current run rules (``run_upgraded``); returns the event's id.  :class:`InputError`
    when no run is open, or when it runs on that definition already."""
    fold = await _fold(bus, session_id)
    run = fold.run
    if run is None or not run.open:
        raise InputError(f"session {session_id} has no open run to upgrade")
    known = resolve(await known_agents(bus.client, bus.keys), run.agent_name)
    if known.digest == run.digest and known.rules == run.rules:
        raise InputError(
            f"the run of {session_id} runs on agent {run.agent_name} at digest {known.digest} already: "
            "there is nothing to upgrade to"
        )
    session = await bus.operate(session_id, tenant=tenant)
    upgraded = events.RunUpgraded(digest=known.digest, rules=known.rules, previous=run.digest)
    (upgrade_id,) = await session.append(upgraded)
    return upgrade_id


async def follow_run(bus: Bus, session_id: str, start: int) -> AsyncIterator[events.Event]:
    """The session's events from ``start`` on, as they are appended, until a run ends at or
    after ``start`` (the run open then, or the next one); the ending event is the last yielded."""
    fold = RunFold()
    async for event in bus.session(session_id).log(1, follow=True):
        fold.add(event)
        if event.id is not None and event.id >= start:
            yield event
            run = fold.run
            if run is not None and run.ended is not None and run.ended >= start:
                return


async def list_runs(
    bus: Bus,
    *,
    state: str | None = None,
    tenant: str | None = None,
    prices: dict[str, Price] | None = None,
    sessions: list[str] | None = None,
) -> list[RunRow]:
    """The sessions' latest runs, newest first (filtered by ``state`` and ``tenant``; only
    those of ``sessions`` when it is given)."""
    if state is not None and state not in STATES:
        raise InputError(f"unknown run state {state!r}: use {', '.join(STATES)}")
    if sessions is None and tenant is not None and await bus.client.hget(bus.keys.tenant_index, "done") is not None:
        sessions = await _tenant_runs(bus, tenant)  # (every session is in its tenant's index)
    elif sessions is None:
        sessions = [s.decode() for s, _score in reversed(await bus.client.zrange_scores(bus.keys.runs))]
    async with bus.client.pipeline() as pipe:
        replies = [pipe.get(bus.keys.run(s)) for s in sessions]
        await pipe.execute()
    summaries = [reply.value for reply in replies]
    now = time.time()
    rows: list[RunRow] = []
    for session, raw in zip(sessions, summaries, strict=True):
        summary = saved_summary(raw)
        if summary is None:  # no agent worker has picked the run up yet: its log says where it is
            fold = await _fold(bus, session, prices)
            if fold.run is None:
                continue
            summary = summarize(session, fold.run, parent=fold.delegated.parent if fold.delegated else None)
        row = _row(summary, now)
        if (state is None or row.state == state) and (tenant is None or row.tenant == tenant):
            rows.append(row)
    return rows


_CHUNK = 1000
"""Sessions whose run scores one command reads."""


async def _tenant_runs(bus: Bus, tenant: str) -> list[str]:
    """The sessions with a run among ``tenant``'s (its index of sessions), newest run first: what
    one tenant's list costs does not grow with the other tenants' runs."""
    names = [name.decode() for name in await bus.client.zrange(bus.keys.tenant_sessions(tenant))]
    scored: list[tuple[float, str]] = []
    for begin in range(0, len(names), _CHUNK):
        part = names[begin : begin + _CHUNK]
        scores = await bus.client.zmscore(bus.keys.runs, part)
        scored.extend((score, name) for name, score in zip(part, scores, strict=True) if score is not None)
    scored.sort(reverse=True)
    return [name for _score, name in scored]


def _row(summary: RunSummary, now: float) -> RunRow:
    return RunRow(
        session=summary.session,
        tenant=summary.tenant,
        state=summary.state,
        steps=summary.steps,
        tokens=summary.tokens,
        cost=summary.cost,
        worker=summary.worker,
        age=max(0.0, now - summary.opened_at),
        reason=summary.reason,
        started_at=summary.opened_at,
        model=summary.model,
        parent=summary.parent,
        children=summary.children,
        agent=summary.agent,
        detail=summary.detail,
    )

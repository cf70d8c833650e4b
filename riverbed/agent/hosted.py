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
``riverbed runs`` pages through the index of runs (:mod:`riverbed.agent.run_index`), reads
the summaries the agent role keeps (``keys.run``), and folds the log of a run that no agent
worker has picked up yet.  An open run that no live agent worker holds is ``waiting``, not
``running``.

A run no agent worker has taken yet is cancelled here at once: the ``run_cancel`` and, right
after it, the ``error`` (reason ``cancelled``) the agent role would write, under the same
idempotency key, so a worker that takes the session meanwhile writes nothing twice; its
tenant's run slot is given back in the same call.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from dataclasses import replace as dataclass_replace
from typing import Any

import anyio
import msgspec

from riverbed import events
from riverbed.agent import run_index
from riverbed.agent.define import RULES_VERSION, Agent, RunLimits, check_policy
from riverbed.agent.quotas import Quotas
from riverbed.agent.registry import known_agents, resolve
from riverbed.agent.run_index import DEFAULT_RETENTION, Candidate
from riverbed.agent.runs import PendingCall, RunFold, RunSummary, fold_runs, summarize
from riverbed.agent.secrets import SecretStore, check_name
from riverbed.agent.usage import Price, unpriced
from riverbed.bus.keys import AGENT_ROLE
from riverbed.client.session import Bus
from riverbed.errors import AlreadyAnswered, AppendConflict, InputError
from riverbed.settings import Settings

__all__ = [
    "STATES",
    "OpenedRun",
    "RunLimits",
    "RunPage",
    "RunRow",
    "cancel_run",
    "follow_run",
    "list_runs",
    "open_run",
    "page_runs",
    "upgrade_run",
]

STATES = ("running", "waiting", "finished", "failed", "cancelled")
"""What ``riverbed runs`` says of a run: ``waiting`` is an open run no agent worker holds now."""
OPEN_STATES = ("running", "waiting")
AGENT_NAME = "llm"
"""The ``agent`` of what the agent role appends (a queued run's end is written as it would be)."""
MAX_PAGE = 200
"""The most runs one page holds."""


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
    awaiting: list[PendingCall] = msgspec.field(default_factory=list)
    """its calls that wait for a person's approval"""
    paused: bool = False


@dataclass(frozen=True)
class RunPage:
    """One page of runs, newest first, and the cursor of the next (None: the last page)."""

    rows: list[RunRow] = field(default_factory=list)
    next_cursor: str | None = None


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
    confirm: str | Sequence[str] | None = None,
    default_model: str | None = None,
    prices: dict[str, Price] | None = None,
    secrets: Sequence[str] = (),
) -> OpenedRun:
    """Record a run on the log (task message + ``run_started``) and return at once.

    ``agent`` names the hosted agent that works on it (a name the deployment knows, or an
    :class:`~riverbed.agent.define.Agent`; None: the reference agent); the run records its
    definition's digest and the run rules' version, and without ``limits`` opens with the
    agent's own.  :class:`InputError` when the session has a run open already, the task is
    empty or the agent is unknown (the sentence names the known ones).  ``confirm`` is the run's
    approval policy (``never``, ``always``, ``risky`` or tool names; None: the agent's);
    :class:`~riverbed.errors.QuotaExceeded` when the session's tenant is at a quota
    (:mod:`riverbed.agent.quotas`); :class:`InputError` too when the run asks for a model that is
    not its tenant's to use, or for a ``max_cost`` that ``prices`` cannot bound (a model without a
    price).  ``default_model``: the model a run that names none gets (default
    ``RIVERBED_LLM_MODEL``).  ``secrets`` names the tenant's secrets the run may use besides its
    agent's own; :class:`InputError` when the session's tenant has no secret under one of
    either (another tenant's gets the same answer), or the session has no tenant."""
    if not task.strip():
        raise InputError("the task is empty: say what the agent should do")
    chosen: dict[str, Any] = {}
    agent_model: str | None = None
    named = [check_name(name) for name in secrets]
    if isinstance(agent, Agent):
        chosen = {"agent_name": agent.name, "digest": agent.digest, "rules": RULES_VERSION}
        limits, agent_model = limits or agent.limits, agent.model
        named += agent.secrets
    elif agent is not None:
        known = resolve(await known_agents(bus.client, bus.keys), agent)
        chosen = {"agent_name": known.name, "digest": known.digest, "rules": known.rules}
        agent_model = known.model
        named += known.secrets
        if limits is None and known.limits:
            limits = msgspec.convert(known.limits, RunLimits)
    limits = limits or RunLimits()
    if limits.model is None and agent_model is not None:  # (the agent's model: the one quotas and prices see)
        limits = dataclass_replace(limits, model=agent_model)
    if confirm is not None:
        check_policy(confirm, "the run")
        chosen["confirm"] = confirm if isinstance(confirm, str) else list(confirm)
    if default_model is None:
        default_model = str(Settings.one("llm_model"))
    if limits.max_cost is not None and prices is not None:
        refused = unpriced(limits.model or default_model, prices)
        if refused is not None:
            raise InputError(f"no run opens: {refused}")
    session = await bus.operate(session_id, tenant=tenant)
    if named:
        chosen["secrets"] = sorted(set(named))
        await _check_secrets(bus, session.tenant, chosen["secrets"])
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
        await quotas.admit(session.tenant, session_id, model=limits.model, default_model=default_model)
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
    async with bus.client.pipeline() as pipe:  # (the agent role indexes it too, with each summary)
        run_index.queue_opened(pipe, bus.keys, session_id, time.time(), session.tenant, chosen.get("agent_name"))
        await pipe.execute()
    return OpenedRun(session_id, task_id, opened)


async def _check_secrets(bus: Bus, tenant: str | None, names: list[str]) -> None:
    """:class:`InputError` unless ``tenant`` has a secret under each of ``names``."""
    if tenant is None:
        raise InputError(
            f"no run opens: secrets belong to a tenant and this session has none, so {names[0]} cannot be used "
            "(open the run with a tenant's key, or --tenant)"
        )
    missing = await SecretStore(bus.client, bus.keys, None).missing(tenant, names)
    if missing:
        raise InputError(
            f"no run opens: no secret {missing[0]} for this tenant "
            f"(`riverbed secrets set {tenant} {missing[0]}` stores one)"
        )


async def cancel_run(bus: Bus, session_id: str, *, note: str = "", tenant: str | None = None) -> int:
    """Ask the agent role to end the session's open run; returns the ``run_cancel``'s id.
    A run that no agent worker holds is ended here and now, and its tenant's run slot given
    back.  :class:`InputError` when no run is open."""
    fold = await _fold(bus, session_id)
    run = fold.run
    if run is None or not run.open:
        raise InputError(f"session {session_id} has no open run to cancel")
    session = await bus.operate(session_id, tenant=tenant)
    (cancel_id,) = await session.append(events.RunCancel(note=note))
    if not await _held(bus, session_id):
        await _end_queued(bus, session_id, fold, cancel_id)
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


async def pause_run(
    bus: Bus, session_id: str, *, resume: bool = False, note: str = "", tenant: str | None = None
) -> int:
    """Pause the session's open run (``run_paused``), or resume it (``run_resumed``); returns
    the event's id.  :class:`InputError` when no run is open, or it is paused (resumed) already."""
    fold = await _fold(bus, session_id)
    run = fold.run
    if run is None or not run.open:
        raise InputError(f"session {session_id} has no open run to {'resume' if resume else 'pause'}")
    if resume and run.paused is None:
        raise InputError(f"the run of {session_id} is not paused")
    if not resume and run.paused is not None:
        raise InputError(f"the run of {session_id} is paused already (event {run.paused})")
    session = await bus.operate(session_id, tenant=tenant)
    event: events.Event = events.RunResumed(note=note) if resume else events.RunPaused(note=note)
    (event_id,) = await session.append(event)  # (a second pause or resume at once changes nothing)
    return event_id


async def decide(
    bus: Bus,
    session_id: str,
    actions: Sequence[int] = (),
    *,
    approve: bool = True,
    reason: str = "",
    by: str = "",
    tenant: str | None = None,
) -> tuple[int, list[int]]:
    """Approve (or reject) calls of the session's open run that wait for a person: ``actions``,
    or every one that waits when none are named.  Returns the ``approval``'s id and the calls
    it decided.  :class:`~riverbed.errors.AlreadyAnswered` for a call answered already (or
    decided), :class:`InputError` for one that does not wait for approval.  Appended onto the log
    as read (a decision made meanwhile is read, and checked, again)."""
    for _ in range(5):
        try:
            return await _decide(bus, session_id, actions, approve, reason, by, tenant)
        except AppendConflict:
            continue
    return await _decide(bus, session_id, actions, approve, reason, by, tenant)


async def _decide(
    bus: Bus,
    session_id: str,
    actions: Sequence[int],
    approve: bool,
    reason: str,
    by: str,
    tenant: str | None,
) -> tuple[int, list[int]]:
    fold = await _fold(bus, session_id)
    run = fold.run
    awaiting = {a.id: a for a in run.awaiting()} if run is not None and run.open else {}
    chosen = list(dict.fromkeys(actions)) or sorted(i for i in awaiting if i is not None)
    if not chosen:
        raise InputError(f"no call of session {session_id} waits for approval")
    for action in chosen:
        if action in awaiting:
            continue
        if run is not None and (action in run.answered or action in run.approved or action in run.refused_by_person):
            raise AlreadyAnswered(action, 0, f"action {action} of session {session_id} is answered or decided already")
        raise InputError(f"action {action} of session {session_id} does not wait for approval")
    session = await bus.operate(session_id, tenant=tenant)
    approval = events.Approval(actions=chosen, decision="approve" if approve else "reject", reason=reason, by=by)
    (approval_id,) = await session.append(approval, expected_last=fold.last)
    return approval_id, chosen


async def _held(bus: Bus, session_id: str) -> bool:
    """Whether a live agent worker holds the session now."""
    holder, expires = await bus.client.hmget(
        bus.keys.meta(session_id), [f"holder:{AGENT_ROLE}", f"expires:{AGENT_ROLE}"]
    )
    return bool(holder) and float(expires or 0) > await bus.client.time() * 1000


async def _end_queued(bus: Bus, session_id: str, fold: RunFold, cancel_id: int) -> None:
    """End a run no agent worker holds, as the agent role would: its ``error`` right after the
    ``run_cancel`` (only there: anything else between means a worker is at it), under the key the
    role ends a run with; then its summary, its index entry and its tenant's slot."""
    run = fold.run
    assert run is not None
    tenant = run.tenant
    content = f"the run was cancelled (event {cancel_id})"  # (the agent role's words)
    error = events.Error(
        source="agent", content=content, reason="cancelled", retryable=False, agent=AGENT_NAME, tenant=tenant
    )
    try:
        await bus.log_store.append(
            session_id, [error], expected_last=cancel_id, idempotency_key=f"run-{run.opened}-end", tenant=tenant
        )
    except AppendConflict:
        return  # a worker took the session meanwhile: it ends the run
    ended = await _fold(bus, session_id)
    if ended.run is None or ended.run.open:
        return
    parent = ended.delegated.parent if ended.delegated else None
    summary = summarize(session_id, ended.run, parent=parent)
    await bus.client.send(run_index.summary_writes(bus.keys, summary))
    if tenant is not None:
        await Quotas(bus.log_store).release(tenant, session_id)


async def awaiting_approval(bus: Bus, *, tenant: str | None = None) -> list[tuple[RunRow, PendingCall]]:
    """The calls that wait for a person's approval in the open runs (``tenant``'s only when
    given), oldest first, with their run.  A run that waits only for people is let go by its
    worker, so it lists as ``waiting``; one with other work as ``running``."""
    rows = [row for state in ("running", "waiting") for row in await list_runs(bus, state=state, tenant=tenant)]
    pending = [(row, call) for row in rows for call in row.awaiting]
    pending.sort(key=lambda pair: pair[1].since)
    return pending


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
    agent: str | None = None,
    prices: dict[str, Price] | None = None,
    sessions: list[str] | None = None,
    retention: float = DEFAULT_RETENTION,
) -> list[RunRow]:
    """Every listed run, newest first (filtered by ``state``, ``tenant`` and ``agent``; only
    those of ``sessions`` when it is given): :func:`page_runs`, page after page."""
    if sessions is not None:
        entries = [(session, 0.0) for session in sessions]
        return await _rows(bus, await run_index.candidates(bus.client, bus.keys, entries), prices)
    rows: list[RunRow] = []
    cursor: str | None = None
    while True:
        page = await page_runs(
            bus, state=state, tenant=tenant, agent=agent, prices=prices, limit=MAX_PAGE, cursor=cursor,
            retention=retention,
        )  # fmt: skip
        rows.extend(page.rows)
        if page.next_cursor is None:
            return rows
        cursor = page.next_cursor


async def page_runs(
    bus: Bus,
    *,
    state: str | None = None,
    tenant: str | None = None,
    agent: str | None = None,
    prices: dict[str, Price] | None = None,
    limit: int = 50,
    cursor: str | None = None,
    retention: float = DEFAULT_RETENTION,
) -> RunPage:
    """One page of runs, newest first, after ``cursor`` (:mod:`riverbed.agent.run_index`); the
    ended runs older than ``retention`` seconds are trimmed from the index first (a bounded few)."""
    if state is not None and state not in STATES:
        raise InputError(f"unknown run state {state!r}: use {', '.join(STATES)}")
    if not 1 <= limit <= MAX_PAGE:
        raise InputError(f"the page size must be from 1 to {MAX_PAGE}, not {limit}")
    keys = bus.keys
    await run_index.trim(bus.client, keys, retention)
    if state in OPEN_STATES:
        source = keys.runs_open
    elif tenant is not None:
        source = keys.tenant_runs(tenant)
    else:
        source = keys.runs

    def keep(candidate: Candidate) -> bool:
        summary = candidate.summary
        if agent is not None and candidate.agent != agent:
            return False
        if summary is None:  # not picked up yet: open, and its tenant is read from its log below
            return state is None or state == ("running" if candidate.held else "waiting")
        if tenant is not None and summary.tenant != tenant:
            return False
        return state is None or _state(summary, candidate.held) == state

    found = await run_index.scan(bus.client, keys, source, limit=limit, cursor=cursor, keep=keep)
    rows = await _rows(bus, found.kept, prices)
    if tenant is not None:
        rows = [row for row in rows if row.tenant == tenant]
    return RunPage(rows, found.next_cursor)


def _state(summary: RunSummary, held: bool) -> str:
    if summary.state == "running" and not held:
        return "waiting"
    return summary.state


async def _rows(bus: Bus, candidates: list[Candidate], prices: dict[str, Price] | None) -> list[RunRow]:
    now = time.time()
    rows: list[RunRow] = []
    for candidate in candidates:
        summary = candidate.summary
        if summary is None:  # no agent worker has picked the run up yet: its log says where it is
            fold = await _fold(bus, candidate.session, prices)
            if fold.run is None:
                continue
            summary = summarize(candidate.session, fold.run, parent=fold.delegated.parent if fold.delegated else None)
        row = _row(summary, now)
        if row.state == "running" and not candidate.held:
            row.state, row.worker = "waiting", None
        rows.append(row)
    return rows


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
        awaiting=summary.awaiting,
        paused=summary.paused,
    )

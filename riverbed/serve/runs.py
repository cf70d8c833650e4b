"""The ``/v1`` routes of runs: open one on a session, list them, cancel one.

A run opened here is the same two events ``riverbed agent --detach`` appends (the task as the
user's ``message``, then ``run_started`` with the limits), under the session's tenant; the
agent role serves it from then on, and its progress is the session's event stream.  The
session rules are the other routes' (:mod:`riverbed.serve.routes`): another tenant's session
answers 404 like one that does not exist, and opening a run on a free id creates the session
for the key's tenant.  ``GET /v1/runs`` pages through the runs ``riverbed runs`` lists, only the
key's tenant's (an admin key: every tenant's, or one named with ``?tenant=``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from riverbed.agent.hosted import (
    MAX_PAGE,
    STATES,
    RunLimits,
    RunRow,
    awaiting_approval,
    cancel_run,
    decide,
    list_runs,
    open_run,
    page_runs,
    pause_run,
)
from riverbed.agent.registry import known_agents
from riverbed.agent.usage import parse_prices
from riverbed.errors import InputError
from riverbed.events import MAX_RUN_STEPS, Confirm, SecretName
from riverbed.serve.routes import _api, _body_as, _int_param, _json, _session_tenant, bounded, principal

__all__ = ["agents", "approvals", "cancel", "decide_calls", "handlers", "list_all", "pause", "start"]

MAX_TASK_CHARS = 100_000


class _RunBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    task: Annotated[str, msgspec.Meta(max_length=MAX_TASK_CHARS)]
    max_steps: Annotated[int, msgspec.Meta(ge=1, le=MAX_RUN_STEPS)] = 30
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_cost: Annotated[float, msgspec.Meta(gt=0, le=1_000_000)] | None = None
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None
    agent: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None
    confirm: Confirm | None = None
    secrets: Annotated[list[SecretName], msgspec.Meta(max_length=100)] = msgspec.field(default_factory=list)


class _DecisionBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    decision: Literal["approve", "reject"]
    actions: Annotated[list[Annotated[int, msgspec.Meta(ge=1)]], msgspec.Meta(max_length=1000)] = msgspec.field(
        default_factory=list
    )
    reason: Annotated[str, msgspec.Meta(max_length=4000)] = ""


class _CancelBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    note: Annotated[str, msgspec.Meta(max_length=2000)] = ""


_RUN_SHAPE = (
    '{"task": "...", "max_steps": N, "max_tokens": N, "max_cost": USD, "model": "...", "agent": "...", '
    '"confirm": ..., "secrets": ["NAME", ...]}'
)


def run_document(row: RunRow) -> dict[str, Any]:
    """A run as the API shows it (``GET /v1/runs`` and the answer to opening one)."""
    return {
        "session": row.session,
        "tenant": row.tenant,
        "state": row.state,
        "reason": row.reason,
        "steps": row.steps,
        "tokens": row.tokens,
        "cost": row.cost,
        "model": row.model,
        "worker": row.worker,
        "started_at": row.started_at,
        "age": round(row.age, 3),
        "parent": row.parent,
        "children": row.children,
        "agent": row.agent,
        "detail": row.detail if row.state in ("running", "waiting") else "",
        "paused": row.paused,
        "awaiting": len(row.awaiting),
    }


@bounded
async def start(request: Request) -> Response:
    """Open a run on the session (202): the task message and ``run_started``, for the agent role."""
    who = await principal(request)
    api = _api(request)
    session = request.path_params["session"]
    tenant = await _session_tenant(api, who, session, create=True)
    body = await _body_as(request, _RunBody, f"the run body must be {_RUN_SHAPE} with only task required")
    limits = RunLimits(model=body.model, max_steps=body.max_steps, max_tokens=body.max_tokens, max_cost=body.max_cost)
    opened = await open_run(
        api.bus,
        session,
        body.task,
        limits=limits,
        tenant=tenant,
        default_model=api.config.llm_model,
        prices=parse_prices(api.config.prices),
        agent=body.agent,
        confirm=body.confirm,
        secrets=body.secrets,
    )
    rows = await list_runs(api.bus, sessions=[session], prices=parse_prices(api.config.prices))
    run = run_document(rows[0]) if rows else {"session": session, "tenant": tenant, "state": "running"}
    limits_doc = {"max_steps": body.max_steps, "max_tokens": body.max_tokens, "max_cost": body.max_cost}
    return _json({**run, "task": opened.task, "opened": opened.opened, **limits_doc}, status=202)


@bounded
async def list_all(request: Request) -> Response:
    """One page of the runs of the key's tenant (an admin key: every tenant's, or ``?tenant=``),
    newest first: ``state``, ``agent``, ``limit`` (default 50) and ``cursor`` (the last page's
    ``next_cursor``)."""
    who = await principal(request)
    api = _api(request)
    params = request.query_params
    state = params.get("state") or None
    if state is not None and state not in STATES:
        raise InputError(f"the state parameter must be one of {', '.join(STATES)}, not {state[:40]!r}")
    named = params.get("tenant") or None
    if who.admin:
        tenant = named
    else:
        if named is not None and named != who.tenant:
            raise InputError("a tenant's key lists only its own tenant's runs: leave out the tenant parameter")
        tenant = who.tenant
    limit = _int_param(request, "limit") or 50
    if limit > MAX_PAGE:
        raise InputError(f"the limit parameter must be at most {MAX_PAGE}, not {limit}")
    page = await page_runs(
        api.bus,
        state=state,
        tenant=tenant,
        agent=params.get("agent") or None,
        prices=parse_prices(api.config.prices),
        limit=limit,
        cursor=params.get("cursor") or None,
        retention=api.config.runs_retention,
    )
    rows = page.rows if who.admin else [row for row in page.rows if who.may_see(row.tenant)]
    return _json({"runs": [run_document(row) for row in rows], "next_cursor": page.next_cursor})


@bounded
async def cancel(request: Request) -> Response:
    """Ask the agent role to end the session's open run (202): one ``run_cancel``."""
    who = await principal(request)
    api = _api(request)
    session = request.path_params["session"]
    tenant = await _session_tenant(api, who, session)
    note = ""
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > 16_384:
            raise InputError("the cancel body is over 16 KiB: send at most a note")
    if raw.strip():
        try:
            note = msgspec.json.decode(raw, type=_CancelBody).note
        except msgspec.DecodeError as exc:
            raise InputError(f'the cancel body must be empty or {{"note": "..."}} ({exc})') from exc
    cancel_id = await cancel_run(api.bus, session, note=note, tenant=tenant)
    return _json({"session": session, "cancel": cancel_id}, status=202)


@bounded
async def approvals(request: Request) -> Response:
    """The calls that wait for a person's approval in the key's tenant's runs (an admin key:
    every tenant's, or ``?tenant=``), oldest first."""
    who = await principal(request)
    api = _api(request)
    tenant = request.query_params.get("tenant") or None if who.admin else who.tenant
    pending = [
        {"session": row.session, "tenant": row.tenant, **msgspec.to_builtins(call)}
        for row, call in await awaiting_approval(api.bus, tenant=tenant)
        if who.may_see(row.tenant)
    ]
    return _json({"approvals": pending})


@bounded
async def decide_calls(request: Request) -> Response:
    """Approve or reject calls of the session's open run that wait for a person (201): one
    ``approval``; ``actions`` empty: every call that waits.  409 for a call answered or decided
    already, 400 for one that does not wait."""
    who = await principal(request)
    api = _api(request)
    session = request.path_params["session"]
    tenant = await _session_tenant(api, who, session)
    body = await _body_as(
        request, _DecisionBody, 'the body must be {"decision": "approve" | "reject", "actions": [ids], "reason": "..."}'
    )
    approval, decided = await decide(
        api.bus,
        session,
        body.actions,
        approve=body.decision == "approve",
        reason=body.reason,
        by=f"key:{who.key_id}",
        tenant=tenant,
    )
    return _json({"session": session, "approval": approval, "actions": decided}, status=201)


@bounded
async def pause(request: Request) -> Response:
    """Pause (``/pause``) or resume (``/resume``) the session's open run (202)."""
    who = await principal(request)
    api = _api(request)
    session = request.path_params["session"]
    tenant = await _session_tenant(api, who, session)
    resume = request.url.path.endswith("/resume")
    event = await pause_run(api.bus, session, resume=resume, tenant=tenant)
    return _json({"session": session, "resumed" if resume else "paused": event}, status=202)


@bounded
async def agents(request: Request) -> Response:
    """The agents the deployment knows (``riverbed agents``): name, digest, tools, MCP servers,
    where each is defined and whether a live worker hosts it."""
    await principal(request)
    api = _api(request)
    known = await known_agents(api.bus.client, api.bus.keys)
    return _json({"agents": [{**msgspec.to_builtins(k), "live": k.live} for k in known]})


def handlers() -> list[tuple[str, Any, list[str]]]:
    """(path, handler, methods) of the runs routes."""
    return [
        ("/v1/sessions/{session}/runs", start, ["POST"]),
        ("/v1/sessions/{session}/runs/cancel", cancel, ["POST"]),
        ("/v1/runs", list_all, ["GET"]),
        ("/v1/agents", agents, ["GET"]),
        ("/v1/approvals", approvals, ["GET"]),
        ("/v1/sessions/{session}/approvals", decide_calls, ["POST"]),
        ("/v1/sessions/{session}/runs/pause", pause, ["POST"]),
        ("/v1/sessions/{session}/runs/resume", pause, ["POST"]),
    ]

"""The ``/v1`` routes: each checks the key, then the session's tenant, then does one thing.

Handlers are thin: the log, the View fold, fork and the backlog statistics live in the
packages that own them.  Every route that names a session answers 404 alike for a session
that does not exist and for one of another tenant, so a key learns nothing about other
tenants' sessions.  Appends through the API set ``tenant`` on every event to the session's
tenant (for a new session: the key's), whatever the client sent, and take only what a
client may write (``events.check_client``: no ``forked``, no role's observation), from an
admin key too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import msgspec
import structlog
from anyio.abc import TaskStatus
from msgspec.structs import replace
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from riverbed import events
from riverbed.agent import run_index
from riverbed.agent.replay import fork
from riverbed.agent.runs import is_child_id
from riverbed.agent.usage import parse_prices
from riverbed.agent.usage import usage as usage_report
from riverbed.bus import status as bus_status
from riverbed.bus.keys import ROLES, require_session
from riverbed.client.session import Bus
from riverbed.errors import InputError, NotFoundError, UnavailableError
from riverbed.serve.auth import KeyStore, Principal, valid_tenant
from riverbed.serve.follow import Followers
from riverbed.serve.limits import RateLimit, Slots, Streams
from riverbed.serve.sessions import (
    STATUSES,
    Tenants,
    index_older_sessions,
    page_sessions,
    session_infos,
    session_names,
)
from riverbed.serve.sse import EventStream
from riverbed.settings import DEFAULT_MAX_EVENTS_PER_APPEND, Settings

if TYPE_CHECKING:
    from riverbed.memory.recall import Memory

__all__ = ["Api", "ServeConfig", "handlers"]

log = structlog.get_logger("riverbed.serve")

MAX_QUERY_CHARS = 2000
MAX_HITS = 50


@dataclass(frozen=True)
class ServeConfig:
    """Bounds of the HTTP API."""

    max_body_bytes: int = 8 * 1024 * 1024
    """The largest request body accepted (413 above it)."""
    request_timeout: float = 30.0
    """A request other than ``act`` and an event stream must be answered within this (504)."""
    act_timeout: float = 30.0
    """The ``act`` timeout when the request names none."""
    max_act_timeout: float = 300.0
    """The longest ``act`` wait a request may ask for."""
    heartbeat_seconds: float = 15.0
    """An event stream sends a comment line after this long without an event."""
    prices: str | None = None
    """The price table of ``/usage`` (``RIVERBED_PRICES``'s JSON form); none: no costs."""
    max_events_per_append: int = DEFAULT_MAX_EVENTS_PER_APPEND
    """The most events one append may carry (413 above it)."""
    max_streams_per_key: int = 500
    """Event streams one key may hold open on this process (429 above it)."""
    max_acts_per_key: int = 100
    """Acts of one key waiting for their answer on this process at once (429 above it)."""
    rate: float = 50.0
    """Requests a second per key, over every process of the prefix (0: no limit; 429 above it)."""
    burst: int = 200
    """Requests a key may make at once above ``rate``."""
    max_streams_per_tenant: int = 1000
    """Event streams all keys of one tenant may hold open on this process (429 above it)."""
    max_acts_per_tenant: int = 200
    """Acts of all keys of one tenant waiting for their answer on this process at once (429 above it)."""
    tenant_rate: float = 100.0
    """Requests a second per tenant, over all its keys and every process (0: no limit; 429 above it)."""
    tenant_burst: int = 400
    """Requests a tenant may make at once above ``tenant_rate``."""
    runs_retention: float = 7 * 24 * 3600.0
    """Seconds an ended run stays in the list of runs (``RIVERBED_RUNS_RETENTION``)."""
    llm_model: str | None = None
    """The model a run that names none gets, a tenant's only one without an allow-list (None:
    ``RIVERBED_LLM_MODEL``)."""
    secrets_key: str | None = field(default=None, repr=False)
    """The key tenants' secrets are encrypted under (``RIVERBED_SECRETS_KEY``; None: the
    ``/v1/secrets`` routes answer 503)."""

    @classmethod
    def from_settings(cls, settings: Settings) -> ServeConfig:
        """The bounds ``riverbed serve`` takes from the environment."""
        return cls(
            # A body holds at least one event of RIVERBED_MAX_EVENT_BYTES (JSON is larger than msgpack).
            max_body_bytes=max(cls.max_body_bytes, 2 * settings.max_event_bytes),
            prices=settings.prices,
            max_events_per_append=settings.max_events_per_append,
            max_streams_per_key=settings.serve_max_streams_per_key,
            max_acts_per_key=settings.serve_max_acts_per_key,
            rate=settings.serve_rate,
            burst=settings.serve_burst,
            max_streams_per_tenant=settings.serve_max_streams_per_tenant,
            max_acts_per_tenant=settings.serve_max_acts_per_tenant,
            tenant_rate=settings.serve_tenant_rate,
            tenant_burst=settings.serve_tenant_burst,
            runs_retention=settings.runs_retention,
            llm_model=settings.llm_model,
            secrets_key=settings.secrets_key,
        )


class Api:
    """What the handlers share: the bus, the key store, the tenants of sessions, and the
    memory store that recall searches read (None: recall search answers 503)."""

    def __init__(self, bus: Bus, config: ServeConfig | None = None, *, memory: Memory | None = None) -> None:
        self.bus = bus
        self.config = config or ServeConfig()
        self.memory = memory
        self.keys = KeyStore(bus.client, bus.keys)
        self.tenants = Tenants(bus)
        config = self.config
        self.rate = RateLimit(
            bus.client,
            bus.keys,
            rate=config.rate,
            burst=config.burst,
            tenant_rate=config.tenant_rate,
            tenant_burst=config.tenant_burst,
        )
        self.streams = Streams(self.keys, most=config.max_streams_per_tenant, per_key=config.max_streams_per_key)
        self.acts = Slots(
            "acts waiting for their answer",
            "RIVERBED_SERVE_MAX_ACTS",
            most=config.max_acts_per_tenant,
            per_key=config.max_acts_per_key,
        )
        self.followers = Followers(bus.log_store, bus.client)
        self.stopping = anyio.Event()
        """Set when the server starts shutting down: event streams end then."""

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """What the handlers need running: the followed sessions' readers and the revocation check
        (and, once per prefix, the sessions older than the tenant indexes indexed)."""
        if indexed := await index_older_sessions(self.bus):
            log.info("serve.tenant_indexes_built", sessions=indexed)
        if indexed := await run_index.backfill(self.bus.client, self.bus.keys):
            log.info("serve.run_indexes_built", runs=indexed)
        async with anyio.create_task_group() as tg:
            await tg.start(self.followers.run)
            await tg.start(self.streams.run)
            task_status.started()


Handler = Callable[[Request], Awaitable[Response]]


def _api(request: Request) -> Api:
    api: Api = request.app.state.api
    return api


def _json(value: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status_code=status, media_type="application/json")


async def principal(request: Request) -> Principal:
    """The key's principal; 401 when the key is missing, malformed, unknown or revoked."""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise HTTPException(
            401,
            "this API needs a key: send 'Authorization: Bearer <key>' (riverbed keys create --tenant T)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    api = _api(request)
    who = await api.keys.check(key.strip())
    if who is None:
        raise HTTPException(
            401, "the API key is not valid or was revoked; ask for a new one", headers={"WWW-Authenticate": "Bearer"}
        )
    await api.rate.take(who)
    return who


async def _session_tenant(api: Api, who: Principal, session: str, *, create: bool = False) -> str | None:
    """The tenant of ``session`` when the key may use it (404 otherwise); with ``create``, a
    session that does not exist yet is the key's tenant's."""
    require_session(session)
    exists, tenant = await api.tenants.of(session)
    if exists and who.may_see(tenant):
        return tenant
    if not exists and create:
        if who.tenant is None:
            raise InputError(f"an admin key without a tenant cannot create session {session!r}; use a tenant's key")
        _not_a_child_id(session)
        return who.tenant
    raise NotFoundError(f"no session {session!r} is visible to this key")


async def _visible_session(request: Request) -> tuple[Api, str, str | None]:
    """The API, the session the path names and its tenant, for a key that may use the session
    (401 without a valid key, 404 when the session is not visible to it)."""
    who = await principal(request)
    api = _api(request)
    session = request.path_params["session"]
    return api, session, await _session_tenant(api, who, session)


def _not_a_child_id(session: str) -> None:
    """Refuse to create a session whose id is a sub-agent's (``<parent>.sub<N>``): the agent role
    makes those, and a client that took one first would make its parent's delegate fail."""
    if is_child_id(session):
        raise InputError(
            f"session ids ending in .sub<N>, like {session!r}, are made by the agent role for sub-agents; "
            "choose another id"
        )


_DIGITS = re.compile(r"[0-9]{1,19}")
MAX_ID = 2**63 - 1
"""The largest event id a parameter may name (a stream entry id is 64 bits)."""


def _whole_number(raw: str, what: str, *, minimum: int) -> int:
    """``raw`` as a whole number of ASCII digits from ``minimum`` to :data:`MAX_ID`, else 400."""
    if not _DIGITS.fullmatch(raw):
        shown = raw if len(raw) <= 40 else raw[:40] + "…"
        raise InputError(f"{what} must be a whole number, not {shown!r}")
    value = int(raw)
    if not minimum <= value <= MAX_ID:
        raise InputError(f"{what} must be from {minimum} to {MAX_ID}, not {value}")
    return value


def _int_param(request: Request, name: str, *, minimum: int = 1) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    return _whole_number(raw, f"the {name} parameter", minimum=minimum)


async def _body(request: Request) -> bytes:
    """The request body, refused (413) above the configured size."""
    limit = _api(request).config.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"the request body is {int(declared):,} bytes, over the limit of {limit:,}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"the request body is over the limit of {limit:,} bytes")
        chunks.append(chunk)
    if not size:
        raise InputError("the request needs a JSON body")
    body = b"".join(chunks)
    request.state.body_digest = hashlib.sha256(body).hexdigest()  # what an Idempotency-Key is bound to
    return body


_Body = TypeVar("_Body", bound=msgspec.Struct)


async def _body_as(request: Request, shape: type[_Body], must: str) -> _Body:
    """The request's JSON body decoded as ``shape``; 400 saying what it ``must`` be when it is not."""
    try:
        return msgspec.json.decode(await _body(request), type=shape)
    except msgspec.DecodeError as exc:
        raise InputError(f"{must} ({exc})") from exc


def _within_append_limit(api: Api, batch: list[events.Event]) -> None:
    """413 for more events than one append may carry (one append is one Redis call)."""
    most = api.config.max_events_per_append
    if len(batch) > most:
        raise HTTPException(
            413,
            f"one append may carry at most {most:,} events (RIVERBED_MAX_EVENTS_PER_APPEND), not {len(batch):,}; "
            "send them in several requests",
        )


def bounded(handler: Handler) -> Handler:
    """Answer within the configured request timeout (504 otherwise)."""

    async def run(request: Request) -> Response:
        seconds = _api(request).config.request_timeout
        with anyio.move_on_after(seconds) as scope:
            return await handler(request)
        assert scope.cancelled_caught
        raise HTTPException(504, f"the request took longer than {seconds:g}s; try again, or ask for less")

    run.__name__ = handler.__name__
    run.__doc__ = handler.__doc__
    return run


# --- routes -------------------------------------------------------------------------------


@bounded
async def whoami(request: Request) -> Response:
    """The key's tenant and whether it is an admin key."""
    who = await principal(request)
    return _json({"key_id": who.key_id, "tenant": who.tenant, "admin": who.admin})


MAX_PAGE = 200
"""The most sessions one page of the session list may hold."""


@bounded
async def list_sessions(request: Request) -> Response:
    """The sessions the key may see: tenant, last id, last event time, owner and lag per role.
    With ``tenant``, ``status``, ``q`` (part of the id), ``limit`` or ``offset``: one page of the
    matching sessions, newest first, each with its status and task; without any: every session,
    oldest first (their status is not read: it takes the newest events of each)."""
    who = await principal(request)
    bus = _api(request).bus
    params = request.query_params
    tenant = params.get("tenant", "").strip() or None
    wanted = params.get("status", "").strip() or None
    if wanted is not None and wanted not in STATUSES:
        raise InputError(f"unknown session status {wanted!r}: use {', '.join(STATUSES)}")
    search = params.get("q", "").strip()
    limit = _int_param(request, "limit")
    offset = _int_param(request, "offset", minimum=0)
    if limit is not None and limit > MAX_PAGE:
        raise InputError(f"the limit parameter must be at most {MAX_PAGE}, not {limit}")
    if tenant is not None:
        valid_tenant(tenant)
    if tenant is not None and (who.admin or tenant == who.tenant):
        names = [n.decode() for n in await bus.client.zrange(bus.keys.tenant_sessions(tenant))]
    elif tenant is not None:
        names = []  # another tenant's sessions are not this key's to list
    else:
        names = await session_names(bus, who.tenant, admin=who.admin)
    if tenant is None and wanted is None and not search and limit is None and offset is None:
        infos = await session_infos(bus, names, visible=who.may_see)
        return _json({"sessions": [info.as_dict() for info in infos]})
    page = await page_sessions(
        bus,
        names,
        visible=lambda owner: who.may_see(owner) and (tenant is None or owner == tenant),
        search=search,
        wanted=wanted,
        offset=offset or 0,
        limit=limit or 50,
    )
    return _json(
        {
            "sessions": [info.as_dict() for info in page.sessions],
            "offset": page.offset,
            "next_offset": page.next_offset,
            "total": page.total,
        }
    )


@bounded
async def append(request: Request) -> Response:
    """Append one event or a JSON array of events (``expected_last``, ``Idempotency-Key``)."""
    who = await principal(request)
    api = _api(request)
    session = request.path_params["session"]
    expected_last = _int_param(request, "expected_last", minimum=0)
    # An append that expects events creates nothing: to it a free id is as missing as another tenant's.
    tenant = await _session_tenant(api, who, session, create=expected_last in (None, 0))
    batch = [replace(e, tenant=tenant) for e in events.events_from_json(await _body(request))]
    _within_append_limit(api, batch)
    for event in batch:
        events.check_client(event)
    key = request.headers.get("idempotency-key")
    ids = await api.bus.session(session, tenant=tenant).append(
        *batch, expected_last=expected_last, idempotency_key=key, idempotency_digest=request.state.body_digest
    )
    return _json({"session": session, "ids": ids}, status=201)


async def act(request: Request) -> Response:
    """Append one action and answer with its observation (504 when none comes in time); with an
    ``Idempotency-Key``, a repeat of the request appends nothing and answers with the first's
    action's observation (409 for the key sent with another body)."""
    api = _api(request)
    timeout = _timeout(request, api.config)
    with anyio.move_on_after(timeout + api.config.request_timeout) as scope:
        return await _act(request, api, timeout)
    assert scope.cancelled_caught
    raise HTTPException(504, f"the act request took longer than {timeout + api.config.request_timeout:g}s")


async def _act(request: Request, api: Api, timeout: float) -> Response:
    who = await principal(request)
    slot = api.acts.take(who)
    try:
        return await _act_as(request, api, who, timeout)
    finally:
        slot.release()


async def _act_as(request: Request, api: Api, who: Principal, timeout: float) -> Response:
    session = request.path_params["session"]
    tenant = await _session_tenant(api, who, session, create=True)
    action = events.from_json(await _body(request))
    if not isinstance(action, events.Action):
        raise InputError(f"{action.kind!r} is not an action (see `riverbed schema`); POST it to /events instead")
    events.check_client(action)
    answer = await api.bus.session(session, tenant=tenant).act(
        replace(action, tenant=tenant),
        timeout=timeout,
        idempotency_key=request.headers.get("idempotency-key"),
        idempotency_digest=request.state.body_digest,
    )
    return Response(events.encode_json(answer), media_type="application/json")


def _timeout(request: Request, config: ServeConfig) -> float:
    raw = request.query_params.get("timeout")
    if raw is None or raw == "":
        return config.act_timeout
    try:
        value = float(raw)
    except ValueError:
        raise InputError(f"the timeout parameter must be a number of seconds, not {raw!r}") from None
    if not (0 < value <= config.max_act_timeout and math.isfinite(value)):
        raise InputError(f"the timeout parameter must be greater than 0 and at most {config.max_act_timeout:g} seconds")
    return value


async def read_events(request: Request) -> Response:
    """The log as JSON lines, or with ``Accept: text/event-stream`` live as SSE."""
    who = await principal(request)
    api = _api(request)
    session = request.path_params["session"]
    start = _int_param(request, "from") or 1
    until = _int_param(request, "until")
    if until is not None and until < start:
        raise InputError(f"until ({until}) must not be before from ({start})")
    with anyio.fail_after(api.config.request_timeout):
        await _session_tenant(api, who, session)
    if "text/event-stream" in request.headers.get("accept", ""):
        last_seen = request.headers.get("last-event-id", "").strip()
        if last_seen:
            start = _whole_number(last_seen, "Last-Event-ID (an event id)", minimum=0) + 1
        slot = api.streams.take(who)
        return _Raw(
            EventStream(
                api.followers,
                session,
                start,
                until,
                heartbeat=api.config.heartbeat_seconds,
                stopping=api.stopping,
                revoked=slot.revoked,
                done=slot.release,
            )
        )

    async def lines() -> AsyncIterator[bytes]:
        async for event in api.bus.log_store.read(session, start, until):
            yield events.encode_json(event) + b"\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


class _Raw(Response):
    """A response that is an ASGI callable of its own (the event stream)."""

    def __init__(self, app: EventStream) -> None:
        super().__init__()
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


@bounded
async def view(request: Request) -> Response:
    """The condensed view as the agent saw it right after event ``until``."""
    from riverbed.memory.view import view as fold  # noqa: PLC0415  (memory is optional for clients)

    api, session, _tenant = await _visible_session(request)
    until = _int_param(request, "until")
    folded = fold([e async for e in api.bus.log_store.read(session, 1, until)], until=until)
    body = {
        "session": session,
        "until": until,
        "last_id": folded.last_id,
        "summary_index": folded.summary_index,
        "events": [msgspec.Raw(events.encode_json(e)) for e in folded.events],
    }
    return _json(body)


@bounded
async def context(request: Request) -> Response:
    """The context right after event ``until``: visible ids, hidden ones and what hid each,
    pinned ones, the summary."""
    from riverbed.memory.context import document  # noqa: PLC0415  (memory is optional for clients)

    api, session, _tenant = await _visible_session(request)
    until = _int_param(request, "until")
    return _json({**document(session, await api.bus.session(session).context.show(until)), "until": until})


class _EditBody(msgspec.Struct, forbid_unknown_fields=True):
    op: str
    ranges: list[tuple[int, int]] = []
    kinds: list[str] = []
    note: str | None = None
    dry_run: bool = False


_OPS = ("forget", "restore", "pin", "unpin")


@bounded
async def edit_context(request: Request) -> Response:
    """Append one ``context_edit`` and answer with what it changed; with ``dry_run`` answer
    with what it would change, appending nothing."""
    api, session, tenant = await _visible_session(request)
    body = await _body_as(
        request,
        _EditBody,
        'the context body must be {"op": "forget", "ranges": [[A, B]], "kinds": [...], "note": "..."}',
    )
    if body.op not in _OPS:
        raise InputError(f"unknown context operation {body.op!r}: use {', '.join(_OPS)}")
    handle = api.bus.session(session, tenant=tenant).context
    op: Any = body.op
    if body.dry_run:
        changed = await handle.preview(op, ranges=body.ranges, kinds=body.kinds, note=body.note)
    else:
        changed = await handle.edit(op, ranges=body.ranges, kinds=body.kinds, note=body.note)
    return _json(
        {"session": session, "dry_run": body.dry_run, **msgspec.to_builtins(changed)}, 200 if body.dry_run else 201
    )


@bounded
async def usage(request: Request) -> Response:
    """Prompt, cached and completion tokens and cost of every model call, and the totals."""
    api, session, _tenant = await _visible_session(request)
    report = usage_report(await api.bus.session(session).events(), parse_prices(api.config.prices))
    return _json({"session": session, **msgspec.to_builtins(report)})


@bounded
async def recall(request: Request) -> Response:
    """Search the session's indexed events (by meaning and by words, fused), each hit with why
    it matched; appends nothing
    (a ``recall`` action would write into the session it searches)."""
    api, session, tenant = await _visible_session(request)
    query = request.query_params.get("q", "").strip()
    if not query:
        raise InputError("the q parameter (what to search for) is missing")
    if len(query) > MAX_QUERY_CHARS:
        raise InputError(f"the q parameter is {len(query):,} characters, over the limit of {MAX_QUERY_CHARS:,}")
    k = _int_param(request, "k") or 10
    if k > MAX_HITS:
        raise InputError(f"the k parameter must be at most {MAX_HITS}, not {k}")
    if api.memory is None:
        raise UnavailableError(
            "recall search needs the memory database: set RIVERBED_DATABASE_URL to the Postgres the memory workers use"
        )
    await api.memory.store.start()  # (once; migrations run with the first)
    matches = await api.memory.search_explained(
        query, session=session, tenant=tenant, k=k, timeout=api.config.request_timeout * 0.8
    )
    return _json({"session": session, "query": query, "hits": [match.as_dict() for match in matches]})


class _ForkBody(msgspec.Struct, forbid_unknown_fields=True):
    at: int
    into: str
    workspace: events.WorkspaceMethod = "replay"
    """how the fork's sandbox is built: replay (re-run 1..at), copy (the source's files now), empty"""


@bounded
async def fork_session(request: Request) -> Response:
    """Copy events 1..``at`` into the new session ``into`` (the source's tenant), then ``forked``."""
    api, session, _tenant = await _visible_session(request)
    body = await _body_as(
        request, _ForkBody, 'the fork body must be {"at": N, "into": "new-session", "workspace": "replay|copy|empty"}'
    )
    require_session(body.into)
    _not_a_child_id(body.into)
    forked = await fork(api.bus, session, body.at, body.into, workspace=body.workspace)
    return _json({"session": body.into, "source": session, "at": body.at, "forked": forked}, status=201)


@bounded
async def status(request: Request) -> Response:
    """Roles, lag, pending and dead letters: every session for an admin key, the tenant's otherwise."""
    who = await principal(request)
    bus = _api(request).bus
    if who.admin:
        snapshot = await bus_status.status(bus.client, bus.keys)
        return _json(dataclasses.asdict(snapshot))
    names = await session_names(bus, who.tenant, admin=False)
    mine = [info.session for info in await session_infos(bus, names, visible=who.may_see, roles=(), describe=False)]
    roles = [await bus_status.role_backlog(bus.client, bus.keys, role, mine) for role in ROLES]
    body: dict[str, Any] = {
        "sessions": len(mine),
        "roles": [
            {"role": r.role, "lag": r.lag, "pending": r.pending, "oldest_pending_seconds": r.oldest_pending_seconds}
            for r in roles
        ],
        "workers": len(await bus_status.live_workers(bus.client, bus.keys)),
    }
    return _json(body)


def handlers() -> list[tuple[str, Handler | Callable[..., Any], list[str]]]:
    """(path, handler, methods) of every ``/v1`` route."""
    return [
        ("/v1/me", whoami, ["GET"]),
        ("/v1/sessions", list_sessions, ["GET"]),
        ("/v1/sessions/{session}/events", append, ["POST"]),
        ("/v1/sessions/{session}/events", read_events, ["GET"]),
        ("/v1/sessions/{session}/act", act, ["POST"]),
        ("/v1/sessions/{session}/view", view, ["GET"]),
        ("/v1/sessions/{session}/fork", fork_session, ["POST"]),
        ("/v1/sessions/{session}/context", context, ["GET"]),
        ("/v1/sessions/{session}/context", edit_context, ["POST"]),
        ("/v1/sessions/{session}/usage", usage, ["GET"]),
        ("/v1/sessions/{session}/recall", recall, ["GET"]),
        ("/v1/status", status, ["GET"]),
    ]

"""The client API: connect to the bus, append actions, await observations, replay.

::

    async with riverbed.connect() as bus:
        session = bus.session("s-42", tenant="acme")
        obs = await session.act(CmdRun(command="ls"), timeout=30)
        async for event in session.log(start=1):
            ...
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import redis.exceptions as rexc
from msgspec.structs import replace

from riverbed import events, tracing
from riverbed.bus import status
from riverbed.bus.connection import RawClient, connect_redis
from riverbed.bus.exchange import stream_entries
from riverbed.bus.keys import PAYLOAD_FIELD, Keys
from riverbed.bus.log import PAGE, Log, answered_cause, decode_entry, entry_id
from riverbed.bus.redis_client import RedisClient, StreamEntry
from riverbed.bus.wakeups import Bell
from riverbed.client.answers import Answers
from riverbed.errors import ActTimeout, AlreadyAnswered, InputError, NotFoundError, UnavailableError
from riverbed.extras import needs_extra
from riverbed.settings import DEFAULT_MAX_EVENT_BYTES, DEFAULT_MAX_EVENTS_PER_APPEND, Settings

if TYPE_CHECKING:
    from riverbed.bus.archive import Archive
    from riverbed.client.context import ContextControl

__all__ = ["Bus", "Session", "connect", "resolve_redis_url"]


def resolve_redis_url(settings: Settings, *, progress: Callable[[str], None] | None = None) -> str:
    """The Redis URL from settings, or the embedded services (started on demand; ``progress``
    hears about it when they have to be started)."""
    if settings.redis_url:
        return settings.redis_url
    from riverbed import services  # noqa: PLC0415  (embedded services only when no URL is set)

    directory = Path(settings.services_dir)
    running = services.load(directory)
    if running is None:
        if progress is not None:
            progress(f"RIVERBED_REDIS_URL is not set: starting the embedded services in {directory}")
        running = services.up(directory)
    elif progress is not None:
        progress(f"RIVERBED_REDIS_URL is not set: using the embedded services already running in {directory}")
    return running.redis_url


class Session:
    """A handle on one session's log; the log is created by the first append.

    The first append fixes the session's tenant (the handle's, or none): every later append
    must come from a handle with the same tenant, else :class:`TenantMismatch` and nothing is
    appended.  An event may carry a tenant itself only when it is the handle's.

    A handle acting for a tenant is a client: it appends only what clients may
    (:func:`riverbed.events.check_client`: actions, messages, settings, context edits, an
    agent's own errors), else :class:`~riverbed.errors.SystemEventRefused`.  What only
    riverbed writes (``forked``, ``sandbox_rebuilt``, a role's observations) goes through the
    log itself (``bus.log_store.append``), as roles, ``fork()`` and import do.
    """

    def __init__(self, bus: Bus, session_id: str, *, tenant: str | None = None, agent: str | None = None) -> None:
        bus.log_store.check_session(session_id)
        self.bus = bus
        self.id = session_id
        self.tenant = tenant
        self.agent = agent
        self.trace = tracing.new_trace()
        """The handle's own trace, used when no OpenTelemetry span is active."""

    def stamp(self, event: events.Event) -> events.Event:
        """The event with this handle's agent, tenant and trace filled in where it has none."""
        changes: dict[str, Any] = {}
        if self.tenant is not None and event.tenant is None:
            changes["tenant"] = self.tenant
        if self.agent is not None and event.agent is None:
            changes["agent"] = self.agent
        if event.trace is None:
            changes["trace"] = tracing.child_of(tracing.current() or self.trace)
        return replace(event, **changes) if changes else event

    async def append(
        self,
        *batch: events.Event,
        expected_last: int | None = None,
        idempotency_key: str | None = None,
        idempotency_digest: str | None = None,
    ) -> list[int]:
        """Append events in one round trip; returns their ids.

        ``expected_last``: refuse (:class:`AppendConflict`) unless the log's last id is this;
        ``idempotency_key``: a retry with the same key returns the first ids and appends nothing;
        ``idempotency_digest`` binds the key to one request (a hash of it): the key used again with
        another digest raises :class:`IdempotencyKeyReused`.  One call carries at most
        ``RIVERBED_MAX_EVENTS_PER_APPEND`` events (one Redis call each: a bigger one would hold
        Redis up for every other session).  Every event is checked first
        (:func:`riverbed.events.check`: the schema's bounds, nesting, size, reserved environment
        names): a bad one appends nothing of the batch and raises :class:`InputError`; a second
        answer to an action raises :class:`AlreadyAnswered`.
        A handle acting for a tenant refuses events only riverbed writes (:class:`SystemEventRefused`).
        """
        most = self.bus.max_events_per_append
        if len(batch) > most:
            raise InputError(
                f"one append may carry at most {most:,} events (RIVERBED_MAX_EVENTS_PER_APPEND), not "
                f"{len(batch):,}; append them in several calls"
            )
        stamped = [self.stamp(e) if isinstance(e, events.Event) else e for e in batch]
        if self.tenant is not None:
            for event in stamped:
                if isinstance(event, events.Event):  # (anything else is refused by the check below)
                    events.check_client(event)
        payloads = [(self.bus.check(e), answered_cause(e)) for e in stamped]
        result = await self.bus.log_store.append_raw(
            self.id,
            payloads,
            expected_last=expected_last,
            idempotency_key=idempotency_key,
            tenant=self._tenant_of(stamped),
            digest=idempotency_digest,
        )
        if isinstance(result, AlreadyAnswered):
            raise result
        return result

    async def act(
        self,
        action: events.Action,
        *,
        timeout: float = 30.0,
        idempotency_key: str | None = None,
        idempotency_digest: str | None = None,
    ) -> events.Event:
        """Append ``action`` and wait for the event that answers it (``cause`` = its id).

        A kind nothing answers (``message``, ``think``, ``finish``) returns at once: the
        action itself, carrying its new id.  ``idempotency_key`` (and ``idempotency_digest``) as
        :meth:`append` takes them: the same key again appends nothing and waits for the first
        action's answer (the answer it had, when it has one).
        """
        if not isinstance(action, events.Action):
            raise InputError(f"act() takes an action, not a {type(action).__name__} event")
        if not (timeout > 0 and math.isfinite(timeout)):
            raise InputError(f"the act timeout must be a finite number of seconds greater than 0, not {timeout}")
        if idempotency_key is not None:
            return await self._act_once(action, timeout, idempotency_key, idempotency_digest)
        stamped = self.stamp(action)
        if self.tenant is not None:
            events.check_client(stamped)
        payload = self.bus.check(stamped)
        if type(action).answered_by is None:
            (action_id,) = await self.append(stamped)
            return events.with_id(stamped, action_id)
        started = time.monotonic()  # (the event loop's clock, without asking which loop runs)
        tenant = self._tenant_of([stamped])
        answers = self.bus.answers
        await self.bus.log_store.append_script.load()  # (at once when loaded: nothing comes between
        # the look at the pool and the exchange taking a connection from it)
        if answers is not None and answers.crowded():
            return await self._act_crowded(answers, payload, tenant, timeout)
        ids, after = await self.bus.log_store.append_then_read(
            self.id, [(payload, 0)], block_ms=max(1, min(int(timeout * 1000), 1000)), tenant=tenant
        )
        action_id = ids[0]
        answer = _answer_among(after, action_id)
        if answer is not None:
            return answer
        # Its answer can only come after it, so tailing the log from what was read sees the
        # answer: no lookup first.
        cursor = after[-1][0] if after else action_id
        waited = time.monotonic() - started
        return await self._answer(action_id, timeout, look_up=False, cursor=cursor, waited=waited)

    async def _act_once(self, action: events.Action, timeout: float, key: str, digest: str | None) -> events.Event:
        """:meth:`act` under an idempotency key: the append is made once, and a repeat waits for
        the answer of the action the first made."""
        started = time.monotonic()
        (action_id,) = await self.append(action, idempotency_key=key, idempotency_digest=digest)
        if type(action).answered_by is None:
            async for event in self.bus.log_store.read(self.id, action_id, action_id):
                return event
            return events.with_id(self.stamp(action), action_id)
        return await self._answer(action_id, timeout, look_up=True, waited=time.monotonic() - started)

    async def _act_crowded(self, answers: Answers, payload: bytes, tenant: str | None, timeout: float) -> events.Event:
        """:meth:`act` when every connection is taken: the append goes in a batch, and the
        wait is on the session's wake-ups (:mod:`riverbed.client.answers`)."""
        started = time.monotonic()
        log_store = self.bus.log_store
        async with answers.watch(self.id) as bell:
            mark = bell.rung  # before the append: its answer's wake-up cannot be missed
            prepared = log_store.prepare(self.id, [(payload, 0)], tenant=tenant)
            try:
                reply = await answers.call(prepared.command)
            except (rexc.NoScriptError, UnavailableError):
                ids = await prepared.run()  # loads the script, or retries under the same idempotency key
            else:
                ids = await prepared.outcome(reply)
            assert not isinstance(ids, AlreadyAnswered)  # an action answers nothing
            action_id = ids[0]
            waited = time.monotonic() - started
            with anyio.move_on_after(max(timeout - waited, 0.0)):
                return await self._hear(answers, bell, action_id, action_id, mark, read=False)
        raise self._timed_out(action_id, timeout)

    async def _hear(
        self, answers: Answers, bell: Bell, action_id: int, cursor: int, mark: int, *, read: bool
    ) -> events.Event:
        """The answer to ``action_id``, reading the log after ``cursor`` whenever ``bell`` says
        it moved past it (and once a second when it says nothing); ``read``: read first."""
        log_key = self.bus.keys.log(self.id)
        rang = True
        while True:
            if read:
                mark = bell.rung
                command = ("XREAD", "COUNT", PAGE, "STREAMS", log_key, f"{cursor}-0")
                try:
                    entries = stream_entries(await answers.call(command))
                except UnavailableError:
                    entries = await self.bus.client.xread(log_key, f"{cursor}-0", count=PAGE)  # with retries
                answer, last = _answer_in(entries, action_id)
                if answer is not None:
                    return answer
                if last is not None:
                    cursor = last
                elif not rang and await self._last_id(answers) < action_id:
                    raise self._lost(action_id)
            rang = await bell.wait(mark, 1.0)
            # A wake-up whose news is not past what was read is this act's own append, or an
            # answer already read: nothing to read for it.
            read = not rang or bell.news is None or bell.news > cursor
            if not read:
                mark = bell.rung

    async def _last_id(self, answers: Answers) -> int:
        """:meth:`last_id` in a batch (a crowded client has no connection to spare for it)."""
        try:
            last = await answers.call(("HGET", self.bus.keys.meta(self.id), "last"))
        except UnavailableError:
            return await self.last_id()  # with retries
        return int(last or 0)

    def _lost(self, action_id: int) -> NotFoundError:
        return NotFoundError(
            f"action {action_id} of session {self.id!r} is no longer in its log: Redis lost "
            "the session's data; append the action again"
        )

    def _timed_out(self, action_id: int, timeout: float) -> ActTimeout:
        return ActTimeout(
            f"no observation answered action {action_id} in session {self.id!r} within {timeout:g}s; "
            "it stays on the log and runs when a worker for its role takes the session "
            "(is one running? riverbed worker all)"
        )

    def _tenant_of(self, batch: Sequence[events.Event]) -> str | None:
        """The tenant a batch of stamped events is appended as: the handle's, else the one the
        events name (they may not name two, nor another than the handle's)."""
        named = {e.tenant for e in batch if e.tenant is not None}
        if self.tenant is not None:
            named.discard(self.tenant)
            if named:
                raise InputError(
                    f"an event names tenant {named.pop()!r} but this handle on session {self.id!r} is "
                    f"tenant {self.tenant!r}'s; leave the event's tenant unset"
                )
            return self.tenant
        if len(named) > 1:
            raise InputError(f"one append names several tenants ({', '.join(sorted(named))}); a session has one")
        return named.pop() if named else None

    async def wait_for_answer(self, action_id: int, *, timeout: float = 30.0) -> events.Event:
        """The observation answering ``action_id``; :class:`ActTimeout` when none comes in time,
        :class:`NotFoundError` as soon as the log no longer holds the action (Redis lost its data)."""
        return await self._answer(action_id, timeout, look_up=True)

    async def _answer(
        self, action_id: int, timeout: float, *, look_up: bool, cursor: int | None = None, waited: float = 0.0
    ) -> events.Event:
        """Wait what is left of ``timeout`` (``waited`` of it is gone) for the answer, tailing the
        log after ``cursor`` (default: the action)."""
        bus = self.bus
        log_key = bus.keys.log(self.id)
        cursor = action_id if cursor is None else cursor
        with anyio.move_on_after(max(timeout - waited, 0.0)):
            if look_up:
                known = await bus.client.hget(bus.keys.answers(self.id), str(action_id))
                if known is not None:
                    async for event in bus.log_store.read(self.id, int(known), int(known)):
                        return event
            answers = bus.answers
            if answers is not None and answers.running:
                # A long wait holds no connection: it listens to the session's wake-ups.
                async with answers.watch(self.id) as bell:
                    return await self._hear(answers, bell, action_id, cursor, bell.rung, read=True)
            while True:
                entries = await bus.client.xread(log_key, f"{cursor}-0", count=500, block=1000)
                if not entries and await bus.log_store.last_id(self.id) < action_id:
                    # The log is shorter than the action: Redis lost its data (a restart without
                    # persistence, a failover to an empty replica, FLUSHALL); no answer can come.
                    raise self._lost(action_id)
                answer, last = _answer_in(entries, action_id)
                if answer is not None:
                    return answer
                if last is not None:
                    cursor = last
        raise self._timed_out(action_id, timeout)

    def log(self, start: int = 1, end: int | None = None, *, follow: bool = False) -> AsyncIterator[events.Event]:
        """Replay the log from ``start`` (to ``end``); ``follow=True`` keeps tailing."""
        if follow:
            return self._follow(start, end)
        return self.bus.log_store.read(self.id, start, end)  # no extra generator layer on replays

    async def _follow(self, start: int, end: int | None) -> AsyncIterator[events.Event]:
        async for event in self.bus.log_store.follow(self.id, start):
            if end is not None and (event.id or 0) > end:
                return
            yield event

    async def events(self, start: int = 1, end: int | None = None) -> list[events.Event]:
        return [e async for e in self.log(start, end)]

    async def last_id(self) -> int:
        return await self.bus.log_store.last_id(self.id)

    async def view(self, until: int | None = None) -> list[Any]:
        """The condensed context as the agent saw it right after event ``until``."""
        from riverbed.memory.view import view as fold  # noqa: PLC0415  (memory is optional for clients)

        return list(fold(await self.events(1, until), until=until))

    @property
    def context(self) -> ContextControl:
        """The user's control of the agent's context: ``show``, ``forget``, ``restore``, ``pin``
        and ``unpin``, each one a ``context_edit`` event (:mod:`riverbed.client.context`)."""
        from riverbed.client.context import ContextControl  # noqa: PLC0415  (memory is optional for clients)

        return ContextControl(self)


def _answer_in(entries: Sequence[StreamEntry], action_id: int) -> tuple[events.Event | None, int | None]:
    """The entry of raw stream ``entries`` that answers ``action_id``, if any, and the id of
    the last entry (None when there are none)."""
    pairs = [(entry_id(raw_id), fields.get(PAYLOAD_FIELD, b"")) for raw_id, fields in entries]
    return _answer_among(pairs, action_id), (pairs[-1][0] if pairs else None)


def _answer_among(entries: Sequence[tuple[int, bytes]], action_id: int) -> events.Event | None:
    """The first of (id, payload) ``entries`` that answers ``action_id``, if any."""
    for event_id, payload in entries:
        event = decode_entry(payload, event_id)
        if event.cause == action_id and not isinstance(event, events.Action):
            return event
    return None


class Bus:
    """A connection to the event bus under one key prefix.

    With an ``archive`` (Postgres), reads span the events retention moved out of Redis; it
    connects only when a read needs it.

    :attr:`client` is how riverbed calls Redis (typed, errors translated); :attr:`redis` is
    the redis-py client under it, for commands riverbed has no use for (tests, operations).
    """

    def __init__(
        self,
        redis: RawClient,
        *,
        prefix: str = "rb",
        url: str = "redis",
        archive: Archive | None = None,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        max_events_per_append: int = DEFAULT_MAX_EVENTS_PER_APPEND,
    ) -> None:
        self.redis = redis
        self.client = RedisClient(redis, url)
        self.url = url
        self.keys = Keys(prefix)
        self.archive = archive
        self.max_event_bytes = max_event_bytes
        self.max_events_per_append = max_events_per_append
        self.log_store = Log(self.client, self.keys, archive=archive)
        self.answers: Answers | None = None
        """Waits for answers many to a connection (:mod:`riverbed.client.answers`): started by
        :func:`connect`; without it every act waits on a connection of its own."""

    def check(self, event: events.Event) -> bytes:
        """The payload of an event given by a user, once :func:`riverbed.events.check` (with
        this bus's ``RIVERBED_MAX_EVENT_BYTES``) accepts it."""
        return events.check(event, max_bytes=self.max_event_bytes)

    def session(self, session_id: str, *, tenant: str | None = None, agent: str | None = None) -> Session:
        return Session(self, session_id, tenant=tenant, agent=agent)

    async def operate(self, session_id: str, *, tenant: str | None = None, agent: str | None = None) -> Session:
        """A handle for an operator (the CLI): as ``tenant`` when one is named, else as the
        session's own tenant (none for a new session).  Whoever holds the bus's Redis
        credentials may act for any tenant; naming one makes the append checked against it."""
        if tenant is None:
            tenant = (await self.log_store.meta(session_id)).get("tenant") or None
        return self.session(session_id, tenant=tenant, agent=agent)

    async def sessions(self) -> list[str]:
        """Every session, oldest first."""
        return await status.list_sessions(self.client, self.keys)

    async def aclose(self) -> None:
        if self.answers is not None:
            await self.answers.aclose()
        if self.archive is not None:
            await self.archive.close()
        await self.client.aclose()


@contextlib.asynccontextmanager
async def connect(
    url: str | None = None, *, prefix: str | None = None, settings: Settings | None = None
) -> AsyncIterator[Bus]:
    """Connect to the bus at ``url`` (default: ``RIVERBED_REDIS_URL``, else the embedded services).

    With ``RIVERBED_DATABASE_URL`` set, reads span the Postgres archive of trimmed events.
    """
    settings = settings or Settings.from_env(os.environ)
    url = url or resolve_redis_url(settings)
    prefix = prefix or settings.prefix
    archive: Archive | None = None
    if settings.database_url:
        with needs_extra():
            from riverbed.bus.archive import Archive  # noqa: PLC0415  (asyncpg only with a database)

        archive = Archive(settings.database_url, schema=prefix)
    redis = await connect_redis(url)
    bus = Bus(
        redis,
        prefix=prefix,
        url=url,
        archive=archive,
        max_event_bytes=settings.max_event_bytes,
        max_events_per_append=settings.max_events_per_append,
    )
    try:
        bus.answers = await Answers.start(redis, bus.keys, url)
        yield bus
    finally:
        with anyio.CancelScope(shield=True):
            await bus.aclose()

"""The condenser role: keep each session's view within its budget by appending condensations.

Per session the handler keeps an incremental :class:`ViewBuilder` and the session's
:class:`CondenserConfig` (from its ``session_config`` events).  After each batch it asks
the policy whether to condense; a ``condensation_request`` is always honoured and is
answered by the condensation (``cause`` = the request).  The condensation is appended
with the owner's fencing token and ``expected_last``, so two condensers can never both
condense the same history: if the log moved meanwhile the batch is retried on the newer
history.  An LLM failure leaves the log untouched apart from an ``error`` event, and the
session goes on.  What the condenser appends carries the session's tenant (fixed by its
first append) and continues its trace: the request's, else the latest event's that had one.

One condensation per step: a request appended while a condensation was being made is answered
by it, and a request whose ``cause`` (the last event of the view its agent saw) is older than
a condensation, with the view now within its limits, is answered by an ``error``
(``already_condensed``) instead of a second condensation.  Nothing is condensed after the
agent's run ended (the next prompt is the next run's), and a session's config is its
``session_config`` over the worker's ``RIVERBED_CONDENSER_*`` defaults (``docs/condensers.md``),
whose token budget keeps the prompt and its answer within the model's context window when it is
known (``RIVERBED_LLM_CONTEXT_TOKENS``, else asked of the server once: ``agent/window.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import structlog
from msgspec.structs import replace

from riverbed import events, tracing
from riverbed.agent.runs import END_REASONS
from riverbed.agent.window import WindowFit, window_fit
from riverbed.bus.consumer import Entry, SessionContext
from riverbed.errors import ConfigError, InputError, RiverbedError, UnavailableError
from riverbed.memory.condensers import CondenserConfig, condense, should_condense
from riverbed.memory.view import HistoryReleased, ViewBuilder, id_runs
from riverbed.settings import Settings

if TYPE_CHECKING:
    from openai import AsyncOpenAI

log = structlog.get_logger("riverbed.worker")

E = TypeVar("E", bound=events.Event)


def _lean() -> ViewBuilder:
    return ViewBuilder(keep_hidden=False)


SAVE_EVERY = 10_000
"""The condenser saves its fold of a session (``SessionContext.save_fold``) when it has folded
this many events since the last save: a new owner reads only the log after the saved fold."""
SAVE_ON_CLOSE = 1_000
"""...and when it lets the session go with at least this many events folded since (fewer are
quick to read again, and a drain does not wait for many small saves)."""
SAVE_SHRUNK = 1_000
"""...and when a condensation left its view showing at least this many events fewer than the
saved fold's: a new owner reads the events the saved view shows, so a long session condensed
for the first time would otherwise cost the next owner a read of its whole log."""


@dataclass
class _State:
    builder: ViewBuilder = field(default_factory=_lean)
    """the session's view; hidden events are let go, so a long session costs only its context"""
    config: CondenserConfig = field(default_factory=CondenserConfig)
    condenser: dict[str, Any] | None = None
    """the condenser settings ``config`` came from (the latest valid ``session_config``'s)"""
    trace: str | None = None
    """the traceparent of the latest folded event that had one"""
    saved: int = 0
    """the last id of the fold saved last (0: none)"""
    saved_shown: int = 0
    """how many events the view of the fold saved last shows (a new owner reads them)"""
    condensed: int | None = None
    """the id of the latest condensation folded"""
    served: dict[int, int] = field(default_factory=dict)
    """requests made on a view older than a condensation: request id -> that condensation"""
    requested: list[int] = field(default_factory=list)
    """ids of the condensation requests folded by a catch-up (not in the batch being handled)"""
    idle: bool = False
    """the latest event ended the agent's run: nothing is condensed until the session goes on"""


class _Saved(msgspec.Struct, array_like=True):
    """What the condenser saves of a session: its view without events, settings, trace."""

    view: bytes
    condenser: dict[str, Any] | None
    trace: str | None


class CondenserHandler:
    role = "condenser"
    ignores_own_answers = False

    def __init__(
        self,
        *,
        llm: AsyncOpenAI | Callable[[], AsyncOpenAI] | None,
        model: str | None,
        defaults: WindowFit | Mapping[str, Any] | None = None,
    ) -> None:
        self.llm = llm
        self.model = model
        self.fit = defaults if isinstance(defaults, WindowFit) else WindowFit(self.role, defaults, 0)
        """the config of a session whose ``session_config`` does not say (``RIVERBED_CONDENSER_*``),
        fitted to the model's context window (asked of the server before the first session opens)"""
        self.states: dict[str, _State] = {}

    @property
    def defaults(self) -> dict[str, Any]:
        return self.fit.defaults

    def _state(self, builder: ViewBuilder | None = None) -> _State:
        config = CondenserConfig.from_dict(None, self.defaults)
        return _State(builder=_lean() if builder is None else builder, config=config)

    async def open(self, ctx: SessionContext) -> None:
        await self.fit.learn()
        await ctx.read_tenant()
        group_next = await ctx.delivered_up_to()
        state = await self._thawed(ctx) or self._state()
        filled, folded = state.saved_shown, 0
        try:
            async for event in ctx.log.read(ctx.session, state.builder.last_id + 1, group_next):
                self._fold(state, event)
                folded += 1
        except HistoryReleased:
            await self._refold(ctx, state, group_next)
        self.states[ctx.session] = state
        log.info("condenser.opened", session=ctx.session, saved=state.saved, filled=filled, folded=folded)
        await self._save_now_and_then(ctx, state)

    async def _thawed(self, ctx: SessionContext) -> _State | None:
        """The state saved by an owner before, with the events its view shows (None: no
        saved fold of this log, or one this version cannot read: the log is folded then)."""
        saved = await ctx.saved_fold()
        if saved is None:
            return None
        try:
            stored = msgspec.msgpack.decode(saved.blob, type=_Saved)
            builder, wanted = ViewBuilder.thaw(stored.view)
            builder.fill(await _events(ctx, wanted))
            config = CondenserConfig.from_dict(stored.condenser, self.defaults)
        except (msgspec.DecodeError, InputError, ConfigError) as exc:
            log.warning("fold.unreadable", session=ctx.session, role=ctx.role, error=str(exc))
            return None
        return _State(
            builder=builder,
            config=config,
            condenser=stored.condenser,
            trace=stored.trace,
            saved=saved.last,
            saved_shown=len(wanted),
        )

    async def _save(self, ctx: SessionContext, state: _State) -> None:
        blob = _Saved(view=state.builder.freeze(), condenser=state.condenser, trace=state.trace)
        await ctx.save_fold(state.builder.last_id, msgspec.msgpack.encode(blob))
        state.saved, state.saved_shown = state.builder.last_id, len(state.builder)
        log.info("fold.saved", session=ctx.session, role=ctx.role, last=state.saved, shown=state.saved_shown)

    async def _refold(self, ctx: SessionContext, state: _State, until: int) -> None:
        """Fold ``state`` again from the log's start up to ``until``, keeping hidden events (a
        ``restore`` shows some again), which are let go once it is done."""
        fresh = self._state(ViewBuilder(keep_hidden=True))
        async for event in ctx.log.read(ctx.session, 1, until):
            with contextlib.suppress(ConfigError):  # (said when the bad config was first folded)
                self._fold(fresh, event)
        fresh.builder.release_hidden()
        state.builder, state.config, state.condenser, state.trace = (
            fresh.builder,
            fresh.config,
            fresh.condenser,
            fresh.trace,
        )
        state.condensed, state.idle = fresh.condensed, fresh.idle
        log.info("session.refolded", session=ctx.session, last=state.builder.last_id)

    async def close(self, ctx: SessionContext) -> None:
        state = self.states.pop(ctx.session, None)
        if state is not None and state.builder.last_id - state.saved >= SAVE_ON_CLOSE:
            try:
                await self._save(ctx, state)
            except RiverbedError as exc:  # (a cache: the next owner folds more of the log)
                log.info("fold.not_saved", session=ctx.session, error=str(exc))

    async def recover(self, ctx: SessionContext, entries: list[Entry]) -> None:
        await self.handle(ctx, entries)

    async def handle(self, ctx: SessionContext, entries: list[Entry]) -> None:
        state = self.states[ctx.session]
        requests: list[Entry] = []
        bad_config: str | None = None
        for entry in entries:
            if entry.id > state.builder.last_id:
                try:
                    self._fold(state, entry.event)
                except ConfigError as exc:
                    bad_config = str(exc)
                except HistoryReleased:
                    await self._refold(ctx, state, entry.id)
            if isinstance(entry.event, events.CondensationRequest):
                if await ctx.is_answered(entry.id):
                    state.served.pop(entry.id, None)
                else:
                    requests.append(entry)
        state.requested = []
        if should_condense(state.builder.view(), state.config, requested=bool(requests)):
            bad_config = await self._catch_up(ctx, state) or bad_config
        if bad_config is not None:
            error = events.Error(content=bad_config, reason="bad_condenser_config", source="condenser")
            await ctx.append([_stamped(ctx, state, error)])
        others = [e.id for e in entries if e not in requests]
        view = state.builder.view()
        requests = await self._served(ctx, state, requests, over=should_condense(view, state.config))
        if not should_condense(view, state.config, requested=bool(requests)) or (state.idle and not requests):
            # (after the run ended nothing is condensed: the next prompt is the next run's)
            await ctx.ack(others)
            await self._save_now_and_then(ctx, state)
            return
        try:
            condensation = await condense(view, state.config, self.llm, requested=bool(requests), model=self.model)
        except (UnavailableError, ConfigError) as exc:
            log.warning("condense.failed", session=ctx.session, error=str(exc))
            failure = events.Error(
                content=f"condensation failed: {exc}", reason="condensation_failed", retryable=exc.retryable
            )
            for entry in requests:
                await ctx.answer(entry, replace(failure, source="condenser"))
            if not requests:
                await ctx.append([_stamped(ctx, state, replace(failure, source="condenser"))])
            await ctx.ack(others)
            return
        if condensation is not None:
            # An AppendConflict (the log moved) leaves the entries unacknowledged: the batch is
            # retried on the newer history.
            await self._publish(
                ctx, _stamped(ctx, state, condensation, requests), requests, state.builder.last_id, state.requested
            )
        await ctx.ack(others)
        await self._save_now_and_then(ctx, state)

    async def _save_now_and_then(self, ctx: SessionContext, state: _State) -> None:
        if state.builder.last_id - state.saved >= SAVE_EVERY or state.saved_shown - len(state.builder) >= SAVE_SHRUNK:
            await self._save(ctx, state)

    async def _served(self, ctx: SessionContext, state: _State, requests: list[Entry], *, over: bool) -> list[Entry]:
        """The requests still to serve.  One condensation per step: a request whose ``cause`` (the
        last event of the view its agent saw over the limit) is older than a condensation raced
        that condensation; while the view is within its limits it is answered by a sentence
        pointing at it rather than by a second condensation with nothing left to forget."""
        still = []
        for entry in requests:
            condensed = state.served.pop(entry.id, None)
            if condensed is None or over:
                still.append(entry)
                continue
            content = (
                f"the view was condensed by event {condensed} after the view this request saw, and is "
                "within its limits: nothing more to forget until the session goes on"
            )
            error = events.Error(source="condenser", content=content, reason="already_condensed")
            await ctx.answer(entry, _stamped(ctx, state, error, [entry]))
            log.info("condense.already", session=ctx.session, request=entry.id, condensation=condensed)
        return still

    async def _publish(
        self,
        ctx: SessionContext,
        condensation: events.Condensation,
        requests: list[Entry],
        last: int,
        caught_up: Sequence[int] = (),
    ) -> None:
        first = requests[0] if requests else None
        # A request that came while the condensation was made (caught up, not yet delivered) is
        # answered by it: it is delivered answered, and makes no second condensation.
        cause = first.id if first else (caught_up[0] if caught_up else None)
        cond = replace(condensation, cause=cause, source="condenser", tenant=ctx.tenant)
        await ctx.append([cond], expected_last=last)
        log.info(
            "session.condensed",
            session=ctx.session,
            forgotten=cond.forgotten,
            summary=cond.summary is not None,
            requested=cause is not None,
        )
        for entry in requests:
            if entry is first:
                await ctx.ack([entry.id])
            else:  # one condensation answers the first request; later ones get an empty answer
                await ctx.answer(entry, events.Condensation(source="condenser"))

    async def _catch_up(self, ctx: SessionContext, state: _State) -> str | None:
        """Fold the events appended after this batch (they are skipped when delivered later).

        The condensation is appended with ``expected_last`` = the last event folded: folding
        only the batch would make it conflict for as long as the log has moved past the
        batch, and the batch is retried as it is, so the session would never be condensed
        again.  Returns the error of a bad ``session_config`` met on the way, if any."""
        bad_config: str | None = None
        async for event in ctx.log.read(ctx.session, state.builder.last_id + 1):
            if event.id is None or event.id <= state.builder.last_id:
                continue
            try:
                self._fold(state, event)
            except ConfigError as exc:
                bad_config = str(exc)
            except HistoryReleased:
                await self._refold(ctx, state, event.id)
            if isinstance(event, events.CondensationRequest):
                state.requested.append(event.id)
        return bad_config

    def _fold(self, state: _State, event: events.Event) -> None:
        state.builder.append(event)
        if event.trace is not None:
            state.trace = event.trace
        _follow_steps(state, event)
        if isinstance(event, events.SessionConfig) and event.condenser is not None:
            state.config = CondenserConfig.from_dict(event.condenser, self.defaults)
            state.condenser = event.condenser


def _follow_steps(state: _State, event: events.Event) -> None:
    """Track what one condensation per step needs: the latest condensation, the requests made
    on a view older than it, and whether the run ended."""
    match event:
        case events.Condensation():
            state.condensed = event.id
        case events.CondensationRequest(cause=seen):
            if seen is not None and state.condensed is not None and state.condensed > seen and event.id is not None:
                state.served[event.id] = state.condensed
        case events.Error() if event.source == "condenser":
            pass  # (the condenser's own answers and reports)
        case events.SessionConfig() | events.ContextEdit():
            pass
        case _:
            state.idle = _ends_run(event)


def _ends_run(event: events.Event) -> bool:
    """Whether ``event`` ends the agent's run: its ``finish``, the ``error`` that stops it, or
    its question for the user."""
    if event.source != "agent":
        return False
    match event:
        case events.Finish():
            return True
        case events.Error(reason=reason):
            return reason in END_REASONS
        case events.Message(wait_for_response=waiting):
            return waiting
    return False


async def _events(ctx: SessionContext, ids: Sequence[int]) -> list[events.Event]:
    """The events with these ids (ascending), read run by run (one read over the whole span
    when they are scattered)."""
    runs = id_runs(ids)
    if len(runs) > 64:
        runs = [(ids[0], ids[-1])]
    wanted = set(ids)
    return [e for start, end in runs async for e in ctx.log.read(ctx.session, start, end) if e.id in wanted]


def _stamped(ctx: SessionContext, state: _State, event: E, requests: Sequence[Entry] = ()) -> E:
    """``event`` with the session's tenant and a child of the request's (else the latest) trace."""
    parent = next((r.event.trace for r in requests if r.event.trace is not None), None) or state.trace
    changes: dict[str, str] = {}
    if event.tenant is None and ctx.tenant is not None:
        changes["tenant"] = ctx.tenant
    if event.trace is None and parent is not None:
        child = tracing.child_of(parent)
        if child is not None:
            changes["trace"] = child
    return replace(event, **changes) if changes else event


def build_condenser_handler(settings: Settings) -> CondenserHandler:
    fit = window_fit("condenser", settings)
    try:
        CondenserConfig.from_dict(None, fit.defaults)
    except ConfigError as exc:
        raise ConfigError(f"the RIVERBED_CONDENSER_* settings do not go together: {exc}") from exc
    configured = bool(settings.openai_api_key or settings.openai_base_url)

    def llm() -> AsyncOpenAI:
        """The model client, made at the first LLM stage (loading the client library is a second
        of a worker's start, which a condenser that only forgets never needs)."""
        from openai import AsyncOpenAI  # noqa: PLC0415

        return AsyncOpenAI(api_key=settings.openai_api_key or "unused", base_url=settings.openai_base_url)

    return CondenserHandler(llm=functools.cache(llm) if configured else None, model=settings.llm_model, defaults=fit)

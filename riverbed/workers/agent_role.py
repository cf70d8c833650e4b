"""The agent role: work on each session's open run, one move at a time, as a function of the log.

A session is announced to this role when a run opens on it (``run_started``, or a
``run_cancel``: ``bus/scripts.py``), and the role owns it with the lease, fencing token,
takeover and drain of every role.  Per owned session the handler keeps the log's events and
their :class:`~riverbed.agent.runs.RunFold`; on each batch it folds what is new and makes the
moves :func:`~riverbed.agent.runs.next_move` names until it must wait for the log:

- **call the model** (limits checked first: a run overspends by at most one call), then append
  its ``llm_response`` (key ``run-<opened>-step-<n>``);
- **append call ``i``** of that response (key ``resp-<id>-call-<i>``), one at a time: the next
  once the one before is answered;
- **end the run** with an ``error`` from ``source: agent`` (``step_limit``,
  ``budget_exhausted``, ``cancelled``, ``llm_error``; key ``run-<opened>-end``).

Every append carries the owner's fencing token (a worker that lost the session appends
nothing) and an idempotency key derived from the log (a retried append appends nothing twice).
The entries of a batch are acknowledged only once its moves are made: a worker that dies in
the middle leaves them pending, and the next owner, having folded the whole log, makes the
moves still due.  A model call whose ``llm_response`` is in the log is never made again; only
a call in flight when its worker died is repeated, once.

A model server that is down, times out or answers 5xx/429 is tried again with backoff for
``RIVERBED_AGENT_LLM_RETRY_SECONDS``, then the run ends with ``llm_error`` saying what the
server said.  A ``run_cancel`` ends the run at the next move; a model call in flight is given
up within :data:`CANCEL_POLL_SECONDS` (a command in flight is not interrupted).  Once the run ended
the idle session is *retired* (released without being announced again until another run opens).

Each move rewrites the session's run summary (``keys.run``), which ``riverbed runs`` lists.
The reference agent's prompt (:func:`~riverbed.agent.llm.build_messages`) and tools are used;
unlike the in-process loop (``riverbed agent --in-process``), this role does not ask the
memory role for context recalls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import openai
import structlog
from msgspec.structs import replace
from openai import AsyncOpenAI

from riverbed import events
from riverbed.agent.llm import build_messages, call_record
from riverbed.agent.messages import cache_breakpoints
from riverbed.agent.runs import (
    AppendAction,
    CallModel,
    EndRun,
    RejectCalls,
    Run,
    RunFold,
    RunSummary,
    Wait,
    next_move,
    summarize,
)
from riverbed.agent.tools import tools
from riverbed.agent.usage import Price, parse_prices
from riverbed.bus.backoff import Backoff
from riverbed.bus.faults import crashpoint
from riverbed.bus.handling import Entry, SessionContext
from riverbed.bus.keys import AGENT_ROLE
from riverbed.settings import Settings

__all__ = ["AgentCounters", "AgentHandler", "build_agent_handler"]

log = structlog.get_logger("riverbed.worker")

AGENT_NAME = "llm"
"""The ``agent`` of what the role appends."""
CANCEL_POLL_SECONDS = 0.5
"""How often the log is looked at for a ``run_cancel`` while a model call is in flight."""


@dataclass
class AgentCounters:
    """What the role's Prometheus metrics read at scrape time (``workers/metrics.py``)."""

    ended: dict[str, int] = field(default_factory=dict)
    """runs this worker ended, by reason (``finish`` for a finished run)"""
    model_calls: int = 0
    model_failures: int = 0
    """model calls that failed (each try of a retried call counts)"""
    model_seconds: float = 0.0
    """the time model calls took, summed"""
    taken_over: int = 0
    """open runs this worker picked up with model calls already made (from a lost or drained owner)"""


class _ModelFailed(Exception):
    """The model could not be asked (its error sentence is the message)."""


@dataclass
class _Session:
    fold: RunFold
    seen: list[events.Event] = field(default_factory=list)
    """the log's events 1..``fold.last`` (the prompt is built from them)"""
    summary: RunSummary | None = None

    def add(self, event: events.Event) -> None:
        if event.id is not None and event.id > self.fold.last:
            self.seen.append(event)
            self.fold.add(event)


class AgentHandler:
    role = AGENT_ROLE
    ignores_own_answers = False

    def __init__(
        self,
        *,
        client: AsyncOpenAI,
        model: str,
        prices: dict[str, Price] | None = None,
        llm_timeout: float = 120.0,
        retry_seconds: float = 60.0,
        prompt_cache: str = "none",
    ) -> None:
        self.client = client
        self.model = model
        self.prices = prices or {}
        self.llm_timeout = llm_timeout
        self.retry_seconds = retry_seconds
        self.prompt_cache = prompt_cache
        self.tools = tools()
        self.sessions: dict[str, _Session] = {}
        self.counters = AgentCounters()

    # --- the Handler protocol -----------------------------------------------------------------

    async def open(self, ctx: SessionContext) -> None:
        await ctx.read_tenant()
        state = _Session(fold=RunFold(self.prices))
        async for event in ctx.log.read(ctx.session, 1):
            state.add(event)
        self.sessions[ctx.session] = state
        run = state.fold.run
        if run is not None and run.open and run.steps > 0:
            self.counters.taken_over += 1
        log.info("agent.opened", session=ctx.session, run=run.opened if run else None, open=bool(run and run.open))

    async def recover(self, ctx: SessionContext, entries: list[Entry]) -> None:
        await self.handle(ctx, entries)

    async def handle(self, ctx: SessionContext, entries: list[Entry]) -> None:
        state = self.sessions[ctx.session]
        if entries[-1].id > state.fold.last:
            if entries[0].id > state.fold.last + 1:
                await self._catch_up(ctx, state)
            for entry in entries:
                state.add(entry.event)
        await self._advance(ctx, state)
        await ctx.ack([e.id for e in entries])

    def retires(self, ctx: SessionContext) -> bool:
        """Nothing to do for the session until another run opens."""
        state = self.sessions.get(ctx.session)
        return state is None or state.fold.run is None or not state.fold.run.open

    async def close(self, ctx: SessionContext) -> None:
        self.sessions.pop(ctx.session, None)

    async def aclose(self) -> None:
        await self.client.close()

    # --- moves ----------------------------------------------------------------------------------

    async def _advance(self, ctx: SessionContext, state: _Session) -> None:
        """Make the moves the log calls for, until the run must wait for the log (or ended)."""
        made: tuple[str, int] | None = None
        while True:
            run = state.fold.run
            move = next_move(run)
            if isinstance(move, Wait) or run is None:
                break
            if made == (type(move).__name__, state.fold.last):
                # The same kind of move again with the log where it was: its append was a repeat the
                # log does not show (a log made again under the same id while the key lived).
                # Stop rather than spin; the next event wakes the session again.
                log.error("agent.move_repeated", session=ctx.session, move=type(move).__name__, last=state.fold.last)
                break
            made = (type(move).__name__, state.fold.last)
            if isinstance(move, EndRun):
                await self._end(ctx, state, run, move.reason, move.content)
            elif isinstance(move, RejectCalls):
                error = events.Error(source="agent", cause=move.response, content=move.content, reason="bad_tool_call")
                await self._append(ctx, state, error, f"resp-{move.response}-reject")
            elif isinstance(move, AppendAction):
                if move.index > 0:
                    crashpoint("agent_between_actions")
                await self._append(ctx, state, move.action, f"resp-{move.response}-call-{move.index}")
                if isinstance(move.action, events.Finish):
                    self._count_end("finish")
            elif isinstance(move, CallModel):
                await self._step(ctx, state, run)
        await self._save_summary(ctx, state)

    async def _step(self, ctx: SessionContext, state: _Session, run: Run) -> None:
        """One model call and its ``llm_response`` (or the ``llm_error`` that ends the run)."""
        model = run.model or self.model
        until = state.fold.last
        crashpoint("agent_before_llm")
        await self._save_summary(ctx, state)
        try:
            response = await self._complete(ctx, state, model)
        except _ModelFailed as exc:
            await self._catch_up(ctx, state)
            if state.fold.run is run and run.open and run.cancel_requested is None:
                await self._end(ctx, state, run, "llm_error", str(exc))
            return
        await self._catch_up(ctx, state)
        if state.fold.run is not run or not run.open or run.cancel_requested is not None:
            return  # cancelled (or ended) during the call: its response is not used
        recorded = _recorded(response, model, until)
        await self._append(ctx, state, recorded, f"run-{run.opened}-step-{run.steps + 1}")
        crashpoint("agent_after_response")

    async def _end(self, ctx: SessionContext, state: _Session, run: Run, reason: str, content: str) -> None:
        error = events.Error(source="agent", content=content, reason=reason, retryable=reason != "cancelled")
        await self._append(ctx, state, error, f"run-{run.opened}-end")
        self._count_end(reason)
        log.info("agent.run_ended", session=ctx.session, run=run.opened, reason=reason, steps=run.steps)

    def _count_end(self, reason: str) -> None:
        self.counters.ended[reason] = self.counters.ended.get(reason, 0) + 1

    async def _append(self, ctx: SessionContext, state: _Session, event: events.Event, key: str) -> None:
        """Append one event with the owner's fencing token under ``key``, then fold the log up to it."""
        changes: dict[str, Any] = {"agent": event.agent or AGENT_NAME}
        if event.tenant is None and ctx.tenant is not None:
            changes["tenant"] = ctx.tenant
        await ctx.append([replace(event, **changes)], idempotency_key=key)
        await self._catch_up(ctx, state)

    async def _catch_up(self, ctx: SessionContext, state: _Session) -> None:
        async for event in ctx.log.read(ctx.session, state.fold.last + 1):
            state.add(event)

    # --- the model ------------------------------------------------------------------------------

    async def _complete(self, ctx: SessionContext, state: _Session, model: str) -> Any:
        """The model's response to the prompt the log makes; a server that is down or answers
        5xx/429 is asked again, backing off, for ``retry_seconds`` (a cancel stops that)."""
        request: dict[str, Any] = {
            "model": model,
            "messages": cache_breakpoints(build_messages(state.seen, agent=AGENT_NAME), self.prompt_cache),
            "tools": self.tools,
            "tool_choice": "auto",
            "parallel_tool_calls": False,
        }
        deadline = time.monotonic() + self.retry_seconds
        backoff = Backoff(first=0.5, cap=5.0)
        tries = 0
        while True:
            tries += 1
            try:
                response = await self._call_once(ctx, state, request)
            except (TimeoutError, openai.OpenAIError) as exc:
                said = _said(exc, self.llm_timeout)
                if not _retryable(exc) or time.monotonic() + backoff.next > deadline:
                    again = f" after {tries} tries" if tries > 1 else ""
                    raise _ModelFailed(f"the model call failed{again} ({said})") from exc
                log.warning("agent.llm_retry", session=ctx.session, error=said, retry_in=backoff.next)
                await backoff.pause()
                await self._catch_up(ctx, state)
                run = state.fold.run
                if run is None or not run.open or run.cancel_requested is not None:
                    raise _ModelFailed(f"the model call was given up ({said})") from exc
                continue
            if not (getattr(response, "choices", None) or []):
                raise _ModelFailed("the model call failed (the model returned no choices)")
            return response

    async def _call_once(self, ctx: SessionContext, state: _Session, request: dict[str, Any]) -> Any:
        """One model call, given up (:class:`_ModelFailed`) when the run is cancelled meanwhile:
        the log is looked at every :data:`CANCEL_POLL_SECONDS` while the call is in flight."""
        outcome: list[Any] = []
        failure: list[BaseException] = []

        async with anyio.create_task_group() as tg:

            async def call() -> None:
                started = time.monotonic()
                try:
                    with anyio.fail_after(self.llm_timeout):
                        outcome.append(await self.client.chat.completions.create(**request))
                except (TimeoutError, openai.OpenAIError) as exc:
                    failure.append(exc)
                    self.counters.model_failures += 1
                finally:
                    self.counters.model_calls += 1
                    self.counters.model_seconds += time.monotonic() - started
                tg.cancel_scope.cancel()

            async def watch() -> None:
                while True:
                    await anyio.sleep(CANCEL_POLL_SECONDS)
                    await self._catch_up(ctx, state)
                    run = state.fold.run
                    if run is None or not run.open or run.cancel_requested is not None:
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(call)
            tg.start_soon(watch)
        if failure:
            raise failure[0]
        if not outcome:
            raise _ModelFailed("the model call was given up: the run was cancelled")
        return outcome[0]

    async def _save_summary(self, ctx: SessionContext, state: _Session) -> None:
        run = state.fold.run
        if run is None:
            return
        summary = summarize(ctx.session, run, worker=ctx.worker, model=self.model)
        if summary == state.summary:
            return
        redis, keys = ctx.log.redis, ctx.log.keys
        stamped = replace(summary, updated=time.time())
        async with redis.pipeline() as pipe:
            pipe.set(keys.run(ctx.session), msgspec.json.encode(stamped))
            pipe.zadd(keys.runs, {ctx.session: run.opened_at}, nx=True)
            await pipe.execute()
        state.summary = summary


def _recorded(response: Any, model: str, until: int) -> events.LlmResponse:
    message = response.choices[0].message
    calls = list(message.tool_calls or [])
    usage = getattr(response, "usage", None)
    return events.LlmResponse(
        source="agent",
        model=getattr(response, "model", None) or model,
        content=message.content,
        tool_calls=[call_record(c) for c in calls],
        usage=usage.model_dump(exclude_none=True) if usage is not None else {},
        cause=until or None,
    )


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, TimeoutError | openai.APIConnectionError | openai.RateLimitError):
        return True
    status = getattr(exc, "status_code", None)
    return isinstance(status, int) and status >= 500


def _said(exc: BaseException, timeout: float) -> str:
    """What the server said, in a few words."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:g}s"
    status = getattr(exc, "status_code", None)
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return f"HTTP {status}: {message}" if status is not None else message


def build_agent_handler(settings: Settings) -> AgentHandler:
    """The agent role's handler for the configured model server (``OPENAI_BASE_URL`` /
    ``OPENAI_API_KEY``; retries are the role's own)."""
    client = AsyncOpenAI(
        api_key=settings.openai_api_key or "unused", base_url=settings.openai_base_url or None, max_retries=0
    )
    return AgentHandler(
        client=client,
        model=settings.llm_model,
        prices=parse_prices(settings.prices),
        llm_timeout=settings.agent_llm_timeout,
        retry_seconds=settings.agent_llm_retry_seconds,
        prompt_cache=settings.prompt_cache,
    )

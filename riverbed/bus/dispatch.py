"""Handing a batch to a role's handler: classify what went wrong, back off, dead-letter poison.

- An entry that does not decode, or that failed (or crashed its worker) ``max_attempts``
  times, goes to the dead-letter stream; the session gets an ``error`` event (answering the
  entry when it is an action of this role) and the batch goes on without it.
- :class:`UnavailableError` (Postgres or the embedder down) and :class:`AppendConflict` (the
  log moved) are not the entry's fault: the batch is retried, backing off, without counting
  attempts.  Only the entries still pending are retried (a failed batch may be half done).
- :class:`FencedError` ends the session loop (another worker owns the session now).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial

import anyio
import msgspec
import structlog

from riverbed import events
from riverbed.bus.backoff import Backoff, retry_unavailable
from riverbed.bus.handles import Handles, OwnerStats
from riverbed.bus.handling import Answer, Entry, Handler, SessionContext
from riverbed.bus.log import entry_id
from riverbed.errors import AppendConflict, FencedError, UnavailableError

__all__ = ["Dispatcher"]

log = structlog.get_logger("riverbed.worker")


class Dispatcher:
    """Runs batches through one owner's handler (``stopping``: the owner's, which ends the
    waits for Redis; ``stats``: the owner's counters)."""

    def __init__(self, handles: Handles, handler: Handler, *, stats: OwnerStats, stopping: anyio.Event) -> None:
        self.handles = handles
        self.handler = handler
        self.role = handles.role
        self.stats = stats
        self.stopping = stopping

    async def dispatch(self, ctx: SessionContext, batch: list[Entry], *, recovering: bool) -> Answer | None:
        """Hand a batch to the handler (``recover`` for entries in flight on a previous owner,
        else ``handle``); the answer the handler left for the loop to send, if any."""
        ctx.delivered = max(ctx.delivered, batch[-1].id)
        attempts: dict[int, int] = {}
        failures: dict[int, str] = {}  # an entry's last error, for its dead letter
        todo = batch
        backoff = Backoff(cap=5.0)
        max_attempts = self.handles.max_attempts
        while todo:
            poison = [e for e in todo if e.undecodable or e.deliveries + attempts.get(e.id, 0) > max_attempts]
            if poison:
                await self.dead_letter(
                    ctx,
                    [
                        (
                            e,
                            "undecodable payload"
                            if e.undecodable
                            else "failed too many times" + (f": {failures[e.id]}" if e.id in failures else ""),
                            e.deliveries + attempts.get(e.id, 0),
                        )
                        for e in poison
                    ],
                )
            todo = [e for e in todo if e not in poison]
            if not todo:
                break
            if recovering:
                self.stats.redeliveries += len(todo)
            started = time.perf_counter()
            try:
                await ctx.refresh_masks()
                run = self.handler.recover if recovering else self.handler.handle
                held = await run(ctx, todo)
            except FencedError:
                raise
            except (UnavailableError, AppendConflict) as exc:
                log.warning("handler.retry", role=self.role, session=ctx.session, error=str(exc))
                await backoff.pause()
                todo = await retry_unavailable(partial(self._unacked, ctx, todo), stopping=self.stopping)
                continue
            except Exception as exc:
                log.exception("handler.failed", role=self.role, session=ctx.session, error=str(exc))
                for entry in todo:
                    attempts[entry.id] = attempts.get(entry.id, 0) + 1
                    failures[entry.id] = f"{type(exc).__name__}: {exc}"
                await backoff.pause()
                todo = await retry_unavailable(partial(self._unacked, ctx, todo), stopping=self.stopping)
                continue
            finally:
                self.stats.observe_handler(time.perf_counter() - started)
            self.stats.handled += len(todo)
            ctx.last_seen = max(ctx.last_seen, todo[-1].id)
            return held
        return None

    async def _unacked(self, ctx: SessionContext, entries: list[Entry]) -> list[Entry]:
        """The entries of ``entries`` that are still pending (a failed batch may be half done)."""
        handles = self.handles
        pending = await handles.client.xpending_range(
            handles.keys.log(ctx.session),
            self.role,
            min=f"{entries[0].id}-0",
            max=f"{entries[-1].id}-0",
            count=len(entries),
        )
        still = {entry_id(p["message_id"]) for p in pending}
        return [e for e in entries if e.id in still]

    async def dead_letter(self, ctx: SessionContext, poison: Sequence[tuple[Entry, str, int]]) -> None:
        """Move entries (with the reason and attempts) to the dead-letter stream and tell the
        session: one ``error`` each, answering the entry if it is an action of this role.  A few
        round trips per batch, however many entries: a flood of garbage cannot stall a session."""
        self.stats.dead_letters += len(poison)
        letters = await self.handles.dlq.add_many(
            ctx.session, self.role, [(e.id, r, a, e.payload) for e, r, a in poison]
        )
        notices: list[events.Error] = []
        for (entry, reason, attempts), letter in zip(poison, letters, strict=True):
            log.error("entry.dead_lettered", role=self.role, session=ctx.session, event_id=entry.id, reason=reason)
            notices.append(
                events.Error(
                    content=f"event {entry.id} was moved to the dead-letter stream by the {self.role} role "
                    f"({reason}, {attempts} attempts); see `riverbed dlq list` (dead letter {letter})",
                    reason="dead_letter",
                    retryable=False,
                    source="system",
                    cause=entry.id if answered_by(entry) == self.role else None,
                    tenant=ctx.tenant,
                )
            )
        if not await ctx.append(notices):
            # One of them was answered already (a redelivery): the batch appended nothing; go one by one.
            for (entry, _reason, _attempts), notice in zip(poison, notices, strict=True):
                if notice.cause is not None:
                    await ctx.answer(entry, notice)
                else:
                    await ctx.append([notice])
        await ctx.ack([e.id for e, _reason, _attempts in poison])


def answered_by(entry: Entry) -> str | None:
    """The role that answers ``entry``: its action kind's, also when the payload names an
    action kind but does not decode (a field of the wrong type): its sender waits all the same."""
    event = entry.event
    if isinstance(event, events.Action):
        return event.answering_role
    if not entry.undecodable:
        return None
    try:
        raw = msgspec.msgpack.decode(entry.payload)
    except msgspec.DecodeError:
        return None
    kind = raw.get("kind") if isinstance(raw, dict) else None
    cls = events.kinds().get(kind) if isinstance(kind, str) else None
    if cls is not None and issubclass(cls, events.Action):
        return cls.answered_by
    return None

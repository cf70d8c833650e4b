"""The memory role: index every event of a session and answer its ``recall`` actions.

Indexing is exactly-once in effect (chunks and the tracking row commit together), so a
redelivered batch is a no-op.  When Postgres or the embedder is down, the batch is retried
with backoff until indexing catches up, and nothing is acknowledged before it is indexed.
The session reads nothing new while it retries, so each failed attempt answers with a
retryable ``error`` every ``recall`` in the batch *and* every one queued behind it in the
log: an agent never waits out an outage for its answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

from riverbed import events
from riverbed.bus.consumer import Entry, SessionContext
from riverbed.bus.faults import crashpoint
from riverbed.errors import UnavailableError
from riverbed.memory.embedders import make_embedder
from riverbed.memory.recall import Memory
from riverbed.memory.store import Store
from riverbed.runtime.paths import workspace_name
from riverbed.settings import Settings

log = structlog.get_logger("riverbed.worker")


class MemoryHandler:
    role = "memory"

    def __init__(self, memory: Memory, *, workspace_root: Path | None = None) -> None:
        self.memory = memory
        self.workspace_root = workspace_root
        self._scanned: dict[str, int] = {}  # session -> last id looked at for queued recalls

    @property
    def cache(self) -> object:
        return self.memory.cache

    async def open(self, ctx: SessionContext) -> None:
        if ctx.tenant is None:
            ctx.tenant = (await ctx.log.meta(ctx.session)).get("tenant") or None

    async def close(self, ctx: SessionContext) -> None:
        self._scanned.pop(ctx.session, None)

    async def recover(self, ctx: SessionContext, entries: list[Entry]) -> None:
        await self.handle(ctx, entries)

    async def handle(self, ctx: SessionContext, entries: list[Entry]) -> None:
        recalls = [e for e in entries if isinstance(e.event, events.Recall)]
        try:
            await self.memory.store.start()  # idempotent; raises UnavailableError while Postgres is down
            await self.memory.index(ctx.session, [e.event for e in entries], tenant=ctx.tenant)
        except UnavailableError as exc:
            for entry in recalls:
                await self._answer_error(ctx, entry, exc)
            await self._answer_queued_recalls(ctx, entries[-1].id, exc)
            raise
        crashpoint("after_index")
        for entry in recalls:
            await self._recall(ctx, entry)
        await ctx.ack([e.id for e in entries if e not in recalls])

    async def _recall(self, ctx: SessionContext, entry: Entry) -> None:
        if await ctx.is_answered(entry.id):
            await ctx.ack([entry.id])
            return
        action = entry.event
        assert isinstance(action, events.Recall)
        workspace = self.workspace_root / workspace_name(ctx.session) if self.workspace_root else None
        try:
            result: events.Observation = await self.memory.recall(
                action, session=ctx.session, tenant=ctx.tenant, workspace=workspace
            )
        except UnavailableError as exc:
            await self._answer_error(ctx, entry, exc)
            return
        await ctx.answer(entry, result)

    async def _answer_queued_recalls(self, ctx: SessionContext, after: int, exc: UnavailableError) -> None:
        """Answer with an error the recalls appended after ``after`` (not read yet: the session
        loop retries the failed batch first).  Answered ones are only acknowledged later."""
        start = max(after, self._scanned.get(ctx.session, 0)) + 1
        async for event in ctx.log.read(ctx.session, start):
            if event.id is None:
                continue
            if isinstance(event, events.Recall):
                await self._answer_error(ctx, Entry(id=event.id, event=event, payload=b""), exc)
            self._scanned[ctx.session] = event.id

    async def _answer_error(self, ctx: SessionContext, entry: Entry, exc: UnavailableError) -> None:
        await ctx.answer(
            entry,
            events.Error(content=f"recall failed: {exc}", reason="memory_unavailable", retryable=True, source="memory"),
        )


def build_memory_handler(settings: Settings) -> tuple[MemoryHandler, Callable[[], Awaitable[None]]]:
    """The memory handler for ``settings`` (the store connects lazily, on the first session)."""
    database_url = settings.database_url
    if not database_url:
        from riverbed import services  # noqa: PLC0415  (embedded Postgres only without a URL)

        database_url = services.up(Path(settings.services_dir)).database_url
    embedder = make_embedder(settings.embedder, api_key=settings.openai_api_key, base_url=settings.openai_base_url)
    store = Store(database_url, schema=settings.prefix)
    memory = Memory.cached(store, embedder)
    handler = MemoryHandler(memory, workspace_root=Path(settings.workspace))
    return handler, store.close

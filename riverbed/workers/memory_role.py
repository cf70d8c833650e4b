"""The memory role: index every event of a session and answer its ``recall`` actions.

Indexing is exactly-once in effect (chunks and the tracking row commit together), so a
redelivered batch is a no-op.  Nothing is acknowledged before it is indexed, recall actions
included: a recall is answered as soon as it can be, but stays pending until its own event
went through indexing like any other.

- **Postgres or the embedder down** (:class:`UnavailableError`): the batch is retried with
  backoff until indexing catches up; each failed attempt answers with a retryable ``error``
  every ``recall`` in the batch *and* every one queued behind it in the log.
- **Postgres slow or hanging**: every recall is answered within ``Memory.recall_timeout`` of
  the start of its batch: a watcher answers with a retryable ``error`` the recalls of the
  batch, and those queued behind it, that are still waiting at that deadline, while the
  indexing goes on (bounded by its own timeouts).  When the batch is a retry after memory
  was found unavailable, the watcher answers queued recalls at once.
- **An indexing backlog** (a long log arriving at once, a worker catching up): a recall
  never waits for indexing of the events before it for more than :data:`AHEAD_AFTER` of
  ``Memory.recall_timeout``.  While a batch is indexed, a watcher reads the recalls queued
  behind it; one still queued that long is answered from the index as it is, and its
  ``recall_result`` says how far that is (``indexed_to``), or with a retryable error when
  even that does not come in time.
- **A value Postgres cannot hold** (:class:`DataError`, after the texts were cleaned): the
  rest of the batch is indexed and acknowledged; the guilty events fail, are counted by the
  consumer loop, and are dead-lettered with the reason after its attempts.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import anyio
import structlog
from msgspec.structs import replace

from riverbed import events
from riverbed.agent.usage import UsageCounters, parse_prices
from riverbed.bus.consumer import Entry, SessionContext
from riverbed.bus.faults import crashpoint
from riverbed.errors import DataError, RiverbedError, UnavailableError
from riverbed.memory.embedders import make_embedder
from riverbed.memory.recall import Memory
from riverbed.memory.store import Store
from riverbed.runtime.paths import belongs_to, workspace_name
from riverbed.settings import Settings

log = structlog.get_logger("riverbed.worker")

#: How often the watcher looks for recalls queued behind the batch being indexed.
LATE_CHECK_SECONDS = 0.5
#: The part of ``Memory.recall_timeout`` a recall queued behind indexing waits for it; then
#: it is answered from the index as it is, within the rest of its timeout.
AHEAD_AFTER = 0.5


class MemoryHandler:
    role = "memory"
    ignores_own_answers = False

    def __init__(
        self, memory: Memory, *, workspace_root: Path | None = None, usage: UsageCounters | None = None
    ) -> None:
        self.memory = memory
        self.workspace_root = workspace_root
        self.usage = usage if usage is not None else UsageCounters()
        """Tokens and cost of the model calls this worker indexed (the worker's usage counters)."""
        self._scanned: dict[str, int] = {}  # session -> last id looked at for queued recalls
        # session -> recalls queued behind the batch being indexed, unanswered: id -> (first seen, recall)
        self._queued: dict[str, dict[int, tuple[float, events.Recall]]] = {}
        self._failing: set[str] = set()  # sessions whose last indexing attempt found memory unavailable
        self._logs: set[str] = set()  # sessions whose log's creation stamp the store has seen

    @property
    def cache(self) -> object:
        return self.memory.cache

    async def open(self, ctx: SessionContext) -> None:
        await ctx.read_tenant()

    async def close(self, ctx: SessionContext) -> None:
        self._scanned.pop(ctx.session, None)
        self._queued.pop(ctx.session, None)
        self._failing.discard(ctx.session)
        self._logs.discard(ctx.session)

    async def recover(self, ctx: SessionContext, entries: list[Entry]) -> None:
        await self.handle(ctx, entries)

    async def handle(self, ctx: SessionContext, entries: list[Entry]) -> None:
        now = anyio.current_time()
        deadline = now + self.memory.recall_timeout
        failure: Exception | None = None
        async with anyio.create_task_group() as tg:
            # while a retried batch waits on memory, recalls queued behind it are answered at once
            tg.start_soon(self._watch, ctx, entries, now if ctx.session in self._failing else deadline)
            try:
                await self._index_and_answer(ctx, entries, deadline)
            except Exception as exc:  # re-raised below, outside the task group (no ExceptionGroup)
                failure = exc
            finally:
                tg.cancel_scope.cancel()
        if failure is not None:
            raise failure

    async def _index_and_answer(self, ctx: SessionContext, entries: list[Entry], deadline: float) -> None:
        recalls = [e for e in entries if isinstance(e.event, events.Recall)]
        unindexable: DataError | None = None
        try:
            await self.memory.store.start()  # idempotent; raises UnavailableError while Postgres is down
            await self._check_log(ctx)
            await self.memory.index(ctx.session, [e.event for e in entries], tenant=ctx.tenant)
        except UnavailableError as exc:
            self._failing.add(ctx.session)
            for entry in recalls:
                await self._answer_error(ctx, entry, exc)
            await self._answer_queued_recalls(ctx, entries[-1].id, exc)
            raise
        except DataError as exc:
            if not exc.event_ids:
                raise
            log.warning("memory.unindexable", session=ctx.session, event_ids=sorted(exc.event_ids), error=str(exc))
            unindexable = exc
        self._failing.discard(ctx.session)
        guilty = unindexable.event_ids if unindexable is not None else frozenset()
        crashpoint("after_index")
        for entry in recalls:
            if entry.id not in guilty:
                await self._recall(ctx, entry, deadline)
        done = [e for e in entries if e not in recalls and e.id not in guilty]
        await ctx.ack([e.id for e in done])
        # Counted once an entry is acknowledged: a retried or redelivered batch is not counted twice.
        for entry in done:
            if isinstance(entry.event, events.LlmResponse):
                self.usage.count(entry.event, entry.id)
        if unindexable is not None:
            raise unindexable  # the consumer counts it against the guilty entries (still pending)

    async def _check_log(self, ctx: SessionContext) -> None:
        """Once per session loop: drop the rows of an earlier log of this session id."""
        if ctx.session in self._logs:
            return
        created = await ctx.created()
        if created and await self.memory.store.start_log(ctx.session, created):
            log.warning("memory.log_restarted", session=ctx.session, detail="rows of the lost log were dropped")
        self._logs.add(ctx.session)

    async def _recall(self, ctx: SessionContext, entry: Entry, deadline: float) -> None:
        if await ctx.is_answered(entry.id):
            await ctx.ack([entry.id])
            return
        action = entry.event
        assert isinstance(action, events.Recall)
        try:
            result: events.Observation = await self._search(
                ctx, action, timeout=max(0.1, deadline - anyio.current_time())
            )
        except UnavailableError as exc:
            await self._answer_error(ctx, entry, exc)
            await ctx.ack([entry.id])
            return
        await ctx.answer(entry, result)

    async def _search(self, ctx: SessionContext, action: events.Recall, *, timeout: float) -> events.RecallResult:
        workspace = self.workspace_root / workspace_name(ctx.session) if self.workspace_root else None
        if workspace is not None and not belongs_to(workspace, await ctx.created()):
            workspace = None  # an earlier log's, under the same id: not this one's to read
        return await self.memory.recall(
            action, session=ctx.session, tenant=ctx.tenant, workspace=workspace, timeout=timeout
        )

    async def _watch(self, ctx: SessionContext, entries: Sequence[Entry], deadline: float) -> None:
        """Until ``deadline``, answer the recalls queued behind the batch that waited too long
        for indexing, from the index as it is; from ``deadline`` on, answer with an error the
        recalls of the batch still waiting, and those queued behind it, until the batch is
        done (then this task is cancelled)."""
        after = entries[-1].id
        try:
            while (now := anyio.current_time()) < deadline:
                await self._answer_ahead(ctx, after, indexed_to=entries[0].id - 1)
                await anyio.sleep(min(LATE_CHECK_SECONDS, deadline - now))
            late = UnavailableError(
                f"memory cannot answer within {self.memory.recall_timeout:g}s: Postgres or the embedder is "
                "slow, hanging or down, or indexing is behind; try again"
            )
            for entry in entries:
                if isinstance(entry.event, events.Recall) and not await ctx.is_answered(entry.id):
                    await self._answer_error(ctx, entry, late)
            while True:
                await self._answer_queued_recalls(ctx, after, late)
                await anyio.sleep(LATE_CHECK_SECONDS)
        except RiverbedError as exc:  # Redis down or the session lost: the loop finds out too
            log.warning("memory.late_answers_failed", session=ctx.session, error=str(exc))

    async def _queue(self, ctx: SessionContext, after: int) -> dict[int, tuple[float, events.Recall]]:
        """The unanswered recalls appended after ``after`` (the session loop is still on the
        batch that ends there), with when this worker first saw each."""
        queued = self._queued.setdefault(ctx.session, {})
        for reached in [i for i in queued if i <= after]:
            del queued[reached]  # the session loop has them now
        start = max(after, self._scanned.get(ctx.session, 0)) + 1
        now = anyio.current_time()
        async for event in ctx.log.read(ctx.session, start):
            if event.id is None:
                continue
            if isinstance(event, events.Recall):
                queued[event.id] = (now, event)
            self._scanned[ctx.session] = event.id
        return queued

    async def _answer_ahead(self, ctx: SessionContext, after: int, *, indexed_to: int) -> None:
        """Answer the recalls queued behind ``after`` for :data:`AHEAD_AFTER` of their
        timeout from the index as it is (it holds events 1..``indexed_to``), leaving them
        pending until they are read and indexed in their turn."""
        queued = await self._queue(ctx, after)
        timeout = self.memory.recall_timeout
        now = anyio.current_time()
        for event_id, (seen, action) in sorted(queued.items()):
            if now - seen < timeout * AHEAD_AFTER:
                break  # (later ones were seen no earlier)
            # Shielded: the batch may be done while this recall is searched for, and the answer
            # must not go with the watcher (the search keeps to the recall's deadline).
            del queued[event_id]
            with anyio.CancelScope(shield=True):
                await self._answer_one_ahead(ctx, event_id, seen, action, indexed_to)

    async def _answer_one_ahead(
        self, ctx: SessionContext, event_id: int, seen: float, action: events.Recall, indexed_to: int
    ) -> None:
        if await ctx.is_answered(event_id):
            return
        entry = Entry(id=event_id, event=action, payload=b"")
        timeout = self.memory.recall_timeout
        try:
            result = await self._search(ctx, action, timeout=max(0.1, seen + timeout - anyio.current_time()))
        except UnavailableError as exc:
            await self._answer_error(ctx, entry, exc)
            return
        log.info("memory.recall_ahead", session=ctx.session, recall=event_id, indexed_to=indexed_to)
        await ctx.answer(entry, replace(result, indexed_to=indexed_to), ack=False)

    async def _answer_queued_recalls(self, ctx: SessionContext, after: int, exc: UnavailableError) -> None:
        """Answer with an error the recalls appended after ``after`` (not read yet: the session
        loop is still on the batch).  They are acknowledged once they are read and indexed."""
        queued = await self._queue(ctx, after)
        for event_id, (_, action) in sorted(queued.items()):
            del queued[event_id]
            with anyio.CancelScope(shield=True):  # (answered, not dropped, when the batch is done meanwhile)
                if not await ctx.is_answered(event_id):
                    await self._answer_error(ctx, Entry(id=event_id, event=action, payload=b""), exc)

    async def _answer_error(self, ctx: SessionContext, entry: Entry, exc: UnavailableError) -> None:
        """Answer ``entry`` with a retryable error, leaving it pending until it is indexed."""
        await ctx.answer(
            entry,
            events.Error(content=f"recall failed: {exc}", reason="memory_unavailable", retryable=True, source="memory"),
            ack=False,
        )


def build_memory(settings: Settings, *, start_services: bool = True) -> Memory | None:
    """The memory of a deployment: the store at ``RIVERBED_DATABASE_URL`` (schema: the
    prefix) or, without one, the embedded services' (started when ``start_services``, else
    only when already running; None without either), behind the cached pipeline of
    ``RIVERBED_EMBEDDER``.  The store connects on first use."""
    database_url = settings.database_url
    if not database_url:
        from riverbed import services  # noqa: PLC0415  (embedded Postgres only without a URL)

        directory = Path(settings.services_dir)
        running = services.up(directory) if start_services else services.load(directory)
        if running is None:
            return None
        database_url = running.database_url
    embedder = make_embedder(settings.embedder, api_key=settings.openai_api_key, base_url=settings.openai_base_url)
    return Memory.cached(Store(database_url, schema=settings.prefix), embedder, recall_timeout=settings.recall_timeout)


def build_memory_handler(settings: Settings) -> tuple[MemoryHandler, Callable[[], Awaitable[None]]]:
    """The memory handler for ``settings`` (the store connects lazily, on the first session)."""
    memory = build_memory(settings)
    assert memory is not None  # (the embedded services start when no URL is set)
    handler = MemoryHandler(
        memory, workspace_root=Path(settings.workspace), usage=UsageCounters(parse_prices(settings.prices))
    )
    return handler, memory.aclose

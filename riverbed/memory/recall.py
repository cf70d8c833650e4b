"""The memory service: index events into the store and answer ``recall`` actions.

:class:`Memory` composes a started :class:`~riverbed.memory.store.Store`, an embedder
(normally the cached, micro-batched pipeline from :func:`embedding_pipeline`) and the
microagent directories.  The memory worker calls :meth:`Memory.index` for every event of
a session it owns and :meth:`Memory.recall` for every ``recall`` action; both raise
:class:`~riverbed.errors.UnavailableError` (bounded by a timeout) when Postgres or the
embedder fails or hangs, so the worker can answer with an ``error`` observation or retry
later.  :meth:`Memory.index` raises :class:`~riverbed.errors.DataError` naming the events
Postgres cannot hold (the others of the batch are indexed), so the worker can dead-letter
those alone.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Required, TypedDict, Unpack

import anyio
import anyio.to_thread
import structlog

from riverbed import events
from riverbed.errors import DataError, InputError, UnavailableError
from riverbed.memory.chunking import ChunkPolicy, event_chunks, searchable
from riverbed.memory.embedcache import CachedEmbedder, embedding_pipeline
from riverbed.memory.embedders import Embedder
from riverbed.memory.microagents import load_microagents, match_knowledge, workspace_dirs
from riverbed.memory.ranking import Match, explained_rank
from riverbed.memory.store import ChunkRow, Store, query_words
from riverbed.memory.workspace import workspace_context

__all__ = ["Memory", "SearchOptions"]

log = structlog.get_logger("riverbed.memory")


class SearchOptions(TypedDict, total=False):
    """Where and how a search looks (:meth:`Memory.search_explained` has the defaults)."""

    session: Required[str]
    tenant: Required[str | None]
    k: int
    scope: str
    now: dt.datetime | None
    timeout: float | None


class Memory:
    """Indexing and recall over one store and one embedder.

    ``microagent_dirs`` are searched before the workspace's own (global, then user);
    ``half_life_seconds`` turns on recency weighting of semantic hits; ``candidates`` is
    how many rows each of the two searches contributes to the fusion (at least ``k``).
    """

    def __init__(
        self,
        store: Store,
        embedder: Embedder,
        *,
        policy: ChunkPolicy | None = None,
        microagent_dirs: Sequence[Path] = (),
        recall_timeout: float = 8.0,
        index_timeout: float = 120.0,
        half_life_seconds: float | None = None,
        candidates: int = 40,
    ) -> None:
        self.store = store
        self.embedder = embedder
        self.policy = policy or ChunkPolicy()
        self.microagent_dirs = list(microagent_dirs)
        self.recall_timeout = recall_timeout
        self.index_timeout = index_timeout
        self.half_life_seconds = half_life_seconds
        self.candidates = candidates

    @classmethod
    def cached(cls, store: Store, embedder: Embedder, *, lru_size: int = 10_000, **options: Any) -> Memory:
        """A Memory whose embedder sits behind the micro-batcher and the two-level cache
        (``options`` are the constructor's keyword arguments)."""
        return cls(store, embedding_pipeline(embedder, store, lru_size=lru_size), **options)

    async def aclose(self) -> None:
        """Close the store's connections."""
        await self.store.close()

    @property
    def cache(self) -> CachedEmbedder | None:
        """The embedding cache (for its hit/miss counters), when the embedder has one."""
        return self.embedder if isinstance(self.embedder, CachedEmbedder) else None

    # --- indexing ----------------------------------------------------------------------

    async def index(self, session: str, batch: Sequence[events.Event], *, tenant: str | None) -> int:
        """Index events of one session (each must carry its id); returns how many were new.

        Chunks and tracking rows of the batch commit together, so indexing the same events
        again (a redelivery, a catch-up after a crash) changes nothing.  When Postgres cannot
        hold a value of the batch, its events are indexed one by one and the
        :class:`DataError` raised at the end names the events that failed (``event_ids``).
        """
        if not batch:
            return 0
        if any(e.id is None for e in batch):
            raise InputError("only events read from a log (with an id) can be indexed")
        by_id = {int(e.id): e for e in batch if e.id is not None}
        try:
            with anyio.fail_after(self.index_timeout):
                done = await self.store.indexed(session, by_id)
                todo = [e for i, e in by_id.items() if i not in done]
                try:
                    return await self._write(session, todo, tenant=tenant)
                except DataError:
                    if len(todo) > 1:
                        return await self._write_one_by_one(session, todo, tenant=tenant)
                    raise
        except TimeoutError as exc:
            raise UnavailableError(
                f"indexing {len(batch)} events of {session!r} took over {self.index_timeout}s"
            ) from exc

    async def _write(self, session: str, todo: Sequence[events.Event], *, tenant: str | None) -> int:
        """Embed and write the chunks of ``todo`` (events not indexed yet) in one transaction;
        a :class:`DataError` names the events when there is only one."""
        if not todo:
            return 0
        try:
            return await self._embed_and_write(session, todo, tenant=tenant)
        except DataError as exc:
            if len(todo) > 1 or exc.event_ids:
                raise
            guilty = int(todo[0].id or 0)
            raise DataError(
                f"event {guilty} of {session!r} cannot be indexed: {exc}", event_ids=frozenset({guilty})
            ) from exc

    async def _embed_and_write(self, session: str, todo: Sequence[events.Event], *, tenant: str | None) -> int:
        rows = [
            ChunkRow(event_id=int(e.id or 0), chunk=n, kind=e.kind, source=e.source, ts=e.ts, text=text)
            for e in todo
            for n, text in enumerate(event_chunks(e, self.policy))
        ]
        vectors = await self.embedder.embed([r.text for r in rows])
        if rows:
            await self.store.ensure_model_index(self.embedder.model, int(vectors.shape[1]))
        fresh = await self.store.write(
            session=session,
            tenant=tenant,
            model=self.embedder.model,
            event_ids=[int(e.id or 0) for e in todo],
            rows=rows,
            vectors=vectors,
        )
        return len(fresh)

    async def _write_one_by_one(self, session: str, todo: Sequence[events.Event], *, tenant: str | None) -> int:
        """After a batch failed on a value: each event alone, so only the guilty ones fail."""
        written = 0
        failed: dict[int, DataError] = {}
        for event in todo:
            try:
                written += await self._write(session, [event], tenant=tenant)
            except DataError as exc:
                failed[int(event.id or 0)] = exc
        if failed:
            first = next(iter(failed.values()))
            raise DataError(
                f"{len(failed)} of {len(todo)} events cannot be indexed; {first}", event_ids=frozenset(failed)
            ) from first
        return written

    # --- recall ------------------------------------------------------------------------

    async def recall(
        self,
        action: events.Recall,
        *,
        session: str,
        tenant: str | None,
        workspace: Path | None,
        conversation_instructions: str | None = None,
        timeout: float | None = None,
    ) -> events.RecallResult:
        """Answer a ``recall`` action (``cause`` is the action's id) within ``timeout``
        seconds (default :attr:`recall_timeout`), or raise UnavailableError."""
        timeout = self.recall_timeout if timeout is None else timeout
        try:
            with anyio.fail_after(timeout):
                if action.recall_type == "workspace_context":
                    ctx = await anyio.to_thread.run_sync(
                        lambda: workspace_context(workspace, conversation_instructions=conversation_instructions)
                    )
                    return events.RecallResult(
                        cause=action.id,
                        tenant=tenant,
                        recall_type="workspace_context",
                        repo_name=ctx.repo_name,
                        repo_branch=ctx.repo_branch,
                        repo_directory=ctx.repo_directory,
                        repo_instructions=ctx.repo_instructions,
                        runtime_info=ctx.runtime_info,
                        date=ctx.date,
                        conversation_instructions=ctx.conversation_instructions,
                    )
                if action.recall_type == "knowledge":
                    knowledge = await anyio.to_thread.run_sync(self.knowledge, action.query, workspace)
                    return events.RecallResult(
                        cause=action.id, tenant=tenant, recall_type="knowledge", knowledge=knowledge
                    )
                # the statement gets most of what is left, so Postgres cancels it before the deadline
                hits = await self.search(
                    action.query,
                    session=session,
                    tenant=tenant,
                    k=action.k,
                    scope=action.scope,
                    timeout=timeout * 0.8,
                )
                return events.RecallResult(cause=action.id, tenant=tenant, recall_type="semantic", hits=hits)
        except TimeoutError as exc:
            raise UnavailableError(f"recall did not finish within {timeout:g}s; try again") from exc

    def knowledge(self, query: str, workspace: Path | None) -> list[events.Knowledge]:
        """Knowledge microagents triggered by ``query`` (blocking file reads)."""
        agents = load_microagents([*self.microagent_dirs, *workspace_dirs(workspace)])
        return match_knowledge(agents, query)

    async def search(self, query: str, **options: Unpack[SearchOptions]) -> list[events.Hit]:
        """Hybrid semantic search: vector and full-text candidates fused by RRF.

        ``scope="tenant"`` spans the tenant's sessions; sessions without a tenant share nothing,
        so for them it is the session alone.  The query is embedded first; both searches then
        run in one statement, which ``timeout`` bounds (with the wait for its connection)."""
        return [match.hit for match in await self.search_explained(query, **options)]

    async def search_explained(
        self,
        query: str,
        *,
        session: str,
        tenant: str | None,
        k: int = 5,
        scope: str = "session",
        now: dt.datetime | None = None,
        timeout: float | None = None,
    ) -> list[Match]:
        """:meth:`search`'s hits, each with why it matched (by meaning, by words, or both)."""
        query = searchable(query)
        if k < 1 or not query.strip():
            return []
        k = min(k, 100)
        if isinstance(self.embedder, CachedEmbedder):
            vector = await self.embedder.embed_query(query)
        else:
            vector = (await self.embedder.embed([query]))[0]
        by_vector, by_text = await self.store.search(
            vector,
            query,
            model=self.embedder.model,
            k=max(self.candidates, k * 2),
            tenant=tenant,
            session=None if scope == "tenant" and tenant is not None else session,
            timeout=timeout,
        )
        return explained_rank(
            by_vector,
            by_text,
            query_words(query),
            k=k,
            now=now or dt.datetime.now(dt.UTC),
            half_life_seconds=self.half_life_seconds,
        )

    # --- model migration ---------------------------------------------------------------

    async def reembed(self, *, batch_size: int = 64, max_batches: int | None = None, pause: float = 0.0) -> int:
        """Re-embed, batch by batch, chunks written by another model with the current one.

        Meant to run in the background after the embedder changed; until it is done,
        recall simply does not see the rows still on the old model.  Returns rows updated.
        """
        total = 0
        batches = 0
        while max_batches is None or batches < max_batches:
            stale = await self.store.stale_rows(self.embedder.model, batch_size)
            if not stale:
                break
            vectors = await self.embedder.embed([r.text for r in stale])
            await self.store.ensure_model_index(self.embedder.model, int(vectors.shape[1]))
            total += await self.store.replace_embeddings(self.embedder.model, stale, vectors)
            batches += 1
            log.info("memory_reembedded", rows=len(stale), total=total, model=self.embedder.model)
            if pause:
                await anyio.sleep(pause)
        return total

"""The memory store: indexed chunks, the indexing tracker and the shared embedding cache
in Postgres + pgvector (layout in :mod:`riverbed.memory.migrations`).

A thin adapter: it writes rows and runs the two kinds of search the recall needs, and
translates every asyncpg/OSError failure into :class:`~riverbed.errors.UnavailableError`.

- Session scope is an exact scan (B-tree on ``session``, distance computed on every row
  of the session): HNSW with such a selective filter returns too few rows.
- Tenant scope uses the per-model partial HNSW index with ``hnsw.iterative_scan``
  (pgvector 0.8), so a filter on the tenant still yields ``k`` rows.
"""

# ruff: noqa: S608  (SQL text only interpolates the validated, quoted schema name and model literal)
from __future__ import annotations

import contextlib
import datetime as dt
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Self

import asyncpg
import numpy as np
from asyncpg.pool import PoolConnectionProxy
from pgvector.asyncpg import register_vector

from riverbed.memory import migrations
from riverbed.memory.embedders import Vectors
from riverbed.memory.migrations import quote_literal
from riverbed.pg import LOCK_KEY, LazyPool, check_schema

__all__ = ["Candidate", "ChunkRow", "StaleRow", "Store", "query_words"]

_WORD_RE = re.compile(r"[^\W_]+", re.UNICODE)
_CHUNK_COLUMNS = ["session", "event_id", "chunk", "tenant", "kind", "source", "ts", "text", "model", "embedding"]


@dataclass(frozen=True, slots=True)
class ChunkRow:
    """One chunk to index (the embedding is passed alongside)."""

    event_id: int
    chunk: int
    kind: str
    source: str
    ts: dt.datetime
    text: str


@dataclass(frozen=True, slots=True)
class Candidate:
    """A search result: ``score`` is cosine similarity (vector search) or ts_rank (text search)."""

    session: str
    event_id: int
    chunk: int
    kind: str
    ts: dt.datetime
    text: str
    score: float


@dataclass(frozen=True, slots=True)
class StaleRow:
    session: str
    event_id: int
    chunk: int
    text: str


TEXT_CANDIDATES = 300
"""Matching rows a full-text query ranks at most."""
EF_SEARCH = 100
"""HNSW candidate list for tenant-scope search (pgvector's default of 40 loses recall on large indexes)."""


def query_words(query: str, limit: int = 32) -> list[str]:
    """Distinct lowercase words of a query, for an OR-ed full-text query."""
    seen: dict[str, None] = {}
    for word in _WORD_RE.findall(query.lower()):
        seen.setdefault(word, None)
        if len(seen) >= limit:
            break
    return list(seen)


def _tenant(tenant: str | None) -> str:
    return tenant or ""


class Store:
    """An asyncpg pool over one schema.  The constructor does no I/O; :meth:`start`
    connects, applies migrations and registers the pgvector codecs."""

    def __init__(
        self,
        url: str,
        *,
        schema: str = "rb",
        min_size: int = 1,
        max_size: int = 10,
        connect_timeout: float = 5.0,
        command_timeout: float = 30.0,
    ) -> None:
        self.url = url
        self.schema = schema
        self._s = check_schema(schema)
        self._vector_schema = "public"
        self._indexed_models: set[str] = set()
        self._pg = LazyPool(
            url,
            what="memory database",
            prepare=self._prepare,
            init=self._init_connection,
            min_size=min_size,
            max_size=max_size,
            connect_timeout=connect_timeout,
            command_timeout=command_timeout,
        )

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, migrate (safe when several workers start at once) and open the pool.

        Concurrent calls (one per session a worker serves) share one pool."""
        await self._pg.start()

    async def _prepare(self, conn: asyncpg.Connection[asyncpg.Record]) -> None:
        await migrations.apply(conn, self.schema)
        found = await conn.fetchval(
            "SELECT extnamespace::regnamespace::text FROM pg_extension WHERE extname = 'vector'"
        )
        self._vector_schema = str(found or "public")

    async def _init_connection(self, conn: asyncpg.Connection[asyncpg.Record]) -> None:
        await register_vector(conn, schema=self._vector_schema)

    async def close(self) -> None:
        await self._pg.close()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _conn(self) -> contextlib.AbstractAsyncContextManager[PoolConnectionProxy[asyncpg.Record]]:
        return self._pg.connection()

    async def ensure_model_index(self, model: str, dim: int) -> None:
        """Create the HNSW index for ``model`` rows if missing (once per store)."""
        if model in self._indexed_models:
            return
        async with self._conn() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", LOCK_KEY)
            await conn.execute(migrations.hnsw_index_sql(self.schema, model, dim))
        self._indexed_models.add(model)

    # --- indexing ----------------------------------------------------------------------

    async def indexed(self, session: str, event_ids: Iterable[int]) -> set[int]:
        """Which of ``event_ids`` already went through indexing."""
        ids = list(event_ids)
        if not ids:
            return set()
        async with self._conn() as conn:
            rows = await conn.fetch(
                f"SELECT event_id FROM {self._s}.memory_indexed WHERE session = $1 AND event_id = ANY($2::bigint[])",
                session,
                ids,
            )
        return {int(r["event_id"]) for r in rows}

    async def write(
        self,
        *,
        session: str,
        tenant: str | None,
        model: str,
        event_ids: Sequence[int],
        rows: Sequence[ChunkRow],
        vectors: Vectors,
    ) -> set[int]:
        """In one transaction: track ``event_ids`` and insert the chunks of the ones that were
        not tracked yet.  Returns the event ids written now (a redelivery writes nothing)."""
        if len(rows) != len(vectors):
            raise ValueError("one vector per chunk row is needed")
        counts: dict[int, int] = dict.fromkeys(event_ids, 0)
        for row in rows:
            counts[row.event_id] = counts.get(row.event_id, 0) + 1
        async with self._conn() as conn, conn.transaction():
            new = await conn.fetch(
                f"INSERT INTO {self._s}.memory_indexed (session, event_id, chunks) "
                "SELECT $1, e, c FROM unnest($2::bigint[], $3::integer[]) AS t(e, c) "
                "ON CONFLICT DO NOTHING RETURNING event_id",
                session,
                list(counts),
                list(counts.values()),
            )
            fresh = {int(r["event_id"]) for r in new}
            records = [
                (session, r.event_id, r.chunk, _tenant(tenant), r.kind, r.source, r.ts, r.text, model, vector)
                for r, vector in zip(rows, vectors, strict=True)
                if r.event_id in fresh
            ]
            if records:
                await conn.copy_records_to_table(
                    "memory_chunks",
                    schema_name=self.schema,
                    columns=_CHUNK_COLUMNS,
                    records=records,
                )
        return fresh

    # --- search ------------------------------------------------------------------------

    async def vector_search(
        self,
        vector: Vectors,
        *,
        model: str,
        k: int,
        tenant: str | None,
        session: str | None = None,
    ) -> list[Candidate]:
        """Nearest chunks of ``model`` by cosine similarity: exact within a session,
        HNSW (iterative scan) across the tenant when ``session`` is None."""
        query = np.asarray(vector, dtype=np.float32).reshape(-1)
        cols = "session, event_id, chunk, kind, ts, text"
        async with self._conn() as conn:
            if session is not None:
                rows = await conn.fetch(
                    f"SELECT {cols}, embedding <=> $1::halfvec AS distance FROM {self._s}.memory_chunks "
                    "WHERE session = $2 AND tenant = $3 AND model = $4 ORDER BY distance LIMIT $5",
                    query,
                    session,
                    _tenant(tenant),
                    model,
                    k,
                )
            else:
                dim = int(query.shape[0])
                async with conn.transaction():
                    await conn.execute("SET LOCAL hnsw.iterative_scan = relaxed_order")
                    ef_search = str(min(1000, max(EF_SEARCH, 4 * k)))
                    await conn.execute("SELECT set_config('hnsw.ef_search', $1, true)", ef_search)
                    rows = await conn.fetch(
                        f"SELECT {cols}, embedding::halfvec({dim}) <=> $1::halfvec({dim}) AS distance "
                        f"FROM {self._s}.memory_chunks WHERE model = {quote_literal(model)} AND tenant = $2 "
                        "ORDER BY distance LIMIT $3",
                        query,
                        _tenant(tenant),
                        k,
                    )
            # relaxed_order may return rows slightly out of order (and PG elides a re-sort in SQL)
            rows = sorted(rows, key=lambda r: float(r["distance"]))
        return [_candidate(r, 1.0 - float(r["distance"])) for r in rows]

    async def text_search(
        self,
        query: str,
        *,
        k: int,
        tenant: str | None,
        session: str | None = None,
    ) -> list[Candidate]:
        """Chunks matching the words of ``query`` (English stemming), best ``ts_rank_cd`` first.

        Chunks with every word come first; when they are fewer than ``k``, chunks with any word
        fill up.  Each query ranks at most :data:`TEXT_CANDIDATES` matching rows, so a common
        word in a large index costs a bounded amount (the vector half of a recall does not
        depend on it).
        """
        words = query_words(query)
        if not words:
            return []
        if session is not None:
            # One session is small: take its rows first, then match (no index-wide bitmap).
            source = (
                f"(SELECT session, event_id, chunk, kind, ts, text, tsv FROM {self._s}.memory_chunks "
                "WHERE session = $4 AND tenant = $2 OFFSET 0) AS c"
            )
            where = "TRUE"
        else:
            source = f"{self._s}.memory_chunks"
            where = "tenant = $2"
        sql = (
            "SELECT session, event_id, chunk, kind, ts, text, ts_rank_cd(tsv, q) AS rank "
            f"FROM (SELECT session, event_id, chunk, kind, ts, text, tsv FROM {source} "
            f"WHERE tsv @@ to_tsquery('english', $1) AND {where} LIMIT {TEXT_CANDIDATES}) AS m, "
            "to_tsquery('english', $1) AS q ORDER BY rank DESC LIMIT $3"
        )
        found: dict[tuple[str, int, int], Candidate] = {}
        async with self._conn() as conn, conn.transaction():
            # Across a tenant, a common word matches most rows: let the GIN index stop early.
            await conn.execute(f"SET LOCAL gin_fuzzy_search_limit = {TEXT_CANDIDATES * 10}")
            for joiner in (" & ", " | ") if len(words) > 1 else (" | ",):
                args: list[Any] = [joiner.join(words), _tenant(tenant), k]
                if session is not None:
                    args.append(session)
                for row in await conn.fetch(sql, *args):
                    found.setdefault(
                        (row["session"], row["event_id"], row["chunk"]), _candidate(row, float(row["rank"]))
                    )
                if len(found) >= k:
                    break
        return list(found.values())[:k]

    # --- embedding cache (shared level) ------------------------------------------------

    async def cache_get(self, model: str, hashes: Sequence[bytes]) -> dict[bytes, Vectors]:
        if not hashes:
            return {}
        async with self._conn() as conn:
            rows = await conn.fetch(
                f"SELECT hash, embedding FROM {self._s}.embedding_cache WHERE model = $1 AND hash = ANY($2::bytea[])",
                model,
                list(hashes),
            )
        return {bytes(r["hash"]): r["embedding"].to_numpy().astype(np.float32) for r in rows}

    async def cache_put(self, model: str, hashes: Sequence[bytes], vectors: Vectors) -> None:
        if not hashes:
            return
        async with self._conn() as conn:
            await conn.executemany(
                f"INSERT INTO {self._s}.embedding_cache (model, hash, embedding) VALUES ($1, $2, $3) "
                "ON CONFLICT DO NOTHING",
                [(model, h, v) for h, v in zip(hashes, vectors, strict=True)],
            )

    # --- re-embedding ------------------------------------------------------------------

    async def stale_rows(self, model: str, limit: int) -> list[StaleRow]:
        """Up to ``limit`` chunks embedded by a model other than ``model``."""
        async with self._conn() as conn:
            rows = await conn.fetch(
                f"SELECT session, event_id, chunk, text FROM {self._s}.memory_chunks WHERE model <> $1 LIMIT $2",
                model,
                limit,
            )
        return [StaleRow(r["session"], int(r["event_id"]), int(r["chunk"]), r["text"]) for r in rows]

    async def replace_embeddings(self, model: str, rows: Sequence[StaleRow], vectors: Vectors) -> int:
        """Store ``model``'s vectors for ``rows`` (rows already on ``model`` are left alone)."""
        async with self._conn() as conn:
            await conn.executemany(
                f"UPDATE {self._s}.memory_chunks SET model = $1, embedding = $2 "
                "WHERE session = $3 AND event_id = $4 AND chunk = $5 AND model <> $1",
                [(model, v, r.session, r.event_id, r.chunk) for r, v in zip(rows, vectors, strict=True)],
            )
        return len(rows)

    # --- inspection --------------------------------------------------------------------

    async def counts(self, session: str | None = None) -> dict[str, int]:
        """Rows in the chunk and tracking tables (of one session, or all)."""
        where, args = ("WHERE session = $1", [session]) if session is not None else ("", [])
        async with self._conn() as conn:
            chunks = await conn.fetchval(f"SELECT count(*) FROM {self._s}.memory_chunks {where}", *args)
            tracked = await conn.fetchval(f"SELECT count(*) FROM {self._s}.memory_indexed {where}", *args)
            cached = await conn.fetchval(f"SELECT count(*) FROM {self._s}.embedding_cache")
        return {"chunks": int(chunks), "indexed": int(tracked), "cached": int(cached)}

    async def models(self) -> dict[str, int]:
        """Chunk rows per embedding model."""
        async with self._conn() as conn:
            rows = await conn.fetch(f"SELECT model, count(*) AS n FROM {self._s}.memory_chunks GROUP BY model")
        return {r["model"]: int(r["n"]) for r in rows}


def _candidate(row: asyncpg.Record, score: float) -> Candidate:
    return Candidate(
        session=row["session"],
        event_id=int(row["event_id"]),
        chunk=int(row["chunk"]),
        kind=row["kind"],
        ts=row["ts"],
        text=row["text"],
        score=score,
    )

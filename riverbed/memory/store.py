"""The memory store: indexed chunks, the indexing tracker and the shared embedding cache
in Postgres + pgvector (layout in :mod:`riverbed.memory.migrations`).

A thin adapter: it writes rows and runs the two kinds of search the recall needs (both in
one statement, :meth:`Store.search`).  Driver errors are translated once, by the pool
(:func:`riverbed.pg.translate_error`): :class:`~riverbed.errors.UnavailableError` when
Postgres cannot be reached or does not answer in time, :class:`~riverbed.errors.DataError`
when it cannot hold a value.  A search takes a ``timeout`` that bounds both the wait for a
connection and the statement (asyncpg cancels it on the server when it runs out).

- Vector, session scope: an exact scan (B-tree on ``session``, distance computed on every
  row of the session): HNSW with such a selective filter returns too few rows.
- Vector, tenant scope: the per-model partial HNSW index with ``hnsw.iterative_scan``
  (pgvector 0.8), so a filter on the tenant still yields ``k`` rows; the function
  ``memory_nearest`` (see :mod:`~riverbed.memory.migrations`) carries those settings, so a
  search needs no transaction around it.
- Full text: a GIN index costs time in proportion to the rows a word matches, and a
  bounded sample of a common word's thousands of rows would be noise, not a ranking.  So
  only *selective* words pick candidates: words that the planner's own statistics
  (``pg_stats`` of the ``tsv`` column) put in at most :data:`SELECTIVE_ROWS` rows, or do
  not list at all.  Every word of the query ranks them (``ts_rank_cd``), rows with all the
  words first.  A table never analysed has no statistics: every word is selective.
"""

# ruff: noqa: S608  (SQL text only interpolates the validated, quoted schema name, placeholders and constants)
from __future__ import annotations

import contextlib
import datetime as dt
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Self, Unpack

import asyncpg
import numpy as np
from asyncpg.pool import PoolConnectionProxy
from pgvector.asyncpg import register_vector

from riverbed.memory import migrations
from riverbed.memory.embedders import Vectors
from riverbed.pg import LOCK_KEY, LazyPool, PoolOptions, check_schema

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
SELECTIVE_ROWS = 1000
"""A word estimated in more rows than this ranks full-text candidates but does not pick them."""
WORD_STATS_TTL = 60.0
"""Seconds the store keeps the table's common words before it reads ``pg_stats`` again."""
EF_SEARCH = 64
"""HNSW candidate list for tenant-scope search, at least ``k`` (pgvector's default of 40
loses recall on large indexes; see :data:`~riverbed.memory.migrations.HNSW_EF_CONSTRUCTION`)."""
EF_SEARCH_OLD_INDEX = 100
"""The same for an index built before with pgvector's default ``ef_construction`` (64)."""


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


class _Params:
    """Positional parameters of one statement: ``add`` returns the placeholder of a value."""

    def __init__(self) -> None:
        self.values: list[Any] = []

    def add(self, value: Any) -> str:
        self.values.append(value)
        return f"${len(self.values)}"


class Store:
    """An asyncpg pool over one schema.  The constructor does no I/O; :meth:`start`
    connects, applies migrations and registers the pgvector codecs."""

    def __init__(self, url: str, *, schema: str = "rb", **pool: Unpack[PoolOptions]) -> None:
        self.url = url
        self.schema = schema
        self._s = check_schema(schema)
        self._vector_schema = "public"
        self._indexed_models: set[str] = set()
        self._ef_search: dict[str, int] = {}
        self._common_words: list[str] = []
        self._common_words_at = -WORD_STATS_TTL
        self._pg = LazyPool(url, what="memory database", prepare=self._prepare, init=self._init_connection, **pool)

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

    def _conn(
        self, timeout: float | None = None
    ) -> contextlib.AbstractAsyncContextManager[PoolConnectionProxy[asyncpg.Record]]:
        return self._pg.connection(timeout=timeout)

    async def ensure_model_index(self, model: str, dim: int) -> None:
        """Create the HNSW index for ``model`` rows if missing (once per store)."""
        if model in self._indexed_models:
            return
        async with self._conn() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", LOCK_KEY)
            await conn.execute(migrations.hnsw_index_sql(self.schema, model, dim))
        self._indexed_models.add(model)

    # --- indexing ----------------------------------------------------------------------

    async def start_log(self, session: str, created: str) -> bool:
        """Record which log of ``session`` is indexed (its creation stamp); when the rows on
        hand come from an earlier log under the same id (Redis lost it and the session started
        over), drop them, so old events are neither recalled as the new ones nor skipped as
        indexed.  Returns True when rows were dropped."""
        async with self._conn() as conn, conn.transaction():
            old = await conn.fetchval(
                f"SELECT created FROM {self._s}.memory_logs WHERE session = $1 FOR UPDATE", session
            )
            if old == created:
                return False
            if old is not None:
                await conn.execute(f"DELETE FROM {self._s}.memory_chunks WHERE session = $1", session)
                await conn.execute(f"DELETE FROM {self._s}.memory_indexed WHERE session = $1", session)
            await conn.execute(
                f"INSERT INTO {self._s}.memory_logs (session, created) VALUES ($1, $2) "
                "ON CONFLICT (session) DO UPDATE SET created = EXCLUDED.created",
                session,
                created,
            )
            return old is not None

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
        by_vector, _ = await self.search(vector, None, model=model, k=k, tenant=tenant, session=session)
        return by_vector

    async def text_search(
        self,
        query: str,
        *,
        k: int,
        tenant: str | None,
        session: str | None = None,
    ) -> list[Candidate]:
        """Chunks matching the selective words of ``query`` (English stemming), rows with
        every word first, then by ``ts_rank_cd`` over all the words; at most
        :data:`TEXT_CANDIDATES` matching rows are ranked."""
        _, by_text = await self.search(None, query, model="", k=k, tenant=tenant, session=session)
        return by_text

    async def search(
        self,
        vector: Vectors | None,
        query: str | None,
        *,
        model: str,
        k: int,
        tenant: str | None,
        session: str | None = None,
        timeout: float | None = None,
    ) -> tuple[list[Candidate], list[Candidate]]:
        """Up to ``k`` vector candidates (nearest first; none without ``vector``) and up to
        ``k`` full-text candidates (best first; none without ``query``), in one statement.

        ``session`` narrows both to one session (an exact vector scan); without it they span
        the tenant (HNSW).  The vector score is cosine similarity, the text score ts_rank_cd.
        ``timeout`` (seconds) bounds the wait for a connection and each statement; past it
        the statement is cancelled on the server and UnavailableError raised.
        """
        words = query_words(query) if query is not None else []
        if (vector is None and not words) or k < 1:
            return [], []
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.001, deadline - time.monotonic())

        params = _Params()
        tenant_ = params.add(_tenant(tenant))
        session_ = params.add(session) if session is not None else None
        limit = params.add(k)
        ctes: list[str] = []
        parts: list[str] = []
        async with self._conn(timeout) as conn:
            if vector is not None:
                query_vector = np.asarray(vector, dtype=np.float32).reshape(-1)
                if session_ is None:
                    ef_search = min(1000, max(await self._ef_search_for(conn, model, left()), k))
                    parts.append(
                        self._nearest_sql(query_vector, model, params, ef_search, tenant_=tenant_, limit=limit)
                    )
                else:
                    parts.append(
                        self._exact_sql(query_vector, model, params, tenant_=tenant_, session_=session_, limit=limit)
                    )
            if words:
                common = params.add(await self._common(conn, left()))
                ctes.append(_QUERY_TERMS_SQL.format(query=params.add(" ".join(words)), common=common))
                parts.append(self._text_sql(tenant_=tenant_, session_=session_, limit=limit))
            sql = ("WITH " + ", ".join(ctes) + " " if ctes else "") + " UNION ALL ".join(parts)
            rows = await conn.fetch(sql, *params.values, timeout=left())
        # relaxed_order may return rows slightly out of order (and PG elides a re-sort in SQL)
        by_vector = sorted((r for r in rows if r["distance"] is not None), key=lambda r: float(r["distance"]))
        return (
            [_candidate(r, 1.0 - float(r["distance"])) for r in by_vector],
            [_candidate(r, float(r["rank"])) for r in rows if r["distance"] is None],
        )

    def _nearest_sql(
        self, query: Vectors, model: str, params: _Params, ef_search: int, *, tenant_: str, limit: str
    ) -> str:
        """HNSW across the tenant, with its settings, in one call (migrations: memory_nearest)."""
        args = f"{params.add(query)}::halfvec, {tenant_}, {params.add(model)}, {limit}, {params.add(ef_search)}"
        return (
            f"(SELECT session, event_id, chunk, kind, ts, text, distance, NULL::real AS rank "
            f"FROM {self._s}.memory_nearest({args}))"
        )

    def _exact_sql(
        self, query: Vectors, model: str, params: _Params, *, tenant_: str, session_: str, limit: str
    ) -> str:
        """Every row of one session, nearest first."""
        return (
            f"(SELECT session, event_id, chunk, kind, ts, text, embedding <=> {params.add(query)}::halfvec "
            f"AS distance, NULL::real AS rank FROM {self._s}.memory_chunks "
            f"WHERE session = {session_} AND tenant = {tenant_} AND model = {params.add(model)} "
            f"ORDER BY distance LIMIT {limit})"
        )

    async def _ef_search_for(
        self, conn: PoolConnectionProxy[asyncpg.Record], model: str, timeout: float | None = None
    ) -> int:
        """:data:`EF_SEARCH`, or :data:`EF_SEARCH_OLD_INDEX` when the model's HNSW index was
        built with a shorter candidate list than ``HNSW_EF_CONSTRUCTION`` (read once)."""
        known = self._ef_search.get(model)
        if known is not None:
            return known
        options = await conn.fetchval(
            "SELECT coalesce(reloptions, '{}') FROM pg_class WHERE oid = to_regclass($1)",
            f"{self._s}.{migrations.quote_ident(migrations.hnsw_index_name(model))}",
            timeout=timeout,
        )
        if options is None:  # no index yet: nothing to search with HNSW (asked again next time)
            return EF_SEARCH
        built = dict(option.split("=", 1) for option in options)
        old = int(built.get("ef_construction", 64)) < migrations.HNSW_EF_CONSTRUCTION
        self._ef_search[model] = EF_SEARCH_OLD_INDEX if old else EF_SEARCH
        return self._ef_search[model]

    def _text_sql(self, *, tenant_: str, session_: str | None, limit: str) -> str:
        where = f"c.tenant = {tenant_}" + (f" AND c.session = {session_}" if session_ is not None else "")
        return (
            "(SELECT session, event_id, chunk, kind, ts, text, NULL::float8 AS distance, rank FROM "
            "(SELECT m.*, ts_rank_cd(m.tsv, q.any_word) AS rank, m.tsv @@ q.every_word AS every FROM q, "
            f"LATERAL (SELECT session, event_id, chunk, kind, ts, text, tsv FROM {self._s}.memory_chunks AS c "
            f"WHERE c.tsv @@ q.selective AND {where} LIMIT {TEXT_CANDIDATES}) AS m) AS t "
            f"ORDER BY every DESC, rank DESC LIMIT {limit})"
        )

    async def _common(self, conn: PoolConnectionProxy[asyncpg.Record], timeout: float | None = None) -> list[str]:
        """Words (lexemes) the planner's statistics put in more than :data:`SELECTIVE_ROWS`
        rows; read again after :data:`WORD_STATS_TTL` seconds."""
        now = time.monotonic()
        if now - self._common_words_at < WORD_STATS_TTL:
            return self._common_words
        row = await conn.fetchrow(
            "SELECT most_common_elems::text::text[] AS words, most_common_elem_freqs AS freqs, "
            f"(SELECT reltuples FROM pg_class WHERE oid = '{self._s}.memory_chunks'::regclass) AS tuples "
            "FROM pg_stats WHERE schemaname = $1 AND tablename = 'memory_chunks' AND attname = 'tsv'",
            self.schema,
            timeout=timeout,
        )
        common: list[str] = []
        if row is not None and row["words"] is not None:
            tuples = max(float(row["tuples"]), 0.0)
            # the frequencies end with three summary figures (min, max, null fraction)
            common = [w for w, f in zip(row["words"], row["freqs"], strict=False) if f * tuples > SELECTIVE_ROWS]
        self._common_words, self._common_words_at = common, now
        return common

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


_QUERY_TERMS_SQL = """
words AS (
    SELECT w.lexeme, w.lexeme = ANY({common}::text[]) AS common
    FROM unnest(tsvector_to_array(to_tsvector('english', {query}))) AS w(lexeme)
), q AS (
    SELECT string_agg(term, ' | ')::tsquery AS any_word,
           string_agg(term, ' & ')::tsquery AS every_word,
           string_agg(term, ' | ') FILTER (WHERE NOT common)::tsquery AS selective
    FROM (SELECT '''' || lexeme || '''' AS term, common FROM words) AS quoted
)"""
"""The query's lexemes as three tsqueries: any word, every word, any selective word.  The
words are letters and digits (:func:`query_words`), so a lexeme needs no escaping."""


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

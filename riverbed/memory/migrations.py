"""Versioned schema migrations of the memory store.

Everything lives in one Postgres schema named after the riverbed prefix.  Migrations
are numbered, applied in order inside one transaction that holds a transaction-level
advisory lock, and recorded in ``<schema>.memory_migrations``: any number of workers
may start at once, the first applies what is missing and the others find it done.

Tables (``<s>`` is the schema):

``<s>.memory_chunks``
    one row per indexed chunk: ``session, event_id, chunk`` (primary key), ``tenant``
    ('' when the session has none), ``kind``, ``source``, ``ts``, ``text``, ``model``
    (the embedder that produced ``embedding``), ``embedding halfvec`` (its width is the
    model's; an HNSW index per model is a partial expression index, see
    :func:`hnsw_index_sql`), ``tsv`` (generated English tsvector, GIN-indexed without a
    pending list, migration 2).
``<s>.memory_nearest(query, tenant, model, k, ef_search)``
    the ``k`` rows of ``model`` in ``tenant`` nearest to ``query`` through the model's HNSW
    index (iterative scan, the given ``ef_search``), in one call (migration 3).
``<s>.memory_indexed``
    one row per event that went through indexing (``session, event_id``), written in the
    same transaction as its chunks: a redelivered event finds it and does nothing.
``<s>.embedding_cache``
    ``model, hash`` → ``embedding``: the shared level of the embedding cache.
``<s>.memory_logs``
    ``session`` → ``created``: the creation stamp of the session log the rows were indexed
    from (migration 4); a log created anew under the same id drops the old rows.
"""

from __future__ import annotations

import hashlib

import asyncpg

from riverbed.pg import migrate, quote_ident

__all__ = [
    "HNSW_EF_CONSTRUCTION",
    "HNSW_M",
    "MIGRATIONS",
    "apply",
    "hnsw_index_name",
    "hnsw_index_sql",
    "quote_ident",
    "quote_literal",
]


MIGRATIONS: list[tuple[int, str]] = [
    (
        1,
        """
        CREATE TABLE {s}.memory_chunks (
            session   text        NOT NULL,
            event_id  bigint      NOT NULL,
            chunk     integer     NOT NULL,
            tenant    text        NOT NULL DEFAULT '',
            kind      text        NOT NULL,
            source    text        NOT NULL,
            ts        timestamptz NOT NULL,
            text      text        NOT NULL,
            model     text        NOT NULL,
            embedding halfvec     NOT NULL,
            tsv       tsvector    GENERATED ALWAYS AS (to_tsvector('english', text)) STORED,
            PRIMARY KEY (session, event_id, chunk)
        );
        CREATE INDEX memory_chunks_tenant ON {s}.memory_chunks (tenant, model);
        CREATE INDEX memory_chunks_model ON {s}.memory_chunks (model);
        CREATE INDEX memory_chunks_tsv ON {s}.memory_chunks USING gin (tsv);
        CREATE TABLE {s}.memory_indexed (
            session    text        NOT NULL,
            event_id   bigint      NOT NULL,
            chunks     integer     NOT NULL,
            indexed_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (session, event_id)
        );
        CREATE TABLE {s}.embedding_cache (
            model     text    NOT NULL,
            hash      bytea   NOT NULL,
            embedding halfvec NOT NULL,
            PRIMARY KEY (model, hash)
        );
        """,
    ),
    (
        2,
        # A GIN index with fastupdate keeps new entries in a pending list (up to 4 MB) that
        # every search reads from start to end: ~2.5 ms per full-text query when it is full.
        # Without it each insert updates the index itself (indexing is embedding-bound).
        """
        ALTER INDEX {s}.memory_chunks_tsv SET (fastupdate = off);
        SELECT gin_clean_pending_list('{s}.memory_chunks_tsv'::regclass);
        """,
    ),
    (
        3,
        # The HNSW search of a tenant needs two settings; a function's SET clauses apply them
        # for the call alone, so a search is one statement instead of a transaction of four.
        # The query is dynamic so that its expression and model literal match the model's
        # partial index (see hnsw_index_sql).
        """
        CREATE FUNCTION {s}.memory_nearest(query halfvec, tenant_ text, model_ text, k integer, ef_search integer)
        RETURNS TABLE (session text, event_id bigint, chunk integer, kind text, ts timestamptz, text text,
                       distance double precision)
        LANGUAGE plpgsql
        SET hnsw.iterative_scan = relaxed_order
        SET hnsw.ef_search = 40  -- set below; the clause restores the caller's value on return
        AS $fn$
        BEGIN
            PERFORM set_config('hnsw.ef_search', ef_search::text, true);
            RETURN QUERY EXECUTE format(
                'SELECT session, event_id, chunk, kind, ts, text, '
                'embedding::halfvec(%1$s) <=> $1::halfvec(%1$s) AS distance FROM {s}.memory_chunks '
                'WHERE model = %2$L AND tenant = $2 ORDER BY distance LIMIT $3',
                vector_dims(query), model_
            ) USING query, tenant_, k;
        END
        $fn$;
        """,
    ),
    (
        4,
        # Which log of a session the rows describe: Redis may lose a log (FLUSHALL, a restart
        # without persistence) and the session id start again from event 1.
        """
        CREATE TABLE {s}.memory_logs (
            session text PRIMARY KEY,
            created text NOT NULL
        );
        """,
    ),
]


def quote_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def hnsw_index_name(model: str) -> str:
    return "memory_chunks_hnsw_" + hashlib.sha256(model.encode()).hexdigest()[:16]


HNSW_M = 16
"""Graph degree of the HNSW index (pgvector's default)."""
HNSW_EF_CONSTRUCTION = 128
"""Candidate list while building: twice pgvector's default, so a search reaches the same
recall with a shorter list (recall@10 at 100,000 rows: 0.98 with ef_search 64, where the
default graph needs 100); a build takes about 15% longer."""


def hnsw_index_sql(schema: str, model: str, dim: int) -> str:
    """A partial HNSW index over the rows of one model (cosine distance on ``halfvec(dim)``)."""
    return (
        f"CREATE INDEX IF NOT EXISTS {quote_ident(hnsw_index_name(model))} ON {quote_ident(schema)}.memory_chunks "
        f"USING hnsw ((embedding::halfvec({int(dim)})) halfvec_cosine_ops) "
        f"WITH (m = {HNSW_M}, ef_construction = {HNSW_EF_CONSTRUCTION}) WHERE model = {quote_literal(model)}"
    )


async def apply(conn: asyncpg.Connection[asyncpg.Record], schema: str) -> list[int]:
    """Bring ``schema`` up to the latest version; returns the versions applied now."""
    return await migrate(
        conn, schema, table="memory_migrations", migrations=MIGRATIONS, before=["CREATE EXTENSION IF NOT EXISTS vector"]
    )

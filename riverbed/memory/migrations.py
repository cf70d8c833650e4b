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
    :func:`hnsw_index_sql`), ``tsv`` (generated English tsvector, GIN-indexed).
``<s>.memory_indexed``
    one row per event that went through indexing (``session, event_id``), written in the
    same transaction as its chunks: a redelivered event finds it and does nothing.
``<s>.embedding_cache``
    ``model, hash`` → ``embedding``: the shared level of the embedding cache.
"""

from __future__ import annotations

import hashlib

import asyncpg

from riverbed.pg import migrate, quote_ident

__all__ = ["MIGRATIONS", "apply", "hnsw_index_name", "hnsw_index_sql", "quote_ident", "quote_literal"]


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
]


def quote_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def hnsw_index_name(model: str) -> str:
    return "memory_chunks_hnsw_" + hashlib.sha256(model.encode()).hexdigest()[:16]


def hnsw_index_sql(schema: str, model: str, dim: int) -> str:
    """A partial HNSW index over the rows of one model (cosine distance on ``halfvec(dim)``)."""
    return (
        f"CREATE INDEX IF NOT EXISTS {quote_ident(hnsw_index_name(model))} ON {quote_ident(schema)}.memory_chunks "
        f"USING hnsw ((embedding::halfvec({int(dim)})) halfvec_cosine_ops) WHERE model = {quote_literal(model)}"
    )


async def apply(conn: asyncpg.Connection[asyncpg.Record], schema: str) -> list[int]:
    """Bring ``schema`` up to the latest version; returns the versions applied now."""
    return await migrate(
        conn, schema, table="memory_migrations", migrations=MIGRATIONS, before=["CREATE EXTENSION IF NOT EXISTS vector"]
    )

"""The memory store on a real embedded Postgres: migrations, exactly-once writes, exact
per-session search among many sessions, tenant-scope search, failures."""

from __future__ import annotations

import datetime as dt
import socket
import time

import anyio
import asyncpg
import numpy as np
import pytest

from riverbed.errors import ConfigError, DataError, StorageError, UnavailableError
from riverbed.memory import migrations
from riverbed.memory.store import ChunkRow, Store, query_words

pytestmark = pytest.mark.anyio

DIM = 384
MODEL = "random-test-model"


def unit_rows(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    m = rng.standard_normal((n, dim)).astype(np.float32)
    return m / np.linalg.norm(m, axis=1, keepdims=True)


def rows_for(event_ids: list[int], text: str = "text") -> list[ChunkRow]:
    ts = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    return [ChunkRow(event_id=i, chunk=0, kind="message", source="user", ts=ts, text=f"{text} {i}") for i in event_ids]


async def test_migrations_are_idempotent_and_safe_concurrently(database_url: str, prefix: str) -> None:
    applied: list[list[int]] = []

    async def migrate() -> None:
        conn = await asyncpg.connect(database_url)
        try:
            applied.append(await migrations.apply(conn, prefix))
        finally:
            await conn.close()

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(migrate)
    latest = [v for v, _ in migrations.MIGRATIONS]
    assert sorted(applied, key=len)[-1] == latest
    assert sum(len(a) for a in applied) == len(latest)  # each version applied exactly once
    await migrate()
    assert applied[-1] == []
    conn = await asyncpg.connect(database_url)
    try:  # full-text searches never read a GIN pending list
        options = await conn.fetchval(
            f"SELECT reloptions FROM pg_class WHERE oid = '{prefix}.memory_chunks_tsv'::regclass"
        )
    finally:
        await conn.close()
    assert "fastupdate=off" in options

    stores = [Store(database_url, schema=prefix) for _ in range(3)]
    async with anyio.create_task_group() as tg:
        for store in stores:
            tg.start_soon(store.start)
    for store in stores:
        assert (await store.counts())["chunks"] == 0
        await store.close()


async def test_write_is_exactly_once(database_url: str, prefix: str) -> None:
    rng = np.random.default_rng(1)
    async with Store(database_url, schema=prefix) as store:
        rows = rows_for([1, 2, 3])
        vectors = unit_rows(rng, 3)
        first = await store.write(
            session="s1", tenant="acme", model=MODEL, event_ids=[1, 2, 3, 4], rows=rows, vectors=vectors
        )
        assert first == {1, 2, 3, 4}  # event 4 had nothing to index but is tracked
        again = await store.write(
            session="s1", tenant="acme", model=MODEL, event_ids=[1, 2, 3, 4], rows=rows, vectors=vectors
        )
        assert again == set()
        assert await store.counts("s1") == {"chunks": 3, "indexed": 4, "cached": 0}
        assert await store.indexed("s1", [1, 4, 5]) == {1, 4}

        async def concurrent() -> None:
            await store.write(session="s2", tenant="acme", model=MODEL, event_ids=[1, 2, 3], rows=rows, vectors=vectors)

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(concurrent)
        assert await store.counts("s2") == {"chunks": 3, "indexed": 3, "cached": 0}


async def test_session_scope_is_exact_among_many_sessions(database_url: str, prefix: str) -> None:
    rng = np.random.default_rng(7)
    sessions, per_session = 250, 20
    async with Store(database_url, schema=prefix) as store:
        vectors: dict[str, np.ndarray] = {}
        for s in range(sessions):
            name = f"s{s:03d}"
            vectors[name] = unit_rows(rng, per_session)
            tenant = "big" if s < 60 else f"t{s % 7}"
            ids = list(range(1, per_session + 1))
            await store.write(
                session=name, tenant=tenant, model=MODEL, event_ids=ids, rows=rows_for(ids), vectors=vectors[name]
            )
        await store.ensure_model_index(MODEL, DIM)
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute(f"ANALYZE {prefix}.memory_chunks")  # so the planner picks HNSW for the tenant
        finally:
            await conn.close()
        query = unit_rows(rng, 1)[0]
        for name in ("s000", "s150", "s249"):
            tenant = "big" if int(name[1:]) < 60 else f"t{int(name[1:]) % 7}"
            hits = await store.vector_search(query, model=MODEL, k=10, tenant=tenant, session=name)
            assert len(hits) == 10
            assert {h.session for h in hits} == {name}
            exact = vectors[name].astype(np.float16).astype(np.float32) @ query
            assert [h.event_id for h in hits] == [int(i) + 1 for i in np.argsort(-exact)[:10]]
            assert hits[0].score == pytest.approx(float(exact.max()), abs=2e-3)

        # tenant scope goes through HNSW with iterative scan: a 24% filter still yields k rows
        hits = await store.vector_search(query, model=MODEL, k=30, tenant="big")
        assert len(hits) == 30
        assert all(int(h.session[1:]) < 60 for h in hits)
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
        # a session named under the wrong tenant shows nothing
        assert await store.vector_search(query, model=MODEL, k=5, tenant="t1", session="s000") == []
        # another model's rows are invisible
        assert await store.vector_search(query, model="other", k=5, tenant="big", session="s000") == []


async def test_text_search_matches_any_word(database_url: str, prefix: str) -> None:
    ts = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    texts = ["docker build failed on the base image", "pytest ran 40 tests", "configure nginx upstream timeouts"]
    rows = [
        ChunkRow(event_id=i + 1, chunk=0, kind="cmd_output", source="runtime", ts=ts, text=t)
        for i, t in enumerate(texts)
    ]
    async with Store(database_url, schema=prefix) as store:
        vectors = unit_rows(np.random.default_rng(3), 3)
        await store.write(session="s", tenant=None, model=MODEL, event_ids=[1, 2, 3], rows=rows, vectors=vectors)
        hits = await store.text_search("why did the docker builds fail?", k=5, tenant=None, session="s")
        assert [h.event_id for h in hits] == [1]
        hits = await store.text_search("timeout or tests", k=5, tenant=None)
        assert {h.event_id for h in hits} == {2, 3}
        assert await store.text_search("the of and", k=5, tenant=None) == []
        assert await store.text_search("docker", k=5, tenant="acme") == []


async def test_common_words_rank_text_candidates_but_do_not_pick_them(database_url: str, prefix: str) -> None:
    ts = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    texts = [f"deploy step {i} done" for i in range(1200)]
    texts[10] = texts[500] = "deploy step failed: ticket zebra42 reopened"
    texts[900] = "notes on zebra42"
    rows = [
        ChunkRow(event_id=i + 1, chunk=0, kind="message", source="agent", ts=ts, text=t) for i, t in enumerate(texts)
    ]
    async with Store(database_url, schema=prefix) as store:
        vectors = unit_rows(np.random.default_rng(5), len(rows))
        ids = [r.event_id for r in rows]
        await store.write(session="s", tenant="acme", model=MODEL, event_ids=ids, rows=rows, vectors=vectors)
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute(f"ANALYZE {prefix}.memory_chunks")  # "deploy" is in every row, "zebra42" in 3
        finally:
            await conn.close()
        hits = await store.text_search("deploy zebra42", k=10, tenant="acme")
        assert [h.event_id for h in hits][:2] in ([11, 501], [501, 11])  # every word first
        assert [h.event_id for h in hits][2:] == [901]
        assert await store.text_search("deploy", k=10, tenant="acme") == []  # too common to pick rows
        hits = await store.text_search("zebra42 deploy", k=10, tenant="acme", session="s")
        assert {h.event_id for h in hits} == {11, 501, 901}
        # one statement answers both searches
        by_vector, by_text = await store.search(vectors[900], "zebra42", model=MODEL, k=3, tenant="acme", session=None)
        assert by_vector[0].event_id == 901
        assert {h.event_id for h in by_text} == {11, 501, 901}


def test_query_words() -> None:
    assert query_words("Where's the config.yaml?  the CONFIG") == ["where", "s", "the", "config", "yaml"]
    assert query_words("a_b -- !!") == ["a", "b"]
    assert len(query_words(" ".join(f"w{i}" for i in range(100)))) == 32


async def test_shared_cache_round_trip(database_url: str, prefix: str) -> None:
    rng = np.random.default_rng(5)
    async with Store(database_url, schema=prefix) as store:
        vectors = unit_rows(rng, 2)
        await store.cache_put(MODEL, [b"a" * 32, b"b" * 32], vectors)
        await store.cache_put(MODEL, [b"a" * 32], vectors[:1])  # a second put is a no-op
        got = await store.cache_get(MODEL, [b"a" * 32, b"c" * 32])
        assert list(got) == [b"a" * 32]
        np.testing.assert_allclose(got[b"a" * 32], vectors[0], atol=1e-3)
        assert await store.cache_get("another-model", [b"a" * 32]) == {}


async def test_unreachable_database_fails_fast() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = Store(f"postgresql://postgres@127.0.0.1:{port}/postgres", schema="rb", connect_timeout=1.0)
    started = time.monotonic()
    with pytest.raises(UnavailableError, match="cannot be reached") as info:
        await store.start()
    assert time.monotonic() - started < 10  # the 1 s connect timeout, not retried for long
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(UnavailableError, match="not started"):
        await store.counts()


async def test_a_value_postgres_cannot_hold_is_a_data_error_not_an_outage(database_url: str, prefix: str) -> None:
    """Postgres class 22 (a NUL in text, a NaN in a vector) is the value's fault: DataError,
    never UnavailableError, and the transaction writes nothing; the store keeps working."""
    rng = np.random.default_rng(3)
    async with Store(database_url, schema=prefix) as store:
        nul = [ChunkRow(event_id=1, chunk=0, kind="message", source="user", ts=dt.datetime.now(dt.UTC), text="a\x00b")]
        with pytest.raises(DataError) as info:
            await store.write(session="s", tenant=None, model=MODEL, event_ids=[1], rows=nul, vectors=unit_rows(rng, 1))
        assert not isinstance(info.value, UnavailableError)
        assert getattr(info.value.__cause__, "sqlstate", "").startswith("22")
        nan = unit_rows(rng, 1)
        nan[0, 0] = np.nan
        with pytest.raises(DataError, match="NaN"):
            await store.write(session="s", tenant=None, model=MODEL, event_ids=[2], rows=rows_for([2]), vectors=nan)
        surrogate = [
            ChunkRow(event_id=3, chunk=0, kind="message", source="user", ts=dt.datetime.now(dt.UTC), text="\ud800")
        ]
        with pytest.raises(DataError):
            await store.write(
                session="s", tenant=None, model=MODEL, event_ids=[3], rows=surrogate, vectors=unit_rows(rng, 1)
            )
        assert await store.counts("s") == {"chunks": 0, "indexed": 0, "cached": 0}
        assert await store.write(
            session="s", tenant=None, model=MODEL, event_ids=[4], rows=rows_for([4]), vectors=unit_rows(rng, 1)
        ) == {4}


async def test_a_refused_statement_is_a_storage_error(database_url: str, prefix: str) -> None:
    """Neither the data nor the connection (here: the tables were dropped): StorageError."""
    async with Store(database_url, schema=prefix) as store:
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute(f'DROP TABLE "{prefix}".memory_indexed')
        finally:
            await conn.close()
        with pytest.raises(StorageError) as info:
            await store.indexed("s", [1])
        assert not isinstance(info.value, DataError | UnavailableError)


async def test_a_search_answers_within_its_timeout_while_a_lock_holds_its_table(database_url: str, prefix: str) -> None:
    """A statement that waits on Postgres (here: for a lock) is cancelled at its timeout."""
    async with Store(database_url, schema=prefix) as store:
        await store.counts()
        conn = await asyncpg.connect(database_url)
        try:
            async with conn.transaction():
                await conn.execute(f'LOCK TABLE "{prefix}".memory_chunks IN ACCESS EXCLUSIVE MODE')
                started = time.monotonic()
                with pytest.raises(UnavailableError):
                    await store.search(
                        unit_rows(np.random.default_rng(0), 1)[0],
                        "hello",
                        model=MODEL,
                        k=3,
                        tenant=None,
                        session="s",
                        timeout=1.0,
                    )
                assert time.monotonic() - started < 10  # the 1 s timeout, not the lock's end
        finally:
            await conn.close()
        assert await store.search(None, "hello", model=MODEL, k=3, tenant=None, session="s", timeout=1.0) == ([], [])


def test_bad_schema_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="schema"):
        Store("postgresql://x/y", schema='rb"; drop table x; --')

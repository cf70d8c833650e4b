"""Memory: indexing throughput against the raw embedder, and recall over 100,000 indexed events.

Texts are synthetic but shaped like an agent's log: shell commands with their output
(pytest, git, pip, grep, make, docker …), user and agent messages, thoughts and file edits,
over a vocabulary of modules, functions, packages and errors; no two are the same.

- indexing: ``LocalEmbedder.embed`` on batches of 100 texts (the raw model: tokenizer +
  onnxruntime, in a thread) vs ``Memory.index`` of batches of 100 events whose chunks are
  those same kinds of texts, through the memory worker's pipeline (micro-batcher, LRU +
  Postgres embedding cache, tracking rows, COPY into ``memory_chunks`` with its generated
  tsvector, GIN and HNSW indexes) into an embedded Postgres.  Every text is new, so the
  cache never answers.  Rounds alternate; texts/s (target ratio >= 0.80).
- recall at 100,000 indexed events (100 sessions of 1,000 in one tenant): embedding every
  text of a 100,000-event corpus with the real model would take ~5 minutes here, so the
  corpus is built from real model output instead.  The texts indexed in the throughput
  rounds (a few thousand, each embedded by the model) come first; every further row joins
  two of those texts (``text_a + "\\n" + text_b``) and carries the normalised
  length-weighted mean of their two model vectors.  The model mean-pools token states, so
  that mean is close to what it gives for the joined text: the run embeds a sample of
  joined texts and prints their cosine to the synthetic vectors.  Rows go in through
  ``Store.write`` (the indexing write path), then the HNSW index is built once.
  Queries are new sentences about the same material (each one unique, so its embedding is
  computed, never cached).  ``Memory.recall`` (semantic, k=10; hybrid: query embedding,
  HNSW vector search over the tenant, full-text search, rank fusion) p50/p99 (target p50 <=
  15 ms) vs the floor of embedding the query and one pgvector HNSW ``SELECT``; the same
  for session scope (an exact scan of one session's 1,000 rows).  Afterwards each stage of a
  recall (embedding the query, ``Store.search``, rank fusion) is timed on its own on further
  new queries; the p50 rows' notes give those stage medians.
- recall@10 of the vector search (``Store.vector_search``, tenant scope, HNSW) against
  exact search: numpy over the very same stored vectors (half precision, as Postgres
  keeps them), no index, no cached plan (target >= 0.95).

``--quick``: 20,000 rows and fewer queries.  Run alone: ``python -m bench.memory``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import random
import statistics
import time
import uuid

import asyncpg
import numpy as np
from pgvector.asyncpg import register_vector

from bench.common import Result, paired_rates, percentile, private_postgres, run_alone
from riverbed import events
from riverbed.memory.chunking import event_chunks
from riverbed.memory.embedders import LocalEmbedder, Vectors, normalize
from riverbed.memory.migrations import hnsw_index_sql, quote_ident
from riverbed.memory.ranking import hybrid_rank
from riverbed.memory.recall import Memory
from riverbed.memory.store import ChunkRow, Store

BATCH = 100
TENANT = "acme"
SESSION_EVENTS = 1000
JOINED_SAMPLE = 64

MODULES = [
    "parser", "lexer", "config", "scheduler", "auth", "billing", "cache", "storage", "router", "metrics",
    "importer", "exporter", "session", "invoice", "payments", "search", "indexer", "crawler", "mailer", "queue",
]  # fmt: skip
FUNCS = [
    "load", "parse_header", "flush", "retry", "validate", "tokenize", "connect", "resolve", "render", "commit",
    "rollback", "serialize", "merge", "split_lines", "normalize", "refresh_token", "compute_total", "apply_discount",
]  # fmt: skip
PACKAGES = ["numpy", "requests", "pydantic", "sqlalchemy", "httpx", "pytest-asyncio", "redis", "boto3", "rich"]
ERRORS = [
    "KeyError: 'timeout'", "TypeError: expected str, got NoneType", "AssertionError: 41 != 42",
    "ConnectionRefusedError: [Errno 111] Connection refused", "ValueError: invalid literal for int() with base 10",
    "ImportError: cannot import name 'Settings'", "TimeoutError: operation timed out after 30s",
    "PermissionError: [Errno 13] Permission denied", "IndexError: list index out of range",
    "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff",
]  # fmt: skip
TOPICS = [
    "the retry loop never backs off", "the config file is read twice", "invoices round the total down",
    "the cache is never invalidated", "the token expires during long uploads", "the lexer drops the last line",
    "tests pass locally but fail in CI", "the migration locks the table", "the queue grows without bound",
    "timezones are compared naively", "the exporter writes an empty CSV", "the scheduler runs a job twice",
]  # fmt: skip
BRANCHES = ["main", "fix/retry-backoff", "feat/export-csv", "hotfix/auth-expiry", "refactor/cache"]


class Corpus:
    """An endless supply of distinct, log-shaped events (deterministic for a seed)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.serial = itertools.count(1)

    def _mod(self) -> str:
        return self.rng.choice(MODULES)

    def _path(self) -> str:
        return f"src/{self.rng.choice(['app', 'core', 'lib'])}/{self._mod()}.py"

    def event(self, event_id: int) -> events.Event:
        r, n = self.rng, next(self.serial)
        mod, func, err = self._mod(), r.choice(FUNCS), r.choice(ERRORS)
        ts = dt.datetime(2026, 11, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=n * 7)
        match r.randrange(7):
            case 0:
                passed, failed = r.randrange(5, 400), r.randrange(0, 6)
                content = (
                    f"============ test session starts ============\ncollected {passed + failed} items\n"
                    f"tests/test_{mod}.py::test_{func}_{n} FAILED\n{err}\n  at {self._path()}:{r.randrange(10, 900)}\n"
                    f"==== {failed} failed, {passed} passed in {r.uniform(0.5, 90):.2f}s ===="
                )
                return events.CmdOutput(
                    id=event_id, ts=ts, source="runtime", command=f"pytest tests/test_{mod}.py -k {func}",
                    content=content, exit_code=1 if failed else 0,
                )  # fmt: skip
            case 1:
                pkg = r.choice(PACKAGES)
                content = (
                    f"Collecting {pkg}=={r.randrange(1, 9)}.{r.randrange(0, 30)}.{n}\n  Downloading {pkg}-"
                    f"{n}.whl ({r.randrange(20, 9000)} kB)\nSuccessfully installed {pkg}"
                )
                return events.CmdOutput(
                    id=event_id, ts=ts, source="runtime", command=f"pip install {pkg}", content=content, exit_code=0
                )
            case 2:
                branch = r.choice(BRANCHES)
                content = (
                    f"On branch {branch}\nChanges not staged for commit:\n  modified:   {self._path()}\n"
                    f"  modified:   tests/test_{mod}.py\ncommit {uuid.UUID(int=r.getrandbits(128)).hex[:12]} "
                    f"'{func}: handle {err.split(':')[0]}' (#{n})"
                )
                return events.CmdOutput(
                    id=event_id, ts=ts, source="runtime", command=r.choice(["git status", "git log -1", "git diff"]),
                    content=content, exit_code=0,
                )  # fmt: skip
            case 3:
                content = "\n".join(
                    f"{self._path()}:{r.randrange(1, 900)}:    def {r.choice(FUNCS)}(self, {mod}_id={n + i}):"
                    for i in range(r.randrange(1, 5))
                )
                return events.CmdOutput(
                    id=event_id, ts=ts, source="runtime", command=f"grep -rn {func} src/", content=content, exit_code=0
                )
            case 4:
                topic = r.choice(TOPICS)
                return events.Message(
                    id=event_id, ts=ts, source="user",
                    content=f"In the {mod} module {topic}; see ticket #{n} and {func}() in {self._path()}.",
                )  # fmt: skip
            case 5:
                return events.Think(
                    id=event_id, ts=ts,
                    thought=f"The {err.split(':')[0]} in {func} comes from {mod}: {r.choice(TOPICS)} "
                    f"(seen in run {n}); next I will patch {self._path()}.",
                )  # fmt: skip
            case _:
                return events.FileEdited(
                    id=event_id, ts=ts, source="runtime", path=self._path(),
                    diff=f"@@ -{n},3 +{n},4 @@\n-    return {func}(value)\n+    if value is None:\n"
                    f"+        raise {err.split(':')[0]}('{mod} {n}')\n+    return {func}(value, retries={n % 7})",
                )  # fmt: skip

    def events(self, count: int, first_id: int = 1) -> list[events.Event]:
        return [self.event(first_id + i) for i in range(count)]

    def query(self) -> str:
        r, n = self.rng, next(self.serial)
        mod, func = self._mod(), r.choice(FUNCS)
        return r.choice(
            [
                f"which test of {mod} failed with {r.choice(ERRORS).split(':')[0]} (attempt {n})?",
                f"where did we change {func} in the {mod} module? #{n}",
                f"what version of {r.choice(PACKAGES)} was installed, run {n}",
                f"what did the user say about {r.choice(TOPICS)} ({n})",
                f"git commit that fixed {func} on {r.choice(BRANCHES)} ref {n}",
            ]
        )


def _texts(batch: list[events.Event]) -> list[str]:
    return [text for e in batch for text in event_chunks(e)]


async def _throughput(
    memory: Memory, embedder: LocalEmbedder, corpus: Corpus, rounds: int, per_round: int
) -> tuple[float, float, float, list[str], Vectors]:
    """(raw texts/s, riverbed texts/s, ratio, raw texts, their vectors)."""
    raw_texts: list[str] = []
    raw_vectors: list[Vectors] = []
    session_ids = itertools.count()

    async def raw() -> int:
        count = 0
        for _ in range(per_round // BATCH):
            texts = _texts(corpus.events(BATCH))
            raw_vectors.append(await embedder.embed(texts))
            raw_texts.extend(texts)
            count += len(texts)
        return count

    async def riverbed() -> int:
        count = 0
        session = f"tp{next(session_ids)}"
        for b in range(per_round // BATCH):
            batch = corpus.events(BATCH, first_id=1 + b * BATCH)
            count += len(_texts(batch))
            await memory.index(session, batch, tenant=TENANT)
        return count

    await raw()  # warm up: the model loads, the HNSW index is created
    await riverbed()
    raw_texts.clear()
    raw_vectors.clear()
    base, figure, ratio = await paired_rates(raw, riverbed, rounds)
    return base, figure, ratio, raw_texts, np.concatenate(raw_vectors)


def _joined(texts: list[str], vectors: Vectors, rng: np.random.Generator, count: int) -> tuple[list[str], Vectors]:
    """``count`` rows, each two texts joined, with the length-weighted mean of their vectors."""
    a = rng.integers(0, len(texts), count)
    b = (a + rng.integers(1, len(texts), count)) % len(texts)
    lengths = np.array([len(t) for t in texts], dtype=np.float32)
    wa, wb = lengths[a][:, None], lengths[b][:, None]
    out_vectors = normalize(vectors[a] * wa + vectors[b] * wb)
    out_texts = [f"{texts[i]}\n{texts[j]}" for i, j in zip(a.tolist(), b.tolist(), strict=True)]
    return out_texts, out_vectors


async def _load(store: Store, texts: list[str], vectors: Vectors, model: str) -> None:
    """Rows through ``Store.write`` in sessions of 1,000 (the indexing write path)."""
    base = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    kinds = ["cmd_output", "message", "think", "file_edited"]
    for s, start in enumerate(range(0, len(texts), SESSION_EVENTS)):
        part = texts[start : start + SESSION_EVENTS]
        rows = [
            ChunkRow(event_id=i + 1, chunk=0, kind=kinds[i % 4], source="runtime", ts=base + dt.timedelta(seconds=i),
                     text=text)
            for i, text in enumerate(part)
        ]  # fmt: skip
        await store.write(
            session=f"s{s}",
            tenant=TENANT,
            model=model,
            event_ids=[r.event_id for r in rows],
            rows=rows,
            vectors=vectors[start : start + len(part)],
        )


async def _stages(memory: Memory, corpus: Corpus, queries: int) -> dict[str, str]:
    """Where a recall's time goes: its stages timed one by one on further new queries
    (p50 of each; the recall figures above are whole calls, measured before this)."""
    out: dict[str, str] = {}
    cache = memory.cache
    for scope in ("tenant", "session"):
        embed_ms: list[float] = []
        search_ms: list[float] = []
        rank_ms: list[float] = []
        texts = 0
        for i in range(queries):
            text = corpus.query()
            started = time.perf_counter()
            vector = await cache.embed_query(text) if cache else (await memory.embedder.embed([text]))[0]
            embed_ms.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            by_vector, by_text = await memory.store.search(
                vector, text, model=memory.embedder.model, k=memory.candidates, tenant=TENANT,
                session=f"s{i % 100}" if scope == "session" else None,
            )  # fmt: skip
            search_ms.append((time.perf_counter() - started) * 1000)
            texts += bool(by_text)
            started = time.perf_counter()
            hybrid_rank(by_vector, by_text, k=10, now=dt.datetime.now(dt.UTC))
            rank_ms.append((time.perf_counter() - started) * 1000)
        out[scope] = (
            f"stages one by one, p50: embed the query {percentile(embed_ms, 50):.1f} ms, Store.search (vector "
            f"and full-text candidates in one statement) {percentile(search_ms, 50):.1f} ms, rank fusion "
            f"{percentile(rank_ms, 50):.2f} ms; {texts} of {queries} queries had full-text candidates"
        )
    return out


async def measure(_url: str, args: argparse.Namespace) -> list[Result]:
    rows_total = 20_000 if args.quick else 100_000
    queries = 30 if args.quick else 60
    rounds = max(args.repeats, 3)
    per_round = 100
    corpus = Corpus(seed=7)
    results: list[Result] = []
    embedder = LocalEmbedder()
    with private_postgres(args.database_url) as db:
        # --- indexing throughput ----------------------------------------------------------
        tp_store = Store(db, schema="bm" + uuid.uuid4().hex[:10])
        await tp_store.start()
        memory = Memory.cached(tp_store, embedder)
        base, figure, ratio, texts, vectors = await _throughput(memory, embedder, corpus, rounds, per_round)
        results.append(
            Result("memory indexing (unique texts)", "texts/s", figure, base, "LocalEmbedder.embed, batches of 100",
                   ratio, 0.80, rounds)
        )  # fmt: skip
        async with tp_store._conn() as conn:  # the texts the riverbed rounds embedded, with their vectors
            stored = await conn.fetch(
                f"SELECT text, embedding FROM {quote_ident(tp_store.schema)}.memory_chunks ORDER BY session, event_id"
            )
        texts += [r["text"] for r in stored]
        vectors = np.concatenate([vectors, np.stack([r["embedding"].to_numpy() for r in stored])]).astype(np.float32)
        await tp_store.close()

        # --- the 100,000-row corpus -------------------------------------------------------
        rng = np.random.default_rng(11)
        extra_texts, extra_vectors = _joined(texts, vectors, rng, rows_total - len(texts))
        sample = list(range(JOINED_SAMPLE))
        true = await embedder.embed([extra_texts[i] for i in sample])
        cosines = np.sum(true * extra_vectors[sample], axis=1)
        all_texts = texts + extra_texts
        all_vectors = np.concatenate([vectors, extra_vectors]).astype(np.float16)  # what halfvec keeps
        store = Store(db, schema="bm" + uuid.uuid4().hex[:10])
        await store.start()
        started = time.perf_counter()
        await _load(store, all_texts, all_vectors.astype(np.float32), embedder.model)
        loaded = time.perf_counter() - started
        started = time.perf_counter()
        builder = await asyncpg.connect(db)  # no command timeout: the build takes minutes on 2 cores
        try:
            await builder.execute("SET maintenance_work_mem = '1GB'")
            await builder.execute(hnsw_index_sql(store.schema, embedder.model, embedder.dim))
            await builder.execute(f"ANALYZE {quote_ident(store.schema)}.memory_chunks")
        finally:
            await builder.close()
        built = time.perf_counter() - started
        note = (
            f"{len(all_texts):,} rows in 100 sessions: {len(texts):,} texts embedded by the model + "
            f"{len(extra_texts):,} joined pairs with the mean of their vectors (cosine to the model's own "
            f"embedding of the joined text: mean {float(cosines.mean()):.3f}, min {float(cosines.min()):.3f}, "
            f"{JOINED_SAMPLE} sampled); Store.write {loaded:.0f} s, HNSW build {built:.0f} s"
        )

        # --- recall latency ---------------------------------------------------------------
        memory = Memory.cached(store, embedder)
        raw = await asyncpg.connect(db)
        await register_vector(raw)
        floor_sql = (
            f"SELECT session, event_id, chunk, kind, ts, text, embedding::halfvec(384) <=> $1::halfvec(384) AS d "
            f"FROM {quote_ident(store.schema)}.memory_chunks WHERE model = $2 AND tenant = $3 ORDER BY d LIMIT 10"
        )
        scopes = {"tenant": "HNSW over the tenant", "session": "one session of 1,000"}
        timings: dict[str, tuple[list[float], list[float]]] = {s: ([], []) for s in scopes}
        qvectors: list[Vectors] = []
        for i in range(queries):
            for scope in scopes:
                text = corpus.query()
                started = time.perf_counter()
                vector = (await embedder.embed([text]))[0]
                if scope == "tenant":
                    await raw.fetch(floor_sql, vector, embedder.model, TENANT)
                else:
                    await raw.fetch(
                        floor_sql.replace("tenant = $3", "tenant = $3 AND session = $4"),
                        vector,
                        embedder.model,
                        TENANT,
                        f"s{i % 100}",
                    )
                timings[scope][0].append(time.perf_counter() - started)
                text = corpus.query()
                action = events.Recall(query=text, recall_type="semantic", scope=scope, k=10)  # type: ignore[arg-type]
                started = time.perf_counter()
                await memory.recall(action, session=f"s{i % 100}", tenant=TENANT, workspace=None)
                timings[scope][1].append(time.perf_counter() - started)
                if scope == "tenant":
                    qvectors.append(vector)
        await raw.close()
        stages = await _stages(memory, corpus, queries)
        for scope, label in scopes.items():
            floor_ms = [t * 1000 for t in timings[scope][0]]
            rb_ms = [t * 1000 for t in timings[scope][1]]
            floor_name = f"embed + one pgvector SELECT, {label}"
            p50, p99 = percentile(rb_ms, 50), percentile(rb_ms, 99)
            f50, f99 = percentile(floor_ms, 50), percentile(floor_ms, 99)
            rows_label = f"{len(all_texts) // 1000}k rows"
            results.append(
                Result(f"recall p50 ({scope} scope, {rows_label})", "ms", p50, f50, floor_name, p50 / f50, 15.0,
                       queries, better="lower", target_on="figure", note=stages[scope])
            )  # fmt: skip
            results.append(
                Result(f"recall p99 ({scope} scope, {rows_label})", "ms", p99, f99, floor_name, p99 / f99, None,
                       queries, better="lower")
            )  # fmt: skip

        # --- recall@10 against exact search -----------------------------------------------
        exact = all_vectors.astype(np.float32)
        found = []
        for vector in qvectors:
            q = vector.astype(np.float16).astype(np.float32)
            truth = set(np.argsort(-(exact @ q), kind="stable")[:10].tolist())
            hits = await store.vector_search(vector, model=embedder.model, k=10, tenant=TENANT)
            got = {(int(h.session[1:]) * SESSION_EVENTS + h.event_id - 1) for h in hits}
            found.append(len(got & truth) / 10)
        recall10 = statistics.mean(found)
        results.append(
            Result(f"recall@10, HNSW vs exact ({len(all_texts) // 1000}k rows)", "", recall10, 1.0,
                   "numpy exact search, same vectors", recall10, 0.95, len(found), target_on="figure", note=note)
        )  # fmt: skip
        await store.close()
    return results


def main() -> int:
    return run_alone(measure, "Memory indexing throughput and recall against their raw baselines.")


if __name__ == "__main__":
    raise SystemExit(main())

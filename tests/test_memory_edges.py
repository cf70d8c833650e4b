"""The memory role at its edges, in-process on real Redis and Postgres.

- Every byte value (NUL included) in a message, a command's output, a path and a file is
  indexed and recalled: the searchable text is cleaned, the event in the log is untouched.
- A value Postgres cannot hold even after cleaning is dead-lettered with its reason after
  the attempts, and the session's other events are indexed.
- Postgres hanging (a lock held on the memory tables): recalls are answered with a
  retryable ``memory_unavailable`` error within their timeout, and every recall action is
  indexed once Postgres answers again, also those in a batch whose indexing failed.
- Recall results are not indexed as copies of the events they quote.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from functools import partial

import anyio
import asyncpg
import numpy as np
import pytest

from riverbed import events
from riverbed.bus.dlq import DeadLetters
from riverbed.client.session import Bus, Session
from riverbed.memory.embedders import LocalEmbedder, Vectors
from riverbed.memory.recall import Memory
from riverbed.memory.store import Store
from tests.kit.agents import record
from tests.kit.answers import assert_answered_once
from tests.kit.memory import memory_owner, tracked, wait_indexed, work_script

pytestmark = pytest.mark.anyio

EVERY_BYTE = "".join(chr(i) for i in range(256))


#: A memory-role owner in this process whose recalls have 10 s unless a test gives its own.
worker = partial(memory_owner, recall_timeout=10.0)


async def recall(session: Session, query: str, *, k: int = 5, timeout: float = 20.0) -> events.RecallResult:
    answer = await session.act(events.Recall(query=query, k=k), timeout=timeout)
    assert isinstance(answer, events.RecallResult), answer
    return answer


# --- data the store cannot hold as is --------------------------------------------------------


async def test_every_byte_value_is_indexed_and_recalled(
    bus: Bus, database_url: str, prefix: str, local: LocalEmbedder
) -> None:
    session = bus.session("bytes", tenant="acme")
    async with worker(bus, database_url, prefix, local):
        ids = await record(
            session,
            events.Message(source="user", content=f"wombat notes {EVERY_BYTE} end of wombat notes"),
            events.CmdRun(command="find . -print0"),
            events.CmdOutput(command="find . -print0", content=f"wombat listing {EVERY_BYTE}", exit_code=0),
            events.FileWrite(path=f"wombat/{EVERY_BYTE.replace('/', '')}.bin", content=f"wombat file {EVERY_BYTE}"),
            events.FileRead(path=f"wombat/{EVERY_BYTE.replace('/', '')}.bin"),
            events.FileContent(path=f"wombat/{EVERY_BYTE.replace('/', '')}.bin", content=f"wombat file {EVERY_BYTE}"),
        )
        await wait_indexed(database_url, prefix, session)
        found = await recall(session, "wombat", k=10)
        assert {ids[0], ids[2], ids[3], ids[5]} <= {h.event_id for h in found.hits}, found.hits
        assert all("\x00" not in h.text for h in found.hits)
        # a query with every byte value is cleaned the same way
        again = await recall(session, f"wombat {EVERY_BYTE}", k=10)
        assert ids[0] in {h.event_id for h in again.hits}
        # the log keeps the events as they were appended
        (message, *_) = await session.events()
        assert isinstance(message, events.Message)
        assert EVERY_BYTE in message.content


async def test_every_byte_value_and_a_lone_surrogate_indexed_in_process(
    database_url: str, prefix: str, local: LocalEmbedder
) -> None:
    """The codec refuses lone surrogates, so none reaches the log; indexing cleans them anyway."""
    text = f"quokka {EVERY_BYTE} \ud800 \udfff"
    batch = [
        events.with_id(events.Message(source="user", content=text), 1),
        events.with_id(events.CmdOutput(command="cat x", content=text), 2),
        events.with_id(events.FileWrite(path=f"q/{text}", content=text), 3),
    ]
    async with Store(database_url, schema=prefix) as store:
        memory = Memory(store, local)
        assert await memory.index("s", batch, tenant=None) == 3
        hits = await memory.search("quokka \ud800\x00", session="s", tenant=None, k=5)
    assert {h.event_id for h in hits} == {1, 2, 3}


class PoisonedEmbedder:
    """The local model, except that a text containing ``POISON`` gets a NaN vector: a value
    Postgres refuses (halfvec, SQLSTATE 22000) that no cleaning of the text can fix."""

    def __init__(self, inner: LocalEmbedder) -> None:
        self.inner = inner

    @property
    def model(self) -> str:
        return self.inner.model + "+poison"

    @property
    def dim(self) -> int:
        return self.inner.dim

    async def embed(self, texts: Sequence[str]) -> Vectors:
        vectors = (await self.inner.embed(texts)).copy()
        for i, text in enumerate(texts):
            if "POISON" in text:
                vectors[i] = np.nan
        return vectors


async def test_an_unstorable_event_is_dead_lettered_with_its_reason_and_the_session_goes_on(
    bus: Bus, database_url: str, prefix: str, local: LocalEmbedder
) -> None:
    session = bus.session("poison", tenant="acme")
    async with worker(bus, database_url, prefix, PoisonedEmbedder(local)):
        ids = await session.append(
            events.Message(source="user", content="the staging database lives on host pelican"),
            events.Message(source="user", content="POISON this one cannot be stored"),
            events.Message(source="user", content="the production database lives on host albatross"),
        )
        bad = ids[1]
        with anyio.fail_after(30):
            while not (letters := await DeadLetters(bus.redis, bus.keys, bus.url).list()):
                await anyio.sleep(0.1)
        (letter,) = letters
        assert (letter.session, letter.event_id, letter.role) == (session.id, bad, "memory")
        assert letter.attempts >= 3  # the usual attempts, not forever
        assert "DataError" in letter.reason, letter.reason
        assert "NaN" in letter.reason, letter.reason
        with anyio.fail_after(30):  # (the notice is appended right after the letter is stored)
            while not (notice := [e for e in await session.events() if getattr(e, "reason", None) == "dead_letter"]):
                await anyio.sleep(0.05)
        await anyio.sleep(0.3)  # (a second notice would have come by now)
        notice = [e for e in await session.events() if isinstance(e, events.Error) and e.reason == "dead_letter"]
        assert len(notice) == 1
        assert f"event {bad}" in notice[0].content

        later = await session.append(events.Message(source="user", content="the cache lives on host heron"))
        answer = await recall(session, "which host does the production database live on?", k=3)
        assert ids[2] in {h.event_id for h in answer.hits}
        with anyio.fail_after(30):  # (a recall may be answered ahead of the indexing behind it)
            while not {ids[0], ids[2], *later} <= set(done := await tracked(database_url, prefix, session.id)):
                await anyio.sleep(0.1)
        assert bad not in done


# --- Postgres hanging --------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def memory_tables_locked(database_url: str, schema: str) -> AsyncIterator[None]:
    """Hold an exclusive lock on the memory tables: every statement on them waits (a hang)."""
    conn = await asyncpg.connect(database_url)
    try:
        async with conn.transaction():
            await conn.execute(
                f'LOCK TABLE "{schema}".memory_indexed, "{schema}".memory_chunks IN ACCESS EXCLUSIVE MODE'
            )
            yield
    finally:
        await conn.close()


async def test_recalls_answer_within_their_timeout_while_postgres_hangs(
    bus: Bus, database_url: str, prefix: str, local: LocalEmbedder
) -> None:
    recall_timeout = 2.0
    session = bus.session("hang", tenant="acme")
    async with worker(bus, database_url, prefix, local, recall_timeout=recall_timeout):
        await record(session, *work_script())
        await wait_indexed(database_url, prefix, session)
        async with memory_tables_locked(database_url, prefix):
            await session.append(events.Message(source="user", content="a note written while Postgres hangs"))
            for _ in range(2):  # the first waits behind the hanging batch, the second is queued behind it
                # Answered (act's timeout bounds it): an error within the recall timeout, not a hang.
                answer = await session.act(events.Recall(query="which pods are running?"), timeout=recall_timeout + 2)
                assert isinstance(answer, events.Error), answer
                assert answer.reason == "memory_unavailable"
                assert answer.retryable
                assert answer.tenant == "acme"
        # Postgres answers again: everything is indexed, each recall answered once
        await wait_indexed(database_url, prefix, session)
        after = await recall(session, "which pods are running in the cluster?", k=3)
        assert after.hits
        await wait_indexed(database_url, prefix, session)
        assert_answered_once(await session.events(), lambda e: isinstance(e, events.Recall), where="recalls")


async def test_recalls_of_a_batch_whose_indexing_failed_are_indexed_too(
    bus: Bus, database_url: str, prefix: str, local: LocalEmbedder
) -> None:
    """Statements time out (UnavailableError) while the lock is held: the batch with the
    recall is retried, and the recall action is tracked like any other event afterwards."""
    session = bus.session("failed-batch", tenant="acme")
    async with worker(bus, database_url, prefix, local, command_timeout=1.0):
        await session.append(events.Message(source="user", content="hello"))
        await wait_indexed(database_url, prefix, session)
        async with memory_tables_locked(database_url, prefix):
            ids = await session.append(
                events.Message(source="user", content="the invoice job runs at midnight"),
                events.Recall(query="when does the invoice job run?"),
            )
            answer = await session.wait_for_answer(ids[-1], timeout=15)
            assert isinstance(answer, events.Error), answer
            assert answer.reason == "memory_unavailable"
            await anyio.sleep(1.5)  # at least one more failed attempt
        await wait_indexed(database_url, prefix, session, deadline=20)
        assert set(ids) <= set(await tracked(database_url, prefix, session.id))
        assert_answered_once(await session.events(), lambda e: isinstance(e, events.Recall), where="recalls")


# --- recall results ----------------------------------------------------------------------------


async def test_recall_results_do_not_crowd_out_the_events_they_quote(
    bus: Bus, database_url: str, prefix: str, local: LocalEmbedder
) -> None:
    session = bus.session("echo", tenant="acme")
    question = "which pods are running in the cluster?"
    async with worker(bus, database_url, prefix, local):
        await record(session, *work_script())
        await wait_indexed(database_url, prefix, session)
        first = await recall(session, question, k=3)
        for _ in range(4):
            await recall(session, question, k=3)
        await wait_indexed(database_url, prefix, session)
        last = await recall(session, question, k=3)
    kinds = {h.kind for h in last.hits}
    assert "recall_result" not in kinds, last.hits
    assert [h.event_id for h in last.hits] == [h.event_id for h in first.hits]

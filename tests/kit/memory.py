"""The memory role in tests: an owner of it in the test process, what was indexed, waiting for
it, a realistic session."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import asyncpg

from riverbed import events
from riverbed.bus.consumer import Owner
from riverbed.client.session import Bus, Session
from riverbed.memory.embedders import Embedder
from riverbed.memory.recall import Memory
from riverbed.memory.store import Store
from riverbed.workers.memory_role import MemoryHandler
from tests.kit.patience import within

INDEX_DEADLINE = 30.0


@contextlib.asynccontextmanager
async def memory_owner(
    bus: Bus,
    database_url: str,
    prefix: str,
    embedder: Embedder,
    *,
    workspace: Path | None = None,
    command_timeout: float = 30.0,
    **memory_options: Any,
) -> AsyncIterator[Owner]:
    """A memory-role Owner wired like ``build_memory_handler``, on this test's database and
    schema, with the Store's statement timeout (``memory_options``: :meth:`Memory.cached`'s,
    such as ``recall_timeout``); it drains when the block ends."""
    store = Store(database_url, schema=prefix, command_timeout=command_timeout)
    handler = MemoryHandler(Memory.cached(store, embedder, **memory_options), workspace_root=workspace)
    owner = Owner(bus.redis, bus.keys, handler, worker="memory-1", lease_seconds=2.0, url=bus.url)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(owner.run)
            yield owner
            await owner.drain(2.0)
    finally:
        await store.close()


async def tracked(database_url: str, schema: str, session: str) -> dict[int, int]:
    """``event_id -> chunks`` from the tracking table (asserting each id is there once)."""
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            f'SELECT event_id, chunks FROM "{schema}".memory_indexed WHERE session = $1',
            session,
        )
    finally:
        await conn.close()
    ids = [int(r["event_id"]) for r in rows]
    assert len(ids) == len(set(ids)), f"an event is tracked twice: {sorted(ids)}"
    return {int(r["event_id"]): int(r["chunks"]) for r in rows}


async def chunk_rows(database_url: str, schema: str, session: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetch(
            f'SELECT event_id, chunk, tenant, text FROM "{schema}".memory_chunks WHERE session = $1',
            session,
        )
    finally:
        await conn.close()


async def wait_indexed(database_url: str, schema: str, session: Session, *, deadline: float = INDEX_DEADLINE) -> None:
    """Until every event of the log up to now is tracked in the index."""
    last = await session.last_id()
    with anyio.fail_after(within(deadline)):
        while True:
            with contextlib.suppress(asyncpg.UndefinedTableError, asyncpg.InvalidSchemaNameError):
                if set(range(1, last + 1)) <= set(await tracked(database_url, schema, session.id)):
                    return
            await anyio.sleep(0.05)


def work_script() -> list[events.Event]:
    """An agent fixing a slow checkout: talk, shell commands with their logs, file edits."""
    pytest_log = "\n".join(
        [
            "============================= test session starts ==============================",
            "collected 57 items",
            *(f"tests/test_cart.py::test_line_{i} PASSED" for i in range(30)),
            "tests/test_checkout.py::test_pay_with_card FAILED",
            "E   asyncpg.exceptions.TooManyConnectionsError: sorry, too many clients already",
            "E   the connection pool to the orders database was exhausted after 20 connections",
            *(f"tests/test_search.py::test_query_{i} PASSED" for i in range(25)),
            "=================== 1 failed, 56 passed in 12.31s ===================",
        ]
    )
    return [
        events.Message(
            source="user",
            content="Checkout got really slow since Monday and sometimes customers see a 502. Can you look?",
        ),
        events.CmdRun(command="git log --oneline -4"),
        events.CmdOutput(
            command="git log --oneline -4",
            content="7d1e2f0 Cache product images on the CDN\n3a9c8b1 Upgrade payment SDK to 4.2\n"
            "c0ffee1 Translate the footer into German\n1234abc Initial import",
            exit_code=0,
        ),
        events.CmdRun(command="python -m pytest -q tests/"),
        events.CmdOutput(command="python -m pytest -q tests/", content=pytest_log, exit_code=1),
        events.FileRead(path="deploy/nginx.conf"),
        events.FileContent(
            path="deploy/nginx.conf",
            content="upstream shop {\n  server 10.1.4.20:8000;\n}\nserver {\n  listen 443 ssl;\n"
            "  proxy_read_timeout 5s;\n}",
        ),
        events.FileEdit(
            command="str_replace",
            path="shop/db.py",
            old_str="POOL_MAX_SIZE = 20",
            new_str="POOL_MAX_SIZE = 60  # checkout opens one connection per cart line",
        ),
        events.FileEdited(path="shop/db.py", diff="-POOL_MAX_SIZE = 20\n+POOL_MAX_SIZE = 60"),
        events.Think(
            thought="The 502s come from nginx giving up after five seconds while checkout waits for a pool slot"
        ),
        events.FileWrite(
            path="docs/runbook.md",
            content="When refunds fail, page the payments on-call engineer in the #payments-oncall channel.",
        ),
        events.CmdRun(command="kubectl get pods -n shop"),
        events.CmdOutput(
            command="kubectl get pods -n shop",
            content="NAME                        READY   STATUS    RESTARTS\n"
            "checkout-7f9c9d-abcde       1/1     Running   0\n"
            "search-5b6d7c-fghij         1/1     Running   3",
            exit_code=0,
        ),
        events.Message(
            source="agent",
            content="I raised the orders database pool to 60 connections; checkout is fast again.",
        ),
    ]


def numbered(items: list[events.Event]) -> list[events.Event]:
    return [events.with_id(e, i) for i, e in enumerate(items, start=1)]

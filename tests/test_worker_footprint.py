"""A worker loads what its roles use: a real agent-only worker process maps no embedding runtime
(onnxruntime, fastembed), no pydantic (the OpenAI client library's models are pydantic's; the role
asks its model on aiohttp) and, without a database, no Postgres driver; its resting RSS stays small."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kit.workers import Spawn, ready, spawn, workers  # noqa: F401  (spawn, workers: fixtures)

pytestmark = pytest.mark.anyio

MOST_MIB = 200
"""An agent-only worker rests near 60 MiB (docs/operations.md); over three times that is a regression."""


async def test_an_agent_only_worker_loads_no_embedding_model_nor_database_driver(spawn: Spawn) -> None:
    worker = spawn("agent-only", ["agent"], OPENAI_BASE_URL="http://127.0.0.1:9/v1", RIVERBED_DATABASE_URL="")
    await ready(worker)
    proc = Path(f"/proc/{worker.proc.pid}")
    maps = (proc / "maps").read_text()
    assert "aiohttp/_http_parser" in maps  # (it sees the role's own libraries: its model client's HTTP parser)
    for absent in ("onnxruntime", "fastembed", "tokenizers", "asyncpg", "pydantic_core"):
        assert absent not in maps, f"an agent-only worker mapped {absent}"
    status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line)
    rss_mib = int(status["VmRSS"].split()[0]) / 1024
    assert rss_mib < MOST_MIB, f"an agent-only worker rests at {rss_mib:.0f} MiB"

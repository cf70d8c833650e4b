"""Backlog statistics, the worker's metrics registry and its HTTP endpoints, against real Redis."""

from __future__ import annotations

import json
import socket
from functools import partial

import anyio
import numpy as np
import pytest

from riverbed import events
from riverbed.bus import status
from riverbed.bus.consumer import Entry, SessionContext
from riverbed.client.session import Bus
from riverbed.errors import ConfigError
from riverbed.memory.embedcache import CachedEmbedder
from riverbed.services import free_port
from riverbed.settings import Settings
from riverbed.workers.http import Health, serve
from riverbed.workers.main import Worker
from riverbed.workers.metrics import METRIC_NAMES, WorkerMetrics
from tests.kit.metrics import get, samples, value
from tests.kit.owners import EchoHandler
from tests.kit.workers import Spawn, ready, spawn, workers  # noqa: F401  (fixtures)

pytestmark = pytest.mark.anyio


# --- backlog statistics ------------------------------------------------------------------------


async def test_lag_pending_and_oldest_age_of_a_session(bus: Bus) -> None:
    session = bus.session("busy")
    await session.append(*[events.Think(thought=f"t{i}") for i in range(5)])
    log_key = bus.keys.log("busy")
    await bus.redis.xgroup_create(log_key, "runtime", id="0")
    await bus.redis.xreadgroup("runtime", "c1", {log_key: ">"}, count=2)
    # make the first delivered entry look 5 s idle without sleeping
    await bus.redis.xclaim(log_key, "runtime", "c1", 0, ["1-0"], idle=5000)

    [runtime] = await status.session_backlogs(bus.redis, bus.keys, "runtime", ["busy"])
    assert (runtime.last, runtime.delivered, runtime.lag, runtime.pending) == (5, 2, 3, 2)
    assert 5.0 <= runtime.oldest_pending_seconds < 30.0
    assert runtime.holder is None

    [memory] = await status.session_backlogs(bus.redis, bus.keys, "memory", ["busy"])
    assert (memory.lag, memory.pending, memory.oldest_pending_seconds) == (5, 0, 0.0)

    [ghost] = await status.session_backlogs(bus.redis, bus.keys, "runtime", ["never-created"])
    assert (ghost.last, ghost.lag, ghost.pending) == (0, 0, 0)

    await bus.redis.xack(log_key, "runtime", "1-0", "2-0")
    [acked] = await status.session_backlogs(bus.redis, bus.keys, "runtime", ["busy"])
    assert (acked.lag, acked.pending, acked.oldest_pending_seconds) == (3, 0, 0.0)


async def test_owner_is_read_against_the_redis_clock(bus: Bus) -> None:
    await bus.session("held").append(events.Think(thought="x"))
    now_ms = int(await status.redis_time(bus.redis) * 1000)
    meta = bus.keys.meta("held")
    await bus.redis.hset(meta, mapping={"holder:runtime": "w1", "expires:runtime": now_ms + 10_000})
    await bus.redis.hset(meta, mapping={"holder:memory": "w2", "expires:memory": now_ms - 1})
    [runtime] = await status.session_backlogs(bus.redis, bus.keys, "runtime", ["held"])
    [memory] = await status.session_backlogs(bus.redis, bus.keys, "memory", ["held"])
    assert runtime.holder == "w1"
    assert runtime.owned
    assert 5.0 < runtime.lease_seconds_left <= 10.0
    assert memory.holder is None
    assert memory.lease_seconds_left == 0.0


async def test_directory_backlog_dead_letters_workers_and_status(bus: Bus) -> None:
    for name in ("a", "b", "c"):
        await bus.session(name).append(events.Think(thought=name))
    assert await status.list_sessions(bus.redis, bus.keys) == ["a", "b", "c"]

    no_group = await status.directory_backlog(bus.redis, bus.keys, "memory")
    assert (no_group.length, no_group.lag, no_group.pending) == (3, 3, 0)
    directory = bus.keys.directory("condenser")
    await bus.redis.xgroup_create(directory, "condenser", id="0")
    await bus.redis.xreadgroup("condenser", "w1", {directory: ">"}, count=1)
    condenser = await status.directory_backlog(bus.redis, bus.keys, "condenser")
    assert (condenser.length, condenser.lag, condenser.pending, condenser.consumers) == (3, 2, 1, 1)
    # The runtime role is announced only for its actions: no session waits for it.
    runtime = await status.directory_backlog(bus.redis, bus.keys, "runtime")
    assert (runtime.length, runtime.lag) == (0, 0)

    await bus.redis.xadd(bus.keys.dlq, {"session": "a", "reason": "test"})
    assert await status.dead_letter_count(bus.redis, bus.keys) == 1

    now = await status.redis_time(bus.redis)
    await bus.redis.zadd(bus.keys.workers, {"fresh": now - 1, "stale": now - 120, "in-ms": (now - 2) * 1000})
    await bus.redis.set(bus.keys.worker("fresh"), json.dumps({"name": "fresh", "roles": ["runtime"]}))
    workers = await status.live_workers(bus.redis, bus.keys, window=10)
    assert [w.name for w in workers] == ["fresh", "in-ms"]
    assert workers[0].description["roles"] == ["runtime"]
    assert workers[1].description == {}
    assert 0.5 < workers[0].age_seconds < 10

    snapshot = await status.status(bus.redis, bus.keys)
    assert snapshot.sessions == 3
    assert snapshot.dead_letters == 1
    assert [r.role for r in snapshot.roles] == ["runtime", "memory", "condenser"]
    by_role = {r.role: r for r in snapshot.roles}
    assert by_role["condenser"].directory.lag == 2
    assert by_role["runtime"].lag == 0
    assert by_role["memory"].lag == 3  # one event per session, no group yet
    assert by_role["memory"].pending == 0


# --- metrics and endpoints over real HTTP --------------------------------------------------------


class CountingEmbedder:
    """A deterministic embedder so the cache counters move without a model."""

    model = "counting"
    dim = 4

    async def embed(self, texts: list[str]) -> np.ndarray:
        return np.ones((len(texts), self.dim), dtype=np.float32)


class EmbedEcho(EchoHandler):
    """The echoing handler, which embeds each path it reads (so the embed-cache counters move)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedder = CachedEmbedder(CountingEmbedder())  # type: ignore[arg-type]

    async def echo(self, ctx: SessionContext, entry: Entry, read: events.FileRead) -> None:
        await self.embedder.embed([read.path])
        await super().echo(ctx, entry, read)


async def test_worker_endpoints_serve_metrics_health_and_readiness(bus: Bus, prefix: str) -> None:
    settings = Settings(prefix=prefix, lease_seconds=2.0, drain_seconds=2.0)
    handler = EmbedEcho()
    worker = Worker(bus.redis, settings, ["runtime"], name="w-metrics", handlers={"runtime": handler}, url=bus.url)
    health = Health(stale_after=5.0)
    async with anyio.create_task_group() as tg:
        port = await tg.start(partial(serve, worker, 0, host="127.0.0.1", refresh_seconds=0.1, health=health))

        status, content_type, body = await get(port, "/readyz")
        assert status == 503  # the owners have not started
        assert content_type == "application/json"
        assert "runtime owner is not ready" in json.loads(body)["reasons"]
        assert (await get(port, "/healthz"))[0] == 200

        async with anyio.create_task_group() as running:
            await running.start(worker.run)
            for i in range(3):
                for name in ("s1", "s2"):
                    obs = await bus.session(name).act(events.FileRead(path=f"p{i}"), timeout=10)
                    assert isinstance(obs, events.FileContent)

            with anyio.fail_after(10):
                while (await get(port, "/readyz"))[0] != 200:
                    await anyio.sleep(0.05)
            body = json.loads((await get(port, "/readyz"))[2])
            assert body == {"ready": True, "worker": "w-metrics", "owners": {"runtime": True}, "reasons": []}

            status, content_type, text = await get(port, "/metrics")
            assert status == 200
            assert content_type.startswith("text/plain")
            scraped = samples(text.decode())
            names = {name for name, _labels in scraped}
            assert names >= METRIC_NAMES
            labels = {"role": "runtime", "worker": "w-metrics"}
            assert value(scraped, "riverbed_handled_total", **labels) >= 6
            assert value(scraped, "riverbed_owned_sessions", **labels) >= 1
            assert value(scraped, "riverbed_handler_seconds_count", **labels) >= 1
            assert value(scraped, "riverbed_handler_seconds_bucket", le="+Inf", **labels) >= 1
            assert value(scraped, "riverbed_dead_letters_total", **labels) == 0
            assert value(scraped, "riverbed_lag_events", **labels) >= 0
            assert value(scraped, "riverbed_pending_entries", **labels) >= 0
            assert value(scraped, "riverbed_oldest_pending_seconds", **labels) >= 0
            # three distinct paths, each embedded twice (two sessions): half the lookups hit the LRU
            assert value(scraped, "riverbed_embedding_cache_hit_ratio", level="lru", **labels) == 0.5
            assert value(scraped, "riverbed_embedding_cache_hit_ratio", level="shared", **labels) == 0.0

            assert (await get(port, "/healthz"))[0] == 200
            assert (await get(port, "/nowhere"))[0] == 404
            worker.stop()
        tg.cancel_scope.cancel()

    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass


async def test_a_worker_process_leaves_its_startup_heap_out_of_the_collector(bus: Bus, spawn: Spawn) -> None:
    """Once started, a worker collects its heap and freezes it (the modules, settings and handlers
    it built): the collector's full collections no longer walk them, and the scrape says how many."""
    port = free_port()
    worker = spawn("w-gc", ["runtime"], RIVERBED_METRICS_PORT=str(port))
    await ready(worker)
    obs = await bus.session("gc").act(events.FileRead(path="nothing.txt"), timeout=10)
    assert isinstance(obs, events.Error)  # (no such file: answered all the same)
    with anyio.fail_after(10):
        while True:
            status, _, text = await get(port, "/metrics")
            scraped = samples(text.decode()) if status == 200 else {}
            if scraped and value(scraped, "riverbed_gc_frozen_objects", worker="w-gc") > 0:
                break
            await anyio.sleep(0.1)
    # the imports alone are tens of thousands of tracked objects; a worker that froze nothing says 0
    assert value(scraped, "riverbed_gc_frozen_objects", worker="w-gc") > 20_000
    assert value(scraped, "python_gc_collections_total", generation="2") >= 1  # the collection before the freeze


async def test_backlog_gauges_follow_redis(bus: Bus, prefix: str) -> None:
    """The refresh reads the owned sessions' backlog; an entry left unacknowledged shows up."""
    settings = Settings(prefix=prefix, lease_seconds=2.0)
    worker = Worker(bus.redis, settings, ["runtime"], name="w-gauges", handlers={"runtime": EmbedEcho()}, url=bus.url)
    metrics = WorkerMetrics()
    metrics.bind(worker)
    await bus.session("g").append(*[events.Think(thought=str(i)) for i in range(4)])
    log_key = bus.keys.log("g")
    await bus.redis.xgroup_create(log_key, "runtime", id="0")
    await bus.redis.xreadgroup("runtime", "w-gauges", {log_key: ">"}, count=1)
    owner = worker.owners["runtime"]
    owner.owned["g"] = object()  # type: ignore[assignment]  # as if acquired; only the key is read
    await metrics.refresh()
    scraped = samples(metrics.render().decode())
    labels = {"role": "runtime", "worker": "w-gauges"}
    assert value(scraped, "riverbed_lag_events", **labels) == 3
    assert value(scraped, "riverbed_pending_entries", **labels) == 1
    assert value(scraped, "riverbed_owned_sessions", **labels) == 1
    owner.owned.clear()


def test_handler_timings_reach_the_histogram_and_the_list_stays_bounded(prefix: str) -> None:
    import redis.asyncio as aioredis  # noqa: PLC0415

    client = aioredis.Redis()  # never connected: nothing here talks to Redis
    worker = Worker(client, Settings(prefix=prefix), ["runtime"], name="w-hist", handlers={"runtime": EmbedEcho()})
    metrics = WorkerMetrics()
    metrics.bind(worker)
    stats_ = worker.owners["runtime"].stats
    observers = getattr(stats_, "observers", None)
    if isinstance(observers, list):
        for observe in observers:
            observe(0.02)
            observe(0.3)
    else:
        stats_.handler_seconds.extend([0.02, 0.3])
    scraped = samples(metrics.render().decode())
    labels = {"role": "runtime", "worker": "w-hist"}
    assert value(scraped, "riverbed_handler_seconds_count", **labels) == 2
    assert value(scraped, "riverbed_handler_seconds_bucket", le="0.025", **labels) == 1
    assert not getattr(stats_, "handler_seconds", [])


async def test_a_taken_port_is_a_clear_configuration_error(bus: Bus, prefix: str) -> None:
    worker = Worker(bus.redis, Settings(prefix=prefix), ["runtime"], name="w-port", handlers={"runtime": EmbedEcho()})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match="RIVERBED_METRICS_PORT"):
            await serve(worker, port, host="127.0.0.1")

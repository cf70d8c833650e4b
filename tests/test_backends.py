"""The Redis deployments the suite runs on: each test id names the one it really got."""

from __future__ import annotations

import pytest
import redis
from redis.asyncio.cluster import RedisCluster

from riverbed.bus.connection import connect_redis, stream_read_keys
from riverbed.bus.keys import Keys
from tests.kit.workers import sync_client

pytestmark = pytest.mark.anyio


async def test_redis_url_is_the_deployment_the_test_id_names(backend: str, redis_url: str) -> None:
    client = await connect_redis(redis_url)
    try:
        assert isinstance(client, RedisCluster) == (backend == "cluster")
    finally:
        await client.aclose()


def test_the_cluster_has_three_masters_serving_every_slot(redis_cluster_url: str) -> None:
    # About the cluster fixture itself, so it asks for the cluster by name.
    client = sync_client(redis_cluster_url)
    try:
        assert isinstance(client, redis.RedisCluster)
        masters = client.get_primaries()
        assert len(masters) == 3
        info = client.cluster_info(target_nodes=masters[0])
        assert info["cluster_state"] == "ok"
        assert int(info["cluster_slots_ok"]) == 16384
    finally:
        client.close()


def test_the_standalone_redis_is_no_cluster(standalone_redis_url: str) -> None:
    client = sync_client(standalone_redis_url)
    try:
        assert not client.info("cluster").get("cluster_enabled")
    finally:
        client.close()


def test_stream_read_keys_are_parsed_as_redis_does() -> None:
    assert stream_read_keys("XREAD", ("COUNT", 5, "BLOCK", 10, "STREAMS", "a", "b", "0-0", "0-0")) == ["a", "b"]
    assert stream_read_keys("xreadgroup", (b"GROUP", b"streams", b"c", b"NOACK", b"STREAMS", b"k", b">")) == [b"k"]
    assert stream_read_keys("XREAD", ("STREAMS", "a")) is None  # odd: Redis refuses it
    assert stream_read_keys("XREADGROUP", ("COUNT", 1, "STREAMS", "k", ">")) is None  # no GROUP
    assert stream_read_keys("XADD", ("k", "*", "f", "v")) is None


async def test_cluster_stream_reads_ask_no_node_for_their_keys(redis_cluster_url: str, prefix: str) -> None:
    # About the cluster client itself, so it asks for the cluster by name.
    keys = Keys(prefix)

    def getkeys_calls() -> int:
        client = sync_client(redis_cluster_url)
        try:
            assert isinstance(client, redis.RedisCluster)
            stats = client.info("commandstats", target_nodes=redis.RedisCluster.PRIMARIES)
            return sum(int(node.get("cmdstat_command|getkeys", {}).get("calls", 0)) for node in stats.values())
        finally:
            client.close()

    cluster = await connect_redis(redis_cluster_url)
    try:
        before = getkeys_calls()
        for i in range(10):
            log = keys.log(f"s{i}")
            await cluster.xadd(log, {"e": b"x"})
            assert await cluster.xread({log: "0-0"}, count=1, block=10)
            await cluster.xgroup_create(log, "runtime", id="0")
            assert await cluster.xreadgroup("runtime", "w", {log: ">"}, count=1, block=10)
        assert getkeys_calls() == before
        with pytest.raises(redis.RedisClusterException, match="same key slot"):
            await cluster.xread({keys.log("a"): "0-0", keys.log("b"): "0-0"})
    finally:
        await cluster.aclose()

"""The Redis deployments the suite runs on: each test id names the one it really got."""

from __future__ import annotations

import pytest
import redis
from redis.asyncio.cluster import RedisCluster

from riverbed.bus.connection import connect_redis
from tests.workerproc import sync_client

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

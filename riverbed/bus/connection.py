"""Connecting to Redis: standalone or Cluster, decided from the URL alone.

A URL whose server reports ``cluster_enabled:1`` gets a ``RedisCluster`` client; every
other URL a plain client.  Both retry a failed command with exponential backoff, and
:func:`translate` turns redis-py's connection errors into :class:`UnavailableError`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, TypeAlias
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from riverbed.errors import ConfigError, UnavailableError

Client: TypeAlias = Any  # redis.asyncio.Redis | RedisCluster: the commands we use exist on both

__all__ = ["Client", "connect_redis", "redact", "translate"]


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


@contextlib.contextmanager
def translate(url: str) -> Iterator[None]:
    """Turn redis-py's connection errors into :class:`UnavailableError`."""
    try:
        yield
    except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
        raise UnavailableError(f"cannot reach Redis at {redact(url)}: {exc}") from exc
    except (rexc.ClusterDownError, rexc.TryAgainError, rexc.SlotNotCoveredError) as exc:
        raise UnavailableError(f"the Redis Cluster at {redact(url)} is not serving every slot: {exc}") from exc
    except rexc.ResponseError as exc:
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            raise ConfigError(f"Redis at {redact(url)} refused the credentials: {exc}") from exc
        raise


def _retry() -> Retry:
    return Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=6)


async def connect_redis(url: str, *, max_connections: int = 2000) -> Client:
    """A connected client for ``url``; raises ConfigError or UnavailableError in one sentence."""
    common: dict[str, Any] = {
        "retry": _retry(),
        "retry_on_error": [rexc.ConnectionError, rexc.TimeoutError],
        "socket_connect_timeout": 5,
        "health_check_interval": 15,
    }
    try:
        client = aioredis.Redis.from_url(url, max_connections=max_connections, **common)
    except ValueError as exc:
        raise ConfigError(f"the Redis URL {redact(url)!r} is not valid: {exc}") from exc
    try:
        with translate(url):
            info = await client.info("cluster")
    except BaseException:
        await client.aclose()
        raise
    if not info.get("cluster_enabled"):
        return client
    await client.aclose()
    cluster = RedisCluster.from_url(url, max_connections=max_connections, **common)
    with translate(url):
        await cluster.initialize()
    return cluster

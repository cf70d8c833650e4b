"""The walls between API keys on the HTTP side: a request rate, open streams and acts per key.

- **Rate.**  Every request draws a token from its key's bucket (``scripts.TAKE_TOKEN``: it
  fills at ``RIVERBED_SERVE_RATE`` a second up to ``RIVERBED_SERVE_BURST``).  The bucket is in
  Redis, so every ``serve`` process of a prefix draws from the same one.  An empty bucket is
  429 with ``Retry-After`` and the limit in the body.
- **Long requests.**  Open event streams and acts waiting for their answer are counted per
  key in this process (each is a connection to this process, and on a Redis Cluster an act
  waits on a pooled Redis connection): one past ``RIVERBED_SERVE_MAX_STREAMS_PER_KEY`` or
  ``RIVERBED_SERVE_MAX_ACTS_PER_KEY`` is 429.  With N ``serve`` processes behind a balancer,
  a key may hold N times as many.
- **Revocation.**  Every :data:`CHECK_SECONDS` the keys that hold open streams are read in one
  call, and the streams of a key revoked since end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import anyio
import structlog
from anyio.abc import TaskStatus
from starlette.exceptions import HTTPException

from riverbed.bus import scripts
from riverbed.bus.keys import Keys
from riverbed.bus.redis_client import RedisClient
from riverbed.errors import RiverbedError
from riverbed.serve.auth import KeyStore, Principal

__all__ = ["CHECK_SECONDS", "RateLimit", "Slot", "Slots", "Streams"]

log = structlog.get_logger("riverbed.serve")

CHECK_SECONDS = 2.0
"""How often the keys holding open streams are checked for revocation."""


class RateLimit:
    """Each key's request rate (a token bucket in Redis); ``rate`` 0: no limit."""

    def __init__(self, redis: RedisClient, keys: Keys, *, rate: float, burst: int) -> None:
        self.redis = redis
        self.keys = keys
        self.rate = rate
        self.burst = burst
        self.script = redis.script(scripts.TAKE_TOKEN)

    async def take(self, who: Principal) -> None:
        """Take a token of ``who``'s bucket; 429 with ``Retry-After`` when it is empty."""
        if self.rate <= 0:
            return
        taken, wait_ms = await self.script([self.keys.rate(who.key_id)], [self.rate, self.burst])
        if int(taken):
            return
        seconds = max(1, math.ceil(int(wait_ms) / 1000))
        raise HTTPException(
            429,
            f"this API key made more than {self.rate:g} requests a second (bursts of {self.burst}: "
            f"RIVERBED_SERVE_RATE, RIVERBED_SERVE_BURST); try again in {seconds}s",
            headers={"Retry-After": str(seconds)},
        )


@dataclass(eq=False)
class Slot:
    """One long request of a key (an open stream, an act waiting for its answer); :attr:`revoked`
    is set when the key is revoked (streams end then)."""

    slots: Slots
    key_id: str
    revoked: anyio.Event

    def release(self) -> None:
        self.slots.release(self)


class Slots:
    """Long requests of one kind open on this process, per key, at most ``most`` each."""

    def __init__(self, what: str, setting: str, *, most: int) -> None:
        self.what = what
        self.setting = setting
        self.most = most
        self._held: dict[str, set[Slot]] = {}

    def open(self, key_id: str) -> int:
        """The requests of this kind ``key_id`` holds open here now."""
        return len(self._held.get(key_id, ()))

    def take(self, who: Principal) -> Slot:
        """A slot for one more request of ``who``; 429 when the key holds its limit."""
        held = self._held.setdefault(who.key_id, set())
        if len(held) >= self.most:
            raise HTTPException(
                429,
                f"this API key holds {len(held)} {self.what}, the limit of this server "
                f"({self.setting}={self.most}); wait for one to end",
                headers={"Retry-After": "1"},
            )
        slot = Slot(self, who.key_id, anyio.Event())
        held.add(slot)
        return slot

    def release(self, slot: Slot) -> None:
        held = self._held.get(slot.key_id)
        if held is not None:
            held.discard(slot)
            if not held:
                del self._held[slot.key_id]


class Streams(Slots):
    """The event streams open on this process, per key, and the end of a revoked key's."""

    def __init__(self, keys: KeyStore, *, most: int, check_seconds: float = CHECK_SECONDS) -> None:
        super().__init__("event streams open", "RIVERBED_SERVE_MAX_STREAMS_PER_KEY", most=most)
        self.keys = keys
        self.check_seconds = check_seconds

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """End the streams of revoked keys, checking every :attr:`check_seconds`."""
        task_status.started()
        while True:
            await anyio.sleep(self.check_seconds)
            ids = list(self._held)
            if not ids:
                continue
            try:
                live = await self.keys.live(ids)
            except RiverbedError as exc:  # Redis away: the next round checks again
                log.warning("serve.revocation_check_failed", error=str(exc))
                continue
            for key_id in ids:
                if key_id not in live:
                    for slot in list(self._held.get(key_id, ())):
                        slot.revoked.set()

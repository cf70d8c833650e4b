"""The walls between tenants on the HTTP side: a request rate, open streams and acts per
tenant, each with a smaller sub-limit per API key.

A tenant's keys share its limits: a tenant that makes more keys gets no more room.  (An admin
key without a tenant is a tenant of its own for these limits.)

- **Rate.**  Every request draws a token from its tenant's bucket and its key's
  (``scripts.TAKE_TOKENS``, one call: each fills at its rate a second up to its burst,
  ``RIVERBED_SERVE_TENANT_RATE``/``_BURST`` and ``RIVERBED_SERVE_RATE``/``_BURST``).  The
  buckets are in Redis, so every ``serve`` process of a prefix draws from the same ones.  An
  empty bucket is 429 with ``Retry-After`` and the limit in the body.
- **Long requests.**  Open event streams and acts waiting for their answer are counted per
  tenant and per key in this process (each is a connection to this process, and on a Redis
  Cluster an act waits on a pooled Redis connection): one past
  ``RIVERBED_SERVE_MAX_STREAMS_PER_TENANT`` or ``RIVERBED_SERVE_MAX_ACTS_PER_TENANT`` (or the
  key's ``..._PER_KEY``) is 429.  With N ``serve`` processes behind a balancer, a tenant may
  hold N times as many.
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

__all__ = ["CHECK_SECONDS", "RateLimit", "Slot", "Slots", "Streams", "tenant_of"]

log = structlog.get_logger("riverbed.serve")

CHECK_SECONDS = 2.0
"""How often the keys holding open streams are checked for revocation."""


def tenant_of(who: Principal) -> str:
    """The tenant whose limits ``who``'s requests count toward (an admin key without a tenant:
    its own, named so that no tenant can be called the same: tenant names start with a letter or digit)."""
    return who.tenant if who.tenant is not None else f"~{who.key_id}"


class RateLimit:
    """Each tenant's and each key's request rate (token buckets in Redis); a rate of 0: no limit."""

    def __init__(
        self, redis: RedisClient, keys: Keys, *, rate: float, burst: int, tenant_rate: float = 0, tenant_burst: int = 1
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.rate = rate
        self.burst = burst
        self.tenant_rate = tenant_rate
        self.tenant_burst = tenant_burst
        self.script = redis.script(scripts.TAKE_TOKENS)

    async def take(self, who: Principal) -> None:
        """Take a token of ``who``'s buckets; 429 with ``Retry-After`` when one is empty."""
        if self.rate <= 0 and self.tenant_rate <= 0:
            return
        tenant = tenant_of(who)
        buckets = [self.keys.rate(who.key_id), self.keys.tenant_rate(tenant)]
        limits = [self.rate, self.burst, self.tenant_rate, self.tenant_burst]
        taken, wait_ms, empty = await self.script(buckets, limits)
        if int(taken):
            return
        seconds = max(1, math.ceil(int(wait_ms) / 1000))
        if int(empty) == 2:
            said = (
                f"tenant {tenant!r} made more than {self.tenant_rate:g} requests a second over all its keys "
                f"(bursts of {self.tenant_burst}: RIVERBED_SERVE_TENANT_RATE, RIVERBED_SERVE_TENANT_BURST)"
            )
        else:
            said = (
                f"this API key made more than {self.rate:g} requests a second (bursts of {self.burst}: "
                "RIVERBED_SERVE_RATE, RIVERBED_SERVE_BURST)"
            )
        raise HTTPException(429, f"{said}; try again in {seconds}s", headers={"Retry-After": str(seconds)})


@dataclass(eq=False)
class Slot:
    """One long request of a key (an open stream, an act waiting for its answer); :attr:`revoked`
    is set when the key is revoked (streams end then)."""

    slots: Slots
    key_id: str
    tenant: str
    revoked: anyio.Event

    def release(self) -> None:
        self.slots.release(self)


class Slots:
    """Long requests of one kind open on this process: at most ``most`` per tenant over all its
    keys, and at most ``per_key`` per key."""

    def __init__(self, what: str, setting: str, *, most: int, per_key: int | None = None) -> None:
        self.what = what
        self.setting = setting
        """the tenant's limit's variable; the key's is the same with ``_PER_KEY``"""
        self.most = most
        self.per_key = most if per_key is None else per_key
        self._held: dict[str, set[Slot]] = {}
        """key id -> its slots"""
        self._tenants: dict[str, int] = {}
        """tenant -> slots its keys hold"""

    def open(self, key_id: str) -> int:
        """The requests of this kind ``key_id`` holds open here now."""
        return len(self._held.get(key_id, ()))

    def open_for(self, tenant: str) -> int:
        """The requests of this kind ``tenant``'s keys hold open here now."""
        return self._tenants.get(tenant, 0)

    def take(self, who: Principal) -> Slot:
        """A slot for one more request of ``who``; 429 when its tenant or the key holds its limit."""
        tenant = tenant_of(who)
        held = self._held.get(who.key_id, set())
        by_tenant = self._tenants.get(tenant, 0)
        if by_tenant >= self.most:
            raise HTTPException(
                429,
                f"tenant {tenant!r} holds {by_tenant} {self.what} over all its keys, the limit of this server "
                f"({self.setting}_PER_TENANT={self.most}); wait for one to end",
                headers={"Retry-After": "1"},
            )
        if len(held) >= self.per_key:
            raise HTTPException(
                429,
                f"this API key holds {len(held)} {self.what}, the limit of this server "
                f"({self.setting}_PER_KEY={self.per_key}); wait for one to end",
                headers={"Retry-After": "1"},
            )
        slot = Slot(self, who.key_id, tenant, anyio.Event())
        self._held.setdefault(who.key_id, held).add(slot)
        self._tenants[tenant] = by_tenant + 1
        return slot

    def release(self, slot: Slot) -> None:
        held = self._held.get(slot.key_id)
        if held is None or slot not in held:
            return
        held.discard(slot)
        if not held:
            del self._held[slot.key_id]
        left = self._tenants.get(slot.tenant, 0) - 1
        if left > 0:
            self._tenants[slot.tenant] = left
        else:
            self._tenants.pop(slot.tenant, None)


class Streams(Slots):
    """The event streams open on this process, per tenant and per key, and the end of a revoked key's."""

    def __init__(
        self, keys: KeyStore, *, most: int, per_key: int | None = None, check_seconds: float = CHECK_SECONDS
    ) -> None:
        super().__init__("event streams open", "RIVERBED_SERVE_MAX_STREAMS", most=most, per_key=per_key)
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

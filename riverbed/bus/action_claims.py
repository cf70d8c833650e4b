"""Action claims: a runtime owner's atomic "I start this action now", fenced by its lease's token.

A lease (``bus/leases.py``) says which worker owns a session for a role; a claim says which
action that owner has started, so that no other owner starts it again.

Before it runs an action with a side effect (a read, ``repeatable``, is run unclaimed: running
it twice changes nothing), the owner calls the CLAIM script (``scripts.CLAIM``), which in one
step checks that the caller still holds the session with the current fencing token, that the
action is not answered, and that nobody claimed it before; then records the claim in the
session's ``claims`` hash (``keys.claims``) and pushes the owner's lease forward by a whole
lease.  So:

- a stale owner (paused past its lease, then resumed) is refused (:class:`FencedError`) and
  does not run the action: only the current owner executes;
- a new owner runs again every in-flight action that was never claimed: it never started;
- an action claimed by a lost owner had started, so only it is answered ``runtime_lost``.

A claim is only as good as the time between it and the start of the action: the claim
guarantees a whole lease before a peer can take over, and the action starts only while less
than :data:`START_WITHIN` of a lease has passed since the claim was sent (:attr:`Claimed.fresh`,
checked by the worker before it hands the action to the sandbox, and the deadline checked again
where the side effect begins: see ``riverbed.runtime.gate``).  Later (the worker was paused, the
network stalled, the machine too loaded for the shell to read its line) it claims again under
the same claim value, which succeeds only while it is still the owner.  What no claim can cover
is a pause within the few statements between that last comparison and the start itself.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal

import anyio

from riverbed.bus import scripts
from riverbed.bus.backoff import retry_unavailable
from riverbed.bus.faults import crashpoint
from riverbed.bus.keys import Keys
from riverbed.bus.log import Fence
from riverbed.bus.redis_client import Arg, RawClient, RedisClient, as_client
from riverbed.errors import FencedError

__all__ = ["Claimed", "Claims"]


START_WITHIN = 0.75
"""How much of a lease may pass between sending a claim and starting its action."""


@dataclass(frozen=True)
class Claimed:
    """The outcome of a claim: ``ok`` (run it), ``answered`` (``detail``: the answer's id) or
    ``claimed`` (``detail``: the claim of the owner that started it before).

    ``value`` is this claim's own value; ``start_by`` (``time.monotonic()``) is how long it
    stays fresh: :data:`START_WITHIN` of a lease after its round trip began.  No peer can have
    taken the session over before then (the claim pushed the lease a whole lease forward; the
    rest is a margin for the clocks)."""

    status: Literal["ok", "answered", "claimed"]
    detail: str = ""
    value: str = ""
    start_by: float = 0.0

    @property
    def fresh(self) -> bool:
        """Whether the action may start now on the strength of this claim."""
        return time.monotonic() < self.start_by


class Claims:
    """CLAIM calls for one worker."""

    def __init__(
        self, redis: RedisClient | RawClient, keys: Keys, *, worker: str, lease_seconds: float, url: str = "redis"
    ) -> None:
        self.redis = as_client(redis, url)
        self.keys = keys
        self.worker = worker
        self.lease_seconds = lease_seconds
        self._claim = self.redis.script(scripts.CLAIM)

    async def claim(
        self,
        session: str,
        action_id: int,
        fence: Fence,
        *,
        force: bool = False,
        again: Claimed | None = None,
        stopping: anyio.Event | None = None,
    ) -> Claimed:
        """Claim ``action_id`` for ``fence``'s owner; :class:`FencedError` when it is stale.

        ``force`` claims over another owner's claim (actions that are safe to repeat);
        ``again`` renews an earlier claim of this owner (same value: not a second start).
        Retried under the same value while Redis is unreachable (unless ``stopping`` is set).
        """
        value = again.value if again is not None else f"{self.worker}:{fence.token}:{secrets.token_hex(4)}"
        keys = [self.keys.meta(session), self.keys.claims(session), self.keys.answers(session)]
        args: list[Arg] = [fence.role, self.worker, fence.token, math.ceil(self.lease_seconds * 1000), action_id, value]
        args.append("1" if force else "")
        sent = 0.0

        async def send() -> Any:
            nonlocal sent
            sent = time.monotonic()  # freshness counts from the try that got through
            return await self._claim(keys, args)

        reply = await retry_unavailable(
            send, stopping=stopping, what="claim.unavailable", session=session, event_id=action_id
        )
        crashpoint("after_claim")
        status = reply[0]
        if status == b"fenced":
            raise FencedError(session, fence.role, fence.token, int(reply[1]))
        if status == b"answered":
            return Claimed("answered", str(int(reply[1])))
        if status == b"claimed":
            held = reply[1]
            return Claimed("claimed", held.decode() if isinstance(held, bytes) else str(held))
        if status != b"ok":
            raise RuntimeError(f"unexpected claim reply {reply!r}")
        return Claimed("ok", value=value, start_by=sent + self.lease_seconds * START_WITHIN)

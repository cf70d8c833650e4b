"""Claims (``bus/action_claims.py``): only the runtime owner with the current fencing token starts an
action, once, never after its answer; on both Redis deployments."""

from __future__ import annotations

import anyio
import pytest

from riverbed import events
from riverbed.bus.action_claims import Claimed, Claims
from riverbed.bus.leases import Claim, Leases
from riverbed.bus.log import Fence
from riverbed.client.session import Bus
from riverbed.errors import FencedError

pytestmark = [pytest.mark.anyio]

LEASE_MS = 300


def leases(bus: Bus, worker: str) -> Leases:
    return Leases(bus.redis, bus.keys, "runtime", worker=worker, lease_ms=LEASE_MS, url=bus.url)


def claims(bus: Bus, worker: str) -> Claims:
    return Claims(bus.redis, bus.keys, worker=worker, lease_seconds=LEASE_MS / 1000, url=bus.url)


async def acquire(bus: Bus, session: str, worker: str) -> Fence:
    """Take ``session`` for ``worker`` as soon as the holder's lease allows."""
    with anyio.fail_after(10):
        while True:
            got = await leases(bus, worker).acquire(Claim(session, f"0-{worker}"))
            if got.token:
                return Fence("runtime", got.token)
            await anyio.sleep(0.02)


async def redis_now_ms(bus: Bus) -> int:
    seconds, micros = await bus.redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def test_the_owner_claims_an_action_once(bus: Bus) -> None:
    (action,) = await bus.session("c").append(events.CmdRun(command="echo hi"))
    fence = await acquire(bus, "c", "w1")
    assert (await claims(bus, "w1").claim("c", action, fence)).status == "ok"
    again = await claims(bus, "w1").claim("c", action, fence)  # a second start, even by the owner
    assert again.status == "claimed"
    assert again.detail.startswith(f"w1:{fence.token}:")
    assert (await claims(bus, "w1").claim("c", action, fence, force=True)).status == "ok"  # safe to repeat


async def test_a_claim_with_a_stale_token_is_refused_and_records_nothing(bus: Bus) -> None:
    (action,) = await bus.session("c").append(events.CmdRun(command="echo hi"))
    stale = await acquire(bus, "c", "w1")
    current = await acquire(bus, "c", "w2")  # after w1's lease ran out
    assert current.token > stale.token
    for force in (False, True):
        with pytest.raises(FencedError) as refused:
            await claims(bus, "w1").claim("c", action, stale, force=force)
        assert refused.value.current == current.token
    assert not await bus.redis.hexists(bus.keys.claims("c"), str(action))
    # Nor does another worker get in with the current token: the holder must be the claimer.
    with pytest.raises(FencedError):
        await claims(bus, "w1").claim("c", action, current)
    assert (await claims(bus, "w2").claim("c", action, current)).status == "ok"


async def test_an_answered_action_is_not_claimed_and_an_answer_clears_its_claim(bus: Bus) -> None:
    session = bus.session("c")
    first, second = await session.append(events.CmdRun(command="echo 1"), events.CmdRun(command="echo 2"))
    fence = await acquire(bus, "c", "w1")
    assert (await claims(bus, "w1").claim("c", first, fence)).status == "ok"
    (answer,) = await session.append(events.CmdOutput(content="1", exit_code=0, cause=first))
    (other,) = await session.append(events.Error(content="cancelled", reason="cancelled", cause=second))
    assert await bus.redis.hlen(bus.keys.claims("c")) == 0
    assert await claims(bus, "w1").claim("c", first, fence) == Claimed("answered", str(answer))
    assert (await claims(bus, "w1").claim("c", second, fence, force=True)).detail == str(other)


async def test_a_claim_pushes_the_lease_forward(bus: Bus) -> None:
    """An owner whose lease ran out but that nobody took over yet may still claim; then a peer
    cannot take the session for a whole lease: the action starts well before a takeover."""
    (action,) = await bus.session("c").append(events.CmdRun(command="echo hi"))
    fence = await acquire(bus, "c", "w1")
    with anyio.fail_after(10):  # until w1's lease has run out
        while int(await bus.redis.hget(bus.keys.meta("c"), "expires:runtime")) > await redis_now_ms(bus):
            await anyio.sleep(0.02)
    assert (await claims(bus, "w1").claim("c", action, fence)).status == "ok"
    refused = await leases(bus, "w2").acquire(Claim("c", "0-w2"))
    assert refused.token == 0
    assert refused.holder == "w1"
    assert refused.left_ms > LEASE_MS // 2

"""Ownership in-process: pickup, capacity, fencing after takeover, dead letters, parking."""

from __future__ import annotations

import time
from typing import Any

import anyio
import msgspec
import pytest

from riverbed import events
from riverbed.bus.consumer import Owner, SessionContext
from riverbed.bus.dlq import DeadLetters
from riverbed.bus.leases import Claim, Leases
from riverbed.bus.log import Fence
from riverbed.client.session import Bus
from riverbed.errors import FencedError
from tests.kit.agent_faults import wait_until
from tests.kit.leases import ROLE, acquired, expiries
from tests.kit.owners import EchoHandler, make_owner
from tests.kit.patience import within

pytestmark = pytest.mark.anyio


async def test_pickup_is_fast_and_capacity_is_respected(bus: Bus) -> None:
    owner, _ = make_owner(bus, "w1", capacity=3, lease_seconds=2)
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        started = time.monotonic()
        obs = await bus.session("a").act(events.FileRead(path="x"), timeout=5)
        assert isinstance(obs, events.FileContent)
        assert obs.content == "w1"
        assert time.monotonic() - started < 5  # the wake-up, not a poll of the 2 s lease
        for s in ("b", "c", "d", "e"):
            await bus.session(s).append(events.FileRead(path="y"))
        await anyio.sleep(0.5)
        assert len(owner.owned) == 3
        await owner.drain(2)
    assert not owner.owned


async def test_second_worker_takes_the_rest_and_a_drained_worker_hands_over(bus: Bus) -> None:
    first, _ = make_owner(bus, "w1", capacity=2, lease_seconds=30)
    second, _ = make_owner(bus, "w2", capacity=10, lease_seconds=30)
    async with anyio.create_task_group() as tg:
        await tg.start(first.run)
        await tg.start(second.run)
        answers = [await bus.session(f"s{i}").act(events.FileRead(path="p"), timeout=5) for i in range(4)]
        owners = {a.content for a in answers if isinstance(a, events.FileContent)}
        assert owners == {"w1", "w2"}
        await first.drain(2)
        for i in range(4):  # each within 20 s, below the 30 s lease: handed over, not expired
            obs = await bus.session(f"s{i}").act(events.FileRead(path="q"), timeout=20)
            assert isinstance(obs, events.FileContent)
            assert obs.content == "w2"
        await second.drain(2)


async def test_takeover_bumps_the_fencing_token(bus: Bus) -> None:
    await bus.session("t").append(events.Think(thought="x"))
    claim = Claim(session="t", entry="0-1")
    old = Leases(bus.redis, bus.keys, "runtime", worker="old", lease_ms=200, url=bus.url)
    new = Leases(bus.redis, bus.keys, "runtime", worker="new", lease_ms=200, url=bus.url)
    await old.ensure_group()
    got_old = await old.acquire(claim)
    assert got_old.token == 1
    refused = await new.acquire(claim)
    assert refused.token == 0
    assert refused.holder == "old"
    await anyio.sleep(0.3)
    got_new = await new.acquire(claim)
    assert got_new.token == 2
    with pytest.raises(FencedError):
        await bus.log_store.append("t", [events.Think(thought="zombie")], fence=Fence("runtime", got_old.token))
    assert (await old.renew({"t": ("0-1", got_old.token)})).lost == {"t"}


async def test_a_live_owners_handle_is_claimed_every_other_renewal_and_never_reclaimed_by_a_peer(bus: Bus) -> None:
    """An owner renews every quarter lease but claims its sessions' directory entries again
    (``XCLAIM``, a few µs of Redis an entry) only every other round: an entry is idle for more
    than a round at times, yet never for the lease after which a peer reclaims it, so a peer
    reclaiming all the while takes none."""
    owner, _ = make_owner(bus, "w1", capacity=4, lease_seconds=1)
    peer = Leases(bus.redis, bus.keys, "runtime", worker="w2", lease_ms=1000, url=bus.url)
    directory = bus.keys.directory("runtime")
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        assert isinstance(await bus.session("kept").act(events.FileRead(path="p"), timeout=5), events.FileContent)
        idle: list[int] = []
        deadline = time.monotonic() + 3.0  # three leases, twelve renewals
        while time.monotonic() < deadline:
            assert await peer.reclaim_stale(10) == [], "a peer reclaimed the session of a live owner"
            [handle] = await bus.redis.xpending_range(directory, "runtime", "-", "+", 10)
            assert handle["consumer"] == b"w1"
            idle.append(handle["time_since_delivered"])
            await anyio.sleep(0.05)
        assert "kept" in owner.owned
        assert max(idle) < 1000
        # Claimed every round, the entry would be idle for a round (250 ms) at most.
        assert max(idle) > 300, f"the handle was claimed again at every renewal: idle at most {max(idle)} ms"
        await owner.drain(2)


async def test_a_reclaim_round_reads_the_pending_entries_only_once_their_holder_went_quiet(bus: Bus) -> None:
    """A live owner claims its handles every other renewal, so its consumer is never idle for
    three quarters of a lease: a peer's round beside it asks the consumers and scans none of the
    pending entries (every session the role's workers hold).  Once the holder stops, its consumer
    goes quiet, and the round takes each of its sessions as the lease runs out."""
    names = [f"q{i}" for i in range(6)]
    holder, owned = await acquired(bus, names, 2000)
    peer = Leases(bus.redis, bus.keys, ROLE, worker="p", lease_ms=2000, url=bus.url)
    # A renewal every 100 ms claims the handles every 800 to 900 ms; quiet is 1,500 ms.
    deadline = time.monotonic() + 2.4  # three claims of the handles
    while time.monotonic() < deadline:
        assert (await holder.renew(owned)).lost == set()
        assert await peer.quiet() == [], "a live holder's consumer looked quiet"
        await anyio.sleep(0.1)
    with anyio.fail_after(within(5)):
        while not await peer.quiet():
            await anyio.sleep(0.05)
    assert await peer.quiet() == [(bus.keys.directory(ROLE), None)]
    taken: list[Claim] = []
    with anyio.fail_after(within(5)):
        while len(taken) < len(names):
            taken += await peer.reclaim_stale(10)
            await anyio.sleep(0.05)
    assert sorted(claim.session for claim in taken) == names
    assert await peer.quiet() == []  # (the peer holds them now, and claimed them a moment ago)


async def test_an_entry_a_busy_owner_left_behind_is_found_by_a_sweep(bus: Bus) -> None:
    """An entry read and not taken (an acquire that failed) stays pending on a consumer that
    goes on claiming its other handles: the consumers say nothing of it, and a round that sweeps
    (each worker's, once a lease; its reader's, a lease after) takes it."""
    holder, owned = await acquired(bus, ["kept"], 1500)
    await bus.session("left").append(events.Think(thought="x"))
    [left] = await holder.read_new(10, 100)
    peer = Leases(bus.redis, bus.keys, ROLE, worker="p", lease_ms=1500, url=bus.url)
    deadline = time.monotonic() + 2.0  # (the entry left behind is idle for more than the lease)
    while time.monotonic() < deadline:
        assert (await holder.renew(owned)).lost == set()
        assert await peer.reclaim_stale(10) == []
        await anyio.sleep(0.1)
    [swept] = await peer.reclaim_stale(10, sweep=True)
    assert (swept.session, swept.entry) == ("left", left.entry)


async def test_a_consumer_that_holds_nothing_and_went_quiet_is_forgotten(bus: Bus) -> None:
    """The directory's group lists every worker name that ever read it (a restarted worker is a
    new name): one that holds no entry and was quiet for twenty leases is forgotten; one that
    holds entries never is."""
    await acquired(bus, ["held"], 50)
    directory = bus.keys.directory(ROLE)
    await bus.redis.xgroup_createconsumer(directory, ROLE, "gone")
    peer = Leases(bus.redis, bus.keys, ROLE, worker="p", lease_ms=50, url=bus.url)
    assert {c["name"] for c in await bus.redis.xinfo_consumers(directory, ROLE)} == {b"w", b"gone"}
    await anyio.sleep(1.1)
    assert await peer.quiet() == [(directory, None)]  # ("w" holds an entry it stopped claiming)
    assert {c["name"] for c in await bus.redis.xinfo_consumers(directory, ROLE)} == {b"w"}


async def test_renewal_reloads_scripts_a_node_lost(bus: Bus) -> None:
    """A restarted or failed-over node has no scripts; renewing still works (and finds no loss)."""
    names = [f"r{i}" for i in range(6)]  # spread over the nodes of a cluster
    leases, owned = await acquired(bus, names, 5000)
    before = await expiries(bus, names)
    await bus.redis.script_flush()
    await anyio.sleep(0.01)
    assert (await leases.renew(owned)).lost == set()
    after = await expiries(bus, names)
    assert all(a > b for a, b in zip(after, before, strict=True))
    owned["r0"] = (owned["r0"][0], owned["r0"][1] + 1)  # a stale token is a lost lease
    assert (await leases.renew(owned)).lost == {"r0"}


async def test_a_worker_holding_more_sessions_than_a_renewal_call_takes_renews_each_and_loses_only_the_stale(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Renewing 1,100 sessions (three script calls on a standalone Redis): every lease moves on
    but those whose token went stale or whose holder changed, which are reported lost."""
    count = 1_100
    names = [f"many{i}" for i in range(count)]
    async with bus.redis.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hset(bus.keys.meta(name), mapping={f"holder:{ROLE}": "w", f"fence:{ROLE}": 3, f"expires:{ROLE}": 1})
        await pipe.execute()
    leases = Leases(bus.redis, bus.keys, ROLE, worker="w", lease_ms=5000, url=bus.url)
    await leases.ensure_group()
    owned = dict.fromkeys(names, ("0-1", 3))
    owned["many7"] = ("0-1", 2)  # a token a takeover made stale
    owned["many1050"] = ("0-1", 4)
    await bus.redis.hset(bus.keys.meta("many600"), f"holder:{ROLE}", "peer")
    pipelines = []
    open_pipeline = leases.redis.pipeline

    def counted(**options: Any) -> Any:
        pipelines.append(1)
        return open_pipeline(**options)

    monkeypatch.setattr(leases.redis, "pipeline", counted)
    await bus.redis.script_flush()  # the round is sent again once the scripts are loaded
    assert (await leases.renew(owned)).lost == {"many7", "many1050", "many600"}
    # Every chunk's script and XCLAIM in one write (two with the reload): a busy worker's
    # commands each wait for a connection and a turn, and a renewal in many waits ran out.
    assert len(pipelines) == 2
    expires = await expiries(bus, names)
    moved = {name for name, value in zip(names, expires, strict=True) if value > 1}
    assert moved == set(names) - {"many7", "many1050", "many600"}


class _Contexts(EchoHandler):
    """The echo handler, keeping each session's context (to ask it whether the lease holds)."""

    def __init__(self) -> None:
        super().__init__()
        self.contexts: dict[str, SessionContext] = {}

    async def open(self, ctx: SessionContext) -> None:
        self.contexts[ctx.session] = ctx


async def test_an_owner_knows_it_holds_a_lease_its_renewal_confirmed_and_asks_redis_once_that_is_old(
    bus: Bus,
) -> None:
    """``SessionContext.holds`` (what the agent role's model call waits for): no read while the
    owner's last confirmed renewal was sent less than three quarters of a lease ago; past that
    (the process was paused), Redis is asked, and a peer's lease there is seen."""
    handler = _Contexts()
    owner = Owner(bus.redis, bus.keys, handler, worker="w1", url=bus.url, lease_seconds=2)
    meta = bus.keys.meta
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        for session in ("known", "paused"):
            assert isinstance(await bus.session(session).act(events.FileRead(path="p"), timeout=5), events.FileContent)
        await wait_until(
            lambda: all(owner.owned[s].renewed > 0 for s in ("known", "paused")), 2, "no renewal confirmed"
        )
        known, paused = handler.contexts["known"], handler.contexts["paused"]
        assert await known.holds()
        assert await paused.holds()

        # Another holder written under the owner (never a peer's doing within the lease): not read.
        await bus.redis.hset(meta("known"), "holder:runtime", "w2")
        assert await known.holds()
        # The next renewal finds the lease lost: from then on, not held.
        await wait_until(lambda: "known" not in owner.owned, 2, "the renewal did not find the lease lost")
        assert not await known.holds()

        # A renewal sent a lease ago (the owner was paused since): Redis is asked.
        owner.owned["paused"].renewed -= 2.0
        await bus.redis.hset(meta("paused"), "holder:runtime", "w2")
        assert not await paused.holds()
        await owner.drain(2)


async def test_an_owner_knows_it_holds_a_lease_it_just_acquired_before_any_renewal(bus: Bus) -> None:
    """The acquire set the lease: it holds for a lease from when the acquire was sent, so the
    session's first model calls need no read either (a lease of a minute: the first renewal
    round comes 15 s after the owner started)."""
    handler = _Contexts()
    owner = Owner(bus.redis, bus.keys, handler, worker="w1", url=bus.url, lease_seconds=60)
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        started = time.monotonic()
        assert isinstance(await bus.session("new").act(events.FileRead(path="p"), timeout=5), events.FileContent)
        assert started < owner.owned["new"].renewed < time.monotonic()
        assert handler.contexts["new"].holds_now()
        await owner.drain(2)


class _Retiring(EchoHandler):
    """The echo handler with nothing more to do once a session is idle (as the agent role once a run ended)."""

    def __init__(self) -> None:
        super().__init__()
        self.opened: list[str] = []

    async def open(self, ctx: SessionContext) -> None:
        self.opened.append(ctx.session)

    def retires(self, ctx: SessionContext) -> bool:
        return True


async def test_a_session_whose_group_a_previous_owner_moved_past_its_last_events_is_retired(bus: Bus) -> None:
    """A previous owner appended events and moved its group past them (its own moves), then lost
    the lease before retiring the session: the next owner reads nothing new, and retires it
    rather than being refused (the log's last is past what it read) look after look."""
    session = bus.session("moved")
    await session.append(events.FileRead(path="x"))
    await bus.client.xgroup_create(bus.keys.log("moved"), "runtime", "$")  # (delivered, handled)
    handler = _Retiring()
    owner = Owner(bus.redis, bus.keys, handler, worker="w1", url=bus.url, lease_seconds=5)
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        await wait_until(lambda: "moved" in handler.opened, 5, "the session was not taken")
        await wait_until(lambda: "moved" not in owner.owned, 3, "the idle session was not retired")
        await owner.drain(2)
    assert handler.seen == []  # (nothing was delivered again)


async def test_poison_entries_are_dead_lettered_and_the_worker_goes_on(bus: Bus) -> None:
    owner, _ = make_owner(bus, "w1", lease_seconds=2, max_attempts=2)
    session = bus.session("poison")
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        bad = await session.act(events.FileRead(path="boom"), timeout=10)
        assert isinstance(bad, events.Error)
        assert bad.reason == "dead_letter"
        await bus.redis.xadd(bus.keys.log("poison"), {"e": b"\xc1not msgpack"}, id=f"{await session.last_id() + 1}-0")
        await bus.redis.hincrby(bus.keys.meta("poison"), "last", 1)
        good = await session.act(events.FileRead(path="fine"), timeout=10)
        assert isinstance(good, events.FileContent)
        await owner.drain(2)
    letters = await DeadLetters(bus.redis, bus.keys).list()
    reasons = sorted(letter.reason for letter in letters)
    assert reasons[0] == "failed too many times: ValueError: handler bug"  # with the last error
    assert reasons[1:] == ["undecodable payload"]
    log = await session.events()
    assert sum(isinstance(e, events.Error) and e.reason == "dead_letter" for e in log) == 2


async def act_until_parked(bus: Bus, owner: Owner, session: str) -> None:
    """One action on ``session``, answered by ``owner`` (running), then wait until it parked."""
    await bus.session(session).act(events.FileRead(path="a"), timeout=5)
    with anyio.fail_after(10):
        while owner.owned:
            await anyio.sleep(0.05)


async def test_idle_sessions_are_parked_and_woken_by_the_next_append(bus: Bus) -> None:
    owner, _ = make_owner(bus, "w1", lease_seconds=2, park_after=0.3)
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        await act_until_parked(bus, owner, "sleepy")
        obs = await bus.session("sleepy").act(events.FileRead(path="b"), timeout=5)
        assert isinstance(obs, events.FileContent)
        await owner.drain(2)


class _SlowClose(EchoHandler):
    """Closes a session after ``pause`` seconds (as a runtime stops a sandbox)."""

    def __init__(self, pause: float) -> None:
        super().__init__()
        self.pause = pause

    async def close(self, ctx: SessionContext) -> None:
        await anyio.sleep(self.pause)


async def test_a_session_parked_while_its_close_is_slow_is_not_renewed_nor_reported_lost(bus: Bus) -> None:
    """A loop that parks its session gives the lease back first, then the handler closes the
    session (a runtime's sandbox: here a pause of several renewal rounds).  Meanwhile the owner
    renews that lease no more, so none is reported lost, and once closed the session is let go."""
    # (a renewal round every 0.5 s: three or four of them during the close)
    owner = Owner(bus.redis, bus.keys, _SlowClose(1.6), worker="w1", url=bus.url, lease_seconds=2, park_after=0.3)
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        await act_until_parked(bus, owner, "slow-close")
        assert owner.stats.lost == 0
        await owner.drain(2)


async def test_a_renewal_answered_after_the_session_was_given_back_reports_no_lost_lease(bus: Bus) -> None:
    """A renewal round sent with the session in it, and answered only after the loop released
    the lease (parked), finds the lease gone: that is no lost lease, and the park is no fence."""

    # (parked after two renewal rounds at least: the first one with the session in it waits; the
    # owner still holds the session, closing, when the renewal answers)
    owner = Owner(bus.redis, bus.keys, _SlowClose(0.5), worker="w1", url=bus.url, lease_seconds=2, park_after=1.2)
    leases = owner.handles.leases
    released = anyio.Event()
    renew, release = leases.renew, leases.release

    async def renew_after_the_release(snapshot: dict[str, tuple[str, int]]) -> Any:
        if "given-back" in snapshot:
            with anyio.move_on_after(5):
                await released.wait()
        return await renew(snapshot)

    async def release_and_tell(*args: Any, **kwargs: Any) -> int:
        answer = await release(*args, **kwargs)
        released.set()
        await anyio.sleep(0.2)  # (its answer comes after the renewal's)
        return answer

    object.__setattr__(leases, "renew", renew_after_the_release)
    object.__setattr__(leases, "release", release_and_tell)
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        await act_until_parked(bus, owner, "given-back")
        assert released.is_set()
        assert owner.stats.lost == 0
        await owner.drain(2)


def test_unknown_payload_is_kept_raw() -> None:
    raw = msgspec.msgpack.encode({"kind": "from_the_future", "x": 1, "source": "agent"})
    event = events.decode(raw, 4)
    assert isinstance(event, events.Unknown)
    assert event.payload["x"] == 1


async def test_a_tenant_holds_its_share_and_what_it_has_beyond_waits_set_aside_not_ahead(bus: Bus) -> None:
    """A worker of capacity 4 with a share of a half: a tenant with six sessions waiting holds
    two of them; the rest are set aside in its own stream, so another tenant's session, announced
    after them all, is taken at once.  Each set-aside session is taken once the tenant's own are
    let go (parked here after 2.5 s idle), and answered once."""
    owner, _ = make_owner(bus, "w1", capacity=4, tenant_share=0.5, lease_seconds=5, park_after=2.5)
    hog = [f"hog{i}" for i in range(6)]
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        for name in hog:
            await bus.session(name, tenant="hog").append(events.FileRead(path=name))
        with anyio.fail_after(5):
            while await bus.redis.xlen(bus.keys.waiting("runtime", "hog")) < len(hog) - 2:
                await anyio.sleep(0.05)
        assert len(owner.owned) == 2
        assert set(owner.owned) <= set(hog)
        started = time.monotonic()
        calm = await bus.session("calm1", tenant="calm").act(events.FileRead(path="calm"), timeout=5)
        assert isinstance(calm, events.FileContent)
        # One read, not after one of the hog's sessions was let go (parked after 2.5 s idle).
        assert time.monotonic() - started < within(1.5)
        with anyio.fail_after(30):
            for name in hog:
                answer = await bus.session(name, tenant="hog").wait_for_answer(1, timeout=30)
                assert isinstance(answer, events.FileContent)
                assert answer.path == name
        for name in hog:
            assert [e.kind for e in await bus.session(name).events()] == ["file_read", "file_content"]
        await owner.drain(2)


async def test_with_room_for_one_the_tenants_set_aside_take_their_turns(bus: Bus) -> None:
    """Three tenants' sessions wait set aside; a worker with room for one session at a time
    reads one tenant's stream, a tenant further on each time: no tenant waits behind another's
    every session (reading every tenant in sorted order had taken all of a's first), and each
    tenant's sessions are taken in the order they came."""
    owner, _ = make_owner(bus, "w1", capacity=1, tenant_share=1.0)
    tenants = ["a", "b", "c"]
    for number in range(3):
        for tenant in tenants:
            await bus.session(f"{tenant}{number}", tenant=tenant).append(events.FileRead(path="x"))
    leases = owner.lease_loops.leases
    await leases.ensure_group()  # (as the owner does when it starts)
    announced = await leases.with_tenants(await leases.read_new(9, block_ms=100))
    assert len(announced) == 9
    await leases.set_aside(announced)
    taken = []
    for _ in range(3):
        claims = await owner.lease_loops._read_fairly()
        assert len(claims) == 1  # (room for one)
        taken.append(claims[0])
    assert sorted(claim.tenant for claim in taken) == tenants, [c.session for c in taken]
    assert {claim.session for claim in taken} == {"a0", "b0", "c0"}  # (each tenant's own in order)


async def test_a_lease_taken_from_a_set_aside_stream_is_renewed_there_and_reclaimed_from_there(bus: Bus) -> None:
    """A session taken from its tenant's set-aside stream keeps that entry as its lease's handle:
    the renewal claims it there, and when its holder stops renewing a peer reclaims it from there."""
    await bus.session("aside", tenant="t").append(events.Think(thought="x"))
    first = Leases(bus.redis, bus.keys, ROLE, worker="w1", lease_ms=300, url=bus.url)
    await first.ensure_group()
    [claim] = await first.with_tenants(await first.read_new(10, block_ms=100))
    assert claim.tenant == "t"
    await first.set_aside([claim])
    assert await bus.redis.xlen(bus.keys.directory(ROLE)) == 0  # moved, not copied
    [aside] = await first.read_new(10, block_ms=100, tenants=["t"])
    assert aside.set_aside
    assert aside.session == "aside"
    got = await first.acquire(aside)
    assert got.token > 0
    assert (await first.renew({"aside": (aside.entry, got.token)})).lost == set()

    second = Leases(bus.redis, bus.keys, ROLE, worker="w2", lease_ms=300, url=bus.url)
    await second.ensure_group()
    assert await second.reclaim_stale(10) == []  # the holder's lease still runs
    await anyio.sleep(0.4)  # the holder stopped renewing
    [reclaimed] = await second.reclaim_stale(10)
    assert reclaimed.entry == aside.entry
    assert reclaimed.tenant == "t"
    taken = await second.acquire(reclaimed)
    assert taken.token == got.token + 1
    assert await second.release("aside", reclaimed.entry, taken.token, tenant="t") == 1
    # Released (a drain's hand-over): announced again in the directory, the set-aside entry gone.
    assert await bus.redis.xlen(bus.keys.waiting(ROLE, "t")) == 0
    [again] = await second.read_new(10, block_ms=100, tenants=["t"])
    assert (again.session, again.tenant, again.set_aside) == ("aside", "t", False)

"""A Redis Cluster master killed under a running system: its replica takes over, nobody acts.

A private cluster of 3 masters with one replica each (``cluster-node-timeout`` 1 s) serves two
runtime worker processes and a client driving several sessions.  The killed master (SIGKILL)
holds the prefix's shared keys (directories, session index, worker registry) and some of the
sessions, the others live on the surviving masters.

Redis replicates asynchronously and riverbed does not ``WAIT`` for a replica after an append:
an append that the master acknowledged in the last moment before it died, and had not yet sent
to its replica, is lost with it, and its id goes to the next append.  So the test pauses the
client between actions, waits until the replica holds every write the master acknowledged,
and only then kills the master; the client resumes at once, while the cluster fails over.
The workers are not paused: their lease renewals and heartbeats race the kill.  Afterwards:

- every event id an append returned (before the kill, and on the new master after it) holds
  the action that was appended;
- every action has exactly one answering observation (its output, or ``runtime_lost`` when the
  owner changed while it was in flight), and no command ran twice;
- every session answers again within a bound after the failover;
- the workers and the client reconnected by themselves, and no worker exited.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest
import redis
from redis.crc import key_slot

import riverbed
from riverbed import services
from riverbed.bus.connection import Cluster, connect_redis
from riverbed.bus.keys import Keys
from riverbed.bus.leases import Leases, Renewed
from riverbed.bus.redis_client import RedisClient
from riverbed.client.session import Bus
from tests.kit.faults import (
    Driver,
    assert_each_action_answered_once,
    assert_in_log,
    driving,
    start_runtime_workers,
    wait_each_answered,
    wait_for,
)
from tests.kit.leases import ROLE, acquired, expiries
from tests.kit.workers import WorkerProcess, workers  # noqa: F401  (workers: a fixture)

pytestmark = [pytest.mark.anyio, pytest.mark.fault]

NODE_TIMEOUT_MS = 1000
LEASE = 2.0
SESSIONS_ON_VICTIM = 2
SESSIONS_ELSEWHERE = 3
#: The guarantee: every session answers again within this long after the replica took over.
RECOVERY_SECONDS = 10.0


@dataclass
class Node:
    port: int
    pid: int

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2)

    def replication(self) -> dict[str, object]:
        with self.client() as client:
            info: dict[str, object] = client.info("replication")
            return info


@dataclass
class ReplicatedCluster:
    """A private cluster (3 masters, 1 replica each) of this test's own: it loses a master."""

    url: str
    pids: list[int]
    sync: redis.RedisCluster = field(init=False)

    def __post_init__(self) -> None:
        self.sync = redis.RedisCluster.from_url(self.url)

    def port_of(self, key: str) -> int:
        """The port of the master serving ``key``'s slot."""
        node = self.sync.nodes_manager.get_node_from_slot(key_slot(key.encode()))
        assert node is not None
        assert node.port is not None
        return int(node.port)

    def master_of(self, key: str) -> Node:
        port = self.port_of(key)
        with redis.Redis(port=port) as client:
            return Node(port, int(client.info("server")["process_id"]))

    def replica_of(self, master: Node) -> Node:
        info = master.replication()
        replica = info["slave0"]
        assert isinstance(replica, dict), info
        port = int(replica["port"])
        with redis.Redis(port=port) as client:
            return Node(port, int(client.info("server")["process_id"]))

    def close(self) -> None:
        self.sync.close()
        services.stop_redis_cluster(self.pids)


@pytest.fixture
def cluster(tmp_path: Path, cluster_selected: None) -> Iterator[ReplicatedCluster]:
    # Its own cluster, not the suite's: the test kills one of its masters.
    url, pids = services.start_redis_cluster(
        tmp_path / "cluster", masters=3, replicas=1, node_timeout_ms=NODE_TIMEOUT_MS
    )
    replicated = ReplicatedCluster(url, pids)
    try:
        yield replicated
    finally:
        replicated.close()


@pytest.fixture
async def bus(cluster: ReplicatedCluster, prefix: str) -> AsyncIterator[Bus]:
    async with riverbed.connect(cluster.url, prefix=prefix) as bus:
        yield bus


@dataclass
class GatedDriver(Driver):
    """A driver that starts its next action only while ``gate`` is open (``idle`` meanwhile)."""

    gate: anyio.Event = field(default_factory=anyio.Event)
    idle: bool = False

    async def wait_turn(self) -> None:
        if not self.gate.is_set():
            self.idle = True
            await self.gate.wait()
            self.idle = False


def session_names(cluster: ReplicatedCluster, keys: Keys, victim: Node) -> list[str]:
    """Sessions on the victim's slots and sessions on the surviving masters."""
    on_victim: list[str] = []
    elsewhere: list[str] = []
    for i in range(1000):
        name = f"c{i}"
        group = on_victim if cluster.port_of(keys.log(name)) == victim.port else elsewhere
        group.append(name)
        if len(on_victim) >= SESSIONS_ON_VICTIM and len(elsewhere) >= SESSIONS_ELSEWHERE:
            break
    return on_victim[:SESSIONS_ON_VICTIM] + elsewhere[:SESSIONS_ELSEWHERE]


async def wait_until_replicated(master: Node, replica: Node) -> None:
    """The replica has applied every write the master had acknowledged when this was called."""
    target = int(str(master.replication()["master_repl_offset"]))
    with anyio.fail_after(10):
        while int(str(replica.replication().get("slave_repl_offset", 0))) < target:
            await anyio.sleep(0.01)


async def wait_until_promoted(replica: Node) -> None:
    with anyio.fail_after(30):
        while replica.replication().get("role") != "master":
            await anyio.sleep(0.05)
        with replica.client() as client:
            while client.cluster("info")["cluster_state"] != "ok":
                await anyio.sleep(0.05)


async def test_a_master_failover_loses_no_replicated_append_and_everyone_reconnects(
    bus: Bus, cluster: ReplicatedCluster, workers: list[WorkerProcess], prefix: str, workspace: Path, tmp_path: Path
) -> None:
    victim = cluster.master_of(bus.keys.directory("runtime"))
    replica = cluster.replica_of(victim)
    await start_runtime_workers(workers, cluster.url, prefix, workspace, tmp_path, lease=LEASE)
    gate = anyio.Event()
    gate.set()
    drivers = [GatedDriver(bus.session(name), gate=gate) for name in session_names(cluster, bus.keys, victim)]

    async with driving(drivers):
        await wait_each_answered(drivers, 30)

        paused = anyio.Event()  # a fresh gate: drivers wait on it after their current action
        for driver in drivers:
            driver.gate = paused
        await wait_for(lambda: all(d.idle for d in drivers), 30, "every driver finished its action")
        acknowledged = {d.session.id: dict(d.appended) for d in drivers}
        await wait_until_replicated(victim, replica)
        os.kill(victim.pid, signal.SIGKILL)
        paused.set()
        killed_at = time.monotonic()
        await wait_until_promoted(replica)
        failed_over_at = time.monotonic()
        promoted_after = failed_over_at - killed_at

        for driver in drivers:
            await assert_in_log(driver.session, acknowledged[driver.session.id])
        await wait_each_answered(drivers, 60, since=failed_over_at, after="the failover")

    recovery = {d.session.id: d.answered_since(failed_over_at)[0] - failed_over_at for d in drivers}
    print(f"failover: promoted {promoted_after:.1f}s after the kill; sessions answered again after {recovery}")
    assert max(recovery.values()) < RECOVERY_SECONDS, f"sessions answered again only after {recovery}"
    assert all(w.proc.poll() is None for w in workers), "a worker exited during the failover"

    await assert_each_action_answered_once(drivers, workspace)


async def test_a_renewal_whose_master_dies_under_it_reports_none_of_its_sessions_lost(
    bus: Bus, cluster: ReplicatedCluster
) -> None:
    """A master killed while a lease renewal waits for its replies: those replies are a lost
    connection, not a refusal.  Its sessions are not reported lost (the next round asks again,
    and their fencing tokens guard their writes meanwhile), and the other masters' sessions are
    renewed.  Reported lost, every session of a node that dropped one connection was abandoned."""
    probe = session_names(cluster, bus.keys, cluster.master_of(bus.keys.log("c0")))
    victim = cluster.master_of(bus.keys.log(probe[0]))
    leases, owned = await acquired(bus, probe, 30_000)
    assert (await leases.renew(owned)).lost == set()  # (the renewal's script is on every master now)
    elsewhere = [name for name in probe if cluster.port_of(bus.keys.meta(name)) != victim.port]
    before = await expiries(bus, elsewhere)

    os.kill(victim.pid, signal.SIGSTOP)  # the renewal's commands reach it and wait for replies
    async with anyio.create_task_group() as tg:
        renewed: list[Renewed] = []

        async def renew() -> None:
            renewed.append(await leases.renew(owned))

        tg.start_soon(renew)
        await anyio.sleep(0.3)
        assert not renewed, "the renewal did not wait for the stopped master"
        os.kill(victim.pid, signal.SIGKILL)
    assert [r.lost for r in renewed] == [set()]
    # (nor renewed: the owner does not count on those leases until a renewal is answered)
    assert renewed[0].unanswered == set(probe) - set(elsewhere)
    after = await expiries(bus, elsewhere)
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


async def test_pipelines_held_up_by_a_stopped_master_do_not_hold_up_renewals_elsewhere(
    bus: Bus, cluster: ReplicatedCluster, prefix: str
) -> None:
    """A master stops answering while a worker's pipelines wait on it, as many as its cluster
    client lets run at once (each waits a socket timeout per try, and redis-py tries again): the
    renewal of the sessions on the other masters still goes out at once, on the connection kept
    for renewals, and renews them."""
    directory_port = cluster.port_of(bus.keys.directory(ROLE))
    bystander = next(f"v{i}" for i in range(1000) if cluster.port_of(bus.keys.log(f"v{i}")) != directory_port)
    victim = cluster.master_of(bus.keys.log(bystander))
    probe = session_names(cluster, bus.keys, victim)
    elsewhere = [name for name in probe if cluster.port_of(bus.keys.meta(name)) != victim.port]
    _leases, owned = await acquired(bus, elsewhere, 30_000)
    raw = await connect_redis(cluster.url, shared=True, max_connections=6, name=f"held-{prefix}")
    client = RedisClient(raw, cluster.url)
    leases = Leases(client, bus.keys, ROLE, worker="w", lease_ms=30_000, url=cluster.url)
    assert (await leases.renew(owned)).lost == set()  # (the script is loaded, the connections open)
    assert isinstance(raw, Cluster)
    assert raw.pipelines is not None
    held = int(raw.pipelines.total_tokens)

    os.kill(victim.pid, signal.SIGSTOP)
    try:
        async with anyio.create_task_group() as tg:

            async def stuck() -> None:
                async with client.pipeline() as pipe:
                    pipe.set(f"{prefix}:{{{bystander}}}:x", 1)
                    await pipe.execute()

            for _ in range(held):
                tg.start_soon(stuck)
            await anyio.sleep(0.3)
            assert raw.pipelines.borrowed_tokens == held, "the pipelines are not waiting on the stopped master"
            before = await expiries(bus, elsewhere)
            with anyio.fail_after(3):
                assert await leases.renew(owned) == Renewed(set(), set())
            after = await expiries(bus, elsewhere)
            assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
            tg.cancel_scope.cancel()
    finally:
        os.kill(victim.pid, signal.SIGCONT)
        await raw.aclose()

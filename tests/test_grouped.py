"""Commands of session loops woken together go in one round trip, each loop gets its own reply,
and whatever fails for the group falls back to each loop's own command (``bus/grouped.py``)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from riverbed import events
from riverbed.bus.grouped import ALONE, Batched, Gather, GroupedAnswers, GroupedPending, GroupedReads
from riverbed.bus.redis_client import StreamEntry
from riverbed.client.session import Bus

pytestmark = pytest.mark.anyio

GROUP = "runtime"


async def _logs(bus: Bus, sessions: list[str]) -> list[str]:
    """Each session's log with the role's group and two entries of its own."""
    keys = [bus.keys.log(s) for s in sessions]
    for session, key in zip(sessions, keys, strict=True):
        await bus.session(session).append(events.Think(thought=f"{session} 1"), events.Think(thought=f"{session} 2"))
        await bus.client.xgroup_create(key, GROUP, "0")
    return keys


async def _together(fns: list[Any]) -> list[Any]:
    """Run every fn at once (started in the same turn of the event loop); their results in order."""
    out: list[Any] = [None] * len(fns)

    async def run(i: int) -> None:
        out[i] = await fns[i]()

    async with anyio.create_task_group() as tg:
        for i in range(len(fns)):
            tg.start_soon(run, i)
    return out


def _thoughts(entries: list[StreamEntry]) -> list[str]:
    return [events.decode(fields[b"e"]).thought for _id, fields in entries]  # type: ignore[attr-defined]


async def test_reads_asked_together_go_in_one_command_and_each_gets_its_own_entries(bus: Bus, backend: str) -> None:
    sessions = [f"g{i}" for i in range(6)]
    keys = await _logs(bus, sessions)
    reads = GroupedReads(bus.client, GROUP, "w1", 100)
    got = await _together([lambda k=k: reads.read(k) for k in keys])
    assert [_thoughts(entries) for entries in got] == [[f"{s} 1", f"{s} 2"] for s in sessions]
    # On a cluster the sessions' logs are in other slots: each loop reads alone.
    assert (reads.gather.round_trips, reads.gather.items) == ((1, 6) if backend == "standalone" else (0, 0))
    # Nothing new: each gets nothing, and a loop that asks alone is never held back.
    assert await _together([lambda k=k: reads.read(k) for k in keys]) == [[]] * 6
    assert await reads.read(keys[0]) == []


async def test_writes_held_for_a_read_are_made_in_its_round_trip_grouped_or_alone(bus: Bus, backend: str) -> None:
    """The agent role acknowledges a batch, and saves its run's summary, with its loop's next
    read (``SessionContext.ack_with_read``): each loop's writes are made, and its read still
    gets only its own entries."""
    sessions = [f"w{i}" for i in range(3)]
    keys = await _logs(bus, sessions)
    reads = GroupedReads(bus.client, GROUP, "w1", 1)  # (one entry a read: the first is delivered, then acked)
    assert [_thoughts(e) for e in await _together([lambda k=k: reads.read(k) for k in keys])] == [
        [f"{s} 1"] for s in sessions
    ]

    def writes(session: str, key: str) -> list[tuple[str, ...]]:
        return [("XACK", key, GROUP, "1-0"), ("SET", bus.keys.run(session), f"{session} saved")]

    got = await _together([lambda s=s, k=k: reads.read(k, writes(s, k)) for s, k in zip(sessions, keys, strict=True)])
    assert [_thoughts(e) for e in got] == [[f"{s} 2"] for s in sessions]
    assert (reads.gather.round_trips, reads.gather.items) == ((2, 6) if backend == "standalone" else (0, 0))
    for session, key in zip(sessions, keys, strict=True):
        pending = await bus.client.xpending_range(key, GROUP, min="-", max="+", count=10)
        assert [p["message_id"] for p in pending] == [b"2-0"]  # (the first acknowledged)
        assert await bus.client.raw.get(bus.keys.run(session)) == f"{session} saved".encode()
    # A loop reading alone makes its writes too (one round trip on a standalone Redis).
    assert await reads.read(keys[0], [("XACK", keys[0], GROUP, "2-0"), ("SET", bus.keys.run("w0"), "again")]) == []
    assert await bus.client.xpending_range(keys[0], GROUP, min="-", max="+", count=10) == []
    assert await bus.client.raw.get(bus.keys.run("w0")) == b"again"


async def test_a_log_without_its_group_fails_only_its_own_read(bus: Bus) -> None:
    """One missing group fails a grouped XREADGROUP as a whole (NOGROUP): every loop then reads
    alone, the others get their entries and the one without a group meets its own error."""
    sessions = [f"n{i}" for i in range(4)]
    keys = await _logs(bus, sessions)
    await bus.client.raw.xgroup_destroy(keys[2], GROUP)
    reads = GroupedReads(bus.client, GROUP, "w1", 100)
    out: list[Any] = [None] * 4

    async def read(i: int) -> None:
        try:
            out[i] = _thoughts(await reads.read(keys[i]))
        except Exception as exc:
            out[i] = str(exc)

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(read, i)
    assert [out[0], out[1], out[3]] == [["n0 1", "n0 2"], ["n1 1", "n1 2"], ["n3 1", "n3 2"]]
    assert out[2].startswith("NOGROUP")


async def test_a_grouped_read_whose_reply_was_lost_tells_each_of_its_loops(bus: Bus, backend: str) -> None:
    """A grouped read that reached Redis and lost its reply (its connection broke under it)
    delivered entries nobody got: each loop reads alone and is told, so that it looks for those
    strays at once (``SessionLoop``).  A grouped read that got its reply tells nobody."""
    if backend == "cluster":
        pytest.skip("a cluster client never groups")
    sessions = [f"l{i}" for i in range(3)]
    keys = await _logs(bus, sessions)
    reads = GroupedReads(bus.client, GROUP, "w1", 100)
    send = reads.gather._send

    async def reply_lost(items: list[Any]) -> Any:
        await send(items)
        raise ConnectionError("the connection broke before the reply")

    told: list[int] = []

    def read(i: int) -> Any:
        return lambda: reads.read(keys[i], lost=lambda: told.append(i))

    reads.gather._send = reply_lost
    got = await _together([read(i) for i in range(3)])
    assert got == [[], [], []], "the lost round trip delivered them: nothing is new for the reads alone"
    assert sorted(told) == [0, 1, 2]
    assert [(await bus.redis.xpending(key, GROUP))["pending"] for key in keys] == [2, 2, 2]

    reads.gather._send = send
    told.clear()
    for session in sessions:
        await bus.session(session).append(events.Think(thought=f"{session} 3"))
    got = await _together([read(i) for i in range(3)])
    assert [_thoughts(entries) for entries in got] == [[f"{s} 3"] for s in sessions]
    assert told == []


async def test_answers_sent_together_get_their_own_replies_and_a_failing_one_goes_alone(bus: Bus, backend: str) -> None:
    """Answers' append scripts in one write: each caller's reply is its own append's; one whose
    script fails (a log key of the wrong type) is left to run alone and see its error itself."""
    sessions = [f"a{i}" for i in range(5)]
    for session in sessions:
        await bus.session(session).append(events.CmdRun(command="true"))
    await bus.redis.delete(bus.keys.log("a3"))
    await bus.redis.set(bus.keys.log("a3"), "not a stream")
    answers = GroupedAnswers(bus.client)
    prepared = [
        bus.log_store.prepare(s, [(events.encode(events.CmdOutput(content=s, exit_code=0, cause=1)), 1)])
        for s in sessions
    ]
    # Some loops held writes for their next read (acknowledgements of entries other than actions): they go first.
    held = {s: [("SET", bus.keys.run(s), f"held by {s}")] * (i % 2 + 1) for i, s in enumerate(sessions) if i != 1}
    replies = await _together(
        [lambda s=s, p=p: answers.reply(p, held.get(s, ())) for s, p in zip(sessions, prepared, strict=True)]
    )
    if backend == "cluster":
        assert all(reply is ALONE for reply in replies)
        return
    assert [reply is ALONE for reply in replies] == [False, False, False, True, False]
    for session, p, reply in zip(sessions, prepared, replies, strict=True):
        if session != "a3":
            assert await p.outcome(reply) == [2]
            (answer,) = await bus.session(session).events(2, 2)
            assert isinstance(answer, events.CmdOutput)
            assert answer.content == session
        assert await bus.client.raw.get(bus.keys.run(session)) == (
            f"held by {session}".encode() if session in held else None
        )
    assert (answers.gather.round_trips, answers.gather.items) == (1, 5)
    with pytest.raises(Exception, match="WRONGTYPE"):
        await prepared[3].run()


async def test_stray_checks_asked_together_count_each_logs_own_pending_entries(bus: Bus, backend: str) -> None:
    """The loops' checks for entries pending with nobody on them go in one write; each counts
    its own log's, and a log without the group fails only its own check (NOGROUP)."""
    sessions = [f"p{i}" for i in range(4)]
    keys = await _logs(bus, sessions)
    reads = GroupedReads(bus.client, GROUP, "gone-owner", 100)
    await reads.read(keys[1])  # delivered, never acknowledged: two strays
    await reads.read(keys[3])
    await bus.client.xack(keys[3], GROUP, "1-0")  # one of them answered
    await bus.client.raw.xgroup_destroy(keys[2], GROUP)
    pending = GroupedPending(bus.client, GROUP)
    out: list[Any] = [None] * 4

    async def count(i: int) -> None:
        try:
            out[i] = await pending.count(keys[i])
        except Exception as exc:
            out[i] = str(exc)

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(count, i)
    # The count says whether any is pending (alone, it reads at most one entry's details).
    assert [bool(out[0]), bool(out[1]), bool(out[3])] == [False, True, True]
    assert out[2].startswith("NOGROUP")
    if backend == "standalone":
        assert [out[1], out[3]] == [2, 1]
        assert (pending.gather.round_trips, pending.gather.items) == (1, 4)
    # A loop's held acknowledgements go first in its check: what it handled is not pending.
    acks = [("XACK", keys[1], GROUP, "1-0"), ("XACK", keys[3], GROUP, "2-0")]
    got = await _together(
        [
            lambda: pending.count(keys[0]),
            lambda: pending.count(keys[1], acks[:1]),
            lambda: pending.count(keys[3], acks[1:]),
        ]
    )
    assert [bool(n) for n in got] == [False, True, False]
    assert await pending.count(keys[1], [("XACK", keys[1], GROUP, "2-0")]) == 0  # (alone)


async def test_the_steps_of_taking_sessions_together_go_in_one_write_each_with_its_own_reply(
    bus: Bus, backend: str
) -> None:
    """A burst of sessions taken at once: each step (the acquire script, the log's group, the
    saved fold, the log, the pending entries) is one write for all of them, and every caller
    gets what the client's own command would have given it, a refusal included."""
    sessions = [f"t{i}" for i in range(5)]
    for session in sessions:
        await bus.session(session).append(events.Think(thought=f"{session} 1"), events.Think(thought=f"{session} 2"))
    keys = [bus.keys.log(s) for s in sessions]
    await bus.client.xgroup_create(keys[1], GROUP, "0")  # made before: its creation says so
    await bus.client.hset(bus.keys.folds("t2"), GROUP, b"saved")
    batch = Batched(bus.client)
    script = bus.client.script("return {KEYS[1], ARGV[1]}")

    created = await _together([lambda k=k: batch.xgroup_create(k, GROUP, "0") for k in keys])
    assert created == [True, False, True, True, True]
    assert await _together([lambda s=s: batch.hget(bus.keys.folds(s), GROUP) for s in sessions]) == [
        None, None, b"saved", None, None
    ]  # fmt: skip
    ranges = await _together([lambda k=k: batch.xrange(k, "2-0", "+", count=10) for k in keys])
    assert [_thoughts(entries) for entries in ranges] == [[f"{s} 2"] for s in sessions]
    assert ranges == [await bus.client.xrange(k, "2-0", "+", count=10) for k in keys]
    ran = await _together([lambda k=k: batch.run(script, [k], ["x"]) for k in keys])
    assert ran == [[k.encode(), b"x"] for k in keys]
    await bus.client.xreadgroup(GROUP, "gone", keys[3], ">", count=1)  # one entry left pending
    pending = await _together([lambda k=k: batch.xpending_range(k, GROUP, count=10) for k in keys])
    assert [len(p) for p in pending] == [0, 0, 0, 1, 0]
    alone = await bus.client.xpending_range(keys[3], GROUP, count=10)
    assert [{**p, "time_since_delivered": 0} for p in pending[3]] == [{**p, "time_since_delivered": 0} for p in alone]
    # Five steps of five sessions each: five writes on a standalone Redis, none grouped on a cluster.
    expected = (5, 25) if backend == "standalone" else (0, 0)
    assert (batch.gather.round_trips, batch.gather.items) == expected


async def test_a_step_whose_round_trip_failed_is_sent_by_each_caller_alone(bus: Bus, backend: str) -> None:
    """A grouped step whose round trip failed (its connection broke, or it outlasted its
    timeout) answers each caller what the client's own command gives: every such command is
    safe to send again, and none answers the failure's marker instead of its reply."""
    if backend == "cluster":
        pytest.skip("a cluster client never groups")
    sessions = [f"f{i}" for i in range(3)]
    keys = await _logs(bus, sessions)
    await bus.client.hset(bus.keys.folds("f1"), GROUP, b"saved")
    batch = Batched(bus.client)
    send = batch.gather._send

    async def reply_lost(items: list[Any]) -> Any:
        await send(items)
        raise ConnectionError("the connection broke before the reply")

    batch.gather._send = reply_lost
    script = bus.client.script("return {KEYS[1], ARGV[1]}")
    ranges = await _together([lambda k=k: batch.xrange(k, "-", "+", count=10) for k in keys])
    assert [_thoughts(entries) for entries in ranges] == [[f"{s} 1", f"{s} 2"] for s in sessions]
    assert await _together([lambda s=s: batch.hget(bus.keys.folds(s), GROUP) for s in sessions]) == [
        None, b"saved", None
    ]  # fmt: skip
    assert await _together([lambda k=k: batch.xgroup_create(k, GROUP, "0") for k in keys]) == [False] * 3
    assert await _together([lambda k=k: batch.run(script, [k], ["x"]) for k in keys]) == [
        [k.encode(), b"x"] for k in keys
    ]
    pending = await _together([lambda k=k: batch.xpending_range(k, GROUP, count=10) for k in keys])
    assert pending == [[], [], []]
    assert batch.gather.round_trips == 5  # (each step was grouped, and failed)


async def test_a_step_the_server_refuses_fails_only_its_own_caller(bus: Bus, backend: str) -> None:
    """One log of the wrong type in a batch: its caller meets the server's error (as alone),
    the others their replies; a script the server lost is loaded and run by its callers."""
    sessions = [f"r{i}" for i in range(4)]
    for session in sessions:
        await bus.session(session).append(events.Think(thought=session))
    keys = [bus.keys.log(s) for s in sessions]
    await bus.redis.delete(keys[2])
    await bus.redis.set(keys[2], "not a stream")
    batch = Batched(bus.client)
    out: list[Any] = [None] * 4

    async def create(i: int) -> None:
        try:
            out[i] = await batch.xgroup_create(keys[i], GROUP, "0")
        except Exception as exc:
            out[i] = str(exc)

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(create, i)
    assert [out[0], out[1], out[3]] == [True, True, True]
    assert "WRONGTYPE" in out[2] or "key" in out[2].lower()
    script = bus.client.script("return ARGV[1]")
    await script.load()
    await bus.redis.script_flush()
    assert await _together([lambda i=i: batch.run(script, [keys[0]], [str(i)]) for i in range(3)]) == [
        b"0", b"1", b"2"
    ]  # fmt: skip
    if backend == "standalone":
        assert batch.gather.items == 7


async def test_when_the_leader_is_cancelled_before_it_sends_the_others_go_alone(bus: Bus, backend: str) -> None:
    """The first caller of a turn leads; cancelled while the others join, it sends nothing and
    each of them is told to go alone at once (none waits for a round trip that never comes)."""
    if backend == "cluster":
        pytest.skip("a cluster client never groups")
    sent: list[list[str]] = []

    async def send(items: list[str]) -> list[str]:
        sent.append(items)
        return [f"reply {item}" for item in items]

    gather: Gather[str, str] = Gather(bus.client, send)
    lead = anyio.CancelScope()
    out: dict[str, Any] = {}

    async def leader() -> None:
        with lead:
            out["leader"] = await gather.join("a")

    async def follower(item: str) -> None:
        out[item] = await gather.join(item)

    async def cancel_leader() -> None:
        lead.cancel()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(leader)
            tg.start_soon(follower, "b")
            tg.start_soon(follower, "c")
            tg.start_soon(cancel_leader)  # runs while the leader waits for its turn to come back
    assert out == {"b": ALONE, "c": ALONE}
    assert sent == []
    # The next turn groups as before, and every caller gets its own reply.
    assert await _together([lambda i=i: gather.join(i) for i in "xyz"]) == ["reply x", "reply y", "reply z"]
    assert sent == [["x", "y", "z"]]


async def test_a_caller_cancelled_while_it_waits_leaves_the_others_their_replies(bus: Bus, backend: str) -> None:
    """Each caller waits on its own: one cancelled while the round trip is on its way does not
    cancel the wait of the others (nor the leader's send)."""
    if backend == "cluster":
        pytest.skip("a cluster client never groups")
    sending = anyio.Event()

    async def send(items: list[str]) -> list[str]:
        sending.set()
        await anyio.sleep(0.2)
        return [f"reply {item}" for item in items]

    gather: Gather[str, str] = Gather(bus.client, send)
    impatient = anyio.CancelScope()
    out: dict[str, Any] = {}

    async def caller(item: str, scope: anyio.CancelScope | None = None) -> None:
        with scope or anyio.CancelScope():
            out[item] = await gather.join(item)

    async def cancel_once_sent() -> None:
        await sending.wait()
        impatient.cancel()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(caller, "a")
            tg.start_soon(caller, "b", impatient)
            tg.start_soon(caller, "c")
            tg.start_soon(cancel_once_sent)
    assert out == {"a": "reply a", "c": "reply c"}
    assert gather.round_trips == 1

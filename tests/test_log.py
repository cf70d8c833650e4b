"""The session log against a real redis-server: ids, conflicts, idempotency, fencing, answers, follow."""

from __future__ import annotations

import os

import anyio
import msgspec
import pytest
import redis.exceptions as redis_exceptions
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

import riverbed
from riverbed import events
from riverbed.bus.backoff import retry_unavailable
from riverbed.bus.keys import ROLES, Keys
from riverbed.bus.log import AlreadyAnswered, Fence, auto_key, payload_kind, wakes_runtime
from riverbed.client.session import Bus
from riverbed.errors import AppendConflict, FencedError, InputError

pytestmark = pytest.mark.anyio


async def test_ids_are_consecutive_integers_and_entry_ids(bus: Bus) -> None:
    session = bus.session("s1")
    assert await session.append(events.Message(content="a", source="user")) == [1]
    assert await session.append(events.CmdRun(command="ls"), events.Think(thought="t")) == [2, 3]
    got = await session.events()
    assert [e.id for e in got] == [1, 2, 3]
    assert [e.kind for e in got] == ["message", "cmd_run", "think"]
    raw = await bus.redis.xrange(bus.keys.log("s1"))
    assert [r[0] for r in raw] == [b"1-0", b"2-0", b"3-0"]
    assert await session.last_id() == 3


async def test_range_reads_are_inclusive(bus: Bus) -> None:
    session = bus.session("s1")
    await session.append(*[events.Think(thought=str(i)) for i in range(30)])
    got = await session.events(10, 20)
    assert [e.id for e in got] == list(range(10, 21))
    assert [e.thought for e in got if isinstance(e, events.Think)] == [str(i) for i in range(9, 20)]


async def test_expected_last_conflict_names_both_ids(bus: Bus) -> None:
    session = bus.session("s1")
    await session.append(events.Think(thought="x"), expected_last=0)
    await session.append(events.Think(thought="y"), expected_last=1)
    with pytest.raises(AppendConflict) as info:
        await session.append(events.Think(thought="z"), expected_last=1)
    assert "expected the last event id to be 1 but it is 2" in str(info.value)
    assert await session.last_id() == 2


async def test_idempotent_retry_returns_first_ids_and_appends_nothing(bus: Bus) -> None:
    session = bus.session("s1")
    batch = [events.Think(thought="a"), events.Think(thought="b")]
    first = await session.append(*batch, idempotency_key="req-1")
    again = await session.append(*batch, idempotency_key="req-1")
    assert first == again == [1, 2]
    assert await session.last_id() == 2
    assert await session.append(events.Think(thought="c"), idempotency_key="req-2") == [3]


async def test_a_refused_append_keeps_no_idempotency_key(bus: Bus) -> None:
    """An append refused (a conflict, an answered action) leaves its key unused: the same key
    then appends once the cause is gone, or is refused again, never taken as done."""
    session = bus.session("s1")
    await session.append(events.Think(thought="a"))
    with pytest.raises(AppendConflict):
        await session.append(events.Think(thought="b"), expected_last=0, idempotency_key="req-b")
    assert await session.append(events.Think(thought="b"), expected_last=1, idempotency_key="req-b") == [2]
    assert [e.thought for e in await session.events() if isinstance(e, events.Think)] == ["a", "b"]
    (action,) = await session.append(events.CmdRun(command="true"))
    await bus.log_store.append("s1", [events.CmdOutput(content="", exit_code=0, cause=action)])
    late = [events.Error(content="late", cause=action)]
    for _ in range(2):
        refused = await bus.log_store.append("s1", late, idempotency_key="req-late")
        assert refused == AlreadyAnswered(cause=action, existing=action + 1)
    assert await session.last_id() == action + 1


async def test_a_retry_announces_again_what_its_first_try_could_not(bus: Bus) -> None:
    """The announce follows the append script and writes shared keys, which a cluster keeps on
    another node than the session's: when it fails, the append went through but nobody heard of
    the session.  The client's retry (same idempotency key) must announce it again."""
    session = bus.session("unheard")
    assert await session.append(events.CmdRun(command="true"), idempotency_key="req-1") == [1]
    # What a lost announce leaves behind: no directory entries, no index entry.
    for role in ROLES:
        await bus.redis.delete(bus.keys.directory(role))
    await bus.redis.zrem(bus.keys.sessions, session.id)
    assert await session.append(events.CmdRun(command="true"), idempotency_key="req-1") == [1]
    for role in ROLES:
        entries = await bus.redis.xrange(bus.keys.directory(role))
        assert [fields[b"s"] for _id, fields in entries] == [b"unheard"], role
    assert await bus.sessions() == ["unheard"]


async def test_the_append_script_announces_a_new_session_itself_where_it_can(bus: Bus, backend: str) -> None:
    """On a standalone Redis the script that appends a session's first event also announces it
    to every role and indexes it, in the same atomic step: a client that dies as the script's
    reply comes back leaves no session nobody heard of.  On a cluster the directories live in
    another slot, so the reply names the roles and the client announces them next."""
    prepared = bus.log_store.prepare("told", [(events.encode(events.CmdRun(command="true")), 0)])
    reply = await bus.log_store.append_script(prepared.keys, prepared.args)  # the reply is dropped
    heard = {role: await bus.redis.xrange(bus.keys.directory(role)) for role in ROLES}
    if backend == "standalone":
        assert reply == [b"ok", 1, 1, 0]
        assert {role: [f[b"s"] for _id, f in entries] for role, entries in heard.items()} == {
            role: [b"told"] for role in ROLES
        }
        assert await bus.sessions() == ["told"]
    else:
        assert reply == [b"ok", 1, 1, 1, *(role.encode() for role in ROLES)]
        assert heard == {role: [] for role in ROLES}
        assert await bus.sessions() == []


async def test_an_append_whose_reply_was_lost_or_whose_script_was_forgotten_appends_once(
    standalone_bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A standalone client sends an append in an exchange; a reply lost to a broken connection
    runs the call again under the same idempotency key (the first ids back, nothing appended
    twice), and ``NOSCRIPT`` (Redis restarted) runs it alone, which loads the script."""
    from riverbed.bus._redispy import DirectSend  # noqa: PLC0415

    bus = standalone_bus
    session = bus.session("s1")
    assert await session.append(events.Think(thought="first")) == [1]  # (the script is loaded)
    read = DirectSend.read_response
    breaks = [redis_exceptions.ConnectionError("connection reset by peer")]

    async def breaking(self: DirectSend, *args: object, **kwargs: object) -> object:
        reply = await read(self, *args, **kwargs)  # type: ignore[arg-type]
        if breaks:
            raise breaks.pop()  # the append went through; its reply is lost
        return reply

    monkeypatch.setattr(DirectSend, "read_response", breaking)
    assert await session.append(events.Think(thought="second")) == [2]
    assert not breaks
    await bus.redis.script_flush()
    assert await session.append(events.Think(thought="third")) == [3]
    assert [e.thought for e in await session.events() if isinstance(e, events.Think)] == ["first", "second", "third"]


async def test_fencing_refuses_a_stale_token(bus: Bus) -> None:
    session = bus.session("s1")
    await session.append(events.CmdRun(command="true"))
    meta = bus.keys.meta("s1")
    await bus.redis.hset(meta, "fence:runtime", 2)
    ok = await bus.log_store.append("s1", [events.Think(thought="new owner")], fence=Fence("runtime", 2))
    assert ok == [2]
    with pytest.raises(FencedError, match="token 1"):
        await bus.log_store.append("s1", [events.Think(thought="zombie")], fence=Fence("runtime", 1))
    assert await session.last_id() == 2


async def test_an_answer_passes_its_own_role_but_reaches_the_others(bus: Bus) -> None:
    session = bus.session("own")
    (action,) = await session.append(events.CmdRun(command="true"))
    key = bus.keys.log("own")
    for group in ("runtime", "memory"):
        await bus.redis.xgroup_create(key, group, id="0")
    assert len((await bus.redis.xreadgroup("runtime", "w", {key: ">"}))[0][1]) == 1
    answer = events.CmdOutput(content="", exit_code=0, cause=action)
    await bus.log_store.append("own", [answer], ack=("runtime", f"{action}-0"), pass_own=action)
    assert await bus.redis.xreadgroup("runtime", "w", {key: ">"}, block=50) == []  # skipped, and acked
    assert (await bus.redis.xpending(key, "runtime"))["pending"] == 0
    memory = await bus.redis.xreadgroup("memory", "m", {key: ">"})
    assert [entry_id for entry_id, _ in memory[0][1]] == [b"1-0", b"2-0"]
    # When something arrived in between, nothing is skipped.
    (second,) = await session.append(events.CmdRun(command="true"))
    await bus.redis.xreadgroup("runtime", "w", {key: ">"})
    (third,) = await session.append(events.CmdRun(command="true"))
    late = events.CmdOutput(content="", exit_code=0, cause=second)
    (late_id,) = await bus.log_store.append("own", [late], ack=("runtime", f"{second}-0"), pass_own=second)
    delivered = await bus.redis.xreadgroup("runtime", "w", {key: ">"})
    assert [entry_id for entry_id, _ in delivered[0][1]] == [f"{third}-0".encode(), f"{late_id}-0".encode()]


async def test_an_answer_that_would_pass_a_group_deleted_under_it_is_still_appended(bus: Bus) -> None:
    """The stream was deleted under its owner (its meta kept): the answer goes in, acking and
    passing nothing, and the owner finds the group gone on its next read."""
    session = bus.session("gone")
    (action,) = await session.append(events.CmdRun(command="true"))
    key = bus.keys.log("gone")
    await bus.redis.xgroup_create(key, "runtime", id="0")
    await bus.redis.xreadgroup("runtime", "w", {key: ">"})
    await bus.redis.delete(key)
    answer = events.CmdOutput(content="", exit_code=0, cause=action)
    (answer_id,) = await bus.log_store.append("gone", [answer], ack=("runtime", f"{action}-0"), pass_own=action)
    assert answer_id == action + 1
    assert [e.cause async for e in session.log(start=answer_id)] == [action]


async def test_an_owners_answer_makes_no_idempotency_key_and_a_repeat_only_says_answered(bus: Bus) -> None:
    """A repeat of an owner's answer (its reply lost with a connection) is refused as answered,
    so on a standalone Redis the answer needs no key of its own: one key per act, not two."""
    session = bus.session("idem")
    (action,) = await session.append(events.CmdRun(command="true"))
    await bus.redis.hset(bus.keys.meta("idem"), "fence:runtime", 1)
    answer = events.encode(events.CmdOutput(content="", exit_code=0, cause=action))
    prepared = bus.log_store.prepare("idem", [(answer, action)], fence=Fence("runtime", 1))
    assert await prepared.run() == [action + 1]
    cluster = isinstance(bus.redis, RedisCluster)
    # (A cluster announces in a second step, which a lost reply would lose: there the answer
    # keeps a key, and its repeat gives the same ids, to announce again.)
    repeat = [action + 1] if cluster else AlreadyAnswered(cause=action, existing=action + 1)
    assert await prepared.run() == repeat
    assert await session.last_id() == action + 1
    keys = [k async for k in bus.redis.scan_iter(match=bus.keys.idem("idem", "*"))]
    assert len(keys) == (2 if cluster else 1), keys


def test_a_forked_process_makes_keys_of_its_own_for_appends_made_without_one() -> None:
    """Keys made for appends without one are a process's prefix and a count: a child forked
    with the parent's count must not make the parent's next keys (its appends would be
    dropped as repeats)."""
    parent = auto_key()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next key, to the parent
        os.write(write_end, auto_key().encode())
        os._exit(0)
    os.close(write_end)
    child = os.read(read_end, 200).decode()
    os.close(read_end)
    os.waitpid(pid, 0)
    mine = auto_key()
    assert child.rsplit(":", 1)[0] != mine.rsplit(":", 1)[0]
    assert mine.rsplit(":", 1)[0] == parent.rsplit(":", 1)[0]
    assert child != mine


async def test_an_action_is_answered_at_most_once(bus: Bus) -> None:
    session = bus.session("s1")
    (action,) = await session.append(events.CmdRun(command="true"))
    first = await bus.log_store.append("s1", [events.CmdOutput(content="", exit_code=0, cause=action)])
    second = await bus.log_store.append("s1", [events.Error(content="late", cause=action)])
    assert first == [2]
    assert second == AlreadyAnswered(cause=action, existing=2)
    assert await session.last_id() == 2


async def test_act_returns_the_answer_even_when_it_came_first(bus: Bus) -> None:
    session = bus.session("s1")
    (action,) = await session.append(events.FileRead(path="x"))
    await bus.log_store.append("s1", [events.Think(thought="noise", source="user")])
    await bus.log_store.append("s1", [events.FileContent(path="x", content="hello", cause=action)])
    answer = await session.wait_for_answer(action, timeout=5)
    assert isinstance(answer, events.FileContent)
    assert answer.content == "hello"


async def test_act_waits_for_the_answer_and_times_out_clearly(bus: Bus) -> None:
    session = bus.session("s1")

    async def answer_later() -> None:
        await anyio.sleep(0.2)
        await bus.log_store.append("s1", [events.FileContent(path="a", content="late", cause=1)])

    async with anyio.create_task_group() as tg:
        tg.start_soon(answer_later)
        obs = await session.act(events.FileRead(path="a"), timeout=5)
    assert isinstance(obs, events.FileContent)
    with pytest.raises(riverbed.ActTimeout, match="no observation answered action 3"):
        await session.act(events.FileRead(path="b"), timeout=0.3)


def test_keys_of_a_session_share_one_cluster_slot() -> None:
    keys = Keys("rb")
    of_session = [keys.log("s-1"), keys.meta("s-1"), keys.answers("s-1"), keys.idem("s-1", "req{1}")]
    assert len({key_slot(k.encode()) for k in of_session}) == 1
    shared = [keys.dlq, keys.sessions, keys.workers, keys.directory("runtime"), keys.worker("w1")]
    assert len({key_slot(k.encode()) for k in shared}) == 1
    assert len({key_slot(keys.log(f"s-{i}").encode()) for i in range(20)}) > 1


async def test_bad_session_ids_are_refused(bus: Bus) -> None:
    for bad in ["", "a{b}", "x" * 200, "has space", "-lead"]:
        with pytest.raises(InputError, match="not a valid session id"):
            bus.session(bad)


async def test_twenty_concurrent_writers_never_interleave_or_lose(bus: Bus) -> None:
    session = bus.session("busy")
    got: dict[int, list[int]] = {}

    async def writer(w: int) -> None:
        ids: list[int] = []
        for i in range(25):
            ids += await session.append(events.Think(thought=f"{w}:{i}", agent=f"w{w}"))
        got[w] = ids

    async with anyio.create_task_group() as tg:
        for w in range(20):
            tg.start_soon(writer, w)
    all_ids = sorted(i for ids in got.values() for i in ids)
    assert all_ids == list(range(1, 501))
    log = await session.events()
    assert [e.id for e in log] == list(range(1, 501))
    for w, ids in got.items():
        assert ids == sorted(ids)
        for event_id in ids:
            event = log[event_id - 1]
            assert isinstance(event, events.Think)
            assert event.thought.startswith(f"{w}:")


async def test_follow_yields_every_event_once_across_a_reconnect(bus: Bus) -> None:
    session = bus.session("tail")
    await session.append(*[events.Think(thought=str(i)) for i in range(5)])
    seen: list[int] = []
    stop = anyio.Event()

    async def consume() -> None:
        async for event in bus.log_store.follow("tail", 1, block_ms=100, stop=stop):
            seen.append(event.id or 0)
            if len(seen) == 15:
                stop.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await session.append(*[events.Think(thought="x") for _ in range(5)])
        await kill_connections(bus)
        # (the append may find its connection closed under it: retried, as a client does, under a key)
        after = [events.Think(thought="y") for _ in range(5)]
        await retry_unavailable(lambda: session.append(*after, idempotency_key="after-the-kill"))
    assert seen == list(range(1, 16))
    assert await session.last_id() == 15


async def kill_connections(bus: Bus) -> None:
    """Close every client connection except the caller's, on every node of the deployment."""
    command = ("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    if isinstance(bus.redis, RedisCluster):
        await bus.redis.execute_command(*command, target_nodes=bus.redis.get_nodes())
    else:
        await bus.redis.execute_command(*command)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=8))
async def test_batches_get_contiguous_ids(bus: Bus, batches: list[int]) -> None:
    session = bus.session(f"h{len(batches)}-{sum(batches)}-{id(batches)}")
    expected = 1
    for size in batches:
        ids = await session.append(*[events.Think(thought="b") for _ in range(size)])
        assert ids == list(range(expected, expected + size))
        expected += size


def test_a_fenced_error_names_the_current_token_only_when_it_is_known() -> None:
    known = FencedError("s", "runtime", 3, 4)
    assert str(known).endswith("lease (token 3) was taken over (current token 4)")
    unknown = FencedError("s", "agent", 3)  # (a lease check that found another holder)
    assert str(unknown).endswith("lease (token 3) was taken over")
    assert unknown.current is None


def test_the_runtime_role_is_announced_only_by_its_own_work() -> None:
    """Which appended events announce a session to the runtime role (``wakes_runtime``): its
    actions, an approval, a fork whose sandbox it builds, a kind this version cannot read."""
    work = [
        events.CmdRun(command="ls"),
        events.FileRead(path="a"),
        events.ToolCall(tool="git.status", runs_in="runtime"),
        events.McpList(server="git", command=["mcp-server-git"]),
        events.Approval(decision="approve", actions=[3]),
        events.Forked(source_session="s", at=3, workspace="replay"),
    ]
    other = [
        events.Message(content="hi", source="user"),
        events.Think(thought="x"),
        events.ToolCall(tool="mine"),
        events.McpList(server="docs", url="http://docs/mcp", runs_in="agent"),
        events.Approval(decision="reject", actions=[3]),
        events.Forked(source_session="s", at=3),
        events.Recall(query="q"),
        events.CmdOutput(content="", exit_code=0, cause=1),
    ]
    for event in work:
        assert payload_kind(events.encode(event)) == event.kind
        assert wakes_runtime(events.encode(event)), event
    for event in other:
        assert not wakes_runtime(events.encode(event)), event
    assert wakes_runtime(msgspec.msgpack.encode({"kind": "cmd_run_v9", "source": "agent"}))  # (answered: unknown)
    assert payload_kind(b"\x00garbage") is None

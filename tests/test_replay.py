"""Fork and rerun against real Redis and a real runtime worker."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from riverbed import events
from riverbed.agent.replay import compare, fork, rerun
from riverbed.client.session import Bus
from riverbed.errors import ConfigError, InputError
from riverbed.runtime import Runtime
from tests.kit.agents import runtime_worker

pytestmark = pytest.mark.anyio


async def raw_log(bus: Bus, session: str) -> list[tuple[int, bytes]]:
    return [pair async for pair in bus.log_store.read_raw(session)]


async def test_fork_copies_the_same_ids_and_bytes_then_diverges(bus: Bus, workspace: Path) -> None:
    source = bus.session("src", tenant="acme")
    async with runtime_worker(bus, workspace) as runtime:
        await source.append(events.Message(content="count please", source="user"))
        for _ in range(2):
            obs = await source.act(events.CmdRun(command="echo x >> count.txt && wc -l < count.txt"), timeout=20)
            assert isinstance(obs, events.CmdOutput)
        assert obs.content.strip() == "2"
        at = await source.last_id()
        forked_id = await fork(bus, "src", at, "copy", workspace="empty")
        assert forked_id == at + 1

        original = await raw_log(bus, "src")
        copied = await raw_log(bus, "copy")
        assert copied[:at] == original
        marker = (await bus.session("copy").events(forked_id, forked_id))[0]
        assert isinstance(marker, events.Forked)
        assert (marker.source_session, marker.at, marker.source, marker.tenant) == ("src", at, "system", "acme")
        assert marker.workspace == "empty"
        assert (await bus.log_store.meta("copy"))["tenant"] == "acme"

        # The one-answer guard holds in the fork: copied actions are answered already.
        action_id = next(e.id for e in await bus.session("copy").events() if isinstance(e, events.CmdRun))
        assert action_id is not None
        fork_session = bus.session("copy", tenant="acme")  # the fork keeps the source's tenant
        with pytest.raises(InputError, match="already answered"):
            await fork_session.append(events.Error(content="again", source="agent", cause=action_id))

        # The copied actions are not run again: with workspace="empty" the fork's workspace starts empty.
        obs = await fork_session.act(events.CmdRun(command="echo y >> count.txt && wc -l < count.txt"), timeout=20)
        assert isinstance(obs, events.CmdOutput)
        assert obs.content.strip() == "1"
        assert runtime.workspace("copy") != runtime.workspace("src")
        obs = await source.act(events.CmdRun(command="wc -l < count.txt"), timeout=20)
        assert isinstance(obs, events.CmdOutput)
        assert obs.content.strip() == "2"
    assert await bus.session("src").last_id() == at + 2
    assert await fork_session.last_id() == forked_id + 2


async def test_a_fork_answers_the_action_that_was_waiting_at_the_fork_point(bus: Bus, workspace: Path) -> None:
    source = bus.session("waiting")
    await source.append(events.Message(content="go", source="user"))
    (action_id,) = await source.append(events.CmdRun(command="echo forked-run"))
    await source.append(events.CmdOutput(content="recorded", cause=action_id, exit_code=0))
    await fork(bus, "waiting", action_id, "branch")
    async with runtime_worker(bus, workspace):
        obs = await bus.session("branch").wait_for_answer(action_id, timeout=20)
    assert isinstance(obs, events.CmdOutput)
    assert obs.content.strip() == "forked-run"
    assert obs.id == action_id + 3  # after the forked event and the sandbox_rebuilt record


async def test_fork_refuses_bad_points_and_existing_targets(bus: Bus) -> None:
    session = bus.session("base")
    await session.append(events.Message(content="a", source="user"), events.Think(thought="b"))
    await bus.session("taken").append(events.Think(thought="c"))
    for at, into, pattern in [
        (0, "new", "from 1 to 2"),
        (3, "new", "from 1 to 2"),
        (1, "taken", "exists already"),
        (1, "base", "exists already"),
    ]:
        with pytest.raises(InputError, match=pattern) as info:
            await fork(bus, "base", at, into)
        assert str(info.value).count(".") <= 1
    with pytest.raises(InputError, match="no events"):
        await fork(bus, "nothing-here", 1, "new")
    assert not await bus.log_store.exists("new")
    assert await fork(bus, "base", 1, "new") == 2


async def test_fork_copies_many_pages_and_unknown_kinds(bus: Bus) -> None:
    session = bus.session("long")
    await session.append(*[events.Think(thought=f"t{i}") for i in range(2500)])
    payload = b"\x82\xa4kind\xa8teleport\xa6source\xa5agent"
    await bus.log_store.append_raw("long", [(payload, 0)])
    assert await fork(bus, "long", 2501, "long-copy") == 2502
    copied = await raw_log(bus, "long-copy")
    assert copied[:2501] == await raw_log(bus, "long")
    last = (await bus.session("long-copy").events(2501, 2501))[0]
    assert isinstance(last, events.Unknown)
    assert last.original_kind == "teleport"


async def record_session(bus: Bus, workspace: Path, session_id: str) -> None:
    """A session that reads a file the workspace started with, and makes one of its own."""
    seeded = workspace / "seeded"
    async with runtime_worker(bus, workspace) as runtime:
        ws = runtime.workspace(session_id)
        ws.mkdir(parents=True)
        (ws / "data.txt").write_text("alpha\nbeta\n")
        shutil.copytree(ws, seeded)
        session = bus.session(session_id)
        await session.append(events.SessionConfig(env={"GREETING": "hi"}))
        for action in [
            events.FileRead(path="data.txt"),
            events.CmdRun(command="echo $GREETING; wc -l < data.txt"),
            events.FileWrite(path="out.txt", content="made here\n"),
            events.FileRead(path="out.txt"),
            events.Think(thought="not a runtime action"),
        ]:
            if action.answered_by is None:
                await session.append(action)
            else:
                obs = await session.act(action, timeout=20)
                assert not isinstance(obs, events.Error), obs


async def test_rerun_with_the_same_seed_finds_no_difference(bus: Bus, workspace: Path, tmp_path: Path) -> None:
    await record_session(bus, workspace, "rec")
    runtime = Runtime(workspace_root=tmp_path / "rerun-ws")
    try:
        assert await rerun(bus, "rec", runtime, seed=workspace / "seeded") == []
        assert (runtime.workspace("rec-rerun-1") / "out.txt").read_text() == "made here\n"
        assert await rerun(bus, "rec", runtime, seed=workspace / "seeded") == []
        assert (runtime.workspace("rec-rerun-2") / "out.txt").exists()
    finally:
        await runtime.aclose()


async def test_rerun_reports_a_file_changed_underneath(bus: Bus, workspace: Path, tmp_path: Path) -> None:
    await record_session(bus, workspace, "rec")
    changed = tmp_path / "changed"
    shutil.copytree(workspace / "seeded", changed)
    (changed / "data.txt").write_text("alpha\nbeta\ngamma\n")
    runtime = Runtime(workspace_root=tmp_path / "rerun-ws")
    try:
        differences = await rerun(bus, "rec", runtime, seed=changed)
    finally:
        await runtime.aclose()
    log = await bus.session("rec").events()
    read_id = next(e.id for e in log if isinstance(e, events.FileRead) and e.path == "data.txt")
    cmd_id = next(e.id for e in log if isinstance(e, events.CmdRun))
    found = {(d.action_id, d.kind, d.field): (d.recorded, d.new) for d in differences}
    assert found == {
        (read_id, "file_read", "content"): ("alpha\nbeta\n", "alpha\nbeta\ngamma\n"),
        (cmd_id, "cmd_run", "content"): ("hi\n2\n", "hi\n3\n"),
    }


async def test_rerun_without_a_seed_reports_the_missing_file(bus: Bus, workspace: Path, tmp_path: Path) -> None:
    await record_session(bus, workspace, "rec")
    runtime = Runtime(workspace_root=tmp_path / "rerun-ws")
    try:
        differences = await rerun(bus, "rec", runtime)
    finally:
        await runtime.aclose()
    kinds = [(d.kind, d.field, d.recorded, d.new) for d in differences if d.field == "kind"]
    assert kinds == [("file_read", "kind", "file_content", "error")]


async def test_rerun_into_writes_a_log_that_no_worker_runs_again(bus: Bus, workspace: Path, tmp_path: Path) -> None:
    await record_session(bus, workspace, "rec")
    async with runtime_worker(bus, workspace) as runtime:
        differences = await rerun(bus, "rec", runtime, into="rec-again", seed=workspace / "seeded")
        assert differences == []
        again = bus.session("rec-again")
        log = await again.events()
        assert [e.kind for e in log] == [
            "session_config",
            "file_read",
            "file_content",
            "cmd_run",
            "cmd_output",
            "file_write",
            "file_written",
            "file_read",
            "file_content",
        ]
        for action, answer in zip(log[1::2], log[2::2], strict=True):
            assert answer.cause == action.id
        # A worker serving the new session starts after the written log: file_write is not run twice.
        (runtime.workspace("rec-again") / "out.txt").unlink()
        obs = await again.act(events.CmdRun(command="ls"), timeout=20)
        assert isinstance(obs, events.CmdOutput)
        assert obs.content.split() == ["data.txt"]
    with pytest.raises(InputError, match="exists already"):
        await rerun(bus, "rec", Runtime(workspace_root=tmp_path / "x"), into="rec-again")
    with pytest.raises(InputError, match="no events"):
        await rerun(bus, "never", Runtime(workspace_root=tmp_path / "x"))


async def test_fork_refuses_a_source_whose_first_events_cannot_be_read(bus: Bus) -> None:
    session = bus.session("trimmed")
    await session.append(*[events.Think(thought=f"t{i}") for i in range(5)])
    await bus.redis.xtrim(bus.keys.log("trimmed"), minid="3-0", approximate=False)
    bus.log_store.archive = None  # no database to read the trimmed events from
    with pytest.raises(ConfigError, match=r"events 1\.\.2 of session 'trimmed' were moved to the Postgres archive"):
        await fork(bus, "trimmed", 5, "from-trimmed")
    assert not await bus.log_store.exists("from-trimmed")


def test_paths_that_differ_only_by_workspace_are_not_differences() -> None:
    action = events.CmdRun(id=3, command="pwd")
    recorded = events.CmdOutput(content="/ws/a/app\n", exit_code=0, cause=3)
    same = events.CmdOutput(content="/ws/b/app\n", exit_code=0, cause=3)
    moved = events.CmdOutput(content="/ws/b/elsewhere\n", exit_code=0, cause=3)
    assert compare(action, recorded, same, workspaces=("/ws/a", "/ws/b")) == []
    assert [d.field for d in compare(action, recorded, moved, workspaces=("/ws/a", "/ws/b"))] == ["content"]
    assert [d.field for d in compare(action, recorded, same)] == ["content"]

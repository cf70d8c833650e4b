"""File actions and path confinement (real files in a temporary workspace)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from riverbed import confine, events
from riverbed.runtime import Runtime, files, workspace_name
from riverbed.runtime.limits import Limits
from riverbed.runtime.runtime import INLINE_READ_BYTES

pytestmark = pytest.mark.anyio


@pytest.fixture
async def rt(workspace: Path) -> AsyncIterator[Runtime]:
    runtime = Runtime(workspace_root=workspace)
    yield runtime
    await runtime.aclose()


async def ok(rt: Runtime, action: events.Action) -> events.Observation:
    obs = await rt.execute("s", action)
    assert not isinstance(obs, events.Error), obs
    return obs


async def refused(rt: Runtime, action: events.Action, reason: str) -> events.Error:
    obs = await rt.execute("s", action)
    assert isinstance(obs, events.Error), obs
    assert obs.reason == reason, obs
    assert obs.cause == action.id
    return obs


async def test_write_creates_parents_and_read_takes_line_ranges(rt: Runtime) -> None:
    written = await ok(rt, events.FileWrite(id=1, path="a/b/c.txt", content="one\ntwo\nthree\nfour\n"))
    assert isinstance(written, events.FileWritten)
    assert written.path == "a/b/c.txt"
    assert written.cause == 1
    assert (rt.workspace("s") / "a/b/c.txt").read_text() == "one\ntwo\nthree\nfour\n"

    whole = await ok(rt, events.FileRead(id=2, path="a/b/c.txt"))
    assert isinstance(whole, events.FileContent)
    assert whole.content == "one\ntwo\nthree\nfour\n"
    middle = await ok(rt, events.FileRead(id=3, path="a/b/c.txt", start=2, end=3))
    assert isinstance(middle, events.FileContent)
    assert middle.content == "two\nthree\n"
    tail = await ok(rt, events.FileRead(id=4, path=str(rt.workspace("s") / "a/b/c.txt"), start=4, end=99))
    assert isinstance(tail, events.FileContent)
    assert tail.content == "four\n"

    await refused(rt, events.FileRead(id=5, path="a/b/c.txt", start=0), "bad_range")
    await refused(rt, events.FileRead(id=6, path="a/b/c.txt", start=3, end=2), "bad_range")
    await refused(rt, events.FileRead(id=7, path="a/b/c.txt", start=9), "bad_range")
    await refused(rt, events.FileRead(id=8, path="missing.txt"), "not_found")
    await refused(rt, events.FileRead(id=9, path="a"), "is_directory")


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("../outside.txt", "path_outside_workspace"),
        ("a/../../outside.txt", "path_outside_workspace"),
        ("/etc/passwd", "path_outside_workspace"),
        ("link/passwd", "path_outside_workspace"),
        ("filelink", "path_outside_workspace"),
        ("nul\x00byte", "bad_path"),
        ("x" * 5000, "bad_path"),
        ("d/" + "y" * 300, "bad_path"),
        ("", "bad_path"),
    ],
)
async def test_every_path_escape_is_refused(rt: Runtime, tmp_path: Path, path: str, reason: str) -> None:
    ws = rt.workspace("s")
    ws.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("secret")
    os.symlink("/etc", ws / "link")
    os.symlink(outside / "secret", ws / "filelink")
    actions: list[events.Action] = [
        events.FileRead(id=1, path=path),
        events.FileWrite(id=2, path=path, content="x"),
        events.FileEdit(id=3, command="view", path=path),
        events.FileEdit(id=4, command="create", path=path, file_text="x"),
        events.FileEdit(id=5, command="str_replace", path=path, old_str="secret", new_str="gone"),
    ]
    for action in actions:
        error = await refused(rt, action, reason)
        assert not error.retryable
    assert (outside / "secret").read_text() == "secret"
    assert not (tmp_path / "outside.txt").exists()


async def test_symlinks_inside_the_workspace_are_fine(rt: Runtime) -> None:
    ws = rt.workspace("s")
    (ws / "real").mkdir(parents=True)
    (ws / "real/f.txt").write_text("hi\n")
    os.symlink(ws / "real", ws / "alias")
    got = await ok(rt, events.FileRead(id=1, path="alias/f.txt"))
    assert isinstance(got, events.FileContent)
    assert got.content == "hi\n"


async def test_file_edit_commands_and_undo(rt: Runtime) -> None:
    created = await ok(rt, events.FileEdit(id=1, command="create", path="src/app.py", file_text="a = 1\nb = 2\n"))
    assert isinstance(created, events.FileEdited)
    assert created.cause == 1
    assert "+a = 1" in created.diff
    assert "/dev/null" in created.diff
    await refused(rt, events.FileEdit(id=2, command="create", path="src/app.py", file_text="x"), "file_exists")
    await refused(rt, events.FileEdit(id=3, command="create", path="src/other.py"), "missing_argument")

    replaced = await ok(
        rt, events.FileEdit(id=4, command="str_replace", path="src/app.py", old_str="b = 2", new_str="b = 3")
    )
    assert isinstance(replaced, events.FileEdited)
    assert "-b = 2" in replaced.diff
    assert "+b = 3" in replaced.diff
    assert "b = 3" in replaced.content
    path = rt.workspace("s") / "src/app.py"
    assert path.read_text() == "a = 1\nb = 3\n"

    missing = await refused(
        rt, events.FileEdit(id=5, command="str_replace", path="src/app.py", old_str="zzz"), "old_str_not_found"
    )
    assert "not found" in missing.content
    await ok(rt, events.FileWrite(id=6, path="dup.txt", content="x = 1\ny\nx = 1\nx = 1\n"))
    dup = await refused(
        rt,
        events.FileEdit(id=7, command="str_replace", path="dup.txt", old_str="x = 1", new_str="z"),
        "old_str_not_unique",
    )
    assert "3 times" in dup.content
    assert "1, 3, 4" in dup.content
    await refused(rt, events.FileEdit(id=8, command="str_replace", path="src/app.py", old_str=""), "missing_argument")
    await refused(rt, events.FileEdit(id=9, command="str_replace", path="nope.py", old_str="a"), "not_found")

    inserted = await ok(
        rt, events.FileEdit(id=10, command="insert", path="src/app.py", insert_line=1, new_str="# between")
    )
    assert isinstance(inserted, events.FileEdited)
    assert path.read_text() == "a = 1\n# between\nb = 3\n"
    await ok(rt, events.FileEdit(id=11, command="insert", path="src/app.py", insert_line=0, new_str="# top\n"))
    assert path.read_text().startswith("# top\na = 1\n")
    await refused(
        rt, events.FileEdit(id=12, command="insert", path="src/app.py", insert_line=99, new_str="x"), "bad_range"
    )
    await refused(rt, events.FileEdit(id=13, command="insert", path="src/app.py", new_str="x"), "missing_argument")

    viewed = await ok(rt, events.FileEdit(id=14, command="view", path="src/app.py"))
    assert isinstance(viewed, events.FileContent)
    assert viewed.content.splitlines()[1] == "     2\ta = 1"
    listing = await ok(rt, events.FileEdit(id=15, command="view", path="."))
    assert isinstance(listing, events.FileContent)
    assert "src/" in listing.content.splitlines()
    assert "src/app.py" in listing.content.splitlines()

    undone = await ok(rt, events.FileEdit(id=16, command="undo_edit", path="src/app.py"))
    assert isinstance(undone, events.FileEdited)
    assert path.read_text() == "a = 1\n# between\nb = 3\n"
    await ok(rt, events.FileEdit(id=17, command="undo_edit", path="src/app.py"))
    assert path.read_text() == "a = 1\nb = 3\n"
    await ok(rt, events.FileEdit(id=18, command="undo_edit", path="src/app.py"))
    assert path.read_text() == "a = 1\nb = 2\n"
    await ok(rt, events.FileEdit(id=19, command="undo_edit", path="src/app.py"))
    assert not path.exists()
    await refused(rt, events.FileEdit(id=20, command="undo_edit", path="src/app.py"), "no_history")


async def test_undo_restores_what_file_write_replaced(rt: Runtime) -> None:
    await ok(rt, events.FileWrite(id=1, path="n.txt", content="first"))
    await ok(rt, events.FileWrite(id=2, path="n.txt", content="second"))
    await ok(rt, events.FileEdit(id=3, command="undo_edit", path="n.txt"))
    assert (rt.workspace("s") / "n.txt").read_text() == "first"


async def test_binary_and_large_reads_are_refused(rt: Runtime) -> None:
    ws = rt.workspace("s")
    ws.mkdir(parents=True)
    (ws / "bin").write_bytes(b"\x00\x01\x02")
    await refused(rt, events.FileRead(id=1, path="bin"), "not_text")


async def test_workspace_names_are_safe_and_deterministic(rt: Runtime) -> None:
    names = {sid: workspace_name(sid) for sid in ("s-42", "../../etc", "a/b", "a_b", "", "x" * 500, "ünï cödé")}
    assert names["a/b"] != names["a_b"]
    assert len(set(names.values())) == len(names)
    for sid, name in names.items():
        assert name == workspace_name(sid)
        assert "/" not in name
        assert name not in {".", ".."}
        assert len(name) <= 65
        assert rt.workspace(sid).parent == rt.workspace("s").parent


async def test_a_session_that_only_touches_files_writes_no_sandbox_state(rt: Runtime) -> None:
    # The state a sandbox process sees (/etc/passwd, group, hosts, resolv.conf) is written when
    # the first process starts, not for every new session: a file costs ~1 ms on some disks.
    await ok(rt, events.FileWrite(id=1, path="notes.txt", content="hi\n"))
    await ok(rt, events.FileRead(id=2, path="notes.txt"))
    state = rt.workspace("s").parent / ".sandbox" / rt.workspace("s").name
    assert not state.exists()
    ran = await ok(rt, events.CmdRun(id=3, command="cat notes.txt; id -un"))
    assert isinstance(ran, events.CmdOutput)
    assert ran.content.split() == ["hi", "sandbox"]
    assert sorted(p.name for p in state.iterdir() if p.is_file()) == ["group", "hosts", "passwd", "resolv.conf"]
    # A session whose first process is a Python cell gets the same state.
    cell = await rt.execute("p", events.PythonRun(id=1, code="import getpass; print(getpass.getuser())"))
    assert isinstance(cell, events.PythonOutput), cell
    assert cell.content.strip() == "sandbox"


async def test_a_small_file_is_read_at_once_and_a_large_one_off_the_event_loop(rt: Runtime, workspace: Path) -> None:
    """``read_small`` answers a small file, a missing one and a directory from what it opened,
    and gives a file over the size back unread (the runtime then reads it in a thread)."""
    ws = workspace / workspace_name("s")
    ws.mkdir(parents=True)
    (ws / "small.txt").write_text("tiny\n")
    (ws / "big.txt").write_text("x" * 99 + "\n")
    (ws / "d").mkdir()
    limits = Limits()
    small = files.read_small(ws, events.FileRead(id=3, path="small.txt"), limits, 50)
    assert small is not None
    assert small.content == "tiny\n"
    assert small.cause == 3
    assert files.read_small(ws, events.FileRead(path="big.txt"), limits, 50) is None
    for path, reason in (("nope.txt", "not_found"), ("d", "is_directory")):
        with pytest.raises(files.FileActionError) as caught:
            files.read_small(ws, events.FileRead(path=path), limits, 50)
        assert caught.value.reason == reason
    large = "y" * (INLINE_READ_BYTES + 10) + "\n"
    (ws / "large.txt").write_text(large)
    read = await ok(rt, events.FileRead(id=4, path="large.txt"))
    assert isinstance(read, events.FileContent)
    assert read.content.startswith("y" * 10_000)
    assert read.content == files.read(ws, events.FileRead(path="large.txt"), limits).content  # (capped alike)


def test_read_fd_reads_the_whole_file_whatever_its_stat_said(tmp_path: Path) -> None:
    """The stat size only sizes the first read: a file that grew or shrank after it is read to
    its end, and never past one byte over the limit."""
    path = tmp_path / "f"
    text = b"abcdefghij" * 300_000  # 3 MB: more than one of the later reads
    path.write_bytes(text)

    def read(limit: int, size: int) -> bytes:
        fd = os.open(path, os.O_RDONLY)
        try:
            return confine.read_fd(fd, limit, size)
        finally:
            os.close(fd)

    for size in (0, 5, len(text) - 1, len(text), len(text) + 100):
        assert read(10_000_000, size) == text, size
    for size in (0, 10, 2_000_000):
        assert read(1_500_000, size) == text[:1_500_001], size

"""Attacks on the file actions and the memory role's workspace reads, each asserted to fail.

Every file here is real.  What the attacker's shell would do (in ``process`` mode, where it
runs as the worker's user on the host's filesystem) is done from the test process: plant
symlinks and hard links, swap a directory for a symlink in a tight loop while the worker
reads and writes.  Next to each attack, the same kind of normal work is asserted to work.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from riverbed import events
from riverbed.errors import PathRefused
from riverbed.memory.microagents import load_microagents, match_knowledge, workspace_dirs
from riverbed.memory.workspace import MAX_INSTRUCTIONS, workspace_context
from riverbed.runtime import Limits, Runtime, Sandbox
from riverbed.runtime import files as file_actions

pytestmark = pytest.mark.security

SECRET = "OUTSIDE-SECRET-7f3a"


@pytest.fixture
async def rt(tmp_path: Path) -> AsyncIterator[Runtime]:
    runtime = Runtime(workspace_root=tmp_path / "root", sandbox=Sandbox(mode="process"))
    yield runtime
    await runtime.aclose()


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside every workspace (same filesystem, so hard links to it work)."""
    path = tmp_path / "outside"
    path.mkdir()
    (path / "secret").write_text(SECRET + "\n")
    return path


async def run(rt: Runtime, action: events.Action, session: str = "a") -> events.Observation:
    return await rt.execute(session, action)


async def ok(rt: Runtime, action: events.Action, session: str = "a") -> events.Observation:
    obs = await run(rt, action, session)
    assert not isinstance(obs, events.Error), obs
    return obs


async def refused(rt: Runtime, action: events.Action, reason: str) -> None:
    obs = await run(rt, action)
    assert isinstance(obs, events.Error), obs
    assert obs.reason == reason, obs
    assert not obs.retryable
    assert SECRET not in obs.content


def every_action(path: str) -> list[events.Action]:
    return [
        events.FileRead(id=1, path=path),
        events.FileWrite(id=2, path=path, content="pwned"),
        events.FileEdit(id=3, command="view", path=path),
        events.FileEdit(id=4, command="str_replace", path=path, old_str=SECRET, new_str="pwned"),
        events.FileEdit(id=5, command="insert", path=path, insert_line=0, new_str="pwned"),
    ]


def tree(path: Path) -> dict[str, str]:
    """Every file below ``path`` with its contents (to show nothing outside changed)."""
    return {str(p.relative_to(path)): p.read_text() for p in sorted(path.rglob("*")) if p.is_file()}


# --- another session's workspace --------------------------------------------------------


@pytest.mark.anyio
async def test_another_sessions_workspace_cannot_be_reached(rt: Runtime) -> None:
    await ok(rt, events.FileWrite(id=1, path="secret.txt", content=SECRET), session="b")
    await ok(rt, events.FileWrite(id=1, path="mine.txt", content="mine"), session="a")
    other = rt.workspace("b")
    before = tree(other)
    for path in (
        f"../{other.name}/secret.txt",
        f"sub/../../{other.name}/secret.txt",
        str(other / "secret.txt"),
        f"{rt.workspace('a')}/../{other.name}/secret.txt",
    ):
        for action in every_action(path):
            await refused(rt, action, "path_outside_workspace")
        await refused(rt, events.FileEdit(id=6, command="create", path=path, file_text="x"), "path_outside_workspace")
    assert tree(other) == before


# --- symlinks ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_symlinks_that_lead_out_are_refused(rt: Runtime, outside: Path) -> None:
    await ok(rt, events.FileWrite(id=1, path="secret.txt", content=SECRET), session="b")
    ws = rt.workspace("a")
    ws.mkdir(parents=True)
    other = rt.workspace("b")
    os.symlink(other / "secret.txt", ws / "abs_other")
    os.symlink(f"../{other.name}/secret.txt", ws / "rel_other")
    os.symlink("/etc/passwd", ws / "passwd")
    os.symlink(other, ws / "other_dir")
    os.symlink(outside, ws / "outside_dir")
    (ws / "deep" / "er").mkdir(parents=True)
    os.symlink("../../../outside", ws / "deep" / "er" / "up")  # stays a name inside, climbs out in steps
    os.symlink("/proc/self", ws / "proc")
    os.symlink(ws / "loop_b", ws / "loop_a")
    os.symlink(ws / "loop_a", ws / "loop_b")
    passwd = Path("/etc/passwd").read_text()
    before = tree(other), tree(outside)
    for path in (
        "abs_other",
        "rel_other",
        "passwd",
        "other_dir/secret.txt",
        "outside_dir/secret",
        "deep/er/up/secret",
        "proc/environ",
    ):
        for action in every_action(path):
            await refused(rt, action, "path_outside_workspace")
    await refused(rt, events.FileWrite(id=7, path="outside_dir/new.txt", content="x"), "path_outside_workspace")
    await refused(rt, events.FileWrite(id=8, path="other_dir/sub/new.txt", content="x"), "path_outside_workspace")
    await refused(rt, events.FileRead(id=9, path="loop_a"), "symlink_loop")
    assert (tree(other), tree(outside)) == before
    assert Path("/etc/passwd").read_text() == passwd
    assert os.readlink(ws / "passwd") == "/etc/passwd"


@pytest.mark.anyio
async def test_symlinks_inside_the_workspace_work(rt: Runtime) -> None:
    ws = rt.workspace("a")
    (ws / "real" / "sub").mkdir(parents=True)
    (ws / "real" / "sub" / "f.txt").write_text("hi\n")
    os.symlink(ws / "real", ws / "abs_alias")
    os.symlink("real/sub", ws / "rel_alias")
    os.symlink("../real/sub/f.txt", ws / "real" / "up_link")
    for path in ("abs_alias/sub/f.txt", "rel_alias/f.txt", "real/up_link"):
        got = await ok(rt, events.FileRead(id=1, path=path))
        assert isinstance(got, events.FileContent)
        assert (got.content, got.path) == ("hi\n", "real/sub/f.txt")
    await ok(rt, events.FileEdit(id=2, command="str_replace", path="rel_alias/f.txt", old_str="hi", new_str="ho"))
    assert (ws / "real" / "sub" / "f.txt").read_text() == "ho\n"
    assert (ws / "rel_alias").is_symlink()
    await ok(rt, events.FileEdit(id=3, command="undo_edit", path="real/sub/f.txt"))  # one history per real file
    assert (ws / "real" / "sub" / "f.txt").read_text() == "hi\n"


# --- hard links -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_hard_link_to_an_outside_file_is_neither_read_nor_written(rt: Runtime, outside: Path) -> None:
    ws = rt.workspace("a")
    (ws / "sub").mkdir(parents=True)
    os.link(outside / "secret", ws / "sub" / "linked")
    for action in every_action("sub/linked"):
        await refused(rt, action, "hard_link_refused")
    await refused(rt, events.FileEdit(id=6, command="create", path="sub/linked", file_text="x"), "hard_link_refused")
    assert (outside / "secret").read_text() == SECRET + "\n"
    assert os.stat(outside / "secret").st_nlink == 2


# --- swaps between check and use -----------------------------------------------------------

SWAPPER = """
import ctypes, os, sys
os.chdir(sys.argv[1])
a, b = (b"d", b"d_link") if sys.argv[2] == "dir" else (b"d/f", b"d/f_link")
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
exchange = getattr(libc, "renameat2", None)
while True:   # one atomic exchange a step: the name is a real directory (file), then the symlink
    if exchange is not None:
        exchange(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE)
    else:
        os.rename(a, a + b".real"); os.rename(b, a); os.rename(a, b); os.rename(a + b".real", a)
"""


@pytest.fixture
def swapper(tmp_path: Path, outside: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A workspace whose ``d`` (or ``d/f``) another process swaps for a symlink to the
    outside, over and over, as an attacker's shell would."""
    kind = request.param
    ws = tmp_path / "root" / "ws"
    (ws / "d").mkdir(parents=True)
    (ws / "d" / "f").write_text("inside\n")
    os.symlink(outside, ws / "d_link")
    os.symlink(outside / "secret", ws / "d" / "f_link")
    (outside / "f").write_text(SECRET + "\n")
    proc = subprocess.Popen([sys.executable, "-c", SWAPPER, str(ws), kind])
    try:
        time.sleep(0.2)  # let it start swapping (a race needs both sides running)
        yield ws
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("swapper", ["dir", "file"], indirect=True)
def test_swapping_a_directory_or_file_for_a_symlink_never_leads_out(swapper: Path, outside: Path) -> None:
    limits = Limits()
    history = file_actions.EditHistory(limits.edit_history)
    before = tree(outside)
    allowed = {"not_found", "symlink_refused", "path_outside_workspace", "not_a_directory"}
    results: dict[str, int] = {}
    deadline = time.monotonic() + 3
    rounds = 0
    while time.monotonic() < deadline:
        rounds += 1
        for action in (
            events.FileRead(id=1, path="d/f"),
            events.FileWrite(id=2, path="d/f", content="written\n"),
            events.FileEdit(id=3, command="str_replace", path="d/f", old_str="e", new_str="e"),
        ):
            try:
                if isinstance(action, events.FileRead):
                    obs: events.Observation = file_actions.read(swapper, action, limits)
                elif isinstance(action, events.FileWrite):
                    obs = file_actions.write(swapper, action, limits, history)
                else:
                    obs = file_actions.edit(swapper, action, limits, history)
            except (PathRefused, file_actions.FileActionError) as exc:
                results[exc.reason] = results.get(exc.reason, 0) + 1
                continue
            results[action.kind] = results.get(action.kind, 0) + 1
            assert SECRET not in str(obs)
    assert tree(outside) == before, "a file outside the workspace was changed"
    assert set(results) <= allowed | {"file_read", "file_write", "file_edit"}, results
    assert results.get("file_read", 0) > 0, results  # the attack did not just stop all work
    assert rounds > 100


# --- the memory role's workspace reads ----------------------------------------------------


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    path = tmp_path / "root" / "ws"
    path.mkdir(parents=True)
    return path


def context_text(ws: Path) -> str:
    ctx = workspace_context(ws)
    return repr(ctx)


def test_agents_md_symlinked_to_proc_environ_or_outside_gives_nothing(ws: Path, outside: Path) -> None:
    environ = Path("/proc/self/environ").read_bytes().split(b"\x00")
    markers = [e.decode(errors="replace") for e in environ if b"=" in e and len(e) > 8][:5]
    assert markers
    os.symlink("/proc/self/environ", ws / "AGENTS.md")
    ctx = workspace_context(ws)
    assert ctx.repo_instructions is None
    assert not any(m in repr(ctx) for m in markers)
    (ws / "AGENTS.md").unlink()
    os.symlink(outside / "secret", ws / "AGENTS.md")
    assert workspace_context(ws).repo_instructions is None
    (ws / "AGENTS.md").unlink()
    os.link(outside / "secret", ws / "AGENTS.md")
    assert workspace_context(ws).repo_instructions is None
    (ws / "AGENTS.md").unlink()
    (ws / "real.md").write_text("Run the tests.\n")
    os.symlink("real.md", ws / "AGENTS.md")  # inside the workspace: fine
    assert workspace_context(ws).repo_instructions == "Run the tests."


def test_microagents_linked_outside_give_nothing(ws: Path, outside: Path) -> None:
    (outside / "repo.md").write_text(f"---\ntype: repo\n---\n{SECRET} repo\n")
    (outside / "k.md").write_text(f"---\nname: k\ntriggers: [deploy]\n---\n{SECRET} knowledge\n")
    agents = ws / ".openhands" / "microagents"
    agents.mkdir(parents=True)
    os.symlink(outside / "repo.md", agents / "repo.md")
    os.symlink(outside / "k.md", agents / "k.md")
    os.link(outside / "k.md", agents / "hard.md")
    os.symlink(outside, agents / "sub")
    (ws / ".riverbed").mkdir()
    os.symlink(outside, ws / ".riverbed" / "microagents")
    assert SECRET not in context_text(ws)
    assert match_knowledge(load_microagents(workspace_dirs(ws)), "how do I deploy?") == []
    (agents / "own.md").write_text("---\nname: own\ntriggers: [deploy]\n---\nUse make deploy.\n")
    found = match_knowledge(load_microagents(workspace_dirs(ws)), "how do I deploy?")
    assert [k.content for k in found] == ["Use make deploy."]


def test_git_metadata_outside_the_workspace_is_not_read(ws: Path, outside: Path) -> None:
    repo = outside / "repo.git"
    repo.mkdir()
    (repo / "HEAD").write_text("ref: refs/heads/secret-branch\n")
    (repo / "config").write_text(f'[remote "origin"]\n\turl = https://{SECRET}@github.com/acme/private.git\n')
    (ws / ".git").write_text(f"gitdir: {repo}\n")
    assert SECRET not in context_text(ws)
    assert "secret-branch" not in context_text(ws)
    (ws / ".git").unlink()
    os.symlink(repo, ws / ".git")
    assert SECRET not in context_text(ws)
    (ws / ".git").unlink()
    (ws / ".git").mkdir()
    os.symlink(repo / "HEAD", ws / ".git" / "HEAD")
    os.symlink(repo / "config", ws / ".git" / "config")
    assert "secret-branch" not in context_text(ws)
    assert SECRET not in context_text(ws)
    (ws / ".git" / "HEAD").unlink()
    (ws / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (ws / ".git" / "commondir").write_text(str(repo))
    ctx = workspace_context(ws)
    assert (ctx.repo_name, ctx.repo_branch) == ("ws", "main")
    assert SECRET not in repr(ctx)


def test_workspace_reads_are_capped_and_a_fifo_does_not_stall_them(ws: Path) -> None:
    (ws / "AGENTS.md").write_text("x" * (50 * MAX_INSTRUCTIONS))
    assert len(workspace_context(ws).repo_instructions or "") == MAX_INSTRUCTIONS
    (ws / "AGENTS.md").unlink()
    os.mkfifo(ws / "AGENTS.md")
    done: list[object] = []
    thread = threading.Thread(target=lambda: done.append(workspace_context(ws)), daemon=True)
    thread.start()
    thread.join(10)
    assert done, "reading a FIFO named AGENTS.md blocked"


# --- normal work -----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_normal_work_in_subdirectories_and_by_absolute_path(rt: Runtime) -> None:
    ws = rt.workspace("a")
    await ok(rt, events.FileWrite(id=1, path="src/pkg/mod.py", content="x = 1\n"))
    await ok(rt, events.FileWrite(id=2, path=str(ws / "src/pkg/other.py"), content="y = 2\n"))
    os.chmod(ws / "src/pkg/mod.py", 0o755)
    await ok(rt, events.FileEdit(id=3, command="str_replace", path="src/pkg/mod.py", old_str="1", new_str="3"))
    assert stat.S_IMODE(os.stat(ws / "src/pkg/mod.py").st_mode) == 0o755  # a rewrite keeps the mode
    await ok(rt, events.FileEdit(id=4, command="insert", path=str(ws / "src/pkg/mod.py"), insert_line=1, new_str="z"))
    got = await ok(rt, events.FileRead(id=5, path="src/./pkg/../pkg/mod.py"))
    assert isinstance(got, events.FileContent)
    assert (got.path, got.content) == ("src/pkg/mod.py", "x = 3\nz\n")
    await ok(rt, events.FileEdit(id=6, command="undo_edit", path="src/pkg/mod.py"))
    await ok(rt, events.FileEdit(id=7, command="undo_edit", path=str(ws / "src/pkg/mod.py")))
    assert (ws / "src/pkg/mod.py").read_text() == "x = 1\n"
    await ok(rt, events.FileEdit(id=8, command="create", path="a/b/c/new.txt", file_text="new\n"))
    listing = await ok(rt, events.FileEdit(id=9, command="view", path=str(ws)))
    assert isinstance(listing, events.FileContent)
    assert {"a/", "src/", "src/pkg/"} <= set(listing.content.splitlines())
    await ok(rt, events.FileEdit(id=10, command="undo_edit", path="a/b/c/new.txt"))
    assert not (ws / "a/b/c/new.txt").exists()
    assert not list(ws.rglob("*.tmp"))  # no temporary file is left behind
    await refused(rt, events.FileWrite(id=11, path="src", content="x"), "is_directory")
    await refused(rt, events.FileWrite(id=12, path="src/pkg/mod.py/x", content="x"), "not_a_directory")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another user needs root")
def test_what_a_write_creates_is_given_to_the_sandbox_user(ws: Path) -> None:
    limits = Limits()
    history = file_actions.EditHistory(limits.edit_history)
    owner = (2_345_678, 2_345_679)
    file_actions.write(ws, events.FileWrite(path="new/dir/f.txt", content="x"), limits, history, owner=owner)
    file_actions.edit(
        ws, events.FileEdit(command="create", path="made/g.txt", file_text="y"), limits, history, owner=owner
    )
    for path in ("new", "new/dir", "new/dir/f.txt", "made", "made/g.txt"):
        st = os.stat(ws / path)
        assert (st.st_uid, st.st_gid) == owner, path
    (ws / "mine.txt").write_text("root's")
    file_actions.write(ws, events.FileWrite(path="mine.txt", content="x"), limits, history)  # owner None: as is
    assert os.stat(ws / "mine.txt").st_uid == 0


@pytest.mark.anyio
@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another user needs root")
async def test_a_root_workers_file_actions_give_files_to_the_sessions_uid(tmp_path: Path) -> None:
    sandbox = Sandbox(mode="namespaces")
    runtime = Runtime(workspace_root=tmp_path / "root", sandbox=sandbox)
    try:
        await ok(runtime, events.FileWrite(id=1, path="d/f.txt", content="x"))
        await ok(runtime, events.FileEdit(id=2, command="create", path="e/g.txt", file_text="y"))
        ws = runtime.workspace("a")
        owner = sandbox.owner(ws)
        assert owner is not None
        for path in ("d", "d/f.txt", "e", "e/g.txt"):
            st = os.stat(ws / path)
            assert (st.st_uid, st.st_gid) == owner, path
    finally:
        await runtime.aclose()

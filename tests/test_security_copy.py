"""Attacks on a fork's ``copy`` of a workspace, which the worker makes as root.

The source workspace belongs to a sandbox that may still be running, so everything in it
may be an attacker's arrangement: symlinks to host files, a directory swapped for a symlink
to ``/`` between being listed and being opened, FIFOs that would block a reader, a tree
deeper than Python's recursion limit.  The walker (:mod:`riverbed.runtime.trees`) is
attacked directly with real files (the swaps made exactly between its steps, and in a tight
loop from another thread); then end to end, with a real runtime worker process forking a
session whose own sandbox made the FIFO and the deep tree.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from riverbed import events
from riverbed.agent.replay import fork, wait_rebuilt
from riverbed.client.session import Bus
from riverbed.runtime import trees
from tests.kit.workers import Spawn, WorkerProcess, spawn, workers  # noqa: F401  (fixtures)

pytestmark = pytest.mark.security

SECRET = "HOST-SECRET-91d2"
DEPTH = 1100


@pytest.fixture(autouse=True)
def no_deep_tree_survives(tmp_path: Path) -> Iterator[None]:
    """Empty the test's directory by fd afterwards, whatever happened: pytest's own clean-up
    of old directories (``shutil.rmtree``, recursive) would fail on a deep tree, in every
    later test run on this machine."""
    yield
    trees.empty_tree(tmp_path)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A host directory outside every workspace, shaped like the source's subdirectory ``sub``
    (so a copy that followed a swapped-in symlink would find files to take)."""
    path = tmp_path / "outside"
    (path / "deeper").mkdir(parents=True)
    (path / "secret").write_text(SECRET)
    (path / "deeper" / "secret").write_text(SECRET)
    return path


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "src"
    (path / "sub" / "deeper").mkdir(parents=True)
    (path / "sub" / "mine.txt").write_text("mine")
    (path / "top.txt").write_text("top")
    return path


def leaked(dest: Path) -> list[str]:
    """Regular files below ``dest`` (not following symlinks) that hold the secret."""
    found = []
    for top, _dirs, files in os.walk(dest):
        for name in files:
            path = Path(top) / name
            if stat.S_ISREG(path.lstat().st_mode) and SECRET in path.read_text(errors="replace"):
                found.append(str(path.relative_to(dest)))
    return found


def swap_for_link(directory: Path, target: Path) -> None:
    """Move ``directory`` aside and put a symlink to ``target`` in its place."""
    directory.rename(directory.with_name(directory.name + ".moved"))
    directory.symlink_to(target)


@contextlib.contextmanager
def before(
    monkeypatch: pytest.MonkeyPatch, step: str, when: Callable[..., bool], do: Callable[[], None]
) -> Iterator[None]:
    """Run ``do`` once, just before the walker's ``step`` is called with arguments ``when`` accepts."""
    real = getattr(trees, step)
    done = False

    def hooked(*args: Any, **kwargs: Any) -> Any:
        nonlocal done
        if not done and when(*args):
            done = True
            do()
        return real(*args, **kwargs)

    monkeypatch.setattr(trees, step, hooked)
    yield
    assert done, f"the walker never reached {step}"


def test_symlinks_in_the_source_are_copied_as_symlinks_never_followed(
    source: Path, outside: Path, tmp_path: Path
) -> None:
    (source / "to-file").symlink_to(outside / "secret")
    (source / "to-dir").symlink_to(outside)
    (source / "sub" / "relative").symlink_to("../../outside/secret")
    dest = tmp_path / "dest"
    copied = trees.copy_tree(source, dest)
    assert copied is not None
    assert os.readlink(dest / "to-file") == str(outside / "secret")
    assert os.readlink(dest / "to-dir") == str(outside)
    assert os.readlink(dest / "sub" / "relative") == "../../outside/secret"
    assert (dest / "sub" / "mine.txt").read_text() == "mine"
    assert leaked(dest) == []
    # A source that is itself a symlink is not a workspace: nothing is copied from it.
    (tmp_path / "src-link").symlink_to(outside)
    assert trees.copy_tree(tmp_path / "src-link", tmp_path / "dest-2") is None
    assert not (tmp_path / "dest-2" / "secret").exists()


def test_a_directory_swapped_for_a_symlink_after_it_was_listed_is_not_followed(
    source: Path, outside: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = tmp_path / "dest"
    with before(
        monkeypatch, "_enter", lambda parent, name, *_: name == "sub", lambda: swap_for_link(source / "sub", outside)
    ):
        copied = trees.copy_tree(source, dest)
    assert copied is not None
    assert ("sub", "changed") in copied.skipped
    assert leaked(dest) == []
    assert not (dest / "sub").exists()
    assert (dest / "top.txt").read_text() == "top"


def test_a_directory_swapped_while_its_fd_was_closed_is_not_followed_on_the_way_back(
    source: Path, outside: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deeper than the fds kept open, the walker opens an ancestor again by name; a swap in
    the meantime is noticed (not a directory any more, or another one) and not followed."""
    chain = source / "sub" / "a" / "b" / "c" / "d"
    chain.mkdir(parents=True)
    (chain / "deep.txt").write_text("deep")
    monkeypatch.setattr(trees, "OPEN_DIRS", 2)
    dest = tmp_path / "dest"
    # While the walk is down in sub/a/b/c/d, "sub" (its fd closed by then, "deeper" still to
    # copy) becomes a symlink to a host directory that also has a "deeper".
    with before(
        monkeypatch, "_enter", lambda parent, name, *_: name == "d", lambda: swap_for_link(source / "sub", outside)
    ):
        copied = trees.copy_tree(source, dest)
    assert copied is not None
    assert ("sub", "changed") in copied.skipped
    assert (dest / "sub" / "a" / "b" / "c" / "d" / "deep.txt").read_text() == "deep"
    assert leaked(dest) == []


def test_a_file_swapped_for_a_fifo_after_it_was_listed_does_not_wedge_the_copy(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def swap() -> None:
        (source / "top.txt").unlink()
        os.mkfifo(source / "top.txt")

    dest = tmp_path / "dest"
    with before(monkeypatch, "_copy_file", lambda frame, name, *_: name == "top.txt", swap):
        copied = run_bounded(trees.copy_tree, source, dest)
    assert copied is not None
    assert ("top.txt", "changed") in copied.skipped
    assert not (dest / "top.txt").exists()


def run_bounded(fn: Callable[..., Any], *args: Any, seconds: float = 30) -> Any:
    """``fn(*args)`` in a thread; fails (instead of hanging the suite) when it does not return."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn.__name__} did not return within {seconds:g}s (wedged)"
    return out[0]


def test_special_files_are_skipped_and_reported(source: Path, tmp_path: Path) -> None:
    os.mkfifo(source / "pipe")
    os.mkfifo(source / "sub" / "pipe")
    import socket  # noqa: PLC0415

    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(source / "sock"))
    try:
        copied = run_bounded(trees.copy_tree, source, tmp_path / "dest")
    finally:
        sock.close()
    assert sorted(copied.skipped) == [("pipe", "fifo"), ("sock", "socket"), ("sub/pipe", "fifo")]
    assert copied.skipped_count == 3
    assert not (tmp_path / "dest" / "pipe").exists()
    assert (tmp_path / "dest" / "sub" / "mine.txt").read_text() == "mine"


def make_deep(root: Path, depth: int) -> None:
    """``root/d/d/…/d/leaf`` ``depth`` directories deep, made by fd (no long paths)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        leaf = os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(leaf, b"at the bottom")
        os.close(leaf)
    finally:
        os.close(fd)


def test_a_tree_deeper_than_the_recursion_limit_is_copied_and_emptied(source: Path, tmp_path: Path) -> None:
    make_deep(source, DEPTH)
    dest = tmp_path / "dest"
    copied = run_bounded(trees.copy_tree, source, dest)
    assert copied.dirs == DEPTH + 2  # and sub, sub/deeper
    assert (dest / ("d/" * DEPTH + "leaf")).read_text() == "at the bottom"
    run_bounded(trees.empty_tree, dest)
    assert list(dest.iterdir()) == []


def test_a_directory_swapped_in_a_tight_loop_never_leaks_a_host_file(
    source: Path, outside: Path, tmp_path: Path
) -> None:
    """Another process (as the source's sandbox would) swaps ``sub`` for a symlink to the host
    directory and back as fast as it can, while the tree is copied again and again; the files
    of the top directory make the time between listing ``sub`` and opening it long."""
    for i in range(300):
        (source / f"f{i:03}").write_text("mine")
    swapper = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, random, sys, time\n"
            "real, aside, target = sys.argv[1:]\n"
            "while True:\n"
            "    try:\n"
            "        os.rename(real, aside); os.symlink(target, real)\n"
            "        time.sleep(random.random() / 500)\n"
            "        os.unlink(real); os.rename(aside, real)\n"
            "        time.sleep(random.random() / 500)\n"
            "    except OSError:\n"
            "        pass\n",
            str(source / "sub"),
            str(source / "sub.real"),
            str(outside),
        ]
    )
    swapped = rounds = 0
    try:
        started = time.monotonic() + 30  # (the swapper has started once the directory was swapped)
        while not (source / "sub.real").exists() and not (source / "sub").is_symlink():
            assert time.monotonic() < started, "the swapper never swapped"
            time.sleep(0.01)
        # At least 40 rounds, and on until one saw the swap (a loaded machine may run the swapper
        # seldom); a bound keeps a broken swapper from looping for ever.
        while rounds < 40 or (not swapped and rounds < 2000):
            dest = tmp_path / f"dest-{rounds}"
            copied = trees.copy_tree(source, dest)
            assert copied is not None
            assert leaked(dest) == [], f"round {rounds}"
            swapped += ("sub", "changed") in copied.skipped or ("sub.real", "changed") in copied.skipped
            trees.empty_tree(dest)
            rounds += 1
    finally:
        swapper.kill()
        swapper.wait(10)
    assert swapped, f"none of {rounds} rounds saw a directory swapped between listing and opening"


# --- end to end: a real runtime worker forks a session its own sandbox shaped ------------------


@pytest.fixture
def runtime_worker(spawn: Spawn) -> WorkerProcess:
    worker = spawn("copy-w1", ["runtime"])
    worker.wait_ready()
    return worker


@pytest.mark.anyio
async def test_a_fork_copy_skips_the_sandboxs_fifo_and_copies_its_deep_tree(
    bus: Bus, workspace: Path, runtime_worker: WorkerProcess
) -> None:
    source = bus.session("shaped", tenant="acme")
    made = await source.act(
        events.PythonRun(
            code="import os\n"
            "os.mkfifo('pipe')\n"
            "open('kept.txt', 'w').write('kept\\n')\n"
            "top = os.getcwd()\n"
            f"for _ in range({DEPTH}):\n"
            "    os.mkdir('d')\n"
            "    os.chdir('d')\n"
            "open('leaf', 'w').write('at the bottom\\n')\n"
            "os.chdir(top)\n",
            timeout=120,
        ),
        timeout=150,
    )
    assert isinstance(made, events.PythonOutput), made
    assert made.exception is None, made.exception

    forked_id = await fork(bus, "shaped", await source.last_id(), "shaped-copy", workspace="copy")
    record = await wait_rebuilt(bus, "shaped-copy", forked_id, timeout=60)
    assert record.method == "copy"
    assert record.skipped == [events.Skipped(path="pipe", reason="fifo")]
    assert "1 file was not copied" in record.note

    fork_session = bus.session("shaped-copy", tenant="acme")
    leaf = await fork_session.act(events.CmdRun(command="cat " + "d/" * DEPTH + "leaf; cat kept.txt; ls -A1"))
    assert isinstance(leaf, events.CmdOutput), leaf
    assert leaf.content.splitlines() == ["at the bottom", "kept", "d", "kept.txt"]
    # The fork's sandbox owns what was copied: it can change and remove it.
    changed = await fork_session.act(events.CmdRun(command="echo changed > kept.txt && rm -r d && ls -A"))
    assert isinstance(changed, events.CmdOutput)
    assert (changed.exit_code, changed.content.strip()) == (0, "kept.txt")

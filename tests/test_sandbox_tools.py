"""The host tools a sandbox runs, found wherever ``PATH`` has them.

A ``PATH`` whose first entry is a directory of symlinks (a ``~/bin`` farm; Nix, Homebrew and conda
look the same) named paths that do not exist inside bubblewrap's sandbox, and every command
failed.  Here a real worker runs with such a ``PATH``, and the sandbox is built on a machine
whose system directories lack the tools (:data:`riverbed.runtime.tools.SYSTEM_DIRS` emptied):
the tool found on ``PATH`` is mounted, and one that cannot run inside is named, with its path,
in the one sentence that refuses the sandbox.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from riverbed.client.session import Bus
from riverbed.runtime import Sandbox, SandboxUnavailable, tools
from riverbed.runtime.sandbox import probe
from tests.kit.workers import WorkerProcess, run_command, standalone_worker  # noqa: F401  (standalone_worker: a fixture)

#: The tools a namespaces sandbox runs, inside it or around it.
TOOLS = ("setpriv", "prlimit", "nsenter", "unshare", "mount", "setsid")

#: The one a root worker's sandbox runs inside itself (to drop to the session's user).
INSIDE = "setpriv"

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="a root worker's sandbox runs setpriv inside itself")


def symlink_farm(where: Path, targets: dict[str, str]) -> Path:
    where.mkdir(parents=True)
    for name, target in targets.items():
        (where / name).symlink_to(target)
    return where


def system(name: str) -> str:
    found = shutil.which(name, path=os.pathsep.join(tools.SYSTEM_DIRS))
    if found is None:
        pytest.skip(f"{name} (util-linux) is not installed")
    return found


@pytest.fixture
def lookups() -> Iterator[None]:
    """The tool lookups forget what they found, before and after the test (they are cached)."""
    tools.find.cache_clear()
    tools.find_inside.cache_clear()
    yield
    tools.find.cache_clear()
    tools.find_inside.cache_clear()


@pytest.mark.anyio
async def test_a_worker_with_a_symlink_farm_first_on_path_runs_commands_confined(
    standalone_bus: Bus, standalone_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    farm = symlink_farm(tmp_path / "home" / "bin", {name: system(name) for name in TOOLS})
    notes = tmp_path / "home" / "notes"
    notes.write_text("the host's\n")
    path = f"{farm}:{os.environ['PATH']}"
    worker = standalone_worker("farmed", extra_env={"PATH": path, "RIVERBED_SANDBOX": "namespaces"})
    out = await run_command(
        standalone_bus, "s1", f"id -u; test -e {notes} && echo host-visible || echo confined", timeout=20, wait=40
    )
    assert out.exit_code == 0, out.content
    uid, seen = out.content.split()[:2]
    assert seen == "confined"  # the host's directories are not there: the namespaces sandbox
    if os.geteuid() == 0:
        assert int(uid) != 0  # dropped to the session's user by setpriv, run inside
    assert worker.proc.poll() is None


@root_only
def test_a_tool_found_only_outside_the_system_directories_is_mounted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lookups: None
) -> None:
    """On a machine whose only setpriv is in a directory of its own (a Nix store, a Homebrew
    cellar), reached through a symlink on ``PATH``: the sandbox mounts the real file and runs it."""
    real = tmp_path / "opt" / "util-linux" / "bin"
    real.mkdir(parents=True)
    shutil.copy2(system(INSIDE), real / INSIDE)
    farm = symlink_farm(tmp_path / "home" / "bin", {INSIDE: str(real / INSIDE)})
    monkeypatch.setattr(tools, "SYSTEM_DIRS", ())
    monkeypatch.setenv("PATH", f"{farm}:/usr/bin:/bin")
    sandbox = Sandbox()
    assert tools.find_inside(INSIDE) == str(real / INSIDE)
    probe(sandbox, tmp_path / "ws")  # a real sandbox, dropped to its user by the mounted setpriv


@root_only
def test_a_tool_that_cannot_run_inside_is_named_with_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lookups: None
) -> None:
    """A tool whose program does not run inside the sandbox (here a script whose interpreter is
    not there; a Nix binary whose loader is in the store alike): the sentence names the tool and
    its path, and does not blame user namespaces, which work."""
    real = tmp_path / "nix" / "store" / "abc-util-linux" / "bin"
    real.mkdir(parents=True)
    (real / INSIDE).write_text('#!/nix/store/abc-bash/bin/sh\nexec "$@"\n')
    (real / INSIDE).chmod(0o755)
    farm = symlink_farm(tmp_path / "home" / "bin", {INSIDE: str(real / INSIDE)})
    monkeypatch.setattr(tools, "SYSTEM_DIRS", ())
    monkeypatch.setenv("PATH", f"{farm}:/usr/bin:/bin")  # (bwrap and the rest as usual)
    with pytest.raises(SandboxUnavailable) as refused:
        probe(Sandbox(), tmp_path / "ws")
    said = str(refused.value)
    assert f"could not run {INSIDE} at {real / INSIDE}" in said, said
    assert "No such file or directory" in said
    assert "user namespaces" not in said
    assert "RIVERBED_SANDBOX=process" not in said
    assert len(said.splitlines()) == 1

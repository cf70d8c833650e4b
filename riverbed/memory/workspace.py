"""The ``workspace_context`` recall: what an agent should know about where it works.

Repository facts come from the files under ``.git`` (HEAD, config), never from running
git or touching the network; instructions come from ``AGENTS.md`` and the workspace's
``repo`` microagents (``.openhands/microagents/repo.md`` …).

Everything here is read from a workspace a sandbox may have arranged against the memory
worker (``AGENTS.md`` as a symlink to ``/proc/self/environ``, a ``.git`` file whose
``gitdir:`` names another session's repository, a hard link to a worker file), so every
read goes through :func:`riverbed.confine.read_text`: confined to the workspace by an fd
walk, single-link regular files only, each capped in size.  Nothing above the workspace
is read either: a workspace inside a larger repository reports only itself.
"""

from __future__ import annotations

import datetime as dt
import platform
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from riverbed import confine
from riverbed.errors import PathRefused
from riverbed.memory.microagents import load_microagents, workspace_dirs

__all__ = ["GitInfo", "WorkspaceContext", "find_git", "read_git", "runtime_info", "workspace_context"]

INSTRUCTION_FILES = ("AGENTS.md",)
MAX_INSTRUCTIONS = 20_000
_SMALL_FILE = 4096  # .git pointer files, HEAD, commondir
_MAX_CONFIG = 256 * 1024


@dataclass(frozen=True)
class GitInfo:
    root: Path
    name: str
    branch: str | None
    remote: str | None


@dataclass(frozen=True)
class WorkspaceContext:
    repo_name: str | None = None
    repo_branch: str | None = None
    repo_directory: str | None = None
    repo_instructions: str | None = None
    runtime_info: dict[str, Any] = field(default_factory=dict)
    date: str | None = None
    conversation_instructions: str | None = None


def _git_dir(workspace: Path) -> str | None:
    """The git dir of a repository at the workspace's root, relative to the workspace.

    A ``.git`` directory, or a ``.git`` file (worktrees, submodules: ``gitdir: …``) whose
    target lies inside the workspace; one that points elsewhere is not followed."""
    pointer = confine.read_text(workspace, ".git", limit=_SMALL_FILE)
    if pointer is None:
        return ".git"  # a directory, or nothing: the reads under it tell
    if not pointer.startswith("gitdir:"):
        return None
    return _inside(workspace, pointer.removeprefix("gitdir:").strip())


def _inside(workspace: Path, path: str) -> str | None:
    try:
        return "/".join(confine.parts(workspace, path)) or "."
    except PathRefused:
        return None


def find_git(workspace: Path) -> tuple[Path, Path] | None:
    """``(work tree root, git dir)`` of the repository at ``workspace``'s root, if any."""
    git_dir = _git_dir(workspace)
    if git_dir is None or confine.read_text(workspace, f"{git_dir}/HEAD", limit=_SMALL_FILE) is None:
        return None
    return workspace, workspace / git_dir


def _origin_url(config: str) -> str | None:
    section = None
    for raw in config.splitlines():
        line = raw.strip()
        if line.startswith("["):
            section = line.strip("[]").replace('"', "").split()
            continue
        if section == ["remote", "origin"] and "=" in line:
            key, _, value = line.partition("=")
            if key.strip().lower() == "url":
                return value.strip()
    return None


def _name_from_url(url: str) -> str:
    """``owner/name`` for a hosted remote (https://host/owner/name.git, git@host:owner/name),
    the last path component for a local one."""
    hosted = "://" in url or ("@" in url and ":" in url)
    parts = [p for p in url.rstrip("/").removesuffix(".git").replace(":", "/").split("/") if p]
    if hosted and len(parts) >= 3:
        return "/".join(parts[-2:])
    return parts[-1] if parts else url


def read_git(workspace: Path) -> GitInfo | None:
    """Name, branch and origin of the repository at ``workspace``'s root (None without one)."""
    git_dir = _git_dir(workspace)
    if git_dir is None:
        return None
    head = confine.read_text(workspace, f"{git_dir}/HEAD", limit=_SMALL_FILE)
    if head is None:
        return None
    head = head.strip()
    branch: str | None = None
    if head.startswith("ref:"):
        branch = head.removeprefix("ref:").strip().removeprefix("refs/heads/")
    elif head:
        branch = head[:12]  # detached HEAD: the commit
    common: str | None = git_dir
    pointer = confine.read_text(workspace, f"{git_dir}/commondir", limit=_SMALL_FILE)
    if pointer is not None and pointer.strip():
        target = pointer.strip()
        common = _inside(workspace, target if target.startswith("/") else f"{git_dir}/{target}")
    config = confine.read_text(workspace, f"{common}/config", limit=_MAX_CONFIG, truncate=True) if common else None
    remote = _origin_url(config) if config is not None else None
    name = _name_from_url(remote) if remote else workspace.name
    return GitInfo(root=workspace, name=name, branch=branch, remote=remote)


def runtime_info(workspace: Path | None = None) -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
    }
    if workspace is not None:
        info["working_dir"] = str(workspace)
    return info


def _instructions(workspace: Path) -> str | None:
    parts: list[str] = []
    for name in INSTRUCTION_FILES:
        text = confine.read_text(workspace, name, limit=4 * MAX_INSTRUCTIONS, truncate=True)
        if text is not None and text.strip():
            parts.append(text.strip())
    parts.extend(a.content for a in load_microagents(workspace_dirs(workspace)) if a.type == "repo" and a.content)
    joined = "\n\n".join(dict.fromkeys(parts))
    return joined[:MAX_INSTRUCTIONS] or None


def workspace_context(
    workspace: Path | None,
    *,
    conversation_instructions: str | None = None,
    now: dt.datetime | None = None,
) -> WorkspaceContext:
    """Repository, runtime and instructions of ``workspace`` (blocking file reads; small)."""
    today = (now or dt.datetime.now(dt.UTC)).date().isoformat()
    if workspace is None or not workspace.is_dir():
        return WorkspaceContext(
            runtime_info=runtime_info(None), date=today, conversation_instructions=conversation_instructions
        )
    git = read_git(workspace)
    return WorkspaceContext(
        repo_name=git.name if git else workspace.name,
        repo_branch=git.branch if git else None,
        repo_directory=str(workspace),
        repo_instructions=_instructions(workspace),
        runtime_info=runtime_info(workspace),
        date=today,
        conversation_instructions=conversation_instructions,
    )

"""The ``workspace_context`` recall: what an agent should know about where it works.

Repository facts come from the files under ``.git`` (HEAD, config), never from running
git or touching the network; instructions come from ``AGENTS.md`` and the workspace's
``repo`` microagents (``.openhands/microagents/repo.md`` …).
"""

from __future__ import annotations

import datetime as dt
import platform
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from riverbed.memory.microagents import load_microagents, workspace_dirs

__all__ = ["GitInfo", "WorkspaceContext", "find_git", "read_git", "runtime_info", "workspace_context"]

INSTRUCTION_FILES = ("AGENTS.md",)
MAX_INSTRUCTIONS = 20_000


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


def find_git(start: Path) -> tuple[Path, Path] | None:
    """``(work tree root, git dir)`` of the repository containing ``start``, if any.

    Handles a ``.git`` directory and a ``.git`` file (worktrees, submodules: ``gitdir: …``).
    """
    for directory in (start, *start.parents):
        dot_git = directory / ".git"
        if dot_git.is_dir():
            return directory, dot_git
        if dot_git.is_file():
            try:
                line = dot_git.read_text(encoding="utf-8").strip()
            except OSError:
                return None
            if line.startswith("gitdir:"):
                target = Path(line.removeprefix("gitdir:").strip())
                return directory, target if target.is_absolute() else (directory / target).resolve()
            return None
    return None


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


def read_git(start: Path) -> GitInfo | None:
    """Name, branch and origin of the repository at or above ``start`` (None outside one)."""
    found = find_git(start)
    if found is None:
        return None
    root, git_dir = found
    branch: str | None = None
    try:
        head = (git_dir / "HEAD").read_text(encoding="utf-8").strip()
    except OSError:
        head = ""
    if head.startswith("ref:"):
        branch = head.removeprefix("ref:").strip().removeprefix("refs/heads/")
    elif head:
        branch = head[:12]  # detached HEAD: the commit
    common = git_dir
    try:
        pointer = (git_dir / "commondir").read_text(encoding="utf-8").strip()
        common = (git_dir / pointer).resolve()
    except OSError:
        pass
    try:
        remote = _origin_url((common / "config").read_text(encoding="utf-8"))
    except OSError:
        remote = None
    name = _name_from_url(remote) if remote else root.name
    return GitInfo(root=root, name=name, branch=branch, remote=remote)


def runtime_info(workspace: Path | None = None) -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
    }
    if workspace is not None:
        info["working_dir"] = str(workspace)
    return info


def _instructions(workspace: Path, repo_root: Path | None) -> str | None:
    parts: list[str] = []
    roots = [workspace] + ([repo_root] if repo_root is not None and repo_root != workspace else [])
    for root in roots:
        for name in INSTRUCTION_FILES:
            path = root / name
            try:
                text = path.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError):
                continue
            if text:
                parts.append(text)
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
        repo_directory=str(git.root if git else workspace),
        repo_instructions=_instructions(workspace, git.root if git else None),
        runtime_info=runtime_info(workspace),
        date=today,
        conversation_instructions=conversation_instructions,
    )

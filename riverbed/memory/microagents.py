"""Microagents: markdown files of instructions and knowledge, in the OpenHands format.

A file is markdown with optional YAML front matter::

    ---
    name: docker
    type: knowledge          # knowledge (keyword-triggered) or repo (always on)
    triggers: [docker, container]
    ---
    How to use docker in this sandbox ...

``knowledge`` microagents answer a ``knowledge`` recall when one of their triggers
occurs in the query (case-insensitive, as a whole word or phrase).  ``repo``
microagents (and a ``repo.md`` without front matter) are repository instructions,
returned by ``workspace_context``.  Directories are searched in order (global, user,
workspace); a later file with the same name replaces an earlier one.  A file that cannot
be read or parsed is skipped with a warning; it never fails a recall.

A workspace's own microagents (:func:`workspace_dirs`) are written by its sandbox, which
may be hostile: they are listed and read through :mod:`riverbed.confine`, so a symlinked
directory or file that leads out of the workspace (to ``/proc/self/environ``, another
session) and a hard-linked file give nothing.  The global and user directories are the
operator's and are read as plain paths.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import yaml

from riverbed import confine
from riverbed.events import Knowledge

__all__ = [
    "WORKSPACE_DIRS",
    "Microagent",
    "WorkspaceDir",
    "load_microagents",
    "match_knowledge",
    "parse_microagent",
    "split_front_matter",
    "workspace_dirs",
]

log = structlog.get_logger("riverbed.memory.microagents")

#: Where a workspace keeps its microagents (relative to the workspace root).
WORKSPACE_DIRS = (Path(".openhands/microagents"), Path(".riverbed/microagents"))
MAX_FILE_BYTES = 256 * 1024
#: At most this many files are looked at in one workspace directory.
MAX_WORKSPACE_FILES = 1000
TYPES = ("knowledge", "repo", "task")


@dataclass(frozen=True)
class Microagent:
    name: str
    type: str
    triggers: tuple[str, ...]
    content: str
    path: Path


def split_front_matter(text: str) -> tuple[str | None, str]:
    """``(front matter, body)``; the front matter is None when the text has none."""
    if not text.startswith("---"):
        return None, text
    lines = text.splitlines(keepends=True)
    if lines[0].strip() != "---":
        return None, text
    for index in range(1, len(lines)):
        if lines[index].strip() in ("---", "..."):
            return "".join(lines[1:index]), "".join(lines[index + 1 :])
    raise ValueError("the front matter starting with '---' is never closed")


def parse_microagent(text: str, path: Path) -> Microagent:
    """Parse one file; raises ValueError when it is not a usable microagent."""
    front, body = split_front_matter(text)
    content = body.strip()
    if front is None:
        if path.name == "repo.md":
            return Microagent(name="repo", type="repo", triggers=(), content=content, path=path)
        raise ValueError("no YAML front matter (name, type, triggers)")
    try:
        meta = yaml.safe_load(front) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"bad YAML front matter: {exc}") from exc
    if not isinstance(meta, dict):
        raise ValueError("the front matter is not a mapping")  # noqa: TRY004  (callers catch ValueError for any bad file)
    name = meta.get("name") or path.stem
    triggers = meta.get("triggers") or []
    if isinstance(triggers, str):
        triggers = [triggers]
    if not isinstance(triggers, list) or not all(isinstance(t, str | int | float) for t in triggers):
        raise ValueError("'triggers' must be a list of words")
    kind = meta.get("type") or ("knowledge" if triggers else "repo")
    if kind not in TYPES:
        raise ValueError(f"unknown type {kind!r} (use one of {', '.join(TYPES)})")
    clean = tuple(dict.fromkeys(str(t).strip() for t in triggers if str(t).strip()))
    if kind == "knowledge" and not clean:
        raise ValueError("a knowledge microagent needs at least one trigger")
    return Microagent(name=str(name), type=str(kind), triggers=clean, content=content, path=path)


@dataclass(frozen=True)
class WorkspaceDir:
    """A microagent directory inside a workspace (``rel`` below ``workspace``): read
    confined to the workspace, unlike the operator's directories given as paths."""

    workspace: Path
    rel: str


def workspace_dirs(workspace: Path | None) -> list[WorkspaceDir]:
    if workspace is None:
        return []
    return [WorkspaceDir(workspace, str(d)) for d in WORKSPACE_DIRS]


def load_microagents(dirs: Iterable[Path | WorkspaceDir | None]) -> list[Microagent]:
    """Every microagent under ``dirs`` (recursively, ``*.md`` except README.md), later dirs winning."""
    by_name: dict[str, Microagent] = {}
    for directory in dirs:
        if directory is None:
            continue
        found = _workspace_files(directory) if isinstance(directory, WorkspaceDir) else _files(directory)
        for path, read in found:
            try:
                agent = parse_microagent(read(), path)
            except (OSError, UnicodeDecodeError, ValueError) as exc:
                log.warning("microagent_skipped", path=str(path), reason=str(exc))
                continue
            by_name[agent.name] = agent
    return list(by_name.values())


def _wanted(name: str) -> bool:
    return name.endswith(".md") and name.lower() != "readme.md"


def _files(directory: Path) -> list[tuple[Path, Callable[[], str]]]:
    if not directory.is_dir():
        return []
    return [
        (p, functools.partial(_load_file, p))
        for p in sorted(directory.rglob("*.md"))
        if _wanted(p.name) and p.is_file()
    ]


def _workspace_files(directory: WorkspaceDir) -> list[tuple[Path, Callable[[], str]]]:
    rels = confine.list_files(directory.workspace, directory.rel, limit=MAX_WORKSPACE_FILES)
    return [
        (directory.workspace / rel, functools.partial(_load_confined, directory.workspace, rel))
        for rel in rels
        if _wanted(rel.rsplit("/", 1)[-1])
    ]


def _load_file(path: Path) -> str:
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
    return path.read_text(encoding="utf-8")


def _load_confined(workspace: Path, rel: str) -> str:
    text = confine.read_text(workspace, rel, limit=MAX_FILE_BYTES)
    if text is None:
        raise ValueError(
            f"not read: larger than {MAX_FILE_BYTES} bytes, not UTF-8, or not a single-link regular file "
            "inside the workspace"
        )
    return text


def _trigger_pattern(trigger: str) -> re.Pattern[str]:
    return re.compile(r"(?<!\w)" + re.escape(trigger.lower()) + r"(?!\w)")


def match_knowledge(agents: Sequence[Microagent], query: str) -> list[Knowledge]:
    """Knowledge microagents with a trigger in ``query``; each at most once, first trigger wins."""
    text = query.lower()
    found: list[Knowledge] = []
    for agent in agents:
        if agent.type != "knowledge":
            continue
        for trigger in agent.triggers:
            if _trigger_pattern(trigger).search(text):
                found.append(Knowledge(name=agent.name, trigger=trigger, content=agent.content))
                break
    return found

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
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import yaml

from riverbed.events import Knowledge

__all__ = [
    "WORKSPACE_DIRS",
    "Microagent",
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


def workspace_dirs(workspace: Path | None) -> list[Path]:
    if workspace is None:
        return []
    return [workspace / d for d in WORKSPACE_DIRS]


def load_microagents(dirs: Iterable[Path | None]) -> list[Microagent]:
    """Every microagent under ``dirs`` (recursively, ``*.md`` except README.md), later dirs winning."""
    by_name: dict[str, Microagent] = {}
    for directory in dirs:
        if directory is None or not directory.is_dir():
            continue
        for path in sorted(directory.rglob("*.md")):
            if path.name.lower() == "readme.md" or not path.is_file():
                continue
            try:
                agent = _load_file(path)
            except (OSError, UnicodeDecodeError, ValueError) as exc:
                log.warning("microagent_skipped", path=str(path), reason=str(exc))
                continue
            by_name[agent.name] = agent
    return list(by_name.values())


def _load_file(path: Path) -> Microagent:
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
    return parse_microagent(path.read_text(encoding="utf-8"), path)


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

"""Workspaces and path confinement.

Each session has one directory below the runtime's root.  Session ids are arbitrary
strings, so the directory name is a readable slug of the id (letters, digits, ``.``, ``_``,
``-``; at most 48 characters) followed by 16 hex digits of the id's SHA-256: deterministic,
safe on any filesystem, and two ids never share a directory in practice.

A workspace belongs to one log: the log's creation stamp (``created`` in its meta, set by the
append that made it) is kept beside it (:func:`stamp_file`, outside every sandbox), and a log
made again under the same id (after a Redis wipe, or a delete) never sees the files of the
old one: the runtime puts the old workspace away when it opens the new log, and the memory
role reads no workspace whose stamp is another log's (:func:`belongs_to`).

Every path an action names is confined to its session's workspace: relative paths resolve
from the workspace; absolute paths must lie inside it; ``..`` and symlinks are resolved
first, so neither can lead out.  NUL bytes, over-long names and non-paths are refused.

The file actions do not use :func:`confine`: they open what they touch with the fd walk of
:mod:`riverbed.confine`, which no swap between check and use can lead out.  :func:`confine`
is a path check made when the action runs, for what needs a path rather than an open file
(a command's ``cwd``, which then exists only inside the session's own sandbox, and custom
handlers); a sandbox process that swaps a directory for a symlink at the same instant is
outside what a path check can stop.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path

from riverbed.confine import check_raw
from riverbed.errors import PathRefused

__all__ = ["PathRefused", "belongs_to", "confine", "display", "stamp_file", "stamp_of", "workspace_name"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def workspace_name(session_id: str) -> str:
    """The directory name of a session's workspace (pure, deterministic)."""
    digest = hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    slug = _UNSAFE.sub("_", session_id).strip("._-")[:48] or "session"
    return f"{slug}-{digest}"


def stamp_file(workspace: Path) -> Path:
    """Where the creation stamp of the log a workspace belongs to is kept (beside the
    workspaces, in a directory no sandbox sees)."""
    return workspace.parent / ".logs" / workspace.name


def stamp_of(workspace: Path) -> str | None:
    """The creation stamp of the log ``workspace`` belongs to (None: none recorded)."""
    try:
        return stamp_file(workspace).read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        return None


def belongs_to(workspace: Path, created: str) -> bool:
    """Whether ``workspace`` may be shown to the log created at ``created``: its stamp is that
    log's, or it has none (made before stamps were kept, or the log's stamp is unknown)."""
    stamp = stamp_of(workspace)
    return stamp is None or not created or stamp == created


@functools.lru_cache(maxsize=4096)
def _real_root(workspace: str) -> str:
    """The real path of a workspace root.  Cached: if the root is later swapped for a symlink,
    paths resolve outside the cached root and are refused, never let through."""
    return os.path.realpath(workspace)


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def confine(workspace: Path, raw: str) -> Path:
    """The real path that ``raw`` names inside ``workspace``, or :class:`PathRefused`."""
    check_raw(raw)
    root = _real_root(str(workspace))
    joined = raw if os.path.isabs(raw) else os.path.join(root, raw)
    if not _within(os.path.normpath(joined), root) and not _within(os.path.normpath(joined), str(workspace)):
        raise PathRefused("path_outside_workspace", f"{raw!r} is outside the workspace")
    try:
        real = os.path.realpath(joined)
    except (OSError, ValueError) as exc:
        raise PathRefused("bad_path", f"{raw!r} cannot be resolved: {exc}") from exc
    if not _within(real, root):
        raise PathRefused("path_outside_workspace", f"{raw!r} leads outside the workspace (through a symlink or '..')")
    return Path(real)


def display(workspace: Path, path: Path) -> str:
    """``path`` relative to the workspace, as shown to agents."""
    rel = os.path.relpath(path, _real_root(str(workspace)))
    return "." if rel == "." else rel

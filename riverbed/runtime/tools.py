"""Where the host tools the sandbox runs are found (util-linux's ``setpriv``, ``prlimit``,
``nsenter``, ``unshare``, ``mount``, ``setsid``; ``slirp4netns``).

``shutil.which`` answers with the first one on ``PATH``, as ``PATH`` spells it.  A ``PATH`` entry
outside the system directories (a ``~/bin`` of symlinks, a Nix profile, Homebrew, a conda
environment) gives a path that does not exist inside bubblewrap's sandbox, which has only the
host's ``/usr`` (and the ``/bin``, ``/sbin``, ``/lib*`` links): a tool that runs in there (``setpriv``,
``prlimit``) would be missing.  So :func:`find_inside` looks for those in the system directories
first, and only then on ``PATH``, symlinks resolved: the real file, which :func:`mounts` then names
for the sandbox to mount read-only at its own path.  A tool that runs on the host (``bwrap``,
``nsenter``, ``unshare``, ``slirp4netns``) is the first on ``PATH``, as the user set it, its
symlinks resolved too (:func:`find`).
"""

from __future__ import annotations

import functools
import os
import shutil

__all__ = ["SYSTEM_DIRS", "find", "find_inside", "mounts", "seen_inside"]

SYSTEM_DIRS = ("/usr/bin", "/usr/sbin", "/bin", "/sbin")
"""Where a tool that runs inside a sandbox is looked for first: a sandbox sees them at the same paths."""

_INSIDE = ("/usr/", "/bin/", "/sbin/")


@functools.cache
def find(name: str) -> str | None:
    """The tool ``name`` that runs on the host: the first on ``PATH``, its symlinks resolved (so
    the path names the file itself); None when there is none."""
    found = shutil.which(name)
    return None if found is None else os.path.realpath(found)


@functools.cache
def find_inside(name: str) -> str | None:
    """The tool ``name`` that runs inside a sandbox: in :data:`SYSTEM_DIRS` first, else
    :func:`find`'s (which :func:`mounts` then mounts)."""
    for directory in SYSTEM_DIRS:
        found = shutil.which(name, path=directory)
        if found is not None:
            return os.path.realpath(found)
    return find(name)


def seen_inside(path: str) -> bool:
    """Whether a sandbox sees the host's file ``path`` at the same path without a mount of its own."""
    return path.startswith(_INSIDE)


def mounts(*paths: str | None) -> list[tuple[str, str]]:
    """The ``(host path, path inside)`` read-only mounts that let a sandbox run the tools at
    ``paths`` (those a sandbox does not see already)."""
    return [(path, path) for path in dict.fromkeys(paths) if path is not None and not seen_inside(path)]

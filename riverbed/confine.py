"""Opening files below a directory without following anything out of it.

A workspace belongs to a sandbox that runs commands written by a model, so everything in it
may have been arranged by an attacker: a symlink to ``/etc/passwd`` or to another session's
workspace, a hard link to a file of the worker, a directory swapped for a symlink while the
worker is between checking a path and using it.  A path check (``realpath``, then
``open``) loses that race.  Here a path is resolved one component at a time from a file
descriptor of the root, each directory opened with ``O_NOFOLLOW | O_DIRECTORY`` relative to
the one before, and the caller opens the last component with ``O_NOFOLLOW`` relative to
the directory the walk ends in.  What was checked is what gets used: a swap after a
component was opened changes nothing, and a swap before makes the open fail.

- ``..`` in the path is resolved lexically before anything is opened; a path that climbs
  above the root, or an absolute path outside it, is refused (``path_outside_workspace``).
- A symlink met on the way is read (``readlink`` relative to its directory's fd) and its
  target is walked by the same rules: an absolute target must lie inside the root and is
  walked from the root's fd, a relative one from the directory that holds the link, and
  its ``..`` steps back along the directories already opened, never above the root.  So a
  symlink that stays inside the workspace works as on any filesystem, one that leads out
  is refused.  More than :data:`MAX_SYMLINKS` links in one path is a loop (``symlink_loop``).
- The root itself is opened with ``O_NOFOLLOW`` from its parent, so a workspace swapped
  for a symlink is refused too.  The parent is the operator's directory and is trusted.
- Hard links cannot be seen in a path: :func:`open_file` refuses a regular file with more
  than one link (``hard_link_refused``) when asked to, since the other name may be outside.

:func:`open_direct` is the walk's common case in a few system calls (a path with no symlink
on it, every part of it there): the same opens, each with ``O_NOFOLLOW`` from the one
before, without looking at each name first.  Anything else makes it give up with nothing
refused, and the caller walks.

:func:`read_text` is the best-effort reader for context the memory role gathers
(``AGENTS.md``, microagents, git metadata): it never raises, caps the size, and gives
``None`` for anything that is not a single-link regular file inside the root.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import dataclasses
import errno
import functools
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from riverbed.errors import PathRefused

__all__ = [
    "MAX_SYMLINKS",
    "Place",
    "check_raw",
    "list_files",
    "open_direct",
    "open_file",
    "parts",
    "read_fd",
    "read_text",
    "walk",
]

#: Links followed in one path before it counts as a loop (Linux's own limit).
MAX_SYMLINKS = 40
_NAME_MAX = 255
_PATH_MAX = 4096
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a walk ended: ``name`` inside the directory open as ``dir_fd``.

    ``name`` is ``"."`` when the path is the root itself.  ``rel`` is the path relative to
    the root with every symlink resolved, as shown to agents (``"."`` for the root).  The
    fd belongs to the walk and is closed when its ``with`` block ends.
    """

    dir_fd: int
    name: str
    rel: str


@functools.lru_cache(maxsize=4096)
def _real_root(root: str) -> str:
    """The root's real path, for absolute paths spelled through the root's own symlinks
    (``/tmp`` -> ``/private/tmp``).  Only used to strip a prefix; nothing is opened by it."""
    return os.path.realpath(root)


def check_raw(raw: object) -> str:
    """``raw`` when it can name a path at all (a non-empty UTF-8 string, no NUL, within the
    length limits), else :class:`PathRefused` with reason ``bad_path``."""
    if not isinstance(raw, str) or raw == "":
        raise PathRefused("bad_path", "the path is empty")
    if "\x00" in raw:
        raise PathRefused("bad_path", "the path contains a NUL byte")
    try:
        encoded = raw.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PathRefused("bad_path", "the path is not valid UTF-8") from exc
    if len(encoded) > _PATH_MAX:
        raise PathRefused("bad_path", f"the path is {len(encoded)} bytes long; the limit is {_PATH_MAX}")
    if any(len(part.encode("utf-8")) > _NAME_MAX for part in raw.split("/")):
        raise PathRefused("bad_path", f"a path component is longer than {_NAME_MAX} bytes")
    return raw


def parts(root: Path, raw: str) -> list[str]:
    """The components of ``raw`` relative to ``root``, ``..`` resolved lexically (pure but
    for the root's real path); :class:`PathRefused` when it is not a usable path or lies
    outside the root."""
    check_raw(raw)
    if raw.startswith("/"):
        norm = os.path.normpath(raw)
        for base in dict.fromkeys((os.path.normpath(os.path.abspath(root)), _real_root(os.path.abspath(root)))):
            if norm == base or norm.startswith(base.rstrip("/") + "/"):
                raw = norm[len(base) :]
                break
        else:
            raise PathRefused("path_outside_workspace", f"{raw!r} is outside the workspace")
    out: list[str] = []
    for part in raw.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not out:
                raise PathRefused("path_outside_workspace", f"{raw!r} climbs out of the workspace with '..'")
            out.pop()
        else:
            out.append(part)
    return out


def _open_root(root: Path) -> int:
    """An fd of ``root``, itself not a symlink (its parent may be one: the operator's)."""
    head, name = os.path.split(os.path.abspath(root))  # (strings: pathlib costs more than the opens)
    parent = os.open(head, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if name == "":
            return os.dup(parent)
        return _open_dir(name, parent, shown="the workspace")
    finally:
        os.close(parent)


def _open_dir(name: str, dir_fd: int, *, shown: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise PathRefused("not_found", f"{shown} does not exist") from None
    except (NotADirectoryError, OSError) as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        if _is_link(name, dir_fd):
            raise PathRefused("symlink_refused", f"{shown} is a symlink") from None
        raise PathRefused("not_a_directory", f"{shown} is not a directory") from None


def _lstat(name: str, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _is_link(name: str, dir_fd: int) -> bool:
    st = _lstat(name, dir_fd)
    return st is not None and stat.S_ISLNK(st.st_mode)


@contextlib.contextmanager
def walk(root: Path, raw: str, *, make_parents: bool = False, owner: tuple[int, int] | None = None) -> Iterator[Place]:
    """Resolve ``raw`` below ``root`` by an fd walk (see the module docstring).

    The last component may not exist; a missing directory on the way is created when
    ``make_parents`` is set (and given to ``owner``, a ``(uid, gid)``, when one is named, so
    a sandbox running as another user owns what it asked for), else refused (``not_found``).
    """
    queue = collections.deque(parts(root, raw))
    fds = [_open_root(root)]
    names: list[str] = []
    links = 0
    try:
        while True:
            if not queue:
                # The path ends at a directory already opened (the root, or one a '..' or a
                # link's target led back to): hand it over as a name in its parent.
                if not names:
                    yield Place(fds[0], ".", ".")
                    return
                name = names.pop()
                os.close(fds.pop())
                yield Place(fds[-1], name, "/".join([*names, name]))
                return
            part = queue.popleft()
            if part == "..":
                if not names:
                    raise PathRefused("path_outside_workspace", f"{raw!r} leads out of the workspace through a symlink")
                names.pop()
                os.close(fds.pop())
                continue
            shown = "/".join([*names, part])
            st = _lstat(part, fds[-1])
            if st is not None and stat.S_ISLNK(st.st_mode):
                links += 1
                if links > MAX_SYMLINKS:
                    raise PathRefused("symlink_loop", f"{raw!r} goes through more than {MAX_SYMLINKS} symlinks")
                try:
                    target = os.readlink(part, dir_fd=fds[-1])
                except OSError:
                    queue.appendleft(part)  # it changed since the lstat: look again
                    continue
                if target.startswith("/"):
                    try:
                        steps = parts(root, target)
                    except PathRefused as exc:
                        raise PathRefused(
                            "path_outside_workspace", f"{raw!r} leads out of the workspace through the symlink {shown}"
                        ) from exc
                    while len(fds) > 1:
                        os.close(fds.pop())
                    names.clear()
                else:
                    steps = [p for p in target.split("/") if p not in ("", ".")]
                queue.extendleft(reversed(steps))
                continue
            if not queue:
                yield Place(fds[-1], part, shown)
                return
            if st is None and make_parents:
                _make_dir(part, fds[-1], owner)
            fd = _open_dir(part, fds[-1], shown=shown)
            fds.append(fd)
            names.append(part)
    finally:
        for fd in fds:
            os.close(fd)


def open_direct(root: Path, raw: str) -> tuple[int, os.stat_result, str] | None:
    """:func:`walk` and :func:`open_file` (read-only, single link) in one go where nothing needs
    looking at: ``(fd, stat, rel)``, the caller closes.  None, with nothing open, for anything
    the walk handles itself, refusals included: a symlink on the way (``O_NOFOLLOW`` makes its
    open fail), a missing part, a file with other links, the root itself, an error."""
    names = parts(root, raw)
    if not names:
        return None
    try:
        # The root opened by its full path: its parents are the operator's, and only the root
        # itself must not be a symlink.
        dir_fd = os.open(os.path.abspath(root), _DIR_FLAGS)
    except OSError:
        return None
    try:
        for name in names[:-1]:
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            except OSError:
                return None
            os.close(dir_fd)
            dir_fd = fd
        try:
            fd = os.open(names[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            return None
    finally:
        os.close(dir_fd)
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        os.close(fd)
        return None
    return fd, st, "/".join(names)


def _make_dir(name: str, dir_fd: int, owner: tuple[int, int] | None) -> None:
    try:
        os.mkdir(name, 0o777, dir_fd=dir_fd)
    except FileExistsError:
        return  # made meanwhile: the open that follows checks what it is
    if owner is not None:
        fd = _open_dir(name, dir_fd, shown=name)
        try:
            os.fchown(fd, *owner)
        finally:
            os.close(fd)


def open_file(place: Place, flags: int = os.O_RDONLY, *, single_link: bool = True) -> tuple[int, os.stat_result]:
    """Open the last component of a walk and ``fstat`` it: ``(fd, stat)``; the caller closes.

    ``O_NOFOLLOW`` refuses a symlink put there since the walk (``symlink_refused``);
    ``O_NONBLOCK`` keeps a FIFO from stalling the worker (the caller looks at the stat
    before reading).  With ``single_link``, a regular file with other names is refused
    (``hard_link_refused``): one of them may be outside the workspace, and the check is on
    the open file, so a link made after it cannot redirect the fd.
    """
    try:
        fd = os.open(place.name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=place.dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PathRefused("symlink_refused", f"{place.rel} was replaced by a symlink while it was opened") from exc
        raise
    st = os.fstat(fd)
    if single_link and stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        os.close(fd)
        raise PathRefused(
            "hard_link_refused",
            f"{place.rel} has {st.st_nlink} hard links; one may be a file outside the workspace, so file "
            "actions do not read or write it (cmd_run can, inside the sandbox)",
        )
    return fd, st


def read_fd(fd: int, limit: int, size: int) -> bytes:
    """Up to ``limit + 1`` bytes of an open regular file (one more than allowed tells it was
    longer); ``size`` is its size as ``fstat`` saw it.  A read shorter than asked for is the end
    of the file: no read more to hear so.

    The first read asks for one byte more than ``size``, so a file that did not change is read
    in one call, and a small file costs no large buffer (``os.read`` allocates all it asks for:
    a megabyte for a 200-byte file took ~15 µs more); a file that grew since is read on in
    chunks of up to a megabyte."""
    chunks: list[bytes] = []
    left = limit + 1
    want = min(left, max(size, 0) + 1)
    while left > 0:
        chunk = os.read(fd, want)
        chunks.append(chunk)
        left -= len(chunk)
        if len(chunk) < want:
            break
        want = min(left, 1 << 20)
    return b"".join(chunks)


def read_text(root: Path, raw: str, *, limit: int, truncate: bool = False) -> str | None:
    """The UTF-8 text of ``raw`` below ``root``, or ``None``; never raises.

    ``None`` for anything but a single-link regular file reached inside the root, for text
    that is not UTF-8, and for a file over ``limit`` bytes unless ``truncate`` asks for its
    first ``limit`` bytes (a character cut at the end is dropped).
    """
    try:
        with walk(root, raw) as place:
            fd, st = open_file(place)
            try:
                if not stat.S_ISREG(st.st_mode):
                    return None
                data = read_fd(fd, limit, st.st_size)
            finally:
                os.close(fd)
        if len(data) <= limit:
            return data.decode("utf-8")
        if not truncate:
            return None
        return codecs.getincrementaldecoder("utf-8")().decode(data[:limit], final=False)
    except (PathRefused, OSError, UnicodeDecodeError):
        return None


def list_files(root: Path, raw: str, *, limit: int = 1000, depth: int = 8) -> list[str]:
    """Paths (relative to ``root``, sorted, at most ``limit``) of the non-directories below
    the directory ``raw``, found without following a symlinked directory; ``[]`` when it is
    missing, not a directory or not inside the root.  Symlinks to files are listed: reading
    one goes through :func:`read_text`, which follows it only inside the root."""
    out: list[str] = []

    def visit(fd: int, rel: str, level: int) -> None:
        with os.scandir(fd) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            if len(out) >= limit:
                return
            path = f"{rel}/{entry.name}" if rel != "." else entry.name
            if not entry.is_dir(follow_symlinks=False):
                out.append(path)
            elif level < depth:
                try:
                    sub = _open_dir(entry.name, fd, shown=path)
                except (PathRefused, OSError):
                    continue
                try:
                    visit(sub, path, level + 1)
                finally:
                    os.close(sub)

    try:
        with walk(root, raw) as place:
            fd = _open_dir(place.name, place.dir_fd, shown=place.rel)
            try:
                visit(fd, place.rel, 0)
            finally:
                os.close(fd)
    except (PathRefused, OSError):
        return out
    return out

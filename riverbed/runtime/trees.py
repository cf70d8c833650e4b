"""Copying and emptying workspace trees by file descriptor (a fork's ``copy`` and rebuild).

The source belongs to a sandbox that may still be running commands written by a model, so
its tree may change under the copy at any moment: a directory swapped for a symlink to
``/`` between being listed and being opened, a file swapped for a FIFO that would block a
reader for ever.  The worker copying it runs as root, so a copy that follows paths could
read any host file (another tenant's workspace, the Redis AOF) into the fork.

So nothing is opened by path.  The source root is opened with ``O_NOFOLLOW`` from its
parent (the operator's directory), and every directory and file below it with
``O_NOFOLLOW`` relative to the fd of the directory that lists it: a name that is a symlink
by the time it is opened fails to open, whatever it was when listed.  Symlinks are copied as
symlinks (their target text, never followed).  A file is opened with ``O_NONBLOCK`` and
copied only if ``fstat`` of the open fd says it is a regular file, and only up to the size
that ``fstat`` gave (a file that grows while it is read cannot make the copy endless).
FIFOs, sockets and devices are never opened: they are skipped and reported, like anything
that changed kind while it was copied.

The walk is iterative (a stack, no recursion), so a tree thousands of directories deep
copies like a flat one.  Only the deepest :data:`OPEN_DIRS` directories keep their fds
open; one above them that still has subdirectories to copy is opened again by name from
its parent's fd, with ``O_NOFOLLOW``, and used only if it is still the same directory
(device and inode), else its rest is skipped as ``changed``.

What is created belongs to ``owner`` (the fork's sandbox user) when one is given.  Files
keep their permission bits (no set-uid, set-gid or sticky bit) and times; directories keep
their permission bits with the owner's ``rwx`` added, so the copy can fill them.

:func:`empty_tree` removes everything below a directory the same way (never following a
symlink, never recursing): a directory deeper than :data:`OPEN_DIRS` is first moved up to
the top under a fresh name, so the fds it holds stay bounded however deep the tree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import os
import stat
from pathlib import Path

__all__ = ["OPEN_DIRS", "Copied", "copy_tree", "empty_tree"]

OPEN_DIRS = 32
"""How many directories of the walk keep their source and destination fds open at once."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20
_SPECIAL = {stat.S_IFIFO: "fifo", stat.S_IFSOCK: "socket", stat.S_IFCHR: "device", stat.S_IFBLK: "device"}


@dataclasses.dataclass
class Copied:
    """What a copy did: files (regular files and symlinks) and directories copied, and what it
    skipped as (path relative to the root, reason), the first ``keep`` of them listed."""

    files: int = 0
    dirs: int = 0
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    skipped_count: int = 0
    keep: int = 100

    def skip(self, rel: str, reason: str) -> None:
        self.skipped_count += 1
        if len(self.skipped) < self.keep:
            self.skipped.append((rel, reason))


@dataclasses.dataclass
class _Dir:
    """A directory of the walk: its name in its parent, its path from the root, its source's
    identity, the subdirectories still to copy, and its fds (-1: closed for now)."""

    name: str
    rel: str
    ident: tuple[int, int]
    pending: list[str]
    src: int = -1
    dst: int = -1

    def close(self) -> None:
        for fd in (self.src, self.dst):
            if fd >= 0:
                os.close(fd)
        self.src = self.dst = -1


def _join(rel: str, name: str) -> str:
    return name if rel == "" else f"{rel}/{name}"


def _open_top(path: Path) -> int:
    """An fd of the directory ``path``, itself not a symlink (its parent is the operator's)."""
    head, name = os.path.split(os.path.abspath(path))
    parent = os.open(head or "/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return os.open(name or ".", _DIR_FLAGS, dir_fd=parent)
    finally:
        os.close(parent)


def copy_tree(source: Path, dest: Path, *, owner: tuple[int, int] | None = None, keep: int = 100) -> Copied | None:
    """Copy everything below the directory ``source`` into ``dest`` (made if missing; what
    it holds already stays) without following any symlink; None when ``source`` is not a
    directory (or is a symlink).  See the module docstring."""
    try:
        src_root = _open_top(source)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        raise
    try:
        dest.mkdir(parents=True, exist_ok=True)
        dst_root = _open_top(dest)
    except BaseException:
        os.close(src_root)
        raise
    done = Copied(keep=keep)
    st = os.fstat(src_root)
    root = _Dir("", "", (st.st_dev, st.st_ino), [], src_root, dst_root)
    stack = [root]
    try:
        if owner is not None:
            os.fchown(dst_root, *owner)
        _list(root, done, owner)
        while stack:
            top = stack[-1]
            if not top.pending:
                stack.pop().close()
                continue
            name = top.pending.pop()
            if not _reopen(stack, done):
                continue
            child = _enter(top, name, done, owner)
            if child is not None:
                stack.append(child)
                _list(child, done, owner)
                _trim(stack)
    finally:
        for frame in stack:
            frame.close()
    return done


def _enter(parent: _Dir, name: str, done: Copied, owner: tuple[int, int] | None) -> _Dir | None:
    """Open the subdirectory ``name`` of ``parent`` in the source and make it in the copy;
    None (skipped as ``changed``, or gone) when it is no longer a directory."""
    rel = _join(parent.rel, name)
    try:
        src = os.open(name, _DIR_FLAGS, dir_fd=parent.src)
    except FileNotFoundError:
        return None  # removed since it was listed: nothing to copy
    except OSError as exc:
        done.skip(rel, "changed" if exc.errno in (errno.ELOOP, errno.ENOTDIR) else "unreadable")
        return None
    try:
        st = os.fstat(src)
        with contextlib.suppress(FileExistsError):  # (what the destination held: opened only if a directory)
            os.mkdir(name, 0o700, dir_fd=parent.dst)
        dst = os.open(name, _DIR_FLAGS, dir_fd=parent.dst)
    except OSError:
        os.close(src)
        done.skip(rel, "unreadable")
        return None
    try:
        if owner is not None:
            os.fchown(dst, *owner)
        os.fchmod(dst, stat.S_IMODE(st.st_mode) & 0o777 | 0o700)
    except OSError:
        os.close(src)
        os.close(dst)
        raise
    done.dirs += 1
    return _Dir(name, rel, (st.st_dev, st.st_ino), [], src, dst)


def _list(frame: _Dir, done: Copied, owner: tuple[int, int] | None) -> None:
    """Copy the files and symlinks of ``frame``, skip its special files, and note its
    subdirectories for the walk."""
    try:
        entries = os.scandir(frame.src)
    except OSError:
        done.skip(frame.rel or ".", "unreadable")
        return
    with entries:
        for entry in entries:
            rel = _join(frame.rel, entry.name)
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(mode):
                frame.pending.append(entry.name)
            elif stat.S_ISLNK(mode):
                _copy_link(frame, entry.name, rel, done, owner)
            elif stat.S_ISREG(mode):
                _copy_file(frame, entry.name, rel, done, owner)
            else:
                done.skip(rel, _SPECIAL.get(stat.S_IFMT(mode), "special"))
    frame.pending.sort(reverse=True)  # popped from the end: copied in name order


def _copy_link(frame: _Dir, name: str, rel: str, done: Copied, owner: tuple[int, int] | None) -> None:
    try:
        target = os.readlink(name, dir_fd=frame.src)
    except FileNotFoundError:
        return
    except OSError:
        done.skip(rel, "changed")  # no longer a symlink
        return
    try:
        os.symlink(target, name, dir_fd=frame.dst)
    except FileExistsError:
        _remove(name, frame.dst)  # (what the destination held)
        os.symlink(target, name, dir_fd=frame.dst)
    if owner is not None:
        os.chown(name, *owner, dir_fd=frame.dst, follow_symlinks=False)
    done.files += 1


def _copy_file(frame: _Dir, name: str, rel: str, done: Copied, owner: tuple[int, int] | None) -> None:
    try:
        src = os.open(name, _FILE_FLAGS, dir_fd=frame.src)
    except FileNotFoundError:
        return
    except OSError as exc:
        done.skip(rel, "changed" if exc.errno in (errno.ELOOP, errno.ENXIO) else "unreadable")
        return
    try:
        st = os.fstat(src)
        if not stat.S_ISREG(st.st_mode):
            done.skip(rel, "changed")  # swapped for a FIFO or a device since it was listed
            return
        try:
            dst = os.open(name, _NEW_FILE_FLAGS, 0o600, dir_fd=frame.dst)
        except FileExistsError:
            _remove(name, frame.dst)  # (what the destination held)
            dst = os.open(name, _NEW_FILE_FLAGS, 0o600, dir_fd=frame.dst)
        try:
            if owner is not None:
                os.fchown(dst, *owner)
            _copy_bytes(src, dst, st.st_size)
            os.fchmod(dst, stat.S_IMODE(st.st_mode) & 0o777)
            os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(dst)
    finally:
        os.close(src)
    done.files += 1


def _copy_bytes(src: int, dst: int, size: int) -> None:
    """At most ``size`` bytes (the file's size when it was opened) from ``src`` to ``dst``."""
    left = size
    while left > 0:
        chunk = os.read(src, min(left, _CHUNK))
        if not chunk:
            return
        left -= len(chunk)
        view = memoryview(chunk)
        while view:
            view = view[os.write(dst, view) :]


def _trim(stack: list[_Dir]) -> None:
    """Close the fds of all but the root and the deepest :data:`OPEN_DIRS` directories."""
    for frame in stack[1 : max(1, len(stack) - OPEN_DIRS)]:
        frame.close()


def _reopen(stack: list[_Dir], done: Copied) -> bool:
    """Make sure the top directory has its fds, opening it again (and the closed ones above
    it) by name from the nearest open ancestor; False when one of them is no longer the
    directory it was (its rest, and everything below it, is then skipped as ``changed``)."""
    if stack[-1].src >= 0:
        return True
    first = max(i for i, frame in enumerate(stack) if frame.src >= 0) + 1
    for i in range(first, len(stack)):
        parent, frame = stack[i - 1], stack[i]
        try:
            src = os.open(frame.name, _DIR_FLAGS, dir_fd=parent.src)
        except OSError:
            src = -1
        if src >= 0:
            st = os.fstat(src)
            if (st.st_dev, st.st_ino) == frame.ident:
                frame.src = src
                frame.dst = os.open(frame.name, _DIR_FLAGS, dir_fd=parent.dst)
                continue
            os.close(src)
        done.skip(frame.rel, "changed")
        for gone in stack[i:]:
            gone.pending.clear()
        return False
    _trim(stack)
    return True


def _remove(name: str, dir_fd: int) -> None:
    """Remove the entry ``name`` of ``dir_fd``: a file or symlink, or a directory and its tree."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except IsADirectoryError:
        sub = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        try:
            _empty_fd(sub)
        finally:
            os.close(sub)
        os.rmdir(name, dir_fd=dir_fd)


def empty_tree(path: Path) -> None:
    """Remove everything below the directory ``path`` (which stays), without following a
    symlink and without recursing; nothing when it is missing or not a directory."""
    try:
        root = _open_top(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return
        raise
    try:
        _empty_fd(root)
    finally:
        os.close(root)


def _empty_fd(root: int) -> None:
    """Empty the directory open as ``root`` (its fd stays open, the caller's)."""
    fresh = itertools.count()
    # (fd, name in its parent, subdirectories still to remove); the root's fd is the caller's.
    stack: list[tuple[int, str, list[str]]] = [(root, "", _unlink_files(root))]
    try:
        while stack:
            fd, name, pending = stack[-1]
            if not pending:
                pending.extend(_unlink_files(fd))  # what came up from below (moved there) or changed kind
            if not pending:
                stack.pop()
                if stack:
                    os.close(fd)
                    with contextlib.suppress(FileNotFoundError):  # (removed meanwhile)
                        os.rmdir(name, dir_fd=stack[-1][0])
                continue
            sub = pending.pop()
            if len(stack) > OPEN_DIRS:
                # Too deep to keep every fd above it open: move it to the top and remove it from there.
                while True:
                    moved = f".rb-empty-{next(fresh)}"
                    try:
                        os.stat(moved, dir_fd=root, follow_symlinks=False)
                    except FileNotFoundError:
                        break
                os.rename(sub, moved, src_dir_fd=fd, dst_dir_fd=root)
                continue
            try:
                child = os.open(sub, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                continue
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                continue  # no longer a directory: the next look at this one unlinks it
            stack.append((child, sub, _unlink_files(child)))
    finally:
        for fd, _name, _pending in stack[1:]:
            os.close(fd)


def _unlink_files(dir_fd: int) -> list[str]:
    """Unlink every entry of ``dir_fd`` that is not a directory; the names of its directories."""
    subdirs: list[str] = []
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                subdirs.append(entry.name)
                continue
            try:
                os.unlink(entry.name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            except IsADirectoryError:
                subdirs.append(entry.name)  # became one since it was listed
    return subdirs

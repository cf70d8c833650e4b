"""File actions: ``file_read``, ``file_write`` and the ``file_edit`` commands.

The workspace belongs to a sandbox that may be hostile, so no path is opened by name:
every action resolves its path with :func:`riverbed.confine.walk` (one component at a time
from a directory fd, ``O_NOFOLLOW``; symlinks only inside the workspace) and does its I/O
on the fds that walk opened.  A swap of a directory for a symlink between check and use
cannot lead out, and a regular file with more than one hard link is neither read nor
written (``hard_link_refused``): its other name may be a file outside the workspace.

Writes never write into an existing file: the new contents go to a temporary file in the
same directory (through the directory's fd), which then replaces the old name with
``os.replace``.  So a link planted after the check cannot receive the write, a reader never
sees half a file, and the old file's mode is kept.  When the sandbox runs as another user
than the worker (a root worker), ``owner`` names it, and every file and directory a write
creates is given to it, so the sandbox can change what its agent wrote.

Reads take 1-based inclusive line ranges.  Edits keep, per file, the contents before each
change (bounded by ``Limits.edit_history``) so ``undo_edit`` can step back, including
undoing a creation or a ``file_write``.  Edits answer with a unified diff and a numbered
snippet around the change.  The work is synchronous file I/O, run in a worker thread by
the caller.  A change takes effect only while the start gate's deadline holds
(``riverbed.runtime.gate.in_time``, right before the ``os.replace`` or ``unlink``); past it,
:class:`~riverbed.runtime.gate.LateStart` leaves the file as it was (a ``file_write`` may have
made the missing parent directories).
"""

from __future__ import annotations

import collections
import contextlib
import difflib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

from riverbed import confine, events
from riverbed.errors import InputError, PathRefused
from riverbed.runtime.gate import LateStart, in_time
from riverbed.runtime.limits import Limits

_SNIPPET_CONTEXT = 4
_LISTING_MAX = 1000

Owner = tuple[int, int]


class FileActionError(InputError):
    """A file action cannot be done; ``reason`` is the Error's reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class EditHistory:
    """Contents before each change, per file (``None``: the file did not exist).

    Keyed by the path relative to the workspace with symlinks resolved, so an edit made
    through a link and its undo through the real name are one history."""

    def __init__(self, depth: int) -> None:
        self._depth = max(depth, 1)
        self._steps: dict[str, collections.deque[str | None]] = {}

    def push(self, rel: str, before: str | None) -> None:
        self._steps.setdefault(rel, collections.deque(maxlen=self._depth)).append(before)

    def pop(self, rel: str) -> tuple[bool, str | None]:
        steps = self._steps.get(rel)
        if not steps:
            return False, None
        return True, steps.pop()


@contextlib.contextmanager
def _opened(place: confine.Place) -> Iterator[tuple[int, os.stat_result] | None]:
    """The last component of a walk, opened for reading (``None``: it does not exist)."""
    try:
        fd, st = confine.open_file(place)
    except FileNotFoundError:
        yield None
        return
    try:
        yield fd, st
    finally:
        os.close(fd)


def _text(rel: str, fd: int, st: os.stat_result, limits: Limits) -> str:
    """The text of an opened file (``rel`` as shown), refused unless it is a regular UTF-8 file
    within the limit."""
    if stat.S_ISDIR(st.st_mode):
        raise FileActionError("is_directory", f"{rel} is a directory")
    if not stat.S_ISREG(st.st_mode):
        raise FileActionError("not_a_file", f"{rel} is not a regular file")
    data = confine.read_fd(fd, limits.max_read_bytes, st.st_size)
    if len(data) > limits.max_read_bytes:
        raise FileActionError(
            "file_too_large",
            f"{rel} is {max(st.st_size, len(data))} bytes; the limit is {limits.max_read_bytes} "
            "(read a range with cmd_run)",
        )
    if b"\x00" in data[:8192]:
        raise FileActionError("not_text", f"{rel} looks binary (it contains NUL bytes)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileActionError("not_text", f"{rel} is not UTF-8 text: {exc.reason}") from exc


def _text_at_most(rel: str, fd: int, st: os.stat_result, limits: Limits, most: int | None) -> str | None:
    """:func:`_text`, or None with nothing read for a regular file of more than ``most`` bytes."""
    if most is not None and stat.S_ISREG(st.st_mode) and st.st_size > most:
        return None
    return _text(rel, fd, st, limits)


def _existing(place: confine.Place, limits: Limits) -> tuple[str | None, os.stat_result | None]:
    """What a write is about to replace: its text (``None`` if it is not text) and stat."""
    with _opened(place) as found:
        if found is None:
            return None, None
        fd, st = found
        if stat.S_ISDIR(st.st_mode):
            raise FileActionError("is_directory", f"{place.rel} is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise FileActionError("not_a_file", f"{place.rel} is not a regular file")
        try:
            return _text(place.rel, fd, st, limits), st
        except FileActionError:
            return None, st


def _write_text(place: confine.Place, text: str, *, like: os.stat_result | None, owner: Owner | None) -> None:
    """Replace ``place`` with a new file holding ``text`` (see the module docstring)."""
    tmp = f".rb-{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=place.dir_fd
        )
    except OSError as exc:
        raise FileActionError("write_failed", f"cannot write {place.rel}: {exc.strerror}") from exc
    try:
        try:
            view = memoryview(text.encode("utf-8"))
            while view:
                view = view[os.write(fd, view) :]
            if like is not None:
                os.fchmod(fd, stat.S_IMODE(like.st_mode))
            if owner is not None:
                os.fchown(fd, *owner)
        finally:
            os.close(fd)
        in_time()  # (the write takes effect here, or not at all)
        os.replace(tmp, place.name, src_dir_fd=place.dir_fd, dst_dir_fd=place.dir_fd)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=place.dir_fd)
        if isinstance(exc, IsADirectoryError):
            raise FileActionError("is_directory", f"{place.rel} is a directory") from exc
        if isinstance(exc, OSError):
            raise FileActionError("write_failed", f"cannot write {place.rel}: {exc.strerror}") from exc
        raise


@contextlib.contextmanager
def _walk(
    workspace: Path, raw: str, *, make_parents: bool = False, owner: Owner | None = None
) -> Iterator[confine.Place]:
    """:func:`riverbed.confine.walk`, with an OS error on the way said as a file action error."""
    try:
        with confine.walk(workspace, raw, make_parents=make_parents, owner=owner) as place:
            yield place
    except PermissionError as exc:
        raise FileActionError("permission_denied", f"{raw!r}: permission denied") from exc
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:
            raise FileActionError("not_a_directory", f"a parent of {raw!r} is a file, not a directory") from exc
        raise


def _cap(text: str, limits: Limits) -> str:
    limit = limits.max_output_chars
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters truncated ...]\n{text[-half:]}"


def _numbered(lines: list[str], first: int) -> str:
    return "".join(f"{first + i:6}\t{line.rstrip(chr(10))}\n" for i, line in enumerate(lines))


def _diff(rel: str, before: str | None, after: str | None) -> str:
    old = [] if before is None else before.splitlines(keepends=True)
    new = [] if after is None else after.splitlines(keepends=True)
    lines = difflib.unified_diff(
        old,
        new,
        fromfile="/dev/null" if before is None else f"a/{rel}",
        tofile="/dev/null" if after is None else f"b/{rel}",
    )
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


def read_bytes(workspace: Path, raw: str, limit: int) -> bytes | None:
    """The bytes of a single-link regular file ``raw`` inside ``workspace`` when it has at most
    ``limit`` of them, else None; never raises (images sent to a model are read this way)."""
    try:
        with confine.walk(workspace, raw) as place:
            fd, st = confine.open_file(place)
            try:
                if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
                    return None
                data = confine.read_fd(fd, limit, st.st_size)
            finally:
                os.close(fd)
    except (PathRefused, OSError):
        return None
    return data if len(data) <= limit else None


def read(workspace: Path, action: events.FileRead, limits: Limits) -> events.FileContent:
    content = read_small(workspace, action, limits, None)
    assert content is not None  # (no size given, none refused)
    return content


def read_small(workspace: Path, action: events.FileRead, limits: Limits, most: int | None) -> events.FileContent | None:
    """:func:`read`, or None with nothing read when the file is larger than ``most`` bytes: the
    caller reads a large file off the event loop, and answers a small one (or a refusal) at once
    from the file it opened, without looking at it first."""
    direct = confine.open_direct(workspace, action.path)
    if direct is not None:
        fd, st, rel = direct
        try:
            text = _text_at_most(rel, fd, st, limits, most)
        finally:
            os.close(fd)
    else:
        with _walk(workspace, action.path) as place, _opened(place) as found:
            if found is None:
                raise FileActionError("not_found", f"{place.rel} does not exist")
            rel = place.rel
            text = _text_at_most(rel, *found, limits, most)
    if text is None:
        return None
    if action.start == 1 and action.end is None:  # the whole file (most reads): no lines to count
        return events.FileContent(path=rel, content=_cap(text, limits), cause=action.id)
    lines = text.splitlines(keepends=True)
    if action.start < 1:
        raise FileActionError("bad_range", f"start must be 1 or more (lines are numbered from 1), not {action.start}")
    if action.end is not None and action.end < action.start:
        raise FileActionError("bad_range", f"end ({action.end}) is before start ({action.start})")
    if action.start > max(len(lines), 1):
        raise FileActionError("bad_range", f"start ({action.start}) is past the end: the file has {len(lines)} lines")
    end = len(lines) if action.end is None else min(action.end, len(lines))
    content = "".join(lines[action.start - 1 : end])
    return events.FileContent(path=rel, content=_cap(content, limits), cause=action.id)


def write(
    workspace: Path, action: events.FileWrite, limits: Limits, history: EditHistory, *, owner: Owner | None = None
) -> events.FileWritten:
    """Write a file, creating its parents; ``owner`` gets what is created (None: the worker)."""
    with _walk(workspace, action.path, make_parents=True, owner=owner) as place:
        before, like = _existing(place, limits)
        _write_text(place, action.content, like=like, owner=owner)
    history.push(place.rel, before)
    return events.FileWritten(path=place.rel, cause=action.id)


def edit(
    workspace: Path, action: events.FileEdit, limits: Limits, history: EditHistory, *, owner: Owner | None = None
) -> events.Observation:
    """Run one ``file_edit`` command; ``owner`` gets what is created (None: the worker)."""
    if action.command not in ("view", "create", "str_replace", "insert", "undo_edit"):
        raise FileActionError("bad_argument", f"unknown file_edit command {action.command!r}")
    with _walk(workspace, action.path, make_parents=action.command == "create", owner=owner) as place:
        rel = place.rel
        if action.command == "view":
            return _view(place, action, limits)
        if action.command == "create":
            if action.file_text is None:
                raise FileActionError("missing_argument", "create needs file_text")
            with _opened(place) as found:
                if found is not None:
                    raise FileActionError(
                        "file_exists", f"{rel} already exists; use str_replace or insert to change it"
                    )
            _write_text(place, action.file_text, like=None, owner=owner)
            history.push(rel, None)
            return _edited(action, rel=rel, before=None, after=action.file_text, first_line=1, limits=limits)
        if action.command == "str_replace":
            return _str_replace(place, action, limits, history, owner)
        if action.command == "insert":
            return _insert(place, action, limits, history, owner)
        found_step, before = history.pop(rel)
        if not found_step:
            raise FileActionError("no_history", f"there is no edit of {rel} to undo")
        try:
            current, like = _existing(place, limits)
            if before is None:
                in_time()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(place.name, dir_fd=place.dir_fd)
            else:
                _write_text(place, before, like=like, owner=owner)
        except LateStart:
            history.push(rel, before)  # (not undone: the step stays to undo)
            raise
        return _edited(action, rel=rel, before=current, after=before, first_line=1, limits=limits)


def _view(place: confine.Place, action: events.FileEdit, limits: Limits) -> events.FileContent:
    with _opened(place) as found:
        if found is None:
            raise FileActionError("not_found", f"{place.rel} does not exist")
        fd, st = found
        if stat.S_ISDIR(st.st_mode):
            return events.FileContent(path=place.rel, content=_listing(fd, limits), cause=action.id)
        text = _text(place.rel, fd, st, limits)
    return events.FileContent(path=place.rel, content=_cap(_numbered(text.splitlines(), 1), limits), cause=action.id)


def _str_replace(
    place: confine.Place, action: events.FileEdit, limits: Limits, history: EditHistory, owner: Owner | None
) -> events.FileEdited:
    rel = place.rel
    if not action.old_str:
        raise FileActionError("missing_argument", "str_replace needs a non-empty old_str")
    text, like = _current(place, limits)
    count = text.count(action.old_str)
    if count == 0:
        raise FileActionError("old_str_not_found", f"old_str was not found in {rel}; nothing was changed")
    if count > 1:
        starts = [i for i in range(len(text)) if text.startswith(action.old_str, i)]
        lines = ", ".join(str(text.count("\n", 0, i) + 1) for i in starts[:20])
        raise FileActionError(
            "old_str_not_unique",
            f"old_str occurs {count} times in {rel} (at lines {lines}); include more surrounding text so it "
            "occurs exactly once; nothing was changed",
        )
    new_str = action.new_str or ""
    at = text.index(action.old_str)
    after = text[:at] + new_str + text[at + len(action.old_str) :]
    _write_text(place, after, like=like, owner=owner)
    history.push(rel, text)
    first = text.count("\n", 0, at) + 1
    return _edited(
        action, rel=rel, before=text, after=after, first_line=first, limits=limits, span=new_str.count("\n") + 1
    )


def _insert(
    place: confine.Place, action: events.FileEdit, limits: Limits, history: EditHistory, owner: Owner | None
) -> events.FileEdited:
    if action.insert_line is None or action.new_str is None:
        raise FileActionError("missing_argument", "insert needs insert_line and new_str")
    text, like = _current(place, limits)
    lines = text.splitlines(keepends=True)
    if not 0 <= action.insert_line <= len(lines):
        raise FileActionError(
            "bad_range",
            f"insert_line must be between 0 and {len(lines)} (the file's line count), not {action.insert_line}",
        )
    if lines and action.insert_line == len(lines) and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    block = action.new_str if action.new_str.endswith("\n") else action.new_str + "\n"
    after = "".join([*lines[: action.insert_line], block, *lines[action.insert_line :]])
    _write_text(place, after, like=like, owner=owner)
    history.push(place.rel, text)
    first = action.insert_line + 1
    return _edited(
        action, rel=place.rel, before=text, after=after, first_line=first, limits=limits, span=block.count("\n")
    )


def _current(place: confine.Place, limits: Limits) -> tuple[str, os.stat_result]:
    """The text and stat of the file an edit changes (it must exist and be text)."""
    with _opened(place) as found:
        if found is None:
            raise FileActionError("not_found", f"{place.rel} does not exist")
        return _text(place.rel, *found, limits), found[1]


def _edited(
    action: events.FileEdit,
    *,
    rel: str,
    before: str | None,
    after: str | None,
    first_line: int,
    limits: Limits,
    span: int = 1,
) -> events.FileEdited:
    snippet = ""
    if after is not None:
        lines = after.splitlines()
        lo = max(first_line - 1 - _SNIPPET_CONTEXT, 0)
        hi = min(first_line - 1 + span + _SNIPPET_CONTEXT, len(lines))
        snippet = _numbered(lines[lo:hi], lo + 1)
    return events.FileEdited(
        path=rel, diff=_cap(_diff(rel, before, after), limits), content=_cap(snippet, limits), cause=action.id
    )


def _listing(fd: int, limits: Limits) -> str:
    """Files and directories up to two levels deep, hidden ones left out; read from the
    directory's fd, without following a symlinked directory."""
    out: list[str] = []

    def entries(dir_fd: int) -> tuple[list[str], list[str]]:
        with os.scandir(dir_fd) as it:
            found = [e for e in it if not e.name.startswith(".")]
        dirs = sorted(e.name for e in found if e.is_dir(follow_symlinks=False))
        return dirs, sorted(e.name for e in found if not e.is_dir(follow_symlinks=False))

    def add(name: str) -> bool:
        out.append(name)
        if len(out) < _LISTING_MAX:
            return True
        out.append(f"[... listing stopped at {_LISTING_MAX} entries ...]")
        return False

    dirs, names = entries(fd)
    for name in [*(d + "/" for d in dirs), *names]:
        if not add(name):
            return _cap("\n".join(out) + "\n", limits)
    for directory in dirs:
        try:
            sub = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError:
            continue  # replaced or unreadable since it was listed
        try:
            subdirs, subnames = entries(sub)
        finally:
            os.close(sub)
        for name in [*(d + "/" for d in subdirs), *subnames]:
            if not add(f"{directory}/{name}"):
                return _cap("\n".join(out) + "\n", limits)
    return _cap("\n".join(out) + "\n", limits)

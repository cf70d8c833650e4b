"""File actions: ``file_read``, ``file_write`` and the ``file_edit`` commands.

Every path goes through :func:`riverbed.runtime.paths.confine` first.  Reads take 1-based
inclusive line ranges.  Edits keep, per file, the contents before each change (bounded by
``Limits.edit_history``) so ``undo_edit`` can step back, including undoing a creation or a
``file_write``.  Edits answer with a unified diff and a numbered snippet around the change.
The work is synchronous file I/O, run in a worker thread by the caller.
"""

from __future__ import annotations

import collections
import difflib
import os
import stat
from pathlib import Path

from riverbed import events
from riverbed.errors import InputError
from riverbed.runtime.limits import Limits
from riverbed.runtime.paths import confine, display

_SNIPPET_CONTEXT = 4
_LISTING_MAX = 1000


class FileActionError(InputError):
    """A file action cannot be done; ``reason`` is the Error's reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class EditHistory:
    """Contents before each change, per file (``None``: the file did not exist)."""

    def __init__(self, depth: int) -> None:
        self._depth = max(depth, 1)
        self._steps: dict[Path, collections.deque[str | None]] = {}

    def push(self, path: Path, before: str | None) -> None:
        self._steps.setdefault(path, collections.deque(maxlen=self._depth)).append(before)

    def pop(self, path: Path) -> tuple[bool, str | None]:
        steps = self._steps.get(path)
        if not steps:
            return False, None
        return True, steps.pop()


def _read_text(path: Path, limits: Limits) -> str:
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise FileActionError("not_found", f"{path.name} does not exist") from None
    if stat.S_ISDIR(st.st_mode):
        raise FileActionError("is_directory", f"{path.name} is a directory")
    if not stat.S_ISREG(st.st_mode):
        raise FileActionError("not_a_file", f"{path.name} is not a regular file")
    size = st.st_size
    if size > limits.max_read_bytes:
        raise FileActionError(
            "file_too_large",
            f"{path.name} is {size} bytes; the limit is {limits.max_read_bytes} (read a range with cmd_run)",
        )
    data = path.read_bytes()
    if b"\x00" in data[:8192]:
        raise FileActionError("not_text", f"{path.name} looks binary (it contains NUL bytes)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileActionError("not_text", f"{path.name} is not UTF-8 text: {exc.reason}") from exc


def _write_text(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8", newline="")
    except IsADirectoryError as exc:
        raise FileActionError("is_directory", f"{path.name} is a directory") from exc
    except NotADirectoryError as exc:
        raise FileActionError("not_a_directory", f"a parent of {path.name} is a file, not a directory") from exc
    except OSError as exc:
        raise FileActionError("write_failed", f"cannot write {path.name}: {exc.strerror}") from exc


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


def read(workspace: Path, action: events.FileRead, limits: Limits) -> events.FileContent:
    path = confine(workspace, action.path)
    text = _read_text(path, limits)
    lines = text.splitlines(keepends=True)
    if action.start < 1:
        raise FileActionError("bad_range", f"start must be 1 or more (lines are numbered from 1), not {action.start}")
    if action.end is not None and action.end < action.start:
        raise FileActionError("bad_range", f"end ({action.end}) is before start ({action.start})")
    if action.start > max(len(lines), 1):
        raise FileActionError("bad_range", f"start ({action.start}) is past the end: the file has {len(lines)} lines")
    end = len(lines) if action.end is None else min(action.end, len(lines))
    content = "".join(lines[action.start - 1 : end])
    return events.FileContent(path=display(workspace, path), content=_cap(content, limits), cause=action.id)


def write(workspace: Path, action: events.FileWrite, limits: Limits, history: EditHistory) -> events.FileWritten:
    path = confine(workspace, action.path)
    if path.is_dir():
        raise FileActionError("is_directory", f"{action.path} is a directory")
    before: str | None = None
    if path.exists():
        try:
            before = _read_text(path, limits)
        except FileActionError:
            before = None
    _write_text(path, action.content)
    history.push(path, before)
    return events.FileWritten(path=display(workspace, path), cause=action.id)


def edit(workspace: Path, action: events.FileEdit, limits: Limits, history: EditHistory) -> events.Observation:
    path = confine(workspace, action.path)
    rel = display(workspace, path)
    if action.command == "view":
        if path.is_dir():
            return events.FileContent(path=rel, content=_listing(path, limits), cause=action.id)
        text = _read_text(path, limits)
        return events.FileContent(path=rel, content=_cap(_numbered(text.splitlines(), 1), limits), cause=action.id)
    if action.command == "create":
        if path.exists() or path.is_symlink():
            raise FileActionError("file_exists", f"{rel} already exists; use str_replace or insert to change it")
        if action.file_text is None:
            raise FileActionError("missing_argument", "create needs file_text")
        _write_text(path, action.file_text)
        history.push(path, None)
        return _edited(action, rel=rel, before=None, after=action.file_text, first_line=1, limits=limits)
    if action.command == "str_replace":
        return _str_replace(path, rel, action, limits, history)
    if action.command == "insert":
        return _insert(path, rel, action, limits, history)
    if action.command == "undo_edit":
        found, before = history.pop(path)
        if not found:
            raise FileActionError("no_history", f"there is no edit of {rel} to undo")
        current = _read_text(path, limits) if path.exists() else None
        if before is None:
            path.unlink(missing_ok=True)
        else:
            _write_text(path, before)
        return _edited(action, rel=rel, before=current, after=before, first_line=1, limits=limits)
    raise FileActionError("bad_argument", f"unknown file_edit command {action.command!r}")


def _str_replace(
    path: Path, rel: str, action: events.FileEdit, limits: Limits, history: EditHistory
) -> events.FileEdited:
    if not action.old_str:
        raise FileActionError("missing_argument", "str_replace needs a non-empty old_str")
    text = _read_text(path, limits)
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
    _write_text(path, after)
    history.push(path, text)
    first = text.count("\n", 0, at) + 1
    return _edited(
        action, rel=rel, before=text, after=after, first_line=first, limits=limits, span=new_str.count("\n") + 1
    )


def _insert(path: Path, rel: str, action: events.FileEdit, limits: Limits, history: EditHistory) -> events.FileEdited:
    if action.insert_line is None or action.new_str is None:
        raise FileActionError("missing_argument", "insert needs insert_line and new_str")
    text = _read_text(path, limits)
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
    _write_text(path, after)
    history.push(path, text)
    first = action.insert_line + 1
    return _edited(action, rel=rel, before=text, after=after, first_line=first, limits=limits, span=block.count("\n"))


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


def _listing(root: Path, limits: Limits) -> str:
    """Files and directories up to two levels deep, hidden ones left out."""
    out: list[str] = []
    for top, dirs, files in os.walk(root):
        depth = len(Path(top).relative_to(root).parts)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in [*(d + "/" for d in dirs), *sorted(f for f in files if not f.startswith("."))]:
            out.append(str(Path(top, name).relative_to(root)) + ("/" if name.endswith("/") else ""))
            if len(out) >= _LISTING_MAX:
                out.append(f"[... listing stopped at {_LISTING_MAX} entries ...]")
                return _cap("\n".join(out) + "\n", limits)
        if depth >= 1:
            dirs[:] = []
    return _cap("\n".join(out) + "\n", limits)

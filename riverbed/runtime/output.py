"""Reading sandbox output: non-blocking fds, capped text, end-of-command markers.

:class:`CappedText` keeps the head and the tail of an output stream within a character
budget while it is read (a flood of gigabytes costs no memory) and renders the middle cut
with a marker.  :class:`MarkerScanner` splits a byte stream at a marker that the sandbox
prints when a command or cell is done; the marker may be split across reads and may carry
a numeric payload (the exit code).  :func:`read_some` waits (bounded by the caller's
cancel scope) for a non-blocking fd and reads what is there.
"""

from __future__ import annotations

import codecs
import collections
import errno
import functools
import os
import re
from typing import Protocol

import anyio

_CHUNK = 65536


class Stream(Protocol):
    """Rewrites one output chunk by chunk (``agent/masking.py``'s ``StreamMasker``: a secret's
    value is masked even when it straddles two chunks)."""

    def feed(self, chunk: str) -> str: ...

    def flush(self) -> str: ...


class StreamSource(Protocol):
    """Makes a :class:`Stream` per output (``agent/masking.py``'s ``Masker``)."""

    def stream(self) -> Stream: ...


class CappedText:
    """Text of at most ``limit`` characters: the first half and the last half are kept.

    With ``masks``, the text is masked as it arrives, before anything is cut: a value cut in
    two by the truncation is masked too."""

    def __init__(self, limit: int, masks: StreamSource | None = None) -> None:
        self._stream = masks.stream() if masks is not None else None
        self._limit = max(limit, 2)
        self._head_budget = self._limit // 2
        self._head: list[str] = []
        self._head_len = 0
        self._tail: collections.deque[str] = collections.deque()
        self._tail_len = 0
        self._dropped = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed_bytes(self, data: bytes, *, final: bool = False) -> None:
        self.feed(self._decoder.decode(data, final))

    def feed(self, text: str) -> None:
        if self._stream is not None and text:
            text = self._stream.feed(text)
        self._keep(text)

    def _keep(self, text: str) -> None:
        if not text:
            return
        if self._head_len < self._head_budget:
            take = text[: self._head_budget - self._head_len]
            self._head.append(take)
            self._head_len += len(take)
            text = text[len(take) :]
            if not text:
                return
        self._tail.append(text)
        self._tail_len += len(text)
        budget = self._limit - self._head_budget
        while self._tail_len > budget:
            first = self._tail[0]
            excess = self._tail_len - budget
            if len(first) <= excess:
                self._tail.popleft()
                self._tail_len -= len(first)
                self._dropped += len(first)
            else:
                self._tail[0] = first[excess:]
                self._tail_len -= excess
                self._dropped += excess

    @property
    def truncated(self) -> bool:
        return self._dropped > 0

    def render(self) -> str:
        if self._stream is not None:
            self._keep(self._stream.flush())
            self._stream = None
        tail_text = "".join(self._tail)
        text = "".join(self._head)
        if self._dropped:
            text += f"\n[... {self._dropped} characters truncated ...]\n"
        return (text + tail_text).replace("\r\n", "\n")


class MarkerScanner:
    """Find ``prefix<digits or -><suffix>`` in a byte stream fed in pieces.

    :meth:`feed` returns the bytes before the marker (safe to show) and keeps back any
    trailing bytes that might be the start of a marker.  Once found, :attr:`found` is
    set, :attr:`payload` holds the text between prefix and suffix, and the bytes after
    the marker are in :attr:`rest`.
    """

    def __init__(self, prefix: bytes, suffix: bytes) -> None:
        self._prefix = prefix
        self._suffix = suffix
        self._max_len = len(prefix) + len(suffix) + 12
        self._pending = b""
        self.found = False
        self.payload = ""
        self.rest = b""

    @functools.cached_property
    def _pattern(self) -> re.Pattern[bytes]:
        # Compiled on first use: a sandbox whose shell never runs a command never needs it.
        return re.compile(re.escape(self._prefix) + rb"(-?[0-9]*)" + re.escape(self._suffix))

    def reset(self) -> None:
        self._pending = b""
        self.found = False
        self.payload = ""
        self.rest = b""

    def feed(self, data: bytes) -> bytes:
        if self.found:
            self.rest += data
            return b""
        buf = self._pending + data
        match = self._pattern.search(buf)
        if match:
            self.found = True
            self.payload = match.group(1).decode("ascii", "replace")
            self.rest = buf[match.end() :]
            self._pending = b""
            return buf[: match.start()]
        keep = self._possible_start(buf)
        self._pending = buf[keep:]
        return buf[:keep]

    def flush(self) -> bytes:
        out, self._pending = self._pending, b""
        return out

    def _possible_start(self, buf: bytes) -> int:
        """Index from which ``buf`` might hold the beginning of a marker."""
        start = max(0, len(buf) - self._max_len)
        idx = buf.find(self._prefix[:1], start)
        while idx != -1:
            piece = buf[idx : idx + len(self._prefix)]
            if self._prefix.startswith(piece) or piece.startswith(self._prefix):
                return idx
            idx = buf.find(self._prefix[:1], idx + 1)
        return len(buf)


async def read_some(fd: int) -> bytes:
    """Wait until ``fd`` (non-blocking) is readable and read; ``b""`` means end of stream.

    A pty master reports the end of its slave side as ``EIO``: that is an end too.
    """
    while True:
        try:
            return os.read(fd, _CHUNK)
        except BlockingIOError:
            await anyio.wait_readable(fd)
        except OSError as exc:
            if exc.errno == errno.EIO:
                return b""
            raise


async def write_all(fd: int, data: bytes) -> None:
    """Write everything to a non-blocking fd, waiting (bounded by the caller) when it is full."""
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            await anyio.wait_writable(fd)
            continue
        view = view[written:]

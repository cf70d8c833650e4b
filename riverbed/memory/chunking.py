"""What gets indexed: a pure function from an event to the texts (chunks) to embed.

Each chunk starts with a short header naming what the text is (``$ <command>``,
``file <path>``, ``user:`` …) so that a chunk cut out of a long output still says where
it came from.  Long texts are cut into overlapping windows at whitespace; very long
ones keep their head and tail windows (``max_chunks``).  Events with nothing worth
indexing give ``[]`` (they are still tracked as indexed).

Chunks are text for search, not a copy of the event (the log keeps that untouched): they
hold no NUL character and no lone surrogate (:func:`searchable`), which Postgres text and
UTF-8 cannot carry.  A ``recall_result`` is not indexed: its hits are copies of other
events, and indexing them would fill later recalls with copies.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field

from riverbed import events

__all__ = ["DEFAULT_SKIP", "ChunkPolicy", "chunk_text", "event_chunks", "event_text", "searchable"]

#: Kinds not indexed unless asked for: records of other records (``recall_result`` quotes the
#: events it found), configuration, raw model output, and ``cmd_run`` (its ``cmd_output``
#: starts with ``$ <command>``, so the pair would fill two of k hits).
DEFAULT_SKIP: frozenset[str] = frozenset(
    {
        "recall",
        "recall_result",
        "condensation_request",
        "session_config",
        "llm_response",
        "forked",
        "unknown",
        "file_read",
        "cmd_run",
    }
)

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def searchable(text: str) -> str:
    """``text`` without what Postgres text cannot hold: a NUL is dropped, a lone surrogate
    becomes U+FFFD (a Python str holds no surrogate pairs, so every surrogate is lone)."""
    if not _UNSTORABLE.search(text):
        return text
    return _UNSTORABLE.sub(lambda m: "" if m.group() == "\x00" else "\ufffd", text)


@dataclass(frozen=True)
class ChunkPolicy:
    """How events are cut into chunks; ``size``/``overlap`` are in characters."""

    size: int = 1000
    overlap: int = 150
    max_chunks: int = 40
    skip: Collection[str] = field(default=DEFAULT_SKIP)

    def __post_init__(self) -> None:
        if self.size < 50 or not (0 <= self.overlap < self.size // 2) or self.max_chunks < 2:
            raise ValueError("ChunkPolicy needs size >= 50, 0 <= overlap < size/2 and max_chunks >= 2")


def chunk_text(text: str, *, size: int = 1000, overlap: int = 150, max_chunks: int = 40) -> list[str]:
    """Overlapping windows of at most ``size`` characters, cut at whitespace when possible.

    When there would be more than ``max_chunks`` windows, the first and last
    ``max_chunks // 2`` are kept (the middle of a huge log is rarely what is searched for).
    """
    text = text.strip()
    if not text:
        return []
    if len(text) <= size:
        return [text]
    windows: list[str] = []
    start = 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            cut = text.rfind(" ", start + size // 2, end)
            cut = max(cut, text.rfind("\n", start + size // 2, end))
            if cut > start:
                end = cut
        piece = text[start:end].strip()
        if piece:
            windows.append(piece)
        if end >= len(text):
            break
        start = max(end - overlap, start + 1)
        if overlap:
            space = text.find(" ", start, end)
            if 0 <= space < end - 1:
                start = space + 1
    if len(windows) > max_chunks:
        half = max_chunks // 2
        windows = windows[:half] + windows[-half:]
    return windows


def event_text(event: events.Event) -> tuple[str, str]:
    """``(header, body)`` of an event's indexable text; both empty when there is none."""
    match event:
        case events.Message(content=content):
            return f"{event.source}:", content
        case events.CmdRun(command=command):
            return "", f"$ {command}"
        case events.CmdOutput(command=command, content=content, exit_code=code):
            status = f" (exit {code})" if code not in (None, 0) else ""
            return (f"$ {command}{status}" if command else f"command output{status}"), content
        case events.FileWrite(path=path, content=content):
            return f"wrote file {path}", content
        case events.FileEdit(path=path, command=command):
            parts = [event.file_text, event.old_str and f"replaced: {event.old_str}", event.new_str]
            return f"edit ({command}) {path}", "\n".join(p for p in parts if p)
        case events.FileEdited(path=path, diff=diff):
            return f"edited file {path}", diff
        case events.FileContent(path=path, content=content):
            return f"file {path}", content
        case events.FileWritten(path=path):
            return "", f"file written: {path}"
        case events.PythonRun(code=code):
            return "python:", code
        case events.PythonOutput():
            parts = [event.content, event.result and f"result: {event.result}", event.exception]
            return "python output:", "\n".join(p for p in parts if p)
        case events.RecallResult():
            return "recalled:", _recall_text(event)
        case events.Condensation(summary=summary):
            return "summary of earlier events:", summary or ""
        case events.Think(thought=thought):
            return "thought:", thought
        case events.Finish(final_thought=thought, outputs=outputs):
            extra = "\n".join(f"{k}: {v}" for k, v in outputs.items())
            return "finished:", "\n".join(p for p in (thought, extra) if p)
        case events.Error(content=content, reason=reason):
            return f"error ({reason}):", content
        case events.DelegateResult(session=session, state=state, content=content):
            return f"sub-agent {session} ({state}):", content
        case events.Delegate(task=task):
            return "delegated:", task
        case events.LlmResponse(content=content):
            return "assistant:", content or ""
    return "", ""


def _recall_text(result: events.RecallResult) -> str:
    """What a recall found, by reference only: quoting its hits would make copies of them."""
    parts = [f"knowledge: {k.name}" for k in result.knowledge]
    parts += [f"{h.kind} {h.event_id} of {h.session}" for h in result.hits]
    if result.repo_directory:
        parts.append(f"workspace {result.repo_directory}")
    return "\n".join(parts)


def event_chunks(event: events.Event, policy: ChunkPolicy | None = None) -> list[str]:
    """The texts to index for ``event`` (``[]``: nothing to index, or a skipped kind)."""
    policy = policy or ChunkPolicy()
    if event.kind in policy.skip:
        return []
    header, body = event_text(event)
    header, body = searchable(header), searchable(body)
    if not body.strip():
        return []
    room = max(policy.size - len(header) - 1, policy.size // 2)
    pieces = chunk_text(body, size=room, overlap=min(policy.overlap, room // 3), max_chunks=policy.max_chunks)
    header = header[: policy.size // 2]
    return [f"{header}\n{p}" if header else p for p in pieces]

"""What a model reads of an event, and how many tokens that is.

:func:`event_text` is the text of an event as a model sees it (an observation's output,
a message's content, an action's arguments as JSON); conversions to chat messages and
the token counts used by condensation triggers both use it, so the budget measures what
is sent.

:class:`TokenCounter` counts with tiktoken when its encoding can be loaded, else with an
estimate.  tiktoken downloads its encoding files on first use; on a machine without
internet access that fails, the failure is remembered for the process, and the counter
falls back to the estimate ``ceil(characters / 4)`` (close to tiktoken on English and
code; a little high on prose, low on dense non-Latin text).  Each event also costs
``PER_EVENT_OVERHEAD`` tokens, the framing a chat message adds.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Literal, Protocol

import msgspec

from riverbed.errors import ConfigError
from riverbed.events import (
    Action,
    CmdOutput,
    CmdRun,
    DelegateResult,
    Error,
    Event,
    FileContent,
    FileEdited,
    FileWritten,
    Finish,
    LlmResponse,
    McpTools,
    Message,
    PythonOutput,
    RecallResult,
    Think,
    ToolCall,
    ToolResult,
)
from riverbed.memory.view import Masked, Summary

__all__ = ["PER_EVENT_OVERHEAD", "TokenCounter", "Tokenizer", "action_arguments", "event_text"]

Tokenizer = Literal["auto", "tiktoken", "estimate"]

PER_EVENT_OVERHEAD = 4

#: Fields every event has: not part of what a model reads.
_ENVELOPE = frozenset({"id", "source", "cause", "ts", "agent", "tenant", "trace", "v", "kind", "tool_call_id", "risk"})
"""Fields every event (or every action) has that are no argument of the call: the risk a judge
recorded on an action is the agent's, not the model's."""


def action_arguments(event: Event) -> dict[str, Any]:
    """An event's own fields (no envelope, no defaults left out), e.g. a tool call's arguments."""
    raw: dict[str, Any] = msgspec.to_builtins(event)
    return {k: v for k, v in raw.items() if k not in _ENVELOPE}


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


def event_text(event: Event) -> str:
    """The text of an event as a model reads it."""
    match event:
        case Message(content=text) | Summary(content=text) | Masked(content=text) | FileContent(content=text):
            return text
        case Think(thought=text):
            return text
        case Finish():
            return event.final_thought + (f"\n{_json(event.outputs)}" if event.outputs else "")
        case CmdRun():
            return event.command
        case CmdOutput():
            return _cmd_output(event)
        case FileWritten():
            return f"wrote {event.path}"
        case FileEdited():
            return event.diff or event.content or f"edited {event.path}"
        case PythonOutput():
            return _python_output(event)
        case RecallResult():
            return _recall_result(event)
        case Error():
            return event.content if event.reason == "error" else f"{event.content} (reason: {event.reason})"
        case DelegateResult():
            return f"{event.content}\n[sub-agent session {event.session}: {event.state}]"
        case ToolResult():
            return f"[error] {event.content}" if event.is_error else event.content
        case ToolCall():
            return f"{event.tool} {_json(event.arguments)}"
        case McpTools():
            return f"{event.server}: " + ", ".join(tool.name for tool in event.tools)
        case LlmResponse():
            calls = _json(event.tool_calls) if event.tool_calls else ""
            return "\n".join(part for part in (event.content or "", calls) if part)
        case Action():
            return _json(action_arguments(event))
        case _:
            return _json(action_arguments(event))


def _cmd_output(event: CmdOutput) -> str:
    notes = []
    if event.exit_code is not None:
        notes.append(f"[exit code {event.exit_code}]")
    if event.timed_out:
        notes.append("[timed out]")
    if event.truncated:
        notes.append("[output truncated]")
    return "\n".join([event.content, *notes]) if notes else event.content


def _python_output(event: PythonOutput) -> str:
    parts = [event.content] if event.content else []
    if event.result is not None:
        parts.append(f"result: {event.result}")
    if event.exception:
        parts.append(event.exception)
    if event.files:
        parts.append("files: " + ", ".join(event.files))
    for flag, note in ((event.timed_out, "[timed out]"), (event.truncated, "[output truncated]")):
        if flag:
            parts.append(note)
    if event.state_lost:
        parts.append("[the Python process was restarted; earlier state is lost]")
    return "\n".join(parts)


def _recall_result(event: RecallResult) -> str:
    parts: list[str] = []
    for label, value in (
        ("repository", event.repo_name),
        ("branch", event.repo_branch),
        ("directory", event.repo_directory),
        ("date", event.date),
        ("repository instructions", event.repo_instructions),
        ("instructions", event.conversation_instructions),
    ):
        if value:
            parts.append(f"{label}: {value}")
    if event.runtime_info:
        parts.append(f"runtime: {_json(event.runtime_info)}")
    parts.extend(f"[{k.name}] {k.content}" for k in event.knowledge)
    parts.extend(f"[{h.session}#{h.event_id} {h.kind} {h.score:.2f}] {h.text}" for h in event.hits)
    if isinstance(event.indexed_to, int):  # answered before indexing reached the recall
        parts.append(f"(searched events 1..{event.indexed_to} only: later ones are not indexed yet)")
    return "\n".join(parts) if parts else "(nothing found)"


class _Encoding(Protocol):
    def encode_ordinary(self, text: str) -> list[int]: ...


_encodings: dict[str, _Encoding | None] = {}


def _load_encoding(model: str | None) -> _Encoding | None:
    """The tiktoken encoding for ``model`` (o200k_base for unknown models), None when unavailable."""
    try:
        import tiktoken  # noqa: PLC0415  (optional at run time)
    except ImportError:
        return None
    try:
        name = tiktoken.encoding_name_for_model(model) if model else "o200k_base"
    except KeyError:
        name = "o200k_base"
    if name not in _encodings:
        try:
            _encodings[name] = tiktoken.get_encoding(name)
        except Exception:  # no network, a broken cache: count with the estimate
            _encodings[name] = None
    return _encodings[name]


class TokenCounter:
    """Counts tokens of texts and events (see the module docstring for the method)."""

    def __init__(self, model: str | None = None, tokenizer: Tokenizer = "auto") -> None:
        self.model = model
        self._encoding = None if tokenizer == "estimate" else _load_encoding(model)
        if tokenizer == "tiktoken" and self._encoding is None:
            raise ConfigError(
                "tokenizer 'tiktoken' was asked for but its encoding files cannot be loaded "
                "(no network?); set TIKTOKEN_CACHE_DIR to a directory holding them, or use 'auto'"
            )

    @property
    def exact(self) -> bool:
        """Whether counts come from tiktoken rather than the estimate."""
        return self._encoding is not None

    def text(self, text: str) -> int:
        if self._encoding is None:
            return (len(text) + 3) // 4
        return len(self._encoding.encode_ordinary(text))

    def event(self, event: Event) -> int:
        return PER_EVENT_OVERHEAD + self.text(event_text(event))

    def events(self, events: Iterable[Event]) -> int:
        return sum(self.event(e) for e in events)

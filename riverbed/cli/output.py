"""Everything the CLI prints: events as readable lines, escapes of control characters, JSON
lines on stdout, one-sentence errors on stderr."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import sys
from collections.abc import Iterable
from typing import Any, NoReturn

import msgspec
from rich.console import Console
from rich.text import Text

from riverbed import events
from riverbed.agent.runs import END_REASONS

err_console = Console(stderr=True, highlight=False, soft_wrap=True)

_UNFOLDED = 1_000_000
"""The width of a console with no terminal: no line of it is ever folded."""


def out_console(*, stderr: bool = False) -> Console:
    """A console for readable output.  Lines are never folded (``soft_wrap``): a command or a
    path printed for the user to copy stays on one line.  Without a terminal (a pipe, a file,
    CI), where rich would lay out tables at 80 columns, it takes the width its lines need."""
    console = Console(stderr=stderr, highlight=False, soft_wrap=True)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = _UNFOLDED
    return console


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 tool call``, ``2 tool calls`` (``many``: a plural that is not ``word`` + s)."""
    return f"{n} {word if n == 1 else many or word + 's'}"


_JSON = msgspec.json.Encoder(enc_hook=str)  # a value JSON has no form for is shown as its string


def json_bytes(value: Any) -> bytes:
    """The CLI's one JSON encoder, for every ``--json`` output: one document on one line; an
    event in its wire form (the form of ``riverbed schema``), dataclasses and structs as objects."""
    if isinstance(value, events.Event):
        return events.encode_json(value)
    return _JSON.encode(value)


def _stdout_lines(lines: Iterable[bytes], *, flush_each: bool = False) -> None:
    out = sys.stdout.buffer
    for line in lines:
        out.write(line)
        out.write(b"\n")
        if flush_each:
            out.flush()
    out.flush()


def _fail(message: str, code: int) -> NoReturn:
    err_console.print(Text(f"riverbed: {visible(message)}", style="bold red"), soft_wrap=True)
    raise SystemExit(code)


# --- log, export -----------------------------------------------------------------------------

_SOURCE_STYLE = {
    "agent": "cyan",
    "user": "green",
    "runtime": "yellow",
    "memory": "magenta",
    "condenser": "blue",
    "system": "dim",
}
_BASE_FIELDS = frozenset(events.Event.__struct_fields__)
_TEXT_WIDTH = 160


# C0 controls but tab and newline, DEL, C1 controls, and the bidirectional overrides that
# reorder what a terminal shows ("Trojan Source").
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def visible(text: str) -> str:
    """``text`` with every control character a program could use to drive the terminal
    (ESC of a CSI or OSC sequence, BEL, a C1 control, a bidi override) shown as an escape
    such as ``\\x1b``: output of commands is printed, never obeyed.  Tab and newline stay."""
    return _UNSAFE.sub(_escape, text)


def _cell(text: str) -> Text:
    """A table cell of text from the data: escaped, and never read as rich markup."""
    return Text(visible(text))


def _one_line(text: str, width: int = _TEXT_WIDTH) -> str:
    flat = " ".join(visible(text).split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def differing(recorded: str, new: str, width: int = 80) -> tuple[str, str]:
    """Two values of one line each, cut to ``width`` around where they first differ: a long
    common beginning (a path, a date, a banner) becomes ``…``, so the difference is shown."""
    a, b = _one_line(recorded, 1 << 30), _one_line(new, 1 << 30)
    same = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        same += 1
    lead = min(same, 20)  # of the common beginning, what is kept as context
    start = 0 if same <= lead else same - lead

    def cut(text: str) -> str:
        shown = ("…" if start else "") + text[start:]
        return shown if len(shown) <= width else shown[: width - 1] + "…"

    return cut(a), cut(b)


def _specific(event: events.Event) -> dict[str, Any]:
    """The fields that belong to the event's kind (not the envelope every event has)."""
    raw = events.to_builtins(event)
    return {k: v for k, v in raw.items() if k not in _BASE_FIELDS and k != "kind"}


def _summary(event: events.Event) -> str:
    """The main content of an event, as one short line."""
    match event:
        case events.CmdRun(command=command, is_input=is_input):
            return f"(input) {command}" if is_input else f"$ {command}"
        case events.CmdOutput(content=content, exit_code=code, timed_out=timed_out):
            status = "timed out" if timed_out else f"exit {code}"
            return f"[{status}] {content}"
        case events.FileRead(path=path, start=start, end=end):
            return f"{path}:{start}-{end}" if end is not None else f"{path}:{start}-"
        case events.FileWrite(path=path, content=content):
            return f"{path} ({len(content)} chars)"
        case events.FileEdit(command=command, path=path):
            return f"{command} {path}"
        case events.FileContent(path=path, content=content):
            return f"{path}: {content}"
        case events.FileEdited(path=path, diff=diff):
            return f"{path}: {diff}"
        case events.Recall(recall_type=recall_type, query=query, k=k):
            return f"{recall_type} k={k}: {query}"
        case events.RecallResult(recall_type=recall_type, hits=hits, knowledge=knowledge, indexed_to=indexed_to):
            behind = f" (index up to event {indexed_to})" if isinstance(indexed_to, int) else ""
            return f"{recall_type}: {plural(len(hits), 'hit')}, {len(knowledge)} knowledge{behind}"
        case events.Error(source="agent", reason=reason, content=content) if reason in END_REASONS:
            return f"{reason}, the run ended: {content}"  # (its retryable flag is for a new run)
        case events.Error(reason=reason, content=content, retryable=retryable):
            return f"{reason}{' (retryable)' if retryable else ''}: {content}"
        case events.Condensation(forgotten=forgotten, summary=summary):
            ranges = ", ".join(f"{a}-{b}" for a, b in forgotten)
            return f"forgot [{ranges}]" + (f": {summary}" if summary else "")
        case events.Forked(source_session=source_session, at=at, workspace=workspace):
            return f"forked from {source_session} at {at} (sandbox: {workspace})"
        case events.SandboxRebuilt(method=method, actions=actions, differences=differences, note=note):
            done = (
                f"{method}: {plural(actions, 'action')} re-run, {plural(len(differences), 'difference')}"
                if method == "replay"
                else method
            )
            return done + (f"; {note}" if note else "")
        case events.ContextEdit(op=op, ranges=ranges, kinds=kinds, note=note):
            what = [f"{a}-{b}" if a != b else str(a) for a, b in ranges] + [f"--kind {k}" for k in kinds]
            return f"{op} {' '.join(what)}" + (f": {note}" if note else "")
        case events.PythonRun(code=code):
            return f">>> {code}"
        case events.ToolCall(tool=tool, arguments=arguments):
            return f"{tool}({json_bytes(arguments).decode()})"
        case events.ToolResult(content=content, is_error=is_error):
            return f"[error] {content}" if is_error else content
        case events.McpList(server=server, command=command, url=url):
            return f"{server}: {' '.join(command) if command else url}"
        case events.McpTools(server=server, tools=listed):
            return f"{server}: {', '.join(t.name for t in listed)}"
        case events.RunUpgraded(digest=digest, previous=previous, rules=rules):
            return f"continues on digest {digest} (was {previous}), run rules {rules}"
        case events.PythonOutput():
            return _python_summary(event)
        case events.SessionConfig(env=env, condenser=condenser):
            parts = [f"{name}={value}" if value is not None else f"unset {name}" for name, value in env.items()]
            if condenser:
                parts.append("condenser " + " ".join(f"{k}={v}" for k, v in condenser.items()))
            return ", ".join(parts)
        case events.Finish(final_thought=final_thought, outputs=outputs):
            return final_thought + (f" outputs: {json.dumps(outputs, default=str)}" if outputs else "")
        case events.Delegate(task=task):
            return f"to a sub-agent: {task}"
        case events.Delegated(parent=parent, parent_action=parent_action, depth=depth):
            return f"sub-agent of {parent} (its delegate {parent_action}; depth {depth})"
        case events.DelegateResult(session=session, state=state, content=content):
            return f"{session} {state}: {content}"
        case events.LlmResponse(model=model, content=content, tool_calls=tool_calls):
            return f"{model}: {content or ''} ({plural(len(tool_calls), 'tool call')})"
        case events.RunStarted():
            return f"run opened: {_run_limits(event)}"
        case events.RunCancel(note=note):
            return "asked the agent to cancel the run" + (f": {note}" if note else "")
        case events.Unknown(original_kind=original_kind, payload=payload):
            return f"{original_kind}: {json.dumps(payload, default=str)}"
    fields = _specific(event)
    for name in ("content", "thought", "final_thought", "query", "code", "path", "summary"):
        value = fields.get(name)
        if isinstance(value, str) and value:
            return value
    return json.dumps(fields, default=str) if fields else ""


def _run_limits(event: events.RunStarted) -> str:
    """A run's limits and model settings as the CLI's ``--max-steps`` … would say them."""
    parts = [
        f"model {event.model}" if event.model else "the worker's model",
        f"at most {plural(event.max_steps, 'step')}",
    ]
    if event.max_tokens is not None:
        parts.append(f"{event.max_tokens} tokens")
    if event.max_cost is not None:
        parts.append(f"${event.max_cost:g}")
    for name, value in (
        ("max output tokens", event.max_output_tokens),
        ("temperature", event.temperature),
        ("model call timeout", event.llm_timeout),
    ):
        if value is not None:
            parts.append(f"{name} {value:g}")
    return ", ".join(parts)


def _python_summary(event: events.PythonOutput) -> str:
    """A cell's printed output, then its value (``→ 42``), its exception's last line, the
    files it saved, and whether it timed out or lost the interpreter's state."""
    parts = [event.content.strip()] if event.content.strip() else []
    if event.result is not None:
        parts.append(f"→ {event.result}")
    if event.exception:
        parts.append("raised " + event.exception.strip().splitlines()[-1])
    if event.files:
        parts.append("files: " + ", ".join(event.files))
    flags = [name for name, on in (("timed out", event.timed_out), ("state lost", event.state_lost)) if on]
    return (f"[{', '.join(flags)}] " if flags else "") + " ".join(parts)


def _ts(ts: dt.datetime) -> str:
    if ts.tzinfo is not None:
        ts = ts.astimezone(dt.UTC)
    return ts.strftime("%Y-%m-%d %H:%M:%S.") + f"{ts.microsecond // 1000:03d}"


def render(event: events.Event) -> Text:
    """One readable, coloured line for an event."""
    kind = event.kind if not isinstance(event, events.Unknown) else f"?{visible(event.original_kind)}"
    kind_style = "bold red" if isinstance(event, events.Error) else "bold" if isinstance(event, events.Action) else ""
    line = Text()
    line.append(f"{event.id or '':>6} ", style="bold")
    line.append(f"{_ts(event.ts)} ", style="dim")
    line.append(f"{visible(str(event.source)):<9} ", style=_SOURCE_STYLE.get(event.source, ""))
    line.append(f"{kind:<20} ", style=kind_style)
    if event.cause is not None:
        line.append(f"←{event.cause} ", style="dim")
    line.append(_one_line(_summary(event)))
    return line


def _id_list(ids: tuple[int, ...]) -> str:
    """``1, 2, 3, 7`` as ``1-3, 7``."""
    from riverbed.memory.view import id_runs  # noqa: PLC0415  (the commands that list ids load memory)

    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in id_runs(ids))

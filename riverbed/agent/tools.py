"""The LLM agent's tools: one per action kind, their JSON Schemas and the way back.

Each tool is named after its action kind (``cmd_run``, ``file_read`` …) and its parameters
are the action's own fields, with the JSON Schema derived from the msgspec Struct minus the
fields every event has (id, source, cause, ts, agent, tenant, trace, v) and the ``kind`` tag.
:func:`action_from_call` turns a model's tool call back into the action, refusing unknown
tools, arguments that are not a JSON object and fields of the wrong type.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import msgspec

from riverbed import events
from riverbed.errors import InputError

__all__ = ["ROLE_TOOL_ACTIONS", "TOOL_ACTIONS", "action_from_call", "tool_names", "tool_schema", "tools"]

#: The action kinds the agent may call, in the order the model sees them.
TOOL_ACTIONS: tuple[type[events.Action], ...] = (
    events.CmdRun,
    events.FileRead,
    events.FileWrite,
    events.FileEdit,
    events.PythonRun,
    events.Recall,
    events.Think,
    events.Finish,
)
#: The agent role's tools: those and ``delegate`` (sub-agents exist only where the role runs).
ROLE_TOOL_ACTIONS: tuple[type[events.Action], ...] = (*TOOL_ACTIONS[:-1], events.Delegate, events.Finish)

_ENVELOPE = frozenset(("kind", "id", "source", "cause", "ts", "agent", "tenant", "trace", "v", "tool_call_id", "risk"))
_OFFERED_APART = frozenset(("sub_agent",))
"""Fields a tool's schema leaves out: the toolbox adds them where the agent has them
(``delegate``'s ``sub_agent``, for an agent with sub-agents: ``riverbed.agent.toolbox``)."""

_TOOLS: dict[str, tuple[str, dict[str, str]]] = {
    "cmd_run": (
        "Run a bash command in the session's persistent shell (the directory and variables carry over). "
        "Returns the output and exit code.",
        {
            "command": "The command line; with is_input, the text to send to the running command (C-c interrupts).",
            "timeout": "Hard limit in seconds; the command is interrupted after it.",
            "is_input": "Send `command` as input to the command that is still running.",
            "blocking": "Wait for the command to end even when it is quiet for a while.",
            "cwd": "Directory to run in, relative to the workspace.",
        },
    ),
    "file_read": (
        "Read a text file of the workspace, optionally only some lines.",
        {
            "path": "Path relative to the workspace.",
            "start": "First line to read (1-based).",
            "end": "Last line to read (inclusive); null reads to the end.",
        },
    ),
    "file_write": (
        "Create or overwrite a file with the given content.",
        {"path": "Path relative to the workspace.", "content": "The whole new content of the file."},
    ),
    "file_edit": (
        "Edit a file: view it with line numbers, create it, replace a unique string, insert after a line, "
        "or undo the last edit.",
        {
            "command": "view, create, str_replace, insert or undo_edit.",
            "path": "Path relative to the workspace.",
            "file_text": "The content for create.",
            "old_str": "For str_replace: the exact text to replace; it must occur exactly once.",
            "new_str": "For str_replace and insert: the new text.",
            "insert_line": "For insert: the line number after which new_str is inserted (0: at the top).",
        },
    ),
    "python_run": (
        "Run Python code in the session's persistent Python process; the value of a trailing expression is returned.",
        {"code": "The cell to run.", "timeout": "Hard limit in seconds."},
    ),
    "recall": (
        "Search memory: semantic finds earlier events of this session (also those no longer in view), "
        "knowledge finds instructions on a topic, workspace_context describes the workspace.",
        {
            "query": "What to look for.",
            "recall_type": "semantic, knowledge or workspace_context.",
            "scope": "session (this session) or tenant (every session of the tenant).",
            "k": "How many results at most.",
        },
    ),
    "think": (
        "Write down reasoning without acting; use it to plan a hard step.",
        {"thought": "The reasoning."},
    ),
    "delegate": (
        "Hand a self-contained part of the work to a sub-agent: it works in a session of its own (its own "
        "workspace) with the same tools and returns its final message. Several delegate calls in one response "
        "run in parallel. Say everything it needs in the task.",
        {
            "task": "What the sub-agent should do and what it should report back, self-contained.",
            "max_steps": "At most this many model calls for the sub-agent.",
            "max_tokens": "At most this many tokens for the sub-agent (capped by its share of yours).",
            "max_cost": "At most this many USD for the sub-agent (capped by its share of yours).",
        },
    ),
    "finish": (
        "Finish the task: call this once the work is done and checked.",
        {
            "final_thought": "A short summary of what was done.",
            "outputs": "Results worth returning to the caller, as a JSON object.",
        },
    ),
}


def tool_names(kinds: tuple[type[events.Action], ...] = TOOL_ACTIONS) -> list[str]:
    return [events.kind_of(cls) for cls in kinds]


def tool_schema(cls: type[events.Action]) -> dict[str, Any]:
    """The JSON Schema of an action's own fields (the tool's parameters)."""
    kind = events.kind_of(cls)
    full = msgspec.json.schema(cls)
    defs: dict[str, Any] = full.get("$defs", {})
    ref = full.get("$ref", "")
    body = copy.deepcopy(defs[ref.rsplit("/", 1)[-1]] if ref else full)
    described = _TOOLS.get(kind, ("", {}))[1]
    properties: dict[str, Any] = {}
    for name, prop in body.get("properties", {}).items():
        if name in _ENVELOPE or name in _OFFERED_APART:
            continue
        properties[name] = {**prop, "description": described[name]} if name in described else prop
    schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "required": [r for r in body.get("required", []) if r not in _ENVELOPE],
        "additionalProperties": False,
    }
    others = {k: v for k, v in defs.items() if k != cls.__name__}
    if others:
        schema["$defs"] = others
    return schema


def tools(kinds: tuple[type[events.Action], ...] = TOOL_ACTIONS) -> list[dict[str, Any]]:
    """The ``tools`` parameter of a chat completion request (the ``kinds`` the model may call)."""
    out = []
    for cls in kinds:
        kind = events.kind_of(cls)
        out.append(
            {
                "type": "function",
                "function": {"name": kind, "description": _TOOLS[kind][0], "parameters": tool_schema(cls)},
            }
        )
    return out


_arguments = msgspec.json.Decoder(dict[str, Any])


@functools.lru_cache(maxsize=256)
def _by_kind(kinds: tuple[type[events.Action], ...]) -> dict[str, type[events.Action]]:
    """``kinds`` by their kind (each toolbox's, made once: a step turns a call into its action)."""
    return {events.kind_of(cls): cls for cls in kinds}


def action_from_call(name: str, arguments: str, kinds: tuple[type[events.Action], ...] = TOOL_ACTIONS) -> events.Action:
    """The action a tool call asks for (one of ``kinds``); :class:`InputError` says what is wrong with it."""
    classes = _by_kind(kinds)
    cls = classes.get(name)
    if cls is None:
        raise InputError(f"there is no tool {name!r}; the tools are {', '.join(classes)}")
    try:
        raw = _arguments.decode(arguments or "{}")
    except msgspec.DecodeError as exc:
        raise InputError(f"the arguments of {name} are not a JSON object: {exc}") from exc
    extra = sorted(set(raw) & _ENVELOPE)
    if extra:
        raise InputError(f"{name} does not take {', '.join(extra)}")
    try:
        action = msgspec.convert({**raw, "kind": name}, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise InputError(f"bad arguments for {name}: {exc}") from exc
    return action

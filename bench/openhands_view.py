"""The peer's side of ``bench.view``: the OpenHands SDK's fold and messages over a session.

Runs in the SDK's own environment (``.venv-openhands``, Python >= 3.12, ``openhands-sdk``),
not in riverbed's: it imports nothing of riverbed.  It reads a session as riverbed's JSON
lines (what ``riverbed export`` writes) from the file it is given, builds the same history
out of the SDK's events, one for one, and prints one JSON line of facts about it (the folded
view's length, and the view and messages of the events up to UNTIL).  Then it answers each
line on stdin with one JSON line, ``{"seconds": ...}``, the thread CPU of one:

- ``fold``: ``View.from_events`` over the whole history;
- ``messages``: ``LLMConvertibleEvent.events_to_messages`` of the view of the events up to
  UNTIL (what the SDK's agent does to its view before each model call);
- ``wire``: the same, then each message's ``to_chat_dict`` (the dicts sent to a chat
  completions API, which riverbed's ``to_messages`` returns).

The history, riverbed's event by event:

- a ``message``: a ``MessageEvent`` (the user's, or the agent's); a ``think`` without a tool
  call id (written before they existed) too, as the agent's;
- an ``llm_response``: an ``LLMCompletionLogEvent`` (the SDK's record of a completion; its
  text and calls go with the actions, as the SDK records them);
- an action: an ``ActionEvent``, its call and ``llm_response_id`` the response's (the
  response's text its ``thought``, on the response's first action); an action without a
  response (written before tool call ids) is a call of a response of its own;
  ``think`` is the SDK's ``ThinkAction``, and its ``ThinkObservation`` follows it (the SDK's
  think tool answers; riverbed's does not: the one SDK event without a riverbed one);
- an observation answering an action: the ``ObservationEvent`` answering that call, with the
  text the model reads;
- a ``condensation``: a ``Condensation`` forgetting the events of its ranges still in view
  and the previous summary (as the SDK's summarizing condenser does), its summary where
  riverbed puts it (after the events kept before the first one forgotten);
- anything else (``session_config``, ``run_started``): a ``ConversationStateUpdateEvent``,
  which the SDK's view leaves out as riverbed's prompt does.

Usage: ``python bench/openhands_view.py SESSION.jsonl UNTIL``.
"""

from __future__ import annotations

import gc
import json
import logging
import sys
import time
from typing import Any

from openhands.sdk import Message, TextContent
from openhands.sdk.context.view import View
from openhands.sdk.event import (
    ActionEvent,
    Condensation,
    ConversationStateUpdateEvent,
    LLMCompletionLogEvent,
    LLMConvertibleEvent,
    MessageEvent,
    ObservationEvent,
)
from openhands.sdk.event.base import Event
from openhands.sdk.llm import MessageToolCall
from openhands.sdk.tool import Action, Observation
from openhands.sdk.tool.builtins.think import ThinkAction, ThinkObservation


class ToolAction(Action):
    """A tool call of the history (its arguments as text)."""

    arguments: str


class ToolObservation(Observation):
    """A tool's result in the history."""


_ENVELOPE = ("id", "kind", "ts", "source", "cause", "tool_call_id", "agent", "tenant", "trace", "v")


def _text(text: str) -> list[TextContent]:
    return [TextContent(text=text)]


def _result(row: dict[str, Any]) -> str:
    """About the text riverbed shows the model for an observation."""
    text = row.get("content") or row.get("diff") or json.dumps({k: v for k, v in row.items() if k not in _ENVELOPE})
    if row.get("exit_code") is not None:
        text += f"\n[exit code {row['exit_code']}]"
    return str(text)


class _Converter:
    """riverbed's rows as the SDK's events, one for one (see the module docstring)."""

    def __init__(self) -> None:
        self.out: list[Event] = []
        self.responses: dict[int, dict[str, Any]] = {}  # llm_response id -> its row
        self.thought_given: set[int] = set()  # responses whose text went with an action
        self.calls: dict[int, tuple[str, str]] = {}  # action id -> (tool call id, tool name)
        self.shown: list[str] = []  # the SDK view's ids as its condensations leave them
        self.summary: str | None = None  # the id of the summary in view

    def add(self, row: dict[str, Any]) -> None:
        eid, kind = row["id"], row["kind"]
        if kind == "message" or (kind == "think" and not row.get("tool_call_id")):
            text = row.get("content") or row.get("thought") or ""
            role, source = ("user", "user") if row.get("source") == "user" else ("assistant", "agent")
            self._show(MessageEvent(id=str(eid), source=source, llm_message=Message(role=role, content=_text(text))))
        elif kind == "llm_response":
            self.responses[eid] = row
            log = json.dumps({k: row.get(k) for k in ("model", "content", "tool_calls", "usage")})
            self.out.append(LLMCompletionLogEvent(id=str(eid), filename=f"{eid}.json", log_data=log))
        elif kind == "condensation":
            self._condense(row)
        elif row.get("cause") in self.calls:
            call_id, name = self.calls[row["cause"]]
            observation = ToolObservation(content=_text(_result(row)), is_error=kind == "error")
            self._answer(eid, row["cause"], call_id, name, observation)
        elif kind in ("session_config", "run_started") or row.get("source") == "runtime":
            self.out.append(ConversationStateUpdateEvent(id=str(eid), key=kind, value=eid))
        else:
            self._action(row)

    def _action(self, row: dict[str, Any]) -> None:
        eid, kind = row["id"], row["kind"]
        response = self.responses.get(row.get("cause"))  # type: ignore[arg-type]
        raw = None
        if response is not None:
            raw = next((c for c in response["tool_calls"] if c.get("id") == row.get("tool_call_id")), None)
        if raw is not None:
            call_id, arguments = raw["id"], raw["function"]["arguments"]
            response_id = str(response["id"])  # type: ignore[index]
            first = response["id"] not in self.thought_given  # type: ignore[index]
            self.thought_given.add(response["id"])  # type: ignore[index]
            thought = _text(response["content"]) if first and response.get("content") else []  # type: ignore[union-attr]
        else:
            call_id, response_id, thought = f"call-{eid}", f"r{eid}", []
            arguments = json.dumps({k: v for k, v in row.items() if k not in _ENVELOPE})
        action: Action = ThinkAction(thought=row["thought"]) if kind == "think" else ToolAction(arguments=arguments)
        self.calls[eid] = (call_id, kind)
        self._show(
            ActionEvent(
                id=str(eid),
                thought=thought,
                action=action,
                tool_name=kind,
                tool_call_id=call_id,
                tool_call=MessageToolCall(id=call_id, name=kind, arguments=arguments, origin="completion"),
                llm_response_id=response_id,
            )
        )
        if kind == "think":
            self._answer(
                f"{eid}-logged", eid, call_id, kind, ThinkObservation.from_text("Your thought has been logged.")
            )

    def _answer(self, eid: object, action: int, call_id: str, name: str, observation: Observation) -> None:
        self._show(
            ObservationEvent(
                id=str(eid), tool_name=name, tool_call_id=call_id, action_id=str(action), observation=observation
            )
        )

    def _show(self, event: Event) -> None:
        self.out.append(event)
        self.shown.append(event.id)

    def _condense(self, row: dict[str, Any]) -> None:
        eid = row["id"]
        ranges = [(start, min(end, eid - 1)) for start, end in row["forgotten"] if start <= end]

        def forgotten(shown: str) -> bool:
            number = int(shown.split("-", maxsplit=1)[0]) if shown[0].isdigit() else 0
            return shown == self.summary or any(start <= number <= end for start, end in ranges)

        gone = {shown for shown in self.shown if forgotten(shown)}
        self.shown = [shown for shown in self.shown if shown not in gone]
        summary = row.get("summary")
        offset = None
        if summary:
            first = min((start for start, _ in ranges), default=eid)
            offset = sum(1 for shown in self.shown if shown[0].isdigit() and int(shown.split("-")[0]) < first)
            self.summary = f"{eid}-summary"
            self.shown.insert(offset, self.summary)
        self.out.append(
            Condensation(
                id=str(eid),
                forgotten_event_ids=gone,
                summary=summary or None,
                summary_offset=offset,
                llm_response_id=f"r{eid}",
            )
        )


def _messages(events: list[LLMConvertibleEvent]) -> list[Message]:
    return LLMConvertibleEvent.events_to_messages(events)


def _wire(events: list[LLMConvertibleEvent]) -> list[dict[str, Any]]:
    return [
        message.to_chat_dict(
            cache_enabled=False,
            vision_enabled=False,
            function_calling_enabled=True,
            force_string_serializer=False,
            send_reasoning_content=False,
        )
        for message in _messages(events)
    ]


def main() -> int:
    path, until = sys.argv[1], int(sys.argv[2])
    # The fold logs a warning when it drops an unmatched tool call; measured without the log.
    logging.getLogger("openhands").setLevel(logging.ERROR)
    converter = _Converter()
    prefix = 0
    with open(path, "rb") as rows:
        for line in rows:
            if line.strip():
                row = json.loads(line)
                converter.add(row)
                if row["id"] <= until:
                    prefix = len(converter.out)
    history = converter.out
    folded = View.from_events(history)
    before = View.from_events(history[:prefix]).events
    facts = {"events": len(history), "view_length": len(folded), "messages_view": len(before)}
    print(json.dumps({**facts, "messages": len(_messages(before))}), flush=True)
    work = {
        "fold": lambda: View.from_events(history),
        "messages": lambda: _messages(before),
        "wire": lambda: _wire(before),
    }
    gc.collect()
    for line in sys.stdin:
        started = time.thread_time()
        work[line.strip()]()
        print(json.dumps({"seconds": time.thread_time() - started}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

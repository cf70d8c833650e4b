"""The peer's side of ``bench.view``: the OpenHands SDK's ``View.from_events`` over a session.

Runs in the SDK's own environment (``.venv-openhands``, Python >= 3.12, ``openhands-sdk``),
not in riverbed's: it imports nothing of riverbed.  It reads a session as riverbed's JSON
lines on stdin (what ``riverbed export`` writes), builds the same history out of the SDK's
events, one for one, and prints one JSON object: the thread CPU of each fold in seconds and
the folded view's length.

- ``message`` and ``think``: a ``MessageEvent`` (user or agent);
- a runtime action (``cmd_run``, ``file_edit``, …): an ``ActionEvent``, one tool call of its
  own model response; its observation: the ``ObservationEvent`` answering that call;
- ``condensation``: a ``Condensation`` forgetting every id in its ranges, with the same
  summary and offset.

Usage: ``python bench/openhands_view.py REPEATS < session.jsonl``.
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
from openhands.sdk.event import ActionEvent, Condensation, MessageEvent, ObservationEvent
from openhands.sdk.event.base import Event
from openhands.sdk.llm import MessageToolCall
from openhands.sdk.tool import Action, Observation


class ToolAction(Action):
    """A tool call of the history (its arguments as text)."""

    arguments: str


class ToolObservation(Observation):
    """A tool's result in the history."""


def _text(text: str) -> list[TextContent]:
    return [TextContent(text=text)]


def convert(rows: list[dict[str, Any]]) -> list[Event]:
    out: list[Event] = []
    calls: dict[int, str] = {}  # riverbed action id -> tool call id
    for row in rows:
        eid, kind = str(row["id"]), row["kind"]
        if kind in ("message", "think"):
            text = row.get("content") or row.get("thought") or ""
            role, source = ("user", "user") if row.get("source") == "user" else ("assistant", "agent")
            out.append(MessageEvent(id=eid, source=source, llm_message=Message(role=role, content=_text(text))))
        elif kind == "condensation":
            forgotten = {str(i) for start, end in row["forgotten"] for i in range(start, min(end, row["id"] - 1) + 1)}
            out.append(
                Condensation(
                    id=eid,
                    forgotten_event_ids=forgotten,
                    summary=row.get("summary"),
                    summary_offset=row.get("summary_offset"),
                    llm_response_id=f"r{eid}",
                )
            )
        elif row.get("cause") in calls:
            call = calls[row["cause"]]
            out.append(
                ObservationEvent(
                    id=eid,
                    tool_name=kind,
                    tool_call_id=call,
                    action_id=str(row["cause"]),
                    observation=ToolObservation(content=_text(json.dumps(row))),
                )
            )
        else:
            call = calls[row["id"]] = f"call-{eid}"
            arguments = json.dumps({k: v for k, v in row.items() if k not in ("id", "kind", "ts", "source")})
            out.append(
                ActionEvent(
                    id=eid,
                    thought=[],
                    action=ToolAction(arguments=arguments),
                    tool_name=kind,
                    tool_call_id=call,
                    tool_call=MessageToolCall(id=call, name=kind, arguments=arguments, origin="completion"),
                    llm_response_id=f"r{eid}",
                )
            )
    return out


def main() -> int:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    # The fold logs a warning when it drops an unmatched tool call; measured without the log.
    logging.getLogger("openhands").setLevel(logging.ERROR)
    history = convert([json.loads(line) for line in sys.stdin.buffer.read().splitlines() if line.strip()])
    folded = View.from_events(history)  # (warm-up)
    seconds = []
    gc.collect()
    for _ in range(repeats):
        started = time.thread_time()
        View.from_events(history)
        seconds.append(time.thread_time() - started)
    json.dump({"fold_seconds": seconds, "view_length": len(folded), "events": len(history)}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

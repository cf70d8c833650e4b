"""Condensation by conversation: a model proposes what to drop from the context, the user decides.

::

    proposal = await suggest(log, "drop the detour about docker, keep the decisions", client=c, model="m")
    proposal.change.hidden      # the ids the proposal would hide (whole units, pins respected)
    await session.append(proposal.condensation, expected_last=proposal.last_id)   # only if accepted

The model sees the context as the agent does (visible events with their ids, the current
summary, which events are pinned) and the user's request, and answers with JSON::

    {"forget": [[12, 40], [45, 45]], "summary": "what the agent must still know of them"}

``summary`` may be null (no summary: the current one stays).  :func:`parse_proposal` checks the
answer against the context; anything else is refused with one sentence (an :class:`InputError`).

**Applied as a ``condensation`` event with ``source: user``** (not as a ``context_edit``): a
proposal is exactly what a condensation is (forgotten ranges, a summary and where it goes), so
the View folds it with the rules every condenser follows: pinned units stay, a batch is kept
or dropped whole, the summary replaces the previous one (the model is shown the previous
summary and asked to fold it in, as the summarizing condenser does) and sits where the first
forgotten event was.  ``riverbed context`` names it (``user condensation N``) and ``restore``
undoes it like any condensation.

Everything here but :func:`ask` is pure.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from riverbed.errors import InputError
from riverbed.events import Condensation, Event, with_id
from riverbed.memory.condensers import complete
from riverbed.memory.context import ContextChange, ContextReport, change, report
from riverbed.memory.tokens import event_text

if TYPE_CHECKING:
    from openai import AsyncOpenAI
    from openai.types.chat import ChatCompletionMessageParam

__all__ = ["SUGGEST_PROMPT", "Proposal", "parse_proposal", "proposal_messages", "suggest"]

SUGGEST_PROMPT = """\
You help a user manage the context of an AI agent that works on a task with tools. You see the
agent's context (each event as [id] kind (source): text; pinned events are marked and must be
kept) and the user's request about what to drop. Propose which events to remove and write a
summary that replaces the removed events and the previous summary, keeping the task, the
decisions, files and open problems the agent still needs.

Answer with JSON only, no prose: {"forget": [[first_id, last_id], ...], "summary": "text or null"}
Ranges are inclusive event ids taken from the context shown."""

EXCERPT = 1500
"""Characters of each event's text shown to the model."""


@dataclass(frozen=True, slots=True)
class Proposal:
    """What the model proposes, as the condensation that would apply it and what that would change."""

    condensation: Condensation
    last_id: int
    before: ContextReport
    after: ContextReport
    change: ContextChange
    model: str


def _excerpt(text: str) -> str:
    return text if len(text) <= EXCERPT else text[: EXCERPT - 20] + f" [... {len(text) - EXCERPT + 20} chars cut]"


def proposal_messages(log: Sequence[Event], request: str) -> list[ChatCompletionMessageParam]:
    """The chat messages asking for a proposal (pure)."""
    now = report(log)
    lines = []
    for e in now.view.real_events():
        pin = " [pinned]" if e.id in now.pinned else ""
        lines.append(f"[{e.id}] {e.kind} ({e.source}){pin}: {_excerpt(event_text(e))}")
    previous = now.view.summary.content if now.view.summary is not None else "(none)"
    return [
        {"role": "system", "content": SUGGEST_PROMPT},
        {
            "role": "user",
            "content": f"<previous_summary>\n{previous}\n</previous_summary>\n<context>\n"
            + "\n".join(lines)
            + f"\n</context>\n<request>\n{request}\n</request>",
        },
    ]


_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")


def parse_proposal(answer: str, log: Sequence[Event], *, model: str = "") -> Proposal:
    """The model's answer checked against the log; one sentence (InputError) when it is not valid."""
    text = _FENCE.sub("", answer.strip())
    try:
        raw = json.loads(text)
    except json.JSONDecodeError:
        raise InputError(f"the model's proposal is not JSON ({_excerpt(answer)[:200]!r})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("forget"), list):
        raise InputError('the model\'s proposal has no "forget" list of [first, last] event id ranges')
    last_id = next((e.id for e in reversed(log) if e.id is not None), 0)
    ranges: list[tuple[int, int]] = []
    for item in raw["forget"]:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in item)
        ):
            raise InputError(f"the model proposed {item!r}, which is not a range [first, last] of event ids")
        first, last = item
        if not 1 <= first <= last <= last_id:
            raise InputError(f"the model proposed the range {first}-{last}, which is not within events 1-{last_id}")
        ranges.append((first, last))
    summary = raw.get("summary")
    if summary is not None and not isinstance(summary, str):
        raise InputError("the model's proposed summary is not text")
    if not ranges:
        raise InputError("the model proposed to forget nothing")
    condensation = Condensation(source="user", forgotten=ranges, summary=summary.strip() if summary else None)
    before = report(log)
    after = report([*log, with_id(condensation, last_id + 1)])
    changed = change(before, after, last_id + 1)
    if not changed.hidden:
        raise InputError("the model's proposal hides nothing: its ranges hold no visible, unpinned event")
    return Proposal(condensation, last_id, before, after, changed, model)


async def suggest(
    log: Sequence[Event], request: str, *, client: AsyncOpenAI, model: str, timeout: float = 120.0
) -> Proposal:
    """Ask ``model`` for a proposal for ``request`` over ``log`` and check it."""
    if not request.strip():
        raise InputError("say what to drop, e.g. 'drop the detour about docker, keep the decisions'")
    answer = await complete(client, model, proposal_messages(log, request), timeout, who="the model")
    return parse_proposal(answer, log, model=model)

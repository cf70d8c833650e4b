"""A session's run as a pure fold of its log: open or ended, steps, tokens, cost, what is owed.

A client opens a run with a ``run_started`` event (its limits and model) after the task's user
``message``, and may append ``run_cancel``.  The agent role (``workers/agent_role.py``) works
on the run; everything it needs to decide its next move is here, folded from the log, never
from the memory of a worker::

    fold = RunFold(prices)
    for event in log_events:
        fold.add(event)
    fold.run            # the latest run (None: the session never had one)
    fold.run.state      # running | finished | failed | cancelled

A run ends with ``finish`` (finished), or with an ``error`` from ``source: agent`` whose
reason is in :data:`END_REASONS` (``cancelled``: cancelled, else failed).  In a fork, a run
that was open at the fork's point is not continued (its ``forked`` event ends it: cancelled).  Its steps are its
``llm_response`` events; tokens and cost are their recorded ``usage``, priced by
``RIVERBED_PRICES`` (a model without a price costs nothing that a cost limit could count:
:attr:`Run.priced` says so).

The tool calls of the run's last response are its *moves*: action ``i`` of the response is the
``i``-th action the agent appended with ``cause`` = the response (the role appends them one
by one, under its fencing token, each with an idempotency key naming the response and ``i``;
``delegate`` calls that follow one another go in one write, so their sub-agents run in
parallel).  A ``delegate_result`` adds the sub-agent's tokens and cost to the run's, and a
child session's header (``delegated``, event 1) says which parent action its first run
answers (:attr:`RunFold.reports_to`; ``riverbed/agent/delegation.py`` has the rules).
A response whose tool calls do not parse is answered by one ``error`` (reason
``bad_tool_call``) instead, and a response without tool calls by a ``finish``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import msgspec
from msgspec.structs import replace

from riverbed import events
from riverbed.agent.tools import ROLE_TOOL_ACTIONS, action_from_call
from riverbed.agent.usage import Price, step
from riverbed.bus.keys import valid_session
from riverbed.errors import InputError

__all__ = [
    "END_REASONS",
    "AppendAction",
    "AppendDelegates",
    "CallModel",
    "EndRun",
    "Move",
    "RejectCalls",
    "Run",
    "RunFold",
    "RunState",
    "RunSummary",
    "Wait",
    "child_session",
    "fold_runs",
    "is_child_id",
    "next_move",
    "planned_actions",
    "saved_summary",
    "summarize",
]

RunState = Literal["running", "finished", "failed", "cancelled"]

END_REASONS = frozenset({"step_limit", "budget_exhausted", "cancelled", "llm_error"})
"""Reasons of an ``error`` from ``source: agent`` that end a run."""


@dataclass
class Run:
    """One run of a session, as folded so far."""

    opened: int
    """the id of its ``run_started``"""
    model: str | None
    max_steps: int
    max_tokens: int | None
    max_cost: float | None
    opened_at: float = 0.0
    """when it opened (unix seconds)"""
    tenant: str | None = None
    task: int | None = None
    """the id of the last user message before it opened (its task)"""
    steps: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float = 0.0
    priced: bool = True
    """every step had a price (otherwise ``cost`` counts only those that had one)"""
    response: events.LlmResponse | None = None
    """the run's last ``llm_response`` (with its id)"""
    actions: list[events.Action] = field(default_factory=list)
    """the actions appended for that response, in call order"""
    rejected: bool = False
    """that response's tool calls did not parse, and an ``error`` said so"""
    answered: set[int] = field(default_factory=set)
    """ids of the run's actions that have their answer"""
    delegates: list[int] = field(default_factory=list)
    """ids of the run's ``delegate`` actions, in order (the fan-out limit counts them)"""
    refused: set[int] = field(default_factory=set)
    """ids of its ``delegate`` actions that a limit refused (no child session)"""
    delegate_calls: int = 0
    """how many ``delegate`` calls the last response holds (they share the budget left)"""
    spent_at_response: tuple[int, float] = (0, 0.0)
    """tokens and cost spent when the last response was recorded (what delegate shares divide)"""
    child_tokens: int = 0
    child_cost: float = 0.0
    """what the run's sub-agents spent, from their ``delegate_result`` events"""
    cancel_requested: int | None = None
    """the id of a ``run_cancel`` that came while it was open"""
    ended: int | None = None
    """the id of the event that ended it"""
    end_reason: str | None = None
    """``finish``, or the ending error's reason"""
    end_content: str = ""
    last_event: int = 0

    @property
    def open(self) -> bool:
        return self.ended is None

    @property
    def tokens(self) -> int:
        """Tokens spent by the run's model calls and by its sub-agents."""
        return self.prompt_tokens + self.completion_tokens + self.child_tokens

    @property
    def state(self) -> RunState:
        if self.ended is None:
            return "running"
        if self.end_reason == "finish":
            return "finished"
        return "cancelled" if self.end_reason in ("cancelled", "forked") else "failed"

    @property
    def unanswered(self) -> list[int]:
        """Ids of the last response's appended actions that still wait for their answer."""
        return [
            a.id
            for a in self.actions
            if a.id is not None and type(a).answered_by is not None and a.id not in self.answered
        ]

    @property
    def waiting_delegates(self) -> list[events.Delegate]:
        """The last response's ``delegate`` actions still waiting for their answer."""
        return [a for a in self.actions if isinstance(a, events.Delegate) and a.id not in self.answered]

    def over_limit(self) -> tuple[str, str] | None:
        """(reason, sentence) when the next model call would go past a limit, else None."""
        if self.steps >= self.max_steps:
            return "step_limit", f"the run stopped after {self.steps} model calls (its limit is {self.max_steps})"
        if self.max_tokens is not None and self.tokens >= self.max_tokens:
            return "budget_exhausted", f"the run used {self.tokens} tokens (its limit is {self.max_tokens})"
        if self.max_cost is not None and self.cost >= self.max_cost:
            return "budget_exhausted", f"the run spent {self.cost:.6f} USD (its limit is {self.max_cost:g} USD)"
        return None


class RunFold:
    """Incremental fold of a session's runs: :meth:`add` events in id order."""

    def __init__(self, prices: Mapping[str, Price] | None = None) -> None:
        self.prices = dict(prices or {})
        self.run: Run | None = None
        """the latest run (open or ended)"""
        self.runs = 0
        """how many runs the session had"""
        self.last = 0
        """the last event id folded"""
        self.delegated: events.Delegated | None = None
        """the session's ``delegated`` header (event 1 of a child session), None for a top-level one"""
        self.forked = False
        """the session is a fork (a forked child keeps its header but never answers the parent)"""
        self._delegated_run: int | None = None
        self._last_user_message: int | None = None

    def add(self, event: events.Event) -> None:
        event_id = event.id
        if event_id is None or event_id <= self.last:
            return
        self.last = event_id
        run = self.run
        if isinstance(event, events.Message) and event.source == "user":
            self._last_user_message = event_id
        if isinstance(event, events.Delegated) and event_id == 1:
            self.delegated = event
        if isinstance(event, events.Forked):
            self.forked = True
        if isinstance(event, events.RunStarted):
            if run is None or not run.open:
                if self.delegated is not None and self._delegated_run is None and self.runs == 0:
                    self._delegated_run = event_id
                self.run = Run(
                    opened=event_id,
                    model=event.model,
                    max_steps=event.max_steps,
                    max_tokens=event.max_tokens,
                    max_cost=event.max_cost,
                    opened_at=event.ts.timestamp(),
                    tenant=event.tenant,
                    task=self._last_user_message,
                    last_event=event_id,
                )
                self.runs += 1
            return
        if run is None or not run.open:
            return
        run.last_event = event_id
        match event:
            case events.Forked():
                # A fork copies the log up to a point, not the work in progress: a run open there
                # is not continued in the fork (a new run may be opened on it).
                run.ended, run.end_reason, run.end_content = event_id, "forked", "the session was forked mid-run"
            case events.RunCancel():
                if run.cancel_requested is None:
                    run.cancel_requested = event_id
            case events.LlmResponse():
                counted = step(event, event_id, self.prices)
                run.steps += 1
                run.prompt_tokens += counted.prompt_tokens
                run.completion_tokens += counted.completion_tokens
                if counted.cost is None:
                    run.priced = False
                else:
                    run.cost += counted.cost
                run.response = event
                run.actions = []
                run.rejected = False
                run.delegate_calls = sum(1 for call in event.tool_calls if _called(call) == "delegate")
                run.spent_at_response = (run.tokens, run.cost)
            case events.Finish() if event.source == "agent":
                self._own_action(run, event)
                run.ended, run.end_reason, run.end_content = event_id, "finish", event.final_thought
            case events.Error() if event.source == "agent" and event.reason in END_REASONS:
                run.ended, run.end_reason, run.end_content = event_id, event.reason, event.content
            case events.Error() if event.reason == "delegate_refused" and event.cause in run.delegates:
                run.answered.add(event.cause)
                run.refused.add(event.cause)
            case events.Error() if (
                event.source == "agent"
                and event.reason == "bad_tool_call"
                and run.response is not None
                and event.cause == run.response.id
            ):
                run.rejected = True
            case events.DelegateResult() if event.cause in run.delegates and event.cause not in run.answered:
                run.answered.add(event.cause)
                run.child_tokens += event.tokens
                if event.cost is None:
                    run.priced = False
                else:
                    run.child_cost += event.cost
                    run.cost += event.cost
            case events.Observation() if event.cause is not None:
                run.answered.add(event.cause)
            case events.Action() if event.source == "agent":
                self._own_action(run, event)

    @property
    def reports_to(self) -> tuple[str, int] | None:
        """(parent session, its ``delegate`` action) that the latest run answers when it ends:
        the run a child session was created for, unless the session is a fork."""
        header, run = self.delegated, self.run
        if header is None or self.forked or run is None or run.opened != self._delegated_run:
            return None
        return header.parent, header.parent_action

    @property
    def depth(self) -> int:
        """How many sessions are above this one (0: a top-level session)."""
        return self.delegated.depth if self.delegated is not None else 0

    @staticmethod
    def _own_action(run: Run, event: events.Action) -> None:
        if run.response is not None and event.cause == run.response.id:
            run.actions.append(event)
            if isinstance(event, events.Delegate) and event.id is not None:
                run.delegates.append(event.id)


def child_session(parent: str, action: int) -> str:
    """The id of the child session that ``parent``'s ``delegate`` action ``action`` creates:
    derived, so that a retry after a crash finds the child it created."""
    candidate = f"{parent}.sub{action}"
    if valid_session(candidate):
        return candidate
    # Too long for a session id (a deep tree of long ids): a digest of the parent stands in for it.
    return f"d{hashlib.sha256(parent.encode()).hexdigest()[:24]}.sub{action}"


_CHILD_ID = re.compile(r".*\.sub[0-9]+")


def is_child_id(session: str) -> bool:
    """Whether ``session`` has the shape of a child session's id (``<parent>.sub<N>``): such ids
    are the agent role's, since anyone who knows a session's id can tell its next children's."""
    return _CHILD_ID.fullmatch(session) is not None


def _called(call: object) -> str | None:
    function = call.get("function") if isinstance(call, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    return name if isinstance(name, str) else None


def fold_runs(log_events: Iterable[events.Event], prices: Mapping[str, Price] | None = None) -> RunFold:
    """The fold of a whole log (events with ids, in order)."""
    fold = RunFold(prices)
    for event in log_events:
        fold.add(event)
    return fold


class RunSummary(msgspec.Struct, kw_only=True):
    """What ``riverbed runs`` shows of a session's latest run, derived from its log: the agent
    role saves it at each move (``keys.run``); ``worker`` is its owner while it is open."""

    session: str
    tenant: str | None = None
    state: str = "running"
    steps: int = 0
    tokens: int = 0
    cost: float | None = None
    model: str | None = None
    worker: str | None = None
    opened: int = 0
    opened_at: float = 0.0
    ended: int | None = None
    reason: str | None = None
    detail: str = ""
    updated: float = 0.0
    parent: str | None = None
    """the session this one works for (a sub-agent's), None for a top-level run"""
    children: list[str] = msgspec.field(default_factory=list)
    """the sub-agents' sessions the run created"""


def saved_summary(raw: bytes | None) -> RunSummary | None:
    """The summary the agent role saved (None: none saved, or one that does not decode)."""
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw, type=RunSummary)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def summarize(
    session: str, run: Run, *, worker: str | None = None, model: str | None = None, parent: str | None = None
) -> RunSummary:
    return RunSummary(
        parent=parent,
        children=[child_session(session, d) for d in run.delegates if d not in run.refused],
        session=session,
        tenant=run.tenant,
        state=run.state,
        steps=run.steps,
        tokens=run.tokens,
        cost=run.cost if run.priced else None,
        model=run.model or model,
        worker=worker if run.open else None,
        opened=run.opened,
        opened_at=run.opened_at,
        ended=run.ended,
        reason=run.end_reason,
        detail=run.end_content[:500],
    )


# --- the next move ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Wait:
    """Nothing to do until the log moves: no open run, or an action waits for its answer."""


@dataclass(frozen=True)
class EndRun:
    """End the open run with an ``error`` from ``source: agent`` (``reason`` in END_REASONS)."""

    reason: str
    content: str


@dataclass(frozen=True)
class CallModel:
    """Every action of the last response is answered and no limit is reached: call the model."""


@dataclass(frozen=True)
class AppendAction:
    """Append call ``index`` of ``response`` (a ``finish`` made of its text when it has no calls)."""

    response: int
    index: int
    action: events.Action


@dataclass(frozen=True)
class AppendDelegates:
    """Append calls ``index``.. of ``response``: ``delegate`` calls that follow one another, in one
    write, so that their sub-agents run in parallel (each answered by its ``delegate_result``)."""

    response: int
    index: int
    actions: tuple[events.Delegate, ...]


@dataclass(frozen=True)
class RejectCalls:
    """The response's tool calls do not parse: one ``error`` (``bad_tool_call``) says why."""

    response: int
    content: str


Move = Wait | EndRun | CallModel | AppendAction | AppendDelegates | RejectCalls


def planned_actions(response: events.LlmResponse) -> tuple[list[events.Action], list[str]]:
    """The actions a response asks for, in call order (``cause`` = the response, with each
    call's ``tool_call_id``), and what is wrong with the calls that do not parse.  A response
    without tool calls asks for a ``finish`` with its text."""
    if not response.tool_calls:
        return [events.Finish(final_thought=response.content or "", cause=response.id)], []
    actions: list[events.Action] = []
    problems: list[str] = []
    for raw in response.tool_calls:
        function = raw.get("function") if isinstance(raw, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        arguments = function.get("arguments") if isinstance(function, Mapping) else None
        call_id = raw.get("id") if isinstance(raw, Mapping) else None
        try:
            action = action_from_call(
                str(name or ""), arguments if isinstance(arguments, str) else "{}", ROLE_TOOL_ACTIONS
            )
        except InputError as exc:
            problems.append(f"tool call {call_id}: {exc}")
            continue
        if isinstance(call_id, str) and call_id:
            action = replace(action, tool_call_id=call_id)
        actions.append(replace(action, cause=response.id))
    return actions, problems


def appended_with(response: events.LlmResponse) -> events.Action | None:
    """The action written in the same append as ``response`` (its ``id`` as it will be on the
    log): its first, unless its calls do not parse or the first is a ``delegate`` (those have
    moves of their own).  No crash can then come between a response and its first action."""
    planned, problems = planned_actions(response)
    if problems or not planned or isinstance(planned[0], events.Delegate):
        return None
    return planned[0]


def next_move(run: Run | None) -> Move:
    """What the agent does next for ``run``, decided from the fold alone."""
    if run is None or not run.open:
        return Wait()
    if run.cancel_requested is not None:
        return EndRun("cancelled", f"the run was cancelled (event {run.cancel_requested})")
    response = run.response
    if response is not None and response.id is not None:
        planned, problems = planned_actions(response)
        if problems:
            if not run.rejected:
                text = "; ".join(problems) + ". None of the tool calls of that response were run; call the tools again."
                return RejectCalls(response.id, text)
        else:
            if run.unanswered:
                return Wait()
            done = len(run.actions)
            if done < len(planned):
                together: list[events.Delegate] = []
                for action in planned[done:]:
                    if not isinstance(action, events.Delegate):
                        break
                    together.append(action)
                if together:
                    return AppendDelegates(response.id, done, tuple(together))
                return AppendAction(response.id, done, planned[done])
    over = run.over_limit()
    if over is not None:
        return EndRun(*over)
    return CallModel()

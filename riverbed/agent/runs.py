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

import datetime as dt
import hashlib
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from msgspec.structs import replace

from riverbed import events
from riverbed.agent.define import REFERENCE, Agent, StuckLimits
from riverbed.agent.toolbox import Toolbox, made_toolbox
from riverbed.agent.usage import Price, step
from riverbed.bus.keys import valid_session
from riverbed.errors import InputError
from riverbed.memory.tokens import action_arguments

__all__ = [
    "END_REASONS",
    "AppendAction",
    "AppendDelegates",
    "CallModel",
    "EndRun",
    "ListTools",
    "Move",
    "PendingCall",
    "RecallContext",
    "RefuseCall",
    "RejectCalls",
    "Run",
    "RunFold",
    "RunState",
    "RunSummary",
    "RunTool",
    "Wait",
    "child_session",
    "fold_runs",
    "is_child_id",
    "next_move",
    "planned_actions",
    "runs_here",
    "saved_summary",
    "stuck",
    "summarize",
]

RunState = Literal["running", "finished", "failed", "cancelled"]

END_REASONS = frozenset({"step_limit", "budget_exhausted", "cancelled", "llm_error", "stuck"})
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
    agent_name: str = "llm"
    """the hosted agent definition that works on it"""
    digest: str | None = None
    """the digest of that definition it runs on (None: whichever a worker hosts)"""
    rules: int = 1
    """the run rules' version it runs on"""
    listing: dict[str, int] = field(default_factory=dict)
    """MCP server -> the id of the ``mcp_list`` the run asked it with"""
    repeats: list[tuple[str, str]] = field(default_factory=list)
    """(call, result) of its answered calls since the last different one (stuck detection)"""
    errors: list[str] = field(default_factory=list)
    """the text of its calls' errors since the last call that did not fail"""
    idle: int = 0
    """responses in a row that called nothing but ``think``"""
    said: list[tuple[int, str]] = field(default_factory=list)
    """(id, text) of the user messages it works on: its task, and those that came while it ran"""
    recalls: dict[int, list[int]] = field(default_factory=dict)
    """user message -> the ids of the context recalls the agent asked for it"""
    recalled_at: dict[int, float] = field(default_factory=dict)
    """context recall -> when it was asked (unix seconds)"""
    confirm: events.Confirm | None = None
    """the run's approval policy (None: its agent's)"""
    secrets: tuple[str, ...] = ()
    """the names of its tenant's secrets it may use (its ``run_started``'s)"""
    approved: set[int] = field(default_factory=set)
    """calls a person approved"""
    refused_by_person: dict[int, str] = field(default_factory=dict)
    """calls a person rejected -> why"""
    paused: int | None = None
    """the id of the ``run_paused`` in force (None: not paused)"""

    def awaiting(self) -> list[events.Action]:
        """The last response's appended calls that wait for a person's decision."""
        waiting = set(self.unanswered)
        return [
            a
            for a in self.actions
            if a.id in waiting
            and a.awaits_approval
            and a.id not in self.approved
            and a.id not in self.refused_by_person
        ]

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

    def _waiting(self) -> Iterator[events.Action]:
        """The last response's appended actions that still wait for their answer."""
        return (
            a
            for a in self.actions
            if a.id is not None and type(a).answered_by is not None and a.id not in self.answered
        )

    @property
    def unanswered(self) -> list[int]:
        """Ids of the last response's appended actions that still wait for their answer."""
        return [a.id for a in self._waiting() if a.id is not None]

    @property
    def waits_for_sub_agents_only(self) -> bool:
        """Whether the last response's actions still waiting for an answer are all ``delegate``
        calls (and one is): the run has nothing to do until its sub-agents answer.  One pass and
        no lists: a pacing worker asks it of every session it owns, often."""
        waiting = False
        for a in self._waiting():
            if not isinstance(a, events.Delegate):
                return False
            waiting = True
        return waiting

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
        self.mcp: dict[str, events.McpTools] = {}
        """MCP server -> the tools it listed last (``mcp_tools``)"""
        self._delegated_run: int | None = None
        self._last_user_message: int | None = None
        self._last_user_text = ""
        self.first_user_message: int | None = None
        """the session's first user message (its context recall asks for the workspace's too)"""

    def add(self, event: events.Event) -> None:
        event_id = event.id
        if event_id is None or event_id <= self.last:
            return
        self.last = event_id
        run = self.run
        if isinstance(event, events.Message) and event.source == "user":
            self._last_user_message, self._last_user_text = event_id, event.content
            if self.first_user_message is None:
                self.first_user_message = event_id
            if run is not None and run.open:
                run.said.append((event_id, event.content))
        if isinstance(event, events.Delegated) and event_id == 1:
            self.delegated = event
        if isinstance(event, events.Forked):
            self.forked = True
        if isinstance(event, events.McpTools):
            self.mcp[event.server] = event
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
                    agent_name=event.agent_name if isinstance(event.agent_name, str) else "llm",
                    digest=event.digest if isinstance(event.digest, str) else None,
                    rules=event.rules if isinstance(event.rules, int) else 1,
                    confirm=None if isinstance(event.confirm, msgspec.UnsetType) else event.confirm,
                    secrets=tuple(event.secrets) if isinstance(event.secrets, list) else (),
                )
                if self._last_user_message is not None:
                    self.run.said.append((self._last_user_message, self._last_user_text))
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
            case events.RunUpgraded():
                run.digest, run.rules = event.digest, event.rules
            case events.Approval() if event.source == "user":
                for action in event.actions:
                    if action in run.approved or action in run.refused_by_person:
                        continue  # (the first decision on a call holds)
                    if event.decision == "approve":
                        run.approved.add(action)
                    else:
                        run.refused_by_person[action] = event.reason
            case events.RunPaused() if event.source == "user":
                run.paused = event_id
            case events.RunResumed() if event.source == "user":
                run.paused = None
            case events.McpList() if event.source == "agent":
                run.listing.setdefault(event.server, event_id)
            case events.Recall() if event.source == "agent" and any(m == event.cause for m, _ in run.said):
                run.recalls.setdefault(event.cause or 0, []).append(event_id)
                run.recalled_at[event_id] = event.ts.timestamp()
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
                thinking = [c for c in event.tool_calls if _called(c) != "think"]
                run.idle = run.idle + 1 if event.tool_calls and not thinking else 0
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
                _note_result(run, event)
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


def _note_result(run: Run, event: events.Observation) -> None:
    """Keep what stuck detection reads: the last answered calls and errors of the run."""
    action = next((a for a in run.actions if a.id == event.cause), None)
    if action is None:
        return
    call = f"{action.kind}:{_arguments_of(action)}"
    failed = isinstance(event, events.Error) or (isinstance(event, events.ToolResult) and event.is_error)
    text = event_text_of(event)
    result = f"{event.kind}:{text}"
    if run.repeats and run.repeats[-1] != (call, result):
        run.repeats.clear()
    run.repeats.append((call, result))
    del run.repeats[:-64]
    if failed:
        if run.errors and run.errors[-1] != text:
            run.errors.clear()
        run.errors.append(text)
        del run.errors[:-64]
    else:
        run.errors.clear()


def _arguments_of(action: events.Action) -> str:
    return msgspec.json.encode(action_arguments(action), order="sorted").decode()


def event_text_of(event: events.Observation) -> str:
    content = getattr(event, "content", None)
    return content if isinstance(content, str) else msgspec.json.encode(msgspec.to_builtins(event)).decode()


def stuck(run: Run, limits: StuckLimits) -> str | None:
    """Why the run counts as stuck (a sentence), or None: it repeats a call and its result,
    an error, or answers that do nothing but think (``StuckLimits``)."""
    if limits.repeats and len(run.repeats) >= limits.repeats:
        call = run.repeats[-1][0]
        return f"the run repeated the same call with the same result {len(run.repeats)} times ({call[:200]})"
    if limits.errors and len(run.errors) >= limits.errors:
        return f"the run got the same error {len(run.errors)} times in a row ({run.errors[-1][:200]})"
    if limits.idle and run.idle >= limits.idle:
        return f"the run answered {run.idle} times in a row without a call that acts"
    return None


def fold_runs(log_events: Iterable[events.Event], prices: Mapping[str, Price] | None = None) -> RunFold:
    """The fold of a whole log (events with ids, in order)."""
    fold = RunFold(prices)
    for event in log_events:
        fold.add(event)
    return fold


class PendingCall(msgspec.Struct, kw_only=True):
    """A call that waits for a person's approval (``riverbed approvals`` lists them)."""

    action: int
    tool: str
    arguments: str
    """the call's arguments as JSON, cut at 500 characters"""
    level: str
    reason: str
    since: float = 0.0


def pending_call(action: events.Action) -> PendingCall:
    risk = action.risk if isinstance(action.risk, events.Risk) else events.Risk(level="unknown")
    tool = action.tool if isinstance(action, events.ToolCall) else action.kind
    return PendingCall(
        action=action.id or 0,
        tool=tool,
        arguments=_arguments_of(action)[:500],
        level=risk.level,
        reason=risk.reason,
        since=action.ts.timestamp(),
    )


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
    agent: str = "llm"
    """the hosted agent that works on it"""
    awaiting: list[PendingCall] = msgspec.field(default_factory=list)
    """the calls that wait for a person's approval"""
    paused: bool = False


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
        agent=run.agent_name,
        awaiting=[pending_call(a) for a in run.awaiting()] if run.open else [],
        paused=run.open and run.paused is not None,
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


@dataclass(frozen=True)
class ListTools:
    """Ask an MCP server of the agent for its tools before the run's first model call uses it."""

    server: Any


@dataclass(frozen=True)
class RecallContext:
    """Ask the memory role what a user message calls for before the model reads it: the
    workspace's context (on the session's first user message) and the knowledge it triggers."""

    message: int
    text: str
    first: bool


@dataclass(frozen=True)
class RefuseCall:
    """A person rejected a call that waited for approval: answer it with an ``error`` the model reads."""

    action: int
    reason: str


@dataclass(frozen=True)
class RunTool:
    """Run an action the agent worker answers itself (a Python tool's ``tool_call``, a remote MCP
    server's call or listing), claimed first."""

    action: events.ToolCall | events.McpList


Move = (
    Wait
    | EndRun
    | CallModel
    | AppendAction
    | AppendDelegates
    | RejectCalls
    | ListTools
    | RecallContext
    | RefuseCall
    | RunTool
)


MAX_CALLS_PER_STEP = 32
"""The tool calls of one response that are run, unless the caller says otherwise
(``RIVERBED_AGENT_MAX_CALLS_PER_STEP``); the rest are answered by one error the model reads."""


PLANS_KEPT = 1024
"""Plans a toolbox keeps (``Toolbox.plans``): the responses of the steps in flight on a worker."""


def planned_actions(
    response: events.LlmResponse, toolbox: Toolbox | None = None, *, max_calls: int = MAX_CALLS_PER_STEP
) -> tuple[list[events.Action], list[str]]:
    """The actions a response asks for, in call order (``cause`` = the response, with each
    call's ``tool_call_id``), and what is wrong with the calls that do not parse.  A response
    without tool calls asks for a ``finish`` with its text.  ``toolbox`` is the agent's (the
    reference agent's when None).  Calls past ``max_calls`` are a problem of their own: the
    model is told how many it may make."""
    if not response.tool_calls:
        return [events.Finish(final_thought=response.content or "", cause=response.id)], []
    box = toolbox if toolbox is not None else made_toolbox(REFERENCE)
    key = (response.id, response.ts, max_calls)
    last = box.plans.get(key)
    if last is not None and last[0].tool_calls == response.tool_calls:
        # A step's moves ask for the same response's plan: its actions as made now (their stamp).
        now = dt.datetime.now(dt.UTC)
        return [replace(action, ts=now) for action in last[1]], list(last[2])
    actions, problems = _plan(response, box, max_calls)
    box.plans[key] = (response, actions, problems)
    if len(box.plans) > PLANS_KEPT:
        del box.plans[next(iter(box.plans))]
    return list(actions), list(problems)


def _plan(response: events.LlmResponse, box: Toolbox, max_calls: int) -> tuple[list[events.Action], list[str]]:
    actions: list[events.Action] = []
    problems: list[str] = []
    if len(response.tool_calls) > max_calls:
        problems.append(
            f"the response made {len(response.tool_calls)} tool calls; at most {max_calls} are run per response"
        )
        return actions, problems
    for raw in response.tool_calls:
        function = raw.get("function") if isinstance(raw, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        arguments = function.get("arguments") if isinstance(function, Mapping) else None
        call_id = raw.get("id") if isinstance(raw, Mapping) else None
        try:
            action = box.action(str(name or ""), arguments if isinstance(arguments, str) else "{}")
        except InputError as exc:
            problems.append(f"tool call {call_id}: {exc}")
            continue
        if isinstance(call_id, str) and call_id:
            action = replace(action, tool_call_id=call_id)
        actions.append(replace(action, cause=response.id))
    return actions, problems


def appended_with(response: events.LlmResponse, toolbox: Toolbox | None = None) -> events.Action | None:
    """The action written in the same append as ``response`` (its ``id`` as it will be on the
    log): its first, unless its calls do not parse or the first is a ``delegate`` (those have
    moves of their own).  No crash can then come between a response and its first action."""
    planned, problems = planned_actions(response, toolbox)
    if problems or not planned or isinstance(planned[0], events.Delegate):
        return None
    return planned[0]


def runs_here(action: events.Action) -> bool:
    """Whether the agent worker answers ``action`` itself (rather than another role, or a child)."""
    return isinstance(action, events.ToolCall | events.McpList) and action.answering_role == "agent"


def next_move(
    run: Run | None,
    agent: Agent | None = None,
    listed: Mapping[str, events.McpTools] | None = None,
    *,
    recalls: bool = False,
    first_message: int | None = None,
) -> Move:
    """What the agent does next for ``run``, decided from the fold alone (``agent``: its
    definition, the reference agent when None; ``listed``: the MCP listings of the log;
    ``recalls``: ask the memory role for each user message's context before the model reads
    it, ``first_message`` being the session's first user message)."""
    if run is None or not run.open:
        return Wait()
    if run.cancel_requested is not None:
        return EndRun("cancelled", f"the run was cancelled (event {run.cancel_requested})")
    if run.paused is not None:
        return Wait()
    definition = agent if agent is not None else REFERENCE
    response = run.response
    if response is not None and response.id is not None:
        toolbox = None if agent is None else made_toolbox(definition, listed)
        planned, problems = planned_actions(response, toolbox)
        if problems:
            if not run.rejected:
                text = "; ".join(problems) + ". None of the tool calls of that response were run; call the tools again."
                return RejectCalls(response.id, text)
        else:
            waiting = run.unanswered
            if waiting:
                for action in run.actions:
                    if action.id not in waiting or action.id is None:
                        continue
                    if action.id in run.refused_by_person:
                        return RefuseCall(action.id, run.refused_by_person[action.id])
                    if action.awaits_approval and action.id not in run.approved:
                        continue
                    if runs_here(action):
                        assert isinstance(action, events.ToolCall | events.McpList)
                        return RunTool(action)
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
    if recalls:
        for message, text in run.said:
            recalled = run.recalls.get(message)
            if recalled is None:
                return RecallContext(message, text, message == first_message)
            if any(a not in run.answered for a in recalled):
                return Wait()
    for server in definition.mcp:
        name = getattr(server, "name", "")
        asked = run.listing.get(name)
        if asked is None:
            return ListTools(server)
        if asked not in run.answered:
            return Wait()
    over = run.over_limit()
    if over is not None:
        return EndRun(*over)
    why = stuck(run, definition.stuck)
    if why is not None:
        return EndRun("stuck", why)
    return CallModel()

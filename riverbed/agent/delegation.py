"""Sub-agents: the rules of a ``delegate``, as pure functions of the parent's run fold.

A run's model calls ``delegate`` (a ``task``, optional ``max_steps`` / ``max_tokens`` /
``max_cost``); the agent role (``workers/agent_role.py``) appends the action, then creates a
child session whose log begins::

    1 delegated   parent=<parent session> parent_action=<the delegate's id> depth=<d>
    2 message     the task (source: user)
    3 run_started the child's limits and the parent's model

That append announces the child to the agent role like any run.  When the child's run ends,
its owner answers the parent's ``delegate`` once with a ``delegate_result`` (:func:`result`).

- **Ids.** :func:`~riverbed.agent.runs.child_session` derives the child's id from the parent's and the action's id,
  so a retry after a crash finds the child it created (its log is created with
  ``expected_last=0``: only once).
- **Limits.** A session at depth ``d`` (top-level runs: 0) may delegate only while ``d + 1 <=
  max_depth``; a run hands out at most ``max_fanout`` tasks (its ``delegate`` actions, counted
  in order).  Past either, the ``delegate`` is answered by an ``error`` (reason
  ``delegate_refused``) that tells the model to do the work itself.
- **Budget shares.** The ``n`` delegate calls of one response share what the parent's limits had
  left when that response was recorded: each child gets at most ``1/n`` of the tokens and cost
  left (and the model's own ``max_tokens`` / ``max_cost`` when smaller); ``max_steps`` is the
  model's or the parent's, at most the parent's (steps bound one loop, they are not spent from
  a shared pool).  A child's ``delegate_result`` carries what it (and its own sub-agents) spent,
  which the parent's fold adds to its own: the tree as a whole stays within the top-level
  limits, give or take one model call per run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from riverbed import events
from riverbed.agent.runs import Run, RunFold, child_session

__all__ = ["REFUSED", "ChildPlan", "child_session", "plan_child", "refusal", "result"]

REFUSED = "delegate_refused"
"""The reason of the ``error`` that answers a ``delegate`` a limit refuses."""


@dataclass(frozen=True)
class ChildPlan:
    """The child session a ``delegate`` creates, and its run's limits."""

    session: str
    header: events.Delegated
    task: events.Message
    started: events.RunStarted


def refusal(fold: RunFold, run: Run, action: events.Delegate, *, max_depth: int, max_fanout: int) -> str | None:
    """Why ``action`` creates no sub-agent (one sentence for the model), or None when it may."""
    depth = fold.depth
    if depth >= max_depth:
        where = "this run is a top-level one" if depth == 0 else f"this session is {depth} levels below its top run"
        return (
            f"delegate refused: {where}, and sub-agents go at most {max_depth} levels deep "
            "(RIVERBED_AGENT_MAX_DEPTH); do this task yourself"
        )
    if action.id is not None and action.id in run.delegates and run.delegates.index(action.id) >= max_fanout:
        return (
            f"delegate refused: this run has handed out {max_fanout} tasks already, the most one run may "
            "(RIVERBED_AGENT_MAX_FANOUT); do this task yourself"
        )
    tokens, cost = _shares(run)
    if tokens is not None and tokens < 1:
        return "delegate refused: this run has no tokens left to share with a sub-agent; finish with what you have"
    if cost is not None and cost <= 0:
        return "delegate refused: this run has no budget left to share with a sub-agent; finish with what you have"
    return None


def plan_child(session: str, fold: RunFold, run: Run, action: events.Delegate) -> ChildPlan:
    """The child session of ``action`` (a ``delegate`` of ``session``'s open run) and its limits."""
    assert action.id is not None
    tokens, cost = _shares(run)
    max_steps = min(action.max_steps or run.max_steps, run.max_steps)
    return ChildPlan(
        session=child_session(session, action.id),
        header=events.Delegated(parent=session, parent_action=action.id, depth=fold.depth + 1),
        task=events.Message(content=action.task, source="user"),
        started=events.RunStarted(
            model=run.model,
            max_steps=max_steps,
            max_tokens=_smaller(action.max_tokens, tokens),
            max_cost=_smaller(action.max_cost, cost),
        ),
    )


def _shares(run: Run) -> tuple[int | None, float | None]:
    """Each delegate call's share of the tokens and cost the run had left at its last response
    (None: the run has no such limit)."""
    siblings = max(1, run.delegate_calls)
    spent_tokens, spent_cost = run.spent_at_response
    tokens = None if run.max_tokens is None else (run.max_tokens - spent_tokens) // siblings
    cost = None if run.max_cost is None else (run.max_cost - spent_cost) / siblings
    return tokens, cost


_Number = TypeVar("_Number", int, float)


def _smaller(asked: _Number | None, share: _Number | None) -> _Number | None:
    if asked is None:
        return share
    if share is None:
        return asked
    return min(asked, share)


def result(session: str, run: Run, cause: int) -> events.DelegateResult:
    """The ``delegate_result`` that answers the parent's action ``cause`` once ``run`` (the
    child ``session``'s) ended."""
    if run.end_reason == "finish":
        content = run.end_content or "(the sub-agent finished without a final message)"
    else:
        content = f"the sub-agent's run ended with {run.end_reason}: {run.end_content}"
    return events.DelegateResult(
        cause=cause,
        session=session,
        content=content,
        state=run.state,
        tokens=run.tokens,
        cost=run.cost if run.priced else None,
    )

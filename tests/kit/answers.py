"""The one check of the guarantee "every action answered exactly once"."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from riverbed import events
from riverbed.client.session import Bus


def runtime_action(event: events.Event) -> bool:
    """An action the runtime role answers (a command, a file operation, a Python cell...)."""
    return isinstance(event, events.Action) and type(event).answered_by == "runtime"


def answers_of(log: Sequence[events.Event], is_action: Callable[[events.Event], bool]) -> dict[int, list[events.Event]]:
    """Each action of ``log`` that ``is_action`` picks (by id, in log order) -> the observations
    the log holds for it (each one whose ``cause`` is that id)."""
    out: dict[int, list[events.Event]] = {e.id: [] for e in log if e.id is not None and is_action(e)}
    for event in log:
        if isinstance(event, events.Observation) and event.cause in out:
            out[event.cause].append(event)
    return out


def assert_answered_once(
    log: Sequence[events.Event], is_action: Callable[[events.Event], bool] = runtime_action, *, where: str = "the log"
) -> dict[int, events.Event]:
    """Every action of ``log`` that ``is_action`` picks has exactly one answer; returns action
    id -> its answer, in log order."""
    answers = answers_of(log, is_action)
    wrong = {action: got for action, got in answers.items() if len(got) != 1}
    assert not wrong, f"{where}: actions not answered exactly once (action -> its answers): {wrong}"
    return {action: got[0] for action, got in answers.items()}


async def check_exactly_one_answer(bus: Bus, session_id: str) -> list[events.Event]:
    """Every runtime action in the session's log has exactly one answer; returns the log."""
    log = await bus.session(session_id).events()
    assert_answered_once(log, runtime_action, where=f"session {session_id}")
    return log

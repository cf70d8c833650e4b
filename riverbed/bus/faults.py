"""Named crash (and pause) points for the fault suite.

``RIVERBED_CRASH_AT=<point>[:<n>]`` makes the process SIGKILL itself the n-th time (default
the first) it passes ``crashpoint(<point>)``; ``RIVERBED_PAUSE_AT=<point>[:<n>]`` makes it
SIGSTOP itself there instead (a GC stall, a frozen VM: the test sends SIGCONT).  Unset
(always, in production) the check is one comparison.  Points: ``after_read``,
``after_claim``, ``start_gate`` (each check before a start), ``after_start_gate`` (a check that let
the start through), ``after_side_effect``, ``after_append``, ``before_ack``, ``during_renew`` (a
renewal round with a lease to renew), ``after_index``; the agent role's ``agent_before_llm``,
``agent_after_response``, ``agent_between_actions``, ``agent_delegating`` (before each child
session is made sure of), ``agent_creating`` (its checks passed, the child's session not made
yet) and ``agent_reporting`` (before a child's ``delegate_result`` goes to its parent), and
``model_connected`` (the model client connected, its request not yet sent) and ``model_sending``
(before the model client writes a request, and after each part it wrote, the request not yet
complete).
"""

from __future__ import annotations

import os
import signal


def _parse(spec: str) -> tuple[str, int]:
    point, _, nth = spec.partition(":")
    return point, int(nth or 1) if point else 0


_points: dict[str, list[int]] = {}
for _variable, _signal in (("RIVERBED_CRASH_AT", signal.SIGKILL), ("RIVERBED_PAUSE_AT", signal.SIGSTOP)):
    _point, _remaining = _parse(os.environ.get(_variable, ""))
    if _point:
        _points[_point] = [_remaining, _signal]


def crashpoint(name: str) -> None:
    if not _points:
        return
    armed = _points.get(name)
    if armed is None:
        return
    armed[0] -= 1
    if armed[0] == 0:
        os.kill(os.getpid(), armed[1])


def armed(name: str) -> bool:
    """Whether ``crashpoint(name)`` may stop the process (never, in production)."""
    return name in _points

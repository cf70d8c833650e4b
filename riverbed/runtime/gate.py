"""The start gate: the last check before an action's side effect begins.

The runtime role claims an action before it runs it (``bus/action_claims.py``), but a worker can be
paused anywhere (a GC stall, a frozen VM, SIGSTOP), also between that claim and the moment the
sandbox starts the command, while a peer takes the session over.  So the sandbox calls
:func:`before_start` right before it starts a side effect (writes the command to the shell,
sends a cell, writes a file), and the check the worker set with :func:`gated` decides: it
returns at once while the claim is fresh, claims again when it is not, and raises when the
worker may no longer start the action.  The sandbox turns that exception into an ``error``
observation, which a worker that lost the session cannot append.

What the check returns is a deadline, the moment (``time.monotonic()``) after which no peer can
be ruled out any more.  The worker's own check cannot cover what happens after it: the worker
may be paused between the check and the write, and the sandbox's process may get the command
late on a loaded machine.  So the deadline travels with the command, and the process inside the
sandbox that starts it (the shell, the Python driver) refuses to start it once the deadline has
passed; the sandbox then goes through the gate again (:data:`LATE_TRIES` times at most).  The
worker's own side effects (a file write or edit, done in a worker thread) check the deadline the
same way right before they take effect (:func:`starting_by`, :func:`in_time`).

Outside a worker (tests, a runtime used on its own) no check is set and the gate is open.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar

__all__ = ["LATE_TRIES", "LateStart", "before_start", "boottime_centiseconds", "gated", "in_time", "starting_by"]

Check = Callable[[], Awaitable[float]]
_check: ContextVar[Check | None] = ContextVar("riverbed_start_gate", default=None)
_deadline: ContextVar[float | None] = ContextVar("riverbed_start_deadline", default=None)

LATE_TRIES = 5
"""How many times a start refused for lateness goes through the gate again before the action
is answered with a retryable error."""


@contextlib.contextmanager
def gated(check: Check) -> Iterator[None]:
    """Run the block with ``check`` as the gate of every start in it (this task only)."""
    token = _check.set(check)
    try:
        yield
    finally:
        _check.reset(token)


async def before_start() -> float | None:
    """Wait for the gate, or raise when the action must not start; the deadline
    (``time.monotonic()``) by which the start must begin, None when no gate is set."""
    check = _check.get()
    if check is None:
        return None
    return await check()


def boottime_centiseconds(deadline: float) -> int:
    """``deadline`` (``time.monotonic()``) on the clock of ``/proc/uptime`` (CLOCK_BOOTTIME), in
    whole hundredths of a second, rounded down: what a shell compares its uptime with."""
    return int((time.clock_gettime(time.CLOCK_BOOTTIME) + deadline - time.monotonic()) * 100)


class LateStart(Exception):
    """A side effect found, right before it would have taken effect, that its deadline had passed."""


@contextlib.contextmanager
def starting_by(deadline: float | None) -> Iterator[None]:
    """Let the side effects in the block (in the threads it starts too) take effect only by
    ``deadline`` (``time.monotonic()``; None: whenever)."""
    token = _deadline.set(deadline)
    try:
        yield
    finally:
        _deadline.reset(token)


def in_time() -> None:
    """Raise :class:`LateStart` when the block's deadline has passed: the last statement before
    a side effect takes effect."""
    deadline = _deadline.get()
    if deadline is not None and time.monotonic() >= deadline:
        raise LateStart

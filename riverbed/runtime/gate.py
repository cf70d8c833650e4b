"""The start gate: the last check before an action's side effect begins.

The runtime role claims an action before it runs it (``bus/claims.py``), but a worker can be
paused anywhere (a GC stall, a frozen VM, SIGSTOP), also between that claim and the moment the
sandbox starts the command, while a peer takes the session over.  So the sandbox calls
:func:`before_start` right before it starts a side effect (writes the command to the shell,
sends a cell, writes a file), with nothing awaited in between, and the check the worker set
with :func:`gated` decides: it returns at once while the claim is fresh, claims again when it
is not, and raises when the worker may no longer start the action.  The sandbox turns that
exception into an ``error`` observation, which a worker that lost the session cannot append.

Outside a worker (tests, a runtime used on its own) no check is set and the gate is open.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar

__all__ = ["before_start", "gated"]

Check = Callable[[], Awaitable[None]]
_check: ContextVar[Check | None] = ContextVar("riverbed_start_gate", default=None)


@contextlib.contextmanager
def gated(check: Check) -> Iterator[None]:
    """Run the block with ``check`` as the gate of every start in it (this task only)."""
    token = _check.set(check)
    try:
        yield
    finally:
        _check.reset(token)


async def before_start() -> None:
    """Wait for the gate, or raise when the action must not start.  Cheap when it is open."""
    check = _check.get()
    if check is not None:
        await check()

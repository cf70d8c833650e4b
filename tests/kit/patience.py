"""How long a test waits for something, on this machine now: the one place every bound of the
kit's waits (a worker ready, an answer, a run's end, a server listening) and each test's own
timeout comes from.

A bound is a failure bound, never a speed: it is what a wait may take before the test says the
thing it waits for is broken.  On a busy machine everything takes longer (a worker's start, a
model load, a sandbox), so a bound written for a quiet one is multiplied by :func:`patience`:
the machine's load per CPU (``os.getloadavg()``'s last minute over the CPUs this process may
use), at least 1, at most :data:`MOST`.  ``RIVERBED_TEST_PATIENCE`` sets the factor instead
(``1`` for the bounds as written, ``4`` for a machine known to be slow).

What a wait can see failing it reports at once, whatever its bound: a worker process that
exited is reported by :meth:`~tests.kit.workers.WorkerProcess.wait_ready` when it exits, not
when the bound runs out.
"""

from __future__ import annotations

import os

__all__ = ["ENV", "MOST", "patience", "within"]

ENV = "RIVERBED_TEST_PATIENCE"
MOST = 6.0
"""The largest factor the load gives (a machine busier than that is not one tests can tell apart
from a hang)."""


def patience() -> float:
    """The factor a bound is multiplied by now: ``$RIVERBED_TEST_PATIENCE``, else the load per CPU
    between 1 and :data:`MOST`."""
    given = os.environ.get(ENV)
    if given:
        try:
            factor = float(given)
        except ValueError:
            raise ValueError(f"{ENV}={given!r} is not a number") from None
        if not factor > 0:
            raise ValueError(f"{ENV}={given!r} must be above 0")
        return factor
    try:
        load = os.getloadavg()[0]
    except OSError:  # (no load average on this system)
        return 1.0
    return min(max(load / _cpus(), 1.0), MOST)


def within(seconds: float) -> float:
    """``seconds`` as a bound on this machine now (multiplied by :func:`patience`)."""
    return seconds * patience()


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # (not on Linux)
        return os.cpu_count() or 1

"""Loops that keep failing, remembered so that the worker says so instead of retrying silently.

A role's loops (intake, reclaim, renew) retry forever: Redis comes back, a lost consumer
group is rebuilt, a permission is granted again.  Retrying in silence would hide an outage,
so each loop records a failed round here and clears the record with its next good round.
While a record stands, the worker's ``/readyz`` answers 503 naming the loop, its last error
and since when, and the heartbeat publishes the records for ``riverbed status``.

The record also paces the retries: :attr:`Failure.retry_in` grows with the failures in a row
(the shared schedule of ``bus/backoff.py``: 0.1 s, doubling, at most :data:`MAX_RETRY_SECONDS`,
jittered), so a loop that keeps failing neither spins nor waits long once the cause is gone.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from riverbed.bus.backoff import delay

__all__ = ["MAX_RETRY_SECONDS", "Failure", "Failures"]

FIRST_RETRY_SECONDS = 0.1
MAX_RETRY_SECONDS = 1.0


@dataclass(frozen=True)
class Failure:
    """A loop's current run of failed rounds."""

    error: str
    """The last round's error."""
    since: float
    """Unix time of the first failed round of the run."""
    attempts: int
    """Failed rounds in a row."""
    retry_in: float
    """How long the loop waits before its next round (drawn once, so the log says the wait)."""

    def reason(self, role: str, loop: str) -> str:
        """One sentence for ``/readyz``."""
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since))
        return f"{role} {loop} failing since {since} ({self.attempts} attempts): {self.error}"


class Failures:
    """The failing loops of one role in one worker, by loop name."""

    def __init__(self) -> None:
        self._current: dict[str, Failure] = {}

    def record(self, loop: str, exc: BaseException) -> Failure:
        """Note a failed round of ``loop``; returns its run so far."""
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        previous = self._current.get(loop)
        attempts = previous.attempts + 1 if previous else 1
        failure = Failure(
            error=error,
            since=previous.since if previous else time.time(),
            attempts=attempts,
            retry_in=delay(attempts, first=FIRST_RETRY_SECONDS, cap=MAX_RETRY_SECONDS),
        )
        self._current[loop] = failure
        return failure

    def clear(self, loop: str) -> None:
        """A round of ``loop`` went well."""
        self._current.pop(loop, None)

    def current(self) -> dict[str, Failure]:
        return dict(self._current)

    def as_json(self) -> dict[str, dict[str, Any]]:
        return {loop: asdict(failure) for loop, failure in self._current.items()}

"""Asking a model again: one retry policy, a value, for every place that calls a model.

::

    policy = RetryPolicy(budget=settings.agent_llm_retry_seconds)
    answer = await retrying(policy, lambda: client.chat_completion(body))

A call fails with a *model error* (:func:`is_model_error`: a timeout, an error of the client
library, a :class:`ModelError` of riverbed's own, or :class:`Saturated`, the shared limits saying
"not now"); any other exception is the caller's and goes through untouched.  A model error is
retried when :func:`retryable` says so:

- the server could not be reached, or the connection broke before the whole answer came
  (refused, reset, closed mid-answer: the client library's ``APIConnectionError``), or the
  answer came cut short (not JSON: ``APIResponseValidationError``);
- no answer within the call's time limit (``TimeoutError``);
- HTTP 408, 409, 429 and every 5xx (the statuses OpenAI's own client retries);
- :class:`Saturated`: the model's shared limits (``agent/throttle.py``) have no room now.

Every other status (400, 401, 403, 404, 422 …) ends the retries at once: asking again gets
the same answer.  The pause before a retry is the server's ``Retry-After`` (or
``retry-after-ms``) when it gave one, :attr:`Saturated.wait` for the shared limits, else
exponential backoff: ``first`` seconds, times ``factor`` after each failure, at most ``cap``,
with "equal jitter" (each pause is drawn between half and all of its step).

The budget is counted from the first failure, not from the first try: a server that is down
fails each try in a millisecond and is retried for ``budget`` seconds; a server that drops the
connection a minute into an answer (a small model on a CPU) is retried for as long, the tries
themselves included.  A retry is not made when its pause would end past the budget; the last
error is then raised inside :class:`GaveUp`, with how many tries were made.
"""

from __future__ import annotations

import email.utils
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import anyio

__all__ = [
    "GaveUp",
    "ModelError",
    "RetryPolicy",
    "Saturated",
    "is_model_error",
    "retry_after",
    "retryable",
    "retrying",
]

T = TypeVar("T")

RETRYABLE_STATUSES = frozenset({408, 409, 429})
"""The 4xx statuses that are retried (with every 5xx)."""


class Saturated(Exception):
    """The model's shared limits have no room for this call now: try again in ``wait`` seconds."""

    def __init__(self, message: str, wait: float) -> None:
        super().__init__(message)
        self.wait = wait


class ModelError(Exception):
    """A model's answer that riverbed refuses itself (not an error of the client library)."""


def _library() -> Any:
    """The OpenAI client library, or None while nothing in this process has loaded it.

    A worker that asks its model through its own HTTP client loads the library (a second of CPU
    on these VMs) only when it makes one of the library's errors: until then, no exception can
    be one of them."""
    return sys.modules.get("openai")


def is_model_error(exc: BaseException) -> bool:
    """Whether a model call's exception says the model did not answer (anything else is not the
    model's): a timeout, :class:`Saturated`, a :class:`ModelError`, or an error of the client
    library."""
    if isinstance(exc, TimeoutError | Saturated | ModelError):
        return True
    library = _library()
    return library is not None and isinstance(exc, library.OpenAIError)


def retryable(exc: BaseException) -> bool:
    """Whether a model error is worth another try (see the module docstring)."""
    if isinstance(exc, TimeoutError | Saturated):
        return True
    library = _library()
    if library is not None and isinstance(exc, library.APIConnectionError | library.APIResponseValidationError):
        return True
    status = getattr(exc, "status_code", None)
    return isinstance(status, int) and (status in RETRYABLE_STATUSES or status >= 500)


def retry_after(exc: BaseException, now: float | None = None) -> float | None:
    """The seconds the server asked to wait before the next try (``retry-after-ms``, else
    ``Retry-After`` in seconds or as an HTTP date), :attr:`Saturated.wait`; None when neither."""
    if isinstance(exc, Saturated):
        return exc.wait
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    if headers is None:
        return None
    raw_ms = headers.get("retry-after-ms")
    if raw_ms:
        try:
            return max(0.0, float(raw_ms) / 1000)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How a model call is retried (see the module docstring)."""

    budget: float = 60.0
    """seconds, from the first failure, within which a retry may still be made"""
    first: float = 0.5
    """the first backoff step (seconds)"""
    factor: float = 2.0
    """how much each backoff step grows"""
    cap: float = 5.0
    """the largest backoff step (a server's ``Retry-After`` may ask for longer)"""
    retryable: Callable[[BaseException], bool] = retryable
    """which model errors are retried"""

    def backoff(self, failures: int) -> float:
        """The pause after ``failures`` failed tries in a row (1 or more), with equal jitter."""
        step = min(self.first * self.factor ** min(max(failures - 1, 0), 60), self.cap)
        return step / 2 + random.uniform(0, step / 2)

    def pause(self, exc: BaseException, failures: int) -> float:
        """The pause before the next try after ``exc``, the ``failures``-th backoff otherwise."""
        asked = retry_after(exc)
        return self.backoff(failures) if asked is None else asked


class GaveUp(Exception):
    """No more tries: ``error`` (the last model error) was not retryable (``why`` ``final``),
    or the next try would start past the budget (``budget``)."""

    def __init__(self, error: BaseException, tries: int, why: Literal["final", "budget"], pause: float = 0.0) -> None:
        super().__init__(str(error) or type(error).__name__)
        self.error = error
        self.tries = tries
        """the calls made that reached for the model (a :class:`Saturated` wait is not a try)"""
        self.why = why
        self.pause = pause
        """the pause the next try would have needed"""


Wait = Callable[[BaseException, float], Awaitable[None]]


async def _sleep(_exc: BaseException, seconds: float) -> None:
    await anyio.sleep(seconds)


async def retrying(policy: RetryPolicy, call: Callable[[], Awaitable[T]], *, wait: Wait = _sleep) -> T:
    """``await call()`` until it answers, by ``policy``; :class:`GaveUp` when it stops trying.

    ``wait(error, seconds)`` makes each pause (by default a sleep): a caller that must stop
    waiting (its run was cancelled) raises from it, and that exception goes through."""
    tries = failures = 0
    failing_since: float | None = None
    while True:
        try:
            return await call()
        except Exception as exc:
            if not is_model_error(exc):
                raise
            saturated = isinstance(exc, Saturated)
            if not saturated:
                tries += 1
            if not policy.retryable(exc):
                raise GaveUp(exc, tries, "final") from exc
            now = time.monotonic()
            if failing_since is None:
                failing_since = now
            if not saturated and retry_after(exc) is None:
                failures += 1
            pause = policy.pause(exc, max(failures, 1))
            if now + pause > failing_since + policy.budget:
                raise GaveUp(exc, tries, "budget", pause) from exc
            await wait(exc, pause)

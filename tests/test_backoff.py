"""The one retry schedule: exponential steps up to a cap, each pause jittered within its step."""

from __future__ import annotations

import pytest

from riverbed.bus.backoff import Backoff, RedisBackoff, delay
from riverbed.bus.failures import MAX_RETRY_SECONDS, Failures


@pytest.mark.parametrize(("failures", "step"), [(1, 0.1), (2, 0.2), (3, 0.4), (5, 1.6), (6, 2.0), (10_000, 2.0)])
def test_each_pause_lies_between_half_its_step_and_its_step(failures: int, step: float) -> None:
    pauses = [delay(failures, first=0.1, cap=2.0) for _ in range(200)]
    assert all(step / 2 <= p <= step for p in pauses), (min(pauses), max(pauses))
    assert len(set(pauses)) > 100  # jittered: workers failed together do not retry together


@pytest.mark.anyio
async def test_a_backoff_grows_until_its_cap_and_starts_over_after_a_success() -> None:
    backoff = Backoff(first=0.001, cap=0.004)
    assert 0.0005 <= backoff.next <= 0.001
    for _ in range(4):
        await backoff.pause()
    assert 0.002 <= backoff.next <= 0.004
    backoff.reset()
    assert 0.0005 <= backoff.next <= 0.001


def test_redis_py_retries_and_failing_loops_follow_the_same_schedule() -> None:
    redis_backoff = RedisBackoff(first=0.05, cap=1.0)
    assert all(0.025 <= redis_backoff.compute(1) <= 0.05 for _ in range(50))
    assert all(0.5 <= redis_backoff.compute(30) <= 1.0 for _ in range(50))
    failures = Failures()
    waits = [failures.record("intake", RuntimeError("down")).retry_in for _ in range(12)]
    assert 0.05 <= waits[0] <= 0.1
    assert all(MAX_RETRY_SECONDS / 2 <= w <= MAX_RETRY_SECONDS for w in waits[5:])
    assert failures.current()["intake"].retry_in == waits[-1]  # the wait logged is the wait taken

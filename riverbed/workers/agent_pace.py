"""How many runs one agent worker serves at once: as many as its CPU keeps up with.

A step costs the role some time of its own besides the model call: noticing the answer,
folding it, building the prompt, recording the response and appending the action (the model
client's own work is counted with the call).  While the worker's CPU keeps up, that time stays
near what it is on an idle worker.  Once it does not, each step of every run the worker holds
waits behind the others.  More runs then finish no sooner (the CPU was the limit), each step
takes longer, and so do lease renewals and cancels.

So the role paces what it takes.  Every :data:`WINDOW` it looks at the median own time of the
steps made since the last look.  While that stays within a slack of the least it has seen
lately (its *baseline*), and the runs it serves are near its limit, the limit grows: it
doubles until the first time the median went past, then grows by a quarter.  The slack is a
ratio (:data:`SLACK` by default, ``RIVERBED_AGENT_PACE_SLACK``) plus :data:`SLACK_SECONDS`.
A look with no step at all (runs waiting on slow model calls) counts as within the slack.
When the median goes past, the limit shrinks below the runs the worker serves (never below its
floor), and it takes no new run until enough of them ended.  It never drops a run it holds.
Runs it does not take wait in the role's directory, in the order they opened, for this worker
or a peer with room.  A worker starts with room for :data:`START` runs, and takes a run
whatever the pace while it serves fewer than ``floor``.

Runs waiting only for their sub-agents' answers do not count as served.  They cost nothing
while they wait, and counting them could hold back the very children they wait for.

The baseline is the least window median, and it drifts up by :data:`DRIFT` each window, so a
worker whose steps get dearer for good (longer prompts) settles on the new cost.

Steps that cost more shrink the limit only while the CPUs are busy: with half of their time idle
or more over the window (:data:`IDLE_ROOM`: the machine's, or a container's quota: :class:`MachineIdle`),
a step that took longer waited for Redis, the model server or its turn in the event loop, not
for a CPU, and taking fewer runs would only leave the CPUs idle while runs wait to start
(1,000 runs of a 2 s model on 4 workers of a 2-core machine held the load under 1 while runs
waited minutes to start: ``python -m bench agents``).  Where that cannot be read, steps that
cost more shrink it whatever the CPUs do.

A look also asks how late the worker's event loop ran a timer (:meth:`Pace.lagged`, probed every
:data:`LAG_PROBE` by the role): a mean lag over :data:`LAG_LIMIT` counts as past the slack,
with steps or without.  A loop that far behind makes few steps, and a look with none would
otherwise read as runs waiting on slow model calls: with 10,000 runs of a 2 s model on 4
workers of a 2-core machine, the looks without steps let each worker take 1,400 to 2,400 runs,
whose model calls then timed out (120 s) and were tried again (``python -m bench agents``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["MachineIdle", "Pace", "own_cgroup"]

WINDOW = 0.5
"""Seconds between two looks at the steps' own time."""
MIN_STEPS = 3
"""A look with fewer steps than this waits for more (up to four windows)."""
SLACK = 1.2
"""How far the median own time may rise over the baseline (as a ratio) before the limit shrinks,
by default (``RIVERBED_AGENT_PACE_SLACK``)."""
SLACK_SECONDS = 0.0005
"""Added to the ratio's allowance: a baseline of a few milliseconds moves by this much in noise."""
START = 8
"""The runs a worker takes on before it first looked at what their steps cost (at least its
floor): a few runs opened at once on an idle worker start at once."""
START_GROW = 2.0
"""How the limit grows at a look that allows it, until the first time steps cost too much (a
burst of runs on an idle worker is taken on within a few looks)..."""
GROW = 1.25
"""...and after that."""
SHRINK = 0.8
DRIFT = 1.02
LAG_PROBE = 0.1
"""How often the role looks how late its event loop runs a timer (:meth:`Pace.lagged`)."""
LAG_LIMIT = 0.05
"""A window's mean timer lateness past which the worker's loop is behind: a step's every part
waits that long for the loop (the overhead goal of a step is 10 ms)."""
IDLE_ROOM = 0.5
"""The share of the CPU time left idle over a window from which steps that cost more are not the
CPU's doing (the limit does not shrink for them).  A fifth let the runs in so fast that their
steps queued for Redis and the runtime role (``docs/benchmarks.md``)."""


class MachineIdle:
    """The share of the CPU time the worker may use that was left idle since the last call, None
    when it cannot be read or no time passed.  Under a cgroup v2 CPU limit (``cpu.max``: a
    container's), what the cgroup did not use of its quota (``cpu.stat``); else the machine's
    idle and I/O wait time over all its CPUs (``/proc/stat``)."""

    def __init__(
        self, stat: str = "/proc/stat", cgroup: str | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """``cgroup``: the worker's cgroup v2 directory (:func:`own_cgroup`; None: none)."""
        self._stat = stat
        self._cgroup = cgroup
        self._clock = clock
        self._cores = self._quota()
        self._last = self._times()

    def _quota(self) -> float | None:
        """The CPUs the cgroup may use (``cpu.max``'s quota over its period), None: no limit."""
        if self._cgroup is None:
            return None
        try:
            quota, period = Path(self._cgroup, "cpu.max").read_text().split()[:2]
            return int(quota) / int(period) if quota != "max" else None
        except (OSError, ValueError):
            return None

    def _times(self) -> tuple[float, float] | None:
        """(idle, all) CPU time so far, in any unit: the cgroup's quota less its usage, or the
        machine's idle and I/O wait against all of its time."""
        try:
            if self._cores is not None and self._cgroup is not None:
                for line in Path(self._cgroup, "cpu.stat").read_text().splitlines():
                    name, _, value = line.partition(" ")
                    if name == "usage_usec":
                        allowed = self._clock() * self._cores
                        return allowed - int(value) / 1e6, allowed
                return None
            with open(self._stat, "rb") as stat:
                fields = [int(value) for value in stat.readline().split()[1:8]]
        except (OSError, ValueError):
            return None
        if len(fields) < 5:
            return None
        return fields[3] + fields[4], sum(fields)  # (idle + iowait, user .. softirq)

    def __call__(self) -> float | None:
        now, last = self._times(), self._last
        self._last = now
        if now is None or last is None or now[1] <= last[1]:
            return None
        return min(1.0, max(0.0, (now[0] - last[0]) / (now[1] - last[1])))


def own_cgroup() -> str | None:
    """This process's cgroup v2 directory, None where there is none."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return str(Path("/sys/fs/cgroup", line[3:].lstrip("/")))
    except OSError:
        return None
    return None


class Pace:
    """The number of runs a worker takes on at once, moved by its steps' own time."""

    def __init__(
        self,
        floor: int,
        *,
        slack: float = SLACK,
        clock: Callable[[], float] = time.monotonic,
        idle: Callable[[], float | None] | None = None,
    ) -> None:
        """``idle``: the share of the machine's CPU time left idle since its last call
        (:class:`MachineIdle`); None: steps that cost more always shrink the limit."""
        self.floor = max(1, floor)
        self.slack = slack
        self._idle = idle
        self.idle: float | None = None
        """the last window's share of the machine's CPU time left idle, when read"""
        self.limit = float(max(self.floor, START))
        """how many runs the worker serves at once now (never below ``floor``)"""
        self.baseline: float | None = None
        """the least median own time of a step seen lately (seconds)"""
        self.median: float | None = None
        """the last window's median own time of a step (seconds)"""
        self._clock = clock
        self._since = clock()
        self._steps: list[float] = []
        self._lags: list[float] = []
        self._starting = True
        self.lag: float | None = None
        """the last window's mean lateness of the event loop's timers (seconds), when probed"""

    def observe(self, seconds: float) -> None:
        """A step took the role ``seconds`` of its own (the model's wait left out)."""
        self._steps.append(seconds)

    def lagged(self, seconds: float) -> None:
        """A timer of the worker's event loop ran ``seconds`` late."""
        self._lags.append(max(0.0, seconds))

    def room(self, served: int) -> int:
        """How many more runs the worker may take now, serving ``served``."""
        now = self._clock()
        if now - self._since >= WINDOW and self._look(served, now - self._since):
            self._since = now
        return max(0, math.floor(self.limit) - served)

    def _look(self, served: int, elapsed: float) -> bool:
        """Move the limit; False when there were too few steps to tell yet."""
        steps = self._steps
        if 0 < len(steps) < MIN_STEPS and elapsed < 4 * WINDOW:
            return False
        self._steps = []
        lags, self._lags = self._lags, []
        self.lag = statistics.fmean(lags) if lags else None
        self.idle = self._idle() if self._idle is not None else None
        behind = self.lag is not None and self.lag > LAG_LIMIT
        if steps or behind:
            over = behind
            if steps:
                median = self.median = statistics.median(steps)
                baseline = self.baseline = median if self.baseline is None else min(median, self.baseline * DRIFT)
                busy = self.idle is None or self.idle < IDLE_ROOM
                over = over or (busy and median > baseline * self.slack + SLACK_SECONDS)
            if over:
                self.limit = max(float(self.floor), min(self.limit, served) * SHRINK)
                self._starting = False
                return True
        if served >= math.floor(self.limit) * 0.75:
            grown = self.limit * (START_GROW if self._starting else GROW)
            self.limit = max(grown, math.floor(self.limit) + 1.0)  # (a limit of 1.5 serves one run)
        return True

"""Named crash points for the fault suite.

``RIVERBED_CRASH_AT=<point>[:<n>]`` makes the process SIGKILL itself the n-th time (default
the first) it passes ``crashpoint(<point>)``.  Unset (always, in production) the check is
one dictionary lookup.  Points: ``after_read``, ``after_side_effect``, ``after_append``,
``before_ack``, ``during_renew``, ``after_index``.
"""

from __future__ import annotations

import os
import signal

_spec = os.environ.get("RIVERBED_CRASH_AT", "")
_point, _, _nth = _spec.partition(":")
_remaining = int(_nth or 1) if _point else 0


def crashpoint(name: str) -> None:
    global _remaining
    if _point != name:
        return
    _remaining -= 1
    if _remaining <= 0:
        os.kill(os.getpid(), signal.SIGKILL)

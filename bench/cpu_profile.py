"""Run a module under ``cProfile`` timed by the thread's CPU clock, not the wall clock.

``python -m bench.cpu_profile OUT -m MODULE ARGS…`` runs ``MODULE`` as ``python -m`` would and
writes the profile to ``OUT`` when it ends (a ``SIGTERM`` ends it as an interrupt would, so a
worker stopped by a bench still writes its file).  With ``time.thread_time`` a process waiting
for a CPU, or for the network, adds nothing to the function it waits in: on a busy machine the
wall clock puts those waits on whatever happened to be running.  The profiler's own cost still
weighs most on code of many small calls.
"""

from __future__ import annotations

import cProfile
import runpy
import signal
import sys
import time


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "-m":
        raise SystemExit("usage: python -m bench.cpu_profile OUT -m MODULE [ARGS...]")
    out, module = argv[0], argv[2]
    sys.argv = [module, *argv[3:]]
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except KeyboardInterrupt:
        pass  # (stopped: SIGTERM or SIGINT; a module's own exit status goes on out)
    finally:
        profiler.disable()
        profiler.dump_stats(out)


if __name__ == "__main__":
    main(sys.argv[1:])

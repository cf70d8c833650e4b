"""Start a sandbox process: new POSIX session, optional controlling tty, rlimits, the default
handling of Ctrl-C and Ctrl-\\, exec.

Run as ``python -I -S _launch.py '<json rlimits>' [--ctty] -- program args...``.
Stdlib only and no imports from riverbed: it runs before the sandbox program exists.
"""

import fcntl
import json
import os
import resource
import signal
import sys
import termios


def main(argv: list[str]) -> None:
    limits = json.loads(argv[0])
    rest = argv[1:]
    ctty = False
    while rest and rest[0] != "--":
        if rest[0] == "--ctty":
            ctty = True
        rest = rest[1:]
    program = rest[1:]
    if not program:
        sys.stderr.write("usage: _launch.py LIMITS [--ctty] -- PROGRAM [ARGS...]\n")
        sys.exit(2)
    os.setsid()
    if ctty:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    for name, wanted in limits.items():
        which = getattr(resource, name, None)
        if which is None:
            continue
        _soft, hard = resource.getrlimit(which)
        value = int(wanted)
        if hard != resource.RLIM_INFINITY and value > hard:
            value = hard
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError):
            try:
                resource.setrlimit(which, (value, hard))
            except (ValueError, OSError):
                sys.stderr.write(f"riverbed sandbox: could not apply {name}={value}\n")
    # A worker started where Ctrl-C is ignored (``nohup``, ``&`` in a script) would pass that on:
    # the sandbox's programs start with the default, so a Ctrl-C interrupts a command.
    for number in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(number, signal.SIG_DFL)
    os.execvp(program[0], program)  # noqa: S606  (the sandbox program, argv built by the runtime)


if __name__ == "__main__":
    main(sys.argv[1:])

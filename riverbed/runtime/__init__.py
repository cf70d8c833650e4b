"""The sandbox that executes actions: one workspace, bash and Python process per session.

Start at :class:`Runtime`; limits are in :class:`Limits`; custom action kinds get their
handler with :func:`handler` or :meth:`Runtime.handler`.
"""

from riverbed.runtime.files import FileActionError
from riverbed.runtime.limits import Limits
from riverbed.runtime.paths import PathRefused, workspace_name
from riverbed.runtime.runtime import Handler, HandlerContext, Runtime, handler
from riverbed.runtime.sandbox import Sandbox, SandboxUnavailable

__all__ = [
    "FileActionError",
    "Handler",
    "HandlerContext",
    "Limits",
    "PathRefused",
    "Runtime",
    "Sandbox",
    "SandboxUnavailable",
    "handler",
    "workspace_name",
]

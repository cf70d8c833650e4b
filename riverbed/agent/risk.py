"""How risky a call is, and whether it waits for a person's approval.

:func:`analyze` is the built-in, rule-based analyzer: it labels each call ``low``, ``medium``,
``high`` or ``unknown`` with a reason, from what the call says it does.

- ``cmd_run``: destructive shell patterns (recursive deletes, ``mkfs``, ``dd`` onto a device, a
  fork bomb, ``chmod -R 777``), force pushes, piping a download into a shell, ``sudo``, writes to
  dotfiles are ``high``; package installs, network use (``curl``, ``wget``, ``ssh``, ``git
  clone|push|fetch``…), ``git reset --hard`` and plain ``rm`` are ``medium``;
- ``file_write`` / ``file_edit`` of a dotfile or anything under a dot-directory (``.git/``,
  ``.ssh/``, ``.bashrc``…) is ``high``;
- ``python_run`` that deletes trees, spawns processes or opens network connections is ``high``
  or ``medium`` by the same rules;
- reads, recalls and sub-agents are ``low``; a user's tool or an MCP tool is ``unknown``: riverbed
  cannot tell what it does (an agent can pass its own ``analyzer``).

:func:`judged` applies a run's policy: ``never``; ``always`` (every call that runs something:
reads such as ``file_read`` and ``recall`` never wait);
``risky`` (calls labelled ``high`` or ``unknown``); or a list of tool names.  The label and the
reason are recorded on the action (``risk``) whatever the policy says.

A rule-based analyzer reads what a call says, not what it will do: a command can hide its intent
(a script written first and run later, an alias, base64 piped to ``sh``).  Use ``always`` or a
list of tools where that matters.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from msgspec.structs import replace

from riverbed import events

__all__ = ["Analyzer", "Policy", "analyze", "judged", "needs_approval"]

Analyzer = Callable[[events.Action], events.Risk]
Policy = str | Sequence[str]

_HIGH_SHELL: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), reason)
    for pattern, reason in (
        (r"\brm\s+(-[a-zA-Z]*[rR][a-zA-Z]*|--recursive)\b", "deletes files recursively"),
        (r"\bmkfs(\.\w+)?\b|\bdd\s+[^|;&]*\bof=/dev/", "writes a device or a filesystem"),
        (r":\(\)\s*\{\s*:\s*\|\s*:\s*&\s*\}", "a fork bomb"),
        (r"\bchmod\s+(-R\s+)?[0-7]*777\b", "makes files writable by everyone"),
        (r"\bgit\s+push\b[^|;&]*(\s--force\b|\s-f\b|\s--force-with-lease\b|\s\+\S)", "force-pushes"),
        (r"\b(curl|wget)\b[^|;&]*\|\s*(sudo\s+)?(ba|z|da|k)?sh\b", "pipes a download into a shell"),
        (r"\bsudo\b", "runs as another user"),
        (r">\s*~?/?(\S*/)?\.(bashrc|profile|zshrc|bash_profile|gitconfig|ssh/\S*)\b", "writes a dotfile"),
        (r"\b(shutdown|reboot|halt|poweroff)\b", "stops the machine"),
    )
)
_MEDIUM_SHELL: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), reason)
    for pattern, reason in (
        (
            r"\b(pip3?|uv\s+pip|npm|pnpm|yarn|apt(-get)?|dnf|yum|apk|brew|cargo|gem|go)\s+(install|add|i)\b",
            "installs packages",
        ),
        (r"\b(curl|wget|ssh|scp|rsync|nc|ncat|telnet|ftp)\b", "uses the network"),
        (r"\bgit\s+(clone|push|fetch|pull)\b", "uses the network"),
        (r"\bgit\s+(reset\s+--hard|clean\s+-[a-z]*f)", "throws away work"),
        (r"\brm\b", "deletes files"),
    )
)
_HIGH_PYTHON = re.compile(r"\bshutil\.rmtree\b|\bos\.(remove|unlink|rmdir)\b")
_MEDIUM_PYTHON = re.compile(r"\bsubprocess\b|\bos\.(system|popen|exec\w*)\b|\b(requests|httpx|urllib|socket)\b")
_DOTFILE = re.compile(r"(^|/)\.[^/.][^/]*")


def analyze(action: events.Action) -> events.Risk:
    """The built-in rule-based label of ``action`` (see the module's docstring)."""
    match action:
        case events.CmdRun(command=command):
            return _shell(command)
        case events.FileWrite(path=path) | events.FileEdit(path=path):
            if _DOTFILE.search(path):
                return events.Risk(level="high", reason=f"writes {path}, a dotfile or under a dot-directory")
            return events.Risk(level="low", reason="writes a file of the workspace")
        case events.PythonRun(code=code):
            if _HIGH_PYTHON.search(code):
                return events.Risk(level="high", reason="the cell deletes files")
            if _MEDIUM_PYTHON.search(code):
                return events.Risk(level="medium", reason="the cell runs processes or uses the network")
            return events.Risk(level="low", reason="a Python cell")
        case events.ToolCall(tool=tool):
            return events.Risk(level="unknown", reason=f"{tool} is a tool whose effects riverbed cannot judge")
        case _:
            return events.Risk(level="low", reason=f"{action.kind} changes nothing outside the session")


def _shell(command: str) -> events.Risk:
    for pattern, reason in _HIGH_SHELL:
        if pattern.search(command):
            return events.Risk(level="high", reason=f"the command {reason}")
    for pattern, reason in _MEDIUM_SHELL:
        if pattern.search(command):
            return events.Risk(level="medium", reason=f"the command {reason}")
    return events.Risk(level="low", reason="a command with no risky pattern")


def _name(action: events.Action) -> str:
    return action.tool if isinstance(action, events.ToolCall) else action.kind


def needs_approval(action: events.Action, risk: events.Risk, policy: Policy) -> bool:
    """Whether ``policy`` makes ``action`` (labelled ``risk``) wait for a person."""
    if type(action).answered_by is None or type(action).repeatable:
        return False  # (think, finish, a message: nothing runs; a read changes nothing)
    if isinstance(policy, str):
        if policy == "always":
            return True
        if policy == "risky":
            return risk.level in ("high", "unknown")
        return False
    return _name(action) in policy


def judged(action: events.Action, policy: Policy, analyzer: Analyzer | None = None) -> events.Action:
    """``action`` with its ``risk`` recorded (``analyzer``'s, else :func:`analyze`'s) and marked
    to wait for approval when ``policy`` says so.  A policy of ``never`` with no analyzer of the
    agent's leaves the action as it is (nothing to record, nothing to wait for)."""
    if type(action).answered_by is None or (policy == "never" and analyzer is None):
        return action
    try:
        risk = analyzer(action) if analyzer is not None else analyze(action)
    except Exception as exc:  # (a user's analyzer that fails: the call is unknown, never unjudged)
        risk = events.Risk(level="unknown", reason=f"the analyzer failed: {type(exc).__name__}: {exc}")
    return replace(action, risk=replace(risk, confirm=needs_approval(action, risk, policy)))

"""The scripted agent: replays a list of actions from a JSON-lines file, no model needed.

A script has one action per line, a JSON object whose ``kind`` names the class (the same
form as ``riverbed act``)::

    {"kind": "message", "content": "Make a hello world script"}
    {"kind": "file_write", "path": "hello.py", "content": "print('hello')\\n"}
    {"kind": "cmd_run", "command": "python hello.py"}
    {"kind": "finish", "final_thought": "done"}

Blank lines and lines starting with ``#`` are skipped.  A ``message`` without a ``source``
is the user's.  Every line is validated before anything is appended, so a bad script
appends nothing and the error names its line.

:func:`run_script` appends each action in order; an action that a role answers is awaited
(one timeout per action) before the next one goes out.  It yields ``(action, observation)``
pairs (``observation`` is None for records nobody answers: messages, thoughts, finish), so
a caller can print a transcript as it happens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path

import msgspec

from riverbed import events
from riverbed.client.session import Bus, Session
from riverbed.errors import InputError

__all__ = ["Step", "load_script", "parse_script", "run_script", "run_scripted_agent"]

_raw_line = msgspec.json.Decoder(dict[str, object])


class Step(msgspec.Struct, frozen=True):
    """One action as appended (with its id) and the event that answered it, if any."""

    action: events.Action
    observation: events.Event | None


def parse_script(lines: Iterable[str], *, name: str = "script") -> list[events.Action]:
    """The actions of a script; :class:`InputError` names the first bad line."""
    actions: list[events.Action] = []
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            raw = _raw_line.decode(text)
        except msgspec.DecodeError as exc:
            raise InputError(f"{name} line {number} is not a JSON object: {exc}") from exc
        if raw.get("kind") == "message" and "source" not in raw:
            raw["source"] = "user"
        for field in ("id", "cause"):
            if raw.get(field) is not None:
                raise InputError(f"{name} line {number}: an action in a script cannot set {field!r}")
        try:
            event = events.from_builtins(raw)
        except events.DecodeError as exc:
            raise InputError(f"{name} line {number}: {exc}") from exc
        if not isinstance(event, events.Action):
            raise InputError(f"{name} line {number}: {event.kind!r} is not an action kind")
        actions.append(event)
    return actions


def load_script(path: Path | str) -> list[events.Action]:
    """Read and validate a JSON-lines script file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot read the script {str(path)!r}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise InputError(f"the script {str(path)!r} is not UTF-8 text") from exc
    return parse_script(text.splitlines(), name=path.name)


async def run_script(
    session: Session, actions: Sequence[events.Action], *, timeout: float = 30.0
) -> AsyncIterator[Step]:
    """Append each action in order, awaiting the answer of each answered one.

    Raises :class:`~riverbed.errors.ActTimeout` when an answer does not come within
    ``timeout`` seconds (the actions before it stay in the log).
    """
    for action in actions:
        if not isinstance(action, events.Action):
            raise InputError(f"a script holds actions, not {type(action).__name__} events")
    for action in actions:
        stamped = session.stamp(action)
        (action_id,) = await session.append(stamped)
        appended = events.with_id(stamped, action_id)
        assert isinstance(appended, events.Action)
        observation: events.Event | None = None
        if type(action).answered_by is not None:
            observation = await session.wait_for_answer(action_id, timeout=timeout)
        yield Step(appended, observation)


async def run_scripted_agent(
    bus: Bus,
    session_id: str,
    script: Path | str | Sequence[events.Action],
    *,
    agent: str = "scripted",
    tenant: str | None = None,
    timeout: float = 30.0,
) -> list[Step]:
    """Run a whole script (a file or a list of actions) in one session; returns every step."""
    actions = load_script(script) if isinstance(script, Path | str) else list(script)
    session = bus.session(session_id, agent=agent, tenant=tenant)
    return [step async for step in run_script(session, actions, timeout=timeout)]

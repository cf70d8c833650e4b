"""Replay tools: fork a session at an event, and re-run its runtime actions to compare.

:func:`fork` copies events 1..``at`` of a session, byte for byte and with the same ids,
into a new session and then records where it came from with a ``forked`` event; the two
logs then diverge independently.  Events that retention moved to the archive are read
from there, so an old session forks like a new one.  Only the log is copied: the fork's
sandbox starts from an empty workspace, and the runtime role does not run the copied
actions again (they are answered already; an action that was still waiting for its answer
at ``at`` is run in the fork).

:func:`rerun` executes a session's recorded runtime actions again, in order, in a fresh
workspace, and reports every way the new observations differ from the recorded ones:
a changed file, a command whose output moved, a step that now fails.  Seed the fresh
workspace with the files the original session started from (``seed``), or it starts
empty.  With ``into`` the re-executed actions and their new observations are also written
to a new session, so the rerun can be inspected like any other log.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import anyio
import anyio.to_thread
import msgspec
from msgspec.structs import replace
from redis import exceptions as rexc

from riverbed import events
from riverbed.agent.client import Bus
from riverbed.bus.connection import translate
from riverbed.bus.log import answered_cause, decode_entry
from riverbed.errors import AlreadyAnswered, InputError

__all__ = ["Difference", "Executor", "RuntimeStart", "fork", "observation_fields", "rerun", "start_runtime_after"]

#: Fields every event has; they say where and when, not what happened.
_ENVELOPE = frozenset(("id", "kind", "source", "cause", "ts", "agent", "tenant", "trace", "v"))
_PAGE = 1000


class Executor(Protocol):
    """What :func:`rerun` needs of a sandbox (``riverbed.runtime.Runtime`` fits)."""

    def workspace(self, session_id: str) -> Path: ...

    def set_env(self, session_id: str, env: Mapping[str, str | None]) -> None: ...

    async def execute(self, session_id: str, action: events.Event) -> events.Observation: ...

    async def close_session(self, session_id: str) -> None: ...


class Difference(msgspec.Struct, frozen=True, kw_only=True):
    """One way a re-executed action's observation differs from the recorded one.

    ``field`` is ``"kind"`` when the observation is of another kind altogether (then
    ``recorded`` and ``new`` are the kinds; ``recorded`` is None when the action was never
    answered in the log).
    """

    action_id: int
    kind: str
    field: str
    recorded: Any
    new: Any


# --- fork --------------------------------------------------------------------------------


async def fork(bus: Bus, source: str, at: int, into: str) -> int:
    """Copy events 1..``at`` of ``source`` into the new session ``into`` (same ids, same
    bytes), then append a ``forked`` event; returns that event's id (``at + 1``)."""
    store = bus.log_store
    store.check_session(source)
    store.check_session(into)
    last = await store.last_id(source)
    if last == 0:
        raise InputError(f"cannot fork session {source!r}: it has no events")
    if not 1 <= at <= last:
        raise InputError(f"cannot fork session {source!r} at {at}: choose an event id from 1 to {last}")
    if source == into or await store.exists(into):
        raise InputError(f"cannot fork into {into!r}: that session exists already; choose a new session id")
    tenant = (await store.meta(source)).get("tenant") or None
    await start_runtime_after(bus, into, await _runtime_start(bus, source, at))
    copied = 0
    page: list[tuple[bytes, int]] = []
    async for event_id, payload in store.read_raw(source, 1, at):
        if event_id != copied + len(page) + 1:
            raise InputError(f"cannot fork session {source!r}: event {copied + len(page) + 1} is missing from its log")
        page.append((payload, answered_cause(decode_entry(payload, event_id))))
        if len(page) >= _PAGE:
            copied = await _append_page(bus, into, page, copied, tenant)
            page = []
    if page:
        copied = await _append_page(bus, into, page, copied, tenant)
    if copied != at:
        raise InputError(f"session {source!r} has no events up to {at} any more (only {copied} could be read)")
    forked = events.Forked(source_session=source, at=at, tenant=tenant)
    (forked_id,) = await _append(bus, into, [(events.encode(forked), 0)], expected_last=at, tenant=tenant)
    return forked_id


class RuntimeStart:
    """Where a copied session's runtime role starts reading, so that it never runs a copied
    action again: after the last copied event, or just before the first copied runtime
    action whose answer is not among the copied events (that one still needs to run).

    :func:`fork` and ``riverbed import`` feed it every copied event with :meth:`see`.
    """

    def __init__(self) -> None:
        self._unanswered: set[int] = set()

    def see(self, event: events.Event) -> None:
        if isinstance(event, events.Action) and type(event).answered_by == "runtime" and event.id is not None:
            self._unanswered.add(event.id)
        elif isinstance(event, events.Observation) and event.cause is not None:
            self._unanswered.discard(event.cause)

    def after(self, last: int) -> int:
        """The id after which the runtime role starts, given ``last`` copied events."""
        return min(self._unanswered) - 1 if self._unanswered else last


async def _runtime_start(bus: Bus, source: str, at: int) -> int:
    start = RuntimeStart()
    async for event in bus.log_store.read(source, 1, at):
        start.see(event)
    return start.after(at)


async def start_runtime_after(bus: Bus, session: str, after: int) -> None:
    """Make the runtime role of the new (still empty) ``session`` begin after event ``after``:
    the copied actions up to there are answered already and must not run a second time.

    The caller has made sure the session has no events yet (workers hear of it only at its
    first append), so a group left by an earlier attempt is moved, not trusted.
    """
    key = bus.keys.log(session)
    with translate(bus.url):
        try:
            await bus.redis.xgroup_create(key, "runtime", id=f"{after}-0", mkstream=True)
        except rexc.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
            await bus.redis.xgroup_setid(key, "runtime", id=f"{after}-0")


async def _append_page(bus: Bus, into: str, page: list[tuple[bytes, int]], copied: int, tenant: str | None) -> int:
    ids = await _append(bus, into, page, expected_last=copied, tenant=tenant)
    return ids[-1]


async def _append(
    bus: Bus, session: str, batch: list[tuple[bytes, int]], *, expected_last: int, tenant: str | None
) -> list[int]:
    result = await bus.log_store.append_raw(session, batch, expected_last=expected_last, tenant=tenant)
    if isinstance(result, AlreadyAnswered):
        raise AlreadyAnswered(
            result.cause,
            result.existing,
            f"cannot write session {session!r}: action {result.cause} is answered twice in the copied events",
        )
    return result


# --- rerun -------------------------------------------------------------------------------


def observation_fields(event: events.Event) -> dict[str, Any]:
    """The fields of an observation that say what happened (no id, time, source or cause)."""
    return {k: v for k, v in events.to_builtins(event).items() if k not in _ENVELOPE}


def _neutral(fields: dict[str, Any], workspace: str | None) -> dict[str, Any]:
    """``fields`` with the workspace's absolute path replaced by ``<workspace>``."""
    if not workspace:
        return fields
    return {k: v.replace(workspace, "<workspace>") if isinstance(v, str) else v for k, v in fields.items()}


def compare(
    action: events.Event,
    recorded: events.Event | None,
    new: events.Event,
    *,
    workspaces: tuple[str | None, str | None] = (None, None),
) -> list[Difference]:
    """The differences between a recorded observation and a new one for ``action``.

    ``workspaces`` (recorded, new) are the two sandboxes' absolute paths: a path that differs
    only by the workspace it lives in is not a difference.
    """
    action_id = action.id or 0
    if recorded is None or recorded.kind != new.kind:
        old_kind = None if recorded is None else recorded.kind
        return [Difference(action_id=action_id, kind=action.kind, field="kind", recorded=old_kind, new=new.kind)]
    old_fields = _neutral(observation_fields(recorded), workspaces[0])
    new_fields = _neutral(observation_fields(new), workspaces[1])
    return [
        Difference(action_id=action_id, kind=action.kind, field=name, recorded=old_fields.get(name), new=value)
        for name, value in new_fields.items()
        if old_fields.get(name) != value
    ] + [
        Difference(action_id=action_id, kind=action.kind, field=name, recorded=value, new=None)
        for name, value in old_fields.items()
        if name not in new_fields
    ]


async def rerun(
    bus: Bus,
    session: str,
    runtime: Executor,
    *,
    into: str | None = None,
    seed: Path | str | None = None,
) -> list[Difference]:
    """Execute the runtime actions of ``session`` again, in order, in a fresh workspace, and
    return how each new observation differs from the recorded one (empty: same results).

    The fresh workspace belongs to the session id ``into`` (or ``<session>-rerun-<n>``,
    the first n whose workspace does not exist); ``seed`` is a directory copied into it
    first.  With ``into``, the actions and new observations are written to that new
    session too (it must not exist).  Environment changes recorded with
    ``session_config`` events are applied where they occur.
    """
    store = bus.log_store
    store.check_session(session)
    if not await store.exists(session):
        raise InputError(f"cannot rerun session {session!r}: it has no events")
    if into is not None:
        store.check_session(into)
        if into == session or await store.exists(into):
            raise InputError(f"cannot rerun into {into!r}: that session exists already; choose a new session id")
    workspace_id = into or await _fresh_id(bus, session, runtime)
    workspace = runtime.workspace(workspace_id)
    paths = (str(runtime.workspace(session)), str(workspace))
    if await anyio.to_thread.run_sync(_has_files, workspace):
        raise InputError(f"the rerun workspace {str(workspace)!r} is not empty; choose another session id")
    if seed is not None:
        await anyio.to_thread.run_sync(_copy_seed, Path(seed), workspace)

    recorded: dict[int, events.Event] = {}
    pending: list[events.Event] = []
    async for event in store.read(session):
        if isinstance(event, events.Observation) and event.cause is not None:
            recorded.setdefault(event.cause, event)
        if _is_runtime_action(event) or (isinstance(event, events.SessionConfig) and event.env):
            pending.append(event)

    differences: list[Difference] = []
    written: list[events.Event] = []
    try:
        for event in pending:
            if isinstance(event, events.SessionConfig):
                runtime.set_env(workspace_id, event.env)
                written.append(_fresh(event))
                continue
            new = await runtime.execute(workspace_id, event)
            assert event.id is not None
            differences.extend(compare(event, recorded.get(event.id), new, workspaces=paths))
            written.extend([_fresh(event), _fresh(new)])
    finally:
        with anyio.CancelScope(shield=True):
            await runtime.close_session(workspace_id)
    if into is not None:
        await _write_log(bus, into, written, tenant=(await store.meta(session)).get("tenant") or None)
    return differences


def _is_runtime_action(event: events.Event) -> bool:
    return isinstance(event, events.Action) and type(event).answered_by == "runtime"


def _fresh(event: events.Event) -> events.Event:
    """The event as a new log entry: no id, no cause (set again when written)."""
    return replace(event, id=None, cause=None)


async def _fresh_id(bus: Bus, session: str, runtime: Executor) -> str:
    for n in range(1, 10_000):
        candidate = f"{session}-rerun-{n}"
        if len(candidate) > 128:
            break
        if not await bus.log_store.exists(candidate) and not await anyio.to_thread.run_sync(
            _has_files, runtime.workspace(candidate)
        ):
            return candidate
    raise InputError(f"no free session id for a rerun of {session!r}; pass into= explicitly")


def _has_files(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def _copy_seed(seed: Path, workspace: Path) -> None:
    if not seed.is_dir():
        raise InputError(f"the rerun seed {str(seed)!r} is not a directory")
    shutil.copytree(seed, workspace, symlinks=True, dirs_exist_ok=True)


async def _write_log(bus: Bus, into: str, written: list[events.Event], *, tenant: str | None) -> None:
    """Append actions and their new observations, each observation's ``cause`` pointing at
    its action's new id; the runtime role starts after them (they are answered already)."""
    if not written:
        return
    await start_runtime_after(bus, into, len(written))
    batch: list[tuple[bytes, int]] = []
    last_action = 0
    for position, original in enumerate(written, start=1):
        changes: dict[str, Any] = {}
        if isinstance(original, events.Observation):
            changes["cause"] = last_action
        elif isinstance(original, events.Action):
            last_action = position
        if tenant is not None and original.tenant is None:
            changes["tenant"] = tenant
        event = replace(original, **changes) if changes else original
        batch.append((events.encode(event), answered_cause(event)))
    done = 0
    for start in range(0, len(batch), _PAGE):
        ids = await _append(bus, into, batch[start : start + _PAGE], expected_last=done, tenant=tenant)
        done = ids[-1]

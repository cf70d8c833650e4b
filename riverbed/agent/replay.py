"""Replay tools: fork a session at an event with its sandbox, and re-run its actions to compare.

:func:`fork` copies events 1..``at`` of a session, byte for byte and with the same ids,
into a new session and then records where it came from with a ``forked`` event; the two
logs then diverge independently.  Events that retention moved to the archive are read
from there, so an old session forks like a new one.  The runtime role never answers a
copied action again (an action still waiting for its answer at ``at`` is run in the fork).

The fork's sandbox (files, the shell's cwd and exported variables, the Python cells) is
rebuilt as it was at ``at`` by the runtime that will serve the fork, because that is where
the shell and the Python process live: a sandbox's processes cannot be handed from one
process to another, and re-running commands in a second place would run their side
effects twice.  So the log drives it:

1. :func:`fork` writes the ``forked`` event with ``workspace`` = ``replay`` (the default),
   ``copy`` or ``empty``;
2. the runtime worker that takes the fork (``riverbed.workers.runtime_role``) sees a
   ``forked`` event that no ``sandbox_rebuilt`` event answers yet and, before it runs any
   new action of the fork, calls :func:`rebuild`: ``replay`` empties the fork's workspace
   and re-executes the recorded runtime actions 1..``at`` in it, in order, silently (the
   ``session_config`` environment applied where it occurs), with the same machinery as
   :func:`rerun`; ``copy`` copies the source's current workspace instead (files and
   symlinks, by file descriptor: nothing is followed out of it, and special files are
   skipped and listed, see :mod:`riverbed.runtime.trees`);
3. it appends one ``sandbox_rebuilt`` event (``cause`` = the ``forked`` event): the method,
   how many actions ran, and every observation that came out differently from the
   recording.  The append is fenced like any answer, and a new owner that finds the event
   does not rebuild again; one that finds none (the previous owner died half-way) empties
   the workspace and rebuilds from the start.  No recorded answer is ever appended again:
   the re-executed actions' observations are compared, not logged;
4. :func:`wait_rebuilt` waits for that event (``riverbed fork`` prints it, and exits 3 when
   anything differed).

Only :func:`fork` writes a ``forked`` event that gets built: it marks the new session's meta
hash with the event's id (``forked``) before it copies anything, and clients cannot append
``forked`` at all (``events.check_client``).  The runtime builds the sandbox only for the
marked event, and only when the source session is of the fork's tenant
(:func:`fork_refusal`); any other ``forked`` event that comes its way is answered with a
``sandbox_rebuilt`` that says why nothing was built.  A copied ``forked`` event below the
mark is the source's history, not an instruction.

After the rebuild the fork is served like any session: its shell and Python state last as
long as the worker keeps the session (a new owner after a crash starts them afresh, with
the files in place, as for every session).  Caveat: a copied action that was still
unanswered at ``at`` runs after the rebuild, but if a worker took the fork while its events
were still being copied, such an action can run before it.

:func:`rerun` executes a session's recorded runtime actions again, in order, in a fresh
workspace, and reports every way the new observations differ from the recorded ones:
a changed file, a command whose output moved, a step that now fails.  Seed the fresh
workspace with the files the original session started from (``seed``), or it starts
empty.  With ``into`` the re-executed actions and their new observations are also written
to a new session, so the rerun can be inspected like any other log.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import anyio
import anyio.to_thread
from msgspec.structs import replace

from riverbed import events
from riverbed.bus.log import Log, answered_cause, decode_entry
from riverbed.client.session import Bus
from riverbed.errors import ActTimeout, AlreadyAnswered, InputError
from riverbed.runtime.trees import Copied, copy_tree, empty_tree

__all__ = [
    "WORKSPACE_METHODS",
    "Difference",
    "Executor",
    "RuntimeStart",
    "fork",
    "fork_mark",
    "fork_refusal",
    "observation_fields",
    "rebuild",
    "rebuild_needed",
    "rerun",
    "start_runtime_after",
    "wait_rebuilt",
]

#: Fields every event has; they say where and when, not what happened.
_ENVELOPE = frozenset(("id", "kind", "source", "cause", "ts", "agent", "tenant", "trace", "v"))
_PAGE = 1000


class Executor(Protocol):
    """What :func:`rerun` needs of a sandbox (``riverbed.runtime.Runtime`` fits)."""

    def workspace(self, session_id: str) -> Path: ...

    def workspace_owner(self, session_id: str) -> tuple[int, int] | None: ...

    def set_env(self, session_id: str, env: Mapping[str, str | None]) -> None: ...

    async def execute(self, session_id: str, action: events.Event) -> events.Observation: ...

    async def close_session(self, session_id: str) -> None: ...


Difference = events.Divergence
"""One way a re-executed action's observation differs from the recorded one (the type a
``sandbox_rebuilt`` event lists too)."""

WORKSPACE_METHODS: tuple[events.WorkspaceMethod, ...] = ("replay", "copy", "empty")


# --- fork --------------------------------------------------------------------------------


async def fork(bus: Bus, source: str, at: int, into: str, *, workspace: events.WorkspaceMethod = "replay") -> int:
    """Copy events 1..``at`` of ``source`` into the new session ``into`` (same ids, same
    bytes), then append a ``forked`` event; returns that event's id (``at + 1``).

    ``workspace`` says how the runtime that serves the fork builds its sandbox (see the
    module docstring); :func:`wait_rebuilt` waits until it has.
    """
    if workspace not in WORKSPACE_METHODS:
        raise InputError(f"--workspace {workspace!r} is not a method: use replay, copy or empty")
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
    # The runtime builds a sandbox only for the forked event marked here (see the module
    # docstring), marked before anything is copied: a worker may see the events at once.
    await bus.client.hset(bus.keys.meta(into), FORK_MARK, at + 1)

    async def copies() -> AsyncIterator[tuple[bytes, int]]:
        expected = 1
        async for event_id, payload in store.read_raw(source, 1, at):
            if event_id != expected:
                raise InputError(f"cannot fork session {source!r}: event {expected} is missing from its log")
            yield payload, answered_cause(decode_entry(payload, event_id))
            expected += 1

    copied = await write_copies(bus, into, copies(), tenant=tenant)
    if copied != at:
        raise InputError(f"session {source!r} has no events up to {at} any more (only {copied} could be read)")
    forked = events.Forked(source_session=source, at=at, tenant=tenant, workspace=workspace)
    (forked_id,) = await _append(bus, into, [(events.encode(forked), 0)], expected_last=at, tenant=tenant)
    return forked_id


FORK_MARK = "forked"
"""The field of a fork's meta hash that holds the id of the ``forked`` event :func:`fork` wrote."""


def fork_mark(meta: Mapping[str, str]) -> int:
    """The id of the ``forked`` event :func:`fork` wrote into a session (0: none), from its meta."""
    raw = meta.get(FORK_MARK, "")
    return int(raw) if raw.isdigit() else 0


async def fork_refusal(log: Log, session: str, tenant: str | None, forked: events.Forked) -> str | None:
    """Why the runtime must not build the sandbox that the ``forked`` event of ``session`` (of
    ``tenant``) asks for; None when it may: :func:`fork` wrote the event, and the source
    session is of the same tenant (checked again here, whatever slipped past the append)."""
    if forked.id is None or forked.id != fork_mark(await log.meta(session)):
        return (
            f"the forked event {forked.id} was not written by fork(), so its sandbox was not built "
            "(nothing was copied or replayed)"
        )
    source_tenant = (await log.meta(forked.source_session)).get("tenant") or None
    if source_tenant != tenant:
        return (
            f"the source session {forked.source_session!r} is not this session's tenant's, so the sandbox "
            "was not built (nothing was copied or replayed)"
        )
    return None


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
    if not await bus.client.xgroup_create(key, "runtime", f"{after}-0"):
        await bus.client.xgroup_setid(key, "runtime", f"{after}-0")


async def write_copies(
    bus: Bus, session: str, copies: AsyncIterable[tuple[bytes, int]], *, tenant: str | None, page_size: int = _PAGE
) -> int:
    """Append copied events ((payload, the action it answers or 0), with their ids 1, 2, …) to
    the new session ``session`` a page at a time, each page expecting the one before it: the
    one copy loop of :func:`fork` and ``riverbed import``.  Returns the last id written (0:
    none); :class:`AppendConflict` when someone else wrote to the session meanwhile."""
    last = 0
    page: list[tuple[bytes, int]] = []
    async for copy in copies:
        page.append(copy)
        if len(page) >= page_size:
            last = (await _append(bus, session, page, expected_last=last, tenant=tenant))[-1]
            page = []
    if page:
        last = (await _append(bus, session, page, expected_last=last, tenant=tenant))[-1]
    return last


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


# --- the fork's sandbox ------------------------------------------------------------------


async def wait_rebuilt(bus: Bus, session: str, forked_id: int, *, timeout: float = 60.0) -> events.SandboxRebuilt:
    """The ``sandbox_rebuilt`` event answering the ``forked`` event ``forked_id``, once the
    runtime serving ``session`` has appended it; :class:`ActTimeout` when none comes in time."""
    try:
        answer = await bus.session(session).wait_for_answer(forked_id, timeout=timeout)
    except ActTimeout as exc:
        raise ActTimeout(
            f"the fork {session!r} is made, but no runtime worker rebuilt its sandbox within {timeout:g}s; "
            "a runtime worker rebuilds it when it takes the session (riverbed worker runtime)"
        ) from exc
    if not isinstance(answer, events.SandboxRebuilt):
        raise InputError(f"event {forked_id} of {session!r} is answered by a {answer.kind!r}, not by sandbox_rebuilt")
    return answer


async def rebuild_needed(bus: Bus, session: str, at: int, workspace: events.WorkspaceMethod) -> bool:
    """Whether the fork ``session`` (its events 1..``at`` copied) waits for a rebuild that can
    tell anything: ``copy`` always does; ``replay`` only when events 1..``at`` hold a runtime
    action with its recorded answer (what :func:`rebuild` re-executes); ``empty`` never."""
    if workspace != "replay":
        return workspace == "copy"
    actions: set[int] = set()
    async for event in bus.log_store.read(session, 1, at):
        if _is_runtime_action(event) and event.id is not None:
            actions.add(event.id)
        elif isinstance(event, events.Observation) and event.cause in actions:
            return True
    return False


async def rebuild(
    runtime: Executor, session: str, forked: events.Forked, history: Sequence[events.Event]
) -> events.SandboxRebuilt:
    """Build the sandbox of the fork ``session`` as the ``forked`` event asks, from the
    fork's own ``history`` (its events 1..``forked.at``, copied from the source), and say
    how: the ``sandbox_rebuilt`` event to append (its ``cause`` is the ``forked`` event).

    The workspace is emptied first (a previous attempt may have died half-way).  ``replay``
    re-executes every answered runtime action, in order, and compares each observation with
    the recorded one; ``copy`` copies the source's workspace as it is now.
    """
    workspace = runtime.workspace(session)
    await runtime.close_session(session)
    await anyio.to_thread.run_sync(empty_tree, workspace)
    done = events.SandboxRebuilt(method=forked.workspace, at=forked.at, cause=forked.id, trace=forked.trace)
    if forked.workspace == "copy":
        source = runtime.workspace(forked.source_session)
        owner = runtime.workspace_owner(session)
        copied = await anyio.to_thread.run_sync(
            functools.partial(copy_tree, source, workspace, owner=owner, keep=events.MAX_SKIPPED)
        )
        if copied is None:
            return replace(
                done, note=f"the source's workspace {str(source)!r} does not exist here; the fork starts empty"
            )
        return _with_skipped(done, copied)
    if forked.workspace != "replay":
        return done
    steps: list[events.Event] = []
    recorded: dict[int, events.Event] = {}
    for event in history:
        if event.id is None or event.id > forked.at:
            continue
        if isinstance(event, events.Observation) and event.cause is not None:
            recorded.setdefault(event.cause, event)
        if _is_runtime_action(event) or (isinstance(event, events.SessionConfig) and event.env):
            steps.append(event)
    # An action without a recorded answer is not part of the state at ``at``: it runs for
    # real in the fork, after this rebuild.
    steps = [e for e in steps if not _is_runtime_action(e) or (e.id in recorded)]
    paths = (str(runtime.workspace(forked.source_session)), str(workspace))
    differences = await _replay(runtime, session, steps, recorded, paths, skip_bad_env=True)
    return replace(done, actions=sum(1 for e in steps if _is_runtime_action(e)), differences=differences)


async def _replay(
    runtime: Executor,
    workspace_id: str,
    steps: Sequence[events.Event],
    recorded: Mapping[int, events.Event],
    paths: tuple[str, str],
    *,
    written: list[events.Event] | None = None,
    skip_bad_env: bool = False,
) -> list[Difference]:
    """Execute ``steps`` (runtime actions and ``session_config`` events) in order in the
    sandbox of ``workspace_id``; the differences from the ``recorded`` observations."""
    differences: list[Difference] = []
    for event in steps:
        if isinstance(event, events.SessionConfig):
            env = _good_env(event.env) if skip_bad_env else event.env
            runtime.set_env(workspace_id, env)
            if written is not None:
                written.append(_fresh(event))
            continue
        new = await runtime.execute(workspace_id, event)
        assert event.id is not None
        differences.extend(compare(event, recorded.get(event.id), new, workspaces=paths))
        if written is not None:
            written.extend([_fresh(event), _fresh(new)])
    return differences


def _good_env(env: Mapping[str, str | None]) -> dict[str, str | None]:
    """The variables of ``env`` a sandbox accepts (a log written by hand may hold others)."""
    good: dict[str, str | None] = {}
    for name, value in env.items():
        try:
            events.check_env({name: value})
        except InputError:
            continue
        good[name] = value
    return good


def _with_skipped(done: events.SandboxRebuilt, copied: Copied) -> events.SandboxRebuilt:
    """``done`` listing what the copy skipped (special files, files that changed under it)."""
    if not copied.skipped_count:
        return done
    listed = [events.Skipped(path=path, reason=reason) for path, reason in copied.skipped]
    more = f" (the first {len(listed)} are listed)" if copied.skipped_count > len(listed) else ""
    count = copied.skipped_count
    note = (
        f"{count} {'file was' if count == 1 else 'files were'} not copied{more}: special files (FIFOs, "
        "sockets, devices) are never copied, nor files that changed kind during the copy"
    )
    return replace(done, skipped=listed, note=note)


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
        await anyio.to_thread.run_sync(_copy_seed, Path(seed), workspace, runtime.workspace_owner(workspace_id))

    recorded: dict[int, events.Event] = {}
    pending: list[events.Event] = []
    async for event in store.read(session):
        if isinstance(event, events.Observation) and event.cause is not None:
            recorded.setdefault(event.cause, event)
        if _is_runtime_action(event) or (isinstance(event, events.SessionConfig) and event.env):
            pending.append(event)

    written: list[events.Event] = []
    try:
        differences = await _replay(runtime, workspace_id, pending, recorded, paths, written=written)
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


def _copy_seed(seed: Path, workspace: Path, owner: tuple[int, int] | None) -> None:
    if copy_tree(seed.resolve(), workspace, owner=owner) is None:  # (the operator's directory: its own symlinks count)
        raise InputError(f"the rerun seed {str(seed)!r} is not a directory")


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

"""The runtime role: execute actions in the session's sandbox, answer each exactly once.

Every action is claimed with the owner's fencing token right before it runs
(``bus/action_claims.py``): a stale owner's claim is refused and it runs nothing.  The claim also
decides what an action found in flight on takeover (delivered to a lost owner, never
acknowledged) gets: already answered -> just acknowledged; never claimed -> run (it never
started); safe to repeat (reads) -> run again; claimed by the lost owner -> ``error`` with
reason ``runtime_lost`` and ``retryable: true``, because its side effect may or may not
have happened.

A fork whose ``forked`` event asks for its sandbox (``workspace`` = ``replay`` or
``copy``) and has no ``sandbox_rebuilt`` answer yet is rebuilt first, before any new action
of it runs: when the session is opened, or when the ``forked`` event arrives (a worker may
take a fork while its events are still being copied).  It is built only for the ``forked``
event that ``fork()`` wrote (the fork's meta marks its id) and only when the source session
is of the fork's tenant; any other ``forked`` event is answered with a ``sandbox_rebuilt``
that says why nothing was built, and a copied one below the mark is history.  See
:mod:`riverbed.agent.replay`.

A ``run_cancel`` interrupts the session's command: while a ``cmd_run`` or ``python_run``
runs, the log after it is looked at every :data:`CANCEL_POLL_SECONDS`, and a ``run_cancel``
found there interrupts it as a hard timeout would (its one answer says the run was
cancelled); a command still running after its answer (the soft timeout) is interrupted
when the ``run_cancel`` reaches this role.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import anyio
import msgspec
import structlog
from anyio.abc import TaskStatus
from msgspec.structs import replace

from riverbed import events
from riverbed.agent.replay import fork_mark, fork_refusal, rebuild
from riverbed.agent.secrets import TenantSecrets
from riverbed.bus.consumer import Answer, Entry, SessionContext
from riverbed.bus.faults import crashpoint
from riverbed.errors import InputError, RiverbedError
from riverbed.runtime import Runtime, Sandbox
from riverbed.runtime.cgroups import Bounds, Cgroups, CgroupsUnusable, detect
from riverbed.runtime.gate import gated
from riverbed.runtime.sandbox import probe
from riverbed.settings import Settings

log = structlog.get_logger("riverbed.worker")


def checked_sandbox(settings: Settings) -> Sandbox:
    """The configured sandbox, once a real one was built; an unconfined one says so.

    Raises :class:`~riverbed.runtime.SandboxUnavailable` (a ``ConfigError``) when namespaces
    are asked for and cannot be built: a worker refuses to start rather than run commands
    without the isolation it was configured for.
    """
    sandbox = Sandbox(
        mode=settings.sandbox,
        network=settings.sandbox_network,
        bwrap=settings.bwrap,
        tmp_bytes=settings.sandbox_tmp_bytes,
    )
    probe(sandbox, Path(settings.workspace))
    if not sandbox.confined:
        log.warning(
            "sandbox.unconfined",
            mode=sandbox.mode,
            detail="RIVERBED_SANDBOX=process: commands run as the worker's user with its filesystem and network",
        )
    elif sandbox.network == "host":
        log.warning("sandbox.host_network", detail="commands can reach every service the worker host can")
    return sandbox


def checked_cgroups(settings: Settings, *, proc_self: Path = Path("/proc/self")) -> Cgroups | None:
    """The session cgroups of this worker (``RIVERBED_SANDBOX_CPU``, ``_MEMORY``, ``_PIDS``),
    or None, said once at start, when the host gives it none: each sandbox process then keeps
    its rlimits only.  (``proc_self``: where this process's ``mountinfo`` and ``cgroup`` are read.)"""
    bounds = Bounds(cpu=settings.sandbox_cpu, memory=settings.sandbox_memory, pids=settings.sandbox_pids)
    try:
        cgroups = detect(bounds, proc_self=proc_self)
    except CgroupsUnusable as exc:
        log.warning(
            "sandbox.no_cgroups",
            detail=f"{exc}; a session's CPU, memory and process count are not bounded together, "
            "each sandbox process keeps its rlimits",
        )
        return None
    log.info(
        "sandbox.cgroups",
        cgroups=cgroups.describe(),
        cpu=bounds.cpu,
        memory=bounds.memory,
        pids=bounds.pids,
    )
    return cgroups


CANCEL_POLL_SECONDS = 0.25
"""How often the log after a running command is looked at for a ``run_cancel``."""
CANCELLABLE = (events.CmdRun, events.PythonRun)
"""The actions a ``run_cancel`` interrupts (the others end within their own short bounds)."""

SAVE_EVERY = 10_000
"""The runtime saves a session's settings (``SessionContext.save_fold``) every this many
events: a new owner reads only the log after them."""
SAVE_ON_CLOSE = 1_000
"""...and when it lets the session go with at least this many events seen since."""


class _SavedEnv(msgspec.Struct, array_like=True):
    env: dict[str, str | None]
    secrets: list[str] = msgspec.field(default_factory=list)


@dataclass
class _Folded:
    """A session's settings as of event ``last``, and the last id saved."""

    env: dict[str, str | None]
    last: int
    saved: int
    secrets: set[str] = field(default_factory=set)
    """the names of the tenant's secrets the session's runs may use (their ``run_started``'s)"""


class RuntimeHandler:
    role = "runtime"
    ignores_own_answers = True  # it handles actions and session settings, never observations
    on_demand = True
    """A session is announced to the runtime role only by an append of an action it runs (or an
    approval of one), and an idle one is retired: a session that runs no command never holds a
    runtime slot (``bus/log.py``'s ``wakes_runtime``)."""

    def __init__(self, runtime: Runtime, secrets: TenantSecrets | None = None) -> None:
        self.runtime = runtime
        self.secrets = secrets
        """the tenants' secrets: values for the sandboxes' environments, and the outputs' masks"""
        self._folds: dict[str, _Folded] = {}

    async def background(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The sandbox watchdog (process limits between commands), for the worker's task group."""
        await self.runtime.watch(task_status=task_status)

    async def open(self, ctx: SessionContext) -> None:
        await ctx.read_tenant()  # the session's tenant, fixed by its first append
        # the workspace of this log (not an earlier one's under the same id), the sandbox's user
        await self.runtime.open_session(
            ctx.session, created=await ctx.created(), user=partial(ctx.log.sandbox_user, ctx.session)
        )
        await self._fold(ctx)

    async def _fold(self, ctx: SessionContext, until: int | None = None) -> None:
        """Apply the session's settings from its log (up to ``until``; without it, from the
        fold an owner saved before and the log after it); build a fork's sandbox if that is
        still due."""
        env: dict[str, str | None] = {}
        secrets: set[str] = set()
        saved = await ctx.saved_fold() if until is None else None
        if saved is not None:
            try:
                decoded = msgspec.msgpack.decode(saved.blob, type=_SavedEnv)
                env, secrets = dict(decoded.env), set(decoded.secrets)
            except msgspec.DecodeError:
                saved = None
        start = saved.last + 1 if saved is not None else 1
        forks: list[events.Forked] = []
        built: set[int] = set()
        last = start - 1
        async for event in ctx.log.read(ctx.session, start):
            last = event.id or last
            if isinstance(event, events.SandboxRebuilt) and event.cause is not None:
                built.add(event.cause)
            if until is not None and last > until:
                continue
            if isinstance(event, events.SessionConfig):
                env.update(event.env)
            elif isinstance(event, events.RunStarted) and event.secrets:
                secrets.update(event.secrets)
            elif isinstance(event, events.Forked) and event.workspace != "empty":
                forks.append(event)
        if forks:
            # The marked one (fork()'s) and any after it; a copied one below the mark is history.
            mark = fork_mark(await ctx.log.meta(ctx.session))
            for forked in forks:
                if (forked.id or 0) >= mark and forked.id not in built:
                    await self._rebuild(ctx, forked)
        if env:
            self._set_env(ctx.session, env)
        if until is None:
            self._folds[ctx.session] = _Folded(
                env=env, last=last, saved=saved.last if saved is not None else 0, secrets=secrets
            )
            log.info(
                "runtime.opened", session=ctx.session, saved=self._folds[ctx.session].saved, folded=last - start + 1
            )
            if last - self._folds[ctx.session].saved >= SAVE_EVERY:
                await self._save(ctx)

    async def _rebuild(self, ctx: SessionContext, forked: events.Forked) -> None:
        refused = await fork_refusal(ctx.log, ctx.session, ctx.tenant, forked)
        if refused is not None:
            log.warning("fork.refused", session=ctx.session, event_id=forked.id, source=forked.source_session)
            record = events.SandboxRebuilt(method="empty", at=forked.at, cause=forked.id, note=refused)
            await ctx.append([replace(record, tenant=ctx.tenant, trace=forked.trace)])
            return
        history = [e async for e in ctx.log.read(ctx.session, 1, forked.id)]
        started = anyio.current_time()
        built = await rebuild(self.runtime, ctx.session, forked, history)
        await ctx.append([replace(built, tenant=ctx.tenant)])
        log.info(
            "fork.rebuilt",
            session=ctx.session,
            method=built.method,
            actions=built.actions,
            differences=len(built.differences),
            seconds=round(anyio.current_time() - started, 3),
        )

    async def _save(self, ctx: SessionContext) -> None:
        """Save the session's settings as of the last event seen (a cache of the log's fold)."""
        folded = self._folds.get(ctx.session)
        if folded is None or folded.last <= folded.saved:
            return
        saved = _SavedEnv(env=folded.env, secrets=sorted(folded.secrets))
        await ctx.save_fold(folded.last, msgspec.msgpack.encode(saved))
        folded.saved = folded.last

    async def handle(self, ctx: SessionContext, entries: list[Entry]) -> Answer | None:
        """Run the batch's actions in order; the last entry's answer is returned, for the loop
        to send with its next read."""
        forks = [e for e in entries if isinstance(e.event, events.Forked) and e.event.workspace != "empty"]
        if forks:
            await self._fold(ctx, forks[-1].id)  # before the copied actions still unanswered in this batch
        done: list[int] = []
        last = entries[-1]
        held: Answer | None = None
        for entry in entries:
            event = entry.event
            if events.for_runtime(event) and isinstance(event, events.Action) and event.awaits_approval:
                done.append(entry.id)  # (it runs when an approval names it: see below)
            elif events.for_runtime(event):
                ctx.ack_with_read(done)
                done = []
                held = await self._claim_and_run(ctx, entry, hold=entry is last)
            elif isinstance(event, events.Approval) and event.source == "user" and event.decision == "approve":
                ctx.ack_with_read(done)
                done = []
                await self._run_approved(ctx, event)
                done.append(entry.id)
            else:
                if isinstance(event, events.RunCancel):
                    await self._stop_background(ctx, event)
                if isinstance(event, events.SessionConfig) and event.env:
                    self._set_env(ctx.session, event.env)
                    if (folded := self._folds.get(ctx.session)) is not None:
                        folded.env.update(event.env)
                if isinstance(event, events.RunStarted) and event.secrets and ctx.session in self._folds:
                    self._folds[ctx.session].secrets.update(event.secrets)
                done.append(entry.id)
        # (entries other than actions, acknowledged with the loop's next read: looked at again, they change nothing)
        ctx.ack_with_read(done)
        folded = self._folds.get(ctx.session)
        if folded is not None:
            folded.last = max(folded.last, last.id)
            if folded.last - folded.saved >= SAVE_EVERY:
                await self._save(ctx)
        return held

    async def _run_approved(self, ctx: SessionContext, approval: events.Approval) -> None:
        """Run the calls ``approval`` names that wait for it and that this role answers, each
        once (claimed like every action; one answered meanwhile, or rejected, is passed over)."""
        for action_id in sorted(set(approval.actions)):
            async for event in ctx.log.read(ctx.session, action_id, action_id):
                if not (isinstance(event, events.Action) and events.for_runtime(event) and event.awaits_approval):
                    continue
                if await ctx.is_answered(action_id):
                    continue
                entry = Entry(id=action_id, event=event, payload=events.encode(event))
                held = await self._claim_and_run(ctx, entry)
                assert held is None

    def _set_env(self, session: str, env: dict[str, str | None]) -> None:
        """Apply a session's environment; a name the boundary would refuse (a log written
        before a name was reserved, or by hand) is skipped with a warning, never fatal."""
        good: dict[str, str | None] = {}
        for name, value in env.items():
            try:
                events.check_env({name: value})
            except InputError as exc:
                log.warning("session_config.env_skipped", session=session, name=name, error=str(exc))
                continue
            good[name] = value
        self.runtime.set_env(session, good)

    async def recover(self, ctx: SessionContext, entries: list[Entry]) -> Answer | None:
        for entry in entries:
            if events.for_runtime(entry.event):
                await self._claim_and_run(ctx, entry)
            else:
                await self.handle(ctx, [entry])
        return None

    async def close(self, ctx: SessionContext) -> None:
        try:
            folded = self._folds.get(ctx.session)
            if folded is not None and folded.last - folded.saved >= SAVE_ON_CLOSE:
                await self._save(ctx)
        except RiverbedError as exc:  # (a cache: the next owner reads more of the log)
            log.info("fold.not_saved", session=ctx.session, error=str(exc))
        finally:
            self._folds.pop(ctx.session, None)
        if ctx.released:  # (its sandbox is stopped after this returns, unless it is taken again first)
            await self.runtime.release_session(ctx.session)
        else:
            await self.runtime.close_session(ctx.session)

    async def _claim_and_run(self, ctx: SessionContext, entry: Entry, *, hold: bool = False) -> Answer | None:
        """Claim the action, then run it, acknowledge it (answered already) or answer it
        ``runtime_lost`` (another owner started it).  A stale owner's claim raises
        :class:`FencedError`, which ends its session loop before anything runs.  With ``hold``,
        the answer of an action that ran is returned instead of appended.

        A read (``repeatable``: no side effect) is run without a claim, saving a round trip:
        running it twice changes nothing, and its answer is fenced and one-only all the same (a
        stale owner's is refused; a second answer only acknowledges)."""
        event = entry.event
        if isinstance(event, events.Action) and type(event).repeatable:
            return await self._execute(ctx, entry, hold=hold)
        claimed = await ctx.claim(entry)
        if claimed.status == "ok":

            async def still_ours() -> float:
                """The start gate: start only on a fresh claim (a stall since? claim again), by
                the moment it stops being fresh."""
                nonlocal claimed
                crashpoint("start_gate")
                if claimed.fresh:
                    crashpoint("after_start_gate")
                    return claimed.start_by
                claimed = await ctx.claim(entry, again=claimed)
                if claimed.status != "ok":
                    raise RiverbedError(f"action {entry.id} was {claimed.status} elsewhere while this worker stalled")
                return claimed.start_by

            with gated(still_ours):
                return await self._execute(ctx, entry, hold=hold)
        if claimed.status == "answered":
            await ctx.ack([entry.id])
        else:
            log.warning("action.lost", session=ctx.session, event_id=entry.id, claimed_by=claimed.detail)
            await ctx.answer(
                entry,
                events.Error(
                    content=f"the runtime worker running action {entry.id} ({event.kind}) was lost; "
                    "it may or may not have taken effect; check and retry if needed",
                    reason="runtime_lost",
                    retryable=True,
                ),
            )
        return None

    async def _execute(self, ctx: SessionContext, entry: Entry, *, hold: bool = False) -> Answer | None:
        """Run the action and answer it, or with ``hold`` return the answer (the batch's last,
        sent with the loop's next read)."""
        event = entry.event
        assert isinstance(event, events.Action | events.Unknown)
        server = event.server if isinstance(event, events.ToolCall) else None
        if server and not self.runtime.knows_mcp(ctx.session, server):
            await self._learn_mcp(ctx, server, event.id or 0)
        refused = await self._arm(ctx) if self.secrets is not None else None
        observation: events.Observation
        if refused is not None:
            observation = refused
        elif isinstance(event, CANCELLABLE):
            observation = await self._execute_cancellable(ctx, event)
        else:
            observation = await self.runtime.execute(ctx.session, event)
        crashpoint("after_side_effect")
        if hold:
            return Answer(entry, observation)
        await ctx.answer(entry, observation)
        return None

    async def _arm(self, ctx: SessionContext) -> events.Error | None:
        """Give the session's sandbox the values of the secrets its runs may use, and mask its
        outputs with its tenant's as they are read; the error that answers the action instead
        when a value cannot be had (the action does not run without it).  Only with secrets."""
        assert self.secrets is not None
        folded = self._folds.get(ctx.session)
        names = sorted(folded.secrets) if folded is not None else []
        try:
            values = await self.secrets.values(ctx.tenant, names)
        except RiverbedError as exc:
            return events.Error(
                content=f"the session's secrets are not available, so the action did not run: {exc}",
                reason="secret_unavailable",
            )
        if values:
            self._set_env(ctx.session, dict(values))
        self.runtime.set_masks(ctx.session, self.secrets.masker(ctx.tenant))
        return None

    async def _learn_mcp(self, ctx: SessionContext, server: str, before: int) -> None:
        """Give the runtime the spec of a stdio MCP server this owner has not started: the
        log's latest ``mcp_list`` for it before the call (a takeover, a fork's copied events)."""
        spec: events.McpList | None = None
        async for event in ctx.log.read(ctx.session, 1, before):
            if isinstance(event, events.McpList) and event.server == server and event.command:
                spec = event
        if spec is not None:
            self.runtime.learn_mcp(ctx.session, spec)

    async def _execute_cancellable(self, ctx: SessionContext, action: events.Action) -> events.Observation:
        """Run a command while the log after it is watched for a ``run_cancel`` (the log says
        when to stop: a cancel is an event, never a signal of its own)."""
        done: list[events.Observation] = []
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                done.append(await self.runtime.execute(ctx.session, action))
                tg.cancel_scope.cancel()

            tg.start_soon(run)
            tg.start_soon(self._watch_for_cancel, ctx, action.id or 0)
        return done[0]

    async def _watch_for_cancel(self, ctx: SessionContext, after: int) -> None:
        """Interrupt the session's command once a ``run_cancel`` follows action ``after``
        (asked again at each look until the command's answer ends this task: a command that
        had not started yet when the cancel was seen is interrupted once it starts)."""
        cancel: events.RunCancel | None = None
        while True:
            await anyio.sleep(CANCEL_POLL_SECONDS)
            if cancel is None:
                async for event in ctx.log.read(ctx.session, after + 1):
                    after = event.id or after
                    if cancel is None and isinstance(event, events.RunCancel):
                        cancel = event
            if cancel is not None and self.runtime.cancel(ctx.session, _cancelled_note(cancel)):
                log.info("action.cancelled", session=ctx.session, run_cancel=cancel.id)

    async def _stop_background(self, ctx: SessionContext, cancel: events.RunCancel) -> None:
        said = await self.runtime.stop_background(ctx.session, _cancelled_note(cancel))
        if said is not None:
            log.info("command.cancelled", session=ctx.session, run_cancel=cancel.id, said=said[-500:])


def _cancelled_note(cancel: events.RunCancel) -> str:
    return f"[the run was cancelled (event {cancel.id}): the command was interrupted]"

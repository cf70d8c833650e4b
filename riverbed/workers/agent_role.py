"""The agent role: work on each session's open run, one move at a time, as a function of the log.

A session is announced to this role when a run opens on it (``run_started``, or a
``run_cancel``: ``bus/scripts.py``), and the role owns it with the lease, fencing token,
takeover and drain of every role.  Per owned session the handler keeps the log's events and
their :class:`~riverbed.agent.runs.RunFold`; on each batch it folds what is new and makes the
moves :func:`~riverbed.agent.runs.next_move` names until it must wait for the log:

- **call the model** (limits checked first: a run overspends by at most one call), then append
  its ``llm_response`` and, in the same write, its first call's action unless that is a
  ``delegate`` or a ``finish`` or the calls do not parse (key ``run-<opened>-step-<n>``);
- **append call ``i``** of that response (key ``resp-<id>-call-<i>``), one at a time: the next
  once the one before is answered;
- **end the run** with an ``error`` from ``source: agent`` (``step_limit``,
  ``budget_exhausted``, ``cancelled``, ``llm_error``; key ``run-<opened>-end``).

Sub-agents (``riverbed/agent/delegation.py``): ``delegate`` calls that follow one another are
appended in one write; then each one's child session is created (once: its log must be empty,
key ``delegated``), or the ``delegate`` is answered by the ``error`` of the limit that refuses
it (key ``delegate-<id>-refused``).  The children of ``delegate`` actions still waiting are made
sure of again at the first move of every new owner (a crash between the two).  Once a run
ended, a ``run_cancel`` goes to each child still working for it (key ``parent-ended``; a
``delegate`` whose child was never made is answered by an ``error`` instead), and a
child session's owner appends the ``delegate_result`` answering its parent's action to the
parent's log (key ``delegate-result-<action>``; the log's one answer per action holds it to
one): that append is what wakes the parent's owner, or announces the parent again if it was
parked.  These writes to another session carry no fencing token (the session is not this
owner's); each is a function of logs that a peer would make the same.

Every append carries the owner's fencing token (a worker that lost the session appends
nothing) and an idempotency key derived from the log (a retried append appends nothing twice).
What an append adds right after the fold's last event is folded as written (the log is read
instead after a repeat, or when other events came in between), and the role's group moves past
it (``pass_own``): the role's own moves are not delivered back to it.  A model's response is
appended only onto the log as folded (``expected_last``): what came during the call is read
first, and a ``run_cancel`` among it means the response is not used.
The entries of a batch are acknowledged only once its moves are made: a worker that dies in
the middle leaves them pending, and the next owner, having folded the whole log, makes the
moves still due.  A model call whose ``llm_response`` is in the log is never made again; only
a call in flight when its worker died is repeated, once.

A model call is retried by one policy (:mod:`riverbed.agent.retry`: a server that is down,
breaks the connection, times out or answers 408/409/429/5xx, for ``RIVERBED_AGENT_LLM_RETRY_SECONDS``
from the first failure, honouring ``Retry-After``), within the model's limits shared by every
agent worker (:mod:`riverbed.agent.throttle`), then the run ends with ``llm_error`` saying what the
server said; a prompt over the model's context window gets one condensation and one retry first
(:mod:`riverbed.agent.window`).  A ``run_cancel`` ends the run at the next move; a model call in flight is given
up when the cancel's append wakes the session (a command in flight is interrupted by the runtime role,
which watches the log for the same ``run_cancel``).  Once the run ended
the idle session is *retired* (released without being announced again until another run opens).

A run of a tenant holds one of the tenant's run slots (:mod:`riverbed.agent.quotas`, taken again
before its first model call here, so a run opened by other means is bounded too), reports its
tokens after each model call, and gives its slot back when it ends; before each model call the
tenant's daily tokens are checked like the run's own limits (``budget_exhausted``).

A worker takes on runs only while its CPU keeps up with them (:mod:`~riverbed.workers.agent_pace`:
:meth:`AgentHandler.room` tells the owner's intake how many more it may take); each batch
that made a model call tells the pace how long the step took the role itself.

Requests carry the run's model settings (``run_started``), else the worker's
(``RIVERBED_LLM_TEMPERATURE``, ``RIVERBED_LLM_MAX_OUTPUT_TOKENS``, ``RIVERBED_LLM_TIMEOUT``).

The session's run summary (``keys.run``), which ``riverbed runs`` lists, is rewritten when a
move changed it: before a model call, and in the round trip that acknowledges the batch.
The reference agent's prompt (:func:`~riverbed.agent.llm.build_messages`) and tools are used;
unlike the in-process loop (``riverbed agent --in-process``), this role does not ask the
memory role for context recalls.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from dataclasses import replace as dataclass_replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import structlog
from anyio.abc import TaskStatus
from msgspec.structs import replace

from riverbed import events
from riverbed.agent import run_index, tooling
from riverbed.agent.define import REFERENCE, RULES_VERSION, Agent
from riverbed.agent.delegation import REFUSED, ChildPlan, plan_child, refusal, result
from riverbed.agent.images import ImageSource, WorkspaceImages, vision
from riverbed.agent.llm import (
    bounded_response,
    model_parameters,
    recorded_response,
    system_prompt,
    timeout_sentence,
)
from riverbed.agent.mcp import answer_remote
from riverbed.agent.messages import cache_breakpoints
from riverbed.agent.prompt import Prompt
from riverbed.agent.quotas import Quotas, TenantQuota, call_estimate, model_refusal
from riverbed.agent.registry import Hosted, load
from riverbed.agent.retry import GaveUp, RetryPolicy, Saturated, is_model_error, retry_after, retrying
from riverbed.agent.risk import judged
from riverbed.agent.runs import (
    AppendAction,
    AppendDelegates,
    CallModel,
    EndRun,
    ListTools,
    RecallContext,
    RefuseCall,
    RejectCalls,
    Run,
    RunFold,
    RunSummary,
    RunTool,
    Wait,
    appended_with,
    child_session,
    next_move,
    runs_here,
    summarize,
)
from riverbed.agent.secrets import TenantSecrets
from riverbed.agent.throttle import Throttle
from riverbed.agent.toolbox import Toolbox, made_toolbox
from riverbed.agent.usage import Price, StepUsage, parse_prices, step, unpriced
from riverbed.agent.window import WindowFit, asked_to_condense, exceeds_context, too_long, window_fit, window_in
from riverbed.bus.faults import crashpoint
from riverbed.bus.handling import Entry, SessionContext
from riverbed.bus.keys import AGENT_ROLE
from riverbed.bus.status import live_workers
from riverbed.bus.wakeups import Bell, Wakeups
from riverbed.errors import AppendConflict, ConfigError, FencedError, RiverbedError, TenantMismatch
from riverbed.memory.view import ViewBuilder
from riverbed.runtime.paths import workspace_name
from riverbed.settings import DEFAULT_MAX_EVENT_BYTES, Settings
from riverbed.workers.agent_pace import LAG_PROBE, MachineIdle, Pace, own_cgroup
from riverbed.workers.model_client import CheckedClient, checked_by

if TYPE_CHECKING:
    from openai import AsyncOpenAI

__all__ = ["AgentCounters", "AgentHandler", "build_agent_handler"]

log = structlog.get_logger("riverbed.worker")

Offered = list[dict[str, Any]] | msgspec.Raw
"""A request's ``tools``: the toolbox's, or their JSON as it is (:attr:`Toolbox.offered_json`)."""

AGENT_NAME = "llm"
"""The ``agent`` of what the role appends."""
CANCEL_POLL_SECONDS = 0.5
"""How often the log is looked at for a ``run_cancel`` while waiting for the condenser, and while
a model call is in flight on a handler without the worker's wake-ups."""
CALL_LOOK_SECONDS = 5.0
"""How often the log is read while a model call is in flight when no wake-up said it moved (one
may be lost while a feed reconnects).  Polling every run's log twice a second instead was four
reads a step with a model that answers in 2 s, most of a worker's Redis commands with 10,000 runs."""
CALL_WATCHER = "agent:call"
"""The name a model call in flight watches its session's wake-ups under (never skipped: a
wake-up that skips the agent role's loop still says the log moved)."""
CONDENSE_WAIT_SECONDS = 60.0
"""How long a step whose prompt did not fit waits for the condenser's answer before it retries."""
QUOTA_CACHE_SECONDS = 2.0
"""How long a worker keeps a tenant's quotas before reading them again."""


KEPT_EVENTS = 20_000
"""How many events of the sessions it let go an agent worker keeps folded (about 1.6 KB an event
with their prompt), so that taking one again (its next run) reads only the log after them."""
ROLE_LOOK_SECONDS = 10.0
"""How long an agent worker trusts what it saw of another role's live workers (the memory role's
for auto recalls, the condenser role's before a step waits for a condensation)."""

APPROVAL = "approval"
"""The deadline kind of a call waiting for a person (``Agent.approval_timeout``)."""

OTHER_MODEL = "other"
"""The model label of the calls to a model the operator did not name."""


@dataclass
class AgentCounters:
    """What the role's Prometheus metrics read at scrape time (``workers/metrics.py``)."""

    ended: dict[str, int] = field(default_factory=dict)
    """runs this worker ended, by reason (``finish`` for a finished run)"""
    model_calls: int = 0
    model_failures: int = 0
    """model calls that failed (each try of a retried call counts)"""
    model_seconds: float = 0.0
    """the time model calls took, summed"""
    taken_over: int = 0
    """open runs this worker picked up with model calls already made (from a lost or drained owner)"""
    taken: int = 0
    """sessions this worker took"""
    taken_kept: int = 0
    """of them, sessions it had let go and kept folded (:data:`KEPT_EVENTS`): it read only the log after"""
    taken_events: int = 0
    """the events it read from the logs of the sessions it took"""
    latency: dict[str, Latency] = field(default_factory=dict)
    """model -> how long its calls took (each try)"""
    tokens: dict[tuple[str, str, str], int] = field(default_factory=dict)
    """(tenant, model, kind) -> tokens of the responses this worker appended; kind is ``prompt``,
    ``cached`` or ``completion``; tenant ``""`` for sessions without one"""
    cost: dict[tuple[str, str], float] = field(default_factory=dict)
    """(tenant, model) -> their USD (``RIVERBED_PRICES``; unpriced models are left out)"""

    known: frozenset[str] = frozenset()
    """the models labelled by name (the worker's and the priced ones); any other is ``other``: a
    run's model is its client's choice, and a label per name would let clients add series"""

    def label(self, model: str) -> str:
        return model if model in self.known else OTHER_MODEL

    def observe(self, model: str, seconds: float) -> None:
        self.latency.setdefault(self.label(model), Latency()).observe(seconds)

    def count(self, tenant: str | None, counted: StepUsage) -> None:
        who, model = tenant or "", self.label(counted.model)
        for kind, value in (
            ("prompt", counted.prompt_tokens),
            ("cached", counted.cached_tokens),
            ("completion", counted.completion_tokens),
        ):
            key = (who, model, kind)
            self.tokens[key] = self.tokens.get(key, 0) + value
        if counted.cost is not None:
            self.cost[(who, model)] = self.cost.get((who, model), 0.0) + counted.cost


LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Upper bounds (seconds) of the model-call latency histogram's buckets."""


@dataclass
class Latency:
    """A histogram of model-call durations (``riverbed_agent_model_latency_seconds``)."""

    counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    """calls per bucket (not cumulative); those above the last bound are only in ``count``"""
    count: int = 0
    total: float = 0.0
    bounds: tuple[float, ...] = LATENCY_BUCKETS

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1
                break


class _ModelFailed(Exception):
    """The model could not be asked (its error sentence is the message)."""


@dataclass
class _Session:
    fold: RunFold
    seen: list[events.Event] = field(default_factory=list)
    """the log's events 1..``fold.last`` (the prompt is built from them)"""
    created: str = ""
    """the log's creation stamp ('' unknown)"""
    summary: RunSummary | None = None
    saved_at: float = 0.0
    """when ``summary`` was saved (``time.monotonic()``)"""
    slot: int | None = None
    """the run (its ``run_started`` id) known to hold a run slot of its tenant"""
    released: int | None = None
    """the ended run whose slot was given back"""
    spawned: set[int] = field(default_factory=set)
    """``delegate`` actions whose child this worker made sure of (created, found, or refused)"""
    stopped: set[int] = field(default_factory=set)
    """``delegate`` actions whose child this worker cancelled (the run ended without its answer)"""
    reported: int | None = None
    """the run whose ``delegate_result`` this worker appended to the parent"""
    mark: float = 0.0
    """when the batch in hand began, or its last step did (the start of a step's own time)"""
    waited: float = 0.0
    """the time since ``mark`` that model calls, their retries' pauses and Python tools took:
    the step's own time leaves it out (:mod:`agent_pace`)"""
    calls: int = 0
    """the model calls made in the batch in hand"""
    uncondensed: bool = False
    """a prompt over the condenser's budget went out whole, as no condenser worker runs (said once)"""
    foreign: str | None = None
    """why this worker does not work on the open run (its agent definition or run rules are not
    the ones this worker hosts): the session is left to a worker that matches"""

    builder: ViewBuilder = field(default_factory=ViewBuilder)
    """the fold of ``seen`` up to ``built``, kept as the log grows (:meth:`view`)"""
    built: int = 0
    kept: Prompt | None = None
    """the prompt of ``seen``, kept between steps (:meth:`prompt`)"""

    def kept_fold(self) -> _Session:
        """What of this session is the log's alone (the events, their folds, the prompt), for a
        later owner: the moves this owner made and their bookkeeping start afresh."""
        return _Session(
            fold=self.fold, seen=self.seen, created=self.created, builder=self.builder, built=self.built, kept=self.kept
        )

    def add(self, event: events.Event) -> None:
        if event.id is not None and event.id > self.fold.last:
            self.seen.append(event)
            self.fold.add(event)

    def folded(self) -> ViewBuilder:
        """The fold of ``seen``: a step folds only the events that are new since the last."""
        if self.built < len(self.seen):
            self.builder.extend(self.seen[self.built :])
            self.built = len(self.seen)
        return self.builder

    def prompt(self, system: str, condenser_defaults: dict[str, Any] | None, images: ImageSource | None) -> Prompt:
        """The prompt of ``seen`` (:mod:`riverbed.agent.prompt`): a step converts only what is new."""
        if self.kept is None or not self.kept.fits(system, condenser_defaults):
            self.kept = Prompt(system=system, condenser_defaults=condenser_defaults, images=images)
        self.kept.follow(self.seen, self.folded())
        return self.kept


SUMMARY_EVERY = 1.0
"""Seconds a run's saved summary may lag behind its counters (steps, tokens, cost) in the
middle of a batch of steps; anything else it says is saved at once."""


class AgentHandler:
    role = AGENT_ROLE
    ignores_own_answers = False

    def __init__(
        self,
        *,
        client: CheckedClient | AsyncOpenAI,
        model: str,
        prices: dict[str, Price] | None = None,
        llm_timeout: float = 120.0,
        retry_seconds: float = 60.0,
        prompt_cache: str = "none",
        max_depth: int = 3,
        max_fanout: int = 8,
        temperature: float | None = None,
        max_output_tokens: int = 0,
        condenser_defaults: WindowFit | Mapping[str, Any] | None = None,
        pace: Pace | None = None,
        hosted: Hosted | None = None,
        max_calls_per_step: int = 32,
        action_timeout: float = 0.0,
        context_recalls: bool | None = False,
        recall_timeout: float = 15.0,
        only_session: str | None = None,
        images: Callable[[str], ImageSource | None] | None = None,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        max_in_flight: int = 0,
        per_minute: int = 0,
        context_tokens: int = 0,
    ) -> None:
        self.client = client
        self.model = model
        self.prices = prices or {}
        self.llm_timeout = llm_timeout
        self.retry_seconds = retry_seconds
        self.retry = RetryPolicy(budget=retry_seconds)
        self.max_in_flight = max_in_flight
        self.per_minute = per_minute
        self.context_tokens = context_tokens
        """the model's context window (0: unknown, read from the server's context-length errors)"""
        self._throttle: Throttle | None = None
        self.prompt_cache = prompt_cache
        self.max_depth = max_depth
        self.max_fanout = max_fanout
        self.hosted = hosted if hosted is not None else load(entry_point_group=None)
        """the agent definitions this worker works on (the reference agent among them)"""
        self.max_calls_per_step = max_calls_per_step
        self.action_timeout = action_timeout
        """seconds an action of a run may wait for its answer (beyond its own timeout) before the
        agent answers it with an ``error`` (reason ``timeout``) and goes on; 0: it waits as long
        as it takes"""
        self.context_recalls = context_recalls
        """ask the memory role for each user message's context (the workspace's, the knowledge it
        triggers) before the model reads it, waiting up to ``recall_timeout`` seconds for it
        (None: when a live worker of the deployment serves the memory role)"""
        self._roles_seen: tuple[float, frozenset[str] | None] = (-ROLE_LOOK_SECONDS, None)
        """when the live workers were last looked at, and the roles they serve (None: no live
        worker is registered, as when the roles are driven by owners of their own)"""
        self._roles_look = anyio.Lock()
        """Held while the live workers are looked at: each run's step asks whether to recall, and
        without it every run that asked after the look expired read every worker's description
        (with 2,500 runs on a worker, an eighth of its CPU)."""
        self._let_go: OrderedDict[str, _Session] = OrderedDict()
        """the sessions this worker let go, kept folded (:data:`KEPT_EVENTS`), the last let go last"""
        self._let_go_events = 0
        self.recall_timeout = recall_timeout
        self.only_session = only_session
        """serve this session alone (a run served in the caller's process), leaving others to workers"""
        self.max_event_bytes = max_event_bytes
        self.images = images
        """the images a session's prompt may show (a vision model), by session"""
        self.temperature = temperature
        self.max_output_tokens = max_output_tokens
        self.fit = (
            condenser_defaults
            if isinstance(condenser_defaults, WindowFit)
            else WindowFit(self.role, condenser_defaults, max_output_tokens)
        )
        """the condenser config of a session whose ``session_config`` does not say, fitted to the
        model's context window as the condenser role's is (asked of the server before the first
        session opens): a step whose view is over it waits for the condenser"""
        self.pace = pace
        """how many runs this worker takes on at once (None: as many as its capacity)"""
        self.secrets: TenantSecrets | None = None
        """the tenants' secrets (set by the worker: none without ``RIVERBED_SECRETS_KEY``)"""
        self.wakeups: Wakeups | None = None
        """the worker's wake-up feeds (set by the worker): a model call in flight reads the log
        when its session's wake-up rings, not on a clock"""
        self.sessions: dict[str, _Session] = {}
        self._idle: set[str] = set()
        """the owned sessions whose run costs no CPU (:func:`_served`), as of the end of their
        last handling: a session's fold moves only in :meth:`open` and :meth:`handle`, and a
        pacing worker asks for their count at each look for room (counting them walked every
        owned session, 2% of a worker's CPU at 750 sessions)"""
        self.counters = AgentCounters(known=frozenset({model, *self.prices} - {"*"}))
        self._quotas: Quotas | None = None
        self._quota_cache: dict[str, tuple[float, TenantQuota]] = {}

    # --- the Handler protocol -----------------------------------------------------------------

    async def open(self, ctx: SessionContext) -> None:
        await self.fit.learn()
        await ctx.read_tenant()
        created = await ctx.created()
        state = self._let_go.pop(ctx.session, None)
        if state is not None:
            self._let_go_events -= len(state.seen)
        if state is None or not created or state.created != created:  # (a log made again under the id)
            state = _Session(fold=RunFold(self.prices), created=created)
        known = state.fold.last
        async for event in ctx.log.read(ctx.session, known + 1):
            state.add(event)
        self.sessions[ctx.session] = state
        self._note_served(ctx.session, state)
        self.counters.taken += 1
        self.counters.taken_kept += int(known > 0)
        self.counters.taken_events += state.fold.last - known
        run = state.fold.run
        if run is not None and run.open and run.steps > 0:
            self.counters.taken_over += 1
        log.info(
            "agent.opened", session=ctx.session, run=run.opened if run else None, open=bool(run and run.open),
            kept=known, read=state.fold.last - known,
        )  # fmt: skip

    async def recover(self, ctx: SessionContext, entries: list[Entry]) -> None:
        await self.handle(ctx, entries)

    async def handle(self, ctx: SessionContext, entries: list[Entry]) -> None:
        state = self.sessions[ctx.session]
        try:
            await self._handle(ctx, state, entries)
        finally:
            self._note_served(ctx.session, state)

    def _note_served(self, session: str, state: _Session) -> None:
        if _served(state.fold.run):
            self._idle.discard(session)
        else:
            self._idle.add(session)

    async def _handle(self, ctx: SessionContext, state: _Session, entries: list[Entry]) -> None:
        state.mark, state.waited, state.calls = time.monotonic(), 0.0, 0
        if entries[-1].id > state.fold.last:
            if entries[0].id > state.fold.last + 1:
                await self._catch_up(ctx, state)
            for entry in entries:
                state.add(entry.event)
        await self._advance(ctx, state)
        # Acknowledged, and the run's summary saved, in the round trip of the loop's next read.
        summary = self._summary_due(ctx, state)
        along = () if summary is None else run_index.summary_writes(ctx.log.keys, summary, saved=state.summary)
        ctx.ack_with_read([e.id for e in entries], along=along)
        if summary is not None:
            state.summary, state.saved_at = summary, time.monotonic()
        if self.pace is not None and state.calls:
            self.pace.observe(time.monotonic() - state.mark - state.waited)

    def _step_begins(self, state: _Session) -> None:
        """A model call is about to be made: the pace is told the own time of the step before it
        in this batch (a batch may make many steps: a Python tool's answer is the role's own)."""
        if self.pace is not None and state.calls:
            now = time.monotonic()
            self.pace.observe(now - state.mark - state.waited)
            state.mark, state.waited = now, 0.0
        state.calls += 1

    def retires(self, ctx: SessionContext) -> bool:
        """Nothing to do for the session until a client appends: another run opens, or the open
        run is paused, or it waits only for a person's approval (with no deadline to keep)."""
        state = self.sessions.get(ctx.session)
        if state is None or state.fold.run is None or not state.fold.run.open:
            return True
        run = state.fold.run
        if run.cancel_requested is not None:
            return False
        if run.paused is not None:
            return True
        awaiting = run.awaiting()
        if not awaiting or len(awaiting) < len(run.unanswered):
            return False
        agent = self.definition(run)
        return not (isinstance(agent, Agent) and agent.approval_timeout)

    async def close(self, ctx: SessionContext) -> None:
        state = self.sessions.pop(ctx.session, None)
        self._idle.discard(ctx.session)
        if state is None or not state.created or not 0 < len(state.seen) <= KEPT_EVENTS:
            return
        # Kept, the oldest let go first, within KEPT_EVENTS: the log only grows, so a later take
        # of the session (its next run, on this worker) folds only what came after.
        self._let_go[ctx.session] = state.kept_fold()
        self._let_go_events += len(state.seen)
        while self._let_go_events > KEPT_EVENTS:
            _session, oldest = self._let_go.popitem(last=False)
            self._let_go_events -= len(oldest.seen)

    def room(self, owned: int) -> int | None:
        """How many more sessions this worker may take now, owning ``owned`` (None: no pace).

        Sessions it owns count as served, except those it opened whose run ended or waits
        only for its sub-agents' answers (``agent_pace.py``)."""
        if self.pace is None:
            return None
        return self.pace.room(owned - len(self._idle))

    def serves(self, session: str) -> bool:
        """Whether an owned session counts toward its tenant's share of this worker: not when its
        run ended or waits only for its sub-agents (they would wait behind their own parents)."""
        state = self.sessions.get(session)
        return state is None or _served(state.fold.run)

    def open_runs(self) -> int:
        """Open runs of the sessions this worker owns now."""
        return sum(1 for state in self.sessions.values() if state.fold.run is not None and state.fold.run.open)

    async def background(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Tell the pace how late the worker's event loop runs a timer, every :data:`LAG_PROBE`
        (a worker without a pace has nothing to tell)."""
        task_status.started()
        pace = self.pace
        if pace is None:
            return
        while True:
            asked = time.monotonic()
            await anyio.sleep(LAG_PROBE)
            pace.lagged(time.monotonic() - asked - LAG_PROBE)

    async def aclose(self) -> None:
        await self.client.close()

    # --- moves ----------------------------------------------------------------------------------

    def definition(self, run: Run) -> Agent | str:
        """The hosted definition that works on ``run``, or why this worker has none for it."""
        agent = self.hosted.get(run.agent_name)
        if agent is None:
            return f"waiting for a worker that hosts agent {run.agent_name!r} (this one hosts {self._names()})"
        if run.digest is not None and run.digest != agent.digest:
            return (
                f"waiting for a worker that hosts agent {run.agent_name!r} at digest {run.digest} (this one has "
                f"{agent.digest}; `riverbed agent SESSION --upgrade` moves the run to it)"
            )
        if run.rules != RULES_VERSION:
            return (
                f"waiting for a worker with run rules {run.rules} (this one has {RULES_VERSION}; "
                "`riverbed agent SESSION --upgrade` moves the run to them)"
            )
        return agent

    def _names(self) -> str:
        return ", ".join(sorted(self.hosted.agents))

    def _deadlines(self, state: _Session) -> list[tuple[float, int, str]]:
        """(wall-clock deadline, action id, kind) of the run's actions that wait for another role's answer."""
        run = state.fold.run
        if run is None or not run.open:
            return []
        since = run.response.id if run.response is not None and run.response.id is not None else run.opened
        budget = asked_to_condense(state.seen, since)
        condensing = (
            [(budget.ts.timestamp() + CONDENSE_WAIT_SECONDS, budget.id, budget.kind)]
            if budget is not None and budget.id is not None and budget.id not in run.answered
            else []
        )
        out = condensing + [
            (asked + self.recall_timeout, recall, "recall")
            for recall, asked in run.recalled_at.items()
            if recall not in run.answered
        ]
        agent = self.definition(run)
        if isinstance(agent, Agent) and agent.approval_timeout:
            out.extend((a.ts.timestamp() + agent.approval_timeout, a.id or 0, APPROVAL) for a in run.awaiting())
        if not self.action_timeout:
            return out
        waiting = set(run.unanswered)
        for action in run.actions:
            if action.awaits_approval and action.id not in run.approved:
                continue  # (its clock starts with the approval)
            if action.id in waiting and not runs_here(action) and not isinstance(action, events.Delegate):
                own = getattr(action, "timeout", None)
                limit = self.action_timeout + (own if isinstance(own, int | float) else 0.0)
                out.append((action.ts.timestamp() + limit, action.id or 0, action.kind))
        return out

    def wake_at(self, ctx: SessionContext) -> float | None:
        """When the session's next action deadline passes (``time.monotonic()``), if it has one."""
        state = self.sessions.get(ctx.session)
        deadlines = self._deadlines(state) if state is not None and state.foreign is None else []
        if not deadlines:
            return None
        return time.monotonic() + (min(d for d, _, _ in deadlines) - time.time())

    async def tick(self, ctx: SessionContext) -> None:
        """A deadline passed with nothing new on the log: answer what is overdue, and go on."""
        state = self.sessions.get(ctx.session)
        if state is None:
            return
        await self._catch_up(ctx, state)
        await self._advance(ctx, state)
        await self._save_summary(ctx, state)

    async def _answer_overdue(self, ctx: SessionContext, state: _Session) -> None:
        """Answer each action past its deadline with an ``error`` (reason ``timeout``): a run never
        waits forever for a role that is not there (an answer that comes later is refused)."""
        now = time.time()
        for deadline, action, kind in self._deadlines(state):
            if deadline > now:
                continue
            if kind == APPROVAL:
                expired = events.Error(
                    source="agent",
                    cause=action,
                    content="no one approved this call within its approval timeout; it did not run",
                    reason="rejected",
                )
                await self._append(ctx, state, expired, f"approval-{action}-rejected")
                continue
            content = (
                f"no answer to {kind} (action {action}) in time: no worker of the role that runs it answered; "
                "it may still run, so check before calling it again"
            )
            error = events.Error(source="agent", cause=action, content=content, reason="timeout", retryable=True)
            await self._append(ctx, state, error, f"action-{action}-timeout")

    async def _recalls(self, ctx: SessionContext, run: Run) -> bool:
        """Whether the run's user messages get their context recalls: as configured, or (auto) when
        a live worker serves the memory role."""
        if self.context_recalls is not None:
            return self.context_recalls
        if all(message in run.recalls for message, _text in run.said):
            return True  # (nothing left to ask: the answer changes nothing)
        roles = await self._live_roles(ctx)
        return roles is not None and "memory" in roles

    async def _unserved(self, ctx: SessionContext, role: str) -> bool:
        """Whether the deployment's live workers say that none of them serves ``role`` (not
        when no worker is registered: the roles may be driven by owners of their own)."""
        roles = await self._live_roles(ctx)
        return roles is not None and role not in roles

    async def _live_roles(self, ctx: SessionContext) -> frozenset[str] | None:
        """The roles the deployment's live workers serve (None: no live worker is registered),
        looked at every :data:`ROLE_LOOK_SECONDS`."""
        checked, roles = self._roles_seen
        if time.monotonic() - checked > ROLE_LOOK_SECONDS:
            async with self._roles_look:  # (one look for all the runs that ask while it is made)
                checked, roles = self._roles_seen
                if time.monotonic() - checked > ROLE_LOOK_SECONDS:
                    workers = await live_workers(ctx.log.redis, ctx.log.keys)
                    roles = frozenset(r for w in workers for r in w.description.get("roles", [])) if workers else None
                    self._roles_seen = (time.monotonic(), roles)
        return roles

    def leaves(self, ctx: SessionContext) -> bool:
        """The session's open run is not this worker's to work on: leave it to a worker that matches."""
        state = self.sessions.get(ctx.session)
        return state is not None and state.foreign is not None

    async def _advance(self, ctx: SessionContext, state: _Session) -> None:
        """Make the moves the log calls for, until the run must wait for the log (or ended)."""
        run = state.fold.run
        if self.only_session is not None and ctx.session != self.only_session:
            state.foreign = f"this agent serves {self.only_session} alone"
            return
        if run is not None and run.open:
            found = self.definition(run)
            if isinstance(found, str):
                if state.foreign != found:
                    log.info("agent.run_left", session=ctx.session, run=run.opened, why=found)
                state.foreign = found
                if run.cancel_requested is None:
                    return
                found = REFERENCE  # (any worker may end a cancelled run: no rule of the definition is used)
            state.foreign = None
            agent = found
        else:
            agent = REFERENCE
        await self._delegate(ctx, state)  # (after a takeover: children not made sure of yet)
        await self._answer_overdue(ctx, state)
        made: tuple[str, int] | None = None
        while True:
            run = state.fold.run
            move = next_move(
                run,
                agent,
                state.fold.mcp,
                recalls=run is not None and await self._recalls(ctx, run),
                first_message=state.fold.first_user_message,
            )
            if isinstance(move, Wait) or run is None:
                break
            if made == (type(move).__name__, state.fold.last):
                # The same kind of move again with the log where it was: its append was a repeat the
                # log does not show (a log made again under the same id while the key lived).
                # Stop rather than spin; the next event wakes the session again.
                log.error("agent.move_repeated", session=ctx.session, move=type(move).__name__, last=state.fold.last)
                break
            made = (type(move).__name__, state.fold.last)
            if isinstance(move, EndRun):
                await self._end(ctx, state, run, move.reason, move.content)
            elif isinstance(move, RejectCalls):
                error = events.Error(source="agent", cause=move.response, content=move.content, reason="bad_tool_call")
                await self._append(ctx, state, error, f"resp-{move.response}-reject")
            elif isinstance(move, AppendAction):
                if move.index > 0:
                    crashpoint("agent_between_actions")
                action = _judged(run, agent, move.action)
                await self._append(ctx, state, action, f"resp-{move.response}-call-{move.index}")
                if isinstance(move.action, events.Finish):
                    self._count_end("finish")
            elif isinstance(move, AppendDelegates):
                if move.index > 0:
                    crashpoint("agent_between_actions")
                judged = [_judged(run, agent, a) for a in move.actions]
                await self._append_all(ctx, state, judged, f"resp-{move.response}-call-{move.index}")
                await self._delegate(ctx, state)
            elif isinstance(move, ListTools):
                server = move.server
                url = getattr(server, "url", None)
                listing = events.McpList(
                    server=server.name,
                    command=list(server.command) if getattr(server, "command", None) else None,
                    url=url,
                    env=list(getattr(server, "env", None) or []),
                    timeout=float(getattr(server, "timeout", 30.0)),
                    runs_in="agent" if url else "runtime",
                )
                await self._append(ctx, state, listing, f"run-{run.opened}-mcp-{server.name}")
            elif isinstance(move, RecallContext):
                asks = [events.Recall(recall_type="workspace_context", cause=move.message)] if move.first else []
                asks.append(events.Recall(recall_type="knowledge", query=move.text, cause=move.message))
                await self._append_all(ctx, state, asks, f"recall-{move.message}")
            elif isinstance(move, RunTool):
                await self._run_tool(ctx, state, run, agent, move.action)
            elif isinstance(move, RefuseCall):
                said = f": {move.reason}" if move.reason else ""
                rejection = events.Error(
                    source="agent",
                    cause=move.action,
                    content=f"a person rejected this call{said}. It did not run.",
                    reason="rejected",
                )
                await self._append(ctx, state, rejection, f"approval-{move.action}-rejected")
            elif isinstance(move, CallModel):
                if not await self._within_budget(ctx, state, run, agent):
                    break  # (the condenser's answer wakes the session)
                await ctx.send_writes()  # (the tokens of this batch's steps before, counted)
                refused = await self._over_quota(ctx, state, run)
                if refused is not None:
                    await self._end(ctx, state, run, "budget_exhausted", refused)
                else:
                    await self._step(ctx, state, run, agent)
        await self._wind_up(ctx, state)
        await self._release_slot(ctx, state)

    def _toolbox(self, agent: Agent, listed: dict[str, events.McpTools]) -> tuple[Toolbox, Offered]:
        """The agent's toolbox with the MCP listings of the log, and the request's ``tools``
        (their JSON for the role's own client, which sends it as it is)."""
        toolbox = made_toolbox(agent, listed, sub_agents=self.max_depth > 0)
        return toolbox, toolbox.offered_json if isinstance(self.client, CheckedClient) else toolbox.offered

    def _prompt(self, ctx: SessionContext, state: _Session, agent: Agent) -> Prompt:
        """The session's prompt for ``agent``, caught up with the log."""
        images = self.images(ctx.session) if self.images is not None else None
        return state.prompt(system_prompt(agent), self._condenser(agent), images)

    def _condenser(self, agent: Agent) -> dict[str, Any] | None:
        """The condenser settings of ``agent``'s runs: the worker's, with the agent's over them."""
        if agent.condenser:
            return {**self.fit.defaults, **agent.condenser}
        return self.fit.defaults

    async def _within_budget(self, ctx: SessionContext, state: _Session, run: Run, agent: Agent) -> bool:
        """Whether the model may be sent the view now: it is within the session's condenser
        budget, or the condenser answered this step's ``condensation_request`` (or did not in
        :data:`CONDENSE_WAIT_SECONDS`: the agent answered it, and goes on).  Else the request is
        made (once a step) and the step waits for its answer: a condenser that is behind never
        lets a prompt over the budget go out."""
        if not self._prompt(ctx, state, agent).over_budget():
            return True
        since = run.response.id if run.response is not None and run.response.id is not None else run.opened
        asked = asked_to_condense(state.seen, since)
        if asked is None and await self._unserved(ctx, "condenser"):
            # Nobody would answer: the prompt goes out whole (the model may still take it; when it
            # does not, the run ends with a sentence that names the window).
            if not state.uncondensed:
                state.uncondensed = True
                log.warning("agent.no_condenser", session=ctx.session, run=run.opened)
            return True
        if asked is None:
            request = events.CondensationRequest(source="agent", cause=state.fold.last)
            await self._append(ctx, state, request, f"run-{run.opened}-step-{run.steps + 1}-condense")
            return False
        return asked.id in run.answered or await ctx.is_answered(asked.id or 0)

    async def _run_tool(
        self, ctx: SessionContext, state: _Session, run: Run, agent: Agent, action: events.ToolCall | events.McpList
    ) -> None:
        """Claim ``action`` (one this worker answers itself) with the owner's fencing token, run it,
        and append its answer.  A call a lost owner had claimed is answered ``tool_lost``, or run
        again when its tool is idempotent; one answered meanwhile is only folded."""
        assert action.id is not None
        tool = agent.user_tools.get(action.tool) if isinstance(action, events.ToolCall) else None
        claimed = await ctx.claim_id(action.id)
        if claimed.status == "claimed" and tool is not None and tool.idempotent:
            log.info("agent.tool_again", session=ctx.session, action=action.id, tool=tool.name)
            claimed = await ctx.claim_id(action.id, force=True)
        if claimed.status == "answered":
            await self._catch_up(ctx, state)
            return
        key = f"tool-{action.id}-answer"
        if claimed.status != "ok":
            name = action.tool if isinstance(action, events.ToolCall) else f"{action.server} listing"
            lost = events.Error(
                source="agent",
                cause=action.id,
                content=f"the worker running {name} (action {action.id}) was lost; it may or may not have taken "
                "effect: check before calling it again",
                reason="tool_lost",
                retryable=True,
            )
            await self._append(ctx, state, lost, key)
            return
        crashpoint("agent_tool_claimed")
        began = time.monotonic()
        answer = await self._tool_answer(ctx, run, agent, action, tool)
        state.waited += time.monotonic() - began  # (the tool's time is the user's, as the model's is)
        crashpoint("agent_tool_ran")
        await self._append(ctx, state, answer, key)

    async def _tool_answer(
        self, ctx: SessionContext, run: Run, agent: Agent, action: events.ToolCall | events.McpList, tool: Any
    ) -> events.Observation:
        """The answer of a call this worker runs: a Python tool's outcome, or a remote MCP server's."""
        if isinstance(action, events.ToolCall) and tool is not None:
            try:
                secrets = await self._secret_values(ctx, run, agent)
            except RiverbedError as exc:
                return events.ToolResult(
                    content=f"the tool {tool.name} did not run: the run's secrets are not available ({exc})",
                    is_error=True,
                    cause=action.id,
                )
            context = tooling.ToolContext(
                session=ctx.session,
                tenant=ctx.tenant,
                run=run.opened,
                action_id=action.id or 0,
                log=log.bind(session=ctx.session, run=run.opened),
                secrets=secrets,
            )
            started = time.monotonic()
            outcome = await tooling.call(tool, action.arguments, context)
            log.info(
                "agent.tool_ran",
                session=ctx.session,
                action=action.id,
                tool=tool.name,
                is_error=outcome.is_error,
                seconds=round(time.monotonic() - started, 3),
            )
            return events.ToolResult(content=outcome.content, is_error=outcome.is_error, cause=action.id)
        return await self._remote_mcp(ctx, agent, action)

    async def _secret_values(self, ctx: SessionContext, run: Run, agent: Agent) -> dict[str, str]:
        """The values of the secrets ``run`` may use (its own and its agent's), for its tools."""
        names = sorted({*run.secrets, *agent.secrets})
        if not names:
            return {}
        if self.secrets is None:
            raise ConfigError("this worker cannot read secrets: RIVERBED_SECRETS_KEY is not set in its environment")
        return await self.secrets.values(ctx.tenant, names)

    async def _remote_mcp(
        self, ctx: SessionContext, agent: Agent, action: events.ToolCall | events.McpList
    ) -> events.Observation:
        """A remote MCP server's listing or call (a server of the agent's, by its name): the
        tenant's allowed URLs are checked first, and the server's failures are answers."""
        server = next((s for s in agent.mcp if s.name == action.server), None)
        if server is None or server.url is None:
            missing = f"agent {agent.name} on this worker has no remote MCP server {action.server!r}"
            if isinstance(action, events.McpList):
                return events.Error(source="agent", cause=action.id, content=missing, reason="mcp_failed")
            return events.ToolResult(content=missing, is_error=True, cause=action.id)
        return await answer_remote(action, server, self._quotas_of(ctx), ctx.tenant)

    async def _step(self, ctx: SessionContext, state: _Session, run: Run, agent: Agent) -> None:
        """One model call and its ``llm_response`` (or the ``llm_error`` that ends the run)."""
        model = run.model or agent.model or self.model
        until = state.fold.last
        crashpoint("agent_before_llm")
        self._step_begins(state)
        await self._save_summary(ctx, state)
        toolbox, offered = self._toolbox(agent, state.fold.mcp)
        try:
            try:
                response = await self._complete(ctx, state, model, _started(state.seen, run.opened), agent, offered)
            except _ModelFailed as exc:
                if not exceeds_context(exc.__cause__):
                    raise
                response, until = await self._condensed_retry(ctx, state, run, model, exc, agent, offered)
        except _ModelFailed as exc:
            await self._catch_up(ctx, state)
            if state.fold.run is run and run.open and run.cancel_requested is None:
                await self._end(ctx, state, run, "llm_error", str(exc))
            return
        recorded = bounded_response(recorded_response(response, model, until or None), self.max_event_bytes)
        key = f"run-{run.opened}-step-{run.steps + 1}"
        while True:
            if state.fold.run is not run or not run.open or run.cancel_requested is not None:
                return  # cancelled (or ended) during the call: its response is not used
            # The response's first action goes in the same write (its id follows the response's),
            # unless it ends the run: the step's tokens are counted (metrics, the tenant's day)
            # before the run's end is on the log.
            first = appended_with(replace(recorded, id=state.fold.last + 1), toolbox)
            if isinstance(first, events.Finish):
                first = None
            elif first is not None:
                first = _judged(run, agent, first)
            try:
                # Only onto the log as folded: what came during the call (a cancel) is read first.
                await self._append_all(
                    ctx, state, [recorded] if first is None else [recorded, first], key, expected_last=state.fold.last
                )
            except AppendConflict:
                await self._catch_up(ctx, state)
                continue
            break
        self.counters.count(ctx.tenant, step(recorded, 0, self.prices))
        if ctx.tenant is not None:
            # Its own calls only: each sub-agent's run reports its own (its tokens also count into this run's budget).
            # Counted with the loop's next read, or before this batch's next model call asks for the tenant's room.
            own = run.prompt_tokens + run.completion_tokens
            ctx.write_with_read(self._quotas_of(ctx).count_tokens_write(ctx.tenant, ctx.session, run.opened, own))
        crashpoint("agent_after_response")

    async def _condensed_retry(
        self,
        ctx: SessionContext,
        state: _Session,
        run: Run,
        model: str,
        failed: _ModelFailed,
        agent: Agent,
        offered: Offered,
    ) -> tuple[Any, int]:
        """The prompt did not fit the model's context window: ask the condenser role once
        (a ``condensation_request``), wait for its answer, and ask the model once more (its
        response, and the last event its prompt was built from); a step that asked already (the
        log says so, also after a takeover) ends the run (``agent/window.py``)."""
        error = failed.__cause__
        assert error is not None
        window = self.context_tokens or window_in(error)
        since = run.response.id if run.response is not None and run.response.id is not None else run.opened
        asked = asked_to_condense(state.seen, since)
        if asked is not None and asked.id is not None and await ctx.is_answered(asked.id):
            raise _ModelFailed(too_long(window, _said(error, 0))) from error
        if asked is None and await self._unserved(ctx, "condenser"):
            raise _ModelFailed(too_long(window, _said(error, 0), condensed=False)) from error
        if asked is None:
            request = events.CondensationRequest(source="agent", cause=state.fold.last)
            await self._append(ctx, state, request, f"run-{run.opened}-step-{run.steps + 1}-condense")
            asked = asked_to_condense(state.seen, since)
            log.info("agent.context_exceeded", session=ctx.session, window=window, request=asked and asked.id)
        assert asked is not None
        assert asked.id is not None
        with anyio.move_on_after(CONDENSE_WAIT_SECONDS):  # (no condenser role: the retry comes anyway)
            while True:
                await self._catch_up(ctx, state)
                if run.cancel_requested is not None or await ctx.is_answered(asked.id):
                    break
                await anyio.sleep(CANCEL_POLL_SECONDS)
        await self._catch_up(ctx, state)
        if state.fold.run is not run or not run.open or run.cancel_requested is not None:
            raise _ModelFailed("the model call was given up: the run was cancelled") from error
        until = state.fold.last
        try:
            return await self._complete(ctx, state, model, _started(state.seen, run.opened), agent, offered), until
        except _ModelFailed as again:
            cause = again.__cause__
            if cause is not None and exceeds_context(cause):
                raise _ModelFailed(too_long(window or window_in(cause), _said(cause, 0))) from again
            raise

    async def _end(self, ctx: SessionContext, state: _Session, run: Run, reason: str, content: str) -> None:
        error = events.Error(source="agent", content=content, reason=reason, retryable=reason != "cancelled")
        await self._append(ctx, state, error, f"run-{run.opened}-end")
        self._count_end(reason)
        log.info("agent.run_ended", session=ctx.session, run=run.opened, reason=reason, steps=run.steps)

    # --- tenant quotas --------------------------------------------------------------------------

    def _throttle_of(self, ctx: SessionContext) -> Throttle:
        if self._throttle is None:
            self._throttle = Throttle(
                ctx.log.redis, ctx.log.keys, max_in_flight=self.max_in_flight, per_minute=self.per_minute
            )
        return self._throttle

    def _quotas_of(self, ctx: SessionContext) -> Quotas:
        if self._quotas is None:
            self._quotas = Quotas(ctx.log)
        return self._quotas

    async def _over_quota(self, ctx: SessionContext, state: _Session, run: Run) -> str | None:
        """Why the run's tenant may not have another model call (None: it may: its tokens are reserved)."""
        if run.max_cost is not None and (unbound := unpriced(run.model or self.model, self.prices)) is not None:
            return f"the run may not start: {unbound}"
        tenant = ctx.tenant
        if tenant is None:
            return None
        quotas = self._quotas_of(ctx)
        if state.slot != run.opened:
            refused = await quotas.take_slot(tenant, ctx.session)
            if refused is not None:
                return f"the run may not start: {refused}"
            state.slot = run.opened
        now = time.monotonic()
        cached = self._quota_cache.get(tenant)
        if cached is None or cached[0] < now:
            cached = (now + QUOTA_CACHE_SECONDS, await quotas.get(tenant))
            self._quota_cache[tenant] = cached
        if (other_model := model_refusal(tenant, cached[1], run.model, self.model)) is not None:
            return f"the run may not start: {other_model}"
        refused = await quotas.reserve_call(
            tenant, ctx.session, run.opened, cached[1], ttl=self.llm_timeout + self.retry_seconds + 30,
            estimate=lambda: call_estimate(state.seen, self.max_output_tokens),
        )  # fmt: skip
        return None if refused is None else f"the run stopped: {refused}"

    async def _release_slot(self, ctx: SessionContext, state: _Session) -> None:
        run = state.fold.run
        if run is None or run.open or ctx.tenant is None or state.released == run.opened:
            return
        await self._quotas_of(ctx).release(ctx.tenant, ctx.session)
        state.released = run.opened

    def _count_end(self, reason: str) -> None:
        self.counters.ended[reason] = self.counters.ended.get(reason, 0) + 1

    async def _append(
        self, ctx: SessionContext, state: _Session, event: events.Event, key: str, *, expected_last: int | None = None
    ) -> None:
        """Append one event with the owner's fencing token under ``key``, then fold the log up to it."""
        await self._append_all(ctx, state, [event], key, expected_last=expected_last)

    async def _append_all(
        self,
        ctx: SessionContext,
        state: _Session,
        batch: Sequence[events.Event],
        key: str,
        *,
        expected_last: int | None = None,
    ) -> None:
        """Append ``batch`` in one write with the owner's fencing token under ``key``, then fold the log.

        Events this write appended right after the fold's last one are folded as written (the
        log holds nothing else up to them); otherwise (a repeat, or events came in between) the
        log is read."""
        written = await ctx.append_events(
            [
                _stamped(event, ctx.tenant, state.fold.run.agent_name if state.fold.run else AGENT_NAME)
                for event in batch
            ],
            expected_last=expected_last,
            idempotency_key=key,
            pass_own=True,
        )
        if written and written[0].id == state.fold.last + 1:
            for event in written:
                state.add(event)
        else:
            await self._catch_up(ctx, state)

    # --- sub-agents -----------------------------------------------------------------------------

    async def _delegate(self, ctx: SessionContext, state: _Session) -> None:
        """Make sure each ``delegate`` of the open run that waits for its answer has its child
        session, or is answered by the ``error`` of the limit that refuses it."""
        run = state.fold.run
        if run is None or not run.open or run.cancel_requested is not None:
            return
        waiting = [
            a
            for a in run.waiting_delegates
            if a.id is not None and a.id not in state.spawned and (not a.awaits_approval or a.id in run.approved)
        ]
        for action in waiting:
            assert action.id is not None
            crashpoint("agent_delegating")
            # Claimed with the owner's fencing token, as the runtime claims a command: a worker
            # that lost the session (FencedError) makes nothing after the fact.
            claimed = await ctx.claim_id(action.id)
            if claimed.status == "claimed":  # (a lost owner's: this one makes sure of the child now)
                claimed = await ctx.claim_id(action.id, force=True)
            if claimed.status == "answered":  # (a peer that took the session over ended the run)
                state.spawned.add(action.id)
                continue
            refused = refusal(state.fold, run, action, max_depth=self.max_depth, max_fanout=self.max_fanout)
            if refused is None:
                crashpoint("agent_creating")
                if not claimed.fresh:  # (a stall since the claim: claimed again, or fenced)
                    claimed = await ctx.claim_id(action.id, again=claimed)
                    if claimed.status != "ok":
                        continue
                refused = await self._create_child(ctx, self._child_plan(ctx, state, run, action))
            if refused is not None:
                error = events.Error(source="agent", cause=action.id, content=refused, reason=REFUSED)
                await self._append(ctx, state, error, f"delegate-{action.id}-refused")
            state.spawned.add(action.id)
        if waiting:
            # A cancel (or a peer's end of the run) that came meanwhile reaches the children made here.
            await self._catch_up(ctx, state)

    def _child_plan(self, ctx: SessionContext, state: _Session, run: Run, action: events.Delegate) -> ChildPlan:
        """The child of ``action``; it runs the sub-agent the call names, else its parent's agent
        (a parent on a hosted definition passes it on with the digest this worker hosts)."""
        plan = plan_child(ctx.session, state.fold, run, action)
        named = action.sub_agent if isinstance(action.sub_agent, str) else None
        if named is None and run.digest is None:
            # (the reference agent, on whichever digest a worker hosts)
            return (
                dataclass_replace(plan, started=replace(plan.started, secrets=list(run.secrets)))
                if run.secrets
                else plan
            )
        name = named or run.agent_name
        definition = self.hosted.get(name)
        chosen: dict[str, Any] = {"agent_name": name, "rules": RULES_VERSION}
        if definition is not None:
            chosen["digest"] = definition.digest
        # (a child may use the secrets its parent's run may, and its own agent's)
        secrets = sorted({*run.secrets, *(definition.secrets if definition is not None else ())})
        if secrets:
            chosen["secrets"] = secrets
        return dataclass_replace(plan, started=replace(plan.started, **chosen))

    async def _create_child(self, ctx: SessionContext, plan: ChildPlan) -> str | None:
        """Create the child session (once: its log must be empty); None when it exists as this
        task's child now, else why it cannot be (a sentence for the model)."""
        batch = [_stamped(e, ctx.tenant) for e in (plan.header, plan.task, plan.started)]
        try:
            await ctx.log.append(plan.session, batch, expected_last=0, idempotency_key="delegated", tenant=ctx.tenant)
        except (AppendConflict, TenantMismatch):
            first = None
            async for event in ctx.log.read(plan.session, 1, 1):
                first = event
            ours = (
                isinstance(first, events.Delegated)
                and first.parent == plan.header.parent
                and first.parent_action == plan.header.parent_action
            )
            if not ours:
                return f"delegate refused: the sub-agent's session id {plan.session} is taken by another session"
        else:
            redis, keys = ctx.log.redis, ctx.log.keys
            async with redis.pipeline() as pipe:  # (listed by `riverbed runs` before a worker picks it up)
                run_index.queue_opened(pipe, keys, plan.session, time.time(), ctx.tenant, None)
                await pipe.execute()
            log.info("agent.delegated", session=ctx.session, child=plan.session, action=plan.header.parent_action)
        return None

    @staticmethod
    async def _is_child(ctx: SessionContext, child: str, action: int) -> bool:
        """Whether session ``child`` is the one made for ``ctx.session``'s ``delegate`` ``action``."""
        async for first in ctx.log.read(child, 1, 1):
            return isinstance(first, events.Delegated) and (first.parent, first.parent_action) == (ctx.session, action)
        return False

    async def _wind_up(self, ctx: SessionContext, state: _Session) -> None:
        """Once the run ended: cancel the children it no longer waits for, and answer the
        parent's ``delegate`` when this session is a child."""
        run = state.fold.run
        if run is None or run.open:
            return
        if run.end_reason != "forked":
            for action in run.waiting_delegates:
                if action.id is None or action.id in state.stopped:
                    continue
                child = child_session(ctx.session, action.id)
                # (a child made later is cancelled by its maker; a session that holds the id but is
                # not this action's child, maybe another tenant's, is left alone)
                if await self._is_child(ctx, child, action.id):
                    note = f"the parent run ({ctx.session}) ended: {run.end_reason}"
                    cancel = events.RunCancel(source="system", note=note, agent=AGENT_NAME, tenant=ctx.tenant)
                    await ctx.log.append(child, [cancel], idempotency_key="parent-ended", tenant=ctx.tenant)
                else:  # no child will answer it: the action still gets its one answer
                    why = f"delegate refused: the run ended ({run.end_reason}) before a sub-agent took this task"
                    error = events.Error(source="agent", cause=action.id, content=why, reason=REFUSED)
                    await self._append(ctx, state, error, f"delegate-{action.id}-refused")
                state.stopped.add(action.id)
        report = state.fold.reports_to
        # Only the session made for that action answers it (not an import of one under another id).
        if report is not None and ctx.session == child_session(*report) and state.reported != run.opened:
            parent, cause = report
            crashpoint("agent_reporting")
            answer = _stamped(result(ctx.session, run, cause), ctx.tenant)
            try:
                await ctx.log.append(parent, [answer], idempotency_key=f"delegate-result-{cause}", tenant=ctx.tenant)
            except TenantMismatch:  # (not a child its parent made: its tenant is not the parent's)
                log.warning("agent.report_refused", session=ctx.session, parent=parent, action=cause)
            else:
                log.info("agent.reported", session=ctx.session, parent=parent, action=cause, state=run.state)
            state.reported = run.opened

    async def _catch_up(self, ctx: SessionContext, state: _Session) -> None:
        async for event in ctx.log.read(ctx.session, state.fold.last + 1):
            state.add(event)

    # --- the model ------------------------------------------------------------------------------

    async def _complete(
        self,
        ctx: SessionContext,
        state: _Session,
        model: str,
        started: events.RunStarted | None,
        agent: Agent,
        offered: Offered,
    ) -> Any:
        """The model's response to the prompt the log makes; a model error is retried by
        ``self.retry`` (``agent/retry.py``; a cancel stops that)."""
        prompt = self._prompt(ctx, state, agent)
        request: dict[str, Any] = {
            "model": model,
            # (the kept messages' JSON, joined: only what is new is encoded; a client of the
            # caller's is given the messages themselves)
            "messages": prompt.encoded_parts(self.prompt_cache)
            if isinstance(self.client, CheckedClient)
            else cache_breakpoints(prompt.messages(), self.prompt_cache),
            "tools": offered,
            "tool_choice": "auto",
            # Several calls in one response: the role appends them in order (each after the one
            # before is answered), and ``delegate`` calls that follow one another run at once.
            "parallel_tool_calls": True,
        }
        # The run's own model settings (``riverbed agent --temperature …``), else this worker's.
        run_temperature = started.temperature if started is not None else None
        run_output = started.max_output_tokens if started is not None else None
        timeout = (started.llm_timeout if started is not None else None) or self.llm_timeout
        request.update(
            model_parameters(
                self.temperature if run_temperature is None else run_temperature,
                self.max_output_tokens if run_output is None else run_output,
            )
        )

        async def wait(exc: BaseException, pause: float) -> None:
            said = _said(exc, timeout)
            waiting = log.debug if isinstance(exc, Saturated) else log.warning  # (a wait for a turn is no failure)
            waiting("agent.llm_retry", session=ctx.session, error=said, retry_in=round(pause, 3))
            status = getattr(exc, "status_code", None)
            if status in (429, 503) and retry_after(exc) is not None:  # (every worker waits it out)
                await self._throttle_of(ctx).pause(model, pause)
            paused = time.monotonic()
            await anyio.sleep(pause)
            state.waited += time.monotonic() - paused
            await self._catch_up(ctx, state)
            run = state.fold.run
            if run is None or not run.open or run.cancel_requested is not None:
                raise _ModelFailed(f"the model call was given up ({said})") from exc

        try:
            # (within the model's shared limits: Saturated, waited out like a 429, when they are full)
            limited = partial(self._throttle_of(ctx).run, model, ctx.tenant, f"{ctx.worker}:{ctx.session}")
            response = await retrying(
                self.retry, partial(limited, partial(self._call_once, ctx, state, request, timeout)), wait=wait
            )
        except GaveUp as failed:
            exc = failed.error
            if isinstance(exc, TimeoutError):
                raise _ModelFailed(timeout_sentence(timeout, failed.tries)) from exc
            if isinstance(exc, Saturated):
                raise _ModelFailed(f"the model call waited for its turn past the retry budget ({exc})") from exc
            again = f" after {failed.tries} tries" if failed.tries > 1 else ""
            raise _ModelFailed(f"the model call failed{again} ({_said(exc, timeout)})") from exc
        if not response.get("choices"):
            raise _ModelFailed("the model call failed (the model returned no choices)")
        return response

    async def _call_once(
        self, ctx: SessionContext, state: _Session, request: dict[str, Any], timeout: float
    ) -> dict[str, Any]:
        """One model call, its answer as the server's JSON; given up (:class:`_ModelFailed`)
        when the run is cancelled meanwhile: the log is read when the session's wake-up says it
        moved past the fold while the call is in flight, and every :data:`CALL_LOOK_SECONDS`
        in case a wake-up was lost (without the worker's wake-ups: every
        :data:`CANCEL_POLL_SECONDS`)."""
        outcome: list[dict[str, Any]] = []
        failure: list[BaseException] = []
        client = self.client
        checked = client if isinstance(client, CheckedClient) else None

        async def hold() -> None:  # paused past the lease, then resumed: a peer has the run now
            if not await ctx.holds():
                raise FencedError(ctx.session, ctx.role, ctx.fence.token)

        if checked is None:
            await hold()
        done = ended = False
        watching: list[Bell] = []
        # The call's scope: its deadline is the call's timeout, and the watch cancels it when the
        # run ended meanwhile (one scope for both: a second one, anyio's fail_after, cost a step
        # about 3% of its instructions).
        scope = anyio.CancelScope(deadline=anyio.current_time() + timeout)

        def end_call() -> None:
            nonlocal ended
            ended = True
            scope.cancel()

        async def watch() -> None:
            wakeups = self.wakeups
            bell = await wakeups.watch(ctx.session, CALL_WATCHER) if wakeups is not None else None
            if bell is not None:
                watching.append(bell)
            mark = bell.rung if bell is not None else 0
            try:
                while not done:
                    if bell is None:
                        await anyio.sleep(CANCEL_POLL_SECONDS)
                    else:
                        rang = await bell.wait(mark, CALL_LOOK_SECONDS)
                        mark = bell.rung
                        if done:
                            return
                        if rang and bell.news is not None and bell.news <= state.fold.last:
                            continue  # (nothing past what is folded)
                    await self._catch_up(ctx, state)
                    run = state.fold.run
                    if run is None or not run.open or run.cancel_requested is not None:
                        end_call()
                        return
            except Exception as exc:  # (a read that failed ends the call with it)
                failure.append(exc)
                end_call()
            finally:
                # (The session's loop watches it too: the bell goes without a turn, most times.)
                if wakeups is not None and bell is not None and not wakeups.release(ctx.session, bell):
                    with anyio.CancelScope(shield=True):
                        await wakeups.unwatch(ctx.session, bell)

        # The watch is a task of its own and the call this task's: in a task group of two tasks
        # the same cost 40 us of CPU a call against 18 (uvloop, a loop of 20,000).
        watcher = asyncio.get_running_loop().create_task(watch())
        started = time.monotonic()
        sent = True
        try:
            with scope:
                if isinstance(client, CheckedClient):
                    with checked_by(hold, ctx.holds_now):
                        outcome.append(await client.chat_completion(request))
                else:  # (a client of the caller's: through the client library)
                    completion = await client.chat.completions.create(**_as_built(request))
                    outcome.append(completion.model_dump(exclude_none=True))
        except FencedError as exc:
            failure.append(exc)
            sent = False
        except Exception as exc:
            if not is_model_error(exc):
                raise
            failure.append(exc)
            self.counters.model_failures += 1
        finally:
            if sent:
                took = time.monotonic() - started
                state.waited += took
                self.counters.model_calls += 1
                self.counters.model_seconds += took
                self.counters.observe(str(request.get("model", "")), took)
            done = True
            if watching:
                watching[0].ring()  # (the watch ends at that: no cancellation to deliver)
            else:
                watcher.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait([watcher])
        if failure:
            raise failure[0]
        if scope.cancelled_caught and not ended:  # (the deadline)
            self.counters.model_failures += 1
            raise TimeoutError(f"the model did not answer within {timeout:g} s")
        if not outcome:
            raise _ModelFailed("the model call was given up: the run was cancelled")
        return outcome[0]

    def _summary_due(self, ctx: SessionContext, state: _Session) -> RunSummary | None:
        """The run's summary when it says something the saved one does not (else None)."""
        run = state.fold.run
        if run is None:
            return None
        header = state.fold.delegated
        parent = header.parent if header is not None else None
        summary = summarize(ctx.session, run, worker=ctx.worker, model=self.model, parent=parent)
        if state.foreign is not None and run.open:
            summary = replace(summary, worker=None, detail=state.foreign)
        elif run.open and self.retires(ctx):  # (paused, or waiting for a person: no worker holds it)
            summary = replace(summary, worker=None)
        return None if summary == state.summary else summary

    async def _save_summary(self, ctx: SessionContext, state: _Session) -> None:
        """Save the run's summary before a model call, unless only its counters moved since it
        was saved less than :data:`SUMMARY_EVERY` ago (steps that follow one another in one
        batch, a Python tool's: the batch's acknowledgement saves it with the rest)."""
        summary = self._summary_due(ctx, state)
        if summary is None:
            return
        saved = state.summary
        if saved is not None and time.monotonic() - state.saved_at < SUMMARY_EVERY:
            counters = {"steps": saved.steps, "tokens": saved.tokens, "cost": saved.cost, "updated": saved.updated}
            if replace(summary, **counters) == saved:
                return
        await ctx.log.redis.send(run_index.summary_writes(ctx.log.keys, summary, saved=saved))
        state.summary, state.saved_at = summary, time.monotonic()


def _as_built(request: dict[str, Any]) -> dict[str, Any]:
    """``chat.completions.create`` keywords that send ``request``'s body as it is.

    The client's ``create`` walks every message and tool against its typed schemas before
    sending: several milliseconds of CPU a call, growing with the prompt, a large part of what
    a step costs the role (``python -m bench agents``).  The prompt is JSON already, so it goes
    as ``extra_body``, which the client merges into the body untouched: the server receives
    the same request."""
    options = ("timeout", "extra_headers", "extra_query")
    body = {k: v for k, v in request.items() if k != "model" and k not in options and k != "extra_body"}
    kept = {k: v for k, v in request.items() if k in options}
    return {**kept, "model": request["model"], "messages": [], "extra_body": {**body, **request.get("extra_body", {})}}


def _served(run: Run | None) -> bool:
    """The run costs its worker CPU: it is open, and not waiting only for sub-agents."""
    return run is not None and run.open and not run.waits_for_sub_agents_only


def _judged(run: Run, agent: Agent, action: events.Action) -> events.Action:
    """``action`` with its risk judged under the run's approval policy (else its agent's)."""
    policy = run.confirm if run.confirm is not None else agent.confirm
    return judged(action, policy, agent.analyzer)


def _stamped(event: events.Event, tenant: str | None, agent: str = AGENT_NAME) -> events.Event:
    """``event`` as the role writes it: its ``agent`` (the run's agent), and the session's tenant."""
    changes: dict[str, Any] = {"agent": event.agent or agent}
    if event.tenant is None and tenant is not None:
        changes["tenant"] = tenant
    return replace(event, **changes)


def _started(seen: list[events.Event], opened: int) -> events.RunStarted | None:
    """The ``run_started`` that opened the run (its model settings)."""
    at = bisect_left(seen, opened, key=lambda event: event.id or 0)  # (the log's ids increase)
    event = seen[at] if at < len(seen) else None
    return event if isinstance(event, events.RunStarted) and event.id == opened else None


def _said(exc: BaseException, timeout: float) -> str:
    """What the server said, in a few words."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:g}s"
    status = getattr(exc, "status_code", None)
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return f"HTTP {status}: {message}" if status is not None else message


def build_agent_handler(settings: Settings, **overrides: Any) -> AgentHandler:
    """The agent role's handler for the configured model server (``OPENAI_BASE_URL`` /
    ``OPENAI_API_KEY``; retries are the role's own), ``overrides`` (``AgentHandler``'s keywords)
    over what the settings say: a run served in the caller's process passes its client, the
    one definition it serves and its session."""
    options: dict[str, Any] = {
        "model": settings.llm_model,
        "prices": parse_prices(settings.prices),
        "llm_timeout": settings.llm_timeout,
        "retry_seconds": settings.agent_llm_retry_seconds,
        "prompt_cache": settings.prompt_cache,
        "max_depth": settings.agent_max_depth,
        "max_fanout": settings.agent_max_fanout,
        "temperature": settings.llm_temperature,
        "max_output_tokens": settings.llm_max_output_tokens,
        "condenser_defaults": window_fit("agent", settings),
        "pace": Pace(settings.agent_min_runs, slack=settings.agent_pace_slack, idle=MachineIdle(cgroup=own_cgroup()))
        if settings.agent_pace
        else None,
        "max_calls_per_step": settings.agent_max_calls_per_step,
        "action_timeout": settings.agent_action_timeout,
        "context_recalls": recall_setting(settings),
        "recall_timeout": settings.agent_recall_timeout,
        "images": workspace_images(settings),
        "max_event_bytes": settings.max_event_bytes,
        "max_in_flight": settings.llm_max_concurrency,
        "per_minute": settings.llm_rpm,
        "context_tokens": settings.llm_context_tokens,
        **overrides,
    }
    if "hosted" not in options:
        options["hosted"] = load(agent_modules(settings))
    if "client" not in options:
        options["client"] = CheckedClient(
            api_key=settings.openai_api_key or "unused",
            base_url=settings.openai_base_url or None,
            max_response_bytes=settings.llm_max_response_bytes,
            calls=settings.concurrency,  # (a call in flight per run held, at most)
        )
    return AgentHandler(**options)


def recall_setting(settings: Settings, default: bool | None = None) -> bool | None:
    """``RIVERBED_AGENT_CONTEXT_RECALLS`` as the handler takes it (``auto``: ``default``)."""
    return {"on": True, "off": False}.get(settings.agent_context_recalls, default)


def workspace_images(settings: Settings) -> Callable[[str], ImageSource | None] | None:
    """The images a session's prompt may show, read from its workspace (a vision model's:
    ``RIVERBED_LLM_VISION``), else None."""
    if not vision(settings.llm_vision, settings.llm_model):
        return None
    root = Path(settings.workspace)
    return lambda session: WorkspaceImages(root / workspace_name(session), max_bytes=settings.max_image_bytes)


def agent_modules(settings: Settings) -> list[str]:
    """The modules whose agents the worker hosts (``RIVERBED_AGENTS``, comma-separated)."""
    return [name.strip() for name in settings.agents.split(",") if name.strip()]

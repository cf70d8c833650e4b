"""Per-tenant quotas the operator sets: runs at once, and tokens a day.

::

    quotas = Quotas(bus.log_store)
    await quotas.set("acme", max_runs=20, tokens_per_day=2_000_000)   # riverbed tenants set
    await quotas.admit("acme", "s-1")     # QuotaExceeded, or the run holds one of acme's slots
    await quotas.count_tokens("acme", "s-1", run.opened, tokens)   # its own calls so far, after each
    await quotas.release("acme", "s-1")   # the run ended

The quotas live in one Redis hash (``keys.quotas``), so every worker and API process reads the
same.  What they bound is shared state, kept so that racing processes cannot overshoot:

- **runs at once**: a run holds a *slot*, a field of the tenant's running hash, taken by one
  script (``scripts.TAKE_RUN_SLOT``) that counts and takes together: of two runs racing for the
  last slot, one gets it.  A run takes its slot when it opens (``agent/hosted.py``) and the agent
  role takes it again (a no-op) before its first model call, so a ``run_started`` appended by
  other means is bounded too; the slot is given back when the run ends.  Slots are a cache of
  the logs: when a tenant is at its limit, each slot's log is folded, and the slots of runs that
  ended (a worker died between the end and the release) are given back before refusing.
- **tokens a day**: each run's tokens are a fold of its log (its ``llm_response`` usage); the agent
  role reports them after each model call to the day's hash (``scripts.COUNT_TOKENS``), which
  keeps per run the count already added, so a repeated report adds nothing.  Days are UTC.  A
  tenant at its daily tokens is refused new runs, and its open runs end with
  ``budget_exhausted`` before their next model call.  Before each call the role *reserves* an
  estimate of its tokens (``scripts.RESERVE_TOKENS``, one script for all of a tenant's runs):
  a call goes when no other call of the tenant is in flight, or when all of them, estimates
  included, fit in what is left of the day; otherwise it waits for those to settle.  The report
  after the call settles the reservation.  So the day is overspent by at most one call of the
  tenant (while the estimates hold), not one per open run.
- **models**: a tenant's runs may ask only for the models of its allow-list (``riverbed tenants
  set T --models m1,m2``; without one, only the deployment's ``RIVERBED_LLM_MODEL``): refused when
  the run opens, and by the agent role before its first call for a run opened by other means.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import UTC, date, datetime, timedelta
from functools import lru_cache
from typing import Literal

import anyio
import msgspec
from cachetools import LRUCache

from riverbed import events
from riverbed.agent.runs import RunFold
from riverbed.agent.usage import tokens
from riverbed.bus import scripts
from riverbed.bus.log import Log
from riverbed.bus.redis_client import Arg
from riverbed.errors import InputError, QuotaExceeded

__all__ = [
    "TOKENS_TTL",
    "Quotas",
    "TenantQuota",
    "TenantUsage",
    "call_estimate",
    "model_refusal",
    "parse_models",
    "seconds_to_midnight",
    "today",
]

TOKENS_TTL = 3 * 24 * 3600
"""Seconds a day's token counts are kept (the day after still reads them)."""
MAX_QUOTA = 10**15

_FOLDS: LRUCache[tuple[str, str], tuple[bytes | None, RunFold]] = LRUCache(maxsize=10_000)
"""(prefix, session) -> (its log's creation stamp, the fold of its runs so far) for the slot holders
a reclaim found open: a tenant at its limit that keeps asking has only their new events read."""


class TenantQuota(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A tenant's quotas (None: no limit)."""

    max_runs: int | None = None
    tokens_per_day: int | None = None
    mcp_urls: list[str] | None = None
    """the remote MCP servers the tenant's runs may use (``riverbed.agent.mcp.url_refusal``)"""
    models: list[str] | None = None
    """the models its runs may ask for (None: only the deployment's ``RIVERBED_LLM_MODEL``)"""


MAX_MODELS = 100
RESERVE_POLL_SECONDS = 0.2
"""How often a call that waits for its tenant's calls in flight asks again."""
PROMPT_FLOOR = 2000
"""Tokens a first call's estimate counts for the system prompt and the tools."""


def call_estimate(seen: Sequence[events.Event], max_output: int) -> int:
    """The tokens the next model call of a run whose log is ``seen`` may take, on the high side:
    the last call's prompt and completion (else :data:`PROMPT_FLOOR`), a token per 3 bytes of what
    came since, and the answer's bound (``max_output``; 0: 4096)."""
    base, since = PROMPT_FLOOR, 0
    for event in reversed(seen):
        if isinstance(event, events.LlmResponse) and event.usage:
            prompt, _cached, completion = tokens(event.usage)
            base = prompt + completion
            break
        since += len(events.encode(event))
    return base + since // 3 + (max_output or 4096)


def parse_models(raw: str) -> list[str]:
    """``m1,m2`` as a list of model names (empty: none named); :class:`InputError` for a bad one."""
    names = [part.strip() for part in raw.split(",") if part.strip()]
    if len(names) > MAX_MODELS:
        raise InputError(f"--models names at most {MAX_MODELS} models, not {len(names)}")
    for name in names:
        if len(name) > 200:
            raise InputError(f"a model name is at most 200 characters, not {len(name)}")
    return list(dict.fromkeys(names))


def model_refusal(tenant: str, quota: TenantQuota, model: str | None, default_model: str | None) -> str | None:
    """Why ``tenant``'s run may not ask for ``model`` (None: it may; a run that names no model
    gets the deployment's ``default_model``)."""
    if model is None:
        return None
    allowed = quota.models if quota.models is not None else [m for m in (default_model,) if m is not None]
    if model in allowed:
        return None
    if not allowed:
        return (
            f"tenant {tenant!r} may not choose its model (the operator allows some with "
            f"`riverbed tenants set {tenant} --models`)"
        )
    return (
        f"tenant {tenant!r} may use the model{'s' if len(allowed) > 1 else ''} {', '.join(allowed)}, not {model!r} "
        f"(the operator sets them with `riverbed tenants set {tenant} --models`)"
    )


class TenantUsage(msgspec.Struct, kw_only=True):
    """A tenant's quotas and how much of them is used now (``riverbed tenants show``)."""

    tenant: str
    max_runs: int | None
    running: int
    tokens_per_day: int | None
    tokens_today: int
    models: list[str] | None = None


def today(now: float | None = None) -> str:
    """The UTC day of ``now`` (the time when None), ``YYYY-MM-DD``."""
    return today_and_before(now)[0]


def today_and_before(now: float | None = None) -> tuple[str, str]:
    """The UTC day of ``now`` (the time when None) and the day before it, ``YYYY-MM-DD``."""
    return _days(int((time.time() if now is None else now) // 86400))


_EPOCH = date(1970, 1, 1).toordinal()


@lru_cache(maxsize=4)
def _days(number: int) -> tuple[str, str]:
    """The UTC day ``number`` days after 1970-01-01, and the day before it, ``YYYY-MM-DD``: made
    once a day (a step's token report names both; parsing and formatting them each time cost
    it 14 µs)."""
    day = date.fromordinal(_EPOCH + number)
    return day.isoformat(), (day - timedelta(days=1)).isoformat()


def seconds_to_midnight(now: float | None = None) -> int:
    """Seconds until the next UTC day starts (when a daily quota has room again)."""
    moment = datetime.fromtimestamp(time.time() if now is None else now, UTC)
    midnight = (moment + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return max(1, int((midnight - moment).total_seconds()) + 1)


class Quotas:
    """The tenants' quotas and what they bound, under one key prefix."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.redis = log.redis
        self.keys = log.keys
        self._take = self.redis.script(scripts.TAKE_RUN_SLOT)
        self._release = self.redis.script(scripts.RELEASE_RUN_SLOTS)
        self._count = self.redis.script(scripts.COUNT_TOKENS)
        self._reserve = self.redis.script(scripts.RESERVE_TOKENS)

    # --- the operator's settings ------------------------------------------------------------

    async def set(
        self,
        tenant: str,
        *,
        max_runs: int | None,
        tokens_per_day: int | None,
        mcp_urls: list[str] | None = None,
        models: Sequence[str] | None = None,
    ) -> TenantQuota:
        """Set ``tenant``'s quotas (0 removes one, None keeps it as it is); ``mcp_urls`` replaces
        the remote MCP servers it may use (``[]``: none); ``models`` empty: back to the
        deployment's model only."""
        if not tenant or len(tenant) > 200:
            raise InputError("a tenant name is 1 to 200 characters")
        for name, value in (("--max-runs", max_runs), ("--tokens-per-day", tokens_per_day)):
            if value is not None and not 0 <= value <= MAX_QUOTA:
                raise InputError(f"{name} must be a whole number from 0 (no limit) to {MAX_QUOTA}, not {value}")
        quota = await self.get(tenant)
        if max_runs is not None:
            quota.max_runs = max_runs or None
        if tokens_per_day is not None:
            quota.tokens_per_day = tokens_per_day or None
        if mcp_urls is not None:
            quota.mcp_urls = list(mcp_urls) or None
        if models is not None:
            quota.models = list(models) or None
        await self.redis.hset(self.keys.quotas, tenant, msgspec.json.encode(quota))
        return quota

    async def get(self, tenant: str) -> TenantQuota:
        raw = await self.redis.hget(self.keys.quotas, tenant)
        return _decode(raw)

    async def tenants(self) -> dict[str, TenantQuota]:
        """Every tenant with a quota, by name."""
        return {k.decode(): _decode(v) for k, v in sorted((await self.redis.hgetall(self.keys.quotas)).items())}

    async def usage(self, tenant: str) -> TenantUsage:
        quota = await self.get(tenant)
        running = await self.redis.hgetall(self.keys.tenant_running(tenant))
        return TenantUsage(
            tenant=tenant,
            max_runs=quota.max_runs,
            running=len(running),
            tokens_per_day=quota.tokens_per_day,
            tokens_today=await self.tokens_today(tenant),
            models=quota.models,
        )

    # --- what they bound ------------------------------------------------------------------------

    async def tokens_today(self, tenant: str) -> int:
        raw = await self.redis.hget(self.keys.tenant_tokens(tenant, today()), "_total")
        return int(raw or 0)

    async def tokens_refusal(self, tenant: str, quota: TenantQuota | None = None) -> str | None:
        """Why ``tenant`` may not spend more tokens today (None: it may)."""
        quota = quota if quota is not None else await self.get(tenant)
        if quota.tokens_per_day is None:
            return None
        spent = await self.tokens_today(tenant)
        if spent < quota.tokens_per_day:
            return None
        return (
            f"tenant {tenant!r} used {spent} tokens today, its quota of {quota.tokens_per_day} tokens a day "
            f"(UTC; the operator sets it with `riverbed tenants set`)"
        )

    async def admit(
        self, tenant: str, session: str, *, model: str | None = None, default_model: str | None = None
    ) -> None:
        """A run of ``tenant`` on ``session`` (asking for ``model``) may start: it holds one of the
        tenant's run slots.  :class:`InputError` when the model is not the tenant's to ask for
        (:func:`model_refusal`), :class:`QuotaExceeded` when the tenant is at its daily tokens or
        at its runs at once."""
        quota = await self.get(tenant)
        refused_model = model_refusal(tenant, quota, model, default_model)
        if refused_model is not None:
            raise InputError(f"no run opens: {refused_model}")
        refusal = await self.tokens_refusal(tenant, quota)
        if refusal is not None:
            raise QuotaExceeded(f"no run opens: {refusal}", retry_after=seconds_to_midnight())
        refused = await self.take_slot(tenant, session)
        if refused is not None:
            raise QuotaExceeded(f"no run opens: {refused}")

    async def take_slot(self, tenant: str, session: str) -> str | None:
        """Take (or keep) a run slot of ``tenant`` for ``session``; why not when every slot is taken."""
        reply = await self._slot(tenant, session)
        if int(reply[0]):
            return None
        if await self._reclaim(tenant):
            reply = await self._slot(tenant, session)
            if int(reply[0]):
                return None
        running, most = int(reply[1]), int(reply[2])
        return (
            f"tenant {tenant!r} has {running} runs running, its quota of {most} at once "
            "(wait for one to end, or cancel one)"
        )

    async def _slot(self, tenant: str, session: str) -> list[int]:
        keys = [self.keys.quotas, self.keys.tenant_running(tenant)]
        reply: list[int] = await self._take(keys, [tenant, session, f"{time.time():.3f}"])
        return reply

    async def _reclaim(self, tenant: str) -> int:
        """Give back the slots of runs that ended (their logs say so); how many.  Each holder's
        log is folded from where this process last folded it, not from its first event again."""
        held = [s.decode() for s in await self.redis.hgetall(self.keys.tenant_running(tenant))]
        async with self.redis.pipeline() as pipe:
            metas = [pipe.hmget(self.keys.meta(session), ["created", "last"]) for session in held]
            await pipe.execute()
        ended: list[str] = []
        for session, meta in zip(held, metas, strict=True):
            created, last = meta.value
            seen = (self.keys.prefix, session)
            cached = _FOLDS.get(seen)
            fold = cached[1] if cached is not None and cached[0] == created else RunFold()
            if int(last or 0) > fold.last:
                async for event in self.log.read(session, fold.last + 1):
                    fold.add(event)
            if fold.run is None or not fold.run.open:
                ended.append(session)
                _FOLDS.pop(seen, None)
            else:
                # Kept for its open run only: not the last response and its actions (a client's
                # own llm_response may be megabytes).
                fold.run.response, fold.run.actions = None, []
                _FOLDS[seen] = (created, fold)
        if ended:
            await self._release([self.keys.tenant_running(tenant)], ended)
        return len(ended)

    async def release(self, tenant: str, session: str) -> None:
        """Give ``session``'s run slot back, and any token reservation of its runs (its run
        ended; a repeat does nothing)."""
        await self._release([self.keys.tenant_running(tenant)], [session])
        inflight = self.keys.tenant_inflight(tenant)
        held = [f.decode() for f in await self.redis.hgetall(inflight)]
        mine = [f for f in held if f.rpartition(":")[0] == session]
        if mine:
            await self._release([inflight], mine)

    async def count_tokens(self, tenant: str, session: str, run: int, tokens: int) -> int:
        """Report that run ``run`` of ``session`` spent ``tokens`` so far (settling the
        reservation of its call); today's total."""
        total = await self._count(self._count_keys(tenant), [f"{session}:{run}", tokens, TOKENS_TTL])
        return int(total)

    def count_tokens_write(self, tenant: str, session: str, run: int, tokens: int) -> tuple[Arg, ...]:
        """:meth:`count_tokens` as a command to send along with others (``SessionContext.write_with_read``:
        the script's text, which a server that lost its script cache runs all the same)."""
        keys = self._count_keys(tenant)
        return ("EVAL", scripts.COUNT_TOKENS, len(keys), *keys, f"{session}:{run}", tokens, TOKENS_TTL)

    def _count_keys(self, tenant: str) -> list[str]:
        day, yesterday = today_and_before()
        return [
            self.keys.tenant_tokens(tenant, day),
            self.keys.tenant_tokens(tenant, yesterday),
            self.keys.tenant_inflight(tenant),
        ]

    async def reserve_call(
        self, tenant: str, session: str, run: int, quota: TenantQuota, *, estimate: Callable[[], int], ttl: float
    ) -> str | None:
        """Reserve tokens of ``tenant``'s day for the next call of run ``run`` (``estimate()`` of
        them), waiting while the tenant's calls in flight leave no room; None: the call may go,
        else why not (the day is spent)."""
        if quota.tokens_per_day is None:
            return None
        guess = estimate()
        while True:
            got = await self.reserve(tenant, session, run, guess, quota, ttl=ttl)
            if got != "wait":
                return None if got == "reserved" else got
            # (another process's call settles it: nothing here to wait on but the clock)
            await anyio.sleep(RESERVE_POLL_SECONDS)

    async def reserve(
        self, tenant: str, session: str, run: int, estimate: int, quota: TenantQuota, *, ttl: float
    ) -> Literal["reserved", "wait"] | str:
        """Reserve ``estimate`` tokens of ``tenant``'s day for the next call of run ``run``:
        ``reserved`` (the call may go), ``wait`` (other calls of the tenant are in flight and
        leave no room: ask again once they settle), or why it may not (the day is spent).  The
        reservation lapses after ``ttl`` seconds (a worker that died mid-call)."""
        if quota.tokens_per_day is None:
            return "reserved"
        keys = [self.keys.tenant_tokens(tenant, today()), self.keys.tenant_inflight(tenant)]
        args: list[str | int] = [
            f"{session}:{run}", max(1, int(estimate)), quota.tokens_per_day, max(1000, int(ttl * 1000))
        ]  # fmt: skip
        reply = await self._reserve(keys, args)
        if int(reply[0]) == 1:
            return "reserved"
        if int(reply[0]) == 2:
            return "wait"
        return (
            f"tenant {tenant!r} used {int(reply[1])} tokens today, its quota of {quota.tokens_per_day} tokens a day "
            f"(UTC; the operator sets it with `riverbed tenants set`)"
        )


def _decode(raw: bytes | None) -> TenantQuota:
    if raw is None:
        return TenantQuota()
    try:
        return msgspec.json.decode(raw, type=TenantQuota)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return TenantQuota()

"""The index of runs that ``riverbed runs`` and ``GET /v1/runs`` page through.

Every key is in the prefix's slot (``bus/keys.py``): ``runs`` (every session with a run, scored
by when its run opened), ``runs:open`` (those whose run is open), ``tenant:<t>:runs`` (one
tenant's), ``runs:ended`` (those whose run ended, scored by when it ended) and ``runs:agents``
(the agent a run was opened for, when it names one).  A run is indexed when it opens
(``agent/hosted.py``) and again with each summary the agent role saves, which moves it from open
to ended.

A page is read newest first from one sorted set (the open runs for ``running``/``waiting``, the
tenant's for a tenant, else every run), after an opaque cursor, a chunk at a time, and each
candidate's saved summary is read in one pipelined round trip; filters the set does not hold
(an ended state, the agent) are applied to what was read, and at most :data:`SCAN_MOST`
candidates are read per call: a page may then come back short, with a cursor to go on from.
The first page of 100,000 ended runs costs the same few commands as that of ten.  The runs
listed before these indexes existed are indexed once per prefix (:func:`backfill`, when ``serve``
starts and by ``riverbed runs``).

Ended runs stay listed for ``RIVERBED_RUNS_RETENTION`` seconds, then are trimmed: each listing
first removes at most :data:`TRIM_MOST` runs that ended before that (one command when there are
none).  The session, its log and its summary stay; only the index forgets the run.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from riverbed.agent.runs import RunSummary, saved_summary
from riverbed.bus.keys import AGENT_ROLE, Keys
from riverbed.bus.redis_client import Arg, Pipeline, RedisClient
from riverbed.errors import InputError

__all__ = [
    "DEFAULT_RETENTION",
    "SCAN_MOST",
    "TRIM_MOST",
    "Candidate",
    "Scan",
    "backfill",
    "candidates",
    "decode_cursor",
    "encode_cursor",
    "index_writes",
    "queue_opened",
    "queue_summary",
    "scan",
    "summary_writes",
    "trim",
]

DEFAULT_RETENTION = 7 * 24 * 3600.0
"""Seconds an ended run stays listed (``RIVERBED_RUNS_RETENTION``)."""
SCAN_MOST = 1000
"""Index entries one listing call reads at most, whatever its filters."""
TRIM_MOST = 200
"""Ended runs one listing call trims at most."""


def queue_opened(
    pipe: Pipeline, keys: Keys, session: str, opened_at: float, tenant: str | None, agent: str | None
) -> None:
    """The writes that index a run that just opened on ``session``."""
    pipe.zadd(keys.runs, {session: opened_at})
    pipe.zadd(keys.runs_open, {session: opened_at})
    pipe.zrem(keys.runs_ended, session)
    if tenant is not None:
        pipe.zadd(keys.tenant_runs(tenant), {session: opened_at})
    if agent is not None:
        pipe.hset(keys.runs_agents, session, agent)
    else:
        pipe.hdel(keys.runs_agents, session)


def summary_writes(keys: Keys, summary: RunSummary, *, saved: RunSummary | None = None) -> list[tuple[Arg, ...]]:
    """The writes that save ``summary`` (stamped now) and index its run as it now stands.

    ``saved``: the summary the caller saved last for the session, whose writes indexed the run
    already; when the run stands in the index as it did then (the same run, its tenant, still
    open or still ended), only the summary is written (an agent's every step saves one, and
    its index entries would be written again unchanged)."""
    encoded = msgspec.json.encode(msgspec.structs.replace(summary, updated=time.time()))
    writes: list[tuple[Arg, ...]] = [("SET", keys.run(summary.session), encoded)]
    if saved is None or _indexed_as(saved) != _indexed_as(summary):
        writes += index_writes(keys, summary)
    return writes


def _indexed_as(summary: RunSummary) -> tuple[str, float, str | None, bool]:
    """What of a summary :func:`index_writes` writes into the index."""
    return summary.session, summary.opened_at, summary.tenant, summary.state == "running"


def index_writes(keys: Keys, summary: RunSummary, *, now: float | None = None) -> list[tuple[Arg, ...]]:
    """The writes that index ``summary``'s run as it now stands (open, or ended now)."""
    session, opened = summary.session, repr(summary.opened_at)
    writes: list[tuple[Arg, ...]] = [("ZADD", keys.runs, opened, session)]
    if summary.tenant is not None:
        writes.append(("ZADD", keys.tenant_runs(summary.tenant), opened, session))
    if summary.state == "running":
        writes += [("ZADD", keys.runs_open, opened, session), ("ZREM", keys.runs_ended, session)]
    else:
        ended = repr(time.time() if now is None else now)
        writes += [("ZREM", keys.runs_open, session), ("ZADD", keys.runs_ended, "NX", ended, session)]
    return writes


def queue_summary(pipe: Pipeline, keys: Keys, summary: RunSummary, *, now: float | None = None) -> None:
    """Queue :func:`index_writes` on ``pipe``."""
    for command in index_writes(keys, summary, now=now):
        pipe.command(*command)


async def trim(redis: RedisClient, keys: Keys, retention: float, *, now: float | None = None) -> int:
    """Forget at most :data:`TRIM_MOST` runs that ended more than ``retention`` seconds ago; how many."""
    cutoff = (time.time() if now is None else now) - retention
    old = [s.decode() for s in await redis.zrange_up(keys.runs_ended, cutoff, count=TRIM_MOST)]
    if not old:
        return 0
    async with redis.pipeline() as pipe:
        saved = [pipe.get(keys.run(session)) for session in old]
        await pipe.execute()
    async with redis.pipeline() as pipe:
        for session, raw in zip(old, saved, strict=True):
            summary = saved_summary(raw.value)
            if summary is not None and summary.tenant is not None:
                pipe.zrem(keys.tenant_runs(summary.tenant), session)
        pipe.zrem(keys.runs, *old)
        pipe.zrem(keys.runs_ended, *old)
        pipe.hdel(keys.runs_agents, *old)
        await pipe.execute()
    return len(old)


BACKFILL_CHUNK = 1000


async def backfill(redis: RedisClient, keys: Keys) -> int:
    """Index the runs listed before the open, ended and tenant indexes existed, from their saved
    summaries, once per prefix (``Keys.tenant_index`` field ``runs`` marks it done; running it
    twice changes nothing); how many runs it read.  A run ended then counts its retention from
    its summary's last save."""
    if await redis.hget(keys.tenant_index, "runs") is not None:
        return 0
    sessions = [name.decode() for name in await redis.zrange(keys.runs)]
    for begin in range(0, len(sessions), BACKFILL_CHUNK):
        part = sessions[begin : begin + BACKFILL_CHUNK]
        async with redis.pipeline() as pipe:
            saved = [pipe.get(keys.run(session)) for session in part]
            await pipe.execute()
        async with redis.pipeline() as pipe:
            for reply in saved:
                summary = saved_summary(reply.value)
                if summary is not None:
                    queue_summary(pipe, keys, summary, now=summary.updated or None)
            await pipe.execute()
    await redis.hset(keys.tenant_index, "runs", len(sessions))
    return len(sessions)


def encode_cursor(score: float, session: str) -> str:
    """The cursor after the run of ``session`` scored ``score`` (opaque to callers)."""
    return base64.urlsafe_b64encode(msgspec.json.encode([score, session])).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    """(score, session) of a cursor :func:`encode_cursor` made; :class:`InputError` otherwise."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        score, session = msgspec.json.decode(raw, type=tuple[float, str])
    except (binascii.Error, ValueError, msgspec.DecodeError, msgspec.ValidationError):
        shown = cursor if len(cursor) <= 40 else cursor[:40] + "…"
        raise InputError(f"the cursor {shown!r} is not one a runs page gave: start again without it") from None
    return score, session


@dataclass(frozen=True)
class Candidate:
    """One run read from the index: its session, score, saved summary (None: none saved yet), the
    agent it was opened for, and whether a live agent worker holds its session."""

    session: str
    score: float
    summary: RunSummary | None
    agent: str | None
    held: bool


@dataclass(frozen=True)
class Scan:
    kept: list[Candidate]
    next_cursor: str | None
    """where the next page starts (None: the index has no more)"""


async def scan(
    redis: RedisClient,
    keys: Keys,
    source: str,
    *,
    limit: int,
    cursor: str | None,
    keep: Callable[[Candidate], bool],
) -> Scan:
    """Up to ``limit`` runs of the sorted set ``source`` after ``cursor``, newest first, that
    ``keep`` keeps (reading at most :data:`SCAN_MOST` entries)."""
    top: float | str = "+inf"
    after: tuple[float, str] | None = None
    if cursor:
        after = decode_cursor(cursor)
        top = after[0]
    kept: list[Candidate] = []
    read, ties = 0, 8
    while read < SCAN_MOST:
        want = min(SCAN_MOST - read, limit - len(kept))
        got = await redis.zrange_down(source, top, count=want + ties)  # (+ those tied with the cursor)
        exhausted = len(got) < want + ties
        entries = [(m.decode(), score) for m, score in got]
        if after is not None:
            # Members that share the cursor's score come in descending order: those past it are smaller.
            entries = [(m, sc) for m, sc in entries if sc < after[0] or m < after[1]]
        if not entries:
            if exhausted:
                return Scan(kept, None)
            ties *= 4  # more runs share the cursor's score than were read
            continue
        taken, entries = entries[:want], entries[want:]
        read += len(taken)
        kept.extend(c for c in await candidates(redis, keys, taken) if keep(c))
        last_member, last_score = taken[-1]
        after, top = (last_score, last_member), last_score
        if exhausted and not entries:
            return Scan(kept, None)
        if len(kept) >= limit:
            break
    assert after is not None
    return Scan(kept, encode_cursor(*after))


async def candidates(redis: RedisClient, keys: Keys, entries: list[tuple[str, float]]) -> list[Candidate]:
    """The entries' summaries and agents, read in one round trip; and for the open ones, whether
    an agent worker holds them (a second)."""
    async with redis.pipeline() as pipe:
        saved = [pipe.get(keys.run(session)) for session, _score in entries]
        agents = pipe.hmget(keys.runs_agents, [session for session, _score in entries])
        await pipe.execute()
    summaries = [saved_summary(reply.value) for reply in saved]
    open_ones = [
        s
        for (s, _score), summary in zip(entries, summaries, strict=True)
        if summary is None or summary.state == "running"
    ]
    held: set[str] = set()
    if open_ones:
        async with redis.pipeline() as pipe:
            metas = [pipe.hmget(keys.meta(s), [f"holder:{AGENT_ROLE}", f"expires:{AGENT_ROLE}"]) for s in open_ones]
            await pipe.execute()
        now_ms = await redis.time() * 1000
        for session, meta in zip(open_ones, metas, strict=True):
            holder, expires = meta.value
            if holder and float(expires or 0) > now_ms:
                held.add(session)
    return [
        Candidate(session, score, summary, None if agent is None else agent.decode(), session in held)
        for (session, score), summary, agent in zip(entries, summaries, agents.value, strict=True)
    ]

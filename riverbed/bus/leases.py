"""Session leases: which worker owns a session for a role, a renewable lease with a fencing token.

This module is the lease's records and their Redis operations (acquire, renew, release, hand
back).  The owner's loops that take and keep leases are ``bus/lease_loops.py``; the claim an
owner makes on one action before it runs it is ``bus/action_claims.py``.

For each role there is a directory stream (``keys.directory(role)``) with one consumer
group named after the role.  A session that needs an owner for a role has an entry there:

- a free worker reads new entries (``XREADGROUP >``) and tries :meth:`Leases.acquire`;
  on success the entry stays pending on that worker: the pending entry is the lease's
  handle, claimed again with ``XCLAIM`` to itself (every other renewal: it stays idle for
  under half a lease) while the ``expires`` field in the session's meta hash is pushed forward
  by the RENEW script at each;
- when an owner dies its entries go idle; peers take them with ``XAUTOCLAIM`` after the
  lease time and acquire the session, which bumps the fencing token so the dead (or
  merely stalled) owner can no longer append;
- an owner that stops gracefully releases the session and re-announces it (a fresh
  entry), so a peer takes it at once; an owner whose session is idle *parks* it: it
  releases it and marks it ``need:<role>``, and the next append announces it again.  The agent
  role is announced only when a run opens (or is cancelled), and *retires* a session whose run
  ended: released without the mark, so later appends do not announce it to that role.

Duplicated entries (a crash between announce and acquire) are harmless: a worker whose
acquire finds another live holder acknowledges and deletes the duplicate.

An entry names its session's tenant (``t``).  A worker whose intake reads an entry of a tenant
that holds its share of the worker moves it to that tenant's set-aside stream
(``keys.waiting(role, tenant)``, with the same consumer group; :meth:`Leases.set_aside`), which
intake reads, with the directory, while the tenant holds less (``bus/lease_loops.py``).  An entry
taken from there is the lease's handle just as a directory entry is: its claim's ``entry`` names
the stream (``w:<tenant>:<id>``), and renewals, releases and reclaims go to that stream.

When Redis loses its data (a restart without persistence, a failover to an empty replica,
FLUSHALL) the directory, its group and every lease go with it.  Renewals then fail (the
owners let their sessions go), reads answer ``NOGROUP`` (the owner creates the group again,
:meth:`Leases.ensure_group`), and the next append to a session announces it anew.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import redis.exceptions as rexc
import structlog

from riverbed.bus import scripts
from riverbed.bus.connection import closed_under_us
from riverbed.bus.keys import Keys, directory_entry
from riverbed.bus.redis_client import Arg, Pipeline, RawClient, RedisClient, Reply, StreamEntry, as_client

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from riverbed.bus.grouped import Batched

__all__ = ["Claim", "Leases", "Renewed"]

log = structlog.get_logger("riverbed.worker")

#: Sessions renewed by one script call on a standalone Redis (a call blocks the server while it
#: runs: about a millisecond for this many).
RENEW_CHUNK = 500
#: A renewal claims the sessions' directory entries to the worker again (``XCLAIM``, which makes
#: them idle for none) when this share of a lease passed since it last did: every other round of
#: a renewal every quarter lease, so an entry of a live owner is idle for about half a lease at
#: most, well before peers reclaim it (after a whole one).  A claim costs Redis a few µs per entry
#: (it records each as a command to replicate), the most of an idle session's renewal.
CLAIM_HANDLES_AFTER = 0.4
#: A consumer of a directory that holds entries and has not touched it for this share of a lease is
#: a dead or stalled owner (a live one claims its handles every half lease): a reclaim round scans
#: that directory's pending entries for those come due.
STALE_HOLDER_AFTER = 0.75
#: A consumer that holds no entries and has not touched its directory for this many leases is
#: forgotten (the group lists every worker name that ever read it: a restarted worker is a new one).
FORGET_CONSUMER_AFTER = 20
#: How often a worker reads again which tenants have set-aside streams (it knows its own at once).
WAITING_REFRESH = 1.0


@dataclass(frozen=True)
class Claim:
    """A directory entry naming a session, as read or reclaimed by a worker.

    ``entry`` is the entry's id in the role's directory, or ``w:<tenant>:<id>`` for an entry of
    a tenant's set-aside stream (``Keys.waiting``): unique across the role's streams, it is the
    lease's handle wherever it is kept (the owner's record, the session's meta hash)."""

    session: str
    entry: str
    tenant: str | None = None
    """The session's tenant ('' none), when the entry names it (None: not known yet)."""

    @property
    def set_aside(self) -> bool:
        return self.entry.startswith("w:")


@dataclass(frozen=True)
class Acquired:
    token: int  # 0: someone else holds it
    holder: str
    holder_entry: str
    left_ms: int = 0
    """With token 0: how long the holder's lease still runs."""
    meta: tuple[str | None, str] | None = None
    """With a token: the session's tenant and creation stamp, read by the acquire."""


@dataclass(frozen=True)
class Renewed:
    """What a round of renewals found: the sessions ``lost`` (another owner's now) and those whose
    reply a lost connection took (``unanswered``: the next round asks again); every other
    session of the round is held for a lease from when the round was sent."""

    lost: set[str]
    unanswered: set[str]


class Leases:
    """Lease operations for one role on behalf of one worker."""

    def __init__(
        self,
        redis: RedisClient | RawClient,
        keys: Keys,
        role: str,
        *,
        worker: str,
        lease_ms: int,
        url: str = "redis",
        batch: Batched | None = None,
    ) -> None:
        self.redis = as_client(redis, url)
        self._batch = batch
        """A worker's: the sessions it takes at once are acquired in one write."""
        self.keys = keys
        self.role = role
        self.worker = worker
        self.lease_ms = lease_ms
        self.directory = keys.directory(role)
        self._acquire = self.redis.script(scripts.ACQUIRE)
        self._renew = self.redis.script(scripts.RENEW)
        self._renew_all = self.redis.script(scripts.RENEW_ALL)
        self._release = self.redis.script(scripts.RELEASE)
        self._stale_holder = self.redis.script(scripts.STALE_HOLDER)
        self._handles_claimed = -math.inf
        """When (``time.monotonic()``) a renewal last sent the ``XCLAIM`` of its sessions' entries."""
        self.waiting: set[str] = set()
        """The tenants with a set-aside stream for this role, as last read (:meth:`refresh_waiting`)."""
        self._waiting_read = 0.0
        self._aside_ready: set[str] = set()
        """The tenants whose set-aside stream has its group (made by this worker)."""

    async def ensure_group(self) -> None:
        """The directory's group, and each known set-aside stream's (made again after Redis lost
        its data: a read of a stream without its group would fail every read)."""
        await self.redis.xgroup_create(self.directory, self.role, "0")
        self.waiting = set()
        self._aside_ready.clear()
        self._waiting_read = 0.0
        for tenant in await self.refresh_waiting():
            await self._ensure_aside(tenant)

    async def _ensure_aside(self, tenant: str) -> None:
        if tenant not in self._aside_ready:
            await self.redis.xgroup_create(self.keys.waiting(self.role, tenant), self.role, "0")
            self._aside_ready.add(tenant)

    async def refresh_waiting(self) -> set[str]:
        """The tenants with a set-aside stream (:attr:`waiting`), read again at most once a second."""
        now = time.monotonic()
        if now - self._waiting_read >= WAITING_REFRESH:
            self.waiting |= await self.redis.smembers(self.keys.waiting_tenants(self.role))
            self._waiting_read = now
        return self.waiting

    async def read_new(self, count: int, block_ms: int, *, tenants: Sequence[str] = ()) -> list[Claim]:
        """New entries of the directory and of the set-aside streams of ``tenants``: up to
        ``count`` of each stream, waiting up to ``block_ms`` for one.  The set-aside ones come
        first, one of each tenant in turn (they waited longest), then the directory's."""
        streams = {self.keys.waiting(self.role, t): t for t in tenants}
        got = await self.redis.xreadgroup_many(
            self.role, self.worker, [*streams, self.directory], count=count, block=block_ms
        )
        return self._claims(got, streams)

    def _claims(self, got: dict[str, list[StreamEntry]], streams: dict[str, str]) -> list[Claim]:
        """The claims of a many-stream read: the set-aside ones interleaved (one of each tenant
        in turn), then the directory's."""
        aside = [
            [_claim(entry_id, fields, tenant=t, stream_tenant=t) for entry_id, fields in got.get(key, ()) if fields]
            for key, t in streams.items()
        ]
        interleaved = [claim for rank in itertools.zip_longest(*aside) for claim in rank if claim is not None]
        return interleaved + [_claim(entry_id, fields) for entry_id, fields in got.get(self.directory, ()) if fields]

    async def read_own_pending(self, count: int) -> list[Claim]:
        """Entries this worker name held before a restart (they are its to re-acquire)."""
        streams = {self.keys.waiting(self.role, t): t for t in await self.refresh_waiting()}
        got = await self.redis.xreadgroup_many(
            self.role, self.worker, [*streams, self.directory], count=count, after="0"
        )
        return self._claims(got, streams)

    async def reclaim_stale(self, count: int, *, sweep: bool = False) -> list[Claim]:
        """Entries whose holder stopped renewing for a whole lease (the set-aside streams' too),
        up to ``count``.

        A stream's pending entries are scanned (``XPENDING`` of those idle for a lease, then their
        ``XCLAIM`` if they still are) only when one of its consumers that holds entries has not
        touched it for :data:`STALE_HOLDER_AFTER` of a lease (the STALE_HOLDER script): a live
        owner claims its handles every other renewal, so its consumer is never that idle, and a
        round costs what the consumers are, not what every worker of the role holds.  ``sweep``
        scans them all the same: an entry a live owner left behind (a take that failed) comes due
        while its consumer stays busy."""
        streams = await self._streams() if sweep else await self.quiet()
        claims: list[Claim] = []
        for key, tenant in streams:
            if len(claims) >= count:
                break
            due = await self.redis.xpending_range(key, self.role, count=count - len(claims), idle_ms=self.lease_ms)
            if due:
                ids = [_text(entry["message_id"]) for entry in due]
                got = await self.redis.xclaim(key, self.role, self.worker, ids, min_idle_ms=self.lease_ms)
                claims += [_claim(i, f, tenant=tenant, stream_tenant=tenant) for i, f in got if f]
        return claims

    async def _streams(self) -> list[tuple[str, str | None]]:
        """The role's streams of lease handles, with their tenants: the directory, and the set-aside streams."""
        streams: list[tuple[str, str | None]] = [(self.directory, None)]
        return streams + [(self.keys.waiting(self.role, t), t) for t in sorted(await self.refresh_waiting())]

    async def quiet(self) -> list[tuple[str, str | None]]:
        """The streams (with their tenants) where a consumer that holds entries has not touched
        the group for :data:`STALE_HOLDER_AFTER` of a lease: one STALE_HOLDER call each, in one
        round trip (a stream whose group cannot be read is in the list)."""
        streams = await self._streams()
        replies = await self._sent_with_script(partial(self._stale_holders, streams), scripts.STALE_HOLDER)
        return [stream for stream, reply in zip(streams, replies, strict=True) if reply.error or reply.value]

    async def _stale_holders(self, streams: list[tuple[str, str | None]]) -> list[Reply[Any]]:
        after = int(self.lease_ms * STALE_HOLDER_AFTER)
        forget = int(self.lease_ms * FORGET_CONSUMER_AFTER)
        async with self.redis.pipeline() as pipe:
            replies = [pipe.evalsha(self._stale_holder.sha, [key], [self.role, after, forget]) for key, _ in streams]
            await pipe.execute(raise_on_error=False)
        return replies

    async def with_tenants(self, claims: list[Claim]) -> list[Claim]:
        """``claims`` with every tenant known: an entry that does not name it (an announce by a
        caller that did not know it) has it read from the session's meta hash."""
        unknown = [claim for claim in claims if claim.tenant is None]
        if not unknown:
            return claims
        async with self.redis.pipeline() as pipe:
            replies = [pipe.hget(self.keys.meta(claim.session), "tenant") for claim in unknown]
            await pipe.execute()
        found = {
            claim.entry: _text(reply.value) if reply.value else ""
            for claim, reply in zip(unknown, replies, strict=True)
        }
        return [claim if claim.tenant is not None else replace(claim, tenant=found[claim.entry]) for claim in claims]

    async def set_aside(self, claims: Sequence[Claim]) -> None:
        """Move ``claims`` to the ends of their tenants' set-aside streams: their tenants hold
        their share of this worker, and another worker (or this one, once a session of theirs
        is let go) takes them from there.  The stream's group exists before any worker learns
        of the stream from the set."""
        for tenant in {claim.tenant or "" for claim in claims}:
            await self._ensure_aside(tenant)
        async with self.redis.pipeline() as pipe:
            for claim in claims:
                tenant = claim.tenant or ""
                pipe.xadd(self.keys.waiting(self.role, tenant), {"s": claim.session})
                pipe.sadd(self.keys.waiting_tenants(self.role), tenant)
                stream, entry = self._locate(claim.entry)
                pipe.xack(stream, self.role, entry)
                pipe.xdel(stream, entry)
            await pipe.execute()
        self.waiting |= {claim.tenant or "" for claim in claims}

    def _locate(self, entry: str) -> tuple[str, str]:
        """The stream and id of a lease handle (:attr:`Claim.entry`)."""
        if entry.startswith("w:"):
            tenant, _, entry_id = entry[2:].rpartition(":")
            return self.keys.waiting(self.role, tenant), entry_id
        return self.directory, entry

    async def acquire(self, claim: Claim) -> Acquired:
        keys = [self.keys.meta(claim.session)]
        args: list[Arg] = [self.role, self.worker, self.lease_ms, claim.entry]
        reply = await (self._acquire(keys, args) if self._batch is None else self._batch.run(self._acquire, keys, args))
        token = int(reply[0])
        if token == 0:
            return Acquired(0, _text(reply[1]), _text(reply[2]), int(reply[3]))
        return Acquired(token, _text(reply[1]), _text(reply[2]), meta=(_text(reply[4]) or None, _text(reply[5])))

    async def holds(self, session: str, token: int) -> bool:
        """Whether this worker still holds ``session`` with fencing token ``token``.  False also
        when the session's meta hash is gone (Redis lost its data): the lease went with it."""
        fields = [f"holder:{self.role}", f"fence:{self.role}"]
        holder, fence = await self.redis.hmget(self.keys.meta(session), fields)
        return holder is not None and _text(holder) == self.worker and fence is not None and int(fence) == token

    async def renew(self, owned: dict[str, tuple[str, int]]) -> Renewed:
        """Renew every owned session (session -> (entry, token)): the sessions lost, and those
        whose reply was a lost connection (:func:`_unanswered`, logged once a round: not known
        to be lost); every other one was renewed.

        On a standalone Redis, one script renews them all (:meth:`_renew_standalone`).  On a
        cluster, one pipeline of RENEW calls, one round trip per node (the client splits it by
        slot).  The calls are plain ``EVALSHA`` commands: a cluster pipeline cannot load a
        script first, so a node that lost its script cache (restarted, failed over) answers
        ``NOSCRIPT``; then the script is loaded on every primary and the round is repeated.
        """
        if not owned:
            return Renewed(set(), set())
        items = list(owned.items())
        now = time.monotonic()
        claim = now - self._handles_claimed >= CLAIM_HANDLES_AFTER * self.lease_ms / 1000
        if not self.redis.cluster:
            renewed = await self._renew_standalone(items, claim=claim)
        else:
            renewed = await self._renew_cluster(items, claim=claim)
        if claim and not renewed.unanswered:  # (a lost connection may have lost the claims too)
            self._handles_claimed = now
        return renewed

    async def _renew_cluster(self, items: list[tuple[str, tuple[str, int]]], *, claim: bool) -> Renewed:
        """On a cluster, one RENEW call per session (with the ``XCLAIM`` of their entries when
        ``claim``), in one pipeline split by node."""
        replies = await self._sent_with_script(partial(self._renew_round, items, claim=claim), scripts.RENEW)
        renewed = Renewed(set(), set())
        errors: list[Exception] = []
        for (session, _), ok in zip(items, replies, strict=True):
            if (error := _unanswered(ok)) is not None:
                errors.append(error)
                renewed.unanswered.add(session)
            elif ok.error is not None or ok.value != 1:
                renewed.lost.add(session)
        _warn_unanswered(self.role, len(items), errors)
        return renewed

    async def _renew_standalone(self, items: list[tuple[str, tuple[str, int]]], *, claim: bool) -> Renewed:
        """On a standalone Redis, one RENEW_ALL script per :data:`RENEW_CHUNK` sessions and one
        ``XCLAIM`` of their entries (when ``claim``): a worker holding a thousand sessions renews them in a few
        commands, not a thousand scripts (the worker's and Redis's CPU).  They all go in one
        pipeline, as the per-session calls did: a busy worker's commands wait for a connection
        and a turn of its event loop, and leases renewed chunk after chunk, each waiting its
        turn, ran out under a burst of new sessions."""
        chunks = [items[start : start + RENEW_CHUNK] for start in range(0, len(items), RENEW_CHUNK)]
        replies = await self._sent_with_script(partial(self._renew_all_round, chunks, claim=claim), scripts.RENEW_ALL)
        out = Renewed(set(), set())
        errors: list[Exception] = []
        for chunk, reply in zip(chunks, replies, strict=True):
            if (error := _unanswered(reply)) is not None:
                errors.append(error)
                out.unanswered.update(session for session, _ in chunk)
                continue
            renewed = reply.value if reply.error is None else ()
            out.lost.update(
                session for index, (session, _) in enumerate(chunk) if index >= len(renewed) or int(renewed[index]) != 1
            )
        _warn_unanswered(self.role, len(items), errors)
        return out

    async def _sent_with_script(self, send: Callable[[], Awaitable[list[Reply[Any]]]], script: str) -> list[Reply[Any]]:
        """``send()``'s replies, sent once more after loading ``script`` when a node had lost it
        (``NOSCRIPT``: a pipeline's plain ``EVALSHA`` cannot load it first)."""
        replies = await send()
        if any(isinstance(reply.error, rexc.NoScriptError) for reply in replies):
            await self.redis.script_load(script)
            replies = await send()
        return replies

    async def _renew_all_round(
        self, chunks: list[list[tuple[str, tuple[str, int]]]], *, claim: bool
    ) -> list[Reply[Any]]:
        """The RENEW_ALL replies, one per chunk (the XCLAIMs that follow each when ``claim`` are not read)."""
        sha = self._renew_all.sha
        async with self.redis.pipeline(renewal=True) as pipe:
            replies = []
            for chunk in chunks:
                args: list[Arg] = [self.role, self.worker, self.lease_ms, *(token for _s, (_e, token) in chunk)]
                replies.append(pipe.evalsha(sha, [self.keys.meta(session) for session, _ in chunk], args))
                if claim:
                    self._xclaim_handles(pipe, [entry for _, (entry, _t) in chunk])
            await pipe.execute(raise_on_error=False)
        return replies

    async def _renew_round(self, items: list[tuple[str, tuple[str, int]]], *, claim: bool) -> list[Reply[Any]]:
        """The RENEW replies, one per session (the XCLAIM that follows them when ``claim`` is not read)."""
        sha = self._renew.sha
        async with self.redis.pipeline(renewal=True) as pipe:
            replies = [
                pipe.evalsha(sha, [self.keys.meta(session)], [self.role, self.worker, token, self.lease_ms])
                for session, (_entry, token) in items
            ]
            if claim:
                self._xclaim_handles(pipe, [entry for _, (entry, _t) in items])
            await pipe.execute(raise_on_error=False)
        return replies

    def _xclaim_handles(self, pipe: Pipeline, handles: list[str]) -> None:
        """Claim the entries ``handles`` name to this worker again (one ``XCLAIM`` per stream)."""
        by_stream: dict[str, list[str]] = {}
        for handle in handles:
            stream, entry = self._locate(handle)
            by_stream.setdefault(stream, []).append(entry)
        for stream, entries in by_stream.items():
            pipe.xclaim_ids(stream, self.role, self.worker, entries)

    async def release(
        self,
        session: str,
        entry: str,
        token: int,
        *,
        park: bool = False,
        seen_last: int = 0,
        retire: bool = False,
        tenant: str | None = None,
    ) -> int:
        """Give the session up.  Graceful release re-announces it (naming its ``tenant`` when
        known) so a peer takes it at once.

        ``park``: the next append announces it again; ``park`` with ``retire``: only an append that
        asks for this role does (the agent role's, when a run opens).  Returns 1 when released, 0
        when this worker was not the owner any more, and -1 when a park was refused because new
        events arrived (the caller keeps serving).
        """
        mode = (2 if retire else 1) if park else 0
        result = int(await self._release([self.keys.meta(session)], [self.role, self.worker, token, mode, seen_last]))
        if result != 1:
            # -1: not parked, keep serving.  0: someone else owns the session now, and the
            # entry may be its lease handle (a reclaim moves it): leave it alone.
            return result
        stream, entry_id = self._locate(entry)
        async with self.redis.pipeline() as pipe:
            if not park:
                pipe.xadd(self.directory, directory_entry(session, tenant))
            pipe.xack(stream, self.role, entry_id)
            pipe.xdel(stream, entry_id)
            await pipe.execute()
        return result

    async def drop(self, claim: Claim) -> None:
        """Acknowledge and delete a duplicate entry."""
        stream, entry = self._locate(claim.entry)
        async with self.redis.pipeline() as pipe:
            pipe.xack(stream, self.role, entry)
            pipe.xdel(stream, entry)
            await pipe.execute()

    async def reannounce(self, claim: Claim) -> None:
        """Put the session back in the directory as a new entry and drop ``claim``."""
        stream, entry = self._locate(claim.entry)
        async with self.redis.pipeline() as pipe:
            pipe.xadd(self.directory, directory_entry(claim.session, claim.tenant))
            pipe.xack(stream, self.role, entry)
            pipe.xdel(stream, entry)
            await pipe.execute()

    async def hand_back(self, claim: Claim, holder: str, left_ms: int) -> None:
        """A reclaimed entry whose holder's lease still runs ``left_ms`` goes back to the holder,
        idle for as long as that lease has run: peers can reclaim it again the moment the lease
        ends (a renewal resets it), not a whole lease later.  (An entry is reclaimable a little
        before its lease ends when the renewal's two writes land in that order, as they may on a
        cluster, where they go to different nodes.)"""
        idle = max(0, self.lease_ms - left_ms)
        stream, entry = self._locate(claim.entry)
        await self.redis.xclaim_ids(stream, self.role, holder, [entry], idle_ms=idle)


def _unanswered(reply: Reply[Any]) -> Exception | None:
    """The lost connection a renewal's reply is, rather than the script's answer (None for an
    answer, a refusal included): the sessions it renewed are not known to be lost (the next
    round asks again, and their fencing tokens guard their writes meanwhile)."""
    error = reply.error
    if error is not None and (isinstance(error, rexc.ConnectionError | rexc.TimeoutError) or closed_under_us(error)):
        return error
    return None


def _warn_unanswered(role: str, sessions: int, unanswered: list[Exception]) -> None:
    """One line for a round whose replies were partly lost with their connections."""
    if unanswered:
        log.warning(
            "lease.renewal_unanswered", role=role, sessions=sessions, replies=len(unanswered), error=str(unanswered[0])
        )


def _text(value: bytes | str | int) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _claim(
    entry_id: bytes, fields: dict[bytes, bytes], *, tenant: str | None = None, stream_tenant: str | None = None
) -> Claim:
    """The claim of a directory entry (``stream_tenant``: of that tenant's set-aside stream)."""
    entry = entry_id.decode()
    if stream_tenant is not None:
        entry = f"w:{stream_tenant}:{entry}"
    if tenant is None and b"t" in fields:
        tenant = fields[b"t"].decode()
    return Claim(session=fields[b"s"].decode(), entry=entry, tenant=tenant)

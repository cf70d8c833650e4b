"""The dead-letter stream: entries a role could not handle, with the reason and attempts.

``riverbed dlq list`` shows them; ``riverbed dlq requeue ID`` appends the event again to its
session (a new id, so every role sees it afresh) and removes the dead letter.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from riverbed.bus.keys import Keys
from riverbed.bus.redis_client import Arg, RawClient, RedisClient, as_client
from riverbed.errors import AlreadyAnswered, NotFoundError

if TYPE_CHECKING:
    from riverbed.bus.log import Log

__all__ = ["DeadLetter", "DeadLetters"]


@dataclass(frozen=True)
class DeadLetter:
    id: str
    session: str
    event_id: int
    role: str
    reason: str
    attempts: int
    ts: float
    payload: bytes

    def as_dict(self) -> dict[str, object]:
        return {
            "id": self.id,
            "session": self.session,
            "event_id": self.event_id,
            "role": self.role,
            "reason": self.reason,
            "attempts": self.attempts,
            "ts": self.ts,
            "size": len(self.payload),
        }


class DeadLetters:
    def __init__(self, redis: RedisClient | RawClient, keys: Keys, url: str = "redis") -> None:
        self.redis = as_client(redis, url)
        self.key = keys.dlq

    async def add(self, *, session: str, event_id: int, role: str, reason: str, attempts: int, payload: bytes) -> str:
        (letter,) = await self.add_many(session, role, [(event_id, reason, attempts, payload)])
        return letter

    async def add_many(self, session: str, role: str, letters: Sequence[tuple[int, str, int, bytes]]) -> list[str]:
        """Dead letters (event id, reason, attempts, payload) of one session, in one round trip."""
        now = time.time()
        async with self.redis.pipeline() as pipe:
            entries = []
            for event_id, reason, attempts, payload in letters:
                fields: dict[str, Arg] = {
                    "session": session,
                    "event_id": event_id,
                    "role": role,
                    "reason": reason[:2000],
                    "attempts": attempts,
                    "ts": now,
                    "payload": payload,
                }
                entries.append(pipe.xadd(self.key, fields))
            await pipe.execute()
        return [entry.value.decode() for entry in entries]

    async def list(self, count: int = 1000) -> list[DeadLetter]:
        entries = await self.redis.xrange(self.key, count=count)
        return [_letter(entry_id, fields) for entry_id, fields in entries]

    async def count(self) -> int:
        return await self.redis.xlen(self.key)

    async def get(self, letter_id: str) -> DeadLetter:
        ms, dash, seq = letter_id.partition("-")
        well_formed = dash and ms.isdigit() and seq.isdigit() and int(ms) < 2**64 and int(seq) < 2**64
        entries = await self.redis.xrange(self.key, letter_id, letter_id) if well_formed else []
        if not entries:
            raise NotFoundError(f"no dead letter with id {letter_id!r} (see riverbed dlq list)")
        return _letter(*entries[0])

    async def requeue(self, letter_id: str, log: Log) -> int:
        """Append the dead-lettered event to its session again (a new id, so every role sees
        it afresh), then remove the letter; returns the new id."""
        letter = await self.get(letter_id)
        result = await log.append_raw(letter.session, [(letter.payload, 0)])
        if isinstance(result, AlreadyAnswered):
            raise AlreadyAnswered(
                result.cause, result.existing, f"that event is already answered by event {result.existing}"
            )
        await self.remove(letter_id)
        return result[0]

    async def remove(self, letter_id: str) -> None:
        await self.redis.xdel(self.key, letter_id)


def _letter(entry_id: bytes, fields: dict[bytes, bytes]) -> DeadLetter:
    return DeadLetter(
        id=entry_id.decode(),
        session=fields[b"session"].decode(),
        event_id=int(fields[b"event_id"]),
        role=fields[b"role"].decode(),
        reason=fields[b"reason"].decode(errors="replace"),
        attempts=int(fields[b"attempts"]),
        ts=float(fields[b"ts"]),
        payload=fields[b"payload"],
    )

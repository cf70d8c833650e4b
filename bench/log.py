"""The session log against raw redis-py, on the same Redis in the same run.

- append: riverbed's ``Session.append`` of 100 events per call (one Lua script each: ids,
  expected_last/idempotency/fencing checks, answers) vs a pipelined batch of 100 ``XADD``
  of the same ~300-byte msgpack payloads (target ratio >= 0.50);
- read: riverbed reading a 100,000-event session (``Session.log``: XRANGE pages + typed
  decode + ids) vs raw ``XRANGE`` pages of 2000 + ``msgspec.msgpack.decode`` (target >= 0.75).

Run alone: ``python -m bench.log [--redis-url URL] [--repeats N] [--json]``.
"""

from __future__ import annotations

import argparse
import uuid

import msgspec
import redis.asyncio as aioredis

import riverbed
from bench.common import Result, paired_rates, run_alone
from riverbed import events

BATCH = 100
APPEND_EVENTS = 20_000
READ_EVENTS = 100_000
PAGE = 2000


def sample_events(count: int) -> list[events.Event]:
    """Observations whose msgpack payload is about 300 bytes."""
    filler = "x" * 145
    return [
        events.CmdOutput(content=f"line {i} {filler}", exit_code=0, command=f"echo {i}", agent="bench", tenant="acme")
        for i in range(count)
    ]


async def measure(url: str, args: argparse.Namespace) -> list[Result]:
    repeats = args.repeats
    prefix = "bench" + uuid.uuid4().hex[:8]
    batch = sample_events(BATCH)
    payloads = [events.encode(e) for e in batch]
    raw = aioredis.Redis.from_url(url)
    results: list[Result] = []
    async with riverbed.connect(url, prefix=prefix) as bus:
        counter = iter(range(10**9))

        async def raw_append() -> int:
            key = f"{prefix}:raw:{next(counter)}"
            for _ in range(APPEND_EVENTS // BATCH):
                async with raw.pipeline(transaction=False) as pipe:
                    for payload in payloads:
                        pipe.xadd(key, {b"e": payload})
                    await pipe.execute()
            return APPEND_EVENTS

        async def riverbed_append() -> int:
            session = bus.session(f"append-{next(counter)}")
            for _ in range(APPEND_EVENTS // BATCH):
                await session.append(*batch)
            return APPEND_EVENTS

        await raw_append()  # warm up connections and the script cache
        await riverbed_append()
        baseline, figure, ratio = await paired_rates(raw_append, riverbed_append, repeats)
        results.append(
            Result("log append (batches of 100)", "events/s", figure, baseline, "pipelined XADD", ratio, 0.50, repeats)
        )

        # A 100,000-event session and a raw stream holding the same payloads.
        read_session = bus.session("read")
        big = sample_events(1000)
        for _ in range(READ_EVENTS // len(big)):
            await read_session.append(*big)
        raw_key = f"{prefix}:raw:read"
        big_payloads = [events.encode(e) for e in big]
        for _ in range(READ_EVENTS // len(big)):
            async with raw.pipeline(transaction=False) as pipe:
                for payload in big_payloads:
                    pipe.xadd(raw_key, {b"e": payload})
                await pipe.execute()
        decoder = msgspec.msgpack.Decoder()

        async def raw_read() -> int:
            count = 0
            low = "-"
            while True:
                entries = await raw.xrange(raw_key, low, "+", count=PAGE)
                for _entry_id, fields in entries:
                    decoder.decode(fields[b"e"])
                count += len(entries)
                if len(entries) < PAGE:
                    return count
                low = b"(" + entries[-1][0]

        async def riverbed_read() -> int:
            count = 0
            async for _event in read_session.log():
                count += 1
            return count

        assert await raw_read() == READ_EVENTS
        assert await riverbed_read() == READ_EVENTS
        baseline, figure, ratio = await paired_rates(raw_read, riverbed_read, repeats)
        results.append(
            Result(
                "log read (100k-event session)",
                "events/s",
                figure,
                baseline,
                "XRANGE + msgpack decode",
                ratio,
                0.75,
                repeats,
            )
        )
        keys = [k async for k in raw.scan_iter(match=f"{prefix}:*", count=1000)]
        for start in range(0, len(keys), 500):
            await raw.delete(*keys[start : start + 500])
    await raw.aclose()
    return results


def main() -> int:
    return run_alone(measure, "Benchmark the session log against raw redis-py.")


if __name__ == "__main__":
    raise SystemExit(main())

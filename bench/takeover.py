"""Takeover of a long session: after its owner is SIGKILLed, how long until each role's new
owner serves a 200,000-event session again.

One session of 200,000 events (``cmd_run`` / ``cmd_output`` pairs and messages, ~300-byte
outputs) is written first; every role's consumer group is then moved to its end, as if an
owner had handled it all (indexing 200,000 events would take the memory role about half an
hour here, so its index holds only what the run adds).  Worker A (``python -m
riverbed.workers all``, capacity one session per role, so it takes no other) takes
the session: each role folds
the whole log once and saves its fold.  Worker B starts and warms up on a small session of
its own (its embedding model loaded, a sandbox started).  Then A is killed with SIGKILL and,
at once, the session gets a ``cmd_run`` (runtime), a ``recall`` (memory) and a
``condensation_request`` (condenser); each figure is the time from the kill to that answer.

Nothing can answer before the lease runs out (the dead owner still holds it): the floor is
the lease, ``RIVERBED_LEASE_SECONDS`` = 5 s here, and the target is the lease plus 1 s.  An
owner renews its leases every quarter of the lease, so they run out between 3.75 and 5 s
after the kill; peers look for them every sixteenth of a lease.  How
long A's roles took to fold the whole log the first time is in the notes.

Run alone: ``python -m bench.takeover [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import anyio
import redis.exceptions

import riverbed
from bench.common import Result, private_postgres, run_alone, stop_processes
from riverbed import events
from riverbed.bus.keys import ROLES, Keys

EVENTS = 200_000
LEASE = 5.0
BATCH = 200


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def _write_long(session: riverbed.Session, count: int) -> None:
    for start in range(0, count, BATCH):
        batch: list[events.Event] = []
        for n in range(start, min(start + BATCH, count)):
            if n % 5 == 4:
                batch.append(events.Message(content=f"step {n}: the parser still drops the last line"))
            elif n % 5 in (0, 2):
                batch.append(events.CmdRun(command=f"pytest tests/test_parser.py -k case_{n}"))
            else:  # the answer of the cmd_run just before it (event n; ids start at 1)
                batch.append(
                    events.CmdOutput(
                        cause=n,
                        source="runtime",
                        command=f"pytest tests/test_parser.py -k case_{n - 1}",
                        content=f"case_{n - 1} FAILED\nAssertionError: expected 3 tokens\n" + "." * 200,
                        exit_code=1,
                    )
                )
        await session.append(*batch)
        if start and start % 50_000 == 0:
            _progress(f"  {start:,} events written")


async def _move_groups_to_the_end(bus: riverbed.Bus, session: str) -> None:
    key = bus.keys.log(session)
    last = await bus.session(session).last_id()
    for role in ROLES:
        try:
            await bus.redis.xgroup_create(key, role, id=f"{last}-0")
        except redis.exceptions.ResponseError:
            await bus.redis.xgroup_setid(key, role, id=f"{last}-0")


class _Worker:
    def __init__(self, name: str, env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log = (log_dir / f"{name}.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "riverbed.workers", "all", "--name", name],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    async def ready(self, bus: riverbed.Bus, keys: Keys) -> None:
        with anyio.fail_after(60):
            while not await bus.redis.exists(keys.worker(self.name)):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker {self.name} exited early; see {self.log.name}")
                await anyio.sleep(0.05)

    def tail(self, lines: int = 15) -> str:
        """The last lines of the worker's log (after it stopped)."""
        text = Path(self.log.name).read_bytes().splitlines()[-lines:]
        return b"\n".join(text).decode(errors="replace")

    def stop(self) -> None:
        stop_processes([self.proc], 20)
        self.log.close()


def _actions() -> dict[str, events.Action]:
    return {
        "runtime": events.CmdRun(command="true"),
        "memory": events.Recall(query="which case fails?", k=3),
        "condenser": events.CondensationRequest(),
    }


async def _serve_all(session: riverbed.Session, timeout: float) -> dict[str, float]:
    """Each role's action at once; seconds from now to each answer."""
    started = time.perf_counter()
    took: dict[str, float] = {}

    async def one(role: str, action: events.Action) -> None:
        answer = await session.act(action, timeout=timeout)
        if isinstance(answer, events.Error):
            raise RuntimeError(f"the {role} role answered with an error: {answer.content}")  # noqa: TRY004
        took[role] = time.perf_counter() - started

    async with anyio.create_task_group() as tg:
        for role, action in _actions().items():
            tg.start_soon(one, role, action)
    return took


async def measure(url: str, args: argparse.Namespace) -> list[Result]:
    count = 20_000 if args.quick else EVENTS
    prefix = "tk" + uuid.uuid4().hex[:8]
    keys = Keys(prefix)
    with private_postgres(args.database_url) as db, tempfile.TemporaryDirectory(prefix="riverbed-takeover-") as tmp:
        env = {
            **os.environ,
            "RIVERBED_REDIS_URL": url,
            "RIVERBED_DATABASE_URL": db,
            "RIVERBED_PREFIX": prefix,
            "RIVERBED_WORKSPACE": str(Path(tmp) / "ws"),
            "RIVERBED_LEASE_SECONDS": str(LEASE),
            "RIVERBED_LOG_FORMAT": "json",
        }
        workers: list[_Worker] = []
        async with riverbed.connect(url, prefix=prefix) as bus:
            try:
                long = bus.session("long")
                _progress(f"takeover: writing a session of {count:,} events")
                await _write_long(long, count)
                await _move_groups_to_the_end(bus, "long")
                _progress("takeover: worker A takes it (each role folds the whole log once)")
                a = _Worker("takeover-a", {**env, "RIVERBED_CONCURRENCY": "1"}, Path(tmp))  # only this session
                workers.append(a)
                await a.ready(bus, keys)
                first = await _serve_all(long, timeout=300)
                _progress("takeover: worker B starts and warms up on a session of its own")
                b = _Worker("takeover-b", {**env, "RIVERBED_CONCURRENCY": "10"}, Path(tmp))
                workers.append(b)
                await b.ready(bus, keys)
                await _serve_all(bus.session("warm"), timeout=120)
                _progress("takeover: SIGKILL worker A; the session acts at once")
                a.proc.send_signal(signal.SIGKILL)
                a.proc.wait(10)
                took = await _serve_all(long, timeout=60)
            except BaseException:
                for worker in workers:
                    worker.stop()
                    _progress(f"--- {worker.name} (last lines) ---\n{worker.tail()}")
                raise
            finally:
                for worker in workers:
                    worker.stop()
                names = [k async for k in bus.redis.scan_iter(match=f"{prefix}:*", count=1000)]
                for start in range(0, len(names), 500):
                    await bus.redis.delete(*names[start : start + 500])
    return [
        Result(
            f"{role} role serving a {count:,}-event session again after its owner's SIGKILL",
            "s",
            took[role],
            LEASE,
            "the lease",
            took[role] / LEASE,
            LEASE + 1.0,
            1,
            better="lower",
            target_on="figure",
            baseline_unit="s",
            note=f"the first owner's first answer after folding the whole log: {first[role]:.2f} s",
        )
        for role in ROLES
    ]


def main() -> int:
    return run_alone(measure, "Takeover of a long session by every role after a SIGKILL.")


if __name__ == "__main__":
    raise SystemExit(main())

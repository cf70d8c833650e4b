"""The View fold over a long session against a plain Python loop over the same events.

The session: 100,000 events (ids 1..100,000) of an agent at work: user messages, ``cmd_run``
/ ``cmd_output`` and ``file_edit`` / ``file_edited`` pairs, thoughts, and every 1,000th
event a ``condensation`` (100 in all) that keeps the first 4 events and the last 200,
forgets everything between and puts its summary after the kept head (what a summarizing
condenser writes).

- fold: ``view(events)``, the full fold and the final ``View`` (target < 1 s); baseline: a
  loop that only appends every event to a list, the least any fold can cost;
- incremental: ``ViewBuilder.append`` per event over the same session (µs per event,
  condensations included), against ``list.append`` in the same loop.

Medians of ``--repeats`` runs, alternating.  Run alone: ``python -m bench.view``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from bench.common import Result, run_alone
from riverbed import events
from riverbed.memory.view import ViewBuilder, view

EVENTS = 100_000
CONDENSE_EVERY = 1000
KEEP_HEAD = 4
KEEP_TAIL = 200


def session_events(count: int = EVENTS) -> list[events.Event]:
    out: list[events.Event] = []
    n = 0

    def add(event: events.Event) -> int:
        nonlocal n
        n += 1
        out.append(event)
        return n

    add(events.Message(id=1, content="fix the failing parser test", source="user"))
    step = 0
    while n < count:
        if (n + 1) % CONDENSE_EVERY == 0:
            cid = n + 1
            add(
                events.Condensation(
                    id=cid,
                    forgotten=[(KEEP_HEAD + 1, cid - KEEP_TAIL)],
                    summary=f"summary up to event {cid - KEEP_TAIL}: ran the tests, edited parser.py",
                    summary_offset=KEEP_HEAD,
                )
            )
            continue
        step += 1
        match step % 4:
            case 0:
                add(events.Think(id=n + 1, thought=f"step {step}: the tokenizer drops the last line"))
            case 1:
                action = add(events.CmdRun(id=n + 1, command=f"pytest tests/test_parser.py -k case_{step}"))
                add(
                    events.CmdOutput(
                        id=n + 1,
                        cause=action,
                        source="runtime",
                        content=f"F.. 1 failed, 2 passed in 0.{step % 10}s\nAssertionError: case_{step}",
                        exit_code=1,
                        command=f"pytest tests/test_parser.py -k case_{step}",
                    )
                )
            case 2:
                action = add(
                    events.FileEdit(
                        id=n + 1,
                        command="str_replace",
                        path="src/parser.py",
                        old_str=f"return tokens[:-{step % 3 + 1}]",
                        new_str="return tokens",
                    )
                )
                add(events.FileEdited(id=n + 1, cause=action, source="runtime", path="src/parser.py", diff="-a\n+b"))
            case _:
                add(events.Message(id=n + 1, content=f"still failing at step {step}", source="agent"))
    return out[:count]


def _plain(evs: list[events.Event]) -> float:
    started = time.perf_counter()
    out: list[events.Event] = []
    for event in evs:
        out.append(event)  # noqa: PERF402  (the baseline is this very loop)
    return time.perf_counter() - started


def _fold(evs: list[events.Event]) -> float:
    started = time.perf_counter()
    view(evs)
    return time.perf_counter() - started


def _appends(evs: list[events.Event]) -> float:
    builder = ViewBuilder()
    append = builder.append
    started = time.perf_counter()
    for event in evs:
        append(event)
    return time.perf_counter() - started


async def measure(_url: str, args: argparse.Namespace) -> list[Result]:
    repeats = max(args.repeats, 3)
    evs = session_events()
    conds = sum(isinstance(e, events.Condensation) for e in evs)
    folded = view(evs)
    assert folded.summary is not None
    assert len(folded) <= KEEP_HEAD + 1 + KEEP_TAIL
    plain, fold, appends = [], [], []
    gc.collect()
    for _ in range(repeats):
        plain.append(_plain(evs))
        fold.append(_fold(evs))
        appends.append(_appends(evs))
    base = statistics.median(plain)
    fold_ms = statistics.median(fold) * 1000
    append_us = statistics.median(appends) / len(evs) * 1e6
    base_us = base / len(evs) * 1e6
    return [
        Result(
            f"view fold, {len(evs):,} events / {conds} condensations",
            "ms",
            fold_ms,
            base * 1000,
            "loop appending to a list",
            fold_ms / (base * 1000),
            1000.0,
            repeats,
            better="lower",
            target_on="figure",
        ),
        Result(
            "ViewBuilder.append per event",
            "µs",
            append_us,
            base_us,
            "list.append in the loop",
            append_us / base_us,
            None,
            repeats,
            better="lower",
        ),
    ]


def main() -> int:
    return run_alone(measure, "The View fold against a plain loop over the same events.")


if __name__ == "__main__":
    raise SystemExit(main())

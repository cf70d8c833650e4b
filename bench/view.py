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

And against the peer: the first 10,000 events of that session (10 condensations), folded by
riverbed and by the OpenHands SDK's ``View.from_events`` (``bench/openhands_view.py``, one
SDK event per riverbed event) in the same run, in thread CPU (``time.thread_time``):

- the fold (target <= 0.4x the peer's);
- ``ViewBuilder.append`` of every event, then ``view()`` (target <= 0.5 µs per event).

The SDK needs Python >= 3.12: it runs in its own environment, ``.venv-openhands`` (made here
on first use with a Python 3.12 found on PATH or under pyenv, or ``RIVERBED_BENCH_PYTHON312``;
``--no-peer`` skips it).

Medians of ``--repeats`` runs, alternating.  Run alone: ``python -m bench.view``.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import Result, options, print_results, private_redis
from riverbed import events
from riverbed.cli.output import json_bytes
from riverbed.memory.view import ViewBuilder, view

EVENTS = 100_000
PEER_EVENTS = 10_000
PEER_SDK = "openhands-sdk==1.58.0"
ROOT = Path(__file__).resolve().parent.parent
PEER_VENV = ROOT / ".venv-openhands"
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


def _fold(evs: list[events.Event], clock: Callable[[], float] = time.perf_counter) -> float:
    started = clock()
    view(evs)
    return clock() - started


def _appends(evs: list[events.Event], clock: Callable[[], float] = time.perf_counter) -> float:
    builder = ViewBuilder()
    append = builder.append
    started = clock()
    for event in evs:
        append(event)
    builder.view()  # (folding is lazy: the view is where appended events are folded)
    return clock() - started


async def measure(_url: str, args: argparse.Namespace) -> list[Result]:
    repeats = max(args.repeats, 3)
    results = _against_a_loop(repeats)
    if args.no_peer:
        return results
    return results + _against_openhands(repeats)


def _against_a_loop(repeats: int) -> list[Result]:
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


def _against_openhands(repeats: int) -> list[Result]:
    evs = session_events(PEER_EVENTS)
    conds = sum(isinstance(e, events.Condensation) for e in evs)
    python = peer_python()
    if isinstance(python, str):
        print(f"bench.view: the OpenHands SDK comparison is skipped: {python}", file=sys.stderr)
        return []
    history = b"".join(json_bytes(e) + b"\n" for e in evs)
    folds: list[float] = []
    appends: list[float] = []
    peer: list[float] = []
    peer_length = 0
    gc.collect()
    for _ in range(2):  # riverbed, the peer, riverbed again: a load change hits both alike
        for _ in range(repeats):
            folds.append(_fold(evs, time.thread_time))
            appends.append(_appends(evs, time.thread_time))
        if not peer:
            peer, peer_length = _peer_folds(python, history, repeats * 2)
    fold_ms, peer_ms = statistics.median(folds) * 1000, statistics.median(peer) * 1000
    append_us = statistics.median(appends) / len(evs) * 1e6
    note = f"OpenHands SDK 1.58 view: {peer_length} events (one summary per condensation), riverbed's: {len(view(evs))}"
    return [
        Result(
            f"view fold, {len(evs):,} events / {conds} condensations, thread CPU",
            "ms",
            fold_ms,
            peer_ms,
            "OpenHands SDK View.from_events",
            fold_ms / peer_ms,
            0.4,
            repeats * 2,
            better="lower",
            note=note,
        ),
        Result(
            "ViewBuilder.append per event, then view(), thread CPU",
            "µs",
            append_us,
            peer_ms * 1000 / len(evs),
            "OpenHands SDK, per event",
            append_us / (peer_ms * 1000 / len(evs)),
            0.5,
            repeats * 2,
            better="lower",
            target_on="figure",
        ),
    ]


def _peer_folds(python: Path, history: bytes, repeats: int) -> tuple[list[float], int]:
    env = {**os.environ, "OPENHANDS_SUPPRESS_BANNER": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    script = Path(__file__).with_name("openhands_view.py")
    done = subprocess.run(
        [str(python), str(script), str(repeats)], input=history, capture_output=True, env=env, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"the OpenHands SDK fold failed: {done.stderr.decode(errors='replace')[-2000:]}")
    answer = json.loads(done.stdout)
    return answer["fold_seconds"], answer["view_length"]


def peer_python() -> Path | str:
    """The Python of ``.venv-openhands`` with the SDK installed (made now if need be), or why not."""
    python = PEER_VENV / "bin" / "python"
    check = [str(python), "-c", "import openhands.sdk"]
    if python.exists() and subprocess.run(check, capture_output=True, check=False).returncode == 0:
        return python
    base = _python312()
    if base is None:
        return (
            "no Python >= 3.12 found (PATH, pyenv, RIVERBED_BENCH_PYTHON312), which the SDK needs; "
            "install one (pyenv install 3.12) or pass --no-peer"
        )
    print(f"bench.view: installing {PEER_SDK} into {PEER_VENV} (once) …", file=sys.stderr)
    subprocess.run([base, "-m", "venv", str(PEER_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", PEER_SDK], check=True)
    return python


def _python312() -> str | None:
    given = os.environ.get("RIVERBED_BENCH_PYTHON312")
    if given:
        return given
    pyenv_root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    candidates = [shutil.which(f"python3.{minor}") for minor in (12, 13)]
    candidates += sorted(glob.glob(f"{pyenv_root}/versions/3.1[23]*/bin/python3"))
    for candidate in candidates:
        found = candidate and subprocess.run([candidate, "-c", "import venv"], capture_output=True, check=False)
        if found and found.returncode == 0:
            return candidate
    return None


def main() -> int:
    args = options("The View fold against a plain loop and the OpenHands SDK's, on the same events.").parse_args()
    import anyio  # noqa: PLC0415

    with private_redis(args.redis_url) as url:
        results = anyio.run(measure, url, args)
    print_results(results, as_json=args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The View fold and the prompt over long sessions, against a plain loop and the OpenHands SDK.

Two shapes of log, both reported:

- **the agent's** (first): what the agent role writes.  A ``session_config`` that turns on
  observation masking (a pipeline: masking, then a summarizing condenser), the user's task
  and a ``run_started``; then steps.  A step is an ``llm_response`` (on most steps the
  model's text before its calls; 1-3 tool calls in OpenAI wire form, with ids) and the
  actions its calls ask for, in call order, each with ``cause`` the response and
  ``tool_call_id`` its call (``cmd_run``, ``file_read``, ``file_edit``, ``think``), each but
  ``think`` answered by its observation (``cmd_output``, ``file_content`` or, one read in ten,
  an ``error``, ``file_edited``) before the next action runs.  Every 40 steps the user
  says something, and every 1,000 events the condenser role writes a ``condensation``: it
  forgets everything from the end of the head (the first 3 events) to the end of the last
  step 200 events back and puts its summary after the head.
- **the old one**, from before tool call ids, kept to compare with earlier figures: user
  messages, ``cmd_run`` / ``cmd_output`` and ``file_edit`` / ``file_edited`` pairs (the
  action without a ``cause``), thoughts, and every 1,000th event a condensation keeping
  the first 4 events and the last 200.

Against a loop, 100,000 events (100 condensations), thread CPU (``time.thread_time``):

- fold: ``view(events)``, the full fold (target < 1 s), against a loop that only appends
  every event to a list, the least any fold can cost;
- incremental: ``ViewBuilder.append`` of every event, then ``view()``, per event (target on
  the agent's shape: <= 0.5 µs), against ``list.append`` in the same loop.

Against the OpenHands SDK 1.58, the first 10,000 events (10 condensations) converted one for
one into the SDK's events by ``bench/openhands_view.py`` (the one exception: the SDK's
``think`` tool answers with an observation, which riverbed's does not write), in thread
CPU, rounds alternating between the two processes, the median of the rounds' ratios:

- fold: ``view(events)`` against ``View.from_events`` (target <= 0.4x the peer's);
- prompt: ``to_messages`` of the view of the events before the last condensation,
  masked as the session's config says (``prepare``, timed apart and named in the note),
  against the SDK's ``LLMConvertibleEvent.events_to_messages`` of its view of the same
  events (target <= 0.4x; the SDK's ``to_chat_dict`` that makes its wire form, which
  ``to_messages`` returns, is in the note, not in the figure);
- ``ViewBuilder.append`` of every event then ``view()``, per event, against the SDK's fold
  per event.

The SDK needs Python >= 3.12: it runs in its own environment, ``.venv-openhands`` (made here
on first use with a Python 3.12 found on PATH or under pyenv, or ``RIVERBED_BENCH_PYTHON312``;
``--no-peer`` skips it).  ``--repeats`` rounds (at least 3; 2x that against the peer).  Run
alone: ``python -m bench.view``.

With ``BENCH_VIEW_CALLGRIND=1``, each shape's 100,000 events are also folded under ``valgrind
--tool=callgrind`` (a few minutes): the instructions per event of ``ViewBuilder.append`` and the
fold that ``view()`` then makes, against the ``list.append`` loop's, each less those of a run
that only decodes the same events.  Thread CPU moves with the VM by a factor of two or more
from one hour to the next (and within a run); the fold's counts move by less than 1% from one run
to the next (the bare loop's, a small difference of two large counts, by up to a tenth), so they
say what the 0.5 µs goal asks of a CPU.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from bench.common import Result, dump_instructions, options, print_results, private_redis
from riverbed import events
from riverbed.agent.messages import to_messages
from riverbed.cli.output import json_bytes
from riverbed.memory.condensers import CondenserConfig, config_from_log, prepare
from riverbed.memory.tokens import action_arguments
from riverbed.memory.view import View, ViewBuilder, view

EVENTS = 100_000
PEER_EVENTS = 10_000
PEER_SDK = "openhands-sdk==1.58.0"
ROOT = Path(__file__).resolve().parent.parent
PEER_VENV = ROOT / ".venv-openhands"
CONDENSE_EVERY = 1000
KEEP_HEAD = 4  # (the old shape's)
AGENT_HEAD = 3  # the agent's: its config, the task, the run's start
KEEP_TAIL = 200
MASKING: dict[str, Any] = {
    "strategy": "pipeline",
    "stages": [{"strategy": "masking", "mask_window": 10}, {"strategy": "summarizing", "max_events": 1000}],
}

Shape = Callable[[int], list[events.Event]]

# --- the agent's shape -----------------------------------------------------------------------

_PASSED = [f"tests/test_parser.py::test_case_{i} PASSED" for i in range(40)]


def agent_events(count: int = EVENTS, seed: int = 44) -> list[events.Event]:
    """``count`` events of an agent's session as the agent and condenser roles write them."""
    rng = random.Random(seed)
    out: list[events.Event] = []

    def add(event: events.Event) -> int:
        out.append(events.with_id(event, len(out) + 1))
        return len(out)

    add(events.SessionConfig(source="user", condenser=MASKING))
    add(events.Message(source="user", content="The parser test fails on inputs without a trailing newline; fix it."))
    add(events.RunStarted())
    forgotten_to, step_ends, step, due = AGENT_HEAD, [AGENT_HEAD], 0, CONDENSE_EVERY - 8
    while len(out) < count:
        if len(out) + 1 >= due:
            cid = len(out) + 1
            end = max(e for e in step_ends if e <= cid - KEEP_TAIL)
            due += CONDENSE_EVERY
            if end > forgotten_to:
                summary = f"TASK: fix the parser. DONE: steps up to event {end}: ran the tests, edited the tokenizer."
                add(
                    events.Condensation(
                        source="condenser",
                        cause=cid - 1,
                        forgotten=[(forgotten_to + 1, end)],
                        summary=summary,
                        summary_offset=AGENT_HEAD,
                    )
                )
                forgotten_to = end
                continue
        step += 1
        if step % 40 == 0:
            add(events.Message(source="user", content=f"Also keep the CLI's output as it is (note {step})."))
        planned = [_planned(rng, step) for _ in range(rng.choices((1, 2, 3), (6, 3, 1))[0])]
        calls = [
            {
                "id": f"call_{rng.getrandbits(64):016x}",
                "type": "function",
                "function": {"name": action.kind, "arguments": json.dumps(action_arguments(action))},
            }
            for action in planned
        ]
        said = rng.random() < 0.7  # (on most steps the model says something before its calls)
        thought = f"Step {step}: the tokenizer drops the last line when it has no newline; checking." if said else None
        response = add(
            events.LlmResponse(
                source="agent",
                model="gpt-4.1",
                content=thought,
                tool_calls=calls,
                usage={"prompt_tokens": 9000 + 40 * step % 20000, "completion_tokens": 120},
                cause=len(out),
            )
        )
        for action, call in zip(planned, calls, strict=True):
            asked = add(msgspec.structs.replace(action, source="agent", cause=response, tool_call_id=call["id"]))
            answer = _answer(rng, action, step, asked)
            if answer is not None:
                add(answer)
        step_ends.append(len(out))
    return out[:count]


def _planned(rng: random.Random, step: int) -> events.Action:
    path = f"src/parser/module_{step % 17}.py"
    pick = rng.random()
    if pick < 0.45:
        return events.CmdRun(command=f"pytest tests/test_parser.py -x -q -k case_{step}")
    if pick < 0.65:
        return events.FileRead(path=path)
    if pick < 0.9:
        return events.FileEdit(command="str_replace", path=path, old_str="return tokens[:-1]", new_str="return tokens")
    return events.Think(thought=f"The failure at step {step} comes from the newline handling, in the tokenizer.")


def _answer(rng: random.Random, action: events.Action, step: int, asked: int) -> events.Event | None:
    match action:
        case events.CmdRun():
            passed = "\n".join(_PASSED[: rng.randint(3, 30)])
            content = f"{passed}\nFAILED tests/test_parser.py::test_case_{step} - AssertionError"
            return events.CmdOutput(cause=asked, content=content, exit_code=1, command=action.command)
        case events.FileRead() if rng.random() < 0.1:
            return events.Error(cause=asked, content=f"no such file: {action.path}")
        case events.FileRead():
            lines = (f"    line {i} of {action.path}" for i in range(rng.randint(10, 60)))
            return events.FileContent(cause=asked, path=action.path, content="\n".join(lines))
        case events.FileEdit():
            return events.FileEdited(cause=asked, path=action.path, diff=f"-{action.old_str}\n+{action.new_str}")
    return None


# --- the old shape ---------------------------------------------------------------------------


def session_events(count: int = EVENTS) -> list[events.Event]:
    """``count`` events of a session from before tool call ids (see the module docstring)."""
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


SHAPES: dict[str, Shape] = {"agent's": agent_events, "old": session_events}

# --- measuring -------------------------------------------------------------------------------


def _plain(evs: list[events.Event]) -> float:
    started = time.thread_time()
    out: list[events.Event] = []
    for event in evs:
        out.append(event)  # noqa: PERF402  (the baseline is this very loop)
    return time.thread_time() - started


def _fold(evs: list[events.Event]) -> float:
    started = time.thread_time()
    view(evs)
    return time.thread_time() - started


def _appends(evs: list[events.Event]) -> float:
    builder = ViewBuilder()
    append = builder.append
    started = time.thread_time()
    for event in evs:
        append(event)
    builder.view()  # (folding is lazy: the view is where appended events are folded)
    return time.thread_time() - started


def _timed(fn: Callable[[], object]) -> float:
    started = time.thread_time()
    fn()
    return time.thread_time() - started


async def measure(_url: str, args: argparse.Namespace) -> list[Result]:
    repeats = max(args.repeats, 3)
    counting = bool(os.environ.get("BENCH_VIEW_CALLGRIND"))
    if counting and shutil.which("valgrind") is None:
        raise SystemExit("bench.view: BENCH_VIEW_CALLGRIND needs valgrind on PATH (apt install valgrind)")
    results: list[Result] = []
    for name, shape in SHAPES.items():
        evs = shape(EVENTS)
        timed = _against_a_loop(name, evs, repeats)
        results += timed
        if counting:
            results += _instructions(name, evs, timed[1].figure)
    if not args.no_peer:
        for name, shape in SHAPES.items():
            results += _against_openhands(name, shape(PEER_EVENTS), repeats * 2)
    return results


def _against_a_loop(shape: str, evs: list[events.Event], repeats: int) -> list[Result]:
    conds = sum(isinstance(e, events.Condensation) for e in evs)
    folded = view(evs)
    assert folded.summary is not None
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
            f"view fold, {shape} shape, {len(evs):,} events / {conds} condensations, thread CPU",
            "ms",
            fold_ms,
            base * 1000,
            "loop appending to a list",
            fold_ms / (base * 1000),
            1000.0,
            repeats,
            better="lower",
            target_on="figure",
            note=f"the view: {len(folded)} events",
        ),
        Result(
            f"ViewBuilder.append per event, then view(), {shape} shape, thread CPU",
            "µs",
            append_us,
            base_us,
            "list.append in the loop",
            append_us / base_us,
            0.5 if shape == "agent's" else None,
            repeats,
            better="lower",
            target_on="figure",
        ),
    ]


def _instructions(shape: str, evs: list[events.Event], timed_us: float) -> list[Result]:
    """Instructions per event, counted by callgrind (``BENCH_VIEW_CALLGRIND``): a child process
    per part decodes the same events, then does that part (:func:`_count_part`).  ``timed_us``:
    the same per event in thread CPU, this run (the rate this machine ran them at)."""
    with tempfile.TemporaryDirectory(prefix="riverbed-bench-view-") as tmp:
        history = Path(tmp) / "events.msgpack"
        history.write_bytes(msgspec.msgpack.encode([(e.id, events.encode(e)) for e in evs]))
        counts: dict[str, int] = {}
        for part in ("decode", "loop", "append", "fold"):
            print(f"bench.view: counting the instructions of {part!r}, {shape} shape", file=sys.stderr, flush=True)
            out = Path(tmp) / f"{part}.cg"
            command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-c",
                       f"from bench.view import _count_part; _count_part({part!r}, {str(history)!r})"]  # fmt: skip
            try:
                subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": "0"}, capture_output=True,
                               check=True, timeout=1800)  # fmt: skip
            except subprocess.CalledProcessError as exc:
                why = exc.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
                raise SystemExit(f"bench.view: counting {part!r} under callgrind failed: {why[0]}") from None
            except subprocess.TimeoutExpired:
                raise SystemExit(f"bench.view: counting {part!r} under callgrind took over 30 minutes") from None
            counts[part] = dump_instructions(out)
    per = {part: (counts[part] - counts["decode"]) / len(evs) for part in ("loop", "append", "fold")}
    return [
        Result(
            f"ViewBuilder.append per event, then view(), {shape} shape, instructions (callgrind)",
            "instructions",
            per["fold"],
            per["loop"],
            "list.append in the loop",
            per["fold"] / per["loop"],
            None,
            1,
            better="lower",
            note=(
                f"the append loop {per['append']:,.0f} an event and the fold {per['fold'] - per['append']:,.0f};"
                f" in 0.5 µs an event they ask for {per['fold'] / 500:.1f} instructions a nanosecond of one thread,"
                f" and this run's {timed_us:.3g} µs ran {per['fold'] / (timed_us * 1000):.1f}"
            ),
        )
    ]


def _count_part(part: str, history: str) -> None:
    """One part of :func:`_instructions`, run under callgrind: decode the events, then do ``part``."""
    evs = [events.decode(payload, event_id) for event_id, payload in msgspec.msgpack.decode(Path(history).read_bytes())]
    if part == "loop":
        _plain(evs)
    elif part == "fold":
        _appends(evs)
    elif part == "append":  # (the appends of _appends without its view())
        append = ViewBuilder().append
        for event in evs:
            append(event)


class _Peer:
    """The SDK's side (``bench/openhands_view.py``) in its own process, asked one round at a time."""

    def __init__(self, python: Path, history: Path, until: int) -> None:
        env = {**os.environ, "OPENHANDS_SUPPRESS_BANNER": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        script = Path(__file__).with_name("openhands_view.py")
        self._process = subprocess.Popen(
            [str(python), str(script), str(history), str(until)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        self.facts = self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            self._process.wait(timeout=30)
            stderr = self._process.stderr.read() if self._process.stderr is not None else ""
            raise SystemExit(f"the OpenHands SDK side failed: {stderr[-2000:]}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def seconds(self, what: str) -> float:
        """The thread CPU of one ``fold`` or ``messages`` (or ``wire``: messages and their dicts)."""
        assert self._process.stdin is not None
        self._process.stdin.write(what + "\n")
        self._process.stdin.flush()
        return float(self._answer()["seconds"])

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        self._process.wait(timeout=30)


def _against_openhands(shape: str, evs: list[events.Event], rounds: int) -> list[Result]:
    python = peer_python()
    if isinstance(python, str):
        print(f"bench.view: the OpenHands SDK comparison is skipped: {python}", file=sys.stderr)
        return []
    conds = [e.id for e in evs if isinstance(e, events.Condensation) and e.id is not None]
    until = conds[-1] - 1
    prefix = [e for e in evs if e.id is not None and e.id <= until]
    config = config_from_log(evs) if shape == "agent's" else CondenserConfig()
    folded = view(prefix)
    masked = prepare(folded, config)
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as history:
        history.write(b"".join(json_bytes(e) + b"\n" for e in evs))
        history.flush()
        peer = _Peer(python, Path(history.name), until)
        try:
            figures = _rounds(peer, evs, folded, masked, config, rounds)
        finally:
            peer.close()
    fold, messages, appends, peer_fold, peer_messages, peer_wire, prepared, fold_ratio, messages_ratio = figures
    facts = peer.facts
    append_us = appends / len(evs) * 1e6
    peer_us = peer_fold / len(evs) * 1e6
    sdk = "OpenHands SDK 1.58"
    return [
        Result(
            f"view fold, {shape} shape, {len(evs):,} events / {len(conds)} condensations, thread CPU",
            "ms",
            fold * 1000,
            peer_fold * 1000,
            f"{sdk} View.from_events",
            fold_ratio,
            0.4,
            rounds,
            better="lower",
            note=f"views: riverbed {len(view(evs))} events, the SDK {facts['view_length']}",
        ),
        Result(
            f"to_messages of the view before the last condensation, {shape} shape, thread CPU",
            "ms",
            messages * 1000,
            peer_messages * 1000,
            f"{sdk} events_to_messages",
            messages_ratio,
            0.4,
            rounds,
            better="lower",
            note=(
                f"{len(masked)} events in the view, {len(to_messages(masked))} messages "
                f"(the SDK: {facts['messages_view']} events, {facts['messages']} messages); masking them first "
                f"(prepare) took {prepared * 1000:.3g} ms more; the SDK's messages as dicts "
                f"(to_chat_dict) {peer_wire * 1000:.3g} ms in all"
            ),
        ),
        Result(
            f"ViewBuilder.append per event, then view(), {shape} shape, thread CPU",
            "µs",
            append_us,
            peer_us,
            f"{sdk} fold, per event",
            append_us / peer_us,
            None,
            rounds,
            better="lower",
        ),
    ]


def _rounds(
    peer: _Peer,
    evs: list[events.Event],
    folded: View,
    masked: View,
    config: CondenserConfig,
    rounds: int,
) -> tuple[float, ...]:
    """Medians over alternating rounds (riverbed first in every other one): riverbed's fold,
    messages and appends, the peer's fold, messages and messages as dicts, riverbed's masking,
    and the medians of the rounds' fold and messages ratios."""
    ours: dict[str, list[float]] = {"fold": [], "messages": [], "appends": [], "prepare": []}
    theirs: dict[str, list[float]] = {"fold": [], "messages": [], "wire": []}
    ratios: dict[str, list[float]] = {"fold": [], "messages": []}
    riverbed: dict[str, Callable[[], float]] = {
        "fold": lambda: _fold(evs),
        "messages": lambda: _timed(lambda: to_messages(masked)),
    }
    for what in ("fold", "messages", "wire"):  # (warm-up)
        peer.seconds(what)
    gc.collect()
    for n in range(rounds):
        for what, ours_now in riverbed.items():
            if n % 2 == 0:
                mine, other = ours_now(), peer.seconds(what)
            else:
                other, mine = peer.seconds(what), ours_now()
            ours[what].append(mine)
            theirs[what].append(other)
            ratios[what].append(mine / other)
        theirs["wire"].append(peer.seconds("wire"))
        ours["appends"].append(_appends(evs))
        ours["prepare"].append(_timed(lambda: prepare(folded, config)))
    med = statistics.median
    return (
        med(ours["fold"]),
        med(ours["messages"]),
        med(ours["appends"]),
        med(theirs["fold"]),
        med(theirs["messages"]),
        med(theirs["wire"]),
        med(ours["prepare"]),
        med(ratios["fold"]),
        med(ratios["messages"]),
    )


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
    args = options("The View fold and the prompt against a plain loop and the OpenHands SDK's.").parse_args()
    import anyio  # noqa: PLC0415

    with private_redis(args.redis_url) as url:
        results = anyio.run(measure, url, args)
    print_results(results, as_json=args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

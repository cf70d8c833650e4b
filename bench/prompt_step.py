"""What a later step's prompt costs the agent role by the context's size: CPU per step, in process.

The part of a step that could grow with its context, as the agent role does it: the step's new
events (a model response with one tool call and its id, the action, its result) folded into the
session's view (``ViewBuilder``), its prompt caught up (``Prompt.follow``: what the view added
since the step before), and the request's body made with the prompt's ``messages``
(``request_parts``, as the role's model client makes it: a long prompt's kept JSON a view into its
buffer, a short one's copied into the body).  Sessions
are seeded with the earlier turns of ``bench agents --context`` (about 2,000 events against 20,
and the 20 again with their first message padded to the 2,000's prompt bytes), then every size
makes its steps in rounds that alternate (50 sessions of each, 10 steps each; the collector set
as a worker sets it, and a collection before each).  The figure is this process's CPU per step
(user and system, ``getrusage``), with no socket, no Redis and no other process in it: the end-to-end
figure of ``bench agents --context 20,2000`` holds this and what stays the same at any size
(the reads, the appends, the model call's HTTP), and its noise on a shared machine is larger
than this part's difference.

Run alone: ``python -m bench.prompt_step [--repeats N] [--json]``.
"""

from __future__ import annotations

import argparse
import gc
import statistics

from msgspec.structs import replace

from bench.agents import MODEL, _earlier_turns, _prompt_bytes
from bench.common import Result, process_cpu, run_alone
from riverbed import events
from riverbed.agent.prompt import Prompt
from riverbed.memory.view import ViewBuilder
from riverbed.workers.main import tune_collector
from riverbed.workers.model_client import request_parts

SESSIONS, STEPS = 50, 10
"""sessions per size in a round, and the steps each makes (as a run of ``bench agents``)"""
LARGE, SMALL = 2000, 20
"""the contexts' sizes, in events (about)"""


class _Session:
    """A seeded session's log, its fold and its prompt, stepped as the agent role steps one."""

    def __init__(self, size: int, pad: int) -> None:
        self.seen = [replace(e, id=i) for i, e in enumerate(_earlier_turns(size, None, pad), 1)]
        self.builder = ViewBuilder(self.seen)
        self.prompt = Prompt(system="You are a bench.")
        self.prompt.follow(self.seen, self.builder)
        self.bytes = 0

    def step(self) -> None:
        last = len(self.seen)
        call = f"call_{last}"
        function = {"name": "file_read", "arguments": '{"path": "src/a.py"}'}
        new: list[events.Event] = [
            events.LlmResponse(model=MODEL, tool_calls=[{"id": call, "type": "function", "function": function}],
                               usage={"prompt_tokens": 2000, "completion_tokens": 40}, cause=last, agent="llm",
                               id=last + 1),
            events.FileRead(path="src/a.py", tool_call_id=call, cause=last + 1, agent="llm", id=last + 2),
            events.FileContent(path="src/a.py", content="def f(x):\n    return x\n", source="runtime",
                               cause=last + 2, id=last + 3),
        ]  # fmt: skip
        self.seen += new
        self.builder.extend(new)
        self.prompt.follow(self.seen, self.builder)
        body = {"model": MODEL, "messages": self.prompt.encoded_parts(), "tools": [], "tool_choice": "auto"}
        self.bytes = sum(map(len, request_parts(body)))


async def measure(_url: str, args: argparse.Namespace) -> list[Result]:
    pad = _prompt_bytes(LARGE) - _prompt_bytes(SMALL)
    sizes = {"large": (LARGE, 0), "small": (SMALL, 0), "padded": (SMALL, pad)}
    cpu: dict[str, list[float]] = {name: [] for name in sizes}
    sent: dict[str, int] = {}
    tune_collector()
    for _ in range(max(args.repeats, 5)):
        for name, (size, padding) in sizes.items():
            sessions = [_Session(size, padding) for _ in range(SESSIONS)]
            for session in sessions:  # (warm: the first step after taking a session)
                session.step()
            gc.collect()
            started = process_cpu()
            for session in sessions:
                for _ in range(STEPS):
                    session.step()
            cpu[name].append((process_cpu() - started) / (SESSIONS * STEPS) * 1e6)
            sent[name] = sessions[0].bytes
    large, small, padded = (statistics.median(cpu[name]) for name in ("large", "small", "padded"))
    rounds = ", ".join(f"{a / b:.2f}" for a, b in zip(cpu["large"], cpu["small"], strict=True))
    return [
        Result(f"a later step's prompt work, CPU per step, {LARGE:,}-event context", "us", large, small,
               f"a {SMALL}-event context's", large / small, None, len(cpu["large"]) * SESSIONS * STEPS, better="lower",
               note=f"request bodies of {sent['large']:,} against {sent['small']:,} bytes at the last step; each "
               f"round's ratio: {rounds}"),
        Result(f"a later step's prompt work, CPU per step, {LARGE:,}-event context against {SMALL} events whose "
               "prompt is as long", "us", large, padded, f"the padded {SMALL}-event context's", large / padded, None,
               len(cpu["large"]) * SESSIONS * STEPS, better="lower",
               note=f"the padded body {sent['padded']:,} bytes: what is left is the context's events, not its bytes"),
    ]  # fmt: skip


def main() -> int:
    return run_alone(measure, "What a later step's prompt costs the agent role by the context's size.")


if __name__ == "__main__":
    raise SystemExit(main())

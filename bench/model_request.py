"""What a model request's bytes cost the agent role's client: CPU per call by prompt size.

``CheckedClient.chat_completion`` (the agent role's model call) against the scripted model
server of ``bench.agents`` answering at once, sequential calls in this process, each with the
lease check the role sets (:func:`~riverbed.workers.model_client.checked_by`), known to hold as a
live owner's is (so the request goes out in one write, as the role's does): a prompt of
the bytes of a 2,000-event context (318 KB, the size ``bench agents --context 20,2000`` sends)
against one of a 20-event context's (7 KB), rounds alternating.  The figure is this process's
CPU per call (user + system, ``getrusage``): building the body, writing it (the kernel's copy
and its loopback TCP included), reading and decoding the answer.  It is the part of a step's
CPU that grows with the prompt's bytes whatever riverbed does, since the whole prompt goes to
the model server at every step.

Run alone: ``python -m bench.model_request [--repeats N] [--json]``.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
from typing import Any

import msgspec

from bench.common import Result, process_cpu, run_alone
from riverbed.agent.prompt import EncodedMessages
from riverbed.workers.model_client import CheckedClient, checked_by

LARGE = 318_000
"""bytes of the large prompt: the 2,000-event context's in ``bench agents --context 20,2000``"""
SMALL = 7_000
"""bytes of the small one: about a 20-event context's"""
CALLS = 300
"""calls per size in a round"""


def _system() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def _body(size: int) -> dict[str, Any]:
    """A chat request of about ``size`` bytes whose messages are JSON already, as the role sends
    them: a prompt's kept JSON, each message followed by a comma, read in place."""
    messages = [
        {"role": "system", "content": "You are a bench."},
        {"role": "user", "content": "bench run s1: read the file\n" + "x" * size},
    ]
    joined = bytearray(b"".join(msgspec.json.encode(m) + b"," for m in messages))
    return {
        "model": "bench-model",
        "messages": EncodedMessages(joined, 0, len(joined), b"[", None),
        "tools": [],
        "tool_choice": "auto",
    }


def _model_server() -> tuple[subprocess.Popen[bytes], int]:
    """``python -m bench.model_server`` answering at once, and its port."""
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.model_server", "--latency", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert server.stdout is not None
    return server, int(server.stdout.readline().split()[1])


async def _lease_check() -> None:
    """The role's check, which a request asks only when the owner's clock does not say its lease holds."""


async def _rounds(
    client: CheckedClient,
    bodies: dict[int, dict[str, Any]],
    cpu: dict[int, list[float]],
    system: dict[int, list[float]],
    rounds: int,
) -> None:
    for body in bodies.values():  # (warm: the connection, the allocator)
        for _ in range(20):
            await client.chat_completion(body)
    for _ in range(rounds):
        for size, body in bodies.items():
            started, started_system = process_cpu(), _system()
            for _ in range(CALLS):
                await client.chat_completion(body)
            cpu[size].append((process_cpu() - started) / CALLS * 1e6)
            system[size].append((_system() - started_system) / CALLS * 1e6)


async def measure(_url: str, args: argparse.Namespace) -> list[Result]:
    server, port = _model_server()
    try:
        client = CheckedClient(api_key="bench", base_url=f"http://127.0.0.1:{port}/v1", calls=1)
        bodies = {SMALL: _body(SMALL), LARGE: _body(LARGE)}
        cpu: dict[int, list[float]] = {SMALL: [], LARGE: []}
        system: dict[int, list[float]] = {SMALL: [], LARGE: []}
        try:
            with checked_by(_lease_check, lambda: True):
                await _rounds(client, bodies, cpu, system, max(args.repeats, 3))
        finally:
            await client.close()
    finally:
        server.terminate()
        server.wait()
    large, small = statistics.median(cpu[LARGE]), statistics.median(cpu[SMALL])
    note = (
        f"of which the kernel's: {statistics.median(system[LARGE]):.0f} against "
        f"{statistics.median(system[SMALL]):.0f} us; each round's ratio: "
        + ", ".join(f"{a / b:.2f}" for a, b in zip(cpu[LARGE], cpu[SMALL], strict=True))
    )
    return [
        Result(f"model request client CPU per call, {LARGE // 1000} KB prompt", "us", large, small,
               f"a {SMALL // 1000} KB prompt", large / small, None, len(cpu[LARGE]) * CALLS, better="lower",
               note=note),
        Result("model request client CPU per call, the extra bytes' part", "us", large - small, small,
               f"a {SMALL // 1000} KB prompt's call", (large - small) / small, None, len(cpu[LARGE]) * CALLS,
               better="lower", note="what the prompt's 311 KB more cost each call"),
    ]  # fmt: skip


def main() -> int:
    return run_alone(measure, "The agent role's model client: CPU per call by prompt size.")


if __name__ == "__main__":
    raise SystemExit(main())

"""A scripted OpenAI-compatible model server for ``bench.agents``, in a process of its own.

``python -m bench.model_server --latency 0.2 --steps 10`` listens on 127.0.0.1 (a free port,
printed as ``port N`` on stdout once it listens) and answers ``POST /v1/chat/completions``
after exactly ``--latency`` seconds, on asyncio, so a thousand calls in flight cost it little:

- a request whose last user message that says ``bench run SESSION:`` (the run's task) is step
  ``n`` of that run, ``n`` being one more than the assistant messages after it (a session seeded
  with earlier turns carries theirs before it); steps 1 to ``steps - 1`` answer
  one tool call (``--action``: a ``file_read`` of ``small.txt``, or a ``cmd_run`` of ``true``),
  step ``steps`` answers a text (the agent's ``finish``); ``steps`` is the run's own when its
  task says it (:func:`task_text`), else ``--steps``;
- any other request answers the tool call (the bench's own floor measurement).

After ``POST /gates/close`` a run's first and last calls wait, held, until the bench releases
them: every run taken and at its first call, then every run at its last (``GET /gates``: the
calls held and the chat requests received so far; ``POST /gates/release``: answer the held calls;
``POST /gates/open``: answer them and hold no more).  Between the two releases the agent workers
do exactly the runs' later steps, so their CPU then is a later step's own (``bench.agents
--context``).

``GET /journal`` returns every chat request as ``[session, step, received, sent]`` (unix
seconds: when its body was read, when its answer was written), the model's side of each step,
under ``calls``, and how many connections the server accepted, under ``connections``.
``GET /v1/models`` lists the model.  HTTP/1.1 with keep-alive, no chunked bodies: enough for
the ``openai`` client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
import time
from typing import Any

import msgspec

TASK = re.compile(r"bench run (\S+?):(?: use one tool per step (\d+) times)?")
ACTIONS = {"file_read": {"path": "small.txt"}, "cmd_run": {"command": "true"}, "note": {"text": "a short note"}}
"""The tool calls a step may answer, with their arguments."""


def task_text(session: str, steps: int) -> str:
    """The task of a bench run on ``session`` (the server finds the run by it)."""
    return f"bench run {session}: use one tool per step {steps - 1} times, then say done."


class ModelServer:
    def __init__(self, latency: float, steps: int, model: str, action: str = "file_read") -> None:
        self.latency = latency
        self.gates = False
        self.held: list[asyncio.Future[int]] = []
        self.received = 0
        self.action = action
        self.steps = steps
        self.model = model
        self.journal: list[tuple[str | None, int, float, float]] = []
        self.count = 0
        self.connections = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _version = lines[0].split(" ", 2)
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value.strip())
                body = await reader.readexactly(length) if length else b""
                received = time.time()
                status, payload, journal = await self.answer(method, path.rstrip("/"), body)
                data = json.dumps(payload).encode()
                writer.write(
                    f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                    + data
                )
                await writer.drain()
                if journal is not None:
                    self.journal.append((journal[0], journal[1], received, time.time()))
        except ConnectionError:
            return
        finally:
            writer.close()

    def call(self, step: int) -> dict[str, str]:
        """The tool call of a run's ``step``: the same tool, its arguments a little different
        each step (a run that repeats one call with one result ends as stuck)."""
        arguments = dict(ACTIONS[self.action])
        if self.action == "file_read":
            arguments["end"] = step + 1
        elif self.action == "cmd_run":
            arguments["command"] = f"true {step}"
        else:
            arguments["text"] = f"{arguments['text']} {step}"
        return {"name": self.action, "arguments": json.dumps(arguments)}

    async def answer(self, method: str, path: str, body: bytes) -> tuple[int, Any, tuple[str | None, int] | None]:
        if method == "GET" and path == "/journal":
            return 200, {"calls": self.journal, "connections": self.connections}, None
        if method == "GET" and path == "/gates":
            return 200, {"held": len(self.held), "received": self.received}, None
        if method == "POST" and path in ("/gates/close", "/gates/release", "/gates/open"):
            self.gates = path != "/gates/open"
            held, self.held = self.held, []
            for gate in held:
                gate.set_result(len(held))
            return 200, {"released": len(held)}, None
        if method == "GET" and path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]}, None
        if method != "POST" or path != "/v1/chat/completions":
            return 404, {"error": {"message": f"no route {method} {path}", "type": "invalid_request_error"}}, None
        request = _REQUEST.decode(body)  # (the fields it reads only: a long prompt costs the server little)
        session, step, steps = _run_step(request.messages)
        self.received += 1
        if self.gates and session is not None and step in (1, steps or self.steps):
            gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            self.held.append(gate)
            at = len(self.held)
            released = await gate
            if step == 1:  # (the runs spread over a call's time again, as runs opened one by one are)
                await asyncio.sleep(self.latency * at / released)
        await asyncio.sleep(self.latency)
        self.count += 1
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if session is not None and step >= (steps or self.steps):
            message["content"] = "done"
        else:
            message["tool_calls"] = [
                {
                    "id": f"call_{self.count}",
                    "type": "function",
                    "function": self.call(step),
                }
            ]
        prompt_tokens = len(body) // 4
        return (
            200,
            {
                "id": f"chatcmpl-{self.count}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": request.model or self.model,
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "finish_reason": "tool_calls" if "tool_calls" in message else "stop",
                        "logprobs": None,
                    }
                ],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 8, "total_tokens": prompt_tokens + 8},
            },
            (session, step),
        )


class _Message(msgspec.Struct):
    role: str = ""
    content: Any = None


class _Request(msgspec.Struct):
    model: str = ""
    messages: list[_Message] = msgspec.field(default_factory=list)


_REQUEST = msgspec.json.Decoder(_Request)


def _run_step(messages: list[_Message]) -> tuple[str | None, int, int | None]:
    """The run a request belongs to, its step (one more than the assistant messages after the
    run's task: a session seeded with earlier turns has assistant messages before it) and its
    steps in all when the task says (else the server's ``--steps``)."""
    for at in range(len(messages) - 1, -1, -1):
        message = messages[at]
        if message.role == "user" and isinstance(message.content, str):
            found = TASK.search(message.content)
            if found:
                step = 1 + sum(1 for m in messages[at + 1 :] if m.role == "assistant")
                return found.group(1), step, int(found.group(2)) + 1 if found.group(2) else None
    return None, 1 + sum(1 for m in messages if m.role == "assistant"), None


async def main_async(args: argparse.Namespace) -> None:
    server = ModelServer(args.latency, args.steps, args.model, args.action)
    listening = await asyncio.start_server(server.serve, "127.0.0.1", 0, backlog=4096, limit=1 << 22)
    port = listening.sockets[0].getsockname()[1]
    print(f"port {port}", flush=True)
    async with listening:
        await listening.serve_forever()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.model_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency", type=float, default=0.2, help="seconds each chat completion takes")
    parser.add_argument("--steps", type=int, default=10, help="model calls per run (the last one finishes)")
    parser.add_argument("--model", default="bench-model")
    parser.add_argument("--action", choices=sorted(ACTIONS), default="file_read", help="the tool each step calls")
    args = parser.parse_args()
    try:
        import uvloop  # noqa: PLC0415

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    with contextlib.suppress(KeyboardInterrupt):
        runner(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A tiny stdio MCP server (standard library only) whose tools misbehave on purpose.

Tools: ``read`` (a file's text, or the error reading it), ``env`` (its environment), ``connect``
(a TCP connection to a host and port, or the error), ``where``
(its working directory and a token of this process), ``hang`` (never answers), ``die`` (exits
with code 3).  ``--hang-at-start``: it never answers ``initialize``.
"""

import json
import os
import socket
import sys
import time

TOKEN = f"{os.getpid()}-{time.monotonic_ns()}"

TOOLS = [
    {"name": "read", "description": "Read a file", "inputSchema": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
    {"name": "env", "description": "The server's environment", "inputSchema": {"type": "object"}},
    {"name": "where", "description": "Working directory and process token", "inputSchema": {"type": "object"}},
    {"name": "connect", "description": "Open a TCP connection", "inputSchema": {
        "type": "object", "properties": {"host": {"type": "string"}, "port": {"type": "integer"}}}},
    {"name": "hang", "description": "Never answers", "inputSchema": {"type": "object"}},
    {"name": "die", "description": "Exits", "inputSchema": {"type": "object"}},
]  # fmt: skip


def send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def text(request_id: object, content: str, *, error: bool = False) -> None:
    send({"jsonrpc": "2.0", "id": request_id, "result": {"content": [{"type": "text", "text": content}],
                                                         "isError": error}})  # fmt: skip


def call(request_id: object, name: str, arguments: dict) -> None:
    if name == "read":
        try:
            with open(arguments["path"], encoding="utf-8") as fh:
                text(request_id, fh.read())
        except OSError as exc:
            text(request_id, f"{type(exc).__name__}: {exc}", error=True)
    elif name == "env":
        text(request_id, json.dumps(dict(os.environ)))
    elif name == "where":
        text(request_id, json.dumps({"cwd": os.getcwd(), "token": TOKEN}))
    elif name == "connect":
        try:
            socket.create_connection((arguments["host"], arguments["port"]), timeout=2).close()
            text(request_id, "connected")
        except OSError as exc:
            text(request_id, f"{type(exc).__name__}: {exc}", error=True)
    elif name == "hang":
        time.sleep(3600)
    elif name == "die":
        os._exit(3)
    else:
        send({"jsonrpc": "2.0", "id": request_id, "error": {"code": -32602, "message": f"no tool {name}"}})


def main() -> None:
    print("tiny server starting", file=sys.stderr, flush=True)
    hang_at_start = "--hang-at-start" in sys.argv
    for line in sys.stdin:
        message = json.loads(line)
        method, request_id = message.get("method"), message.get("id")
        if method == "initialize":
            if hang_at_start:
                time.sleep(3600)
            send({"jsonrpc": "2.0", "id": request_id, "result": {
                "protocolVersion": message["params"]["protocolVersion"], "capabilities": {"tools": {}},
                "serverInfo": {"name": "tiny", "version": "1"}}})  # fmt: skip
        elif method == "tools/list":
            send({"jsonrpc": "2.0", "id": request_id, "result": {"tools": TOOLS}})
        elif method == "tools/call":
            call(request_id, message["params"]["name"], message["params"].get("arguments") or {})
        elif request_id is not None:
            send({"jsonrpc": "2.0", "id": request_id, "error": {"code": -32601, "message": f"no method {method}"}})


if __name__ == "__main__":
    main()

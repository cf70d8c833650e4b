"""`riverbed schema`."""

from __future__ import annotations

import sys

import msgspec

from riverbed import events
from riverbed.cli.app import app
from riverbed.cli.output import json_bytes


@app.command("schema")
def schema_cmd() -> None:
    """JSON Schema of every event kind (for agents written in other languages)."""
    sys.stdout.buffer.write(msgspec.json.format(json_bytes(events.json_schema()), indent=2) + b"\n")

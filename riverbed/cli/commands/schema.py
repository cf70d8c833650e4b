"""`riverbed schema`."""

from __future__ import annotations

import json
import sys

from riverbed import events
from riverbed.cli.app import app


@app.command("schema")
def schema_cmd() -> None:
    """JSON Schema of every event kind (for agents written in other languages)."""
    sys.stdout.write(json.dumps(events.json_schema(), indent=2, sort_keys=True) + "\n")

"""The README's first HTTP call, run as a user would paste it (bash and curl) against a
private server: it makes its own session, so a session of the same name made earlier by the
CLI (with no tenant, which a tenant's key cannot see) is no trap."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import anyio
import pytest

from riverbed import events
from riverbed.client.session import Bus
from tests.kit.agents import runtime_worker
from tests.kit.cli import riverbed_command
from tests.kit.serve import running

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl (apt-get install curl)"),
]

README = Path(__file__).resolve().parent.parent / "README.md"


def http_block() -> list[str]:
    """The commands of the README's HTTP block, one a line (continuations joined, comments cut)."""
    text = README.read_text().split("<!-- run: tests/test_readme_http.py", 1)[1]
    body = text.split("```bash\n", 1)[1].split("\n```", 1)[0]
    joined = re.sub(r"\\\n\s*", "", body)
    return [re.sub(r"\s{2,}#.*$", "", line).strip() for line in joined.splitlines() if line.strip()]


def test_the_block_is_what_a_user_reads() -> None:
    lines = http_block()
    assert lines[:2] == ["riverbed serve &", "riverbed worker all &"]
    assert any(line.startswith("S=") for line in lines)  # its own session, not a fixed name
    assert all("/sessions/$S/" in line for line in lines if line.startswith("curl"))


async def test_the_readme_http_call_runs_on_a_fresh_session(
    bus: Bus, redis_url: str, prefix: str, workspace: Path
) -> None:
    # The trap the example used to fall in: `s1` made by the CLI, with no tenant.
    await bus.session("s1").append(events.Message(content="made by the CLI", source="user"))
    lines = http_block()
    async with running(bus) as base, runtime_worker(bus, workspace):
        # The test serves and runs the roles itself (a private server on a free port, a runtime role).
        script = [line.replace("localhost:8300", base.removeprefix("http://")) for line in lines[2:]]
        script = [f"{line} --max-time 3 || true" if " -sN " in line else line for line in script]
        riverbed = " ".join(shlex.quote(part) for part in riverbed_command())
        program = "\n".join(["set -e", f'riverbed() {{ {riverbed} "$@"; }}', *script, 'echo "session=$S"'])
        env = {k: v for k, v in os.environ.items() if not k.startswith("RIVERBED_")}
        env.update(RIVERBED_REDIS_URL=redis_url, RIVERBED_PREFIX=prefix)
        done = await anyio.to_thread.run_sync(
            lambda: subprocess.run(["bash", "-c", program], env=env, capture_output=True, timeout=90, check=False)
        )
    out = done.stdout.decode()
    assert done.returncode == 0, out + done.stderr.decode()
    session = re.search(r"^session=(\S+)$", out, flags=re.M)
    assert session is not None, out
    answer, _end = json.JSONDecoder().raw_decode(out)  # (curl prints it with no newline)
    assert answer["kind"] == "cmd_output", answer
    assert answer["exit_code"] == 0
    assert "Linux" in answer["content"]
    followed = [json.loads(line[5:]) for line in out[_end:].splitlines() if line.startswith("data:")]
    assert [e["kind"] for e in followed] == ["cmd_run", "cmd_output"]
    log = await bus.session(session.group(1)).events()
    assert {e.tenant for e in log} == {"acme"}  # the key's tenant's session

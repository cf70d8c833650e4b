"""A client in another language: the Node example drives a session through `riverbed serve`.

Everything is a real process: `riverbed serve`, a runtime worker, `riverbed keys`, and the
machine's `node` running examples/node-agent/agent.mjs with nothing but an API key.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.kit.serve import bearer, riverbed_command, serve_process
from tests.kit.workers import Spawn, spawn, workers  # noqa: F401  (fixtures)

AGENT = Path(__file__).parent.parent / "examples" / "node-agent" / "agent.mjs"


def keys(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*riverbed_command(), "keys", *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.skipif(shutil.which("node") is None, reason="needs the machine's node (Node.js 20+) on PATH")
def test_a_node_agent_with_only_a_key_runs_a_command_and_follows_the_log(
    cli_env: dict[str, str], spawn: Spawn, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    created = keys(cli_env, "create", "--tenant", "acme", "--json")
    assert created.returncode == 0, created.stderr
    acme = json.loads(created.stdout)
    assert acme["tenant"] == "acme"
    assert acme["key"].startswith("rbk_")
    other = json.loads(keys(cli_env, "create", "--tenant", "globex", "--json").stdout)["key"]

    spawn("node-w", ["runtime"], RIVERBED_SANDBOX="process").wait_ready()
    with serve_process(redis_url, prefix, tmp_path / "serve.log") as base:
        env = {"PATH": cli_env.get("PATH", ""), "RIVERBED_URL": base, "RIVERBED_KEY": acme["key"]}
        ran = subprocess.run(
            ["node", str(AGENT), "node-s", "echo hello from node; uname -s"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert ran.returncode == 0, ran.stderr + ran.stdout
        out = [json.loads(line) for line in ran.stdout.splitlines()]
        observation = next(o["observation"] for o in out if "observation" in o)
        assert observation["kind"] == "cmd_output"
        assert "hello from node" in observation["content"]
        assert "Linux" in observation["content"]
        done = next(o["done"] for o in out if "done" in o)
        # Followed live: the message, the action and its answer, in order, each once.
        assert done["followed"] == sorted(set(done["followed"]))
        assert {1, observation["cause"], observation["id"]} <= set(done["followed"])
        # Resumed after the last event seen: only the finish appended since.
        assert done["resumed"] == [max(done["followed"]) + 1]

        with httpx.Client(base_url=base, timeout=10) as http:
            theirs = http.get("/v1/sessions/node-s/events", headers=bearer(other))
            assert theirs.status_code == 404
            assert theirs.headers["content-type"] == "application/problem+json"
            mine = http.get("/v1/sessions/node-s/events", headers=bearer(acme["key"]))
            assert [json.loads(line)["tenant"] for line in mine.text.splitlines()] == ["acme"] * len(
                mine.text.splitlines()
            )
            listed = keys(cli_env, "list", "--json")
            ids = {json.loads(line)["tenant"]: json.loads(line)["id"] for line in listed.stdout.splitlines()}
            revoked = keys(cli_env, "revoke", ids["acme"])
            assert revoked.returncode == 0, revoked.stderr
            assert http.get("/v1/sessions", headers=bearer(acme["key"])).status_code == 401
        refused = subprocess.run(
            ["node", str(AGENT), "node-s"], env=env, capture_output=True, text=True, timeout=30, check=False
        )
        assert refused.returncode == 1
        assert "401" in refused.stderr
        assert "revoked" in refused.stderr


def test_keys_commands_explain_bad_input(cli_env: dict[str, str]) -> None:
    no_tenant = keys(cli_env, "create")
    assert no_tenant.returncode == 2
    assert "needs a tenant" in no_tenant.stderr
    bad = keys(cli_env, "create", "--tenant", "a b")
    assert bad.returncode == 2
    assert "not a valid tenant" in bad.stderr
    unknown = keys(cli_env, "revoke", "0123456789ab")
    assert unknown.returncode == 2
    assert "no API key" in unknown.stderr
    admin = keys(cli_env, "create", "--admin", "--json")
    assert json.loads(admin.stdout)["admin"] is True
    assert "Traceback" not in no_tenant.stderr + bad.stderr + unknown.stderr

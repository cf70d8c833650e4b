"""The operator commands as a user runs them: worker, act, status, view, fork, dlq, demo."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from riverbed.bus.keys import Keys
from tests.kit.cli import assert_one_sentence, ok, riverbed_command, run
from tests.kit.openai_server import OpenAIServer, tool_call
from tests.kit.workers import sync_client


@pytest.fixture
def worker(cli_env: dict[str, str], tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    env = {**cli_env, "RIVERBED_WORKSPACE": str(tmp_path / "ws"), "RIVERBED_LEASE_SECONDS": "2"}
    log = (tmp_path / "worker.log").open("wb")
    proc = subprocess.Popen(
        [*riverbed_command(), "worker", "runtime", "--name", "cli-w1"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    yield proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    log.close()


def test_act_view_fork_and_status_through_a_cli_worker(
    cli_env: dict[str, str], worker: subprocess.Popen[bytes], redis_url: str
) -> None:
    answer = json.loads(ok(cli_env, "act", "s1", '{"kind": "cmd_run", "command": "echo from-the-cli"}'))
    assert answer["kind"] == "cmd_output"
    assert answer["cause"] == 1
    assert "from-the-cli" in answer["content"]
    failed = json.loads(ok(cli_env, "act", "s1", '{"kind": "file_read", "path": "../../etc/passwd"}'))
    assert failed["kind"] == "error"  # an error observation is still an answer: exit 0

    view = [json.loads(line) for line in ok(cli_env, "view", "s1", "--json", "--until", "2").splitlines()]
    assert [e["id"] for e in view] == [1, 2]

    run(cli_env, "fork", "s1", "--at", "2", "--into", "s1-fork").check_returncode()
    fork_log = [json.loads(line) for line in ok(cli_env, "log", "s1-fork", "--json").splitlines()]
    assert [e["kind"] for e in fork_log] == ["cmd_run", "cmd_output", "forked", "sandbox_rebuilt"]
    assert fork_log[2]["source_session"] == "s1"

    status = json.loads(ok(cli_env, "status", "--json"))
    runtime = next(r for r in status["roles"] if r["role"] == "runtime")
    assert {s["session"] for s in runtime["sessions"]} >= {"s1", "s1-fork"}
    assert any(w["name"] == "cli-w1" for w in status["workers"])
    assert worker.poll() is None


def test_tenant_applies_to_every_event_a_command_appends(
    cli_env: dict[str, str], worker: subprocess.Popen[bytes]
) -> None:
    batch = '[{"kind": "message", "content": "hi", "source": "user"}, {"kind": "think", "thought": "hm"}]'
    ok(cli_env, "append", "t1", batch, "--tenant", "acme")
    ok(cli_env, "act", "t1", '{"kind": "cmd_run", "command": "echo tenanted"}', "--tenant", "acme")
    ok(cli_env, "act", "t1", '{"kind": "finish", "final_thought": "done"}', "--tenant", "acme")
    log = [json.loads(line) for line in ok(cli_env, "log", "t1", "--json").splitlines()]
    assert [e["kind"] for e in log] == ["message", "think", "cmd_run", "cmd_output", "finish"]
    assert {e["tenant"] for e in log} == {"acme"}


def test_act_refuses_bad_input_in_one_sentence(cli_env: dict[str, str]) -> None:
    assert_one_sentence(run(cli_env, "act", "s1", "{not json"), 2, "not valid JSON")
    assert_one_sentence(run(cli_env, "act", "s1", '{"kind": "cmd_output", "content": "x"}'), 2, "not an action")
    assert_one_sentence(run(cli_env, "act", "s1", '{"kind": "nope"}'), 2, "unknown event kind")
    timed_out = run(cli_env, "act", "nobody-home", '{"kind": "file_read", "path": "x"}', "--timeout", "0.5")
    assert_one_sentence(timed_out, 1, "no observation answered action 1")
    assert b"it stays on the log and runs when a worker for its role takes the session" in timed_out.stderr


def test_worker_with_an_unknown_role_fails_in_one_sentence(offline_env: dict[str, str]) -> None:
    assert_one_sentence(run(offline_env, "worker", "janitor"), 2, "unknown role 'janitor'")


def test_dlq_list_and_requeue(cli_env: dict[str, str], redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    client = sync_client(redis_url)
    try:
        client.xadd(
            keys.dlq,
            {
                "session": "s9",
                "event_id": 4,
                "role": "runtime",
                "reason": "failed too many times",
                "attempts": 3,
                "ts": 1.0,
                "payload": b"\x81\xa4kind\xa5think",
            },
        )
    finally:
        client.close()
    letters = [json.loads(line) for line in ok(cli_env, "dlq", "list", "--json").splitlines()]
    assert [(letter["session"], letter["event_id"], letter["reason"]) for letter in letters] == [
        ("s9", 4, "failed too many times")
    ]
    requeued = run(cli_env, "dlq", "requeue", letters[0]["id"])
    assert requeued.returncode == 0, requeued.stderr.decode()
    assert b"as event 1" in requeued.stderr
    assert ok(cli_env, "dlq", "list", "--json") == b""
    assert_one_sentence(run(cli_env, "dlq", "requeue", "1-1"), 2, "no dead letter")


@pytest.mark.slow
def test_demo_runs_on_embedded_services_and_exits_zero(offline_env: dict[str, str], tmp_path: Path) -> None:
    env = {k: v for k, v in offline_env.items() if k not in ("RIVERBED_REDIS_URL",)}
    env["RIVERBED_SERVICES_DIR"] = str(Path("/tmp") / f"rb-demo-{tmp_path.name}")
    env["RIVERBED_WORKSPACE"] = str(tmp_path / "ws")
    try:
        result = run(env, "demo", timeout=120)
        out = result.stdout.decode()
        assert result.returncode == 0, out + result.stderr.decode()
        assert "recall finds a condensed-away event" in out
        assert "✘" not in out
        # Each observation shows its own output, not its command again.
        assert "hello, riverbed" in out  # what `python3 greet.py` printed
        assert "→ 42" in out  # the cell's value
        assert "demo: hello from riverbed from app" in out
        assert not any(line.count("python3 greet.py") > 0 and "cmd_output" in line for line in out.splitlines())
        # It ends by saying how to look at the session and how to stop what it started, with a
        # command that works in the user's shell (this venv is not on its PATH).
        assert "riverbed log demo-" in out
        assert "workspace None" not in out
        look = next(line.strip() for line in out.splitlines() if "log demo-" in line and "every event" in line)
        shell = subprocess.run(
            look.removesuffix("every event").strip(), shell=True, env=env, capture_output=True, timeout=60, check=False
        )
        assert shell.returncode == 0, shell.stderr.decode()
        assert b"message" in shell.stdout
        assert f"riverbed services down --dir {env['RIVERBED_SERVICES_DIR']}" in out
    finally:
        run(env, "services", "down", "--dir", env["RIVERBED_SERVICES_DIR"])


@pytest.mark.slow
def test_demo_with_a_model_configured_runs_the_llm_agent(offline_env: dict[str, str], tmp_path: Path) -> None:
    """With a model server configured, the demo also runs the reference LLM agent on a small
    task: here against the scripted OpenAI-compatible server, which runs a command, then finishes."""

    def answer(body: dict[str, Any]) -> dict[str, Any]:
        if not body.get("tools"):
            return {"content": "a summary"}  # an LLM condenser's request
        if any(m.get("role") == "tool" for m in body.get("messages", [])):
            return {"tool_calls": [tool_call("finish", {"final_thought": "done"})]}
        return {"tool_calls": [tool_call("cmd_run", {"command": "echo riverbed > hello.txt && cat hello.txt"})]}

    env = {k: v for k, v in offline_env.items() if k not in ("RIVERBED_REDIS_URL",)}
    env["RIVERBED_SERVICES_DIR"] = str(Path("/tmp") / f"rb-demo-{tmp_path.name}")
    env["RIVERBED_WORKSPACE"] = str(tmp_path / "ws")
    with OpenAIServer(model="test-model") as server:
        server.respond(answer, times=50)
        env.update(OPENAI_BASE_URL=server.base_url, OPENAI_API_KEY="test-key", RIVERBED_LLM_MODEL="test-model")
        try:
            result = run(env, "demo", timeout=180)
        finally:
            run(env, "services", "down", "--dir", env["RIVERBED_SERVICES_DIR"])
        out = result.stdout.decode()
        assert result.returncode == 0, out + result.stderr.decode()
        assert "the LLM agent (test-model) on a small task" in out
        assert "LLM agent ran to finish or its step limit" in out
        assert "✘" not in out
        agent_requests = [r for r in server.requests if r.get("tools")]
        assert len(agent_requests) >= 2  # the command, then finish
        assert server.unexpected == 0

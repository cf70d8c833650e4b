"""``riverbed agent``: the reference LLM agent from the command line, against the scripted
OpenAI-compatible server (a thread of this process) and the test Redis and Postgres."""

from __future__ import annotations

import json
from pathlib import Path

from tests.kit.cli import agent_env, assert_one_sentence, ok, run  # noqa: F401  (agent_env: a fixture)
from tests.kit.openai_server import OpenAIServer, server  # noqa: F401  (server: a fixture)


def kinds(env: dict[str, str], session: str) -> list[str]:
    return [json.loads(line)["kind"] for line in ok(env, "log", session, "--json").splitlines()]


def test_agent_runs_in_process_prints_progress_and_exits_zero_on_finish(
    agent_env: dict[str, str], server: OpenAIServer
) -> None:
    server.reply(tool_calls=[("cmd_run", {"command": "echo made-by-the-agent"})])
    server.reply(tool_calls=[("finish", {"final_thought": "done"})])
    result = run(agent_env, "agent", "a1", "say something", "--in-process", timeout=120)
    out, err = result.stdout.decode(), result.stderr.decode()
    assert result.returncode == 0, out + err
    # One line per event, as `riverbed log` prints them, in order.
    lines = out.splitlines()
    assert any("cmd_run" in line and "echo made-by-the-agent" in line for line in lines)
    assert any("cmd_output" in line and "made-by-the-agent" in line for line in lines)
    assert "finish" in lines[-1]
    assert "agent ended by finish after 2 model calls" in err
    assert "cached" in err
    assert server.unexpected == 0
    assert [r["model"] for r in server.requests] == ["test-model", "test-model"]
    log_kinds = kinds(agent_env, "a1")
    assert log_kinds[0] == "message"
    assert log_kinds.count("llm_response") == 2
    assert log_kinds[-1] == "finish"


def test_agent_stops_at_its_step_limit_with_exit_zero_and_takes_the_model_flag(
    agent_env: dict[str, str], server: OpenAIServer
) -> None:
    server.reply(tool_calls=[("cmd_run", {"command": "true"})])
    result = run(agent_env, "agent", "a2", "loop", "--in-process", "--max-steps", "1", "--model", "other", timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    assert "step_limit" in result.stdout.decode()
    assert "agent ended by error (step_limit) after 1 model call:" in result.stderr.decode()
    assert [r["model"] for r in server.requests] == ["other"]


def test_a_model_failure_is_one_sentence_and_exit_one(agent_env: dict[str, str], server: OpenAIServer) -> None:
    server.fail(400, "bad request from the test")
    result = run(agent_env, "agent", "a3", "fail", "--in-process", timeout=120)
    assert result.returncode == 1
    assert "riverbed: the agent stopped: the model call failed (HTTP 400" in result.stderr.decode()
    assert "Traceback" not in result.stderr.decode()


def test_no_model_server_configured_or_reachable_is_one_sentence(offline_env: dict[str, str]) -> None:
    env = {k: v for k, v in offline_env.items() if not k.startswith("OPENAI_")}
    assert_one_sentence(run(env, "agent", "a4", "task"), 2, "OPENAI_API_KEY")
    env["OPENAI_BASE_URL"] = "http://127.0.0.1:1/v1"
    assert_one_sentence(run(env, "agent", "a4", "task"), 1, "cannot reach the model server at http://127.0.0.1:1/v1")


def test_without_workers_or_in_process_it_says_so(agent_env: dict[str, str], server: OpenAIServer) -> None:
    assert_one_sentence(run(agent_env, "agent", "a5", "task"), 1, "no runtime worker is running", "--in-process")
    assert server.requests == []


def test_a_vision_model_gets_the_task_image_from_the_workspace_and_others_do_not(
    agent_env: dict[str, str], server: OpenAIServer, tmp_path: Path
) -> None:
    from riverbed.runtime.paths import workspace_name  # noqa: PLC0415
    from tests.kit.images import PNG  # noqa: PLC0415

    for session in ("v1", "v2"):
        root = tmp_path / "ws" / workspace_name(session)
        root.mkdir(parents=True)
        (root / "shot.png").write_bytes(PNG)
    server.reply(tool_calls=[("finish", {"final_thought": "a pixel"})])
    seeing = {**agent_env, "RIVERBED_LLM_VISION": "test-model"}
    result = run(seeing, "agent", "v1", "what is this?", "--image", "shot.png", "--in-process", timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    task = next(m for m in server.requests[-1]["messages"] if m["role"] == "user")
    assert task["content"][0] == {"type": "text", "text": "what is this?"}
    assert task["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")

    server.reply(tool_calls=[("finish", {"final_thought": "cannot see"})])
    result = run(agent_env, "agent", "v2", "what is this?", "--image", "shot.png", "--in-process", timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    task = next(m for m in server.requests[-1]["messages"] if m["role"] == "user")
    assert task["content"] == "what is this?\n[images not shown to this model: shot.png]"


def test_bad_run_options_are_one_sentence(offline_env: dict[str, str]) -> None:
    cases = [
        (["agent", "b1"], "TASK"),
        (["agent", "b1", "task", "--cancel"], "--cancel takes no task"),
        (["agent", "b1", "task", "--in-process", "--detach"], "--detach"),
        (["agent", "b1", "task", "--image", "x.png", "--detach"], "--image"),
        (["agent", "b1", "task", "--detach", "--max-cost", "0"], "--max-cost"),
        (["runs", "--state", "sleeping"], "unknown run state"),
    ]
    for args, fragment in cases:
        assert_one_sentence(run(offline_env, *args), 2, fragment)

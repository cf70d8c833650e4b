"""The model's settings as a user meets them: every request carries the answer's length limit
(``max_tokens``) and the temperature, from ``RIVERBED_LLM_*`` or ``riverbed agent``'s flags
(recorded on a run, so the agent role uses them), and a model that takes longer than
``RIVERBED_LLM_TIMEOUT`` ends the run with one sentence naming that setting.

Against the scripted OpenAI-compatible server (a thread of this process), through the real
``openai`` client; the llama.cpp server's side of it is in ``tests/test_local_model.py``."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from riverbed import events
from riverbed.agent.hosted import RunLimits, follow_run, open_run
from riverbed.agent.llm import AgentOptions, model_parameters, run_llm_agent
from riverbed.client.session import Bus
from riverbed.runtime import Runtime
from riverbed.settings import Settings
from riverbed.workers.agent_role import AgentHandler
from riverbed.workers.runtime_role import RuntimeHandler
from tests.kit.agents import (
    owners,
    workers,  # noqa: F401  (fixtures)
)
from tests.kit.cli import agent_env, assert_one_sentence, run  # noqa: F401  (agent_env: a fixture)
from tests.kit.openai_server import OpenAIServer, server  # noqa: F401  (server: a fixture)

pytestmark = pytest.mark.anyio


def test_the_request_parameters_are_sent_only_when_set() -> None:
    assert model_parameters(None, 0) == {}
    assert model_parameters(0.0, 512) == {"temperature": 0.0, "max_tokens": 512}


def test_the_settings_have_defaults_and_bounds() -> None:
    settings = Settings.from_env({})
    assert (settings.llm_timeout, settings.llm_max_output_tokens, settings.llm_temperature) == (120.0, 4096, None)
    settings = Settings.from_env(
        {"RIVERBED_LLM_TIMEOUT": "600", "RIVERBED_LLM_MAX_OUTPUT_TOKENS": "0", "RIVERBED_LLM_TEMPERATURE": "0.2"}
    )
    assert (settings.llm_timeout, settings.llm_max_output_tokens, settings.llm_temperature) == (600.0, 0, 0.2)
    from riverbed.errors import ConfigError  # noqa: PLC0415

    for variable, value in (("RIVERBED_LLM_TEMPERATURE", "3"), ("RIVERBED_LLM_TIMEOUT", "0")):
        with pytest.raises(ConfigError, match=variable):
            Settings.from_env({variable: value})


def test_the_agent_flags_reach_every_request(agent_env: dict[str, str], server: OpenAIServer) -> None:
    server.reply(tool_calls=[("cmd_run", {"command": "true"})])
    server.reply(tool_calls=[("finish", {"final_thought": "done"})])
    result = run(
        agent_env, "agent", "f1", "do it", "--in-process", "--max-output-tokens", "77", "--temperature", "0.25",
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()
    assert [(r["max_tokens"], r["temperature"]) for r in server.requests] == [(77, 0.25), (77, 0.25)]

    # Without flags: the settings (a length limit by default; the server's own temperature).
    server.reply(tool_calls=[("finish", {"final_thought": "done"})])
    result = run({**agent_env, "RIVERBED_LLM_MAX_OUTPUT_TOKENS": "300"}, "agent", "f2", "do it", "--in-process",
                 timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()
    assert server.requests[-1]["max_tokens"] == 300
    assert "temperature" not in server.requests[-1]


def test_a_slow_model_ends_the_run_with_one_sentence_naming_the_setting(
    agent_env: dict[str, str], server: OpenAIServer
) -> None:
    server.reply(tool_calls=[("finish", {"final_thought": "too late"})], delay=4)
    once = {**agent_env, "RIVERBED_AGENT_LLM_RETRY_SECONDS": "0"}  # (no retry: the one answer is late)
    result = run(once, "agent", "t1", "do it", "--in-process", "--llm-timeout", "1", timeout=120)
    err = result.stderr.decode()
    assert result.returncode == 1, err
    assert "Traceback" not in err
    assert "riverbed: the agent stopped: the model did not answer within 1 s: RIVERBED_LLM_TIMEOUT" in err
    # No raw log line of the agent's (once one with an empty `error=`): the summary and the sentence.
    assert not [line for line in err.splitlines() if '"event":"agent.' in line or "llm_failed" in line], err
    assert err.strip().splitlines()[-2].startswith("agent ended by error (llm_error)"), err


def test_bad_model_flags_are_one_sentence(offline_env: dict[str, str]) -> None:
    assert_one_sentence(run(offline_env, "agent", "b1", "task", "--temperature", "3"), 2, "--temperature", "at most 2")
    assert_one_sentence(run(offline_env, "agent", "b1", "task", "--llm-timeout", "0"), 2, "--llm-timeout")
    assert_one_sentence(run(offline_env, "agent", "b1", "task", "--max-output-tokens", "-1"), 2, "--max-output-tokens")


async def _run_to_end(bus: Bus, session: str, limits: RunLimits) -> list[events.Event]:
    opened = await open_run(bus, session, "do it", limits=limits)
    with anyio.fail_after(30):
        return [event async for event in follow_run(bus, session, opened.task)]


async def test_the_agent_role_sends_its_settings_or_the_runs(bus: Bus, workspace: Path, server: OpenAIServer) -> None:
    runtime = Runtime(workspace_root=workspace)
    agent = AgentHandler(
        client=server.client(), model="test-model", retry_seconds=0, temperature=0.7, max_output_tokens=900,
        llm_timeout=30,
    )  # fmt: skip
    try:
        async with owners(bus, [RuntimeHandler(runtime), agent]):
            server.reply(tool_calls=[("finish", {"final_thought": "done"})])
            await _run_to_end(bus, "r1", RunLimits(max_steps=2))
            assert (server.requests[-1]["temperature"], server.requests[-1]["max_tokens"]) == (0.7, 900)

            server.reply(tool_calls=[("finish", {"final_thought": "done"})])
            await _run_to_end(bus, "r2", RunLimits(max_steps=2, temperature=0.0, max_output_tokens=64))
            assert (server.requests[-1]["temperature"], server.requests[-1]["max_tokens"]) == (0.0, 64)

            server.reply(tool_calls=[("finish", {"final_thought": "too late"})], delay=3)
            seen = await _run_to_end(bus, "r3", RunLimits(max_steps=2, llm_timeout=0.5))
    finally:
        with anyio.CancelScope(shield=True):
            await runtime.aclose()
            await agent.aclose()
    end = seen[-1]
    assert isinstance(end, events.Error)
    assert end.reason == "llm_error"
    assert end.content.startswith("the model did not answer within 0.5 s: RIVERBED_LLM_TIMEOUT"), end.content


async def test_the_in_process_loop_uses_the_settings(
    bus: Bus,
    server: OpenAIServer,
    workers: None,
) -> None:
    settings = Settings(
        llm_model="test-model", llm_temperature=0.1, llm_max_output_tokens=128, llm_timeout=0.5,
        agent_llm_retry_seconds=0,
    )  # fmt: skip
    server.reply(tool_calls=[("finish", {"final_thought": "done"})])
    options = AgentOptions(recall_timeout=15)
    ended = await run_llm_agent(bus, "p1", "do it", settings=settings, client=server.client(), options=options)
    assert isinstance(ended, events.Finish)
    assert (server.requests[-1]["temperature"], server.requests[-1]["max_tokens"]) == (0.1, 128)
    server.reply(tool_calls=[("finish", {"final_thought": "too late"})], delay=3)
    ended = await run_llm_agent(bus, "p1", "again", settings=settings, client=server.client(), options=options)
    assert isinstance(ended, events.Error)
    assert ended.reason == "llm_error"
    assert "within 0.5 s: RIVERBED_LLM_TIMEOUT" in ended.content

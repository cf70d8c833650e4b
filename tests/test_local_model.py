"""The reference agent against a real local OpenAI-compatible server: llama-cpp-python's,
started by the test on a tiny random-weight GGUF model the test writes (tests/tinyllm.py).

Assertions are on the protocol only, never on what the model says: every request is
accepted by the server's own schema (the assistant tool-call message with empty content,
tool results, the tool schemas), the run ends by ``finish``, a message for the user or its
step limit, and the events are recorded.

The server runs in an interpreter of its own: ``$RIVERBED_TEST_LLAMA_PYTHON`` (``.ci/run``
builds ``.venv-llama`` with ``llama-cpp-python[server]`` and ``gguf``, about 4 minutes on 2
cores, and points the variable at it), else this interpreter when it has both.  Its extras
(FastAPI, OpenTelemetry) stay out of the project's own environment.  Skipped when neither has them.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from riverbed import events
from riverbed.agent.hosted import RunLimits, follow_run, list_runs, open_run
from riverbed.agent.llm import AgentOptions
from riverbed.client.session import Bus
from riverbed.settings import Settings
from riverbed.workers.agent_run import run_llm_agent
from tests.kit.agents import roles, workers  # noqa: F401  (fixtures)
from tests.kit.workers import WorkerProcess

TINYLLM = Path(__file__).with_name("tinyllm.py")  # run by the server's interpreter, which has gguf

# Looked up, not imported: the server runs in its own process (importing llama_cpp here
# would load its native library into the test process for nothing).
_LLAMA_PYTHON = os.environ.get("RIVERBED_TEST_LLAMA_PYTHON") or (
    sys.executable
    if all(importlib.util.find_spec(name) is not None for name in ("llama_cpp", "uvicorn", "fastapi", "gguf"))
    else None
)

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.slow,
    pytest.mark.skipif(
        _LLAMA_PYTHON is None,
        reason="llama-cpp-python[server] and gguf are needed: set RIVERBED_TEST_LLAMA_PYTHON (.ci/run builds one)",
    ),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("llama")
    assert _LLAMA_PYTHON is not None
    model = root / "tiny.gguf"
    subprocess.run([_LLAMA_PYTHON, str(TINYLLM), str(model)], check=True, timeout=120)
    port = _free_port()
    log = (root / "server.log").open("wb")
    proc = subprocess.Popen(
        [_LLAMA_PYTHON, "-m", "llama_cpp.server", "--model", str(model), "--model_alias", "tiny",
         "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "8192"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (root / "server.log").read_text()
            assert time.monotonic() < deadline, "the llama-cpp server did not start within 60 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()


async def test_the_agent_runs_steps_against_a_real_local_server(bus: Bus, llama_server: str, workers: None) -> None:
    settings = Settings(llm_model="tiny", openai_base_url=llama_server, openai_api_key="unused")
    session = bus.session("local", agent="llm")
    # An earlier exchange with a tool call, so the very first request carries an assistant
    # tool-call message (empty content) and its tool result, which strict servers check.
    (response_id,) = await session.append(
        events.LlmResponse(
            model="tiny",
            content=None,
            tool_calls=[{"id": "call_a", "type": "function",
                         "function": {"name": "cmd_run", "arguments": '{"command": "echo hi"}'}}],
        )
    )  # fmt: skip
    await session.act(events.CmdRun(command="echo hi", cause=response_id, tool_call_id="call_a"), timeout=30)
    options = AgentOptions(llm_timeout=120, action_timeout=30, recall_timeout=15, temperature=0.0)
    ended = [
        await run_llm_agent(bus, "local", task, settings=settings, max_steps=2, options=options)
        for task in ("Say hello.", "Now say goodbye.")
    ]
    log = await session.events()
    errors = [e for e in log if isinstance(e, events.Error) and e.reason == "llm_error"]
    assert not errors, errors[0].content
    for end in ended:
        assert end is not None
        assert isinstance(end, events.Finish | events.Message) or (
            isinstance(end, events.Error) and end.reason == "step_limit"
        )
    responses = [e for e in log if isinstance(e, events.LlmResponse)]
    assert len(responses) >= 3  # the seeded one and at least one per run
    assert all(r.usage.get("prompt_tokens", 0) > 0 for r in responses[1:])


async def test_the_model_settings_reach_a_real_local_server(bus: Bus, llama_server: str, workers: None) -> None:
    """``RIVERBED_LLM_MAX_OUTPUT_TOKENS`` bounds every answer (a small model that rambles, or a
    tool call's arguments that never end, stops there), and ``RIVERBED_LLM_TEMPERATURE`` is
    accepted; ``RIVERBED_LLM_TIMEOUT`` ends a run with one sentence naming it."""
    settings = Settings(
        llm_model="tiny", openai_base_url=llama_server, openai_api_key="unused",
        llm_max_output_tokens=6, llm_temperature=0.2, llm_timeout=120,
    )  # fmt: skip
    options = AgentOptions(action_timeout=30, recall_timeout=15)
    await run_llm_agent(bus, "bounded", "Write a very long story.", settings=settings, max_steps=2, options=options)
    log = await bus.session("bounded").events()
    errors = [e for e in log if isinstance(e, events.Error) and e.reason == "llm_error"]
    assert not errors, errors[0].content
    responses = [e for e in log if isinstance(e, events.LlmResponse)]
    assert responses
    # llama.cpp completes a UTF-8 character it began (this byte-level model's tokens are bytes):
    # at most three tokens past the limit, where a rambling answer would run on to the timeout.
    assert all(0 < r.usage.get("completion_tokens", 0) <= 6 + 3 for r in responses), [r.usage for r in responses]

    hurried = Settings(  # (no retry: the first late answer ends the run, saying so)
        llm_model="tiny", openai_base_url=llama_server, openai_api_key="unused", llm_timeout=0.001,
        llm_max_output_tokens=6, agent_llm_retry_seconds=0,
    )  # fmt: skip
    ended = await run_llm_agent(bus, "hurried", "Say hello.", settings=hurried, max_steps=1, options=options)
    assert isinstance(ended, events.Error)
    assert ended.reason == "llm_error"
    assert ended.content.startswith("the model did not answer within 0.001 s: RIVERBED_LLM_TIMEOUT"), ended.content


async def test_a_detached_run_ends_through_the_agent_role(
    bus: Bus, llama_server: str, redis_url: str, prefix: str, workspace: Path, tmp_path: Path
) -> None:
    """``riverbed agent --detach``'s records, served by real runtime and agent worker processes."""
    worker = WorkerProcess(
        ["runtime", "agent"],
        name="w-llama",
        redis_url=redis_url,
        prefix=prefix,
        workspace=workspace,
        lease=5.0,
        log_dir=tmp_path,
        extra_env={
            "OPENAI_BASE_URL": llama_server,
            "OPENAI_API_KEY": "unused",
            "RIVERBED_LLM_MODEL": "tiny",
            "RIVERBED_SANDBOX": "process",
            "RIVERBED_LLM_TIMEOUT": "120",
            "RIVERBED_LLM_MAX_OUTPUT_TOKENS": "32",
        },
    )
    try:
        await anyio.to_thread.run_sync(worker.wait_ready)
        opened = await open_run(bus, "detached", "Say hello.", limits=RunLimits(max_steps=2))
        with anyio.fail_after(300):
            seen = [event async for event in follow_run(bus, "detached", opened.task)]
        with anyio.fail_after(30):  # the role rewrites the run's summary just after its last event
            while (row := (await list_runs(bus))[0]).state in ("running", "waiting"):
                await anyio.sleep(0.05)
    finally:
        worker.close()
    end = seen[-1]
    assert not (isinstance(end, events.Error) and end.reason == "llm_error"), end
    assert isinstance(end, events.Finish) or (isinstance(end, events.Error) and end.reason == "step_limit"), end
    responses = [e for e in seen if isinstance(e, events.LlmResponse)]
    assert 1 <= len(responses) <= 2
    assert all(r.usage.get("prompt_tokens", 0) > 0 for r in responses)
    assert (row.session, row.steps) == ("detached", len(responses))
    assert row.state in ("finished", "failed")

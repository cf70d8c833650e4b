"""The model's context window (``riverbed/agent/window.py``): read from the server or the
settings, kept by the condenser's token budget; a context-length error that still comes back
gets one condensation and one retry, then the run ends naming the window.  The runs go through
real agent and condenser worker processes against the scripted server with a window."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx2
import openai
import pytest

from riverbed import events
from riverbed.agent.hosted import RunLimits, follow_run, open_run
from riverbed.agent.window import exceeds_context, fit_condenser, prompt_overhead, read_window, window_in
from riverbed.client.session import Bus
from riverbed.errors import ConfigError
from riverbed.workers.model_client import CheckedClient
from tests.kit.openai_server import OpenAIServer
from tests.kit.workers import Spawn, ready, spawn, workers  # noqa: F401  (fixtures)

pytestmark = pytest.mark.anyio

TINYLLM = Path(__file__).with_name("tinyllm.py")
LLAMA_PYTHON = os.environ.get("RIVERBED_TEST_LLAMA_PYTHON") or (
    sys.executable
    if all(importlib.util.find_spec(name) is not None for name in ("llama_cpp", "uvicorn", "fastapi", "gguf"))
    else None
)

LLAMA_CPP_PYTHON = (  # what llama-cpp-python's server 0.3.x answers (its errors.py)
    "This model's maximum context length is 8192 tokens. However, you requested 9011 tokens "
    "(8011 in the messages, 1000 in the completion). Please reduce the length of the messages or completion."
)


def bad_request(message: str, body: dict[str, Any] | None = None) -> openai.BadRequestError:
    request = httpx2.Request("POST", "http://model/v1/chat/completions")
    response = httpx2.Response(400, request=request, json={"error": body or {"message": message}})
    return openai.BadRequestError(message, response=response, body=body)


def test_context_length_errors_are_recognised_and_name_their_window() -> None:
    llama_python = bad_request(LLAMA_CPP_PYTHON, {"message": LLAMA_CPP_PYTHON, "code": "context_length_exceeded"})
    assert exceeds_context(llama_python)
    assert window_in(llama_python) == 8192
    llama_cpp = bad_request(
        "the request exceeds the available context size, try increasing it",
        {"type": "exceed_context_size_error", "n_prompt_tokens": 9000, "n_ctx": 4096},
    )
    assert exceeds_context(llama_cpp)
    assert window_in(llama_cpp) == 4096
    assert not exceeds_context(bad_request("'messages' is a required property"))
    assert not exceeds_context(openai.APIConnectionError(request=httpx2.Request("POST", "http://model")))


async def test_the_window_is_read_where_the_server_reports_it() -> None:
    with OpenAIServer(window=4096, reports=True) as llama_cpp:
        assert await read_window(llama_cpp.base_url) == 4096
    with OpenAIServer(window=4096) as silent:  # (llama-cpp-python's server reports none)
        assert await read_window(silent.base_url) is None
    with OpenAIServer() as gone:
        url = gone.base_url
    assert await read_window(url) is None


def test_the_condensers_budget_leaves_room_for_the_answer_and_the_tools() -> None:
    fitted = fit_condenser({"strategy": "amortized", "max_events": 100}, 8192, 1000)
    assert fitted["budget_tokens"] == 8192
    assert fitted["headroom_tokens"] == 1000 + prompt_overhead() + 819
    assert fit_condenser({"budget_tokens": 2000}, 8192, 1000) == {"budget_tokens": 2000}  # (tighter already)
    with pytest.raises(ConfigError, match="context window of 2048 tokens leaves no room") as small:
        fit_condenser({}, 2048, 4096)
    assert "RIVERBED_LLM_MAX_OUTPUT_TOKENS" in str(small.value)


def thought(step: int, chars: int) -> str:
    """Text the condenser's estimate and the server count alike (hex: four characters a token)."""
    text = "".join(hashlib.sha256(f"{step}:{i}".encode()).hexdigest() for i in range(chars // 64 + 1))
    return text[:chars]


def thinking(steps: int, chars: int) -> Any:
    """A model that thinks ``chars`` characters a step, ``steps`` times, then finishes."""

    answered: list[int] = []  # (counted here: the prompt forgets the older steps)

    def answer(_request: dict[str, Any]) -> dict[str, Any]:
        done = len(answered)
        answered.append(done)
        if done >= steps:
            return {"tool_calls": [("finish", {"final_thought": "done"})]}
        return {"tool_calls": [("think", {"thought": thought(done, chars)})]}

    return answer


@pytest.fixture
def model(request: pytest.FixtureRequest) -> Iterator[OpenAIServer]:
    window, reports = request.param
    with OpenAIServer(window=window, reports=reports) as server:
        yield server


def env(server: OpenAIServer, **more: str) -> dict[str, str]:
    return {
        "OPENAI_BASE_URL": server.base_url,
        "OPENAI_API_KEY": "test-key",
        "RIVERBED_LLM_MODEL": "test-model",
        "RIVERBED_LLM_MAX_OUTPUT_TOKENS": "200",
        "RIVERBED_AGENT_LLM_RETRY_SECONDS": "5",
        **more,
    }


async def run_to_end(bus: Bus, session: str, task: str, steps: int) -> list[events.Event]:
    opened = await open_run(bus, session, task, limits=RunLimits(max_steps=steps))
    with anyio.fail_after(90):
        return [event async for event in follow_run(bus, session, opened.task)]


WINDOW = prompt_overhead() + 3000


@pytest.mark.parametrize("model", [(WINDOW, False)], indirect=True)
async def test_a_prompt_over_the_window_is_condensed_once_and_asked_again(
    bus: Bus, spawn: Spawn, model: OpenAIServer
) -> None:
    # The server's window is known to nobody (llama-cpp-python's says nothing): every ~5 steps the
    # prompt outgrows it, the server says so, and the step asks the condenser, then the model again.
    model.respond(thinking(12, 2000), times=100)
    await ready(spawn("w-window", ["agent", "condenser"], **env(model)))
    seen = await run_to_end(bus, "s-window", "think a lot", steps=20)
    assert isinstance(seen[-1], events.Finish), seen[-1]
    asked = [e for e in seen if isinstance(e, events.CondensationRequest)]
    assert asked
    assert all(a.source == "agent" for a in asked)
    assert model.context_errors == len(asked)  # one condensation for each refusal, and it was enough
    by_cause = {e.cause: e for e in seen if isinstance(e, events.Condensation)}
    for request in asked:
        answer = by_cause[request.id]
        assert answer.forgotten  # the history was condensed...
        after = [e for e in seen if isinstance(e, events.LlmResponse) and (e.id or 0) > (answer.id or 0)]
        assert after  # ...and the model asked again with it
    assert model.unexpected == 0


@pytest.mark.parametrize("model", [(WINDOW, False)], indirect=True)
async def test_a_prompt_that_never_fits_ends_the_run_naming_the_window(
    bus: Bus, spawn: Spawn, model: OpenAIServer
) -> None:
    model.respond(thinking(1, 10), times=10)
    await ready(spawn("w-window-end", ["agent", "condenser"], **env(model)))
    task = "read this: " + thought(0, 4 * WINDOW)  # (a task is never forgotten)
    seen = await run_to_end(bus, "s-window-end", task, steps=5)
    end = seen[-1]
    assert isinstance(end, events.Error)
    assert end.reason == "llm_error"
    assert f"context window of {WINDOW} tokens" in end.content
    assert "RIVERBED_LLM_CONTEXT_TOKENS" in end.content
    assert len([e for e in seen if isinstance(e, events.CondensationRequest)]) == 1
    assert len(model.requests) == 2  # the call, and its one retry after the condensation


@pytest.mark.parametrize("model", [(None, False)], indirect=True)
async def test_with_no_condenser_worker_a_prompt_over_the_budget_goes_out_whole(
    bus: Bus, spawn: Spawn, model: OpenAIServer
) -> None:
    # The condenser keeps 10 events, which the history outgrows by step 4; no worker serves the
    # condenser role, so no step asks it (and waits a minute for nobody): the model reads the
    # whole history.
    model.respond(thinking(8, 200), times=100)
    await ready(spawn("w-uncondensed", ["agent"], **env(model, RIVERBED_CONDENSER_MAX_EVENTS="10")))
    seen = await run_to_end(bus, "s-uncondensed", "think a lot", steps=10)
    assert isinstance(seen[-1], events.Finish), seen[-1]
    assert len(seen) > 10  # (over the budget: the condenser would have kept 10)
    assert not [e for e in seen if isinstance(e, (events.CondensationRequest, events.Condensation))]
    last = json.dumps(model.last_request)
    assert all(thought(step, 200) in last for step in range(8))


@pytest.mark.parametrize("model", [(WINDOW, False)], indirect=True)
async def test_with_no_condenser_worker_a_prompt_that_does_not_fit_ends_the_run_at_once(
    bus: Bus, spawn: Spawn, model: OpenAIServer
) -> None:
    model.respond(thinking(1, 10), times=10)
    await ready(spawn("w-window-alone", ["agent"], **env(model)))
    seen = await run_to_end(bus, "s-window-alone", "read this: " + thought(0, 4 * WINDOW), steps=5)
    end = seen[-1]
    assert isinstance(end, events.Error)
    assert end.reason == "llm_error"
    assert "no condenser worker runs" in end.content, end.content
    assert not [e for e in seen if isinstance(e, events.CondensationRequest)]
    assert len(model.requests) == 1


@pytest.mark.parametrize(
    "model", [(WINDOW + 1200, True), (WINDOW + 1200, False)], indirect=True, ids=["reported", "set"]
)
async def test_a_known_window_is_kept_by_the_condenser(bus: Bus, spawn: Spawn, model: OpenAIServer) -> None:
    # Known from the server's /props (llama.cpp) or from RIVERBED_LLM_CONTEXT_TOKENS: the
    # condenser's budget keeps every prompt and its max_tokens within it.
    model.respond(thinking(16, 1200), times=100)
    more = {} if model.reports else {"RIVERBED_LLM_CONTEXT_TOKENS": str(model.window)}
    await ready(spawn("w-window-kept", ["agent", "condenser"], **env(model, **more)))
    seen = await run_to_end(bus, "s-window-kept", "think a lot", steps=20)
    assert isinstance(seen[-1], events.Finish), seen[-1]
    assert model.context_errors == 0
    assert [e for e in seen if isinstance(e, events.Condensation)]  # (it had to condense to stay within)
    assert max(len(json.dumps(r["messages"])) // 4 for r in model.requests) > 1000


@pytest.mark.parametrize("model", [(WINDOW + 1200, False)], indirect=True)
async def test_a_step_over_the_windows_budget_waits_for_a_condenser_that_is_behind(
    bus: Bus, spawn: Spawn, model: OpenAIServer
) -> None:
    # The condenser worker is frozen while the run outgrows the window: the agent role knows the
    # budget the condenser keeps, so the step over it asks the condenser and waits, and the model
    # is never sent a prompt over the window (a context error would be the retry's way instead).
    model.respond(thinking(16, 1200), times=100)
    known = env(model, RIVERBED_LLM_CONTEXT_TOKENS=str(model.window))
    condenser = spawn("w-behind-condenser", ["condenser"], **known)
    await ready(condenser, spawn("w-behind-agent", ["agent"], **known))
    os.kill(condenser.proc.pid, signal.SIGSTOP)
    try:
        opened = await open_run(bus, "s-behind", "think a lot", limits=RunLimits(max_steps=20))
        with anyio.fail_after(6):  # (well within the 10 s a frozen worker still counts as live)
            while not [e for e in await bus.session("s-behind").events() if isinstance(e, events.CondensationRequest)]:
                await anyio.sleep(0.05)
    finally:
        os.kill(condenser.proc.pid, signal.SIGCONT)
    with anyio.fail_after(90):
        seen = [event async for event in follow_run(bus, "s-behind", opened.task)]
    assert isinstance(seen[-1], events.Finish), seen[-1]
    assert model.context_errors == 0
    asked = [e for e in seen if isinstance(e, events.CondensationRequest)]
    answers = [
        e for e in seen if e.cause in {a.id for a in asked} and isinstance(e, (events.Condensation, events.Error))
    ]
    assert answers
    assert all(a.source == "condenser" for a in answers)
    assert [e for e in seen if isinstance(e, events.Condensation) and e.forgotten]


@pytest.fixture
def small_llama(tmp_path: Path) -> Iterator[str]:
    """llama-cpp-python's server on the tests' tiny model with a 256-token window."""
    assert LLAMA_PYTHON is not None
    model = tmp_path / "tiny.gguf"
    subprocess.run([LLAMA_PYTHON, str(TINYLLM), str(model)], check=True, timeout=120)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen(
        [LLAMA_PYTHON, "-m", "llama_cpp.server", "--model", str(model), "--model_alias", "tiny",
         "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "256"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx2.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            except httpx2.HTTPError:
                pass
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, "the llama-cpp server did not start within 60 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()


@pytest.mark.slow
@pytest.mark.skipif(LLAMA_PYTHON is None, reason="llama-cpp-python[server] is needed: RIVERBED_TEST_LLAMA_PYTHON")
async def test_llama_cpp_pythons_server_says_its_window_only_in_its_errors(small_llama: str) -> None:
    # llama-cpp-python's server (0.3.x) reports no n_ctx (no /props, /slots, max_model_len): the
    # window is read from its context-length error, which the agent role recognises.
    assert await read_window(small_llama) is None
    client = CheckedClient(api_key="unused", base_url=small_llama)
    body = {"model": "tiny", "max_tokens": 16, "messages": [{"role": "user", "content": "word " * 400}]}
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat_completion(body)
    finally:
        await client.close()
    assert exceeds_context(refused.value)
    assert window_in(refused.value) == 256

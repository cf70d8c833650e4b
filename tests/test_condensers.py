"""Condensation policies: config, triggers, forgetting, masking, LLM strategies on a local server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace
from openai import AsyncOpenAI

from riverbed.errors import ConfigError, UnavailableError
from riverbed.events import (
    CmdOutput,
    CmdRun,
    Condensation,
    Error,
    Event,
    FileContent,
    FileRead,
    Message,
    SessionConfig,
    with_id,
)
from riverbed.memory.condensers import (
    CondenserConfig,
    condense,
    config_from_log,
    prepare,
    should_condense,
)
from riverbed.memory.tokens import TokenCounter
from riverbed.memory.view import Masked, Summary, View, ViewBuilder, view
from tests.kit.openai_server import OpenAIServer

pytestmark = pytest.mark.anyio


@pytest.fixture
def openai_server() -> Iterator[OpenAIServer]:
    with OpenAIServer() as server:
        yield server


def cfg(**raw: Any) -> CondenserConfig:
    return CondenserConfig.from_dict({"tokenizer": "estimate", **raw})


def session(turns: int, *, output: str = "out") -> list[Event]:
    """A task message, then ``turns`` command/output pairs."""
    events: list[Event] = [Message(content="fix the bug in app.py", source="user")]
    for i in range(turns):
        events.append(CmdRun(command=f"step {i}"))
        events.append(CmdOutput(content=f"{output} {i}", exit_code=0))
    return number(events)


def number(events: list[Event]) -> list[Event]:
    """Give ids 1..n, pointing each observation at the action just before it."""
    out: list[Event] = []
    for i, e in enumerate(events, start=1):
        if isinstance(e, CmdOutput | FileContent) and e.cause is None:
            out.append(with_id(replace(e, cause=i - 1), i))
        else:
            out.append(with_id(e, i))
    return out


def more(events: list[Event], turns: int, *, output: str = "out") -> list[Event]:
    """``turns`` more command/output pairs after ``events``."""
    last = events[-1].id
    assert last is not None
    new: list[Event] = []
    for i in range(turns):
        action = last + 1 + 2 * i
        new += [
            with_id(CmdRun(command=f"more {i}"), action),
            with_id(CmdOutput(content=f"{output} {i}", cause=action), action + 1),
        ]
    return [*events, *new]


def append(events: list[Event], *new: Event) -> list[Event]:
    return [*events, *(with_id(e, events[-1].id + 1 + i) for i, e in enumerate(new))]  # type: ignore[operator]


# --- config -----------------------------------------------------------------------------


def test_config_defaults_and_from_dict() -> None:
    assert CondenserConfig.from_dict(None) == CondenserConfig()
    c = CondenserConfig.from_dict({"strategy": "recent", "max_events": "20", "keep_first": 2})
    assert (c.strategy, c.max_events, c.keep_first) == ("recent", 20, 2)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"strategy": "magic"}, "strategy"),
        ({"max_events": 1}, "max_events must be at least"),
        ({"budget_tokens": 100, "headroom_tokens": 100}, "headroom_tokens must be smaller"),
        ({"target_ratio": 0}, "target_ratio"),
        ({"keep_first": -1}, "keep_first"),
        ({"colour": "blue"}, "colour"),
        ({"strategy": "pipeline"}, "at least one stage"),
        ({"strategy": "pipeline", "stages": [{"strategy": "pipeline", "stages": [{}]}]}, "nested"),
        ({"stages": [{}]}, "only for the pipeline"),
        ({"strategy": "summarizing", "budget_tokens": 1000, "summary_tokens": 600}, "summary_tokens"),
        ({"stages": "x", "strategy": "pipeline"}, "list of condenser config"),
    ],
)
def test_bad_config_is_a_config_error(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CondenserConfig.from_dict(raw)


def test_bad_config_type_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="must be an object"):
        CondenserConfig.from_dict(["amortized"])  # type: ignore[arg-type]


def test_pipeline_stages_inherit_the_pipeline_fields() -> None:
    c = CondenserConfig.from_dict(
        {
            "strategy": "pipeline",
            "max_events": 30,
            "stages": [{"strategy": "masking"}, {"strategy": "recent", "keep_first": 3}],
        }
    )
    assert [s.strategy for s in c.flat()] == ["masking", "recent"]
    assert all(s.max_events == 30 for s in c.stages)
    assert c.stages[1].keep_first == 3


def test_config_from_log_takes_the_last_setting() -> None:
    log = [
        SessionConfig(condenser={"strategy": "recent", "max_events": 10}),
        SessionConfig(env={"A": "1"}),
        SessionConfig(condenser={"strategy": "noop"}),
    ]
    assert config_from_log(log).strategy == "noop"
    assert config_from_log(log[:2]).strategy == "recent"
    assert config_from_log([]) == CondenserConfig()


# --- forgetting policies ----------------------------------------------------------------


async def test_noop_never_condenses_but_answers_requests() -> None:
    v = view(session(200))
    c = cfg(strategy="noop", max_events=10)
    assert not should_condense(v, c)
    assert await condense(v, c) is None
    assert should_condense(v, c, requested=True)
    answer = await condense(v, c, requested=True)
    assert answer == Condensation(ts=answer.ts) if answer else False  # an empty answer


async def test_amortized_forgets_down_to_half_keeping_first_and_pairs() -> None:
    events = session(30)  # 61 events
    c = cfg(strategy="amortized", max_events=40, keep_first=1)
    v = view(events)
    assert should_condense(v, c)
    cond = await condense(v, c)
    assert cond is not None
    assert cond.summary is None
    after = view(append(events, cond))
    assert len(after) <= 20
    assert after[0].id == 1
    assert after[-1].id == events[-1].id
    assert isinstance(after[1], CmdRun)  # the cut fell between pairs
    assert not should_condense(after, c)


async def test_recent_is_a_sliding_window() -> None:
    events = session(10)  # 21 events
    c = cfg(strategy="recent", max_events=20, keep_first=1)
    cond = await condense(view(events), c)
    assert cond is not None
    after = view(append(events, cond))
    assert len(after) == 19  # one whole pair forgotten, no more
    assert cond.forgotten == [(2, 3)]


async def test_requested_condensation_forgets_even_under_the_limits() -> None:
    events = session(10)
    c = cfg(strategy="amortized", max_events=100)
    assert not should_condense(view(events), c)
    assert await condense(view(events), c) is None
    cond = await condense(view(events), c, requested=True)
    assert cond is not None
    assert cond.forgotten
    assert len(view(append(events, cond))) <= 12


async def test_nothing_to_forget_gives_none() -> None:
    events = number([Message(content="x" * 10_000), CmdRun(command="ls"), CmdOutput(content="y" * 10_000)])
    c = cfg(strategy="amortized", budget_tokens=1000)
    assert should_condense(view(events), c)
    assert await condense(view(events), c) is None


async def test_open_pairs_are_never_cut() -> None:
    # Two actions in flight, answered out of order, interleaved with a user message.
    events = number(
        [
            Message(content="task", source="user"),
            CmdRun(command="a"),
            CmdRun(command="b"),
            Message(content="hurry", source="user"),
            CmdOutput(content="b done", cause=3),
            CmdOutput(content="a done", cause=2),
            *[Message(content=f"m{i}", source="user") for i in range(10)],
        ]
    )
    c = cfg(strategy="recent", max_events=14, keep_first=1)
    cond = await condense(view(events), c)
    assert cond is not None
    assert cond.forgotten == [(2, 6)]


async def test_summary_is_kept_in_place_by_forgetting_strategies() -> None:
    events = session(10)
    events = append(events, Condensation(forgotten=[(2, 5)], summary="earlier", summary_offset=1))
    events = more(events, 10)
    c = cfg(strategy="amortized", max_events=20)
    cond = await condense(view(events), c)
    assert cond is not None
    after = view(append(events, cond))
    assert isinstance(after[1], Summary)
    assert after[1].content == "earlier"


# --- the token budget, driven repeatedly ------------------------------------------------


async def drive(
    sizes: list[int], config: CondenserConfig, client: Any = None, *, keep_first_size: int = 40
) -> list[View]:
    """Append command/output pairs of the given sizes; condense whenever due; return every view."""
    builder = ViewBuilder()
    next_id = 1

    def add(e: Event) -> None:
        nonlocal next_id
        builder.append(with_id(e, next_id))
        next_id += 1

    add(Message(content="t" * keep_first_size, source="user"))
    views = []
    for size in sizes:
        add(CmdRun(command="run"))
        add(CmdOutput(content="o" * size, cause=next_id - 1))
        v = builder.view()
        if should_condense(v, config):
            cond = await condense(v, config, client, model="test-model")
            if cond is not None:
                add(cond)
        views.append(builder.view())
    return views


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 600), min_size=1, max_size=80),
    st.sampled_from(["recent", "amortized"]),
    st.integers(1000, 4000),
    st.integers(0, 300),
    st.booleans(),
)
def test_token_budget_holds_after_every_step(
    sizes: list[int], strategy: str, budget: int, headroom: int, masked: bool
) -> None:
    stage = {"strategy": strategy, "budget_tokens": budget, "headroom_tokens": headroom, "max_events": None}
    raw = {"strategy": "pipeline", "stages": [{"strategy": "masking", "mask_window": 4}, stage]} if masked else stage
    config = cfg(**raw)
    counter = TokenCounter(tokenizer="estimate")
    for v in anyio.run(drive, sizes, config):
        assert counter.events(prepare(v, config)) <= budget - headroom
        assert not should_condense(v, config)


async def test_token_budget_holds_with_llm_summaries(openai_server: OpenAIServer) -> None:
    openai_server.respond(lambda request: {"content": "summary " * 400}, times=100)  # longer than allowed
    config = cfg(strategy="summarizing", budget_tokens=3000, summary_tokens=300, max_events=None)
    counter = TokenCounter(tokenizer="estimate")
    async with openai_server.client() as client:
        views = await drive([400] * 60, config, client)
    assert openai_server.requests, "the summarizer was never called"
    for v in views:
        assert counter.events(v) <= 3000
        if v.summary is not None:
            assert counter.text(v.summary.content) <= 300


# --- masking ----------------------------------------------------------------------------


def test_masking_replaces_old_observation_content_in_steps() -> None:
    events = session(20, output="x" * 500)
    events = append(events, Error(content="boom", cause=None))
    c = cfg(strategy="masking", mask_window=6)
    assert not should_condense(view(events), c)
    masked = prepare(view(events), c)
    kinds = [e.kind for e in masked if e.kind in ("cmd_output", "masked")]
    assert kinds.count("masked") == 12  # 20 - 6 = 14, rounded down to steps of 3
    assert kinds[:12] == ["masked"] * 12
    first = next(e for e in masked if isinstance(e, Masked))
    assert first.original_kind == "cmd_output"
    assert first.id == 3
    assert first.cause == 2
    assert masked[-1].kind == "error"

    # The boundary moves in steps: 21 and 22 observations both mask 15.
    def masked_ids(turns: int) -> list[int | None]:
        return [e.id for e in prepare(view(more(events, turns, output="y" * 500)), c) if isinstance(e, Masked)]

    assert len(masked_ids(1)) == 15
    assert masked_ids(2) == masked_ids(1)
    assert len(masked_ids(4)) == 18
    assert view(events) == view(events)  # the log is untouched


def test_short_observations_are_not_masked() -> None:
    events = session(20, output="ok")
    assert not any(isinstance(e, Masked) for e in prepare(view(events), cfg(strategy="masking", mask_window=2)))


# --- LLM summarizing --------------------------------------------------------------------


async def test_summarizing_calls_the_model_and_replaces_the_summary(openai_server: OpenAIServer) -> None:
    openai_server.reply("TASK: fix app.py\nFILES: app.py")
    events = session(20)
    events = append(
        events,
        FileRead(path="/work/app.py"),
        FileContent(path="/work/app.py", content="print(1)", cause=events[-1].id + 1),
    )
    c = cfg(strategy="summarizing", max_events=30, model="summarizer")
    async with openai_server.client() as client:
        cond = await condense(view(events), c, client)
    assert cond is not None
    assert cond.summary == "TASK: fix app.py\nFILES: app.py"
    assert cond.summary_offset == 1
    request = openai_server.last_request
    assert request["model"] == "summarizer"
    system, user = request["messages"]
    assert system["role"] == "system"
    assert "FILES" in system["content"]
    assert "OPEN PROBLEMS" in system["content"]
    assert "<previous_summary>\n(none)" in user["content"]
    assert "[2] cmd_run (agent): step 0" in user["content"]
    after = view(append(events, cond))
    assert isinstance(after[1], Summary)
    assert after[1].content == cond.summary

    # The next summary folds in the previous one and replaces it.
    events = more(append(events, cond), 20)
    openai_server.reply("second summary")
    async with openai_server.client() as client:
        cond2 = await condense(view(events), c, client)
    assert cond2 is not None
    assert "TASK: fix app.py" in openai_server.last_request["messages"][1]["content"]
    after = view(append(events, cond2))
    assert [e.content for e in after if isinstance(e, Summary)] == ["second summary"]
    assert after[1].content == "second summary"  # type: ignore[attr-defined]


async def test_summarizing_failures_are_unavailable_errors(openai_server: OpenAIServer) -> None:
    c = cfg(strategy="summarizing", max_events=10)
    v = view(session(20))
    async with openai_server.client() as client:
        openai_server.fail(500)
        with pytest.raises(UnavailableError, match="failed"):
            await condense(v, c, client, model="m")
        openai_server.reply("   ")
        with pytest.raises(UnavailableError, match="empty answer"):
            await condense(v, c, client, model="m")
        openai_server.reply("late", delay=1.0)
        with pytest.raises(UnavailableError, match="did not answer within"):
            await condense(v, cfg(strategy="summarizing", max_events=10, llm_timeout=0.2), client, model="m")
    with pytest.raises(ConfigError, match="needs an LLM"):
        await condense(v, c, None, model="m")
    async with openai_server.client() as client:
        with pytest.raises(ConfigError, match="needs a model"):
            await condense(v, c, client)


async def test_unreachable_server_is_unavailable() -> None:
    async with AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(UnavailableError):
            await condense(view(session(20)), cfg(strategy="summarizing", max_events=10), client, model="m")


# --- LLM attention ----------------------------------------------------------------------


async def test_attention_keeps_what_the_model_picks_with_whole_pairs(openai_server: OpenAIServer) -> None:
    events = session(20)  # ids 1..41; pairs (2k, 2k+1)
    # The model asks to keep the output 5 (its action 4 comes along) and action 10, in a code fence.
    openai_server.reply('```json\n{"keep": [5, "10", 999]}\n```')
    c = cfg(strategy="attention", max_events=30, model="m")
    async with openai_server.client() as client:
        cond = await condense(view(events), c, client)
    assert cond is not None
    after = view(append(events, cond))
    ids = [e.id for e in after]
    assert ids[0] == 1
    assert {4, 5, 10, 11} <= set(ids)
    assert ids[-2:] == [40, 41]
    assert len(after) <= 15
    prompt = openai_server.last_request["messages"]
    assert '{"keep"' in prompt[0]["content"]
    assert "[2] cmd_run" in prompt[1]["content"]
    assert "[41]" not in prompt[1]["content"]  # the newest pair is never offered


async def test_attention_bad_json_is_unavailable(openai_server: OpenAIServer) -> None:
    openai_server.reply("I would keep the important ones.")
    async with openai_server.client() as client:
        with pytest.raises(UnavailableError, match="JSON"):
            await condense(view(session(20)), cfg(strategy="attention", max_events=30), client, model="m")


# --- pipeline ---------------------------------------------------------------------------


async def test_pipeline_masks_then_condenses(openai_server: OpenAIServer) -> None:
    openai_server.respond(lambda request: {"content": json.dumps({"keep": []})})
    c = cfg(
        strategy="pipeline",
        max_events=30,
        stages=[{"strategy": "masking", "mask_window": 4}, {"strategy": "noop"}, {"strategy": "attention"}],
    )
    events = session(20, output="z" * 400)
    assert should_condense(view(events), c)
    async with openai_server.client() as client:
        cond = await condense(view(events), c, client, model="m")
    assert cond is not None
    # The attention stage saw the masked view.
    assert "a recall can bring it back" in openai_server.last_request["messages"][1]["content"]


# --- tokens -----------------------------------------------------------------------------


def test_token_counter_falls_back_to_the_estimate() -> None:
    auto = TokenCounter("gpt-4o")
    estimate = TokenCounter(tokenizer="estimate")
    assert estimate.text("abcdefgh") == 2
    assert not estimate.exact
    assert auto.text("hello world") > 0
    if not auto.exact:
        with pytest.raises(ConfigError, match="tiktoken"):
            TokenCounter("gpt-4o", tokenizer="tiktoken")

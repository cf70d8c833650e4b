"""The reference LLM agent: an OpenAI tool-calling loop over the session log.

::

    async with riverbed.connect() as bus:
        final = await run_llm_agent(bus, "s-42", "Fix the failing test", settings=Settings.from_env())

One run, step by step:

1. The task is appended as the user's ``message``.  On the session's first user message the
   agent recalls the ``workspace_context`` (and the ``knowledge`` microagents the message
   triggers); on a later user message, the ``knowledge`` it triggers.  These recalls carry
   ``cause`` = the message, and they are shown to the model through the Jinja2 templates in
   ``prompts/`` (``workspace_context.j2``, ``knowledge.j2``) as user messages where they
   happened.  A user message that arrives while the agent works gets its knowledge recall too.
2. The prompt is a pure function of the log (:func:`build_messages`): the condensed view
   (the fold, then the session's masking), turned into chat messages by
   :mod:`riverbed.agent.messages`, after the ``system.j2`` prompt.  Between two steps the
   prompt only grows at its end (tools and system prompt byte-identical), so provider prompt
   caches hit; a condensation changes it from the first forgotten event on.  With
   ``RIVERBED_PROMPT_CACHE=anthropic`` the request marks cache breakpoints
   (:func:`~riverbed.agent.messages.cache_breakpoints`).  A model with vision
   (``RIVERBED_LLM_VISION``) is sent a message's images and the images Python cells saved,
   read from the session's workspace under ``RIVERBED_WORKSPACE`` (:mod:`riverbed.agent.images`);
   this needs the agent on a machine that sees the workspace, else an image is left out.
3. The model's response is recorded as an ``llm_response`` *before* anything it asks for is
   published; its ``cause`` is the id of the last event the prompt was built from, so
   ``build_messages(events up to that id)`` is exactly the prompt that was sent.
4. Each tool call becomes its action (tools: :mod:`riverbed.agent.tools`), with ``cause`` =
   the response and ``tool_call_id`` = the call's id, so prompts pair calls and results by
   identity.  The
   agent awaits each action's observation before the next one goes out.  A response with a
   tool call that cannot be parsed runs none of its calls: one ``error`` (source agent,
   ``cause`` = the response) tells the model what was wrong.
5. The run ends on ``finish``, on a response without tool calls (recorded as the agent's
   ``message`` waiting for the user), on an LLM failure (an ``error`` with reason
   ``llm_error``) or at the step limit (an ``error`` with reason ``step_limit``); the event
   that ended it is returned.

Replaying a session needs no model: every prompt is rebuilt from the log, and every model
decision is in its ``llm_response``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import replace as replace_options
from importlib import resources
from pathlib import Path
from typing import Any

import anyio
import jinja2
import structlog
from msgspec.structs import replace
from openai import AsyncOpenAI

from riverbed import events
from riverbed.agent import messages as chat
from riverbed.agent.images import ImageSource, WorkspaceImages, vision
from riverbed.agent.retry import GaveUp, RetryPolicy, retryable, retrying
from riverbed.agent.tools import action_from_call, tools
from riverbed.client.session import Bus, Session
from riverbed.errors import ActTimeout, AlreadyAnswered, ConfigError, InputError, RiverbedError
from riverbed.memory.condensers import CondenserConfig, config_from_log, prepare, should_condense
from riverbed.memory.view import view as fold
from riverbed.runtime.paths import workspace_name
from riverbed.settings import Settings

__all__ = [
    "AgentOptions",
    "build_messages",
    "make_client",
    "model_parameters",
    "recorded_response",
    "render",
    "run_llm_agent",
    "timeout_sentence",
]

log = structlog.get_logger("riverbed.agent")


@dataclass(frozen=True, kw_only=True)
class AgentOptions:
    """How the agent presents itself, asks the model and how long it waits (seconds) for the
    model and answers.  The model's settings left None are the run's settings'
    (``RIVERBED_LLM_TIMEOUT``, ``RIVERBED_LLM_TEMPERATURE``, ``RIVERBED_LLM_MAX_OUTPUT_TOKENS``)."""

    name: str = "llm"
    instructions: str | None = None
    llm_timeout: float | None = None
    action_timeout: float = 120.0
    recall_timeout: float = 15.0
    temperature: float | None = None
    max_output_tokens: int | None = None
    """tokens one model answer may have (0: the server decides)"""
    condense_timeout: float = 60.0

    def resolved(self, settings: Settings) -> AgentOptions:
        """These options with the model's settings filled in from ``settings``."""
        return replace_options(
            self,
            llm_timeout=settings.llm_timeout if self.llm_timeout is None else self.llm_timeout,
            temperature=settings.llm_temperature if self.temperature is None else self.temperature,
            max_output_tokens=(
                settings.llm_max_output_tokens if self.max_output_tokens is None else self.max_output_tokens
            ),
        )


# --- prompts -----------------------------------------------------------------------------


@functools.cache
def _templates() -> jinja2.Environment:
    root = resources.files("riverbed.agent") / "prompts"
    return jinja2.Environment(
        loader=jinja2.FunctionLoader(lambda name: (root / name).read_text(encoding="utf-8")),
        undefined=jinja2.StrictUndefined,
        autoescape=False,  # noqa: S701  (plain-text prompts for a model, never HTML)
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=False,
    )


def render(template: str, **context: Any) -> str:
    """Render one of the prompt templates (``system.j2``, ``workspace_context.j2``, ``knowledge.j2``)."""
    return _templates().get_template(template).render(**context).strip()


def _context_text(result: events.RecallResult) -> str:
    if result.recall_type == "workspace_context":
        return render("workspace_context.j2", ctx=result)
    if result.recall_type == "knowledge" and result.knowledge:
        return render("knowledge.j2", knowledge=result.knowledge)
    return ""


def _with_context(view: Iterable[events.Event]) -> list[events.Event]:
    """The view with the agent's own context recalls (a ``recall`` caused by a user message)
    replaced by their rendered text, as a user message where the result arrived."""
    items = list(view)
    by_id = {e.id: e for e in items if e.id is not None}
    automatic: set[int] = set()
    for e in items:
        if isinstance(e, events.Recall) and e.id is not None and e.cause is not None:
            asked_by = by_id.get(e.cause)
            if isinstance(asked_by, events.Message) and asked_by.source == "user":
                automatic.add(e.id)
    out: list[events.Event] = []
    for e in items:
        if e.id in automatic:
            continue
        if isinstance(e, events.Observation) and e.cause in automatic:
            text = _context_text(e) if isinstance(e, events.RecallResult) else ""
            if text:
                out.append(events.Message(id=e.id, source="user", content=text, ts=e.ts))
            continue
        out.append(e)
    return out


def _condenser_config(log_events: Sequence[events.Event], defaults: Mapping[str, Any] | None = None) -> CondenserConfig:
    try:
        return config_from_log(log_events, defaults)
    except ConfigError as exc:
        log.warning("agent.bad_condenser_config", error=str(exc))
        return CondenserConfig()


def build_messages(
    log_events: Sequence[events.Event],
    *,
    agent: str = "llm",
    instructions: str | None = None,
    images: ImageSource | None = None,
    condenser_defaults: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The chat messages the agent sends after these events (a log prefix, with ids).

    Pure: the same events (and ``condenser_defaults``, the ``RIVERBED_CONDENSER_*`` settings a
    ``session_config`` overrides) always give the same prompt, so any step of a recorded
    session can be rebuilt without a model.
    """
    view = prepare(fold(log_events), _condenser_config(log_events, condenser_defaults))
    system = render("system.j2", agent=agent, instructions=instructions)
    return chat.to_messages(_with_context(view), system_prompt=system, images=images)


# --- the model ---------------------------------------------------------------------------


def make_client(settings: Settings) -> AsyncOpenAI:
    """An OpenAI client from settings (``OPENAI_API_KEY``, ``OPENAI_BASE_URL``)."""
    if not settings.openai_api_key and not settings.openai_base_url:
        raise ConfigError("the LLM agent needs OPENAI_API_KEY (or OPENAI_BASE_URL for a local server) to be set")
    return AsyncOpenAI(
        api_key=settings.openai_api_key or "unused",
        base_url=settings.openai_base_url or None,
        max_retries=0,  # (retried by the agent's policy: ``agent/retry.py``)
    )


def model_parameters(temperature: float | None, max_output_tokens: int | None) -> dict[str, Any]:
    """The request's sampling parameters: ``temperature`` and ``max_tokens`` (what OpenAI and
    llama.cpp's server read as the answer's length limit) when set; None or 0: not sent."""
    parameters: dict[str, Any] = {}
    if temperature is not None:
        parameters["temperature"] = temperature
    if max_output_tokens:
        parameters["max_tokens"] = max_output_tokens
    return parameters


def recorded_response(answer: Mapping[str, Any], model: str, cause: int | None) -> events.LlmResponse:
    """The ``llm_response`` that records a chat completion, ``answer`` being its JSON (which has
    ``choices``): the first choice's text, its tool calls in the wire form they came in, the
    usage without its empty fields, and the model that answered (else ``model``)."""
    message = _mapping(_mapping(answer["choices"][0]).get("message"))
    content = message.get("content")
    usage = answer.get("usage")
    return events.LlmResponse(
        model=answer.get("model") or model,
        content=content if isinstance(content, str) else None,
        tool_calls=[_wire_call(_mapping(call)) for call in message.get("tool_calls") or []],
        usage=_without_none(usage) if isinstance(usage, dict) else {},
        cause=cause,
    )


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _wire_call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call in the wire form it was received in (id, type, function name and arguments)."""
    function = _mapping(call.get("function"))
    return {
        "id": call.get("id"),
        "type": call.get("type") or "function",
        "function": {"name": function.get("name") or "", "arguments": function.get("arguments") or ""},
    }


def _without_none(value: Any) -> Any:
    """``value`` with the ``None`` fields of its mappings left out, at every depth."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    return value


def timeout_sentence(timeout: float, tries: int = 1) -> str:
    """What a model call that took too long says: the limit, and the setting that sets it."""
    again = f" ({tries} tries)" if tries > 1 else ""
    return (
        f"the model did not answer within {timeout:g} s{again}: RIVERBED_LLM_TIMEOUT "
        "(or `riverbed agent --llm-timeout`) sets this limit, and a slow local model needs more"
    )


def _llm_error(exc: BaseException, timeout: float) -> events.Error:
    if isinstance(exc, TimeoutError):
        return events.Error(source="agent", content=timeout_sentence(timeout), reason="llm_error", retryable=True)
    status = getattr(exc, "status_code", None)
    detail = f"HTTP {status}: " if status is not None else ""
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return events.Error(
        source="agent",
        content=f"the model call failed ({detail}{message})",
        reason="llm_error",
        retryable=retryable(exc),
    )


# --- the loop ----------------------------------------------------------------------------


class _Run:
    def __init__(
        self,
        session: Session,
        client: AsyncOpenAI,
        model: str,
        options: AgentOptions,
        prompt_cache: str = "none",
        images: ImageSource | None = None,
    ) -> None:
        self.session = session
        self.images = images
        self.prompt_cache = prompt_cache
        self.client = client
        self.model = model
        self.options = options
        self.events: list[events.Event] = []
        self.recalled: set[int] = set()
        self.tools = tools()
        self.condenser_defaults: dict[str, Any] = {}
        self.retry = RetryPolicy()

    async def refresh(self) -> None:
        start = (self.events[-1].id or 0) + 1 if self.events else 1
        self.events.extend(await self.session.events(start))

    async def append(self, event: events.Event) -> events.Event:
        """Append one event; returns it as the log holds it (id, agent, tenant and trace set)."""
        stamped = self.session.stamp(event)
        (event_id,) = await self.session.append(stamped)
        return events.with_id(stamped, event_id)

    async def recall_context(self, message_id: int, content: str, *, first: bool) -> None:
        """Recall what a user message calls for; a memory that does not answer is not fatal."""
        self.recalled.add(message_id)
        asks = [events.Recall(recall_type="workspace_context", cause=message_id)] if first else []
        asks.append(events.Recall(recall_type="knowledge", query=content, cause=message_id))
        for action in asks:
            try:
                await self.session.act(action, timeout=self.options.recall_timeout)
            except ActTimeout as exc:
                log.warning(
                    "agent.recall_unanswered", session=self.session.id, recall_type=action.recall_type, error=str(exc)
                )

    async def new_user_messages(self) -> None:
        """Knowledge recalls for user messages that arrived while the agent was working."""
        for event in list(self.events):
            if isinstance(event, events.Message) and event.source == "user" and event.id not in self.recalled:
                assert event.id is not None
                await self.recall_context(event.id, event.content, first=False)

    async def keep_within_budget(self) -> None:
        """When the view is over the session's budget, ask the condenser and wait for its answer,
        so the model is never sent a view the policy says is too large (the condenser role may
        simply not have caught up yet)."""
        if not should_condense(fold(self.events), _condenser_config(self.events, self.condenser_defaults)):
            return
        try:
            # cause: the last event of the view seen over the limit (a condensation the condenser
            # made meanwhile answers it: one condensation per step)
            seen = self.events[-1].id if self.events else None
            await self.session.act(events.CondensationRequest(cause=seen), timeout=self.options.condense_timeout)
        except ActTimeout as exc:
            log.warning("agent.condensation_unanswered", session=self.session.id, error=str(exc))
        await self.refresh()

    async def complete(self) -> dict[str, Any]:
        """The model's answer to the prompt the log makes, as its JSON (empty fields left out)."""
        until = self.events[-1].id if self.events else 0
        request: dict[str, Any] = {
            "model": self.model,
            "messages": chat.cache_breakpoints(
                build_messages(
                    self.events,
                    agent=self.options.name,
                    instructions=self.options.instructions,
                    images=self.images,
                    condenser_defaults=self.condenser_defaults,
                ),
                self.prompt_cache,
            ),
            "tools": self.tools,
            "tool_choice": "auto",
            "parallel_tool_calls": False,
        }
        request.update(model_parameters(self.options.temperature, self.options.max_output_tokens))
        timeout = self.options.llm_timeout
        assert timeout is not None  # (resolved)

        async def once() -> Any:
            with anyio.fail_after(timeout):
                return await self.client.chat.completions.create(**request)

        response = await retrying(self.retry, once)
        answer: dict[str, Any] = response.model_dump(exclude_none=True)
        log.info("agent.llm_response", session=self.session.id, until=until, usage=answer.get("usage", {}))
        return answer

    async def act(self, action: events.Action) -> events.Event:
        """Publish an action and wait for its answer; give up with an ``error`` answer in time."""
        appended = await self.append(action)
        assert appended.id is not None
        try:
            return await self.session.wait_for_answer(appended.id, timeout=self.options.action_timeout)
        except ActTimeout as exc:
            try:
                return await self.append(
                    events.Error(source="agent", cause=appended.id, content=str(exc), reason="timeout", retryable=True)
                )
            except AlreadyAnswered:  # the answer came after all
                return await self.session.wait_for_answer(appended.id, timeout=5)

    async def step(self) -> events.Event | None:
        """One model call and the actions it asks for; returns the event that ends the run, if any."""
        await self.refresh()
        await self.new_user_messages()
        await self.refresh()
        await self.keep_within_budget()
        until = self.events[-1].id if self.events else None
        try:
            answer = await self.complete()
        except GaveUp as failed:
            error = _llm_error(failed.error, self.options.llm_timeout or 0)
            log.info("agent.llm_failed", session=self.session.id, error=error.content)
            return await self.append(error)
        if not answer.get("choices"):
            return await self.append(
                events.Error(
                    source="agent", content="the model returned no choices", reason="llm_error", retryable=True
                )
            )
        llm = recorded_response(answer, self.model, until)
        recorded = await self.append(llm)
        response_id = recorded.id
        if not llm.tool_calls:
            return await self.append(
                events.Message(content=llm.content or "", wait_for_response=True, cause=response_id)
            )
        actions: list[events.Action] = []
        problems: list[str] = []
        for record in llm.tool_calls:
            try:
                action = action_from_call(record["function"]["name"], record["function"]["arguments"])
            except InputError as exc:
                problems.append(f"tool call {record['id']}: {exc}")
                continue
            call_id = record["id"]
            if isinstance(call_id, str) and call_id:
                action = replace(action, tool_call_id=call_id)
            actions.append(replace(action, cause=response_id))
        if problems:
            await self.reject(response_id, problems)
            return None
        for action in actions:
            if isinstance(action, events.Finish):
                return await self.append(action)
            if type(action).answered_by is None:
                await self.append(action)
            else:
                await self.act(action)
        return None

    async def reject(self, response_id: int | None, problems: list[str]) -> None:
        text = "; ".join(problems) + ". None of the tool calls of that response were run; call the tools again."
        await self.append(events.Error(source="agent", cause=response_id, content=text, reason="bad_tool_call"))


async def run_llm_agent(
    bus: Bus,
    session_id: str,
    task: str,
    *,
    settings: Settings,
    client: AsyncOpenAI | None = None,
    max_steps: int = 30,
    options: AgentOptions | None = None,
    tenant: str | None = None,
    images: Sequence[str] = (),
) -> events.Event | None:
    """Work on ``task`` (with ``images``: URLs or workspace paths) in session ``session_id``
    until ``finish``, a question for the user, an LLM failure or ``max_steps`` model calls;
    returns the event that ended the run."""
    if max_steps < 1:
        raise InputError("max_steps must be at least 1")
    if client is not None:
        return await _work(bus, session_id, task, settings, client, max_steps, options, tenant, images)
    own = make_client(settings)  # made here, closed here
    try:
        return await _work(bus, session_id, task, settings, own, max_steps, options, tenant, images)
    finally:
        with anyio.CancelScope(shield=True):
            await own.close()


async def _work(
    bus: Bus,
    session_id: str,
    task: str,
    settings: Settings,
    client: AsyncOpenAI,
    max_steps: int,
    options: AgentOptions | None,
    tenant: str | None,
    images: Sequence[str],
) -> events.Event | None:
    options = (options or AgentOptions()).resolved(settings)
    session = bus.session(session_id, agent=options.name, tenant=tenant)
    image_source = (
        WorkspaceImages(Path(settings.workspace) / workspace_name(session_id), max_bytes=settings.max_image_bytes)
        if vision(settings.llm_vision, settings.llm_model)
        else None
    )
    run = _Run(session, client, settings.llm_model, options, settings.prompt_cache, image_source)
    run.condenser_defaults = settings.condenser_defaults()
    run.retry = RetryPolicy(budget=settings.agent_llm_retry_seconds)
    await run.refresh()
    first = not any(isinstance(e, events.Message) and e.source == "user" for e in run.events)
    run.recalled.update(e.id for e in run.events if isinstance(e, events.Message) and e.id is not None)
    task_message = await run.append(
        events.Message(content=task, source="user", images=list(images))
        if images
        else events.Message(content=task, source="user")
    )
    assert task_message.id is not None
    bound = log.bind(session=session_id, agent=options.name)
    try:
        await run.recall_context(task_message.id, task, first=first)
        for _ in range(max_steps):
            ended = await run.step()
            if ended is not None:
                bound.info("agent.done", ended_by=ended.kind, event_id=ended.id)
                return ended
    except RiverbedError as exc:
        bound.warning("agent.failed", error=str(exc))
        raise
    stopped = await run.append(
        events.Error(
            source="agent",
            content=f"the agent stopped after {max_steps} model calls without finishing",
            reason="step_limit",
            retryable=True,
        )
    )
    bound.info("agent.done", ended_by="step_limit", event_id=stopped.id)
    return stopped

"""What the agent asks the model: the prompt as a pure function of the log, the request's
model parameters, and the ``llm_response`` that records an answer.

The loop that works on a run is the agent role's (``riverbed.workers.agent_role``; in this
process: ``riverbed.workers.agent_run.run_llm_agent``).  What it sends:

- The prompt is a pure function of the log (:func:`build_messages`): the condensed view (the
  fold, then the session's masking), turned into chat messages by
  :mod:`riverbed.agent.messages`, after the agent's system prompt (:func:`system_prompt`:
  ``system.j2`` for the reference agent, a hosted agent's own instructions otherwise).  The
  context recalls a user message caused (the workspace's ``workspace_context``, the
  ``knowledge`` it triggers) are shown through ``workspace_context.j2`` and ``knowledge.j2`` as
  user messages where they happened.  Between two steps the prompt only grows at its end, so
  provider prompt caches hit; a condensation changes it from the first forgotten event on.
  With ``RIVERBED_PROMPT_CACHE=anthropic`` the request marks cache breakpoints
  (:func:`~riverbed.agent.messages.cache_breakpoints`).  A model with vision
  (``RIVERBED_LLM_VISION``) is sent a message's images and the images Python cells saved,
  read from the session's workspace (:mod:`riverbed.agent.images`).
- The model's response is recorded as an ``llm_response`` (:func:`recorded_response`) before
  anything it asks for is published; its ``cause`` is the id of the last event the prompt was
  built from, so ``build_messages(events up to that id)`` is exactly the prompt that was sent.

Replaying a session needs no model: every prompt is rebuilt from the log, and every model
decision is in its ``llm_response``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import replace as replace_options
from importlib import resources
from typing import TYPE_CHECKING, Any

import structlog
from msgspec.structs import replace

from riverbed import events
from riverbed.agent import messages as chat
from riverbed.agent.define import REFERENCE, Agent
from riverbed.agent.images import ImageSource
from riverbed.errors import ConfigError
from riverbed.memory.condensers import CondenserConfig, config_from_log, prepare, should_condense
from riverbed.memory.view import View
from riverbed.memory.view import view as fold
from riverbed.settings import Settings

if TYPE_CHECKING:
    import jinja2
    from openai import AsyncOpenAI

__all__ = [
    "OVERSIZED",
    "AgentOptions",
    "bounded_response",
    "build_messages",
    "context_shown",
    "make_client",
    "model_parameters",
    "over_budget",
    "recorded_response",
    "render",
    "system_prompt",
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
    import jinja2  # noqa: PLC0415  (loaded at the first prompt: the CLI and every worker import this module)

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
    by_id: dict[int, events.Event] = {}
    automatic: set[int] = set()
    out: list[events.Event] = []
    for e in view:
        shown = context_shown(e, by_id, automatic)
        if shown is not None:
            out.append(shown)
        if e.id is not None:
            by_id[e.id] = e
    return out


def context_shown(event: events.Event, by_id: Mapping[int, events.Event], automatic: set[int]) -> events.Event | None:
    """What the prompt shows of ``event`` (see :func:`_with_context`): None for an automatic
    context recall and for a result of one that renders to nothing.  ``by_id`` holds the
    view's events before it (a cause names an earlier event); ``automatic`` collects the
    automatic recalls' ids as they come."""
    cause = event.cause
    if cause is None or event.id is None or cause >= event.id:
        return event
    if isinstance(event, events.Recall):
        asked_by = by_id.get(cause)
        if isinstance(asked_by, events.Message) and asked_by.source == "user":
            automatic.add(event.id)
            return None
    if isinstance(event, events.Observation) and cause in automatic:
        text = _context_text(event) if isinstance(event, events.RecallResult) else ""
        return events.Message(id=event.id, source="user", content=text, ts=event.ts) if text else None
    return event


def over_budget(
    log_events: Sequence[events.Event], defaults: Mapping[str, Any] | None = None, *, view: View | None = None
) -> bool:
    """Whether the view of these events is over the session's condenser budget (its policy
    would condense now): the model is not sent such a view before the condenser answered.
    ``view``: their fold, when the caller keeps one (see :func:`build_messages`)."""
    return should_condense(fold(log_events) if view is None else view, _condenser_config(log_events, defaults))


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
    system: str | None = None,
    view: View | None = None,
) -> list[dict[str, Any]]:
    """The chat messages the agent sends after these events (a log prefix, with ids).

    Pure: the same events (and ``condenser_defaults``, the ``RIVERBED_CONDENSER_*`` settings a
    ``session_config`` overrides) always give the same prompt, so any step of a recorded
    session can be rebuilt without a model.  ``system`` is the system prompt of a hosted agent
    (:func:`system_prompt`); without it, the reference agent's (``system.j2``, with ``agent``
    and ``instructions``).  ``view``: the fold of ``log_events`` when the caller keeps one, an
    incremental :class:`~riverbed.memory.view.ViewBuilder`'s (a step then folds only what is
    new); the same as folding them here.
    """
    folded = fold(log_events) if view is None else view
    prepared = prepare(folded, _condenser_config(log_events, condenser_defaults))
    if system is None:
        system = render("system.j2", agent=agent, instructions=instructions)
    return chat.to_messages(_with_context(prepared), system_prompt=system, images=images)


@functools.lru_cache(maxsize=256)
def system_prompt(definition: Agent) -> str:
    """The system prompt of a hosted agent: the reference agent's ``system.j2``; any other
    agent's own instructions (``agent.j2`` when it has none).  Kept per definition (a step asks
    for it, and the template takes longer to render than the rest of a step's prompt)."""
    if definition is REFERENCE:
        return render("system.j2", agent=definition.name, instructions=definition.instructions)
    return definition.instructions or render("agent.j2", agent=definition.name)


# --- the model ---------------------------------------------------------------------------


def make_client(settings: Settings) -> AsyncOpenAI:
    """An OpenAI client from settings (``OPENAI_API_KEY``, ``OPENAI_BASE_URL``)."""
    if not settings.openai_api_key and not settings.openai_base_url:
        raise ConfigError("the LLM agent needs OPENAI_API_KEY (or OPENAI_BASE_URL for a local server) to be set")
    from openai import AsyncOpenAI  # noqa: PLC0415  (a second to load: only the roles that call a model do)

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


OVERSIZED = "[not recorded: "
"""How a tool call's arguments too large for the log begin once replaced (:func:`bounded_response`)."""


def bounded_response(response: events.LlmResponse, max_bytes: int) -> events.LlmResponse:
    """``response`` as it may be recorded: a tool call whose arguments would make the event
    larger than ``max_bytes`` (``RIVERBED_MAX_EVENT_BYTES``) keeps its id and name, its
    arguments replaced by a note saying so (the toolbox answers that call with an error the
    model reads), and a text over the limit is cut, saying so.  Nothing larger than the log
    takes is ever appended, and the run goes on."""
    budget = max(256, max_bytes // 2)
    calls = []
    changed = False
    for call in response.tool_calls:
        function = _mapping(call.get("function"))
        arguments = function.get("arguments")
        if isinstance(arguments, str) and len(arguments.encode()) > budget // max(1, len(response.tool_calls)):
            size = len(arguments.encode())
            note = f"{OVERSIZED}the arguments were {size:,} bytes, over what one event may hold ({max_bytes:,})]"
            calls.append({**call, "function": {**function, "arguments": note}})
            changed = True
        else:
            calls.append(call)
    content = response.content
    if content is not None and len(content.encode()) > budget:
        content = content.encode()[:budget].decode(errors="ignore") + f"\n[cut: the text was over {budget:,} bytes]"
        changed = True
    return replace(response, tool_calls=calls, content=content) if changed else response


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

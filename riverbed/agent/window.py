"""The model's context window: how large it is, keeping the prompt within it, and what to do
when a server still says the prompt does not fit.

A model reads at most its *context window* of tokens, the prompt and the answer together.
riverbed learns it from ``RIVERBED_LLM_CONTEXT_TOKENS``, else from the server where it says
(:func:`read_window`: llama.cpp's server reports ``n_ctx`` at ``GET /props`` and ``GET /slots``,
vLLM ``max_model_len`` at ``GET /v1/models``; llama-cpp-python's server says nothing, and its
window is then read from its first context-length error).  The condenser keeps the prompt
within it (:func:`fit_condenser`): the condenser's token budget becomes the window less the
answer's ``max_tokens``, the system prompt and tools, and a tenth of the window for the
difference between the condenser's token count and the model's tokenizer.

A server that still answers that the prompt is too long (:func:`exceeds_context`: HTTP 400
``context_length_exceeded``, "maximum context length is …") gets one condensation (a
``condensation_request`` the condenser role answers) and one retry per step; a second such
answer ends the run with a sentence that names the window (:func:`too_long`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import httpx2

from riverbed import events
from riverbed.agent.llm import render
from riverbed.agent.tools import ROLE_TOOL_ACTIONS, tools
from riverbed.errors import ConfigError

__all__ = [
    "asked_to_condense",
    "exceeds_context",
    "fit_condenser",
    "prompt_overhead",
    "read_window",
    "too_long",
    "window_in",
]

_CONTEXT_ERROR = re.compile(
    r"context[ _](?:length|window|size)|maximum context|exceeds? the available context|too many tokens"
    r"|prompt is too long",
    re.IGNORECASE,
)
_WINDOW = re.compile(
    r"(?:context (?:length|window|size) (?:is|of)|n_ctx\D{0,4})\s*(\d{3,9})(?: tokens)?", re.IGNORECASE
)


def _body_error(exc: BaseException) -> dict[str, Any]:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        return inner if isinstance(inner, dict) else {}
    return {}


def exceeds_context(exc: BaseException | None) -> bool:
    """Whether a model error says the prompt (with its ``max_tokens``) does not fit the window."""
    if exc is None or getattr(exc, "status_code", None) not in (400, 413):
        return False
    error = _body_error(exc)
    if error.get("code") == "context_length_exceeded" or error.get("type") == "exceed_context_size_error":
        return True
    message = getattr(exc, "message", None) or str(exc)
    return bool(_CONTEXT_ERROR.search(message))


def window_in(exc: BaseException) -> int | None:
    """The window a context-length error names (its ``n_ctx``, or "maximum context length is N")."""
    n_ctx = _body_error(exc).get("n_ctx")
    if isinstance(n_ctx, int) and n_ctx > 0:
        return n_ctx
    match = _WINDOW.search(getattr(exc, "message", None) or str(exc))
    return int(match.group(1)) if match else None


async def read_window(base_url: str, *, api_key: str | None = None, timeout: float = 3.0) -> int | None:
    """The context window the model server at ``base_url`` reports, None when it says nothing
    (or cannot be reached within ``timeout``)."""
    root = base_url.rstrip("/")
    server = root.removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with anyio.move_on_after(timeout):
        async with httpx2.AsyncClient(timeout=timeout, headers=headers) as http:
            return await _first_reported(http, [f"{server}/props", f"{server}/slots", f"{root}/models"])
    return None


async def _first_reported(http: httpx2.AsyncClient, urls: list[str]) -> int | None:
    for url in urls:
        try:
            response = await http.get(url)
            answer = response.json() if response.status_code == 200 else None
        except (httpx2.HTTPError, ValueError):
            continue
        window = _reported(answer)
        if window is not None:
            return window
    return None


def _reported(answer: Any) -> int | None:
    """``n_ctx`` of llama.cpp's ``/props`` (top level or its default generation settings) or
    first slot, or ``max_model_len`` of the first model listed (vLLM)."""
    if isinstance(answer, list) and answer and isinstance(answer[0], dict):
        return _positive(answer[0].get("n_ctx"))
    if not isinstance(answer, dict):
        return None
    settings = answer.get("default_generation_settings")
    for candidate in (answer.get("n_ctx"), settings.get("n_ctx") if isinstance(settings, dict) else None):
        if _positive(candidate) is not None:
            return _positive(candidate)
    data = answer.get("data")
    if isinstance(data, list) and data and isinstance(data[0], dict):
        return _positive(data[0].get("max_model_len"))
    return None


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def prompt_overhead() -> int:
    """Tokens of the agent role's prompt around the events (system prompt and tool schemas),
    estimated as the condenser's fallback counts them (four characters a token)."""
    text = render("system.j2", agent="llm", instructions=None) + json.dumps(tools(ROLE_TOOL_ACTIONS))
    return (len(text) + 3) // 4


def fit_condenser(defaults: Mapping[str, Any], window: int, max_output_tokens: int) -> dict[str, Any]:
    """The condenser defaults with a token budget that keeps the prompt and its answer within
    ``window``; :class:`ConfigError` when the window leaves no room for any conversation."""
    overhead = prompt_overhead() + window // 10
    headroom = int(defaults.get("headroom_tokens") or 0) + max_output_tokens + overhead
    budget = defaults.get("budget_tokens")
    if headroom >= window:
        raise ConfigError(
            f"the model's context window of {window} tokens leaves no room for the conversation once the "
            f"answer's {max_output_tokens} tokens (RIVERBED_LLM_MAX_OUTPUT_TOKENS) and the prompt's "
            f"{overhead} tokens of tools and margin are set aside: lower RIVERBED_LLM_MAX_OUTPUT_TOKENS, or "
            "serve the model with a larger window (RIVERBED_LLM_CONTEXT_TOKENS)"
        )
    fitted = dict(defaults)
    if isinstance(budget, int) and budget - int(defaults.get("headroom_tokens") or 0) <= window - headroom:
        return fitted  # (the operator's own budget is tighter)
    fitted["budget_tokens"] = window
    fitted["headroom_tokens"] = headroom
    return fitted


def asked_to_condense(seen: Sequence[events.Event], since: int) -> events.CondensationRequest | None:
    """The agent's ``condensation_request`` made after event ``since`` (the step's start: the
    run's last ``llm_response``, else its ``run_started``), None when none was."""
    for event in reversed(seen):
        if event.id is not None and event.id <= since:
            return None
        if isinstance(event, events.CondensationRequest) and event.source == "agent":
            return event
    return None


def too_long(window: int | None, said: str, *, condensed: bool = True) -> str:
    """Why the run ends: the prompt still does not fit after one condensation (or, with
    ``condensed`` false, no condenser worker runs to make one)."""
    size = f"the model's context window of {window} tokens" if window else "the model's context window"
    if not condensed:
        return (
            f"the prompt does not fit {size} ({said}), and no condenser worker runs to condense the "
            "history: start one (riverbed worker condenser, or riverbed worker all)"
        )
    return (
        f"the prompt does not fit {size}, even after condensing the history once ({said}): set "
        "RIVERBED_LLM_CONTEXT_TOKENS to the window the server runs with (the condenser then keeps the "
        "prompt within it), lower RIVERBED_LLM_MAX_OUTPUT_TOKENS, or serve the model with a larger window"
    )

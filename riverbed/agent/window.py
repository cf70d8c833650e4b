"""The model's context window: how large it is, keeping the prompt within it, and what to do
when a server still says the prompt does not fit.

A model reads at most its *context window* of tokens, the prompt and the answer together.
riverbed learns it from ``RIVERBED_LLM_CONTEXT_TOKENS``, else from the server where it says
(:func:`read_window`: llama.cpp's server reports ``n_ctx`` at ``GET /props`` and ``GET /slots``,
vLLM ``max_model_len`` at ``GET /v1/models``; llama-cpp-python's server says nothing, and its
window is then read from its first context-length error).  The condenser keeps the prompt
within it (:func:`fit_condenser`): the condenser's token budget becomes the window less the
answer's ``max_tokens``, the system prompt and tools, and a tenth of the window for the
difference between the condenser's token count and the model's tokenizer.  The agent role and
the condenser role fit their defaults alike (:class:`WindowFit`): the condenser condenses to
the budget as the log grows, and a step whose view is over it asks the condenser and waits, so a
condenser that is behind never lets a prompt over the window go out.

A server that still answers that the prompt is too long (:func:`exceeds_context`: HTTP 400
``context_length_exceeded``, "maximum context length is …") gets one condensation (a
``condensation_request`` the condenser role answers) and one retry per step; a second such
answer ends the run with a sentence that names the window (:func:`too_long`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any

import anyio
import httpx2
import structlog

from riverbed import events
from riverbed.agent.llm import render
from riverbed.agent.tools import ROLE_TOOL_ACTIONS, tools
from riverbed.errors import ConfigError
from riverbed.memory.condensers import CondenserConfig
from riverbed.settings import Settings

__all__ = [
    "WindowFit",
    "asked_to_condense",
    "exceeds_context",
    "fit_condenser",
    "prompt_overhead",
    "read_window",
    "too_long",
    "window_fit",
    "window_in",
]

log = structlog.get_logger("riverbed.worker")

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
        # (no certificates loaded for a server without TLS: it is asked without redirects)
        verify = root.startswith("https:")
        async with httpx2.AsyncClient(timeout=timeout, headers=headers, verify=verify) as http:
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


class WindowFit:
    """A role's condenser defaults, fitted to the model's context window: at once when the window
    is set (``RIVERBED_LLM_CONTEXT_TOKENS``; :class:`ConfigError` when it leaves no room), else
    once the server was asked (``ask``, the first time :meth:`learn` is awaited; a window the
    server reports that leaves no room is logged as ``<role>.window_too_small`` and left out)."""

    def __init__(
        self,
        role: str,
        defaults: Mapping[str, Any] | None,
        max_output_tokens: int,
        *,
        window: int = 0,
        ask: Callable[[], Awaitable[int | None]] | None = None,
    ) -> None:
        self.role = role
        self.max_output_tokens = max_output_tokens
        self.defaults = fit_condenser(defaults or {}, window, max_output_tokens) if window else dict(defaults or {})
        """what the role condenses to (fitted once the window is known)"""
        self._ask = None if window else ask
        self._asking = anyio.Lock()

    async def learn(self) -> dict[str, Any]:
        """The defaults, fitted to the window the server reports (asked once, by the first caller)."""
        if self._ask is not None:
            async with self._asking:
                ask, self._ask = self._ask, None
                window = await ask() if ask is not None else None
                if window is not None:
                    try:
                        fitted = fit_condenser(self.defaults, window, self.max_output_tokens)
                        CondenserConfig.from_dict(None, fitted)
                    except ConfigError as exc:
                        log.warning(f"{self.role}.window_too_small", window=window, error=str(exc))
                    else:
                        self.defaults = fitted
                        log.info(f"{self.role}.window", window=window, budget=self.defaults.get("budget_tokens"))
        return self.defaults


def window_fit(role: str, settings: Settings) -> WindowFit:
    """``role``'s condenser defaults (``RIVERBED_CONDENSER_*``) fitted to the window the settings
    set, else to the one the model server reports when asked."""
    ask = None
    if not settings.llm_context_tokens and settings.openai_base_url:
        ask = partial(read_window, settings.openai_base_url, api_key=settings.openai_api_key)
    return WindowFit(
        role,
        settings.condenser_defaults(),
        settings.llm_max_output_tokens,
        window=settings.llm_context_tokens,
        ask=ask,
    )


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

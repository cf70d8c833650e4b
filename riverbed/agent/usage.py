"""Tokens and cost per model call, from the ``llm_response`` events of a log (pure).

The LLM agent records each response's ``usage`` as the provider sent it (OpenAI's
``prompt_tokens``, ``completion_tokens`` and ``prompt_tokens_details.cached_tokens``; servers
that say ``input_tokens``/``output_tokens``/``cache_read_input_tokens`` are read too).
:func:`usage` turns those into per-step and per-session totals, priced by a table of USD per
million tokens per model (``RIVERBED_PRICES``)::

    RIVERBED_PRICES='{"gpt-4o-mini": {"prompt": 0.15, "cached": 0.075, "completion": 0.6}}'

A model missing from the table (and no ``"*"`` entry) has no cost (None), never a guess.

The condenser's effect is in the report too: for each ``condensation`` (by a condenser or a
user), the view's size in events and tokens right before it and right after it
(:class:`CondensationMark`), so the steps before and after it can be compared.
Cached prompt tokens are the part of the prompt the provider served from its cache: they are
counted in ``prompt`` and priced at ``cached``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from riverbed.errors import ConfigError
from riverbed.events import Condensation, Event, LlmResponse
from riverbed.memory.tokens import TokenCounter
from riverbed.memory.view import ViewBuilder

__all__ = [
    "CondensationMark",
    "Price",
    "StepUsage",
    "UsageCounters",
    "UsageReport",
    "parse_prices",
    "step",
    "tokens",
    "unpriced",
    "usage",
]


class Price(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """USD per million tokens; ``cached`` defaults to the prompt price."""

    prompt: float
    completion: float
    cached: float | None = None


@dataclass(frozen=True, slots=True)
class StepUsage:
    event_id: int
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost: float | None


@dataclass(frozen=True, slots=True)
class CondensationMark:
    """A condensation and the view it changed: events and tokens right before and right after."""

    event_id: int
    source: str
    events_before: int
    events_after: int
    tokens_before: int
    tokens_after: int


@dataclass(frozen=True, slots=True)
class UsageReport:
    steps: tuple[StepUsage, ...] = ()
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost: float | None = None
    models: tuple[str, ...] = field(default=())
    condensations: tuple[CondensationMark, ...] = ()


def parse_prices(text: str | None) -> dict[str, Price]:
    """The price table from its JSON form (``RIVERBED_PRICES``); ConfigError when it is bad."""
    if not text:
        return {}
    try:
        return msgspec.json.decode(text, type=dict[str, Price])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(
            f"RIVERBED_PRICES is not a price table ({exc}): use JSON such as "
            '{"gpt-4o-mini": {"prompt": 0.15, "cached": 0.075, "completion": 0.6}} (USD per million tokens)'
        ) from exc


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def unpriced(model: str, prices: Mapping[str, Price]) -> str | None:
    """Why a cost limit cannot bound a run of ``model`` (None: the table prices it)."""
    if model in prices or "*" in prices:
        return None
    return (
        f"a cost limit needs a price for the model {model!r}, and RIVERBED_PRICES has none: "
        "add it to the price table, or leave out the cost limit"
    )


def tokens(raw: Mapping[str, Any]) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens of one recorded ``usage``."""
    prompt = _int(raw.get("prompt_tokens", raw.get("input_tokens")))
    completion = _int(raw.get("completion_tokens", raw.get("output_tokens")))
    details = raw.get("prompt_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, Mapping) else 0
    cached = cached or _int(raw.get("cache_read_input_tokens"))
    return prompt, min(cached, prompt) if prompt else cached, completion


def _cost(price: Price | None, prompt: int, cached: int, completion: int) -> float | None:
    if price is None:
        return None
    cached_price = price.prompt if price.cached is None else price.cached
    return ((prompt - cached) * price.prompt + cached * cached_price + completion * price.completion) / 1_000_000


def step(event: LlmResponse, event_id: int, prices: Mapping[str, Price]) -> StepUsage:
    """The tokens and cost of one ``llm_response`` (priced by ``prices``, else its ``"*"`` entry)."""
    prompt, cached, completion = tokens(event.usage)
    price = prices.get(event.model, prices.get("*"))
    return StepUsage(event_id, event.model, prompt, cached, completion, _cost(price, prompt, cached, completion))


class UsageCounters:
    """Running totals per model of the ``llm_response`` events a worker handled, for its
    Prometheus counters (``riverbed_llm_tokens_total``, ``riverbed_llm_cost_usd_total``)."""

    def __init__(self, prices: Mapping[str, Price] | None = None) -> None:
        self.prices = dict(prices or {})
        self.tokens: dict[tuple[str, str], int] = {}
        """(model, kind) -> tokens; kind is ``prompt``, ``cached`` or ``completion``."""
        self.cost: dict[str, float] = {}
        """model -> USD, for the models the price table knows."""

    def count(self, event: LlmResponse, event_id: int) -> None:
        counted = step(event, event_id, self.prices)
        for kind, value in (
            ("prompt", counted.prompt_tokens),
            ("cached", counted.cached_tokens),
            ("completion", counted.completion_tokens),
        ):
            self.tokens[(counted.model, kind)] = self.tokens.get((counted.model, kind), 0) + value
        if counted.cost is not None:
            self.cost[counted.model] = self.cost.get(counted.model, 0.0) + counted.cost


def usage(events: Iterable[Event], prices: Mapping[str, Price] | None = None) -> UsageReport:
    """Per-step tokens and cost of every ``llm_response``, and the session's totals (the total
    cost is None when a step has no price)."""
    prices = prices or {}
    steps = []
    marks = []
    builder = ViewBuilder()
    counter = TokenCounter()
    for event in events:
        if isinstance(event, Condensation) and event.id is not None:
            before = builder.view()
            builder.append(event)
            after = builder.view()
            marks.append(
                CondensationMark(
                    event.id,
                    event.source,
                    len(before),
                    len(after),
                    counter.events(list(before)),
                    counter.events(list(after)),
                )
            )
            continue
        if event.id is not None:
            builder.append(event)
        if not isinstance(event, LlmResponse) or event.id is None:
            continue
        steps.append(step(event, event.id, prices))
    costs = [s.cost for s in steps]
    return UsageReport(
        steps=tuple(steps),
        prompt_tokens=sum(s.prompt_tokens for s in steps),
        cached_tokens=sum(s.cached_tokens for s in steps),
        completion_tokens=sum(s.completion_tokens for s in steps),
        cost=None if any(c is None for c in costs) or not costs else sum(c for c in costs if c is not None),
        models=tuple(sorted({s.model for s in steps})),
        condensations=tuple(marks),
    )

"""`riverbed usage`: tokens and cost per model call."""

from __future__ import annotations

from typing import Any

import msgspec
from rich.table import Table
from rich.text import Text

from riverbed.cli.app import Invocation, JsonOption, PrefixOption, SessionArg, _require_events, app
from riverbed.cli.output import _cell, _stdout_lines, json_bytes, out_console, visible

# --- usage: tokens and cost per model call -------------------------------------------------------


@app.command("usage")
def usage_command(session: SessionArg, json_out: JsonOption = False, prefix: PrefixOption = None) -> None:
    """Prompt, cached and completion tokens and cost of every model call, and the session's totals.

    Costs come from RIVERBED_PRICES (USD per million tokens per model); without a price a cost is empty.
    A row at each condensation shows, in its own column, the view's tokens (and events) right
    before and after it.
    """
    from riverbed.agent.usage import parse_prices, usage  # noqa: PLC0415

    cli = Invocation(prefix)
    prices = parse_prices(cli.settings.prices)

    async def go() -> Any:
        bus = await cli.bus()
        await _require_events(bus, session)
        return usage(await bus.session(session).events(), prices)

    report = cli.run(go)
    if json_out:
        _stdout_lines([json_bytes({"session": session, **msgspec.to_builtins(report)})])
        return
    columns = ["event", "model", "prompt", "cached", "completion", "cost (USD)"]
    table = Table(*columns, *(["condensed: the view before → after"] if report.condensations else []))

    def money(cost: float | None) -> str:
        return "" if cost is None else f"{cost:.6f}"

    marks = list(report.condensations)
    for step in report.steps:
        while marks and marks[0].event_id < step.event_id:
            _condensation_row(table, marks.pop(0))
        table.add_row(
            str(step.event_id),
            _cell(step.model),
            str(step.prompt_tokens),
            str(step.cached_tokens),
            str(step.completion_tokens),
            money(step.cost),
        )
    for mark in marks:
        _condensation_row(table, mark)
    table.add_row(
        "total",
        f"{len(report.steps)} calls",
        str(report.prompt_tokens),
        str(report.cached_tokens),
        str(report.completion_tokens),
        money(report.cost),
        style="bold",
    )
    out_console().print(table)


# --- usage: the condenser's effect (issue 17) ----------------------------------------------------
# Self-contained: moves into the cli/ package with `usage`.


def _condensation_row(table: Table, mark: Any) -> None:
    """A marker row in `riverbed usage`: a condensation and the view's size before and after it,
    in the condensation column (a model call's columns stay empty)."""
    said = (
        f"{visible(mark.source)} condensation: view {mark.tokens_before} → {mark.tokens_after} tokens, "
        f"{mark.events_before} → {mark.events_after} events"
    )
    table.add_row(str(mark.event_id), "", "", "", "", "", Text(said, style="cyan"))

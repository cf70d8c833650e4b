"""`riverbed context`: what the agent sees, and the user's edits of it."""

from __future__ import annotations

import shlex
from typing import Annotated, Any

import msgspec
import typer
import typer.core
import typer.main
from rich.text import Text

from riverbed import events
from riverbed.cli.app import Invocation, PrefixOption, SessionArg, _require_events, app, command_name
from riverbed.cli.output import (
    _id_list,
    _one_line,
    _stdout_lines,
    err_console,
    json_bytes,
    out_console,
    render,
    visible,
)
from riverbed.errors import (
    InputError,
)

# --- context: what the agent sees, and the user's edits of it ---------------------------------

_CONTEXT_OPS = ("forget", "restore", "pin", "unpin")


@app.command("context")
def context_command(
    session: SessionArg,
    op: Annotated[
        str | None,
        typer.Argument(help="forget | restore | pin | unpin (none: show the context).", show_default=False),
    ] = None,
    targets: Annotated[
        list[str] | None, typer.Argument(help="Event ids or ranges: 7, 12-40.", show_default=False)
    ] = None,
    kind: Annotated[
        list[str] | None, typer.Option("--kind", help="Every event of this kind (repeatable).", show_default=False)
    ] = None,
    note: Annotated[str | None, typer.Option("--note", help="Why (kept in the edit).", show_default=False)] = None,
    until: Annotated[int | None, typer.Option("--until", help="Show the context right after this event.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Show the context as one JSON object.")] = False,
    apply: Annotated[bool, typer.Option("--apply", help="suggest: apply the proposal.")] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="An edit: say what it would change, and append nothing.")
    ] = False,
    model: Annotated[
        str | None, typer.Option("--model", help="suggest: the model (RIVERBED_SUGGEST_MODEL).", show_default=False)
    ] = None,
    prefix: PrefixOption = None,
) -> None:
    """The agent's context: what it sees, what is hidden and what hid it, what is pinned.

    `context S suggest "drop the detour about X"` asks a model which events to drop and prints
    the proposal as a diff; `--apply` appends it (a condensation by the user).

    `context S forget 12-40`, `forget --kind error`, `restore 12-40`, `pin 7`, `unpin 7` each
    append one context_edit event and print what it changed (JSON on stdout, a sentence on stderr);
    with --dry-run they print what it would change and append nothing.
    """
    cli = Invocation(prefix)
    if dry_run and op not in _CONTEXT_OPS:
        raise InputError("--dry-run is for an edit (forget, restore, pin, unpin); suggest without --apply is one")
    if op is None:
        _context_show(cli, session, until, json_out)
        return
    if op == "suggest":
        _context_suggest(cli, session, " ".join(targets or ()), apply=apply, model=model)
        return
    if op not in _CONTEXT_OPS:
        raise InputError(
            f"unknown context operation {op!r}: use {', '.join(_CONTEXT_OPS)} or suggest, or none to show it"
        )
    if until is not None:
        raise InputError("--until is for showing the context; an edit always applies after the last event")
    _context_edit(cli, session, op, targets, kind, note, dry_run=dry_run)


def _context_show(cli: Invocation, session: str, until: int | None, json_out: bool) -> None:
    from riverbed.memory.context import describe, document  # noqa: PLC0415

    async def go() -> Any:
        bus = await cli.bus()
        await _require_events(bus, session)
        return await bus.session(session).context.show(until)

    report = cli.run(go)
    if json_out:
        _stdout_lines([json_bytes(document(session, report))])
        return
    console = out_console()
    console.print(
        f"context of {session} after event {report.view.last_id}: {len(report.view.ids())} events visible, "
        f"{len(report.hidden)} hidden, {len(report.pinned)} pinned",
        markup=False,
    )
    for event in report.view:
        line = render(event)
        if event.id in report.pinned:
            line.append("  [pinned]", style="bold cyan")
        console.print(line)
    if report.hidden:
        console.print("hidden:", style="bold")
        for h in report.hidden:
            line = render(h.event)
            line.append(f"  hidden by {visible(describe(h.by))}", style="dim")
            console.print(line)


def _context_edit(
    cli: Invocation,
    session: str,
    op: str,
    targets: list[str] | None,
    kinds: list[str] | None,
    note: str | None,
    *,
    dry_run: bool = False,
) -> None:
    from riverbed.memory.context import parse_range  # noqa: PLC0415

    spans = [parse_range(r) for r in targets or ()]

    async def go() -> tuple[Any, set[int]]:
        bus = await cli.bus()
        await _require_events(bus, session)
        handle = await bus.operate(session)  # an operator's edit, as the session's own tenant
        before = await handle.context.show() if op == "restore" else None
        make = handle.context.preview if dry_run else handle.context.edit
        changed = await make(
            op,  # type: ignore[arg-type]  # checked against _CONTEXT_OPS
            ranges=spans,
            kinds=kinds or (),
            note=note,
        )
        if before is None:
            return changed, set()
        # Events a condenser had hidden: it hides them again once the view is over its limits.
        condensed = {
            h.event.id
            for h in before.hidden
            if isinstance(h.by, events.Condensation) and h.by.source == "condenser" and h.event.id is not None
        }
        return changed, (condensed - before.pinned) & set(changed.shown)

    changed, recondensable = cli.run(go)
    _stdout_lines([json_bytes({"dry_run": dry_run, **msgspec.to_builtins(changed)} if dry_run else changed)])
    verbs = (
        (("would hide", "hid"), changed.hidden),
        (("would show again", "showed again"), changed.shown),
        (("would pin", "pinned"), changed.pinned),
        (("would unpin", "unpinned"), changed.unpinned),
    )
    parts = [
        f"{verb[0] if dry_run else verb[1]} {len(ids)} event{'s' if len(ids) != 1 else ''} ({_id_list(ids)})"
        for verb, ids in verbs
        if ids
    ]
    if dry_run:
        said = "; ".join(parts) or "would change nothing"
        err_console.print(f"dry run of a {op} edit (nothing appended): it {said}", markup=False)
        return
    err_console.print(f"context edit {changed.edit} ({op}): " + ("; ".join(parts) or "nothing changed"), markup=False)
    if recondensable:
        _warn_recondensed(session, tuple(sorted(recondensable)))


def _warn_recondensed(session: str, ids: tuple[int, ...]) -> None:
    """A restore of what a condenser hid lasts until the condenser's next look at the view: say
    so, with the pin that keeps them (a condensation never forgets a pinned event)."""
    from riverbed.memory.view import id_runs  # noqa: PLC0415

    spans = " ".join(f"{a}-{b}" if a != b else str(a) for a, b in id_runs(ids))
    err_console.print(
        f"warning: a condenser had hidden {spans}, and hides them again at its next condensation "
        f"(within seconds when the view is over its limits); to keep them in view, pin them: "
        f"{command_name()} context {shlex.quote(session)} pin {spans}",
        style="yellow",
        markup=False,
    )


# --- context suggest: condensation by conversation (issue 17) -----------------------------------
# Self-contained: moves into the cli/ package with `context`.


def _context_suggest(cli: Invocation, session: str, request: str, *, apply: bool, model: str | None) -> None:
    """Print a model's proposal for ``request`` as a diff of the context; append it with ``apply``."""
    from riverbed.agent.llm import make_client  # noqa: PLC0415
    from riverbed.memory.tokens import event_text  # noqa: PLC0415

    name = model or cli.settings.suggest_model or cli.settings.llm_model
    client = make_client(cli.settings)

    async def go() -> Any:
        bus = await cli.bus()
        await _require_events(bus, session)
        context = (await bus.operate(session)).context  # an operator's edit, as the session's own tenant
        proposal = await context.suggest(request, client=client, model=name)
        return proposal, (await context.apply(proposal) if apply else None)

    proposal, applied = cli.run(go)
    console = out_console()
    hidden = set(proposal.change.hidden)
    for event in proposal.before.view:
        line = Text("- " if event.id in hidden else "  ", style="red" if event.id in hidden else "dim")
        line.append_text(render(event) if event.id is not None else Text(f"summary: {_one_line(event_text(event))}"))
        console.print(line)
    summary = proposal.after.view.summary
    if summary is not None and proposal.condensation.summary is not None:
        console.print(Text(f"+ summary: {_one_line(summary.content, 400)}", style="green"))
    ranges = ", ".join(f"{a}-{b}" for a, b in proposal.condensation.forgotten)
    what = f"{len(hidden)} event{'s' if len(hidden) != 1 else ''} ({_id_list(proposal.change.hidden)})"
    if applied is None:
        err_console.print(
            f"{proposal.model} proposes to forget {ranges}, which hides {what}; nothing was changed "
            "(--apply asks again and appends the proposal it prints)",
            markup=False,
        )
    else:
        err_console.print(f"applied as condensation {applied.edit}: hid {what}", markup=False)

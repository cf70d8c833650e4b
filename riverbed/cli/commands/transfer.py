"""`riverbed export`, `import`, `fork`, `rerun`: sessions copied, moved and re-run."""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import anyio
import typer
import typer.core
import typer.main
from rich.text import Text

from riverbed import events
from riverbed.agent.transfer import import_session, parse_import
from riverbed.bus import status
from riverbed.bus.keys import require_session
from riverbed.cli.app import Invocation, JsonOption, PrefixOption, SessionArg, _progress, _require_events, app
from riverbed.cli.output import _stdout_lines, differing, err_console, json_bytes, plural, visible
from riverbed.client.session import Bus
from riverbed.errors import (
    InputError,
)


@app.command("export")
def export_cmd(
    session: SessionArg,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Write to this file instead of stdout.", show_default=False)
    ] = None,
    prefix: PrefixOption = None,
) -> None:
    """A whole session as JSON lines (the input of `riverbed import`)."""
    cli = Invocation(prefix)

    async def go() -> int:
        bus = await cli.bus()
        await _require_events(bus, session)
        count = 0
        with _output(out) as sink:
            async for event in bus.session(session).log():
                sink.write(json_bytes(event))
                sink.write(b"\n")
                count += 1
        return count

    count = cli.run(go)
    if out is not None:
        _progress(f"exported {count} events of {session!r} to {out}")


@contextlib.contextmanager
def _output(path: Path | None) -> Iterator[Any]:
    if path is None:
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    try:
        with path.open("wb") as handle:
            yield handle
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from exc


# --- import ----------------------------------------------------------------------------------


def _read_input(file: str) -> list[bytes]:
    if file == "-":
        return sys.stdin.buffer.read().splitlines()
    try:
        return Path(file).read_bytes().splitlines()
    except OSError as exc:
        raise InputError(f"cannot read {file}: {exc.strerror or exc}") from exc


@app.command("import")
def import_cmd(
    file: Annotated[str, typer.Argument(help="JSON lines file from `riverbed export` ('-' reads stdin).")],
    into: Annotated[
        str | None,
        typer.Option(
            "--into", help="New session id (default: the file name without its extension).", show_default=False
        ),
    ] = None,
    keep_unknown: Annotated[
        bool, typer.Option("--keep-unknown", help="Import kinds this version does not know, unchanged.")
    ] = False,
    prefix: PrefixOption = None,
) -> None:
    """Load an exported session into a new session id, with the same event ids.

    Every line is validated before anything is written; the import refuses a session that
    already has events.
    """
    cli = Invocation(prefix)
    if into is None:
        if file == "-":
            raise InputError("reading stdin needs --into SESSION to name the new session")
        into = Path(file).name.split(".", 1)[0]
    lines = _read_input(file)
    rows = parse_import(
        lines, "stdin" if file == "-" else file, keep_unknown=keep_unknown, max_bytes=cli.settings.max_event_bytes
    )
    session = into

    async def go() -> None:
        bus = await cli.bus()
        await import_session(bus, session, rows)

    cli.run(go)
    _progress(f"imported {len(rows)} events into {session!r}")


@app.command("fork")
def fork_command(
    session: Annotated[str, typer.Argument(help="Source session id.", callback=require_session)],
    at: Annotated[int, typer.Option("--at", help="Copy events 1..N.", metavar="N")],
    into: Annotated[str, typer.Option("--into", help="The new session id.", metavar="NEW")],
    workspace: Annotated[
        str,
        typer.Option(
            "--workspace",
            help="How the fork's sandbox is built: replay the actions 1..N (files, cwd, variables, "
            "Python cells), copy the source's workspace, or empty.",
            metavar="replay|copy|empty",
        ),
    ] = "replay",
    timeout: Annotated[
        float,
        typer.Option("--timeout", help="Seconds to wait for a runtime worker to rebuild the sandbox (0: do not wait)."),
    ] = 60.0,
    wait: Annotated[
        bool,
        typer.Option("--wait", help="Wait for the rebuild (up to --timeout) even when no runtime worker is running."),
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object: the fork and its rebuild.")] = False,
    prefix: PrefixOption = None,
) -> None:
    """New session whose log is events 1..N of the source (same ids), then a `forked` event;
    its sandbox is rebuilt as it was at N. Exit 3 when an observation came out differently.

    fork waits for the rebuild only when there is one to report (events 1..N hold a runtime
    action, or `copy`) and a runtime worker is running (or with --wait)."""
    from riverbed.agent.replay import fork, rebuild_needed, wait_rebuilt  # noqa: PLC0415

    cli = Invocation(prefix)
    if not 0 <= timeout < math.inf:
        raise InputError(f"--timeout must be a number of seconds, 0 or more, not {timeout:g}")

    async def go() -> tuple[int, str | events.SandboxRebuilt]:
        bus = await cli.bus()
        forked_id = await fork(bus, session, at, into, workspace=workspace)  # type: ignore[arg-type]
        if not await rebuild_needed(bus, into, at, workspace):  # type: ignore[arg-type]
            return forked_id, "not needed"
        if timeout == 0 or not (wait or await _runtime_worker_alive(bus)):
            return forked_id, "pending"
        err_console.print(
            f"forked {session} at event {at} into {into}; waiting for a runtime worker to rebuild its sandbox …",
            style="dim",
        )
        return forked_id, await wait_rebuilt(bus, into, forked_id, timeout=timeout)

    forked_id, built = cli.run(go)
    if json_out:
        report: dict[str, Any] = {
            "session": into,
            "source": session,
            "at": at,
            "forked_id": forked_id,
            "workspace": workspace,
        }
        if isinstance(built, str):
            report["rebuild"] = built
        else:
            report |= {"actions": built.actions, "differences": built.differences, "note": built.note}
        _stdout_lines([json_bytes(report)])
    else:
        err_console.print(f"forked {session} at event {at} into {into} (its last event is {forked_id})")
        if built == "not needed" and workspace == "replay":
            err_console.print(f"events 1..{at} hold no runtime action: its sandbox starts empty, nothing to replay")
        elif built == "pending":
            err_console.print(
                f"its sandbox is rebuilt ({workspace}) when a runtime worker takes {into} "
                "(no runtime worker is running now; --wait waits for one)"
                if timeout
                else f"its sandbox is rebuilt ({workspace}) when a runtime worker takes {into}"
            )
        elif isinstance(built, events.SandboxRebuilt):
            err_console.print(_rebuilt_summary(built))
    if isinstance(built, events.SandboxRebuilt) and built.differences:
        raise typer.Exit(3)


async def _runtime_worker_alive(bus: Bus) -> bool:
    """Whether a worker with the runtime role sent a heartbeat lately (what `riverbed status` lists)."""
    workers = await status.live_workers(bus.client, bus.keys)
    return any("runtime" in w.description.get("roles", ()) for w in workers)


def _rebuilt_summary(built: events.SandboxRebuilt) -> Text:
    if built.method == "copy":
        line = Text("sandbox rebuilt: copied the source's workspace")
        return line.append(f" ({visible(built.note)})" if built.note else "")
    line = Text(f"sandbox rebuilt by replaying {plural(built.actions, 'action')}: ")
    if not built.differences:
        return line.append("every observation matched the recording")
    line.append(f"{plural(len(built.differences), 'difference')} from the recording", style="bold yellow")
    for d in built.differences:
        line.append("\n  " + _difference_line(d))
    return line


def _difference_line(d: events.Divergence) -> str:
    """One difference, both values cut around where they differ (not at the same prefix)."""
    was, now = differing(repr(d.recorded), repr(d.new))
    return f"action {d.action_id} ({d.kind}): {d.field} was {was}, now {now}"


@app.command("rerun")
def rerun_command(
    session: Annotated[str, typer.Argument(help="The recorded session.", callback=require_session)],
    into: Annotated[str | None, typer.Option("--into", help="Also record the re-run as this new session.")] = None,
    seed: Annotated[
        Path | None, typer.Option("--seed", help="Directory copied into the fresh workspace first.")
    ] = None,
    json_out: JsonOption = False,
    prefix: PrefixOption = None,
) -> None:
    """Re-execute the recorded runtime actions in a fresh workspace and report each difference."""
    from riverbed.agent.replay import rerun  # noqa: PLC0415
    from riverbed.runtime import Runtime  # noqa: PLC0415
    from riverbed.workers.runtime_role import checked_cgroups, checked_sandbox  # noqa: PLC0415

    cli = Invocation(prefix)

    async def go() -> list[Any]:
        sandbox, cgroups = checked_sandbox(cli.settings), checked_cgroups(cli.settings)
        runtime = Runtime(workspace_root=Path(cli.settings.workspace), sandbox=sandbox, cgroups=cgroups)
        try:
            bus = await cli.bus()
            await _require_events(bus, session)
            return list(await rerun(bus, session, runtime, into=into, seed=seed))
        finally:
            with anyio.CancelScope(shield=True):
                await runtime.aclose()

    differences = cli.run(go)
    if json_out:
        _stdout_lines(json_bytes(d) for d in differences)
    elif not differences:
        err_console.print("no differences: every observation matched the recording")
    else:
        for d in differences:
            err_console.print(_difference_line(d), markup=False)
    if differences:
        raise typer.Exit(3)

"""The ``riverbed`` command.

Every command follows the same shape, so adding one is a few lines::

    @app.command()
    def thing(session: str, prefix: PrefixOption = None) -> None:
        settings = _settings(prefix)

        async def go() -> None:
            async with _bus(settings) as bus:
                ...

        _run(go)

- :func:`_settings` reads the configuration (environment + flags) once;
- :func:`_bus` connects to Redis with a bound on the connection time;
- :func:`_run` runs a coroutine function under anyio;
- :func:`main` turns every error into one sentence on stderr and an exit code:
  2 for bad input or configuration, 1 when a service is unavailable or timed out.
  ``RIVERBED_DEBUG=1`` shows the traceback of an unexpected error.

Machine-readable output goes to stdout (JSON lines); progress and errors go to stderr.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import shlex
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import anyio
import msgspec
import redis.asyncio as aioredis
import typer
import typer.core
import typer.main
from msgspec.structs import replace
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from rich.console import Console
from rich.table import Table
from rich.text import Text

from riverbed import events, services
from riverbed.agent.client import Bus, connect, resolve_redis_url
from riverbed.bus.connection import redact, translate
from riverbed.bus.keys import require_session
from riverbed.bus.log import answered_cause
from riverbed.errors import (
    ActTimeout,
    AlreadyAnswered,
    AppendConflict,
    ConfigError,
    InputError,
    NotFoundError,
    RiverbedError,
    ServiceError,
    UnavailableError,
)
from riverbed.logs import configure_logging
from riverbed.settings import Settings

__all__ = ["app", "main"]

T = TypeVar("T")

CONNECT_TIMEOUT = 5.0
"""Seconds a command waits for Redis before it gives up (no minute of retries)."""

IMPORT_BATCH = 1000
"""Events per append when importing (one Lua call each)."""

#: The order of ``riverbed --help``: a first look, daily work, then operations and plumbing.
#: Commands not named here follow, in the order they are registered.
COMMAND_ORDER = (
    "demo",
    "services",
    "worker",
    "act",
    "append",
    "log",
    "view",
    "fork",
    "rerun",
    "sessions",
    "status",
    "export",
    "import",
    "archive",
    "dlq",
    "schema",
)


class _OrderedGroup(typer.core.TyperGroup):
    def list_commands(self, ctx: Any) -> list[str]:
        names = super().list_commands(ctx)
        known = [n for n in COMMAND_ORDER if n in names]
        return known + [n for n in names if n not in known]


def _plain_help(command: Any) -> Any:
    """Help without type placeholders (``<str>``, ``<float>``): an option shows its metavar
    (``--at N``) or nothing, an argument its name in capitals (``SESSION``)."""
    for param in command.params:
        shown = param.metavar
        if param.param_type_name == "argument":
            param.metavar = param.metavar or (param.name or "").upper()
            shown = None  # the name column shows it already
        param.display_type_rich = lambda ctx, shown=shown: shown  # (a method, per parameter)
    make_help = command.get_help_option

    def help_option(ctx: Any) -> Any:
        option = make_help(ctx)
        if option is not None:
            option.display_type_rich = lambda ctx: None
        return option

    command.get_help_option = help_option
    for sub in getattr(command, "commands", {}).values():
        _plain_help(sub)
    return command


app = typer.Typer(
    cls=_OrderedGroup,
    name="riverbed",
    help="riverbed: an event-sourced runtime for AI agents (Redis Streams log, workers, pgvector memory).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
services_app = typer.Typer(help="Embedded Redis + Postgres for development.", no_args_is_help=True)
app.add_typer(services_app, name="services")

err_console = Console(stderr=True, highlight=False, soft_wrap=True)

PrefixOption = Annotated[
    str | None,
    typer.Option("--prefix", envvar="RIVERBED_PREFIX", help="Key namespace in Redis (default rb).", show_default=False),
]
SessionArg = Annotated[str, typer.Argument(help="Session id.", callback=require_session)]
JsonOption = Annotated[bool, typer.Option("--json", help="One JSON object per line.")]
DirOption = Annotated[
    Path | None,
    typer.Option(
        "--dir",
        envvar="RIVERBED_SERVICES_DIR",
        help="Where the embedded services keep their data.",
        show_default=False,
        file_okay=False,
    ),
]


# --- shared helpers ------------------------------------------------------------------------


def _settings(prefix: str | None = None, **overrides: object) -> Settings:
    """The configuration: ``RIVERBED_*`` variables, overridden by the flags given."""
    return Settings.from_env(os.environ, prefix=prefix, **overrides)


def _progress(message: str) -> None:
    err_console.print(message, style="dim")


def _redis_url(settings: Settings) -> str:
    """``RIVERBED_REDIS_URL``, or the embedded services (started now if they are not running)."""
    return resolve_redis_url(settings, progress=_progress)


async def _probe(url: str) -> None:
    """One PING without retries, so an unreachable Redis fails at once with the real reason
    (the bus client itself retries with backoff, which suits workers, not a command line)."""
    try:
        client = aioredis.Redis.from_url(
            url, socket_connect_timeout=CONNECT_TIMEOUT, socket_timeout=CONNECT_TIMEOUT, retry=Retry(NoBackoff(), 0)
        )
    except ValueError as exc:
        raise ConfigError(f"the Redis URL {redact(url)!r} is not valid: {exc}") from exc
    try:
        with translate(url):
            await client.ping()
    finally:
        await client.aclose()


@contextlib.asynccontextmanager
async def _bus(settings: Settings) -> AsyncIterator[Bus]:
    """A connected bus; an unreachable Redis fails within :data:`CONNECT_TIMEOUT` seconds."""
    url = _redis_url(settings)
    async with contextlib.AsyncExitStack() as stack:
        try:
            with anyio.fail_after(CONNECT_TIMEOUT):
                await _probe(url)
                bus = await stack.enter_async_context(connect(url, settings=settings))
        except TimeoutError as exc:
            raise UnavailableError(
                f"cannot reach Redis at {redact(url)}: no answer within {CONNECT_TIMEOUT:g}s"
            ) from exc
        yield bus


def _run(fn: Callable[[], Awaitable[T]], *, interrupt_code: int | None = None) -> T:
    """Run ``fn`` under anyio; SIGINT/SIGTERM cancel it and exit with ``interrupt_code``
    (default 130 for Ctrl-C, 143 for SIGTERM).

    Signals cancel through an anyio cancel scope, which re-delivers the cancellation until
    the work stops (a plain task cancel can be swallowed inside the Redis client).
    """
    received: list[int] = []
    results: list[T] = []

    async def guarded() -> None:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        received.append(signum)
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch)
            try:
                results.append(await fn())
            finally:
                tg.cancel_scope.cancel()

    try:
        anyio.run(guarded)
    except KeyboardInterrupt:
        received.append(signal.SIGINT)
    except BaseExceptionGroup as group:
        raise _leaf(group) from None
    if received:
        raise typer.Exit(interrupt_code if interrupt_code is not None else 128 + received[0])
    return results[0]


def _stdout_lines(lines: Iterable[bytes], *, flush_each: bool = False) -> None:
    out = sys.stdout.buffer
    for line in lines:
        out.write(line)
        out.write(b"\n")
        if flush_each:
            out.flush()
    out.flush()


def exit_code(exc: BaseException) -> int:
    """1 when a service is unavailable (or timed out), 2 for bad input or configuration."""
    if isinstance(exc, UnavailableError | ServiceError | ActTimeout):
        return 1
    return 2


def _leaf(exc: BaseException) -> BaseException:
    """The one real error inside (nested) exception groups, if there is exactly one."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _fail(message: str, code: int) -> NoReturn:
    err_console.print(Text(f"riverbed: {visible(message)}", style="bold red"), soft_wrap=True)
    raise SystemExit(code)


def _hint(exc: RiverbedError) -> str:
    if isinstance(exc, UnavailableError) and "Redis" in str(exc):
        return ' (start one with: eval "$(riverbed services up)", or set RIVERBED_REDIS_URL)'
    return ""


def main() -> None:
    """Entry point of the ``riverbed`` console script."""
    # Commands log warnings only (to stderr); `worker` reconfigures for its own service logs.
    configure_logging(level=os.environ.get("RIVERBED_LOG_LEVEL") or "warning")
    try:
        _plain_help(typer.main.get_command(app))()
    except SystemExit:
        raise
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away: stop quietly.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0) from None
    except BaseException as raw:
        exc = _leaf(raw)
        if isinstance(exc, KeyboardInterrupt):
            raise SystemExit(130) from None
        if isinstance(exc, SystemExit):
            raise exc from None
        if isinstance(exc, RiverbedError):
            _fail(f"{exc}{_hint(exc)}", exit_code(exc))
        if os.environ.get("RIVERBED_DEBUG"):
            raise
        _fail(f"unexpected error ({type(exc).__name__}: {exc}); set RIVERBED_DEBUG=1 to see the traceback", 1)


# --- services ------------------------------------------------------------------------------


def _services_dir(directory: Path | None) -> Path:
    return directory if directory is not None else Path(_settings().services_dir)


@services_app.command("up")
def services_up(directory: DirOption = None) -> None:
    """Start embedded Redis + Postgres; prints `export …` lines, so `eval "$(riverbed services up)"` works."""
    where = _services_dir(directory)
    if services.load(where) is None:
        _progress(f"starting Redis and Postgres in {where} …")
    else:
        _progress(f"services already running in {where}")
    running = services.up(where)
    sys.stdout.write(running.exports())
    sys.stdout.flush()
    _progress(f"ready: Redis at {running.redis_url}, Postgres at {running.database_url}")


@services_app.command("down")
def services_down(directory: DirOption = None) -> None:
    """Stop the embedded services started by `services up` in the same directory."""
    where = _services_dir(directory)
    if services.down(where):
        _progress(f"stopped the services in {where}")
    else:
        _progress(f"no services were running in {where}")


# --- log, export -----------------------------------------------------------------------------

_SOURCE_STYLE = {
    "agent": "cyan",
    "user": "green",
    "runtime": "yellow",
    "memory": "magenta",
    "condenser": "blue",
    "system": "dim",
}
_BASE_FIELDS = frozenset(events.Event.__struct_fields__)
_TEXT_WIDTH = 160


# C0 controls but tab and newline, DEL, C1 controls, and the bidirectional overrides that
# reorder what a terminal shows ("Trojan Source").
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def visible(text: str) -> str:
    """``text`` with every control character a program could use to drive the terminal
    (ESC of a CSI or OSC sequence, BEL, a C1 control, a bidi override) shown as an escape
    such as ``\\x1b``: output of commands is printed, never obeyed.  Tab and newline stay."""
    return _UNSAFE.sub(_escape, text)


def _cell(text: str) -> Text:
    """A table cell of text from the data: escaped, and never read as rich markup."""
    return Text(visible(text))


def _one_line(text: str, width: int = _TEXT_WIDTH) -> str:
    flat = " ".join(visible(text).split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _specific(event: events.Event) -> dict[str, Any]:
    """The fields that belong to the event's kind (not the envelope every event has)."""
    raw = events.to_builtins(event)
    return {k: v for k, v in raw.items() if k not in _BASE_FIELDS and k != "kind"}


def _summary(event: events.Event) -> str:
    """The main content of an event, as one short line."""
    match event:
        case events.CmdRun(command=command, is_input=is_input):
            return f"(input) {command}" if is_input else f"$ {command}"
        case events.CmdOutput(content=content, exit_code=code, timed_out=timed_out):
            status = "timed out" if timed_out else f"exit {code}"
            return f"[{status}] {content}"
        case events.FileRead(path=path, start=start, end=end):
            return f"{path}:{start}-{end}" if end is not None else f"{path}:{start}-"
        case events.FileWrite(path=path, content=content):
            return f"{path} ({len(content)} chars)"
        case events.FileEdit(command=command, path=path):
            return f"{command} {path}"
        case events.FileContent(path=path, content=content):
            return f"{path}: {content}"
        case events.FileEdited(path=path, diff=diff):
            return f"{path}: {diff}"
        case events.Recall(recall_type=recall_type, query=query, k=k):
            return f"{recall_type} k={k}: {query}"
        case events.RecallResult(recall_type=recall_type, hits=hits, knowledge=knowledge):
            return f"{recall_type}: {len(hits)} hits, {len(knowledge)} knowledge"
        case events.Error(reason=reason, content=content, retryable=retryable):
            return f"{reason}{' (retryable)' if retryable else ''}: {content}"
        case events.Condensation(forgotten=forgotten, summary=summary):
            ranges = ", ".join(f"{a}-{b}" for a, b in forgotten)
            return f"forgot [{ranges}]" + (f": {summary}" if summary else "")
        case events.Forked(source_session=source_session, at=at, workspace=workspace):
            return f"forked from {source_session} at {at} (sandbox: {workspace})"
        case events.SandboxRebuilt(method=method, actions=actions, differences=differences, note=note):
            done = (
                f"{method}: {actions} actions re-run, {len(differences)} differences" if method == "replay" else method
            )
            return done + (f"; {note}" if note else "")
        case events.ContextEdit(op=op, ranges=ranges, kinds=kinds, note=note):
            what = [f"{a}-{b}" if a != b else str(a) for a, b in ranges] + [f"--kind {k}" for k in kinds]
            return f"{op} {' '.join(what)}" + (f": {note}" if note else "")
        case events.PythonRun(code=code):
            return f">>> {code}"
        case events.PythonOutput():
            return _python_summary(event)
        case events.SessionConfig(env=env, condenser=condenser):
            parts = [f"{name}={value}" if value is not None else f"unset {name}" for name, value in env.items()]
            if condenser:
                parts.append("condenser " + " ".join(f"{k}={v}" for k, v in condenser.items()))
            return ", ".join(parts)
        case events.Finish(final_thought=final_thought, outputs=outputs):
            return final_thought + (f" outputs: {json.dumps(outputs, default=str)}" if outputs else "")
        case events.LlmResponse(model=model, content=content, tool_calls=tool_calls):
            return f"{model}: {content or ''} ({len(tool_calls)} tool calls)"
        case events.Unknown(original_kind=original_kind, payload=payload):
            return f"{original_kind}: {json.dumps(payload, default=str)}"
    fields = _specific(event)
    for name in ("content", "thought", "final_thought", "query", "code", "path", "summary"):
        value = fields.get(name)
        if isinstance(value, str) and value:
            return value
    return json.dumps(fields, default=str) if fields else ""


def _python_summary(event: events.PythonOutput) -> str:
    """A cell's printed output, then its value (``→ 42``), its exception's last line, the
    files it saved, and whether it timed out or lost the interpreter's state."""
    parts = [event.content.strip()] if event.content.strip() else []
    if event.result is not None:
        parts.append(f"→ {event.result}")
    if event.exception:
        parts.append("raised " + event.exception.strip().splitlines()[-1])
    if event.files:
        parts.append("files: " + ", ".join(event.files))
    flags = [name for name, on in (("timed out", event.timed_out), ("state lost", event.state_lost)) if on]
    return (f"[{', '.join(flags)}] " if flags else "") + " ".join(parts)


def _ts(ts: dt.datetime) -> str:
    if ts.tzinfo is not None:
        ts = ts.astimezone(dt.UTC)
    return ts.strftime("%Y-%m-%d %H:%M:%S.") + f"{ts.microsecond // 1000:03d}"


def render(event: events.Event) -> Text:
    """One readable, coloured line for an event."""
    kind = event.kind if not isinstance(event, events.Unknown) else f"?{visible(event.original_kind)}"
    kind_style = "bold red" if isinstance(event, events.Error) else "bold" if isinstance(event, events.Action) else ""
    line = Text()
    line.append(f"{event.id or '':>6} ", style="bold")
    line.append(f"{_ts(event.ts)} ", style="dim")
    line.append(f"{visible(str(event.source)):<9} ", style=_SOURCE_STYLE.get(event.source, ""))
    line.append(f"{kind:<20} ", style=kind_style)
    if event.cause is not None:
        line.append(f"←{event.cause} ", style="dim")
    line.append(_one_line(_summary(event)))
    return line


def _check_range(start: int, until: int | None) -> None:
    if start < 1:
        raise InputError(f"--from must be 1 or more, not {start}")
    if until is not None and until < start:
        raise InputError(f"--until ({until}) must not be before --from ({start})")


async def _require_events(bus: Bus, session: str) -> None:
    if not await bus.session(session).last_id():
        raise NotFoundError(f"session {session!r} has no events (`riverbed sessions` lists the sessions)")


@app.command("log")
def log_cmd(
    session: SessionArg,
    *,
    start: Annotated[int, typer.Option("--from", help="First event id.")] = 1,
    until: Annotated[int | None, typer.Option("--until", help="Last event id.", show_default=False)] = None,
    as_json: JsonOption = False,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep tailing new events (Ctrl-C stops).")] = False,
    prefix: PrefixOption = None,
) -> None:
    """The raw events of a session (readable, or JSON lines with --json)."""
    settings = _settings(prefix)
    _check_range(start, until)
    console = Console(highlight=False, soft_wrap=True)

    async def go() -> None:
        async with _bus(settings) as bus:
            handle = bus.session(session)
            if not follow:
                await _require_events(bus, session)
            async for event in handle.log(start, until, follow=follow):
                if as_json:
                    _stdout_lines([events.encode_json(event)], flush_each=follow)
                else:
                    console.print(render(event))

    _run(go, interrupt_code=0 if follow else None)


@app.command("export")
def export_cmd(
    session: SessionArg,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Write to this file instead of stdout.", show_default=False)
    ] = None,
    prefix: PrefixOption = None,
) -> None:
    """A whole session as JSON lines (the input of `riverbed import`)."""
    settings = _settings(prefix)

    async def go() -> int:
        async with _bus(settings) as bus:
            await _require_events(bus, session)
            count = 0
            with _output(out) as sink:
                async for event in bus.session(session).log():
                    sink.write(events.encode_json(event))
                    sink.write(b"\n")
                    count += 1
            return count

    count = _run(go)
    if out is not None:
        _progress(f"exported {count} events of {session!r} to {out}")


@contextlib.contextmanager
def _output(path: Path | None) -> Iterator[Any]:
    if path is None:
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    try:
        handle = path.open("wb")
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from exc
    with handle:
        yield handle


# --- import ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Row:
    line: int
    payload: bytes
    cause: int
    tenant: str | None
    event: events.Event


def _normalise_ts(event: events.Event) -> events.Event:
    """Timestamps are UTC; a naive one in a hand-written file is taken as UTC."""
    ts = event.ts
    if ts.tzinfo is None:
        return replace(event, ts=ts.replace(tzinfo=dt.UTC))
    if ts.utcoffset() != dt.timedelta(0):
        return replace(event, ts=ts.astimezone(dt.UTC))
    return event


def parse_import(
    lines: Iterable[bytes], name: str, *, keep_unknown: bool = False, max_bytes: int | None = None
) -> list[_Row]:
    """Validate every line of an export and encode it; raises InputError naming the first bad line.

    Ids, when present, must be 1, 2, 3… in file order; missing ids are assigned by position.
    A line is read as the log reads it (fields a newer version wrote are ignored), then
    checked like any appended event: the schema's bounds, nesting, ``max_bytes``, reserved
    environment names.
    """
    rows: list[_Row] = []
    answered: dict[int, int] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line:
            continue
        where = f"{name} line {number}"
        try:
            event = events.decode_json(line, keep_id=True)
        except events.DecodeError as exc:
            raise InputError(f"{where}: {exc}") from exc
        expected_id = len(rows) + 1
        if event.id is not None and event.id != expected_id:
            raise InputError(
                f"{where}: event id {event.id} out of order (expected {expected_id}; ids must be 1, 2, 3… or absent)"
            )
        if isinstance(event, events.Unknown):
            payload = event.payload
            if "kind" not in payload:
                raise InputError(f"{where}: the object has no 'kind' field")
            if not keep_unknown:
                raise InputError(
                    f"{where}: unknown event kind {event.original_kind!r} or version "
                    "(`riverbed schema` lists the kinds; --keep-unknown imports it as it is)"
                )
            event = events.Unknown(payload={k: v for k, v in payload.items() if k != "id"})
        else:
            event = _normalise_ts(replace(event, id=None))
        cause = answered_cause(event)
        if cause:
            if cause in answered:
                raise InputError(
                    f"{where}: action {cause} is already answered by event {answered[cause]} "
                    "(an action gets exactly one observation)"
                )
            answered[cause] = expected_id
        try:
            payload_bytes = events.check(event, max_bytes=max_bytes)
        except InputError as exc:
            raise InputError(f"{where}: {exc}") from exc
        rows.append(_Row(number, payload_bytes, cause, event.tenant, events.with_id(event, expected_id)))
    if not rows:
        raise InputError(f"{name} holds no events")
    return rows


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
    from riverbed.agent.replay import RuntimeStart, start_runtime_after  # noqa: PLC0415

    settings = _settings(prefix)
    if into is None:
        if file == "-":
            raise InputError("reading stdin needs --into SESSION to name the new session")
        into = Path(file).name.split(".", 1)[0]
    lines = _read_input(file)
    rows = parse_import(
        lines, "stdin" if file == "-" else file, keep_unknown=keep_unknown, max_bytes=settings.max_event_bytes
    )
    session = into
    start = RuntimeStart()
    for row in rows:
        start.see(row.event)

    async def go() -> None:
        async with _bus(settings) as bus:
            store = bus.log_store
            store.check_session(session)
            existing = await store.last_id(session)
            if existing:
                raise InputError(
                    f"session {session!r} already has {existing} events; import only into a new "
                    "session (choose another --into)"
                )
            # Imported actions are answered already: a running runtime worker must not run them
            # again (as for a fork); one still unanswered in the file runs in the new session.
            await start_runtime_after(bus, session, start.after(len(rows)))
            tenant = rows[0].tenant
            last = 0
            for begin in range(0, len(rows), IMPORT_BATCH):
                batch = rows[begin : begin + IMPORT_BATCH]
                try:
                    result = await store.append_raw(
                        session, [(r.payload, r.cause) for r in batch], expected_last=last, tenant=tenant
                    )
                except AppendConflict as exc:
                    if last == 0:
                        raise InputError(
                            f"session {session!r} already has {exc.actual} events; import only into a new "
                            "session (choose another --into)"
                        ) from exc
                    raise InputError(
                        f"session {session!r} was written to by someone else during the import "
                        f"(after event {last}); the import stopped there"
                    ) from exc
                if isinstance(result, AlreadyAnswered):
                    raise result
                last = result[-1]

    _run(go)
    _progress(f"imported {len(rows)} events into {session!r}")


# --- sessions, schema ------------------------------------------------------------------------


def _iso_ms(value: str | None) -> str | None:
    if not value:
        return None
    return dt.datetime.fromtimestamp(int(value) / 1000, dt.UTC).isoformat(timespec="milliseconds")


@app.command("sessions")
def sessions_cmd(as_json: JsonOption = False, prefix: PrefixOption = None) -> None:
    """Every session: its last event id, tenant and creation time."""
    settings = _settings(prefix)

    async def go() -> list[dict[str, Any]]:
        async with _bus(settings) as bus:
            names = await bus.sessions()
            rows: list[dict[str, Any]] = []
            chunk = 500
            for begin in range(0, len(names), chunk):
                part = names[begin : begin + chunk]
                metas = await _metas(bus, part)
                for name, (last, tenant, created) in zip(part, metas, strict=True):
                    rows.append(
                        {
                            "session": name,
                            "last": int(last or 0),
                            "tenant": tenant.decode() if tenant else None,
                            "created": _iso_ms(created.decode() if created else None),
                        }
                    )
            return rows

    rows = _run(go)
    if as_json:
        _stdout_lines(msgspec.json.encode(row) for row in rows)
        return
    if not rows:
        _progress("no sessions yet")
        return
    table = Table("session", "last id", "tenant", "created", box=None, header_style="bold")
    for row in rows:
        table.add_row(row["session"], str(row["last"]), _cell(row["tenant"] or ""), row["created"] or "")
    Console(highlight=False).print(table)


async def _metas(bus: Bus, names: list[str]) -> list[list[bytes | None]]:
    with translate(bus.url):
        async with bus.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hmget(bus.keys.meta(name), "last", "tenant", "created")
            result: list[list[bytes | None]] = await pipe.execute()
    return result


@app.command("schema")
def schema_cmd() -> None:
    """JSON Schema of every event kind (for agents written in other languages)."""
    sys.stdout.write(json.dumps(events.json_schema(), indent=2, sort_keys=True) + "\n")


# --- workers and actions -------------------------------------------------------------------


@app.command("worker")
def worker_command(
    roles: Annotated[list[str], typer.Argument(help="runtime, memory, condenser, or all.")],
    concurrency: Annotated[
        int | None,
        typer.Option("--concurrency", envvar="RIVERBED_CONCURRENCY", help="Sessions owned at most per role."),
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="Worker name (default host-pid).")] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option("--metrics-port", envvar="RIVERBED_METRICS_PORT", help="Serve /metrics, /healthz, /readyz."),
    ] = None,
    prefix: PrefixOption = None,
) -> None:
    """Run a long-lived worker for the given roles until SIGTERM/SIGINT (then drain and hand over)."""
    from riverbed.workers.main import parse_roles, run_worker  # noqa: PLC0415

    settings = _settings(prefix, concurrency=concurrency, metrics_port=metrics_port)
    chosen = parse_roles(roles)
    if not settings.redis_url:
        settings = _settings(prefix, concurrency=concurrency, metrics_port=metrics_port, redis_url=_redis_url(settings))
    configure_logging(settings.log_format)
    try:
        anyio.run(lambda: run_worker(chosen, settings, name=name))
    except BaseExceptionGroup as group:
        raise _leaf(group) from None


def _json_argument(text: str) -> bytes:
    """The JSON an argument gives: the text itself, ``@FILE`` (a file's contents) or ``-`` (stdin)."""
    if text == "-":
        return sys.stdin.buffer.read()
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            return path.read_bytes()
        except OSError as exc:
            raise InputError(f"cannot read {text[1:]}: {exc.strerror or exc}") from exc
    return text.encode("utf-8", "surrogateescape")


def _action_from_json(text: str) -> events.Action:
    event = events.from_json(_json_argument(text))
    if not isinstance(event, events.Action):
        raise InputError(
            f"{event.kind!r} is not an action (see `riverbed schema`); `riverbed append` appends any event"
        )
    return event


EventArg = Annotated[
    str,
    typer.Argument(
        help='JSON, e.g. \'{"kind": "cmd_run", "command": "ls"}\'; @FILE reads it from a file, - from stdin.',
        show_default=False,
    ),
]
TenantOption = Annotated[
    str | None,
    typer.Option(
        "--tenant", help="Tenant of a new session; on an existing one, checked against its own (default: its own)."
    ),
]
AgentOption = Annotated[str | None, typer.Option("--agent", help="Agent name recorded on the events.")]


@app.command("act")
def act_command(
    session: SessionArg,
    action: EventArg,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for the observation.")] = 60.0,
    tenant: TenantOption = None,
    agent: AgentOption = None,
    prefix: PrefixOption = None,
) -> None:
    """Append one action, wait for its observation and print it as one JSON line.

    A kind nothing answers (message, think, finish) prints the appended action at once.
    """
    parsed = _action_from_json(action)
    settings = _settings(prefix)

    async def go() -> bytes:
        async with _bus(settings) as bus:
            handle = await bus.operate(session, tenant=tenant, agent=agent)
            answer = await handle.act(parsed, timeout=timeout)
            return events.encode_json(answer)

    _stdout_lines([_run(go)])


@app.command("append")
def append_command(
    session: SessionArg,
    event: Annotated[
        str,
        typer.Argument(
            help="An event as JSON, or an array of events appended together; @FILE reads a file, - stdin.",
            show_default=False,
        ),
    ],
    expected_last: Annotated[
        int | None,
        typer.Option("--expected-last", help="Refuse unless the session's last event id is this.", show_default=False),
    ] = None,
    idempotency_key: Annotated[
        str | None,
        typer.Option("--idempotency-key", help="A retry with the same key appends nothing.", show_default=False),
    ] = None,
    tenant: TenantOption = None,
    agent: AgentOption = None,
    as_json: Annotated[bool, typer.Option("--json", help='Print {"session": …, "ids": […]}.')] = False,
    prefix: PrefixOption = None,
) -> None:
    """Append any event(s) without waiting for an answer; prints the new id(s), one a line."""
    batch = events.events_from_json(_json_argument(event))
    settings = _settings(prefix)

    async def go() -> list[int]:
        async with _bus(settings) as bus:
            handle = await bus.operate(session, tenant=tenant, agent=agent)
            return await handle.append(*batch, expected_last=expected_last, idempotency_key=idempotency_key)

    ids = _run(go)
    if as_json:
        _stdout_lines([msgspec.json.encode({"session": session, "ids": ids})])
    else:
        _stdout_lines(str(i).encode() for i in ids)


@app.command("view")
def view_command(
    session: SessionArg,
    until: Annotated[
        int | None, typer.Option("--until", help="The view right after this event.", metavar="N", show_default=False)
    ] = None,
    json_out: JsonOption = False,
    prefix: PrefixOption = None,
) -> None:
    """The condensed view: the context exactly as the agent saw it after event N."""
    settings = _settings(prefix)

    async def go() -> list[events.Event]:
        async with _bus(settings) as bus:
            await _require_events(bus, session)
            last = await bus.session(session).last_id()
            if until is not None and not 1 <= until <= last:
                raise InputError(f"cannot view session {session!r} at {until}: choose an event id from 1 to {last}")
            return list(await bus.session(session).view(until=until))

    context = _run(go)
    if json_out:
        _stdout_lines(events.encode_json(e) for e in context)
        return
    console = Console(highlight=False, soft_wrap=True)
    for event in context:
        console.print(render(event))


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
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object: the fork and its rebuild.")] = False,
    prefix: PrefixOption = None,
) -> None:
    """New session whose log is events 1..N of the source (same ids), then a `forked` event;
    its sandbox is rebuilt as it was at N. Exit 3 when an observation came out differently."""
    from riverbed.agent.replay import fork, wait_rebuilt  # noqa: PLC0415

    settings = _settings(prefix)
    if timeout < 0:
        raise InputError(f"--timeout must be 0 or more, not {timeout:g}")

    async def go() -> tuple[int, events.SandboxRebuilt | None]:
        async with _bus(settings) as bus:
            forked_id = await fork(bus, session, at, into, workspace=workspace)  # type: ignore[arg-type]
            if workspace == "empty" or timeout == 0:
                return forked_id, None
            err_console.print(
                f"forked {session} at event {at} into {into}; waiting for a runtime worker to rebuild its sandbox …",
                style="dim",
            )
            return forked_id, await wait_rebuilt(bus, into, forked_id, timeout=timeout)

    forked_id, built = _run(go)
    if json_out:
        report = {"session": into, "source": session, "at": at, "forked_id": forked_id, "workspace": workspace}
        if built is not None:
            report |= {"actions": built.actions, "differences": built.differences, "note": built.note}
        _stdout_lines([msgspec.json.encode(report)])
    else:
        err_console.print(f"forked {session} at event {at} into {into} (its last event is {forked_id})")
        if built is None and workspace != "empty":
            err_console.print(f"its sandbox is rebuilt ({workspace}) when a runtime worker takes {into}")
        elif built is not None:
            err_console.print(_rebuilt_summary(built))
    if built is not None and built.differences:
        raise typer.Exit(3)


def _rebuilt_summary(built: events.SandboxRebuilt) -> Text:
    if built.method == "copy":
        line = Text("sandbox rebuilt: copied the source's workspace")
        return line.append(f" ({visible(built.note)})" if built.note else "")
    line = Text(f"sandbox rebuilt by replaying {built.actions} actions: ")
    if not built.differences:
        return line.append("every observation matched the recording")
    line.append(f"{len(built.differences)} differences from the recording", style="bold yellow")
    for d in built.differences:
        line.append(f"\n  action {d.action_id} ({d.kind}): {d.field} was {_one_line(repr(d.recorded), 80)}, "
                    f"now {_one_line(repr(d.new), 80)}")  # fmt: skip
    return line


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
    from riverbed.workers.runtime_role import checked_sandbox  # noqa: PLC0415

    settings = _settings(prefix)

    async def go() -> list[Any]:
        runtime = Runtime(workspace_root=Path(settings.workspace), sandbox=checked_sandbox(settings))
        try:
            async with _bus(settings) as bus:
                await _require_events(bus, session)
                return list(await rerun(bus, session, runtime, into=into, seed=seed))
        finally:
            with anyio.CancelScope(shield=True):
                await runtime.aclose()

    differences = _run(go)
    if json_out:
        _stdout_lines(msgspec.json.encode(d) for d in differences)
    elif not differences:
        err_console.print("no differences: every observation matched the recording")
    else:
        for d in differences:
            err_console.print(f"action {d.action_id} ({d.kind}): {d.field} was {d.recorded!r}, now {d.new!r}")
    if differences:
        raise typer.Exit(3)


# --- operations ----------------------------------------------------------------------------


@app.command("status")
def status_command(json_out: JsonOption = False, prefix: PrefixOption = None) -> None:
    """Roles, workers, owners, lag, pending and dead letters."""
    from riverbed.bus import stats  # noqa: PLC0415

    settings = _settings(prefix)

    async def go() -> Any:
        async with _bus(settings) as bus:
            return await stats.status(bus.redis, bus.keys, url=bus.url)

    snapshot = _run(go)
    if json_out:
        import dataclasses  # noqa: PLC0415

        sys.stdout.write(json.dumps(dataclasses.asdict(snapshot), default=str) + "\n")
        return
    console = Console(highlight=False)
    table = Table("role", "lag", "pending", "oldest pending (s)", "owned sessions", "waiting for an owner")
    for role in snapshot.roles:
        owned = sum(1 for s in role.sessions if s.owned)
        table.add_row(
            role.role,
            str(role.lag),
            str(role.pending),
            f"{role.oldest_pending_seconds:.1f}",
            str(owned),
            str(role.directory.lag),
        )
    console.print(table)
    workers = Table("worker", "roles", "heartbeat age (s)", "owned")
    for w in snapshot.workers:
        owned_by_role = w.description.get("owned", {})
        workers.add_row(
            _cell(w.name),
            ",".join(w.description.get("roles", [])),
            f"{w.age_seconds:.1f}",
            ", ".join(f"{r}:{len(s)}" for r, s in owned_by_role.items()),
        )
    console.print(workers)
    for failure in snapshot.failing:  # a loop that keeps failing says so (and /readyz is red)
        since = dt.datetime.fromtimestamp(failure.since, dt.UTC).isoformat(timespec="seconds")
        line = Text("failing: ", style="bold red")
        line.append(
            f"worker {failure.worker}, {failure.role} {failure.loop} loop, since {since} "
            f"({failure.attempts} attempts): {failure.error}"
        )
        console.print(line)
    console.print(f"sessions: {snapshot.sessions}   dead letters: {snapshot.dead_letters}")


dlq_app = typer.Typer(help="Dead letters: entries a role could not handle.", no_args_is_help=True)
app.add_typer(dlq_app, name="dlq")


@dlq_app.command("list")
def dlq_list(json_out: JsonOption = False, prefix: PrefixOption = None) -> None:
    """List dead letters (oldest first)."""
    from riverbed.bus.dlq import DeadLetters  # noqa: PLC0415

    settings = _settings(prefix)

    async def go() -> list[Any]:
        async with _bus(settings) as bus:
            return list(await DeadLetters(bus.redis, bus.keys, bus.url).list())

    letters = _run(go)
    if json_out:
        _stdout_lines(json.dumps(letter.as_dict()).encode() for letter in letters)
        return
    table = Table("id", "session", "event", "role", "attempts", "reason")
    for letter in letters:
        table.add_row(
            letter.id, letter.session, str(letter.event_id), letter.role, str(letter.attempts), _cell(letter.reason)
        )
    Console(highlight=False).print(table)


@dlq_app.command("requeue")
def dlq_requeue(
    letter_id: Annotated[str, typer.Argument(help="Dead letter id (from `riverbed dlq list`).")],
    prefix: PrefixOption = None,
) -> None:
    """Append the dead-lettered event to its session again (a new id) and remove the dead letter."""
    from riverbed.bus.dlq import DeadLetters  # noqa: PLC0415

    settings = _settings(prefix)

    async def go() -> int:
        async with _bus(settings) as bus:
            letters = DeadLetters(bus.redis, bus.keys, bus.url)
            letter = await letters.get(letter_id)
            result = await bus.log_store.append_raw(letter.session, [(letter.payload, 0)])
            if isinstance(result, AlreadyAnswered):
                raise AlreadyAnswered(
                    result.cause, result.existing, f"that event is already answered by event {result.existing}"
                )
            await letters.remove(letter_id)
            return result[0]

    new_id = _run(go)
    err_console.print(f"requeued dead letter {letter_id} as event {new_id}")


@app.command("demo")
def demo_command(prefix: PrefixOption = None) -> None:
    """Start embedded services if needed, run every role in-process and drive a demo session."""
    from riverbed.workers.demo import run_demo  # noqa: PLC0415

    started = dt.datetime.now(dt.UTC)
    settings = _settings(prefix)
    embedded = not settings.redis_url or not settings.database_url
    url = _redis_url(settings)
    if not settings.database_url:
        _progress("RIVERBED_DATABASE_URL is not set: using the embedded Postgres")
    configure_logging(settings.log_format, level="warning")
    console = Console(highlight=False)

    async def go() -> Any:
        return await run_demo(settings, console, redis_url=url)

    result = _run(go)
    console.print()
    for check, passed in result.checks.items():
        console.print(("[green]✔[/] " if passed else "[red]✘[/] ") + check)
    seconds = (dt.datetime.now(dt.UTC) - started).total_seconds()
    console.print(
        f"\nsession [bold]{result.session}[/] ({result.events} events, view {result.view_size}), "
        f"fork [bold]{result.fork}[/]; done in {seconds:.1f}s.\n"
        f"\nLook at it:\n"
        f"  riverbed log {result.session}                 every event\n"
        f"  riverbed view {result.session} --until 8      the agent's context right after event 8\n"
        f"  riverbed log {result.fork}            the fork, rebuilt at event 12"
        + (
            f"\n  riverbed usage {result.agent_session}    the LLM agent's tokens and cost"
            if result.agent_session
            else ""
        )
    )
    if embedded:
        where = shlex.quote(str(_services_dir(None)))
        console.print(
            f"\nThe demo started Redis and Postgres in {where}; they keep running for the commands above.\n"
            f"Stop them: riverbed services down --dir {where}"
        )
    if not result.ok:
        raise typer.Exit(1)


@app.command("archive")
def archive_command(
    session: SessionArg,
    older_than: Annotated[
        float | None,
        typer.Option(
            "--older-than",
            help="Only events older than this many seconds (default RIVERBED_RETENTION_SECONDS, else 0).",
            show_default=False,
        ),
    ] = None,
    keep_last: Annotated[
        int | None,
        typer.Option(
            "--keep-last",
            envvar="RIVERBED_RETENTION_KEEP_LAST",
            help="Events always left in Redis (default 1000).",
            show_default=False,
        ),
    ] = None,
    prefix: PrefixOption = None,
) -> None:
    """Copy the old events every role has finished with to the Postgres archive, then trim them from Redis."""
    from riverbed.bus.archive import retain  # noqa: PLC0415

    settings = _settings(prefix, retention_keep_last=keep_last)
    if not settings.database_url:
        raise ConfigError("riverbed archive needs RIVERBED_DATABASE_URL: the Postgres database that keeps the archive")
    age = older_than if older_than is not None else settings.retention_seconds

    async def go() -> tuple[int, str]:
        async with _bus(settings) as bus:
            await _require_events(bus, session)
            assert bus.archive is not None
            trimmed = await retain(
                bus.redis,
                bus.keys,
                bus.archive,
                session,
                older_than_seconds=age,
                keep_last=settings.retention_keep_last,
                url=bus.url,
            )
            return trimmed, (await bus.log_store.meta(session)).get("archived_to", "0")

    trimmed, archived_to = _run(go)
    if archived_to == "0":
        err_console.print(
            f"nothing of {session} archived: no event older than {age:g}s before the last "
            f"{settings.retention_keep_last} is finished with by every role"
        )
    else:
        err_console.print(f"trimmed {trimmed} events of {session} from Redis; events 1..{archived_to} are archived")


# --- serve, keys (the HTTP API: riverbed.serve) ----------------------------------------------

keys_app = typer.Typer(help="API keys of the HTTP API (riverbed serve).", no_args_is_help=True)
app.add_typer(keys_app, name="keys")


@app.command("serve")
def serve_command(
    host: Annotated[str, typer.Option("--host", envvar="RIVERBED_SERVE_HOST", help="Address to listen on.")] = (
        "127.0.0.1"
    ),
    port: Annotated[
        int, typer.Option("--port", envvar="RIVERBED_SERVE_PORT", help="Port to listen on (0: any free port).")
    ] = 8300,
    prefix: PrefixOption = None,
) -> None:
    """Serve the HTTP API (/v1, /openapi.json) and the web console (/) until SIGINT/SIGTERM."""
    from riverbed.serve import Api, ServeConfig, serve  # noqa: PLC0415

    settings = _settings(prefix)
    configure_logging(settings.log_format)
    # A body holds at least one event of RIVERBED_MAX_EVENT_BYTES (JSON is larger than msgpack).
    config = ServeConfig(
        max_body_bytes=max(ServeConfig.max_body_bytes, 2 * settings.max_event_bytes), prices=settings.prices
    )
    from riverbed.agent.usage import parse_prices  # noqa: PLC0415

    parse_prices(settings.prices)  # a bad price table is refused before anything listens

    async def go() -> None:
        async with _bus(settings) as bus, anyio.create_task_group() as tg:
            bound = await tg.start(serve, Api(bus, config), host, port)
            shown = f"[{host}]" if ":" in host else host
            err_console.print(f"riverbed: serving http://{shown}:{bound} (console at /, API at /v1)")

    try:  # uvloop, where installed, takes a tenth to a quarter off every request
        import uvloop  # noqa: F401, PLC0415

        options = {"use_uvloop": True}
    except ImportError:
        options = {}
    try:
        anyio.run(go, backend_options=options)
    except BaseExceptionGroup as group:
        raise _leaf(group) from None


@keys_app.command("create")
def keys_create(
    tenant: Annotated[str | None, typer.Option("--tenant", help="The tenant whose sessions the key sees.")] = None,
    admin: Annotated[bool, typer.Option("--admin", help="An operator key that sees every tenant.")] = False,
    note: Annotated[str | None, typer.Option("--note", help="What the key is for (shown by keys list).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help='Print {"key": …, "tenant": …, "id": …}.')] = False,
    prefix: PrefixOption = None,
) -> None:
    """Create an API key and print it once (only its hash is kept)."""
    from riverbed.serve import KeyStore  # noqa: PLC0415

    settings = _settings(prefix)

    async def go() -> tuple[str, Any]:
        async with _bus(settings) as bus:
            return await KeyStore(bus.redis, bus.keys, bus.url).create(tenant, admin=admin, note=note)

    key, record = _run(go)
    if as_json:
        _stdout_lines([msgspec.json.encode({"key": key, "tenant": tenant, "id": record.id, "admin": admin})])
        return
    _stdout_lines([key.encode()])
    who = "admin key" + (f" (tenant {tenant})" if tenant else "") if admin else f"key for tenant {tenant}"
    _progress(f"created {who}, id {record.id}; it is shown only this once")


@keys_app.command("list")
def keys_list(json_out: JsonOption = False, prefix: PrefixOption = None) -> None:
    """Every API key: id, tenant, admin, created, revoked (never the key)."""
    from riverbed.serve import KeyStore  # noqa: PLC0415

    settings = _settings(prefix)

    async def go() -> list[Any]:
        async with _bus(settings) as bus:
            return await KeyStore(bus.redis, bus.keys, bus.url).list()

    records = _run(go)
    if json_out:
        _stdout_lines(msgspec.json.encode(r.public()) for r in records)
        return
    if not records:
        _progress("no API keys yet (riverbed keys create --tenant T)")
        return
    table = Table("id", "tenant", "admin", "created", "revoked", "note", box=None, header_style="bold")
    for r in records:
        table.add_row(
            r.id,
            _cell(r.tenant or ""),
            "yes" if r.admin else "",
            _iso_ms(str(int(r.created * 1000))) or "",
            _iso_ms(str(int(r.revoked * 1000))) if r.revoked else "",
            _cell(r.note or ""),
        )
    Console(highlight=False).print(table)


@keys_app.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="The key's id (from `riverbed keys list`).")],
    prefix: PrefixOption = None,
) -> None:
    """Revoke an API key: requests with it are refused (401) from now on."""
    from riverbed.serve import KeyStore  # noqa: PLC0415

    settings = _settings(prefix)

    async def go() -> Any:
        async with _bus(settings) as bus:
            return await KeyStore(bus.redis, bus.keys, bus.url).revoke(key_id)

    record = _run(go)
    _progress(f"revoked key {record.id} of tenant {record.tenant or '(admin)'}")


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
    model: Annotated[
        str | None, typer.Option("--model", help="suggest: the model (RIVERBED_SUGGEST_MODEL).", show_default=False)
    ] = None,
    prefix: PrefixOption = None,
) -> None:
    """The agent's context: what it sees, what is hidden and what hid it, what is pinned.

    `context S suggest "drop the detour about X"` asks a model which events to drop and prints
    the proposal as a diff; `--apply` appends it (a condensation by the user).

    `context S forget 12-40`, `forget --kind error`, `restore 12-40`, `pin 7`, `unpin 7` each
    append one context_edit event and print what it changed (JSON on stdout, a sentence on stderr).
    """
    settings = _settings(prefix)
    if op is None:
        _context_show(settings, session, until, json_out)
        return
    if op == "suggest":
        _context_suggest(settings, session, " ".join(targets or ()), apply=apply, model=model)
        return
    if op not in _CONTEXT_OPS:
        raise InputError(
            f"unknown context operation {op!r}: use {', '.join(_CONTEXT_OPS)} or suggest, or none to show it"
        )
    if until is not None:
        raise InputError("--until is for showing the context; an edit always applies after the last event")
    _context_edit(settings, session, op, targets, kind, note)


def _context_show(settings: Settings, session: str, until: int | None, json_out: bool) -> None:
    from riverbed.memory.context import describe, document  # noqa: PLC0415

    async def go() -> Any:
        async with _bus(settings) as bus:
            await _require_events(bus, session)
            return await bus.session(session).context.show(until)

    report = _run(go)
    if json_out:
        _stdout_lines([msgspec.json.encode(document(session, report))])
        return
    console = Console(highlight=False, soft_wrap=True)
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
    settings: Settings, session: str, op: str, targets: list[str] | None, kinds: list[str] | None, note: str | None
) -> None:
    from riverbed.memory.context import parse_range  # noqa: PLC0415

    spans = [parse_range(r) for r in targets or ()]

    async def go() -> Any:
        async with _bus(settings) as bus:
            await _require_events(bus, session)
            handle = await bus.operate(session)  # an operator's edit, as the session's own tenant
            return await handle.context.edit(
                op,  # type: ignore[arg-type]  # checked against _CONTEXT_OPS
                ranges=spans,
                kinds=kinds or (),
                note=note,
            )

    changed = _run(go)
    _stdout_lines([msgspec.json.encode(changed)])
    parts = [
        f"{verb} {len(ids)} event{'s' if len(ids) != 1 else ''} ({_id_list(ids)})"
        for verb, ids in (
            ("hid", changed.hidden),
            ("showed again", changed.shown),
            ("pinned", changed.pinned),
            ("unpinned", changed.unpinned),
        )
        if ids
    ]
    err_console.print(f"context edit {changed.edit} ({op}): " + ("; ".join(parts) or "nothing changed"), markup=False)


def _id_list(ids: tuple[int, ...]) -> str:
    """``1, 2, 3, 7`` as ``1-3, 7``."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


# --- usage: tokens and cost per model call -------------------------------------------------------


@app.command("usage")
def usage_command(session: SessionArg, json_out: JsonOption = False, prefix: PrefixOption = None) -> None:
    """Prompt, cached and completion tokens and cost of every model call, and the session's totals.

    Costs come from RIVERBED_PRICES (USD per million tokens per model); without a price a cost is empty.
    A row at each condensation shows the view's tokens (and events) right before and after it.
    """
    from riverbed.agent.usage import parse_prices, usage  # noqa: PLC0415

    settings = _settings(prefix)
    prices = parse_prices(settings.prices)

    async def go() -> Any:
        async with _bus(settings) as bus:
            await _require_events(bus, session)
            return usage(await bus.session(session).events(), prices)

    report = _run(go)
    if json_out:
        _stdout_lines([msgspec.json.encode({"session": session, **msgspec.to_builtins(report)})])
        return
    table = Table("event", "model", "prompt", "cached", "completion", "cost (USD)")

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
    Console(highlight=False).print(table)


# --- agent: the reference LLM agent from the command line (issue 17) ----------------------------
# Self-contained: moves into the cli/ package as one room.


@app.command("agent")
def agent_command(
    session: SessionArg,
    task: Annotated[str, typer.Argument(help="What the agent should do (appended as the user's message).")],
    max_steps: Annotated[int, typer.Option("--max-steps", help="Model calls at most.", min=1)] = 30,
    model: Annotated[
        str | None, typer.Option("--model", help="Chat model (default RIVERBED_LLM_MODEL).", show_default=False)
    ] = None,
    in_process: Annotated[
        bool, typer.Option("--in-process", help="Run the runtime, memory and condenser roles in this process.")
    ] = False,
    tenant: Annotated[str | None, typer.Option("--tenant", help="The session's tenant.", show_default=False)] = None,
    image: Annotated[
        list[str] | None,
        typer.Option("--image", help="An image for the task: URL or workspace path (repeatable).", show_default=False),
    ] = None,
    prefix: PrefixOption = None,
) -> None:
    """Run the reference LLM agent on TASK, printing each event as the log grows.

    Needs OPENAI_BASE_URL and/or OPENAI_API_KEY, and workers (riverbed worker all) unless
    --in-process.  Exits 0 when the agent finishes, asks the user or reaches --max-steps.
    """
    from riverbed.agent.llm import make_client  # noqa: PLC0415
    from riverbed.workers.agent_run import check_model_server, run_agent  # noqa: PLC0415

    settings = _settings(prefix, llm_model=model)
    make_client(settings)
    url = _redis_url(settings)
    if in_process and not settings.database_url:
        _progress("RIVERBED_DATABASE_URL is not set: using the embedded Postgres")
    console = Console(highlight=False, soft_wrap=True)

    async def go() -> Any:
        async with make_client(settings) as client:
            return await _agent_run(client)

    async def _agent_run(client: Any) -> Any:
        await check_model_server(client, settings)
        with anyio.fail_after(CONNECT_TIMEOUT):
            await _probe(url)
        return await run_agent(
            settings,
            url,
            session,
            task,
            client=client,
            max_steps=max_steps,
            in_process=in_process,
            tenant=tenant,
            images=image or (),
            on_event=lambda event: console.print(render(event)),
        )

    run = _run(go)
    spent = run.usage
    cost = "" if spent.cost is None else f", cost {spent.cost:.6f} USD"
    ended = run.ended.kind if run.ended is not None else "nothing"
    if isinstance(run.ended, events.Error):
        ended = f"{ended} ({run.ended.reason})"
    err_console.print(
        f"agent ended by {ended} after {len(spent.steps)} model calls: {spent.prompt_tokens} prompt tokens "
        f"({spent.cached_tokens} cached), {spent.completion_tokens} completion tokens{cost}",
        markup=False,
    )
    if not run.ok:
        detail = run.ended.content if isinstance(run.ended, events.Error) else "the run failed"
        _fail(f"the agent stopped: {detail}", 1)


# --- context suggest: condensation by conversation (issue 17) -----------------------------------
# Self-contained: moves into the cli/ package with `context`.


def _context_suggest(settings: Settings, session: str, request: str, *, apply: bool, model: str | None) -> None:
    """Print a model's proposal for ``request`` as a diff of the context; append it with ``apply``."""
    from riverbed.agent.llm import make_client  # noqa: PLC0415
    from riverbed.memory.tokens import event_text  # noqa: PLC0415

    name = model or settings.suggest_model or settings.llm_model
    client = make_client(settings)

    async def go() -> Any:
        async with _bus(settings) as bus:
            await _require_events(bus, session)
            context = (await bus.operate(session)).context  # an operator's edit, as the session's own tenant
            proposal = await context.suggest(request, client=client, model=name)
            return proposal, (await context.apply(proposal) if apply else None)

    proposal, applied = _run(go)
    console = Console(highlight=False, soft_wrap=True)
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


# --- usage: the condenser's effect (issue 17) ----------------------------------------------------
# Self-contained: moves into the cli/ package with `usage`.


def _condensation_row(table: Table, mark: Any) -> None:
    """A marker row in `riverbed usage`: a condensation and the view's size before and after it."""
    table.add_row(
        str(mark.event_id),
        Text(f"{visible(mark.source)} condensation", style="cyan"),
        Text(f"view {mark.tokens_before} → {mark.tokens_after} tokens", style="cyan"),
        "",
        Text(f"{mark.events_before} → {mark.events_after} events", style="cyan"),
        "",
    )


if __name__ == "__main__":
    main()

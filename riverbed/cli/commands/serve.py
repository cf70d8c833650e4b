"""`riverbed serve` and `riverbed keys create|list|revoke`."""

from __future__ import annotations

from typing import Annotated, Any

import anyio
import typer
import typer.core
import typer.main
from rich.table import Table

from riverbed.cli.app import Invocation, JsonOption, PrefixOption, _progress, app
from riverbed.cli.commands.sessions import _iso_ms
from riverbed.cli.output import _cell, _stdout_lines, err_console, json_bytes, out_console
from riverbed.logs import configure_logging

# --- serve, keys (the HTTP API: riverbed.serve) ----------------------------------------------

keys_app = typer.Typer(help="API keys of the HTTP API (riverbed serve).", no_args_is_help=True)
app.add_typer(keys_app, name="keys")


@app.command("serve")
def serve_command(
    host: Annotated[
        str | None,
        typer.Option(
            "--host", help="Address to listen on (default RIVERBED_SERVE_HOST, else 127.0.0.1).", show_default=False
        ),
    ] = None,
    port: Annotated[
        int | None,
        typer.Option(
            "--port",
            help="Port to listen on, 0: any free one (default RIVERBED_SERVE_PORT, else 8300).",
            show_default=False,
        ),
    ] = None,
    prefix: PrefixOption = None,
) -> None:
    """Serve the HTTP API (/v1, /openapi.json) and the web console (/) until SIGINT/SIGTERM."""
    from riverbed.serve import Api, ServeConfig, serve  # noqa: PLC0415
    from riverbed.workers.memory_role import build_memory  # noqa: PLC0415

    cli = Invocation(prefix, serve_host=host, serve_port=port)
    settings = cli.settings
    configure_logging(settings.log_format, settings.log_level)
    config = ServeConfig.from_settings(settings)
    from riverbed.agent.usage import parse_prices  # noqa: PLC0415

    parse_prices(settings.prices)  # a bad price table is refused before anything listens

    host, port = settings.serve_host, settings.serve_port

    async def go() -> None:
        bus = await cli.bus()
        # Recall search reads the memory workers' Postgres: RIVERBED_DATABASE_URL, or the
        # embedded services' when they run (the bus above starts them without a Redis URL).
        memory = build_memory(settings, start_services=False)
        try:
            async with anyio.create_task_group() as tg:
                bound = await tg.start(serve, Api(bus, config, memory=memory), host, port)
                shown = f"[{host}]" if ":" in host else host
                err_console.print(f"riverbed: serving http://{shown}:{bound} (console at /, API at /v1)")
                if memory is None:
                    _progress("recall search is off: set RIVERBED_DATABASE_URL to the memory workers' Postgres")
        finally:
            if memory is not None:
                with anyio.CancelScope(shield=True):
                    await memory.aclose()

    cli.run(go, server=True)


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

    cli = Invocation(prefix)

    async def go() -> tuple[str, Any]:
        bus = await cli.bus()
        return await KeyStore(bus.client, bus.keys).create(tenant, admin=admin, note=note)

    key, record = cli.run(go)
    if as_json:
        _stdout_lines([json_bytes({"key": key, "tenant": tenant, "id": record.id, "admin": admin})])
        return
    _stdout_lines([key.encode()])
    who = "admin key" + (f" (tenant {tenant})" if tenant else "") if admin else f"key for tenant {tenant}"
    _progress(f"created {who}, id {record.id}; it is shown only this once")


@keys_app.command("list")
def keys_list(json_out: JsonOption = False, prefix: PrefixOption = None) -> None:
    """Every API key: id, tenant, admin, created, revoked (never the key)."""
    from riverbed.serve import KeyStore  # noqa: PLC0415

    cli = Invocation(prefix)

    async def go() -> list[Any]:
        bus = await cli.bus()
        return await KeyStore(bus.client, bus.keys).list()

    records = cli.run(go)
    if json_out:
        _stdout_lines(json_bytes(r.public()) for r in records)
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
    out_console().print(table)


@keys_app.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="The key's id (from `riverbed keys list`).")],
    prefix: PrefixOption = None,
) -> None:
    """Revoke an API key: requests with it are refused (401) from now on."""
    from riverbed.serve import KeyStore  # noqa: PLC0415

    cli = Invocation(prefix)

    async def go() -> Any:
        bus = await cli.bus()
        return await KeyStore(bus.client, bus.keys).revoke(key_id)

    record = cli.run(go)
    _progress(f"revoked key {record.id} of tenant {record.tenant or '(admin)'}")

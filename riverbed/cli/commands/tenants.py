"""`riverbed tenants set|show`: the operator's per-tenant quotas (runs at once, tokens a day) and
the models a tenant's runs may ask for."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import typer
from rich.table import Table

from riverbed.cli.app import Invocation, JsonOption, PrefixOption, _progress, app
from riverbed.cli.output import _fail, _stdout_lines, json_bytes, out_console

tenants_app = typer.Typer(
    help="Tenants' quotas (runs at once, tokens a day) and the models they may use.", no_args_is_help=True
)
app.add_typer(tenants_app, name="tenants")

TenantArg = Annotated[str, typer.Argument(help="The tenant (as named by its API keys and sessions).")]


@tenants_app.command("set")
def tenants_set(
    tenant: TenantArg,
    max_runs: Annotated[
        int | None,
        typer.Option("--max-runs", help="Runs open at once at most (0: no limit).", show_default=False),
    ] = None,
    tokens_per_day: Annotated[
        int | None,
        typer.Option(
            "--tokens-per-day", help="Prompt + completion tokens a UTC day at most (0: no limit).", show_default=False
        ),
    ] = None,
    mcp_urls: Annotated[
        str | None,
        typer.Option(
            "--mcp-urls",
            help="The remote MCP servers (comma-separated URLs) the tenant's agents may use ('': none).",
            show_default=False,
        ),
    ] = None,
    models: Annotated[
        str | None,
        typer.Option(
            "--models",
            help="The models its runs may ask for, comma-separated ('': only RIVERBED_LLM_MODEL, the default).",
            show_default=False,
        ),
    ] = None,
    prefix: PrefixOption = None,
) -> None:
    """Set TENANT's quotas; a run over one is refused (the CLI exits 2, the API answers 429), and a
    running run stops before its next model call once the day's tokens are spent.  A run that asks
    for a model not in --models (default: the deployment's RIVERBED_LLM_MODEL only) is refused."""
    from riverbed.agent.quotas import Quotas, parse_models  # noqa: PLC0415

    if max_runs is None and tokens_per_day is None and models is None and mcp_urls is None:
        _fail(
            "say what to set: --max-runs N, --tokens-per-day N (0 removes one), --models M,... "
            "and/or --mcp-urls URL,...",
            2,
        )
    urls = _mcp_urls(mcp_urls) if mcp_urls is not None else None
    cli = Invocation(prefix)

    async def go() -> Any:
        allowed = None if models is None else parse_models(models)  # (an InputError: one sentence, exit 2)
        bus = await cli.bus()
        return await Quotas(bus.log_store).set(
            tenant, max_runs=max_runs, tokens_per_day=tokens_per_day, models=allowed, mcp_urls=urls
        )

    quota = cli.run(go)
    _progress(
        f"tenant {tenant}: at most {_limit(quota.max_runs)} runs at once, {_limit(quota.tokens_per_day)} tokens a day, "
        f"models {_models_text(quota.models)}"
        + (f"; MCP servers: {', '.join(quota.mcp_urls)}" if quota.mcp_urls else "")
    )


def _models_text(models: list[str] | None) -> str:
    return ", ".join(models) if models else "RIVERBED_LLM_MODEL only"


def _mcp_urls(given: str) -> list[str]:
    """The URLs of ``--mcp-urls``; one that is not http(s) is refused in one sentence."""
    from urllib.parse import urlsplit  # noqa: PLC0415

    urls = [url.strip() for url in given.split(",") if url.strip()]
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            _fail(f"--mcp-urls takes http:// or https:// URLs separated by commas, and {url!r} is not one", 2)
    return urls


@tenants_app.command("show")
def tenants_show(
    tenant: Annotated[str | None, typer.Argument(help="Only this tenant.", show_default=False)] = None,
    as_json: JsonOption = False,
    prefix: PrefixOption = None,
) -> None:
    """Tenants with quotas (or TENANT): max runs, runs running, tokens a day, tokens used today."""
    from riverbed.agent.quotas import Quotas  # noqa: PLC0415

    cli = Invocation(prefix)

    async def go() -> list[Any]:
        quotas = Quotas((await cli.bus()).log_store)
        names = [tenant] if tenant is not None else list(await quotas.tenants())
        return [await quotas.usage(name) for name in names]

    rows = cli.run(go)
    if as_json:
        _stdout_lines(json_bytes(msgspec.to_builtins(row)) for row in rows)
        return
    if not rows:
        _progress("no tenant has a quota (riverbed tenants set T --max-runs N --tokens-per-day N)")
        return
    columns = ("tenant", "max runs", "running", "tokens/day", "tokens today", "models")
    table = Table(*columns, box=None, header_style="bold")
    for row in rows:
        table.add_row(
            row.tenant, _limit(row.max_runs), str(row.running), _limit(row.tokens_per_day), str(row.tokens_today),
            _models_text(row.models),
        )  # fmt: skip
    out_console().print(table)


def _limit(value: int | None) -> str:
    return "no limit" if value is None else str(value)

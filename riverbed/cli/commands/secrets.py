"""`riverbed secrets keygen|set|list|rm|rotate`: tenants' secrets, encrypted in Redis.

A value is read from stdin or from an environment variable (``--from-env``), never from the
command line, where the shell's history and the process list would keep it; and no command
prints one.  The store is ``riverbed.agent.secrets``.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from riverbed.cli.app import Invocation, JsonOption, PrefixOption, _progress, app
from riverbed.cli.output import _fail, _stdout_lines, json_bytes, out_console
from riverbed.extras import needs_extra

if TYPE_CHECKING:
    from riverbed.agent.secrets import SecretStore

secrets_app = typer.Typer(
    help="Tenants' secrets: stored encrypted under RIVERBED_SECRETS_KEY, named by runs, masked in outputs.",
    no_args_is_help=True,
)
app.add_typer(secrets_app, name="secrets")

TenantArg = Annotated[str, typer.Argument(help="The tenant (as named by its API keys and sessions).")]
NameArg = Annotated[str, typer.Argument(help="The secret's name, like GITHUB_TOKEN.")]
FromEnvOption = Annotated[
    str | None,
    typer.Option("--from-env", metavar="VAR", help="Read the value from this environment variable, not stdin."),
]
# Catches a value given as an argument, to refuse it without echoing it back.
_Stray = Annotated[list[str] | None, typer.Argument(hidden=True, show_default=False)]


def _read_value(what: str, from_env: str | None, stray: list[str] | None) -> str:
    """The value from ``--from-env VAR`` or stdin (one trailing line break dropped)."""
    if stray:
        _fail(f"{what} is read from stdin or --from-env VAR, never from the command line, where the shell's "
              "history and the process list keep it", 2)  # fmt: skip
    if from_env is not None:
        value = os.environ.get(from_env)
        if not value:
            _fail(f"--from-env {from_env}: the variable {from_env} is not set or empty", 2)
        return value
    if sys.stdin.isatty():
        _progress(f"{what}, then Enter (not shown on screen):")
        import getpass  # noqa: PLC0415

        return getpass.getpass(prompt="")
    value = sys.stdin.read()
    value = value[:-1] if value.endswith("\n") else value
    value = value[:-1] if value.endswith("\r") else value
    if not value:
        _fail(f"{what} was expected on stdin (or --from-env VAR), and stdin was empty", 2)
    return value


def _store(cli: Invocation, bus: Any) -> SecretStore:
    with needs_extra():
        from riverbed.agent.secrets import SecretStore  # noqa: PLC0415

        return SecretStore(bus.client, bus.keys, cli.settings.secrets_key)


@secrets_app.command("keygen")
def secrets_keygen() -> None:
    """Print a new key (32 random bytes in base64) for RIVERBED_SECRETS_KEY."""
    from riverbed.agent.secrets import keygen  # noqa: PLC0415

    _stdout_lines([keygen().encode() + b"\n"])


@secrets_app.command("set")
def secrets_set(
    tenant: TenantArg,
    name: NameArg,
    stray: _Stray = None,
    from_env: FromEnvOption = None,
    prefix: PrefixOption = None,
) -> None:
    """Store TENANT's secret NAME (replacing one), the value read from stdin or --from-env VAR."""
    from riverbed.agent.secrets import check_key, check_name, check_value  # noqa: PLC0415

    cli = Invocation(prefix)
    check_key(cli.settings.secrets_key)  # before asking for the value
    check_name(name)
    value = check_value(_read_value("the secret's value", from_env, stray))

    async def go() -> float:
        return await _store(cli, await cli.bus()).set(tenant, name, value)

    cli.run(go)
    _progress(f"secret {name} of tenant {tenant} set; runs name it to use it")


@secrets_app.command("list")
def secrets_list(tenant: TenantArg, as_json: JsonOption = False, prefix: PrefixOption = None) -> None:
    """TENANT's secrets: names and when each was set, never values."""
    cli = Invocation(prefix)

    async def go() -> list[tuple[str, float]]:
        return await _store(cli, await cli.bus()).list(tenant)

    rows = cli.run(go)
    if as_json:
        _stdout_lines(json_bytes({"name": name, "set_at": set_at}) for name, set_at in rows)
        return
    if not rows:
        _progress(f"tenant {tenant} has no secrets (riverbed secrets set {tenant} NAME < file)")
        return
    table = Table("name", "set", box=None, header_style="bold")
    for name, set_at in rows:
        table.add_row(name, dt.datetime.fromtimestamp(set_at, dt.UTC).isoformat(timespec="seconds"))
    out_console().print(table)


@secrets_app.command("rm")
def secrets_rm(tenant: TenantArg, name: NameArg, prefix: PrefixOption = None) -> None:
    """Remove TENANT's secret NAME."""
    cli = Invocation(prefix)

    async def go() -> None:
        await _store(cli, await cli.bus()).remove(tenant, name)

    cli.run(go)
    _progress(f"secret {name} of tenant {tenant} removed")


@secrets_app.command("rotate")
def secrets_rotate(stray: _Stray = None, from_env: FromEnvOption = None, prefix: PrefixOption = None) -> None:
    """Re-encrypt every tenant's secrets under a new key (read from stdin or --from-env VAR;
    `riverbed secrets keygen` makes one), all or nothing; then set it as RIVERBED_SECRETS_KEY."""
    from riverbed.agent.secrets import check_key  # noqa: PLC0415

    cli = Invocation(prefix)
    check_key(cli.settings.secrets_key)  # before asking for the new key
    new_key = _read_value("the new key", from_env, stray).strip()

    async def go() -> Any:
        return await _store(cli, await cli.bus()).rotate(new_key)

    rotated = cli.run(go)
    _progress(
        f"{rotated.secrets} secrets of {rotated.tenants} tenants re-encrypted under the new key: set it as "
        "RIVERBED_SECRETS_KEY for the workers, riverbed serve and this CLI, and restart them; the old key "
        "reads none of them now"
    )

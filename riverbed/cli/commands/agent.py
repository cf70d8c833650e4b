"""`riverbed agent`: a run handed to the agent role (or the in-process loop), and `riverbed runs`."""

from __future__ import annotations

from typing import Annotated, Any

import anyio
import msgspec
import typer
import typer.core
import typer.main
from rich.table import Table

from riverbed import events
from riverbed.agent.hosted import RunLimits
from riverbed.cli.app import (
    CONNECT_TIMEOUT,
    FLAGS,
    Invocation,
    JsonOption,
    PrefixOption,
    SessionArg,
    _probe,
    _progress,
    app,
)
from riverbed.cli.output import _fail, _stdout_lines, err_console, json_bytes, out_console, plural, render
from riverbed.errors import InputError

# --- agent: the reference LLM agent from the command line (issue 17) ----------------------------
# Self-contained: moves into the cli/ package as one room.


@app.command("agent")
def agent_command(
    session: SessionArg,
    task: Annotated[
        str | None,
        typer.Argument(help="What the agent should do (appended as the user's message).", show_default=False),
    ] = None,
    detach: Annotated[
        bool, typer.Option("--detach", help="Record the run for the agent role and return at once.")
    ] = False,
    cancel: Annotated[bool, typer.Option("--cancel", help="End the session's open run (reason cancelled).")] = False,
    agent: Annotated[
        str | None,
        typer.Option(
            "--agent", help="The hosted agent that works on the run (`riverbed agents` lists them).", show_default=False
        ),
    ] = None,
    pause: Annotated[bool, typer.Option("--pause", help="Pause the open run (no model call, no new action).")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Resume a paused run.")] = False,
    say: Annotated[
        str | None,
        typer.Option(
            "--say", help="A user message for the open run: the model reads it at its next call.", show_default=False
        ),
    ] = None,
    confirm: Annotated[
        str | None,
        typer.Option(
            "--confirm",
            help="Which calls wait for approval: never, always, risky, or tool names separated by commas.",
            show_default=False,
        ),
    ] = None,
    secrets: Annotated[
        str | None,
        typer.Option(
            "--secrets",
            help="Names of the tenant's secrets the run may use, separated by commas (`riverbed secrets set`).",
            show_default=False,
        ),
    ] = None,
    upgrade: Annotated[
        bool,
        typer.Option(
            "--upgrade", help="Let the open run continue on its agent's newest definition and the current run rules."
        ),
    ] = False,
    max_steps: Annotated[int, typer.Option("--max-steps", help="Model calls at most.", min=1, max=10_000)] = 30,
    max_tokens: Annotated[
        int | None,
        typer.Option("--max-tokens", help="Prompt + completion tokens at most.", min=1, show_default=False),
    ] = None,
    max_cost: Annotated[
        float | None,
        typer.Option("--max-cost", help="USD at most, priced by RIVERBED_PRICES (agent role).", show_default=False),
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="Chat model (default RIVERBED_LLM_MODEL).", show_default=False)
    ] = None,
    max_output_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-output-tokens",
            help="Tokens one model answer may have, 0: the server decides (default RIVERBED_LLM_MAX_OUTPUT_TOKENS).",
            show_default=False,
        ),
    ] = None,
    temperature: Annotated[
        float | None,
        typer.Option(
            "--temperature", help="Sampling temperature (default RIVERBED_LLM_TEMPERATURE).", show_default=False
        ),
    ] = None,
    llm_timeout: Annotated[
        float | None,
        typer.Option(
            "--llm-timeout", help="Seconds one model call may take (default RIVERBED_LLM_TIMEOUT).", show_default=False
        ),
    ] = None,
    in_process: Annotated[
        bool,
        typer.Option(
            "--in-process", help="Run the agent loop and the runtime, memory and condenser roles in this process."
        ),
    ] = False,
    tenant: Annotated[str | None, typer.Option("--tenant", help="The session's tenant.", show_default=False)] = None,
    image: Annotated[
        list[str] | None,
        typer.Option(
            "--image", help="An image for the task (--in-process): URL or workspace path.", show_default=False
        ),
    ] = None,
    prefix: PrefixOption = None,
) -> None:
    """Hand TASK to the agent role as a run on SESSION and follow it live (Ctrl-C detaches).

    The run is recorded on the log (the task message and a run_started event with the limits),
    so it survives this command and any worker: --detach returns at once.  Workers with the
    agent role (riverbed worker all, with OPENAI_BASE_URL and/or OPENAI_API_KEY set) serve it.
    --in-process runs the loop here instead, with the runtime, memory and condenser roles.
    Exits 0 when the run finishes or reaches --max-steps.
    """
    verbs = [name for name, given in (("--cancel", cancel), ("--upgrade", upgrade), ("--pause", pause),
             ("--resume", resume), ("--say", say is not None)) if given]  # fmt: skip
    if len(verbs) > 1:
        _fail(f"{' and '.join(verbs)} are different things: pass one", 2)
    if verbs:
        if task is not None:
            _fail(f"{verbs[0]} takes no task", 2)
        _steer(session, tenant, prefix, verbs[0], say or "")
        return
    if task is None:
        _fail("say what the agent should do (the TASK argument), or pass --cancel or --upgrade", 2)
    model_flags = _model_flags(max_output_tokens, temperature, llm_timeout)
    if in_process:
        if detach or max_tokens is not None or max_cost is not None or agent is not None:
            _fail(
                "--detach, --agent, --max-tokens and --max-cost are for runs the agent role serves, not --in-process",
                2,
            )
        _in_process(session, task, max_steps, model, tenant, image or [], prefix, model_flags)
        return
    if image:
        _fail("--image is for --in-process runs", 2)
    if max_cost is not None and not max_cost > 0:
        _fail("--max-cost must be a number of USD greater than 0", 2)
    limits = RunLimits(
        model=model, max_steps=max_steps, max_tokens=max_tokens, max_cost=max_cost,
        max_output_tokens=max_output_tokens, temperature=temperature, llm_timeout=llm_timeout,
    )  # fmt: skip
    policy: str | list[str] | None = None
    if confirm is not None:
        policy = (
            confirm if confirm in ("never", "always", "risky") else [t.strip() for t in confirm.split(",") if t.strip()]
        )
    named = [name.strip() for name in (secrets or "").split(",") if name.strip()]
    _hosted(
        session, task, limits, detach=detach, tenant=tenant, prefix=prefix, model_flags=model_flags, agent=agent,
        confirm=policy, secrets=named,
    )  # fmt: skip


def _model_flags(max_output_tokens: int | None, temperature: float | None, llm_timeout: float | None) -> dict[str, Any]:
    """The model flags given, as settings (checked against the settings' bounds: one sentence
    naming the flag when out of them)."""
    from riverbed.settings import Settings  # noqa: PLC0415

    given = {
        "llm_max_output_tokens": max_output_tokens,
        "llm_temperature": temperature,
        "llm_timeout": llm_timeout,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if given:
        Settings.from_env({}, flags=FLAGS, **given)  # (raises ConfigError: the CLI says it, exit 2)
    return given


def _steer(session: str, tenant: str | None, prefix: str | None, verb: str, text: str) -> None:
    """--cancel, --upgrade, --pause, --resume or --say on the session's open run."""
    from riverbed.agent.hosted import cancel_run, pause_run, upgrade_run  # noqa: PLC0415

    cli = Invocation(prefix)

    async def go() -> int:
        bus = await cli.bus()
        if verb == "--upgrade":
            return await upgrade_run(bus, session, tenant=tenant)
        if verb in ("--pause", "--resume"):
            return await pause_run(bus, session, resume=verb == "--resume", tenant=tenant)
        if verb == "--say":
            if not text.strip():
                raise InputError("--say needs the message to say")
            handle = await bus.operate(session, tenant=tenant)
            (said,) = await handle.append(events.Message(content=text, source="user"))
            return said
        return await cancel_run(bus, session, tenant=tenant)

    event_id = cli.run(go)
    done = {
        "--upgrade": f"the run of {session} continues on its agent's newest definition",
        "--pause": f"the run of {session} is paused",
        "--resume": f"the run of {session} goes on",
        "--say": f"said to the run of {session}; the model reads it at its next call",
        "--cancel": f"asked the agent to end the run of {session}",
    }[verb]
    _progress(f"{done} (event {event_id})")


def _hosted(
    session: str,
    task: str,
    limits: RunLimits,
    *,
    detach: bool,
    tenant: str | None,
    prefix: str | None,
    model_flags: dict[str, Any],
    agent: str | None = None,
    confirm: str | list[str] | None = None,
    secrets: list[str] | None = None,
) -> None:
    from riverbed.agent.hosted import follow_run, open_run  # noqa: PLC0415
    from riverbed.agent.llm import make_client  # noqa: PLC0415
    from riverbed.agent.usage import parse_prices  # noqa: PLC0415
    from riverbed.errors import ConfigError  # noqa: PLC0415
    from riverbed.workers.agent_run import (  # noqa: PLC0415
        AGENT_SEEN_SECONDS,
        agent_workers,
        check_model_server,
        require_workers,
    )

    cli = Invocation(prefix, **model_flags)
    settings = cli.settings
    if not detach:
        make_client(settings)  # the model server is checked before anything is appended
    console = out_console()

    async def go() -> list[events.Event]:
        if not detach:
            async with make_client(settings) as client:
                await check_model_server(client, settings)
        bus = await cli.bus()
        if not detach:
            await require_workers(bus, ["runtime", "agent"])
        agents = await agent_workers(bus)
        if not agents and not settings.model_configured:
            raise ConfigError(
                "no model server is configured and no agent worker is running: set OPENAI_BASE_URL "
                "(or OPENAI_API_KEY) and start `riverbed worker all`, which then serves the agent role"
            )
        opened = await open_run(
            bus, session, task, limits=limits, tenant=tenant, agent=agent, confirm=confirm,
            default_model=settings.llm_model, prices=parse_prices(settings.prices), secrets=secrets or (),
        )  # fmt: skip
        if detach:
            _progress(f"run opened on {session} (event {opened.opened}): `riverbed runs` shows it")
            if not agents:
                _progress(
                    f"waiting for an agent worker: none has been seen in the last {AGENT_SEEN_SECONDS:g}s "
                    "(start one with `riverbed worker all` where OPENAI_BASE_URL is set); the run starts when one does"
                )
            return []
        _progress(f"run opened on {session} (event {opened.opened}); following it (Ctrl-C detaches, the run goes on)")
        seen: list[events.Event] = []
        async for event in follow_run(bus, session, opened.task):
            console.print(render(event))
            seen.append(event)
        return seen

    seen = cli.run(go, interrupt_code=0)
    if detach or not seen:
        return
    _report(seen, settings.prices)


def _report(seen: list[events.Event], prices: str | None) -> None:
    from riverbed.agent.usage import parse_prices, usage  # noqa: PLC0415

    spent = usage(seen, parse_prices(prices))
    ended = seen[-1]
    _summary(ended, spent)
    if isinstance(ended, events.Error) and ended.reason != "step_limit":
        _fail(f"the agent stopped: {ended.content}", 1)


def _summary(ended: events.Event | None, spent: Any) -> None:
    cost = "" if spent.cost is None else f", cost {spent.cost:.6f} USD"
    what = ended.kind if ended is not None else "nothing"
    if isinstance(ended, events.Error):
        what = f"{what} ({ended.reason})"
    err_console.print(
        f"agent ended by {what} after {plural(len(spent.steps), 'model call')}: {spent.prompt_tokens} prompt tokens "
        f"({spent.cached_tokens} cached), {spent.completion_tokens} completion tokens{cost}",
        markup=False,
    )


def _in_process(
    session: str,
    task: str,
    max_steps: int,
    model: str | None,
    tenant: str | None,
    image: list[str],
    prefix: str | None,
    model_flags: dict[str, Any],
) -> None:
    from riverbed.agent.llm import make_client  # noqa: PLC0415
    from riverbed.workers.agent_run import check_model_server, run_agent  # noqa: PLC0415

    cli = Invocation(prefix, llm_model=model, **model_flags)
    settings = cli.settings
    make_client(settings)
    url = cli.redis_url()
    if not settings.database_url:
        _progress("RIVERBED_DATABASE_URL is not set: using the embedded Postgres")
    console = out_console()

    async def go() -> Any:
        async with make_client(settings) as client:
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
                in_process=True,
                tenant=tenant,
                images=image,
                on_event=lambda event: console.print(render(event)),
            )

    run = cli.run(go)
    _summary(run.ended, run.usage)
    if not run.ok:
        detail = run.ended.content if isinstance(run.ended, events.Error) else "the run failed"
        _fail(f"the agent stopped: {detail}", 1)


# --- runs ------------------------------------------------------------------------------------


@app.command("runs")
def runs_command(
    state: Annotated[
        str | None,
        typer.Option(
            "--state",
            help="running, waiting (no agent worker holds it), finished, failed or cancelled.",
            show_default=False,
        ),
    ] = None,
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant's runs.", show_default=False)] = None,
    agent: Annotated[
        str | None, typer.Option("--agent", help="Only the runs opened for this agent.", show_default=False)
    ] = None,
    limit: Annotated[int, typer.Option("--limit", help="Runs on one page.", min=1, max=200)] = 50,
    cursor: Annotated[
        str | None, typer.Option("--cursor", help="The page after the one that printed it.", show_default=False)
    ] = None,
    as_json: JsonOption = False,
    prefix: PrefixOption = None,
) -> None:
    """Runs handed to the agent role, newest first, a page at a time: session, tenant, state, steps,
    tokens, cost, owning worker, age, and the parent session of a sub-agent's run."""
    from riverbed.agent import run_index  # noqa: PLC0415
    from riverbed.agent.hosted import STATES, page_runs  # noqa: PLC0415
    from riverbed.agent.usage import parse_prices  # noqa: PLC0415

    if state is not None and state not in STATES:
        _fail(f"unknown run state {state!r}: use {', '.join(STATES)}", 2)
    cli = Invocation(prefix)

    async def go() -> Any:
        bus = await cli.bus()
        await run_index.backfill(bus.client, bus.keys)  # (once per prefix: the runs listed before the indexes)
        return await page_runs(
            bus, state=state, tenant=tenant, agent=agent, prices=parse_prices(cli.settings.prices),
            limit=limit, cursor=cursor, retention=cli.settings.runs_retention,
        )  # fmt: skip

    page = cli.run(go)
    rows = page.rows
    more = f"more runs: riverbed runs --cursor {page.next_cursor}" if page.next_cursor else None
    if as_json:
        _stdout_lines(json_bytes(msgspec.to_builtins(row)) for row in rows)
        if more:
            _progress(more)
        return
    if not rows:
        _progress(more or "no runs" + (f" in state {state}" if state else ""))
        return
    columns = ("session", "tenant", "state", "steps", "tokens", "cost", "worker", "age", "parent")
    table = Table(*columns, box=None, header_style="bold")
    for row in rows:
        cost = "—" if row.cost is None else f"{row.cost:.4f}"  # (as the console shows it: no price)
        state_text = row.state if row.state in ("running", "waiting", "finished") else f"{row.state} ({row.reason})"
        table.add_row(
            row.session, row.tenant or "", state_text, str(row.steps), str(row.tokens), cost, row.worker or "",
            _age(row.age), row.parent or "",
        )  # fmt: skip
    out_console().print(table)
    if more:
        _progress(more)


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"

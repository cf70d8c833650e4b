"""`riverbed agent`: the reference LLM agent from the command line."""

from __future__ import annotations

from typing import Annotated, Any

import anyio
import typer
import typer.core
import typer.main
from rich.console import Console

from riverbed import events
from riverbed.cli.app import CONNECT_TIMEOUT, Invocation, PrefixOption, SessionArg, _probe, _progress, app
from riverbed.cli.output import _fail, err_console, render

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

    cli = Invocation(prefix, llm_model=model)
    settings = cli.settings
    make_client(settings)
    url = cli.redis_url()
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

    run = cli.run(go)
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

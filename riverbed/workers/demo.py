"""``riverbed demo``: the whole system in one process, in under a minute.

Starts the embedded Redis and Postgres when no URLs are set, runs the three roles
in-process, and drives a session that runs commands, writes and edits a file, runs a
Python cell, recalls workspace context and an earlier event, gets condensed (and recalls
an event the condensation dropped), and is then replayed and forked.  With a model server
configured (``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``), the reference LLM agent then works on
a small task in a session of its own.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import anyio
from msgspec.structs import replace
from rich.console import Console

from riverbed import events
from riverbed.bus.connection import connect_redis
from riverbed.client.session import Bus, Session
from riverbed.errors import RiverbedError
from riverbed.settings import Settings
from riverbed.workers.main import Worker, build_handlers

__all__ = ["DemoResult", "run_demo"]

CONDENSER = {"strategy": "recent", "max_events": 16, "keep_first": 2}


@dataclass
class DemoResult:
    session: str
    fork: str
    events: int
    view_size: int
    condensations: int
    recall_found: bool
    agent_session: str | None = None
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(self.checks.values())


def _brief(event: events.Event, limit: int = 90) -> str:
    """One line of what an event says: an action's request, an observation's own output."""
    match event:
        case events.CmdOutput(content=content, exit_code=code):
            text = f"[exit {code}] {content}" if code else content or "(no output)"
        case events.PythonOutput(content=content, result=result, exception=exception):
            parts = [content.strip()] if content.strip() else []
            if result is not None:
                parts.append(f"→ {result}")
            if exception:
                parts.append(f"raised {exception.strip().splitlines()[-1]}")
            text = " ".join(parts) or "(no output)"
        case events.FileContent(content=content):
            text = content
        case events.FileEdited(diff=diff):
            text = " ".join(line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---"))
        case events.RecallResult(hits=hits, knowledge=knowledge, repo_directory=repo, date=date):
            if hits:
                text = f"top hit: event {hits[0].event_id} ({hits[0].kind}) {hits[0].text!r}"
            elif repo or date:
                text = f"{f'git repository {repo}' if repo else 'no git repository'}, date {date}"
            else:
                text = f"{len(knowledge)} knowledge items"
        case events.Condensation(forgotten=forgotten):
            text = f"forgot {forgotten}"
        case events.FileWrite(path=path, content=content):
            text = f"{path} ({len(content)} chars)"
        case events.FileEdit(command=command, path=path):
            text = f"{command} {path}"
        case events.Recall(recall_type=recall_type, query=query):
            text = f"{recall_type}: {query}" if query else recall_type
        case _:
            text = next(
                (v for name in ("command", "code", "content", "query", "path", "summary", "thought")
                 if isinstance(v := getattr(event, name, None), str) and v),
                "",
            )  # fmt: skip
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class _Transcript:
    def __init__(self, console: Console) -> None:
        self.console = console

    def step(self, title: str) -> None:
        self.console.print(f"\n[bold cyan]▸ {title}[/]")

    def pair(self, action: events.Event, answer: events.Event) -> None:
        style = "red" if isinstance(answer, events.Error) else "green"
        self.console.print(f"  [dim]#{action.id}[/] [yellow]{action.kind}[/] {_brief(action)}")
        self.console.print(f"  [dim]#{answer.id}[/] [{style}]{answer.kind}[/] {_brief(answer)}")


async def _act(session: Session, action: events.Action, out: _Transcript, timeout: float = 60) -> events.Event:
    answer = await session.act(action, timeout=timeout)
    action_with_id = replace(action, id=answer.cause)
    out.pair(action_with_id, answer)
    return answer


async def run_demo(settings: Settings, console: Console, *, redis_url: str) -> DemoResult:
    """Drive the demo session against ``redis_url`` with all roles running in this process."""
    out = _Transcript(console)
    sid = f"demo-{uuid.uuid4().hex[:8]}"
    redis = await connect_redis(redis_url)
    bus = Bus(redis, prefix=settings.prefix, url=redis_url)
    roles = ["runtime", "memory", "condenser"]
    console.print("[dim]loading the embedding model and starting runtime, memory and condenser roles…[/]")
    handlers, closers = build_handlers(roles, settings)
    worker = Worker(redis, settings, roles, name=f"demo-{uuid.uuid4().hex[:6]}", handlers=handlers, url=redis_url)
    checks: dict[str, bool] = {}
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            result = await _script(bus, sid, out, checks)
            if settings.openai_api_key or settings.openai_base_url:
                result.agent_session = await _llm_agent(bus, settings, f"{sid}-agent", out, checks)
            worker.stop()
    finally:
        with anyio.CancelScope(shield=True):
            for close in closers:
                await close()
            await redis.aclose()
    result.checks = checks
    return result


async def _script(bus: Bus, sid: str, out: _Transcript, checks: dict[str, bool]) -> DemoResult:
    session = bus.session(sid, tenant="demo", agent="demo-agent")
    out.step(f"session {sid}: configure it and say what we want")
    await session.append(
        events.SessionConfig(env={"GREETING": "hello from riverbed"}, condenser=CONDENSER, source="user"),
        events.Message(content="Write a tiny Python script that greets, run it, and remember how.", source="user"),
    )
    out.step("recall the workspace context (memory role)")
    ctx = await _act(session, events.Recall(recall_type="workspace_context"), out)
    checks["workspace context recalled"] = isinstance(ctx, events.RecallResult)

    out.step("run commands in the session's persistent shell (runtime role)")
    await _act(session, events.CmdRun(command="mkdir -p app && cd app && export STAGE=demo && pwd"), out)
    shell = await _act(session, events.CmdRun(command='echo "$STAGE: $GREETING from $(basename $PWD)"'), out)
    checks["shell keeps cwd and env"] = (
        isinstance(shell, events.CmdOutput) and "demo: hello from riverbed from app" in shell.content
    )

    out.step("write, edit and run a file")
    written = await _act(session, events.FileWrite(path="app/greet.py", content='print("hello, world")\n'), out)
    edited = await _act(
        session,
        events.FileEdit(command="str_replace", path="app/greet.py", old_str="hello, world", new_str="hello, riverbed"),
        out,
    )
    run = await _act(session, events.CmdRun(command="python3 greet.py"), out)
    checks["edited file runs"] = isinstance(run, events.CmdOutput) and "hello, riverbed" in run.content

    out.step("a persistent Python cell")
    await _act(session, events.PythonRun(code="def double(x):\n    return 2 * x"), out)
    cell = await _act(session, events.PythonRun(code="double(21)"), out)
    checks["python state persists"] = isinstance(cell, events.PythonOutput) and cell.result == "42"

    out.step("more work, until the condenser steps in")
    for i in range(8):
        await _act(session, events.CmdRun(command=f"echo step {i}: checking the build && ls"), out)
    # The condenser lags on purpose: wait until it has dropped the greeting script's events.
    condensations = await _wait_condensed(session, {e.id for e in (written, edited, run) if e.id is not None})
    log = [e async for e in session.log()]
    view = await session.view()
    out.console.print(
        f"  log has [bold]{len(log)}[/] events; the agent's view has [bold]{len(view)}[/] "
        f"after {condensations} condensation(s)"
    )
    checks["condensed"] = condensations > 0 and len(view) < len(log)

    out.step("recall an event the condensation dropped, in plain words")
    dropped = await _dropped_ids(session)
    hit = await _act(session, events.Recall(query="which script prints the greeting?", k=3), out)
    found = isinstance(hit, events.RecallResult) and any("greet" in h.text and h.event_id in dropped for h in hit.hits)
    checks["recall finds a condensed-away event"] = found

    out.step("replay: the view as it was right after event 8, then a fork")
    early = await session.view(until=8)
    out.console.print(f"  view(until=8) has {len(early)} events: " + ", ".join(e.kind for e in early))
    fork_id = f"{sid}-fork"
    from riverbed.agent.replay import fork  # noqa: PLC0415

    await fork(bus, sid, 12, fork_id)
    forked = bus.session(fork_id, tenant="demo", agent="demo-agent")
    diverged = await _act(forked, events.CmdRun(command="echo this only happens in the fork"), out)
    fork_log = [e async for e in forked.log()]
    checks["fork diverges"] = isinstance(diverged, events.CmdOutput) and isinstance(fork_log[12], events.Forked)
    return DemoResult(
        session=sid,
        fork=fork_id,
        events=len(log),
        view_size=len(view),
        condensations=condensations,
        recall_found=found,
    )


AGENT_TASK = "Create a file hello.txt containing the word riverbed, show it with cat, then finish."
AGENT_STEPS = 6


async def _llm_agent(bus: Bus, settings: Settings, sid: str, out: _Transcript, checks: dict[str, bool]) -> str:
    """The reference LLM agent on a small task (when a model server is configured): the
    check is that every request was accepted and the run ended by ``finish``, a question
    for the user or its step limit, never what the model chose to do."""
    from riverbed.agent.llm import make_client  # noqa: PLC0415
    from riverbed.workers.agent_run import check_model_server, run_llm_agent  # noqa: PLC0415

    out.step(f"the LLM agent ({settings.llm_model}) on a small task in session {sid}")
    client = make_client(settings)
    try:
        await check_model_server(client, settings)
    except RiverbedError as exc:
        await client.close()
        out.console.print(f"  [red]{exc}[/]", markup=True)
        checks["LLM agent ran"] = False
        return sid
    try:
        ended = await run_llm_agent(bus, sid, AGENT_TASK, settings=settings, client=client, max_steps=AGENT_STEPS)
    finally:
        await client.close()
    async for event in bus.session(sid).log():
        if event.kind not in ("llm_response",):
            out.console.print(f"  [dim]#{event.id}[/] [yellow]{event.kind}[/] {_brief(event)}")
    failed = isinstance(ended, events.Error) and ended.reason != "step_limit"
    checks["LLM agent ran to finish or its step limit"] = not failed
    return sid


async def _wait_condensed(session: Session, forgotten: set[int], timeout: float = 20) -> int:
    """The number of condensations once one has happened and ``forgotten`` are all dropped."""
    count = 0
    with anyio.move_on_after(timeout):
        while True:
            count = len([e async for e in session.log() if isinstance(e, events.Condensation)])
            if count and forgotten <= await _dropped_ids(session):
                return count
            await anyio.sleep(0.1)
    return count


async def _dropped_ids(session: Session) -> set[int]:
    dropped: set[int] = set()
    async for event in session.log():
        if isinstance(event, events.Condensation):
            for start, end in event.forgotten:
                dropped.update(range(start, end + 1))
    return dropped

"""The ``riverbed`` command in tests: in-process through Typer's ``CliRunner`` (the same
:func:`riverbed.cli.main`, its error sentences and exit codes, without an interpreter start-up
per command, on a thread of its own inside a running event loop), or as a real subprocess
where the entry point or signals call for one."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog
from typer.testing import CliRunner

import riverbed
import riverbed.cli
from riverbed import events
from tests.kit.agents import record
from tests.kit.openai_server import OpenAIServer
from tests.kit.patience import within


@pytest.fixture
def agent_env(cli_env: dict[str, str], server: OpenAIServer, database_url: str, tmp_path: Path) -> dict[str, str]:
    """``cli_env`` for ``riverbed agent``: the scripted ``server`` as the model, the test's
    Postgres, a workspace in ``tmp_path`` and the process sandbox."""
    env = {k: v for k, v in cli_env.items() if not k.startswith("OPENAI_")}
    env.update(
        OPENAI_BASE_URL=server.base_url,
        OPENAI_API_KEY="test-key",
        RIVERBED_LLM_MODEL="test-model",
        RIVERBED_DATABASE_URL=database_url,
        RIVERBED_WORKSPACE=str(tmp_path / "ws"),
        RIVERBED_SANDBOX="process",
    )
    return env


def riverbed_command() -> list[str]:
    """The installed ``riverbed`` script (or ``python -m riverbed.cli``), for a subprocess."""
    script = Path(sys.executable).parent / "riverbed"
    return [str(script)] if script.exists() else [sys.executable, "-m", "riverbed.cli"]


def run_process(
    env: dict[str, str], *args: str, stdin: bytes | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[bytes]:
    """``riverbed args...`` as a real process."""
    return subprocess.run(
        [*riverbed_command(), *args], env=env, input=stdin, capture_output=True, timeout=within(timeout), check=False
    )


class _StderrLines:
    """A structlog logger writing to whatever ``sys.stderr`` is when it writes (so a command's
    warnings land in its captured stderr and never in a stream closed after the command)."""

    def msg(self, message: str | bytes) -> None:
        line = message if isinstance(message, bytes) else message.encode()
        sys.stderr.buffer.write(line + b"\n")
        sys.stderr.flush()

    log = debug = info = warning = warn = error = critical = exception = fatal = failure = err = msg


@contextlib.contextmanager
def _isolated_logging() -> Iterator[None]:
    """Let the command configure structlog as it does (whichever module calls
    ``structlog.configure``: the CLI, serve, the services, a worker), but never cache a logger
    bound to the command's stderr, and give the test process its own configuration back."""
    before = structlog.get_config()
    real = structlog.configure

    def configure(**settings: Any) -> None:
        real(**{**settings, "cache_logger_on_first_use": False, "logger_factory": lambda *_: _StderrLines()})

    structlog.configure = configure
    try:
        yield
    finally:
        structlog.configure = real
        real(**before)


def _on_this_thread() -> bool:
    """A command runs its own event loop: here only when no loop runs on this thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return True
    return False


def _argv0() -> str:
    """``sys.argv[0]`` as the installed script sees it (commands print how to run themselves)."""
    command = riverbed_command()
    return command[0] if len(command) == 1 else "riverbed"


def invoke(env: dict[str, str], *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    """``riverbed args...`` in this process, with exactly ``env`` as its environment."""
    unset: dict[str, str | None] = {key: None for key in os.environ if key not in env}
    runner = CliRunner()
    argv = sys.argv
    code = 0
    with runner.isolation(input=stdin, env={**unset, **env}) as (out, err, _), _isolated_logging():
        sys.argv = [_argv0(), *args]
        try:
            riverbed.cli.main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if isinstance(exc.code, str):
                sys.stderr.write(exc.code + "\n")
        finally:
            sys.argv = argv
            sys.stdout.flush()
            sys.stderr.flush()
        stdout, stderr = out.getvalue(), err.getvalue()
    return subprocess.CompletedProcess(["riverbed", *args], code, stdout, stderr)


def run(
    env: dict[str, str], *args: str, stdin: bytes | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[bytes]:
    """``riverbed args...`` in this process; inside a running event loop, on a thread of its
    own (a command runs its own loop) while the caller waits, as it would for a subprocess."""
    if _on_this_thread():
        return invoke(env, *args, stdin=stdin)
    done: list[subprocess.CompletedProcess[bytes]] = []
    failed: list[BaseException] = []

    def command() -> None:
        try:
            done.append(invoke(env, *args, stdin=stdin))
        except BaseException as exc:  # handed to the caller
            failed.append(exc)

    thread = threading.Thread(target=command, name="riverbed-command", daemon=True)
    thread.start()
    thread.join(within(timeout))
    if failed:
        raise failed[0]
    if not done:
        raise subprocess.TimeoutExpired(["riverbed", *args], timeout)
    return done[0]


def run_all(
    jobs: list[tuple[dict[str, str], list[str]]], timeout: float = 60
) -> list[subprocess.CompletedProcess[bytes]]:
    """Several commands, one after the other."""
    return [run(env, *args, timeout=timeout) for env, args in jobs]


def ok(env: dict[str, str], *args: str, stdin: bytes | None = None) -> bytes:
    result = run(env, *args, stdin=stdin)
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout


def assert_one_sentence(result: subprocess.CompletedProcess[bytes], code: int, *fragments: str) -> str:
    err = result.stderr.decode()
    assert result.returncode == code, (result.returncode, err)
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err
    return err


def sample_events(count: int) -> list[events.Event]:
    """A varied session: every action answered, unicode, multi-line output, tenants and traces."""
    out: list[events.Event] = []
    while len(out) < count:
        n = len(out) + 1
        step = n % 6
        if step == 1:
            out.append(events.Message(content=f"step {n}: héllo ✓\nsecond line", source="user", tenant="acme"))
        elif step == 2:
            out.append(events.CmdRun(command=f"echo {n}", timeout=5.5, agent="a1", trace=f"00-{n:032x}-{n:016x}-01"))
        elif step == 3:
            out.append(events.CmdOutput(content=f"{n}\n" * 5, exit_code=n % 3, cause=n - 1, command=f"echo {n - 1}"))
        elif step == 4:
            out.append(events.Recall(query=f"query {n}", k=3, scope="tenant"))
        elif step == 5:
            hit = events.Hit(session="s", event_id=n, kind="think", score=0.25 * (n % 4), text="t")
            out.append(events.RecallResult(recall_type="semantic", hits=[hit], cause=n - 1))
        else:
            out.append(events.Finish(final_thought="done", outputs={"n": n, "ratio": n / 7, "list": [1, None, "x"]}))
    return out[:count]


def fill(redis_url: str, prefix: str, session: str, batch: list[events.Event]) -> None:
    async def go() -> None:
        async with riverbed.connect(redis_url, prefix=prefix) as bus:
            handle = bus.session(session, tenant="acme")
            for begin in range(0, len(batch), 500):
                await record(handle, *batch[begin : begin + 500])

    anyio.run(go)


def last_id(redis_url: str, prefix: str, session: str) -> int:
    async def go() -> int:
        async with riverbed.connect(redis_url, prefix=prefix) as bus:
            return await bus.session(session).last_id()

    return anyio.run(go)

"""First-hour papercuts of the CLI, in-process through Typer's runner: `context … --dry-run`
previews an edit as the HTTP API's ``dry_run`` does, `usage` shows condensations in a column
of their own, and `archive` says what it did in sentences."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import Result
from rich.text import Text
from typer.testing import CliRunner

from riverbed import events
from riverbed.cli import app
from riverbed.client.session import Bus
from riverbed.errors import InputError
from tests.kit.agents import record


def cli(env: dict[str, str], *args: str) -> Result:
    """One `riverbed` command in this process, with ``env`` as its environment."""
    runner = CliRunner()
    return runner.invoke(app, list(args), env=env, catch_exceptions=True)


def ok(env: dict[str, str], *args: str) -> Result:
    result = cli(env, *args)
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def append(env: dict[str, str], session: str, *items: events.Event) -> None:
    ok(env, "append", session, json.dumps([events.to_builtins(e) for e in items]))


def ids(env: dict[str, str], session: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in ok(env, "log", session, "--json").stdout.splitlines()]


def test_a_context_edit_dry_run_previews_and_appends_nothing(cli_env: dict[str, str]) -> None:
    append(
        cli_env,
        "dry",
        events.Message(content="the task", source="user"),
        events.Think(thought="first", source="agent"),
        events.Think(thought="second", source="agent"),
        events.Think(thought="third", source="agent"),
    )
    before = ids(cli_env, "dry")
    result = ok(cli_env, "context", "dry", "forget", "2-3", "--dry-run")
    preview = json.loads(result.stdout)
    assert preview["dry_run"] is True
    assert preview["hidden"] == [2, 3]
    assert preview["edit"] == 5  # the id the edit would get
    assert "dry run of a forget edit (nothing appended): it would hide 2 events (2-3)" in result.stderr
    assert ids(cli_env, "dry") == before  # nothing appended

    # The real edit changes what the preview said it would.
    done = json.loads(ok(cli_env, "context", "dry", "forget", "2-3").stdout)
    assert (done["hidden"], done["edit"]) == (preview["hidden"], preview["edit"])
    assert "would" not in ok(cli_env, "context", "dry", "pin", "4").stderr

    # Refused as the edit is: beyond the log, or not an edit.
    beyond = cli(cli_env, "context", "dry", "forget", "999", "--dry-run")
    assert isinstance(beyond.exception, InputError)
    assert "event 999 is beyond the log" in str(beyond.exception)
    shown = cli(cli_env, "context", "dry", "--dry-run")
    assert isinstance(shown.exception, InputError)
    assert "--dry-run is for an edit" in str(shown.exception)


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("┃│").split("│" if "│" in line else "┃")]


def test_usage_shows_condensations_in_their_own_column(cli_env: dict[str, str]) -> None:
    append(
        cli_env,
        "marks",
        events.Message(source="user", content="task " * 50),
        events.LlmResponse(model="m", usage={"prompt_tokens": 100, "completion_tokens": 5}, source="agent"),
        events.Think(thought="long thought " * 100, source="agent"),
    )
    ok(cli_env, "append", "marks", json.dumps({"kind": "condensation", "source": "user", "forgotten": [[3, 3]]}))
    append(cli_env, "marks", events.LlmResponse(model="m", usage={"prompt_tokens": 40, "completion_tokens": 5}))
    lines = ok({**cli_env, "COLUMNS": "220"}, "usage", "marks").stdout.splitlines()
    header = next(_cells(line) for line in lines if "prompt" in line)
    assert header[-1].startswith("condensed")
    rows = {cells[0]: cells for line in lines if "│" in line and (cells := _cells(line))[0].isdigit()}
    assert set(rows) == {"2", "4", "5"}
    mark = rows["4"]
    assert mark[1:6] == ["", "", "", "", ""]  # nothing under model, prompt, cached, completion, cost
    assert re.fullmatch(r"user condensation: view \d+ → \d+ tokens, 3 → 2 events", mark[6]), mark
    assert rows["2"][2:5] == ["100", "0", "5"]
    assert rows["2"][6] == ""

    # A session never condensed has no such column.
    append(cli_env, "plain", events.LlmResponse(model="m", usage={"prompt_tokens": 7, "completion_tokens": 1}))
    assert "condensed" not in ok({**cli_env, "COLUMNS": "220"}, "usage", "plain").stdout


def test_archive_says_what_it_did_in_sentences(cli_env: dict[str, str], database_url: str, tmp_path: Path) -> None:
    from riverbed.cli.commands.archive import _said  # noqa: PLC0415

    assert _said("s", 1, 1, 0, 10) == (
        "Moved 1 event of session s from Redis to the Postgres archive, which now holds its events 1 to 1; "
        "the rest stay in Redis."
    )
    assert _said("s", 0, 0, 3600, 10) == (
        "Nothing was archived: session s has no event older than 3600 seconds, outside its last 10 "
        "that every role is done with."
    )
    assert _said("s", 0, 40, 0, 10) == (
        "Nothing more was archived: the archive already holds events 1 to 40 of session s, and no later "
        "event is outside the last 10 and done with by every role."
    )
    env = {**cli_env, "RIVERBED_DATABASE_URL": database_url}
    append(env, "young", *[events.Message(content=f"m{i}", source="user") for i in range(3)])
    said = ok(env, "archive", "young", "--keep-last", "10").stderr.strip()
    assert said == _said("young", 0, 0, 0, 10)
    assert said[0].isupper()
    assert said.endswith(".")


def test_log_reads_run_events_as_sentences(cli_env: dict[str, str]) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "think", "arguments": '{"thought": "x"}'}}
    append(
        cli_env,
        "run-log",
        events.Message(content="count the words", source="user"),
        events.RunStarted(model="small", max_steps=5, max_tokens=9000, max_cost=0.25, temperature=0.2),
        events.LlmResponse(model="small", tool_calls=[call], source="agent"),
        events.Error(source="agent", reason="step_limit", content="stopped after 5 model calls", retryable=True),
        events.RunCancel(note="enough"),
    )
    lines = ok(cli_env, "log", "run-log").stdout.splitlines()
    by_kind = {line.split()[4]: line for line in lines}
    assert by_kind["run_started"].endswith(
        "run opened: model small, at most 5 steps, 9000 tokens, $0.25, temperature 0.2"
    )
    assert by_kind["llm_response"].endswith("small: (1 tool call)")
    # A run's end: no "(retryable)", which reads as if the same run were tried again.
    assert by_kind["error"].endswith("step_limit, the run ended: stopped after 5 model calls")
    assert by_kind["run_cancel"].endswith("asked the agent to cancel the run: enough")
    assert not any("{" in line for line in lines), lines


def test_readable_output_without_a_terminal_folds_no_line(cli_env: dict[str, str]) -> None:
    """A pipe, a file or CI: no terminal, and no COLUMNS. Rich would fold at 80 columns."""
    long = "a-session-whose-name-runs-well-past-eighty-columns-" + "x" * 60
    append(cli_env, long, events.Message(content="hello", source="user"))
    runner = CliRunner()
    result = runner.invoke(app, ["sessions"], env={**cli_env, "COLUMNS": None}, catch_exceptions=True)
    assert result.exit_code == 0, (result.output, result.exception)
    (row,) = [line for line in result.stdout.splitlines() if "a-session" in line]
    assert long in row  # the whole id, on one line
    assert ", " not in row

    from riverbed.cli.output import out_console  # noqa: PLC0415

    command = "riverbed services down --dir /tmp/riverbed-0/" + "deep/" * 30 + "services-0123456789"
    with runner.isolation(env={"COLUMNS": None}) as (out, _err, *_):
        out_console().print(f"Stop them: {command}")
        out_console().print(Text(f"look: {command}"))
        printed = out.getvalue().decode().splitlines()
    assert printed == [f"Stop them: {command}", f"look: {command}"]


def test_a_fork_difference_shows_where_the_values_differ() -> None:
    from riverbed.cli.commands.transfer import _rebuilt_summary  # noqa: PLC0415
    from riverbed.cli.output import differing  # noqa: PLC0415

    prefix = "Build 2026-11-29 on host ci-runner-7, Python 3.11.9, started at 12:00:01, output: "
    was, now = differing(prefix + "3 passed", prefix + "2 passed, 1 failed")
    assert was.endswith("3 passed")
    assert now.endswith("2 passed, 1 failed")
    assert was.startswith("…")
    assert now.startswith("…")
    assert was != now
    assert differing("short", "shorter") == ("short", "shorter")  # nothing to cut
    assert differing("x" * 200, "y" * 200)[0] == "x" * 79 + "…"  # differ at once: the start, cut
    drift = events.Divergence(action_id=3, kind="cmd_output", field="content", recorded=prefix + "A", new=prefix + "B")
    built = events.SandboxRebuilt(method="replay", at=5, actions=1, differences=[drift])
    text = _rebuilt_summary(built).plain
    assert text.startswith("sandbox rebuilt by replaying 1 action: 1 difference from the recording")
    assert "A'" in text  # both values show their ends
    assert "B'" in text


@pytest.mark.anyio
async def test_restoring_what_a_condenser_hid_warns_and_names_the_pin(bus: Bus, cli_env: dict[str, str]) -> None:
    s = bus.session("restored")
    await s.append(
        events.Message(content="the task", source="user"),
        *[events.Think(thought=f"step {n}", source="agent") for n in range(4)],
    )
    await record(s, events.Condensation(forgotten=[(2, 4)], summary="three steps"))
    await s.append(events.ContextEdit(op="forget", ranges=[(5, 5)]))  # the user's own: no warning for it
    result = await anyio.to_thread.run_sync(lambda: ok(cli_env, "context", "restored", "restore", "2-5"))
    assert json.loads(result.stdout)["shown"] == [2, 3, 4, 5]
    warning = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1, result.stderr
    assert "a condenser had hidden 2-4" in warning[0]
    assert warning[0].endswith("context restored pin 2-4")
    # What the user hid (an edit, or a condensation of the user's), no condenser hides again: no warning.
    await s.append(events.Condensation(source="user", forgotten=[(2, 5)]))
    again = await anyio.to_thread.run_sync(lambda: ok(cli_env, "context", "restored", "restore", "2-5"))
    assert json.loads(again.stdout)["shown"] == [2, 3, 4, 5]
    assert "warning" not in again.stderr


@pytest.fixture(autouse=True)
def _no_services(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Commands run in this process: keep them off any embedded services of this environment."""
    monkeypatch.setenv("RIVERBED_SERVICES_DIR", str(tmp_path / "services"))

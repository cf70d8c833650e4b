"""First-hour papercuts of the CLI, in-process through Typer's runner: `context … --dry-run`
previews an edit as the HTTP API's ``dry_run`` does, `usage` shows condensations in a column
of their own, and `archive` says what it did in sentences."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from typer.testing import CliRunner

from riverbed import events
from riverbed.cli import app
from riverbed.errors import InputError


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


@pytest.fixture(autouse=True)
def _no_services(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Commands run in this process: keep them off any embedded services of this environment."""
    monkeypatch.setenv("RIVERBED_SERVICES_DIR", str(tmp_path / "services"))

"""The ``riverbed`` command against the test Redis: in-process (Typer's CliRunner), and as a real
process where the entry point, a signal or a pipe is what is tested."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
import pytest
import redis

from riverbed import events
from tests.kit.cli import (
    assert_one_sentence,
    fill,
    last_id,
    ok,
    riverbed_command,
    run,
    run_all,
    run_process,
    sample_events,
)

GOLDEN = Path(__file__).parent / "golden" / "events.jsonl"


# --- export / import / log --------------------------------------------------------------------


@pytest.mark.slow
def test_export_import_and_log_round_trip_10000_events_byte_for_byte(
    cli_env: dict[str, str], redis_url: str, prefix: str, tmp_path: Path
) -> None:
    fill(redis_url, prefix, "orig", sample_events(10_000))
    exported = ok(cli_env, "export", "orig")
    lines = exported.splitlines()
    assert len(lines) == 10_000
    assert [json.loads(line)["id"] for line in lines] == list(range(1, 10_001))
    assert ok(cli_env, "log", "orig", "--json") == exported

    dump = tmp_path / "orig.jsonl"
    assert run(cli_env, "export", "orig", "--out", str(dump)).returncode == 0
    assert dump.read_bytes() == exported
    result = run(cli_env, "import", str(dump), "--into", "copy")
    assert result.returncode == 0, result.stderr.decode()
    assert "imported 10000 events" in result.stderr.decode()
    assert ok(cli_env, "export", "copy") == exported

    window = ok(cli_env, "log", "copy", "--json", "--from", "10", "--until", "20").splitlines()
    assert [json.loads(line)["id"] for line in window] == list(range(10, 21))
    assert window == lines[9:20]


def test_import_takes_the_session_from_the_file_name_and_reads_stdin(cli_env: dict[str, str], tmp_path: Path) -> None:
    golden = GOLDEN.read_bytes()
    named = tmp_path / "golden-1.jsonl"
    named.write_bytes(golden)
    needs_flag, from_name, no_into = run_all(
        [(cli_env, ["import", str(named), "--into", "strict"]), (cli_env, ["import", str(named), "--keep-unknown"]),
         (cli_env, ["import", "-"])]
    )  # fmt: skip
    assert_one_sentence(needs_flag, 2, "line 24", "unknown event kind 'teleport'", "--keep-unknown")
    assert from_name.returncode == 0, from_name.stderr.decode()
    assert_one_sentence(no_into, 2, "--into")
    ok(cli_env, "import", "-", "--into", "piped", "--keep-unknown", stdin=golden)
    for result in run_all([(cli_env, ["export", "golden-1"]), (cli_env, ["export", "piped"])]):
        assert result.stdout == golden


def test_import_refuses_a_session_that_has_events(cli_env: dict[str, str], redis_url: str, prefix: str) -> None:
    fill(redis_url, prefix, "taken", sample_events(3))
    result = run(cli_env, "import", "-", "--into", "taken", stdin=b'{"kind":"think","thought":"x"}\n')
    assert_one_sentence(result, 2, "session 'taken' already has 3 events")
    assert last_id(redis_url, prefix, "taken") == 3


def test_import_assigns_missing_ids(cli_env: dict[str, str]) -> None:
    body = b'{"kind":"message","content":"hi","source":"user"}\n\n{"kind":"think","thought":"hmm","id":2}\n'
    ok(cli_env, "import", "-", "--into", "loose", stdin=body)
    got = [json.loads(line) for line in ok(cli_env, "export", "loose").splitlines()]
    assert [(e["id"], e["kind"]) for e in got] == [(1, "message"), (2, "think")]


GOOD = b'{"kind":"think","thought":"fine"}'
BAD_FILES = {
    "not-json": (b'{"kind":"think","thought": oops}', "line 3", "JSON"),
    "unknown-kind": (b'{"kind":"teleport","to":"mars"}', "line 3", "unknown event kind 'teleport'"),
    "missing-field": (b'{"kind":"message","source":"user"}', "line 3", "missing required field `content`"),
    "wrong-type": (b'{"kind":"cmd_run","command":["ls"]}', "line 3", "cmd_run"),
    "no-kind": (b'{"thought":"x"}', "line 3", "no 'kind'"),
    "id-out-of-order": (b'{"kind":"think","thought":"x","id":7}', "line 3", "id 7"),
    "answered-twice": (b'{"kind":"error","content":"x","cause":1}', "line 3", "already answered"),
}


def test_a_bad_import_names_the_line_and_writes_nothing(
    cli_env: dict[str, str], redis_url: str, prefix: str, tmp_path: Path
) -> None:
    first = b'{"kind":"cmd_run","command":"ls"}'
    answer = b'{"kind":"cmd_output","content":"","cause":1}'
    jobs = []
    for case, (bad, *_fragments) in BAD_FILES.items():
        path = tmp_path / f"{case}.jsonl"
        path.write_bytes(b"\n".join([first, answer, bad, GOOD, GOOD]) + b"\n")
        jobs.append((cli_env, ["import", str(path)]))
    for (case, (_bad, *fragments)), result in zip(BAD_FILES.items(), run_all(jobs), strict=True):
        assert_one_sentence(result, 2, f"{case}.jsonl", *fragments)
        assert last_id(redis_url, prefix, case) == 0


def test_import_of_a_missing_file_is_one_sentence(offline_env: dict[str, str], tmp_path: Path) -> None:
    assert_one_sentence(run(offline_env, "import", str(tmp_path / "nope.jsonl")), 2, "cannot read", "nope.jsonl")


def test_readable_log_shows_kinds_sources_and_content(cli_env: dict[str, str]) -> None:
    ok(cli_env, "import", "-", "--into", "story", "--keep-unknown", stdin=GOLDEN.read_bytes())
    text = ok(cli_env, "log", "story").decode()
    lines = text.splitlines()
    assert len(lines) == len([line for line in GOLDEN.read_bytes().splitlines() if line.strip()])
    assert "cmd_run" in lines[4]
    assert "$ pytest -q" in lines[4]
    assert "runtime_lost (retryable)" in lines[17]
    assert "?teleport" in lines[23]
    assert "2026-11-02 09:00:01.250" in lines[1]
    missing, backwards = run_all(
        [(cli_env, ["log", "nothing-here"]), (cli_env, ["log", "story", "--from", "5", "--until", "2"])]
    )
    assert_one_sentence(missing, 2, "no events")
    assert_one_sentence(backwards, 2, "--until")


def test_view_prints_one_readable_line_per_event_when_piped(
    cli_env: dict[str, str], redis_url: str, prefix: str
) -> None:
    long = "word " * 60
    fill(
        redis_url,
        prefix,
        "readable",
        [
            events.SessionConfig(env={"GREETING": "hi", "OLD": None}, source="user"),
            events.Message(content=long, source="user"),
            events.PythonRun(code="print('computing')\n6 * 7"),
            events.PythonOutput(content="computing\n", result="42", cause=3),
            events.PythonRun(code="1 / 0"),
            events.PythonOutput(
                exception="Traceback (most recent call last):\nZeroDivisionError: division by zero", cause=5
            ),
        ],
    )
    env = {**cli_env, "COLUMNS": "80"}
    lines = ok(env, "view", "readable").decode().splitlines()
    assert len(lines) == 6, lines
    assert long.strip()[:150] in lines[1]  # not wrapped at 80 columns
    assert "GREETING=hi, unset OLD" in lines[0]
    assert lines[2].endswith(">>> print('computing') 6 * 7")
    assert lines[3].endswith("computing → 42")
    assert lines[5].endswith("raised ZeroDivisionError: division by zero")
    assert not any('{"' in line for line in lines)  # no JSON blobs
    assert len(ok(env, "view", "readable", "--until", "6").splitlines()) == 6
    for bad in ("0", "7", "-1"):
        assert_one_sentence(run(env, "view", "readable", "--until", bad), 2, "choose an event id from 1 to 6")


def test_sessions_lists_last_id_and_tenant(cli_env: dict[str, str], redis_url: str, prefix: str) -> None:
    assert ok(cli_env, "sessions", "--json") == b""
    fill(redis_url, prefix, "s-1", sample_events(7))
    fill(redis_url, prefix, "s-2", sample_events(3))
    rows = [json.loads(line) for line in ok(cli_env, "sessions", "--json").splitlines()]
    assert [(r["session"], r["last"], r["tenant"]) for r in rows] == [("s-1", 7, "acme"), ("s-2", 3, "acme")]
    table = ok(cli_env, "sessions").decode()
    assert "s-1" in table
    assert "acme" in table


# --- follow -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_log_follow_picks_up_new_events_and_stops_cleanly(
    stop: signal.Signals, cli_env: dict[str, str], redis_url: str, prefix: str
) -> None:
    fill(redis_url, prefix, "live", sample_events(3))
    with subprocess.Popen(
        [*riverbed_command(), "log", "live", "--follow", "--json"],
        env=cli_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        try:
            assert proc.stdout is not None
            first = [json.loads(proc.stdout.readline())["id"] for _ in range(3)]
            assert first == [1, 2, 3]
            fill(redis_url, prefix, "live", [events.Think(thought=f"later {i}") for i in range(4)])
            later = [json.loads(proc.stdout.readline()) for _ in range(4)]
            assert [e["id"] for e in later] == [4, 5, 6, 7]
            assert later[-1]["thought"] == "later 3"
            proc.send_signal(stop)
            _out, err = proc.communicate(timeout=10)
            assert proc.returncode == 0, err.decode()
            assert b"Traceback" not in err
        finally:
            if proc.poll() is None:
                proc.kill()


def test_version_prints_the_package_version(offline_env: dict[str, str]) -> None:
    from riverbed import __version__  # noqa: PLC0415

    result = run_process(offline_env, "--version")  # the installed entry point, as a real process
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().strip() == f"riverbed {__version__}"


# --- configuration errors ---------------------------------------------------------------------


def test_unreachable_redis_fails_fast_in_one_sentence(offline_env: dict[str, str]) -> None:
    env = offline_env
    started = time.monotonic()
    result = run(env, "log", "anything")
    elapsed = time.monotonic() - started
    assert_one_sentence(result, 1, f"cannot reach Redis at {env['RIVERBED_REDIS_URL']}")
    assert elapsed < 15, elapsed  # refused at once, not retried with backoff


BAD_CONFIG = [
    ({"RIVERBED_PREFIX": "Bad-Prefix"}, ["sessions"], "RIVERBED_PREFIX='Bad-Prefix' is not valid"),
    ({"RIVERBED_REDIS_URL": "http://localhost:6379"}, ["sessions"], "is not a valid URL: it must start with redis://"),
    ({"RIVERBED_REDIS_URL": "redis://localhost:notaport"}, ["sessions"], "is not valid"),
    ({"RIVERBED_LEASE_SECONDS": "soon"}, ["sessions"], "RIVERBED_LEASE_SECONDS"),
    ({}, ["export", "x", "--prefix", "UPPER"], "--prefix 'UPPER' (RIVERBED_PREFIX) is not valid"),
    ({}, ["log", "has space"], "not a valid session id"),
    ({"RIVERBED_CONCURRENCY": "abc"}, ["worker", "runtime"], "RIVERBED_CONCURRENCY='abc' is not valid: it must"),
    ({"RIVERBED_SANDBOX": "docker"}, ["worker", "runtime"], "use 'namespaces' or 'process'"),
    ({"RIVERBED_SERVE_PORT": "http"}, ["serve"], "RIVERBED_SERVE_PORT='http' is not valid"),
    ({"RIVERBED_LOG_LEVEL": "LOUD"}, ["sessions"], "RIVERBED_LOG_LEVEL='LOUD' is not valid"),
]


def test_bad_configuration_is_one_sentence(offline_env: dict[str, str]) -> None:
    results = run_all([({**offline_env, **extra}, args) for extra, args, _ in BAD_CONFIG])
    for (_extra, _args, fragment), result in zip(BAD_CONFIG, results, strict=True):
        assert_one_sentence(result, 2, fragment)
    # The exit code and the one line on stderr of a real process, too.
    extra, args, fragment = BAD_CONFIG[0]
    assert_one_sentence(run_process({**offline_env, **extra}, *args), 2, fragment)


# --- schema -----------------------------------------------------------------------------------


def test_schema_is_json_covering_every_kind(offline_env: dict[str, str]) -> None:
    schema = json.loads(ok(offline_env, "schema"))
    tags = {
        tag
        for definition in schema["$defs"].values()
        for tag in definition.get("properties", {}).get("kind", {}).get("enum", [])
    }
    builtin = {kind for kind, cls in events.kinds().items() if cls.__module__.startswith("riverbed.")}
    assert builtin <= tags  # other test modules register kinds in this process, not in the subprocess
    assert schema["discriminator"]["propertyName"] == "kind"
    # The golden samples (written for other languages) carry the fields the schema names.
    message = schema["$defs"]["Message"]
    assert "content" in message["required"]


# --- embedded services ------------------------------------------------------------------------


@pytest.fixture
def services_dir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="rb-svc-", dir="/tmp"))
    root.chmod(0o755)
    yield root / "services"
    subprocess.run([*riverbed_command(), "services", "down", "--dir", str(root / "services")], check=False, timeout=60)
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_services_up_prints_working_exports_and_down_stops_them(
    offline_env: dict[str, str], services_dir: Path
) -> None:
    env = {k: v for k, v in offline_env.items() if k not in ("RIVERBED_REDIS_URL", "RIVERBED_DATABASE_URL")}
    result = run(env, "services", "up", "--dir", str(services_dir), timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    exports = dict(
        line.removeprefix("export ").split("=", 1) for line in result.stdout.decode().splitlines() if line.strip()
    )
    assert set(exports) == {"RIVERBED_REDIS_URL", "RIVERBED_DATABASE_URL", "RIVERBED_SERVICES_DIR"}
    assert exports["RIVERBED_SERVICES_DIR"] == str(services_dir)
    redis_url = exports["RIVERBED_REDIS_URL"]
    database_url = exports["RIVERBED_DATABASE_URL"].strip("'")
    assert redis.Redis.from_url(redis_url).ping()

    async def query() -> int:
        import asyncpg  # noqa: PLC0415

        conn = await asyncpg.connect(database_url)
        try:
            return int(await conn.fetchval("SELECT 1"))
        finally:
            await conn.close()

    assert anyio.run(query) == 1
    # `up` again adopts the running services.
    again = run(env, "services", "up", "--dir", str(services_dir), timeout=60)
    assert again.stdout == result.stdout
    # A command without a Redis URL says it uses the services already running there.
    reused = run({**env, "RIVERBED_SERVICES_DIR": str(services_dir)}, "sessions")
    assert reused.returncode == 0, reused.stderr.decode()
    assert f"using the embedded services already running in {services_dir}" in reused.stderr.decode()
    # The shell line works as documented.
    shell = subprocess.run(
        ["bash", "-c", f'eval "$({" ".join(riverbed_command())} services up --dir {services_dir})"; '
         "echo $RIVERBED_REDIS_URL; echo $RIVERBED_DATABASE_URL"],
        env=env, capture_output=True, check=True, timeout=60,
    )  # fmt: skip
    assert shell.stdout.decode().split() == [redis_url, database_url]

    # `services down` in a shell that ran the exports stops these services, with no --dir.
    elsewhere = {**env, "RIVERBED_SERVICES_DIR": str(services_dir.parent / "not-these")}
    down = subprocess.run(
        ["bash", "-c", f'eval "$({" ".join(riverbed_command())} services up --dir {services_dir})"; '
         f'{" ".join(riverbed_command())} services down'],
        env=elsewhere, capture_output=True, check=False, timeout=60,
    )  # fmt: skip
    assert down.returncode == 0, down.stderr.decode()
    assert f"stopped the services in {services_dir}" in down.stderr.decode()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(redis_url, socket_connect_timeout=1).ping()
    assert "no services were running" in run(env, "services", "down", "--dir", str(services_dir)).stderr.decode()


def test_help_lists_the_commands(offline_env: dict[str, str]) -> None:
    text = ok(offline_env, "--help").decode()
    for command in ("log", "export", "import", "sessions", "schema", "services"):
        assert command in text
    listed = [m.group(1) for m in re.finditer(r"^│ (\w+) ", text, flags=re.MULTILINE)]
    assert listed[:8] == ["demo", "services", "worker", "act", "append", "log", "view", "fork"]  # daily first
    assert listed.index("schema") > listed.index("status")
    for args in (["--help"], ["act", "--help"], ["fork", "--help"], ["log", "--help"], ["services", "up", "--help"]):
        shown = ok(offline_env, *args).decode()
        for placeholder in ("<str>", "<int>", "<float>", "<bool>", "<path>", " TEXT", " INTEGER", " FLOAT"):
            assert placeholder not in shown, (args, placeholder, shown)
    assert re.search(r"--at +N ", ok(offline_env, "fork", "--help").decode())
    assert msgspec.json.decode(ok(offline_env, "schema"))  # stdout is the schema only

"""Bad input, through the Python API and the CLI: one clear sentence, a non-zero exit,
nothing appended, no worker exit.  Also what validation at the boundary must not break:
imports never re-execute, readable output never passes a program's escape sequences on."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.exceptions as rexc

from riverbed import events
from riverbed.bus.connection import translate
from riverbed.client.session import Bus
from riverbed.errors import AlreadyAnswered, DecodeError, InputError, UnavailableError
from tests.kit.cli import assert_one_sentence, last_id, ok, run, run_all
from tests.kit.workers import WorkerProcess

MIB = 1024 * 1024


def deep(levels: int) -> Any:
    value: Any = []
    for _ in range(levels):
        value = [value]
    return value


# --- the Python API ---------------------------------------------------------------------------

BAD_EVENTS: dict[str, tuple[events.Event, str]] = {
    "timeout-nan": (events.CmdRun(command="true", timeout=math.nan), "timeout"),
    "timeout-inf": (events.CmdRun(command="true", timeout=math.inf), "at most 86400"),
    "timeout-zero": (events.CmdRun(command="true", timeout=0), "greater than 0"),
    "timeout-negative": (events.CmdRun(command="true", timeout=-1), "greater than 0"),
    "timeout-over-a-day": (events.CmdRun(command="true", timeout=86_401), "at most 86400"),
    "python-timeout-zero": (events.PythonRun(code="1", timeout=0), "timeout"),
    "k-zero": (events.Recall(query="q", k=0), "k is 1 to 100"),
    "k-negative": (events.Recall(query="q", k=-1), "k is 1 to 100"),
    "k-2**64": (events.Recall(query="q", k=2**64), "k is 1 to 100"),
    "k-101": (events.Recall(query="q", k=101), "k is 1 to 100"),
    "line-zero": (events.FileRead(path="a", start=0), "line numbers start at 1"),
    "env-prompt-command": (events.SessionConfig(env={"PROMPT_COMMAND": "echo hi"}), "PROMPT_COMMAND is reserved"),
    "env-ps1-unset": (events.SessionConfig(env={"PS1": None}), "PS1 is reserved"),
    "env-ifs": (events.SessionConfig(env={"IFS": ","}), "IFS is reserved"),
    "env-bad-name": (events.SessionConfig(env={"A B": "1"}), "not a valid environment variable name"),
    "env-nul": (events.SessionConfig(env={"A": "x\x00y"}), "NUL"),
    "nested": (events.Finish(outputs={"x": deep(100)}), "more than 64 levels"),
    "too-deep-to-encode": (events.Finish(outputs={"x": deep(5000)}), "more than 64 levels"),
    "too-large": (events.Message(content="x" * (5 * MIB)), "RIVERBED_MAX_EVENT_BYTES"),
}


@pytest.mark.anyio
@pytest.mark.parametrize("case", sorted(BAD_EVENTS))
async def test_a_bad_event_is_refused_by_append_and_act_and_nothing_is_appended(bus: Bus, case: str) -> None:
    event, fragment = BAD_EVENTS[case]
    session = bus.session("s1")
    (first,) = await session.append(events.Think(thought="before"))
    with pytest.raises(InputError, match=re.escape(fragment)) as refused:
        await session.append(events.Think(thought="same batch"), event)
    assert "\n" not in str(refused.value)
    if isinstance(event, events.Action):
        with pytest.raises(InputError, match=re.escape(fragment)):
            await session.act(event, timeout=5)
    assert await session.last_id() == first


def test_input_decoding_refuses_unknown_fields_with_a_hint_and_deep_json_in_one_sentence() -> None:
    with pytest.raises(DecodeError, match=r"cmd_run has no field 'timout' \(did you mean 'timeout'\?\)"):
        events.from_json('{"kind": "cmd_run", "command": "ls", "timout": 5}')
    with pytest.raises(DecodeError, match=r"recall has no field 'kk' \(did you mean 'k'\?\)"):
        events.from_builtins({"kind": "recall", "kk": 3})
    with pytest.raises(DecodeError, match=r"unknown event kind 'cmd_rnu' \(did you mean 'cmd_run'\?\)"):
        events.from_json('{"kind": "cmd_rnu"}')
    with pytest.raises(DecodeError, match="nested too deeply"):
        events.from_json('{"kind": "finish", "outputs": {"x": ' + "[" * 5000 + "]" * 5000 + "}}")
    with pytest.raises(DecodeError, match="more than 64 levels"):
        events.from_json(json.dumps({"kind": "finish", "outputs": {"x": deep(100)}}))
    with pytest.raises(DecodeError, match="timeout"):
        events.from_json('{"kind": "cmd_run", "command": "ls", "timeout": 1e999}')
    # The log's own decoder stays forward compatible: a field a newer version wrote is ignored.
    newer = events.decode_json('{"kind": "cmd_run", "command": "ls", "from_the_future": 1}')
    assert newer == events.CmdRun(command="ls", ts=newer.ts)


def test_the_schema_states_the_bounds() -> None:
    defs = events.json_schema()["$defs"]
    timeout = next(t for t in defs["CmdRun"]["properties"]["timeout"]["anyOf"] if t.get("type") == "number")
    assert timeout["exclusiveMinimum"] == 0
    assert timeout["maximum"] == events.MAX_TIMEOUT
    assert defs["Recall"]["properties"]["k"]["minimum"] == 1
    assert defs["Recall"]["properties"]["k"]["maximum"] == 100


@pytest.mark.anyio
async def test_a_session_id_is_matched_whole(bus: Bus) -> None:
    for bad in ("s1\n", "s1\nx", "\ns1", "s 1", "s{1}"):
        with pytest.raises(InputError, match="not a valid session id"):
            bus.session(bad)
        with pytest.raises(InputError, match="not a valid session id"):
            await bus.log_store.append(bad, [events.Think(thought="x")])


@pytest.mark.anyio
async def test_a_second_answer_raises_already_answered_an_input_error(bus: Bus) -> None:
    session = bus.session("s1")
    (action,) = await session.append(events.CmdRun(command="true"))
    await session.append(events.CmdOutput(content="", cause=action))
    with pytest.raises(AlreadyAnswered) as refused:
        await session.append(events.Error(content="late", cause=action))
    assert (refused.value.cause, refused.value.existing) == (action, 2)
    assert isinstance(refused.value, InputError)
    assert issubclass(DecodeError, InputError)
    assert await session.last_id() == 2


@pytest.mark.anyio
async def test_act_on_a_kind_nothing_answers_returns_at_once(bus: Bus) -> None:
    session = bus.session("s1")
    with anyio.fail_after(5):
        said = await session.act(events.Message(content="hi", source="user"), timeout=60)
    assert isinstance(said, events.Message)
    assert said.id == 1
    with pytest.raises(InputError, match="act timeout"):
        await session.act(events.CmdRun(command="true"), timeout=math.nan)
    assert await session.last_id() == 1


def test_redis_refusing_a_value_as_too_large_is_an_input_error_not_unavailable() -> None:
    with pytest.raises(InputError, match="too large") as refused, translate("redis://h:1"):
        raise rexc.ResponseError("Protocol error: invalid bulk length")
    assert not isinstance(refused.value, UnavailableError)
    with pytest.raises(UnavailableError), translate("redis://h:1"):
        raise rexc.ConnectionError("Connection refused")


# --- the CLI, with a runtime worker running ---------------------------------------------------


@pytest.fixture
def worker(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[WorkerProcess]:
    (tmp_path / "ws").mkdir()
    proc = WorkerProcess(["runtime"], name="bad-input-w", redis_url=redis_url, prefix=prefix, workspace=tmp_path / "ws")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.close()


def bad_cli_cases(tmp_path: Path) -> list[tuple[list[str], bytes | None, str]]:
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"kind": "message", "content": "x" * (5 * MIB)}))
    deep_json = '{"kind": "finish", "outputs": {"x": ' + "[" * 5000 + "]" * 5000 + "}}"
    return [
        (["act", "s1", '{"kind": "cmd_run", "command": "ls", "timout": 5}'], None, "did you mean 'timeout'"),
        (["act", "s1", '{"kind": "cmd_run", "command": "ls", "timeout": 0}'], None, "greater than 0"),
        (["act", "s1", '{"kind": "cmd_run", "command": "ls", "timeout": -3}'], None, "greater than 0"),
        (["act", "s1", '{"kind": "cmd_run", "command": "ls", "timeout": 1e999}'], None, "timeout"),
        (["act", "s1", '{"kind": "cmd_run", "command": "ls", "timeout": 86401}'], None, "at most 86400"),
        (["act", "s1", '{"kind": "cmd_run", "command": "ls", "timeout": NaN}'], None, "not valid JSON"),
        (["act", "s1", '{"kind": "recall", "query": "q", "k": 0}'], None, "k is 1 to 100"),
        (["act", "s1", '{"kind": "recall", "query": "q", "k": 18446744073709551616}'], None, "k is 1 to 100"),
        (["act", "s1", '{"kind": "file_read", "path": "a", "start": 0}'], None, "line numbers start at 1"),
        (["act", "s1", deep_json], None, "nested too deeply"),
        (["act", "s1", "-"], deep_json.encode(), "nested too deeply"),
        (["act", "s1", "@" + str(tmp_path / "missing.json")], None, "cannot read"),
        (["act", "s1", "-"], b"[1, 2]", "not a JSON array"),
        (["act", "s1", '{"kind": "think", "thought": "x"}', "--timeout", "nan"], None, "act timeout"),
        (["append", "s1", "@" + str(big)], None, "RIVERBED_MAX_EVENT_BYTES"),
        (["append", "s1", '{"kind": "session_config", "env": {"PROMPT_COMMAND": "x"}}'], None, "reserved"),
        (["append", "s1", '[{"kind": "think", "thought": "x"}, {"kind": "think", "tought": "y"}]'], None, "item 2"),
        (["append", "s1", "[]"], None, "holds no events"),
        (["append", "s1\n", '{"kind": "think", "thought": "x"}'], None, "not a valid session id"),
        (["log", "s1\n"], None, "not a valid session id"),
    ]


def test_bad_input_through_the_cli_is_one_sentence_appends_nothing_and_the_worker_lives(
    cli_env: dict[str, str], redis_url: str, prefix: str, worker: WorkerProcess, tmp_path: Path
) -> None:
    cases = bad_cli_cases(tmp_path)
    piped = [(args, stdin, fragment) for args, stdin, fragment in cases if stdin is not None]
    plain = [(args, fragment) for args, stdin, fragment in cases if stdin is None]
    results = run_all([(cli_env, args) for args, _ in plain])
    for (args, fragment), result in zip(plain, results, strict=True):
        assert "Traceback" not in result.stderr.decode(), args
        assert_one_sentence(result, 2, fragment)
    for args, stdin, fragment in piped:
        assert_one_sentence(run(cli_env, *args, stdin=stdin), 2, fragment)
    assert last_id(redis_url, prefix, "s1") == 0
    assert worker.proc.poll() is None
    # ... and the worker still answers.
    answer = json.loads(ok(cli_env, "act", "s1", '{"kind": "cmd_run", "command": "echo still-here"}'))
    assert "still-here" in answer["content"]


HUGE = str(2**70)  # past every 64-bit id

#: Inputs that once ended in "unexpected error" (exit 1): now one sentence and exit 2.
UNEXPECTED_ONCE: list[tuple[list[str], str]] = [
    (["dlq", "requeue", "abc"], "no dead letter with id 'abc'"),
    (["dlq", "requeue", HUGE], "no dead letter"),
    (["worker", "runtime", "--concurrency", HUGE], "(RIVERBED_CONCURRENCY) is not valid: it must be a whole number"),
    (["worker", "runtime", "--metrics-port", "99999"], "--metrics-port 99999 (RIVERBED_METRICS_PORT) is not valid"),
    (["append", "s1", os.fsdecode(b'{"kind": "message", "content": "\xff"}')], "not UTF-8"),
    (["export", "s1", "--out", "/dev/full"], "cannot write /dev/full"),
    (["fork", "s1", "--at", "1", "--into", "s1-f", "--timeout", "nan"], "--timeout must be a number of seconds"),
    (["context", "s1", "forget", "999"], "event 999 is beyond the log of 's1' (its last event is 2)"),
    (["keys", "revoke", os.fsdecode(b"\xff")], "an argument or input is not UTF-8 text"),
    (["worker", "runtime", "--prefix", "rb_lease_nan"], "RIVERBED_LEASE_SECONDS='nan' is not valid"),
    (["worker", "runtime", "--prefix", "rb_drain_nan"], "RIVERBED_DRAIN_SECONDS='nan' is not valid"),
]
#: The environment of the cases above that need a variable of their own (by their --prefix).
CASE_ENV = {"rb_lease_nan": {"RIVERBED_LEASE_SECONDS": "nan"}, "rb_drain_nan": {"RIVERBED_DRAIN_SECONDS": "nan"}}


def test_inputs_that_were_unexpected_errors_exit_2_in_one_sentence(cli_env: dict[str, str]) -> None:
    ok(cli_env, "append", "s1", '[{"kind": "message", "content": "hi"}, {"kind": "think", "thought": "t"}]')
    results = run_all([({**cli_env, **CASE_ENV.get(args[-1], {})}, args) for args, _ in UNEXPECTED_ONCE])
    for (args, fragment), result in zip(UNEXPECTED_ONCE, results, strict=True):
        assert "unexpected error" not in result.stderr.decode(), args
        assert_one_sentence(result, 2, fragment)
    services = run(cli_env, "services", "up", "--dir", "/proc/riverbed-none")  # (after a progress line)
    assert services.returncode == 2, services.stderr.decode()
    assert "riverbed: cannot use /proc/riverbed-none for the services' data" in services.stderr.decode()
    port = run(cli_env, "serve", "--port", "99999")  # (it used to listen on 99999 % 65536)
    assert port.returncode == 2, port.stderr.decode()
    assert "99999" in port.stderr.decode()  # (the setting's sentence names it)
    # Ids past 2**64 read what the log has.
    assert ok(cli_env, "log", "s1", "--json", "--until", HUGE).count(b"\n") == 2
    assert ok(cli_env, "log", "s1", "--json", "--from", HUGE) == b""
    assert b"think" in ok(cli_env, "context", "s1", "--until", HUGE)
    assert last_id_of(cli_env, "s1") == 2  # nothing was appended by the refused inputs


def last_id_of(env: dict[str, str], session: str) -> int:
    return len(ok(env, "log", session, "--json").splitlines())


def test_act_and_append_read_json_from_a_file_or_stdin(
    cli_env: dict[str, str], worker: WorkerProcess, tmp_path: Path
) -> None:
    action = tmp_path / "action.json"
    action.write_text('{"kind": "cmd_run", "command": "echo from-a-file"}')
    answer = json.loads(ok(cli_env, "act", "s2", f"@{action}"))
    assert answer["cause"] == 1
    assert "from-a-file" in answer["content"]
    piped = json.loads(ok(cli_env, "act", "s2", "-", stdin=b'{"kind": "cmd_run", "command": "echo from-stdin"}'))
    assert "from-stdin" in piped["content"]
    said = run(cli_env, "act", "s2", '{"kind": "message", "content": "nobody answers this"}', "--timeout", "600")
    assert said.returncode == 0, said.stderr.decode()
    assert json.loads(said.stdout)["id"] == 5  # at once: the action itself, with its id
    assert ok(cli_env, "append", "s2", '{"kind": "think", "thought": "t"}') == b"6\n"
    batch = b'[{"kind": "think", "thought": "a"}, {"kind": "message", "content": "b", "source": "user"}]'
    assert json.loads(ok(cli_env, "append", "s2", "-", "--json", stdin=batch)) == {"session": "s2", "ids": [7, 8]}
    refused = run(cli_env, "append", "s2", '{"kind": "think", "thought": "x"}', "--expected-last", "3")
    assert_one_sentence(refused, 2, "expected the last event id to be 3")


# --- import never re-executes -----------------------------------------------------------------


def test_import_into_a_new_session_does_not_run_the_imported_actions_again(
    cli_env: dict[str, str], redis_url: str, prefix: str, worker: WorkerProcess, tmp_path: Path
) -> None:
    count = '{"kind": "cmd_run", "command": "cat counter 2>/dev/null | wc -l"}'
    for _ in range(3):
        ok(cli_env, "act", "orig", '{"kind": "cmd_run", "command": "echo ran >> counter"}')
    assert json.loads(ok(cli_env, "act", "orig", count))["content"].strip() == "3"
    dump = tmp_path / "orig.jsonl"
    ok(cli_env, "export", "orig", "--out", str(dump))
    # An action still waiting for its answer at export time runs in the copy (as in a fork).
    with dump.open("a") as out:
        out.write('{"kind": "cmd_run", "command": "echo once >> pending"}\n')
    imported = run(cli_env, "import", str(dump), "--into", "copy")
    assert imported.returncode == 0, imported.stderr.decode()
    assert "imported 9 events" in imported.stderr.decode()
    # The runtime handles a session's actions in order: once this one is answered, any
    # re-execution of the imported actions would have happened already.
    check = '{"kind": "cmd_run", "command": "cat counter 2>/dev/null | wc -l; cat pending"}'
    answer = json.loads(ok(cli_env, "act", "copy", check))
    assert answer["content"].split() == ["0", "once"]
    log = [json.loads(line) for line in ok(cli_env, "log", "copy", "--json").splitlines()]
    later = log[9:]
    assert sorted(e["kind"] for e in later) == ["cmd_output", "cmd_output", "cmd_run"]
    assert {e["cause"] for e in later if e["kind"] == "cmd_output"} == {9, answer["cause"]}
    assert json.loads(ok(cli_env, "act", "orig", count))["content"].strip() == "3"
    assert worker.proc.poll() is None


# --- readable output --------------------------------------------------------------------------

HOSTILE = "title\x1b]0;pwned\x07 clip\x1b]52;c;cHduZWQ=\x07 csi\x1b[2J\x1b[31mred bel\x07 c1\x9b31m rlo\u202eevil"
_SGR = re.compile(rb"\x1b\[[0-9;]*m")


def test_log_and_view_escape_a_programs_control_characters_but_keep_riverbeds_colours(
    cli_env: dict[str, str], redis_url: str, prefix: str
) -> None:
    from tests.kit.cli import fill  # noqa: PLC0415

    fill(
        redis_url,
        prefix,
        "hostile",
        [events.CmdRun(command="cat evil"), events.CmdOutput(content=HOSTILE, exit_code=0, cause=1, command=HOSTILE)],
    )
    plain = run_all([(cli_env, ["log", "hostile"]), (cli_env, ["view", "hostile"])])
    coloured = run_all(
        [({**cli_env, "FORCE_COLOR": "1", "TERM": "xterm"}, args) for args in (["log", "hostile"], ["view", "hostile"])]
    )
    for result in plain + coloured:
        assert result.returncode == 0, result.stderr.decode()
        shown = _SGR.sub(b"", result.stdout)
        for byte in (b"\x1b", b"\x07", "\x9b".encode(), "\u202e".encode()):
            assert byte not in shown, (byte, result.stdout)
        assert rb"\x1b]0;pwned\x07" in shown
        assert rb"\x1b]52;c;cHduZWQ=\x07" in shown
        assert rb"\u202eevil" in shown
    for result in coloured:
        assert _SGR.search(result.stdout), "riverbed's own colours are kept"


# --- human output of every command ------------------------------------------------------------


def test_human_output_of_every_command(
    cli_env: dict[str, str], redis_url: str, prefix: str, worker: WorkerProcess, tmp_path: Path
) -> None:
    answer = json.loads(ok(cli_env, "act", "h1", '{"kind": "cmd_run", "command": "echo human"}'))
    assert answer["kind"] == "cmd_output"
    ok(cli_env, "append", "h1", '{"kind": "session_config", "env": {"GREETING": "hi"}, "source": "user"}')
    dump = tmp_path / "h1.jsonl"
    results = run_all(
        [
            (cli_env, ["status"]),
            (cli_env, ["sessions"]),
            (cli_env, ["log", "h1"]),
            (cli_env, ["view", "h1"]),
            (cli_env, ["dlq", "list"]),
            (cli_env, ["export", "h1", "--out", str(dump)]),
        ]
    )
    results.append(run(cli_env, "fork", "h1", "--at", "2", "--into", "h1-fork"))  # after status counted sessions
    for result in results:
        assert result.returncode == 0, (result.args, result.stderr.decode())
        assert b"Traceback" not in result.stderr
    status, sessions, log, view, dlq, export, fork = (r.stdout.decode() + r.stderr.decode() for r in results)
    assert "runtime" in status
    assert "bad-input-w" in status
    assert "sessions: 1" in status
    assert "h1" in sessions
    assert "$ echo human" in log
    assert "[exit 0] human" in log
    assert "session_config" in log
    assert "$ echo human" in view
    assert "id" in dlq
    assert "exported 3 events" in export
    assert "forked h1 at event 2 into h1-fork" in fork
    imported = run(cli_env, "import", str(dump), "--into", "h1-copy")
    assert imported.returncode == 0, imported.stderr.decode()
    assert "imported 3 events into 'h1-copy'" in imported.stderr.decode()
    assert "fork" in ok(cli_env, "log", "h1-fork").decode()
    assert "ready" not in run(cli_env, "schema").stderr.decode()


def test_a_reserved_name_already_in_a_log_is_skipped_by_the_worker_not_fatal(
    cli_env: dict[str, str], redis_url: str, prefix: str, worker: WorkerProcess
) -> None:
    import riverbed  # noqa: PLC0415

    async def write_past_the_boundary() -> None:
        async with riverbed.connect(redis_url, prefix=prefix) as bus:
            config = events.SessionConfig(env={"PROMPT_COMMAND": "echo hijacked", "GREETING": "hi"}, source="user")
            await bus.log_store.append("old", [config])  # as a log written before the name was reserved

    anyio.run(write_past_the_boundary)
    answer = json.loads(ok(cli_env, "act", "old", '{"kind": "cmd_run", "command": "echo $GREETING; echo done"}'))
    assert answer["content"].split() == ["hi", "done"]
    assert worker.proc.poll() is None


# --- the HTTP API: every malformed header, parameter or body is 400/413, never 500 -----------

BIG = str(2**64)
BAD_UTF8_STRING = b'{"kind": "think", "thought": "\xff\xfe"}'
# (method, path, body bytes or None, extra headers, the statuses allowed)
BAD_HTTP: list[tuple[str, str, bytes | None, dict[str, str], set[int]]] = [
    ("GET", "/v1/sessions/s/events", None, {"Accept": "text/event-stream", "Last-Event-ID": "²"}, {400}),
    ("GET", "/v1/sessions/s/events", None, {"Accept": "text/event-stream", "Last-Event-ID": BIG}, {400}),
    ("GET", "/v1/sessions/s/events", None, {"Accept": "text/event-stream", "Last-Event-ID": "-1"}, {400}),
    ("GET", f"/v1/sessions/s/events?until={BIG}", None, {}, {400}),
    ("GET", f"/v1/sessions/s/events?until={BIG}", None, {"Accept": "text/event-stream"}, {400}),
    ("GET", f"/v1/sessions/s/events?from={BIG}", None, {}, {400}),
    ("GET", "/v1/sessions/s/events?from=²", None, {}, {400}),
    ("GET", "/v1/sessions/s/events?from=1e3", None, {}, {400}),
    ("GET", f"/v1/sessions/s/view?until={BIG}", None, {}, {400}),
    ("GET", f"/v1/sessions/s/context?until={BIG}", None, {}, {400}),
    ("GET", "/v1/sessions/s/recall?q=x&k=²", None, {}, {400, 503}),
    ("GET", f"/v1/sessions/s/recall?q=x&k={BIG}", None, {}, {400, 503}),
    ("POST", "/v1/sessions/s/events", BAD_UTF8_STRING, {}, {400}),
    ("POST", "/v1/sessions/s/events", b"\xff", {}, {400}),
    ("POST", "/v1/sessions/s/events", b'{"kind": "think", "thought": "\\ud800"}', {}, {400}),
    ("POST", f"/v1/sessions/s/events?expected_last={BIG}", b'{"kind": "think", "thought": "x"}', {}, {400}),
    ("POST", "/v1/sessions/s/events?expected_last=²", b'{"kind": "think", "thought": "x"}', {}, {400}),
    ("POST", "/v1/sessions/s/events", b'{"kind": "think", "thought": "x"}', {"Idempotency-Key": "k" * 201}, {400}),
    ("POST", "/v1/sessions/s/events", b'{"kind": "think", "thought": "x", "id": 18446744073709551616}', {}, {201, 400}),
    (
        "POST",
        "/v1/sessions/s/events",
        b'{"kind": "cmd_output", "content": "", "cause": 18446744073709551616}',
        {},
        {400},
    ),
    ("POST", "/v1/sessions/s/events", b'{"kind": "think", "thought": "x", "ts": "yesterday"}', {}, {400}),
    ("POST", "/v1/sessions/s/events", b'{"kind": "think", "thought": "x", "tenant": 5}', {}, {400}),
    ("POST", "/v1/sessions/s/events", b"null", {}, {400}),
    ("POST", "/v1/sessions/s/events", b'"think"', {}, {400}),
    ("POST", "/v1/sessions/s/act", BAD_UTF8_STRING, {}, {400}),
    ("POST", "/v1/sessions/s/act?timeout=1e309", b'{"kind": "think", "thought": "x"}', {}, {400}),
    ("POST", "/v1/sessions/s/act?timeout=nan", b'{"kind": "think", "thought": "x"}', {}, {400}),
    ("POST", "/v1/sessions/s/act?timeout=²", b'{"kind": "think", "thought": "x"}', {}, {400}),
    ("POST", "/v1/sessions/s/act", b'{"kind": "cmd_run", "command": "ls", "timeout": 1e999}', {}, {400}),
    ("POST", "/v1/sessions/s/fork", BAD_UTF8_STRING, {}, {400}),
    ("POST", "/v1/sessions/s/fork", b'{"at": 18446744073709551616, "into": "x"}', {}, {400}),
    ("POST", "/v1/sessions/s/fork", b'{"at": -1, "into": "x"}', {}, {400}),
    ("POST", "/v1/sessions/s/fork", b'{"at": 1, "into": "bad{id"}', {}, {400}),
    ("POST", "/v1/sessions/s/fork", b'{"at": 1, "into": "x\\u0000"}', {}, {400}),
    ("POST", "/v1/sessions/s/fork", b"[]", {}, {400}),
    ("POST", "/v1/sessions/s/context", BAD_UTF8_STRING, {}, {400}),
    ("POST", "/v1/sessions/s/context", b'{"op": "forget", "ranges": [[1, 18446744073709551616]]}', {}, {400}),
    ("POST", "/v1/sessions/s/context", b'{"op": "forget", "ranges": [[-5, -1]]}', {}, {400}),
    ("POST", "/v1/sessions/s/context", b'{"op": "forget", "ranges": [[3, 1]]}', {}, {400}),
    ("POST", "/v1/sessions/s/context", b'{"op": "forget", "kinds": ["\\ud800"]}', {}, {400}),
    ("POST", "/v1/sessions/s/context", b'{"op": "pin", "ranges": [[1, 2, 3]]}', {}, {400}),
    ("POST", "/v1/sessions/s/events", b'{"kind": "think", "thought": "x"}', {"Content-Length": "²"}, {400}),
    ("GET", "/v1/sessions/s%FF/events", None, {}, {400, 404}),
    ("GET", "/v1/sessions/" + "s" * 300 + "/events", None, {}, {400}),
]


@pytest.mark.anyio
@pytest.mark.security
async def test_malformed_http_input_is_a_400_or_413_never_a_500(bus: Bus) -> None:
    import httpx  # noqa: PLC0415

    from tests.kit.serve import bearer, new_key, running  # noqa: PLC0415

    key = await new_key(bus, "acme")
    await bus.session("s", tenant="acme").append(events.Think(thought="1"), events.Think(thought="2"))
    async with running(bus) as base, httpx.AsyncClient(base_url=base, headers=bearer(key), timeout=10) as http:
        failures = []
        for method, path, body, headers, allowed in BAD_HTTP:
            if "Content-Length" in headers:  # a header httpx would set itself: sent raw below
                continue
            response = await http.request(
                method, path, content=body, headers={k: v.encode() for k, v in headers.items()}
            )
            if response.status_code not in allowed or "Traceback" in response.text:
                failures.append((method, path, body, headers, response.status_code, response.text[:200]))
            elif response.status_code >= 400:
                assert response.headers["content-type"] == "application/problem+json", (path, response.text)
        raw = await _raw_request(
            base,
            b"POST /v1/sessions/s/events HTTP/1.1\r\nHost: x\r\nContent-Length: \xc2\xb2\r\n"
            + f"Authorization: Bearer {key}\r\n\r\n".encode(),
        )
        if not raw.startswith((b"HTTP/1.1 400", b"HTTP/1.1 413")):
            failures.append(("POST", "Content-Length: ²", None, {}, raw[:100], ""))
        assert not failures, "\n".join(map(repr, failures))
        # Non-ASCII and control bytes in headers a route reads: the key, the idempotency key.
        for value in ("Bearer rbk_\u00e9", "Bearer " + "x" * 10_000, "Basic abc"):
            refused = await http.get("/v1/me", headers={"Authorization": value.encode()})
            assert refused.status_code == 401, refused.text
        odd = await http.post(
            "/v1/sessions/s/events",
            content=b'{"kind": "think", "thought": "x"}',
            headers={"Idempotency-Key": "k\u00e9".encode()},
        )
        assert odd.status_code in (201, 400), odd.text
    assert await bus.session("s").last_id() <= 4  # (the two appends above that may be taken, an id ignored)


async def _raw_request(base: str, request: bytes) -> bytes:
    import httpx  # noqa: PLC0415

    url = httpx.URL(base)
    assert url.port is not None
    async with await anyio.connect_tcp(url.host, url.port) as sock:
        await sock.send(request)
        with anyio.fail_after(10):
            return await sock.receive()


_ODD_VALUES = ["", "²", "١٢", "-1", "0", "1e3", "1_000", " 7 ", "+5", BIG, str(2**63), "nan", "x" * 3000, "\x00", "%00"]
_ODD_JSON: list[object] = [
    None,
    0,
    -1,
    2**64,
    1.5,
    "x",
    [],
    {},
    [[]],
    {"kind": None},
    {"kind": "think", "thought": None},
    {"kind": "cmd_run", "command": "\u0000"},
    {"kind": "recall", "query": "q", "k": 2**70},
    {"at": "1", "into": 5},
    {"op": 5},
    {"op": "forget", "ranges": "1-2"},
    {"op": "forget", "ranges": [[1e999, 2]]},
]


@pytest.mark.anyio
@pytest.mark.security
async def test_random_headers_parameters_and_bodies_on_every_route_never_give_500(bus: Bus) -> None:
    import random  # noqa: PLC0415

    import httpx  # noqa: PLC0415

    from riverbed.serve import ServeConfig  # noqa: PLC0415
    from tests.kit.serve import bearer, new_key, running  # noqa: PLC0415

    routes = [
        ("GET", "/v1/sessions/s/events", ["from", "until"]),
        ("POST", "/v1/sessions/s/events", ["expected_last"]),
        ("POST", "/v1/sessions/s/act", ["timeout"]),
        ("GET", "/v1/sessions/s/view", ["until"]),
        ("GET", "/v1/sessions/s/context", ["until"]),
        ("POST", "/v1/sessions/s/context", []),
        ("POST", "/v1/sessions/s/fork", []),
        ("GET", "/v1/sessions/s/usage", []),
        ("GET", "/v1/sessions/s/recall", ["q", "k"]),
        ("GET", "/v1/sessions", []),
        ("GET", "/v1/status", []),
    ]
    rng = random.Random(32)
    key = await new_key(bus, "acme")
    await bus.session("s", tenant="acme").append(events.Think(thought="1"))
    failures = []
    async with (
        running(bus, ServeConfig(rate=0)) as base,
        httpx.AsyncClient(base_url=base, headers=bearer(key), timeout=10) as http,
    ):
        for _ in range(400):
            method, path, names = rng.choice(routes)
            params = {name: rng.choice(_ODD_VALUES) for name in names if rng.random() < 0.7}
            headers = {}
            if rng.random() < 0.3:
                headers["Accept"] = "text/event-stream"
                headers["Last-Event-ID"] = rng.choice(_ODD_VALUES).replace("\x00", "")
            if rng.random() < 0.3:
                headers["Idempotency-Key"] = rng.choice(_ODD_VALUES).replace("\x00", "") or "k"
            body = None
            if method == "POST":
                body = rng.choice(
                    [
                        json.dumps(rng.choice(_ODD_JSON)).encode(),
                        rng.randbytes(rng.randint(0, 40)),
                        b'{"kind": "think", "thought": "\xc3"}',
                    ]
                )
            sent = {k: v.strip().encode() for k, v in headers.items()}
            with anyio.fail_after(10):
                async with http.stream(method, path, params=params, content=body, headers=sent) as response:
                    if response.status_code >= 400:  # (a stream that follows on is only looked at)
                        await response.aread()
                        if response.status_code >= 500 and response.status_code != 503:
                            failures.append((method, path, params, headers, body, response.status_code, response.text))
    assert not failures, "\n".join(map(repr, failures[:10]))

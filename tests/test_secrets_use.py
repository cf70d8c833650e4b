"""Secrets a run uses and never writes: the values reach the sandbox's environment and Python
tools, and no value, or encoded form of one, is anywhere afterwards: not in Redis or its AOF,
not in Postgres, not in an HTTP answer, not in the model's requests, not in a worker's log.

The end-to-end test runs a worker process (agent, runtime and memory roles) and ``riverbed
serve`` on a Redis of its own that keeps an AOF, with the scripted model server playing a
careless model: it echoes the values, base64s and hex-encodes them, prints one 1,500 times
inside an output cut by the output cap, has a Python tool return one, and writes one into a
command of its own."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import anyio
import asyncpg
import httpx
import pytest
import redis

import riverbed
from riverbed import events, services
from riverbed.agent.hosted import RunLimits, open_run
from riverbed.agent.masking import forms
from riverbed.agent.secrets import SecretStore, TenantSecrets, keygen
from riverbed.client.session import Bus
from riverbed.errors import InputError
from riverbed.runtime.output import CappedText
from tests.kit.agent_faults import model_env  # noqa: F401  (a fixture)
from tests.kit.cli import assert_one_sentence, run
from tests.kit.openai_server import OpenAIServer, server  # noqa: F401  (a fixture)
from tests.kit.patience import within
from tests.kit.serve import bearer, new_key, serve_process
from tests.kit.workers import WorkerProcess, ready, starter

pytestmark = pytest.mark.anyio

KEY = keygen()


@pytest.fixture
def aof_redis(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A redis-server of this test's own that writes every command to its AOF at once."""
    directory = tmp_path / "redis"
    url, pid = services.start_redis(directory, appendonly=True, appendfsync="always")
    try:
        yield url, directory
    finally:
        services.stop_redis(pid)


def _needles(values: dict[str, str]) -> dict[bytes, str]:
    """Every form masking replaces, and every 12 characters in a row of each value (a value cut
    in two by a truncation leaves a part of it behind): bytes -> what it is."""
    found: dict[bytes, str] = {}
    for name, value in values.items():
        for form in forms(value):
            found[form.encode()] = f"{name} as {form!r}"
        for at in range(len(value) - 11):
            found[value[at : at + 12].encode()] = f"{name}'s characters {at} to {at + 12}"
    return found


def _hits(blob: bytes, where: str, needles: dict[bytes, str]) -> list[str]:
    return [f"{what} in {where}" for needle, what in needles.items() if needle in blob]


def _redis_dump(url: str) -> Iterator[tuple[str, bytes]]:
    """Every key of the Redis at ``url`` and everything in it."""
    client = redis.Redis.from_url(url)
    try:
        for key in client.scan_iter(count=1000):
            kind = client.type(key).decode()
            if kind == "string":
                data: object = client.get(key)
            elif kind == "hash":
                data = client.hgetall(key)
            elif kind == "list":
                data = client.lrange(key, 0, -1)
            elif kind == "set":
                data = client.smembers(key)
            elif kind == "zset":
                data = client.zrange(key, 0, -1, withscores=True)
            elif kind == "stream":
                data = client.xrange(key)
            else:
                data = b""
            yield key.decode(errors="replace"), repr(data).encode() + b"".join(_raw_bytes(data))
    finally:
        client.close()


def _raw_bytes(data: object) -> Iterator[bytes]:
    """The bytes inside ``data`` as they are (``repr`` escapes what is not ASCII)."""
    if isinstance(data, bytes):
        yield data
    elif isinstance(data, dict):
        for key, value in data.items():
            yield from _raw_bytes(key)
            yield from _raw_bytes(value)
    elif isinstance(data, list | tuple | set):
        for item in data:
            yield from _raw_bytes(item)


async def _postgres_dump(database_url: str) -> list[tuple[str, bytes]]:
    """Every row of every table of every schema of the database, as text."""
    conn = await asyncpg.connect(database_url)
    out: list[tuple[str, bytes]] = []
    try:
        tables = await conn.fetch(
            "SELECT table_schema, table_name FROM information_schema.tables "
            "WHERE table_type = 'BASE TABLE' AND table_schema NOT IN ('pg_catalog', 'information_schema')"
        )
        for row in tables:
            name = f'"{row["table_schema"]}"."{row["table_name"]}"'
            try:
                rows = await conn.fetch(f"SELECT t::text AS row FROM {name} t")
            except asyncpg.UndefinedTableError:
                continue  # (another test's schema, dropped meanwhile)
            out.append((name, "\n".join(r["row"] for r in rows).encode()))
    finally:
        await conn.close()
    return out


async def _indexed(bus: Bus, session: str) -> None:
    """Until the memory role has read and acknowledged the whole log."""
    key = bus.keys.log(session)
    with anyio.fail_after(within(60)):
        while True:
            last = (await bus.redis.xinfo_stream(key))["last-generated-id"]
            groups = {_text(g["name"]): g for g in await bus.redis.xinfo_groups(key)}
            memory = groups.get("memory")
            if memory is not None and memory["pending"] == 0 and memory["last-delivered-id"] == last:
                return
            await anyio.sleep(0.2)


def _text(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name


def _script(server: OpenAIServer, literal: str) -> None:
    """The careless model: each step a call that shows the values in one more way."""
    # (the output cap keeps the first 15,000 characters: the cut falls inside a copy of the value)
    long_output = (
        'python3 -c \'import os\nt = os.environ["GH_TOKEN"]\nprint("x" * 14980, end="")\n'
        'for i in range(1500): print("x" * (i % 97) + t)\''
    )
    encoded = (
        "import os, urllib.parse as u\nt = os.environ['GH_TOKEN']\n"
        "print(t.encode().hex(), t.encode().hex().upper(), u.quote(t, safe=''), u.quote_plus(t))"
    )
    server.reply(
        f"I have the token {literal} now.",
        tool_calls=[("cmd_run", {"command": 'echo "token=$GH_TOKEN db=$DB_PASSWORD"'})],
    )
    server.reply(
        tool_calls=[("cmd_run", {"command": 'printf %s "$GH_TOKEN" | base64; printf %s "$DB_PASSWORD" | base64'})]
    )
    server.reply(tool_calls=[("cmd_run", {"command": long_output})])
    server.reply(tool_calls=[("python_run", {"code": encoded})])
    server.reply(tool_calls=[("peek", {"name": "GH_TOKEN"})])
    server.reply(tool_calls=[("cmd_run", {"command": f"echo {literal} > echoed.txt"})])
    server.reply(tool_calls=[("finish", {"final_thought": f"done; the token was {literal}"})])


async def test_no_trace_of_a_secret_anywhere(
    aof_redis: tuple[str, Path],
    prefix: str,
    workspace: Path,
    tmp_path: Path,
    database_url: str,
    server: OpenAIServer,
    model_env: dict[str, str],
) -> None:
    url, redis_dir = aof_redis
    values = {"GH_TOKEN": f"ghp_{secrets.token_hex(16)}/a+b=c", "DB_PASSWORD": f"pw-{secrets.token_urlsafe(18)}"}
    _script(server, values["GH_TOKEN"])
    started: list[WorkerProcess] = []
    start = starter(started, url, prefix, workspace, tmp_path)
    env = {
        **model_env,
        "RIVERBED_SECRETS_KEY": KEY,
        "RIVERBED_AGENTS": "tests.kit.secret_agents",
        "RIVERBED_DATABASE_URL": database_url,
    }
    responses: list[bytes] = []
    try:
        worker = start("w-secrets", ["agent", "runtime", "memory"], extra_env=env)
        async with riverbed.connect(url, prefix=prefix) as bus:
            key = await new_key(bus, "acme")
            with serve_process(url, prefix, tmp_path / "serve.log", {"RIVERBED_SECRETS_KEY": KEY}) as base:
                async with httpx.AsyncClient(base_url=base, headers=bearer(key), timeout=within(30)) as http:

                    async def call(method: str, path: str, **kwargs: object) -> httpx.Response:
                        answer = await http.request(method, path, **kwargs)  # type: ignore[arg-type]
                        responses.append(answer.content)
                        return answer

                    for name, value in values.items():
                        assert (await call("PUT", f"/v1/secrets/{name}", content=value)).status_code == 200
                    await ready(worker)
                    opened = await call(
                        "POST",
                        "/v1/sessions/sec1/runs",
                        json={"task": "deploy", "agent": "keeper", "secrets": ["DB_PASSWORD"]},
                    )
                    assert opened.status_code == 202, opened.text
                    with anyio.fail_after(within(90)):
                        while (await call("GET", "/v1/runs")).json()["runs"][0]["state"] in ("running", "waiting"):
                            await anyio.sleep(0.2)
                    await _indexed(bus, "sec1")
                    log_lines = (await call("GET", "/v1/sessions/sec1/events")).text
                    await call("GET", "/v1/sessions/sec1/view")
                    await call("GET", "/v1/sessions/sec1/context")
                    await call("GET", "/v1/sessions/sec1/usage")
                    await call("GET", "/v1/sessions/sec1/recall", params={"q": "token"})
                    await call("GET", "/v1/secrets")
                    last = len(log_lines.splitlines())
                    sse = await call(
                        "GET",
                        "/v1/sessions/sec1/events",
                        headers={"Accept": "text/event-stream"},
                        params={"until": last},
                    )
                    assert sse.status_code == 200
            log = await bus.session("sec1").events()
            cli_log = run(
                {"RIVERBED_REDIS_URL": url, "RIVERBED_PREFIX": prefix, "COLUMNS": "200"}, "log", "sec1"
            ).stdout
        worker.terminate()
    finally:
        for process in started:
            process.close()

    # What ran had the values, and what was written holds a marker where each was.
    outputs = [e.content for e in log if isinstance(e, events.CmdOutput | events.PythonOutput | events.ToolResult)]
    assert len(outputs) == 6, [e.kind for e in log]
    assert "token=[secret GH_TOKEN] db=[secret DB_PASSWORD]" in outputs[0]
    assert outputs[1].splitlines()[:2] == ["[secret GH_TOKEN]", "[secret DB_PASSWORD]"]
    long = next(e for e in log if isinstance(e, events.CmdOutput) and "range(1500)" in e.command)
    assert long.truncated
    assert long.content.count("[secret GH_TOKEN]") > 100
    assert outputs[3].count("[secret GH_TOKEN]") == 4, outputs[3]
    assert outputs[4] == "the value of GH_TOKEN is [secret GH_TOKEN]"
    response = next(e for e in log if isinstance(e, events.LlmResponse))
    assert "I have the token [secret GH_TOKEN] now." in json.dumps(events.to_builtins(response))
    (echoed,) = workspace.rglob("echoed.txt")  # (the command the model wrote ran with the marker)
    assert echoed.read_text() == "[secret GH_TOKEN]\n"
    assert log[-1].kind == "finish"
    assert "[secret GH_TOKEN]" in log_lines

    # Nothing anywhere holds a value or a form of one.
    needles = _needles(values)
    found: list[str] = []
    for key_name, blob in _redis_dump(url):
        found += _hits(blob, f"Redis key {key_name}", needles)
    for path in sorted(redis_dir.rglob("*")):
        if path.is_file():
            found += _hits(path.read_bytes(), f"Redis file {path.name}", needles)
    for table, blob in await _postgres_dump(database_url):
        found += _hits(blob, f"Postgres table {table}", needles)
    for index, blob in enumerate(responses):
        found += _hits(blob, f"HTTP response {index}", needles)
    found += _hits(json.dumps(server.requests).encode(), "the model's requests", needles)
    found += _hits(cli_log, "riverbed log", needles)
    for path in [worker.log_path, tmp_path / "serve.log"]:
        found += _hits(path.read_bytes(), path.name, needles)
    assert not found, found
    assert b"sec1" in b"".join(responses)  # (the scan read what it says it read)
    assert sse.content.count(b"\nid: ") + sse.content.startswith(b"id: ") >= 10


async def test_a_run_may_name_only_its_tenants_secrets(bus: Bus, cli_env: dict[str, str]) -> None:
    store = SecretStore(bus.client, bus.keys, KEY)
    await store.set("acme", "GH_TOKEN", "ghp_0123456789abcdef")
    await store.set("other", "THEIRS", "their-value-123")
    missing = "no secret NOPE for this tenant"
    with pytest.raises(InputError, match=missing):
        await open_run(bus, "n1", "go", tenant="acme", secrets=["GH_TOKEN", "NOPE"])
    # Another tenant's secret gets the answer a missing one gets.
    with pytest.raises(InputError, match="no secret THEIRS for this tenant"):
        await open_run(bus, "n2", "go", tenant="acme", secrets=["THEIRS"])
    with pytest.raises(InputError, match="secrets belong to a tenant and this session has none"):
        await open_run(bus, "n3", "go", secrets=["GH_TOKEN"])
    with pytest.raises(InputError, match="is not a secret name"):
        await open_run(bus, "n4", "go", tenant="acme", secrets=["lower"])
    assert await bus.session("n1").events() == []  # nothing was appended for a refused run
    opened = await open_run(bus, "n5", "go", tenant="acme", secrets=["GH_TOKEN"], limits=RunLimits(max_steps=2))
    started = (await bus.session("n5").events())[-1]
    assert isinstance(started, events.RunStarted)
    assert (started.id, started.secrets) == (opened.opened, ["GH_TOKEN"])
    refused = run({**cli_env, "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}, "agent", "n6", "go", "--tenant", "acme",
                  "--secrets", "GH_TOKEN,THEIRS", "--detach")  # fmt: skip
    assert_one_sentence(refused, 2, "no secret THEIRS for this tenant")


async def test_a_value_split_across_chunks_or_cut_by_the_cap_is_masked(bus: Bus) -> None:
    store = SecretStore(bus.client, bus.keys, KEY)
    value = "tok-" + secrets.token_hex(12)
    await store.set("acme", "TOKEN", value)
    tenants = TenantSecrets(store)
    await tenants.refresh("acme")
    masker = tenants.masker("acme")
    assert masker is not None
    text = CappedText(200, masker)
    # The value arrives in pieces, and the cap's cut falls inside one of its copies.
    output = ("a" * 95 + value + "b" * 50) * 4
    for at in range(0, len(output), 7):
        text.feed(output[at : at + 7])
    rendered = text.render()
    assert text.truncated
    assert value[4:20] not in rendered
    assert "[secret TOKEN]" in rendered
    # Without the masks the cut leaves the start of a value behind (what the masks guard).
    bare = CappedText(200)
    for at in range(0, len(output), 7):
        bare.feed(output[at : at + 7])
    assert bare.render().split("\n[...")[0].endswith(value[:5])
    # A value set after the last read is found as soon as it is asked for.
    await store.set("acme", "LATE", "late-value-" + secrets.token_hex(4))
    assert set(await tenants.values("acme", ["LATE"])) == {"LATE"}
    masker = tenants.masker("acme")
    assert masker is not None
    assert "LATE" in masker.secrets
    with pytest.raises(InputError, match="no secret NOPE for this tenant"):
        await tenants.values("acme", ["NOPE"])

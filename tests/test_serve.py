"""The HTTP API against real Redis over real HTTP (uvicorn in this event loop, on a free port)."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest

from riverbed import events
from riverbed.client.session import Bus
from riverbed.serve import KeyStore, ServeConfig
from tests.kit.agents import record
from tests.kit.serve import assert_problem, bearer, new_key, running
from tests.kit.workers import Spawn, spawn, workers  # noqa: F401  (fixtures)

pytestmark = pytest.mark.anyio


def lines(response: httpx.Response) -> list[dict[str, object]]:
    return [json.loads(line) for line in response.text.splitlines() if line]


async def test_keys_are_required_checked_and_revocable(bus: Bus) -> None:
    store = KeyStore(bus.redis, bus.keys, bus.url)
    key, record = await store.create("acme")
    assert record.sha256 not in key
    assert key not in str(await bus.redis.hgetall(bus.keys.api_keys))
    async with running(bus) as base, httpx.AsyncClient(base_url=base) as http:
        assert_problem(await http.get("/v1/sessions"), 401, "Authorization: Bearer")
        assert_problem(await http.get("/v1/sessions", headers=bearer("rbk_nonsense")), 401, "not valid")
        forged = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
        assert_problem(await http.get("/v1/sessions", headers=bearer(forged)), 401)
        me = await http.get("/v1/me", headers=bearer(key))
        assert me.json() == {"key_id": record.id, "tenant": "acme", "admin": False}
        await store.revoke(record.id)
        assert_problem(await http.get("/v1/me", headers=bearer(key)), 401, "revoked")
    listed = await store.list()
    assert [r.id for r in listed] == [record.id]
    assert listed[0].revoked is not None


async def test_append_read_and_tenants_see_only_their_own_sessions(bus: Bus) -> None:
    acme, other, admin = await new_key(bus, "acme"), await new_key(bus, "globex"), await new_key(bus, None, admin=True)
    async with running(bus) as base, httpx.AsyncClient(base_url=base) as http:
        batch = [
            {"kind": "message", "content": "hi", "source": "user", "tenant": "globex"},
            {"kind": "think", "thought": "t"},
        ]
        created = await http.post("/v1/sessions/s1/events", json=batch, headers=bearer(acme))
        assert created.status_code == 201, created.text
        assert created.json() == {"session": "s1", "ids": [1, 2]}
        one = await http.post("/v1/sessions/s1/events", json={"kind": "think", "thought": "3"}, headers=bearer(acme))
        assert one.json()["ids"] == [3]
        await http.post("/v1/sessions/g1/events", json={"kind": "think", "thought": "g"}, headers=bearer(other))

        read = await http.get("/v1/sessions/s1/events", headers=bearer(acme))
        assert read.headers["content-type"].startswith("application/x-ndjson")
        got = lines(read)
        assert [(e["id"], e["kind"], e["tenant"]) for e in got] == [
            (1, "message", "acme"),
            (2, "think", "acme"),
            (3, "think", "acme"),
        ]
        part = lines(await http.get("/v1/sessions/s1/events?from=2&until=2", headers=bearer(acme)))
        assert [e["id"] for e in part] == [2]
        async for event in bus.session("s1").log():
            assert event.tenant == "acme"  # the tenant the client sent is overridden

        mine = (await http.get("/v1/sessions", headers=bearer(acme))).json()["sessions"]
        assert [(s["session"], s["tenant"], s["last"]) for s in mine] == [("s1", "acme", 3)]
        assert set(mine[0]["roles"]) == {"runtime", "memory", "condenser"}
        everyone = (await http.get("/v1/sessions", headers=bearer(admin))).json()["sessions"]
        assert {s["session"] for s in everyone} == {"s1", "g1"}

        # Another tenant's session answers exactly like a missing one, on every route.
        for n, (method, path, body) in enumerate(
            [
                ("GET", "/v1/sessions/s1/events", None),
                ("POST", "/v1/sessions/s1/events", {"kind": "think", "thought": "x"}),
                ("POST", "/v1/sessions/s1/act", {"kind": "think", "thought": "x"}),
                ("GET", "/v1/sessions/s1/view", None),
                ("POST", "/v1/sessions/s1/fork", {"at": 1, "into": "stolen"}),
            ]
        ):
            theirs = await http.request(method, path, json=body, headers=bearer(other))
            missing = await http.request(method, path.replace("s1", f"nope{n}"), json=body, headers=bearer(other))
            assert_problem(theirs, 404, "no session 's1'")
            if method == "GET" or path.endswith("fork"):
                assert_problem(missing, 404)
        assert await bus.session("s1").last_id() == 3
        assert lines(await http.get("/v1/sessions/s1/events", headers=bearer(admin)))[-1]["id"] == 3


async def test_expected_last_and_idempotency_key(bus: Bus) -> None:
    key = await new_key(bus, "acme")
    async with running(bus) as base, httpx.AsyncClient(base_url=base, headers=bearer(key)) as http:
        think = {"kind": "think", "thought": "once"}
        first = await http.post("/v1/sessions/s/events", json=think, headers={"Idempotency-Key": "k1"})
        again = await http.post("/v1/sessions/s/events", json=think, headers={"Idempotency-Key": "k1"})
        assert first.json()["ids"] == again.json()["ids"] == [1]
        ok = await http.post("/v1/sessions/s/events?expected_last=1", json=think)
        assert ok.json()["ids"] == [2]
        stale = await http.post("/v1/sessions/s/events?expected_last=1", json=think)
        body = assert_problem(stale, 409, "expected the last event id to be 1 but it is 2")
        assert body["last"] == 2
        assert await bus.session("s").last_id() == 2


async def test_bad_input_is_a_problem_document_never_a_traceback(bus: Bus) -> None:
    key = await new_key(bus, "acme")
    config = ServeConfig(max_body_bytes=2000)
    async with running(bus, config) as base, httpx.AsyncClient(base_url=base, headers=bearer(key)) as http:
        assert_problem(await http.post("/v1/sessions/s/events", content=b"{nope"), 400, "not valid JSON")
        assert_problem(await http.post("/v1/sessions/s/events", json={"kind": "teleport"}), 400, "unknown event kind")
        assert_problem(
            await http.post("/v1/sessions/s/events", json={"kind": "think", "thougt": "x"}), 400, "did you mean"
        )
        assert_problem(await http.post("/v1/sessions/s/events", content=b""), 400, "JSON body")
        big = {"kind": "think", "thought": "x" * 5000}
        assert_problem(await http.post("/v1/sessions/s/events", json=big), 413, "limit")
        assert_problem(
            await http.post("/v1/sessions/s/act", json={"kind": "cmd_output", "content": ""}), 400, "not an action"
        )
        assert_problem(
            await http.post("/v1/sessions/s/act?timeout=9999", json={"kind": "cmd_run", "command": "ls"}),
            400,
            "at most",
        )
        assert_problem(
            await http.post("/v1/sessions/bad%7Bid/events", json={"kind": "think", "thought": "x"}),
            400,
            "not a valid session id",
        )
        assert_problem(await http.get("/v1/sessions/s/events?from=x"), 400, "whole number")
        assert_problem(await http.get("/nowhere"), 404, "/openapi.json")
        assert_problem(await http.delete("/v1/sessions"), 405)
        assert await bus.session("s").last_id() == 0


async def test_act_answers_with_the_observation_and_times_out_as_504(bus: Bus, spawn: Spawn) -> None:
    key = await new_key(bus, "acme")
    async with running(bus) as base, httpx.AsyncClient(base_url=base, headers=bearer(key), timeout=30) as http:
        late = await http.post("/v1/sessions/s/act?timeout=0.3", json={"kind": "cmd_run", "command": "echo hi"})
        assert_problem(late, 504, "no observation answered action 1")
        message = await http.post("/v1/sessions/s/act", json={"kind": "message", "content": "no answer needed"})
        assert message.json()["kind"] == "message"
        assert message.json()["id"] == 2

        spawn("serve-w", ["runtime"], RIVERBED_SANDBOX="process").wait_ready()
        answer = await http.post("/v1/sessions/s/act?timeout=20", json={"kind": "cmd_run", "command": "echo from-api"})
        assert answer.status_code == 200, answer.text
        observation = answer.json()
        assert observation["kind"] == "cmd_output"
        assert "from-api" in observation["content"]
        assert observation["tenant"] == "acme" or observation["tenant"] is None


async def test_sse_follows_live_and_resumes_after_last_event_id(bus: Bus) -> None:
    key = await new_key(bus, "acme")
    session = bus.session("live", tenant="acme")
    await session.append(events.Think(thought="1"), events.Think(thought="2"))

    async def collect(
        http: httpx.AsyncClient, headers: dict[str, str], count: int, url: str = "/v1/sessions/live/events"
    ) -> list[int]:
        seen: list[int] = []
        with anyio.fail_after(10):
            async with http.stream("GET", url, headers={"Accept": "text/event-stream", **headers}) as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                event_id = None
                async for line in response.aiter_lines():
                    if line.startswith("id: "):
                        event_id = int(line[4:])
                    elif line.startswith("data: "):
                        data = json.loads(line[6:])
                        assert data["id"] == event_id
                        seen.append(event_id)
                        if len(seen) == count:
                            break
        return seen

    async with running(bus) as base, httpx.AsyncClient(base_url=base, headers=bearer(key), timeout=10) as http:
        async with anyio.create_task_group() as tg:
            result: list[int] = []

            async def follow() -> None:
                result.extend(await collect(http, {}, 4))

            tg.start_soon(follow)
            await anyio.sleep(0.2)
            await session.append(events.Think(thought="3"))
            await session.append(events.Think(thought="4"))
        assert result == [1, 2, 3, 4]
        await session.append(events.Think(thought="5"))
        assert await collect(http, {"Last-Event-ID": "3"}, 2) == [4, 5]
        # ``until`` ends the stream by itself.
        async with http.stream("GET", "/v1/sessions/live/events?until=2", headers={"Accept": "text/event-stream"}) as r:
            body = (await r.aread()).decode()
        assert [line for line in body.splitlines() if line.startswith("id: ")] == ["id: 1", "id: 2"]
        assert_problem(
            await http.get("/v1/sessions/live/events", headers={"Accept": "text/event-stream", "Last-Event-ID": "x"}),
            400,
        )


async def test_view_fork_status_and_the_open_endpoints(bus: Bus) -> None:
    key, admin = await new_key(bus, "acme"), await new_key(bus, None, admin=True)
    session = bus.session("v", tenant="acme")
    await record(
        session,
        events.Message(content="a", source="user"),
        events.Think(thought="b"),
        events.Think(thought="c"),
        events.Condensation(forgotten=[(1, 2)], summary="a and b", cause=None),
    )
    async with running(bus) as base, httpx.AsyncClient(base_url=base, headers=bearer(key)) as http:
        full = (await http.get("/v1/sessions/v/view?until=3")).json()
        assert [e["kind"] for e in full["events"]] == ["message", "think", "think"]
        condensed = (await http.get("/v1/sessions/v/view")).json()
        assert [e["kind"] for e in condensed["events"]] == ["summary", "think"]
        assert condensed["summary_index"] == 0
        assert condensed["last_id"] == 4

        forked = await http.post("/v1/sessions/v/fork", json={"at": 2, "into": "v2"})
        assert forked.status_code == 201, forked.text
        assert forked.json()["forked"] == 3
        copied = lines(await http.get("/v1/sessions/v2/events"))
        assert [e["kind"] for e in copied] == ["message", "think", "forked"]
        assert copied[-1]["workspace"] == "replay"  # the runtime that serves it rebuilds its sandbox
        empty = await http.post("/v1/sessions/v/fork", json={"at": 2, "into": "v4", "workspace": "empty"})
        assert empty.status_code == 201, empty.text
        assert lines(await http.get("/v1/sessions/v4/events"))[-1]["workspace"] == "empty"
        assert_problem(
            await http.post("/v1/sessions/v/fork", json={"at": 2, "into": "v5", "workspace": "clone"}), 400, "workspace"
        )
        assert_problem(await http.post("/v1/sessions/v/fork", json={"at": 9, "into": "v3"}), 400, "choose an event id")
        assert_problem(await http.post("/v1/sessions/v/fork", json={"at": 1}), 400, "into")

        mine = (await http.get("/v1/status")).json()
        assert mine["sessions"] == 3
        assert [r["role"] for r in mine["roles"]] == ["runtime", "memory", "condenser"]
        everything = (await http.get("/v1/status", headers=bearer(admin))).json()
        assert everything["sessions"] == 3
        assert "workers" in everything
        assert "dead_letters" in everything

        assert (await http.get("/healthz", headers={})).json() == {"alive": True}
        assert (await http.get("/readyz", headers={})).json() == {"ready": True}
        spec = (await http.get("/openapi.json")).json()
        assert spec["openapi"].startswith("3.1")
        assert {"/v1/sessions", "/v1/sessions/{session}/act", "/v1/sessions/{session}/events"} <= set(spec["paths"])
        assert "CmdRun" in spec["components"]["schemas"]
        page = await http.get("/")
        assert page.status_code == 200
        assert "riverbed" in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]


async def test_recall_searches_the_session_without_writing_to_it(bus: Bus, database_url: str, prefix: str) -> None:
    from riverbed.memory.embedders import LocalEmbedder  # noqa: PLC0415  (loads onnxruntime)
    from riverbed.memory.recall import Memory  # noqa: PLC0415
    from riverbed.memory.store import Store  # noqa: PLC0415

    acme, other = await new_key(bus, "acme"), await new_key(bus, "globex")
    session = bus.session("r", tenant="acme")
    await record(
        session,
        events.Message(content="Please fix the failing login test.", source="user"),
        events.CmdRun(command="pytest tests/test_login.py"),
        events.CmdOutput(
            content="FAILED test_login.py::test_password_hash - bcrypt rounds must be at least 4", exit_code=1, cause=2
        ),
        events.Think(thought="The weather in Lisbon is sunny today; unrelated to the task."),
    )
    await bus.session("elsewhere", tenant="acme").append(
        events.Think(thought="bcrypt rounds must be at least 4, said another session")
    )
    memory = Memory.cached(Store(database_url, schema=prefix), LocalEmbedder())
    try:
        await memory.store.start()
        for name in ("r", "elsewhere"):
            await memory.index(name, await bus.session(name).events(), tenant="acme")
        async with running(bus, memory=memory) as base, httpx.AsyncClient(base_url=base) as http:
            found = await http.get(
                "/v1/sessions/r/recall", params={"q": "bcrypt rounds error", "k": 3}, headers=bearer(acme)
            )
            assert found.status_code == 200, found.text
            body = found.json()
            assert body["query"] == "bcrypt rounds error"
            hits = body["hits"]
            assert (hits[0]["event_id"], hits[0]["kind"]) == (3, "cmd_output")
            assert {h["session"] for h in hits} == {"r"}  # the session's own events only
            assert len(hits) <= 3
            assert await session.last_id() == 4  # a search appends nothing

            assert_problem(
                await http.get("/v1/sessions/r/recall", params={"q": "bcrypt"}, headers=bearer(other)),
                404,
                "no session",
            )
            assert_problem(await http.get("/v1/sessions/r/recall", headers=bearer(acme)), 400, "q parameter")
            assert_problem(
                await http.get("/v1/sessions/r/recall", params={"q": "x", "k": 500}, headers=bearer(acme)),
                400,
                "at most",
            )
            assert_problem(await http.get("/v1/sessions/r/recall", params={"q": "bcrypt"}), 401)
        async with running(bus) as base, httpx.AsyncClient(base_url=base, headers=bearer(acme)) as http:
            assert_problem(
                await http.get("/v1/sessions/r/recall", params={"q": "bcrypt"}), 503, "RIVERBED_DATABASE_URL"
            )
    finally:
        await memory.aclose()

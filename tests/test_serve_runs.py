"""The runs routes over real HTTP against real Redis: open, list (tenant-scoped), cancel."""

from __future__ import annotations

import httpx
import pytest

from riverbed import events
from riverbed.agent.quotas import Quotas
from riverbed.client.session import Bus
from tests.kit.serve import assert_problem, bearer, new_key, running

pytestmark = pytest.mark.anyio


async def test_open_list_and_cancel_runs_scoped_to_the_tenant(bus: Bus) -> None:
    acme, globex = await new_key(bus, "acme"), await new_key(bus, "globex")
    admin = await new_key(bus, None, admin=True)
    await Quotas(bus.log_store).set("acme", max_runs=None, tokens_per_day=None, models=["m1"])
    async with running(bus) as base, httpx.AsyncClient(base_url=base) as http:
        body = {"task": "list the files", "max_steps": 5, "max_tokens": 1000, "model": "m1"}
        opened = await http.post("/v1/sessions/r1/runs", json=body, headers=bearer(acme))
        assert opened.status_code == 202, opened.text
        run = opened.json()
        assert run["session"] == "r1"
        assert run["tenant"] == "acme"
        assert run["state"] == "waiting"  # no agent worker holds it
        assert (run["steps"], run["max_steps"], run["max_tokens"]) == (0, 5, 1000)
        assert (run["task"], run["opened"]) == (1, 2)
        logged = await bus.session("r1").events()
        assert [e.kind for e in logged] == ["message", "run_started"]
        assert all(e.tenant == "acme" for e in logged)
        started = logged[1]
        assert isinstance(started, events.RunStarted)
        assert (started.max_steps, started.max_tokens, started.model) == (5, 1000, "m1")

        # a second run while one is open, and bad bodies: 400 with one sentence, nothing appended
        assert_problem(await http.post("/v1/sessions/r1/runs", json={"task": "again"}, headers=bearer(acme)),
                       400, "open already")  # fmt: skip
        for bad in ({}, {"task": "x", "max_steps": 0}, {"task": "x", "extra": 1}, {"task": "x", "max_cost": -1},
                    {"task": "  "}, {"task": 3}):  # fmt: skip
            assert_problem(await http.post("/v1/sessions/r2/runs", json=bad, headers=bearer(acme)), 400)
        assert_problem(await http.post("/v1/sessions/r2/runs", content=b"{", headers=bearer(acme)), 400)
        assert_problem(await http.post("/v1/sessions/r2/runs", headers=bearer(acme)), 400, "JSON body")
        assert await bus.session("r2").last_id() == 0

        # another tenant: its runs are its own; acme's session answers like a free id does to it
        await http.post("/v1/sessions/g1/runs", json={"task": "globex work"}, headers=bearer(globex))
        assert_problem(await http.post("/v1/sessions/r1/runs", json={"task": "mine"}, headers=bearer(globex)), 404)
        assert_problem(await http.post("/v1/sessions/r1/runs/cancel", headers=bearer(globex)), 404)
        assert_problem(await http.post("/v1/sessions/free/runs/cancel", headers=bearer(globex)), 404)
        mine = (await http.get("/v1/runs", headers=bearer(acme))).json()["runs"]
        assert [r["session"] for r in mine] == ["r1"]
        assert {"session", "tenant", "state", "steps", "tokens", "cost", "worker", "started_at"} <= set(mine[0])
        theirs = (await http.get("/v1/runs", headers=bearer(globex))).json()["runs"]
        assert [r["session"] for r in theirs] == ["g1"]
        assert_problem(await http.get("/v1/runs?tenant=acme", headers=bearer(globex)), 400, "own tenant")
        everyone = (await http.get("/v1/runs", headers=bearer(admin))).json()["runs"]
        assert {r["session"] for r in everyone} == {"r1", "g1"}
        only = (await http.get("/v1/runs?tenant=globex", headers=bearer(admin))).json()["runs"]
        assert [r["session"] for r in only] == ["g1"]
        assert_problem(await http.get("/v1/runs?state=sleeping", headers=bearer(acme)), 400, "running")

        # cancel: 202 with the run_cancel's id; no agent worker holds the run, so it ends at once
        cancelled = await http.post("/v1/sessions/r1/runs/cancel", json={"note": "enough"}, headers=bearer(acme))
        assert cancelled.status_code == 202, cancelled.text
        assert cancelled.json() == {"session": "r1", "cancel": 3}
        asked, last = (await bus.session("r1").events())[-2:]
        assert isinstance(asked, events.RunCancel)
        assert (asked.note, asked.tenant) == ("enough", "acme")
        assert isinstance(last, events.Error)
        assert (last.source, last.reason, last.tenant) == ("agent", "cancelled", "acme")
        assert_problem(await http.post("/v1/sessions/r1/runs/cancel", content=b"[", headers=bearer(acme)), 400)
        assert (await http.get("/v1/runs?state=running", headers=bearer(acme))).json()["runs"] == []
        ended = (await http.get("/v1/runs?state=cancelled", headers=bearer(acme))).json()["runs"]
        assert [r["session"] for r in ended] == ["r1"]
        assert (await http.get("/v1/runs?state=finished", headers=bearer(acme))).json() == {
            "runs": [],
            "next_cursor": None,
        }
        assert_problem(await http.post("/v1/sessions/g1/runs/cancel", headers=bearer(acme)), 404)

        spec = (await http.get("/openapi.json")).json()
        assert {"/v1/runs", "/v1/sessions/{session}/runs", "/v1/sessions/{session}/runs/cancel"} <= set(spec["paths"])
        assert "task" in spec["components"]["schemas"]["RunRequest"]["required"]


async def test_cancel_without_an_open_run_is_refused(bus: Bus) -> None:
    acme = await new_key(bus, "acme")
    await bus.session("idle", tenant="acme").append(events.Message(content="hi", source="user"))
    async with running(bus) as base, httpx.AsyncClient(base_url=base) as http:
        assert_problem(await http.post("/v1/sessions/idle/runs/cancel", headers=bearer(acme)), 400, "no open run")
    assert await bus.session("idle").last_id() == 1

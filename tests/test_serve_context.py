"""Context edits and usage over the HTTP API, against real Redis over real HTTP."""

from __future__ import annotations

import httpx
import pytest

from riverbed import events
from riverbed.client.session import Bus
from riverbed.memory.context import context_edit, preview, report
from riverbed.serve import ServeConfig
from tests.kit import agents
from tests.kit.serve import assert_problem, bearer, new_key, running

pytestmark = pytest.mark.anyio


async def record(bus: Bus, name: str) -> None:
    s = bus.session(name, tenant="acme")
    await s.append(
        events.Message(content="fix the test", source="user"),
        events.LlmResponse(model="m", content="run it", usage={"prompt_tokens": 100, "completion_tokens": 10}),
        events.CmdRun(command="pytest"),
    )
    await agents.record(s, events.Error(content="boom", reason="runtime_lost", retryable=True, cause=3))
    await s.append(
        events.Think(thought="again"),
        events.LlmResponse(
            model="m",
            content="done",
            usage={"prompt_tokens": 200, "completion_tokens": 20, "prompt_tokens_details": {"cached_tokens": 64}},
        ),
    )


def test_preview_is_the_fold_with_the_edit_added() -> None:
    log = [
        events.with_id(events.Message(content="a", source="user"), 1),
        events.with_id(events.Think(thought="b"), 2),
        events.with_id(events.Think(thought="c"), 3),
    ]
    change = preview(log, context_edit("forget", [(2, 2)]))
    assert (change.edit, change.hidden, change.shown) == (4, (2,), ())
    assert report(log).hidden == ()  # nothing was appended to the log given


async def test_context_report_edit_dry_run_and_usage(bus: Bus) -> None:
    await record(bus, "ctx")
    acme, other = await new_key(bus, "acme"), await new_key(bus, "globex")
    prices = '{"m": {"prompt": 1.0, "completion": 2.0, "cached": 0.5}}'
    async with running(bus, ServeConfig(prices=prices)) as base, httpx.AsyncClient(base_url=base) as http:
        path = "/v1/sessions/ctx"
        shown = (await http.get(f"{path}/context", headers=bearer(acme))).json()
        assert shown["visible"] == [1, 2, 3, 4, 5, 6]
        assert shown["hidden"] == []
        assert shown["pinned"] == []
        assert shown["summary"] is None

        # A dry run says what would change and appends nothing.
        body = {"op": "forget", "kinds": ["error"], "dry_run": True}
        dry = await http.post(f"{path}/context", json=body, headers=bearer(acme))
        assert dry.status_code == 200, dry.text
        assert dry.json() == {
            "session": "ctx",
            "dry_run": True,
            "edit": 7,
            "hidden": [3, 4],  # the error hides the command it answers too
            "shown": [],
            "pinned": [],
            "unpinned": [],
        }
        assert await bus.session("ctx").last_id() == 6
        beyond = {"op": "forget", "ranges": [[99, 99]], "dry_run": True}
        refused = await http.post(f"{path}/context", json=beyond, headers=bearer(acme))
        assert refused.status_code == 400, refused.text  # as the edit itself would be
        assert "event 99 is beyond the log" in refused.text

        # Applied, the change is the one previewed.
        applied = await http.post(f"{path}/context", json={**body, "dry_run": False}, headers=bearer(acme))
        assert applied.status_code == 201, applied.text
        assert {**applied.json(), "dry_run": True} == dry.json()
        log = [e async for e in bus.session("ctx").log()]
        assert log[-1].kind == "context_edit"
        assert log[-1].tenant == "acme"
        shown = (await http.get(f"{path}/context", headers=bearer(acme))).json()
        assert shown["visible"] == [1, 2, 5, 6]  # an edit is not part of the context
        assert [(h["id"], h["by"], h["by_kind"]) for h in shown["hidden"]] == [
            (3, 7, "context_edit"),
            (4, 7, "context_edit"),
        ]
        assert "forget --kind error" in shown["hidden"][0]["why"]
        before = (await http.get(f"{path}/context?until=6", headers=bearer(acme))).json()
        assert before["visible"] == [1, 2, 3, 4, 5, 6]
        assert before["until"] == 6

        # Pin and restore by range.
        pinned = await http.post(f"{path}/context", json={"op": "pin", "ranges": [[5, 5]]}, headers=bearer(acme))
        assert pinned.json()["pinned"] == [5]
        restored = await http.post(f"{path}/context", json={"op": "restore", "ranges": [[2, 4]]}, headers=bearer(acme))
        assert restored.json()["shown"] == [3, 4]

        # Usage: per step and in total, priced.
        used = (await http.get(f"{path}/usage", headers=bearer(acme))).json()
        assert [(s["event_id"], s["prompt_tokens"], s["cached_tokens"]) for s in used["steps"]] == [
            (2, 100, 0),
            (6, 200, 64),
        ]
        assert used["prompt_tokens"] == 300
        assert used["completion_tokens"] == 30
        assert used["cost"] == pytest.approx((100 + 136 + 64 * 0.5 + 30 * 2.0) / 1e6)

        # Bad input and other tenants.
        for bad, words in [
            ({"op": "erase", "ranges": [[1, 2]]}, ["unknown context operation"]),
            ({"op": "forget"}, ["say which events"]),
            ({"op": "forget", "ranges": [[3, 1]]}, ["not a range"]),
            ({"op": "forget", "kinds": ["teleport"]}, ["unknown event kind"]),
            ({"op": "forget", "ranges": [[1, 1]], "extra": 1}, ["context body"]),
        ]:
            assert_problem(await http.post(f"{path}/context", json=bad, headers=bearer(acme)), 400, *words)
        assert_problem(await http.get(f"{path}/context?until=0", headers=bearer(acme)), 400, "until")
        for route in ("context", "usage"):
            assert_problem(await http.get(f"{path}/{route}", headers=bearer(other)), 404)
        assert_problem(
            await http.post(f"{path}/context", json={"op": "forget", "ranges": [[1, 1]]}, headers=bearer(other)), 404
        )
        assert await bus.session("ctx").last_id() == 9

        document = (await http.get("/openapi.json")).json()
        assert {"get", "post"} <= set(document["paths"]["/v1/sessions/{session}/context"])
        assert "get" in document["paths"]["/v1/sessions/{session}/usage"]
        assert "dry_run" in document["components"]["schemas"]["ContextEditRequest"]["properties"]

"""The console a team uses every day, in a real headless browser (Debian's chromium, Playwright)
against a real server and Redis: the session list, how each event kind reads, the state of the
session page across time travel, edits and forks, recall hits that say why they matched, the
runs page and the delegation tree.

Events a role or the agent would write (an observation, a sub-agent's ``delegated`` and
``delegate_result``) are appended as riverbed itself writes them (``tests.kit.agents.record``).
"""

from __future__ import annotations

import re
from typing import Any

import anyio
import httpx
import pytest

from riverbed import events
from riverbed.agent.hosted import open_run
from riverbed.client.session import Bus
from tests.kit.agents import record
from tests.kit.console import console, needs_chromium, record_session
from tests.kit.serve import bearer, new_key, running

pytestmark = [pytest.mark.anyio, needs_chromium]

TIME = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}Z$")


async def times_are_one_format(page: Any, scope: str) -> None:
    texts = await page.locator(f"{scope} time").all_inner_texts()
    assert texts, f"no times under {scope}"
    assert all(TIME.match(t) for t in texts), texts


# --- the session list -----------------------------------------------------------------------


async def make_sessions(bus: Bus) -> None:
    """Six sessions of two tenants, oldest first, one of each status, each created in a
    millisecond of its own (the sessions index orders by the creation millisecond)."""
    done = bus.session("a-done", tenant="acme")
    await done.append(events.Message(content="Fix the failing test\nit is in calc.py", source="user"))
    await done.append(events.Finish(final_thought="fixed"))
    await anyio.sleep(0.002)
    limit = bus.session("a-limit", tenant="acme")
    await limit.append(events.Message(content="Refactor everything", source="user"))
    await limit.append(events.Error(source="agent", content="the run stopped after 3 model calls", reason="step_limit"))
    await anyio.sleep(0.002)
    broken = bus.session("a-broken", tenant="acme")
    await broken.append(events.Message(content="Write the docs", source="user"))
    await broken.append(events.Error(source="agent", content="the model server answered 500", reason="llm_error"))
    await anyio.sleep(0.002)
    await open_run(bus, "a-run", "Summarise the logs", tenant="acme")
    await anyio.sleep(0.002)
    await bus.session("g-open", tenant="globex").append(events.Message(content="Hello there", source="user"))
    await anyio.sleep(0.002)
    g_done = bus.session("g-done", tenant="globex")
    await g_done.append(events.Message(content="Count the words", source="user"))
    await g_done.append(events.Finish(final_thought="42"))


def test_a_sessions_status_and_task_are_read_from_the_ends_of_its_log() -> None:
    from riverbed.agent.runs import RunSummary  # noqa: PLC0415
    from riverbed.serve.sessions import status, task_line  # noqa: PLC0415

    task = events.Message(content="\n  Fix the bug\nin calc.py", source="user")
    ended = events.Error(source="agent", reason="budget_exhausted", content="spent")
    assert status([task, events.RunStarted(), events.Think(thought="hm")]) == "running"
    assert status([task, events.Finish(), events.Condensation(forgotten=[(1, 1)])]) == "finished"
    assert status([task, ended]) == "budget exhausted"
    assert status([task, events.Error(source="runtime", content="exit 1")]) == "open"  # an action's error ends nothing
    assert status([task, events.Finish(), events.Message(content="more", source="user")]) == "open"
    # A run longer than the tail: the agent role's summary says where it is.
    assert status([events.Think(thought="x")], RunSummary(session="s", state="running")) == "running"
    assert status([], RunSummary(session="s", state="failed", reason="step_limit")) == "step limit"
    assert status([], RunSummary(session="s", state="failed", reason="llm_error")) == "error"
    assert task_line([events.SessionConfig(), task]) == "Fix the bug"
    assert task_line([events.Message(content="x" * 500, source="user")]) == "x" * 199 + "\u2026"
    assert task_line([events.Message(content="agent talk", source="agent")]) is None


async def test_session_list_has_status_task_filters_search_and_pages(bus: Bus) -> None:
    await make_sessions(bus)
    admin = await new_key(bus, None, admin=True)
    acme = await new_key(bus, "acme")
    async with running(bus) as base:
        async with httpx.AsyncClient(base_url=base) as http:
            theirs = await http.get("/v1/sessions?tenant=globex", headers=bearer(acme))
            assert theirs.status_code == 200
            assert theirs.json()["sessions"] == []  # another tenant's sessions are not listed, even asked by name
            bad = await http.get("/v1/sessions?status=sleeping", headers=bearer(acme))
            assert bad.status_code == 400
            assert "unknown session status 'sleeping'" in bad.json()["detail"]
            mine = (await http.get("/v1/sessions?limit=10", headers=bearer(acme))).json()
            assert [s["session"] for s in mine["sessions"]] == ["a-run", "a-broken", "a-limit", "a-done"]
            assert mine["total"] == 4

        async with console(base, admin) as page:
            from playwright.async_api import expect  # noqa: PLC0415

            rows = page.locator("#session-rows > tr")
            await expect(rows).to_have_count(6)
            assert await rows.first.get_attribute("data-session") == "g-done"  # newest first
            expected = {
                "a-done": "finished",
                "a-limit": "step limit",
                "a-broken": "error",
                "a-run": "running",
                "g-open": "open",
                "g-done": "finished",
            }
            for session, status in expected.items():
                await expect(page.locator(f'tr[data-session="{session}"] .status')).to_have_text(status)
            task = page.locator('tr[data-session="a-done"] td.task')
            await expect(task).to_have_text("Fix the failing test")  # the first line only
            await times_are_one_format(page, "#session-rows")

            await page.select_option("#list-status", "step limit")
            await page.click("#list-form button[type=submit]")
            await expect(rows).to_have_count(1)
            await expect(rows.first).to_contain_text("a-limit")

            await page.goto(f"{base}/#/?tenant=globex")
            await expect(rows).to_have_count(2)
            await expect(page.locator("#list-tenant")).to_have_value("globex")

            await page.fill("#list-tenant", "")
            await page.select_option("#list-status", "")
            await page.fill("#list-q", "A-")
            await page.click("#list-form button[type=submit]")
            await expect(rows).to_have_count(4)

            # Paging, newest first: 2 a page.
            await page.goto(f"{base}/#/?limit=2")
            await expect(page.locator("#list-page")).to_contain_text("1\u20132 of 6")
            assert [await r.get_attribute("data-session") for r in await rows.all()] == ["g-done", "g-open"]
            await expect(page.locator("#list-prev")).to_be_disabled()
            await page.click("#list-next")
            await expect(page.locator("#list-page")).to_contain_text("3\u20134 of 6")
            assert [await r.get_attribute("data-session") for r in await rows.all()] == ["a-run", "a-broken"]
            await page.click("#list-next")
            await expect(page.locator("#list-page")).to_contain_text("5\u20136 of 6")
            await expect(page.locator("#list-next")).to_be_disabled()
            await page.click("#list-prev")
            await expect(page.locator("#list-page")).to_contain_text("3\u20134 of 6")

        async with console(base, acme) as page:
            from playwright.async_api import expect  # noqa: PLC0415

            rows = page.locator("#session-rows > tr[data-session]")
            await expect(rows).to_have_count(4)
            assert "g-" not in await page.locator("#session-rows").inner_text()
            await page.goto(f"{base}/#/?tenant=globex")
            await expect(page.locator("#session-rows")).to_contain_text("no sessions match")


# --- how each event reads -------------------------------------------------------------------


async def test_every_event_kind_reads_as_what_it_means_with_raw_json_and_long_outputs_folded(bus: Bus) -> None:
    s = bus.session("views", tenant="acme")
    call = {"id": "call_1", "type": "function", "function": {"name": "python", "arguments": '{"code": "1/0"}'}}
    await s.append(
        events.Message(content="Compute things", source="user"),
        events.LlmResponse(model="m", tool_calls=[call], usage={"prompt_tokens": 10, "completion_tokens": 5}),
        events.PythonRun(code="x = 6 * 7\nprint('hello')\nx"),
    )
    await record(s, events.PythonOutput(content="hello\n", result="42", cause=3))
    await s.append(events.PythonRun(code="1/0"))
    traceback = 'Traceback (most recent call last):\n  File "<cell>", line 1\nZeroDivisionError: division by zero'
    await record(s, events.PythonOutput(exception=traceback, cause=5))
    await s.append(
        events.SessionConfig(
            env={"DEBUG": "1", "OLD": None}, condenser={"strategy": "llm_summarizing", "max_size": 80, "keep_first": 2}
        ),
        events.CondensationRequest(),
    )
    await record(s, events.Condensation(forgotten=[(3, 4)], summary="ran a cell", cause=8))
    await s.append(events.CmdRun(command="seq 1 500"))
    await record(s, events.CmdOutput(content="\n".join(str(n) for n in range(1, 501)), exit_code=0, cause=10))
    drift = events.Divergence(action_id=3, kind="python_output", field="result", recorded="42", new="41")
    await record(s, events.SandboxRebuilt(method="replay", at=5, actions=2, differences=[drift]))
    key = await new_key(bus, "acme")
    async with running(bus) as base, console(base, key, "/s/views") as page:
        from playwright.async_api import expect  # noqa: PLC0415

        await expect(page.locator("#at")).to_have_text("12")
        card = lambda n: page.locator(f'#timeline > li[data-id="{n}"]')  # noqa: E731

        # python_output: the value and the exception, not only stdout.
        await expect(card(3).locator(".answer")).to_contain_text("hello")
        await expect(card(3).locator(".answer pre.value")).to_have_text("42")
        await expect(card(5).locator(".answer pre.exception")).to_contain_text("ZeroDivisionError: division by zero")
        # llm_response: its tool calls' names and arguments.
        await expect(card(2).locator(".call-name")).to_have_text("python")
        await expect(card(2).locator("pre.args")).to_contain_text('"code": "1/0"')
        # session_config, condensation_request, sandbox_rebuilt: rendered, not raw JSON or "settings".
        await expect(card(7)).to_contain_text("set DEBUG=1")
        await expect(card(7)).to_contain_text("unset OLD")
        await expect(card(7)).to_contain_text("condenser llm_summarizing: max_size 80, keep_first 2")
        assert "settings" not in await card(7).locator("ul.config").inner_text()
        await expect(card(8)).to_contain_text("asked the condenser to condense now")
        await expect(card(12)).to_contain_text("re-ran 2 recorded actions; 1 divergence from the recording")
        await expect(card(12).locator("table.divergences")).to_contain_text("#3")
        await expect(card(12).locator("table.divergences")).to_contain_text('"41"')
        for n in (7, 8, 12):
            assert '{"' not in await card(n).locator(".text, ul.config").first.inner_text()

        # Every event has a raw-JSON view (an answer inside its action's card too).
        assert await page.locator("#timeline details.raw").count() == 12
        raw = card(7).locator("details.raw")
        await raw.locator("summary").click()
        await expect(raw.locator("pre")).to_contain_text('"kind": "session_config"')
        await expect(page.locator("#ctx-from")).to_have_value("")  # opening it chose nothing for an edit

        # A long output shows folded, and expands.
        long = card(10).locator(".answer pre.long")
        await expect(long).to_have_count(1)
        height = (await long.bounding_box())["height"]
        await card(10).locator(".answer .expand").click()
        await expect(long).to_have_class(re.compile(r"\bopen\b"))
        await expect(card(10).locator(".answer .expand")).to_have_text("show less")
        assert (await long.bounding_box())["height"] > height * 5
        await times_are_one_format(page, "#timeline")


# --- state of the session page --------------------------------------------------------------


async def test_badges_edits_previews_and_forks_keep_to_their_session_and_point_in_time(bus: Bus) -> None:
    await record_session(bus, "fix-calc")  # condensation #12 hides #3-#6
    await bus.session("other", tenant="acme").append(events.Message(content="Another task", source="user"))
    key = await new_key(bus, "acme")
    async with running(bus) as base, console(base, key, "/s/fix-calc") as page:
        from playwright.async_api import expect  # noqa: PLC0415

        card = lambda n: page.locator(f'#timeline > li[data-id="{n}"]')  # noqa: E731
        await expect(page.locator("#at")).to_have_text("14")
        await expect(card(3)).to_contain_text("hidden by #12")
        await expect(page.locator("#run-panel")).to_be_hidden()  # no run, no cancel button
        await expect(page.locator("#delegation")).to_be_hidden()

        # Choosing an event for an edit leaves the time-travel slider where it is.
        await card(7).locator(".head .kind").click()
        await expect(page.locator("#ctx-from")).to_have_value("7")
        await expect(page.locator("#at")).to_have_text("14")
        assert await page.locator("#slider").input_value() == "14"

        # "hidden by" badges follow time travel: at #5 nothing had hidden #3 yet.
        await page.locator("#slider").fill("5")
        await expect(page.locator("#view-note")).to_contain_text("of 5 events in the context")
        await expect(card(3)).not_to_contain_text("hidden by")
        await expect(page.locator("#timeline .badge.cond")).to_have_count(0)
        await page.locator("#slider").fill("14")
        await expect(card(3)).to_contain_text("hidden by #12")

        # A preview's message stays on its session's page.
        await page.click("#ctx-preview")
        await expect(page.locator("#ctx-result")).to_contain_text("would hide")
        await page.goto(f"{base}/#/s/other")
        await expect(page.locator("#session-title")).to_have_text("other")
        await expect(page.locator("#timeline > li")).to_have_count(1)
        await expect(page.locator("#ctx-result")).not_to_contain_text("would hide")
        await expect(page.locator("#ctx-apply")).to_be_disabled()
        await page.goto(f"{base}/#/s/fix-calc")
        await expect(page.locator("#at")).to_have_text("14")

        # After a restore the condensation still says what it hid, and what came back since.
        await bus.session("fix-calc", tenant="acme").context.edit("restore", ranges=[(3, 6)])
        await expect(page.locator("#at")).to_have_text("15")
        await expect(card(12)).to_contain_text("hid 4 events (#3\u2013#6) from the context")
        await expect(card(12)).to_contain_text("4 events of them shown again by #15")
        assert "hid 0" not in await card(12).inner_text()
        await expect(card(3)).not_to_contain_text("hidden by")

        # A fork shows how its sandbox was rebuilt, with the divergences, not only a link.
        await card(7).locator(".fork-here").click()
        await expect(page.locator("#fork-at")).to_have_text("7")
        await page.fill("#fork-into", "fix-calc-retry")
        await page.select_option("#fork-workspace", "replay")
        await page.click("#fork-form button[type=submit]")
        result = page.locator("#fork-result")
        await expect(result.locator("a")).to_have_text("fix-calc-retry")
        await expect(result).to_contain_text("when a runtime worker takes the session")
        # What the runtime appends when it has replayed the fork's actions.
        drift = events.Divergence(action_id=3, kind="cmd_output", field="exit_code", recorded=1, new=0)
        await record(
            bus.session("fix-calc-retry", tenant="acme"),
            events.SandboxRebuilt(method="replay", at=7, actions=2, differences=[drift], cause=8),
        )
        await expect(result).to_contain_text("rebuilt with 1 divergence")
        await expect(result).to_contain_text("re-ran 2 recorded actions")
        await expect(result.locator("table.divergences")).to_contain_text("exit_code")
        await expect(page.locator("#at")).to_have_text("7")


# --- runs and the delegation tree -----------------------------------------------------------


async def test_runs_page_cancels_and_the_delegation_tree_links_both_ways(bus: Bus) -> None:
    await open_run(bus, "r-1", "Summarise the logs", tenant="acme")
    await open_run(bus, "r-2", "Translate the README", tenant="acme")
    await open_run(bus, "theirs", "Not yours", tenant="globex")
    # A parent that delegated one task, and its child.
    parent = bus.session("p-1", tenant="acme")
    await parent.append(events.Message(content="Count the words of every file", source="user"))
    await record(parent, events.Delegate(task="count the words of a.txt"))
    result = events.DelegateResult(session="p-1-child-2", content="42 words", state="finished", tokens=120, cause=2)
    await record(parent, result)
    child = bus.session("p-1-child-2", tenant="acme")
    await record(child, events.Delegated(parent="p-1", parent_action=2, depth=1))
    await child.append(events.Message(content="count the words of a.txt", source="user"))
    await child.append(events.Finish(final_thought="42 words"))
    key = await new_key(bus, "acme")
    async with running(bus) as base, console(base, key, "/runs") as page:
        from playwright.async_api import expect  # noqa: PLC0415

        rows = page.locator("#run-rows > tr[data-session]")
        await expect(rows).to_have_count(2)  # the tenant's runs only
        row = page.locator('#run-rows tr[data-session="r-1"]')
        await expect(row.locator(".status")).to_have_text("waiting")  # no agent worker holds it
        await expect(row).to_contain_text("$")  # steps, tokens and cost columns
        await times_are_one_format(page, "#run-rows")
        await row.locator("button.cancel").click()
        await expect(page.locator("#runs-note")).to_contain_text("asked the agent to cancel the run of r-1")
        # No agent worker held it: the cancel ended it at once, as the agent role would.
        log = [e async for e in bus.session("r-1").log()]
        assert [e.kind for e in log[-2:]] == ["run_cancel", "error"]
        await expect(row.locator(".status")).to_have_text("cancelled", timeout=10_000)
        await expect(row.locator("button.cancel")).to_have_count(0)
        await page.select_option("#runs-state", "cancelled")
        await expect(rows).to_have_count(1)

        # The session page of a run: its state, and a cancel button.
        await page.goto(f"{base}/#/s/r-2")
        await expect(page.locator("#run-state")).to_have_text("running")
        await expect(page.locator("#run-numbers")).to_contain_text("0 steps of 30")
        await page.click("#run-cancel")
        await expect(page.locator("#run-note")).to_contain_text("asked the agent to cancel the run of r-2")
        await expect(page.locator("#run-cancel")).to_be_hidden()

        # The delegation tree: the parent links to its child, and the child back.
        await page.goto(f"{base}/#/s/p-1")
        await expect(page.locator("#delegation")).to_contain_text("sub-agents: p-1-child-2")
        answer = page.locator('#timeline > li[data-id="2"] .answer')
        await expect(answer).to_contain_text("sub-agent p-1-child-2: 42 words")
        await expect(answer.locator(".status")).to_have_text("finished")
        await expect(answer).to_contain_text("120 tokens")
        await page.locator("#delegation a", has_text="p-1-child-2").click()
        await expect(page.locator("#session-title")).to_have_text("p-1-child-2")
        await expect(page.locator("#delegation")).to_contain_text("sub-agent of p-1 (action #2)")
        await expect(page.locator("#session-meta .status")).to_have_text("finished")
        await page.locator("#delegation a", has_text="p-1").click()
        await expect(page.locator("#session-title")).to_have_text("p-1")


# --- recall hits say why they matched -------------------------------------------------------


async def test_recall_hits_say_why_they_matched(bus: Bus, database_url: str, prefix: str) -> None:
    from riverbed.memory.embedders import LocalEmbedder  # noqa: PLC0415  (memory is an extra)
    from riverbed.memory.recall import Memory  # noqa: PLC0415
    from riverbed.memory.store import Store  # noqa: PLC0415

    s = bus.session("greet", tenant="acme")
    await s.append(
        events.Message(content="Write a script that prints a greeting", source="user"),
        events.FileWrite(path="greet.py", content="print('Hello, world: a warm greeting')\n"),
        events.Think(thought="Next I should look at the database migrations."),
    )
    memory = Memory.cached(Store(database_url, schema=prefix), LocalEmbedder())
    try:
        await memory.store.start()
        await memory.index("greet", [e async for e in s.log()], tenant="acme")
        key = await new_key(bus, "acme")
        async with running(bus, memory=memory) as base:
            async with httpx.AsyncClient(base_url=base, headers=bearer(key)) as http:
                found = (await http.get("/v1/sessions/greet/recall", params={"q": "greeting script"})).json()
            best = found["hits"][0]
            assert best["why"]["words"]["matched"], best
            assert best["why"]["meaning"]["rank"] >= 1
            async with console(base, key, "/s/greet") as page:
                from playwright.async_api import expect  # noqa: PLC0415

                await expect(page.locator("#at")).to_have_text("3")
                await page.fill("#search-q", "greeting script")
                await page.click("#search-form button[type=submit]")
                hits = page.locator("#search-hits > li")
                await expect(page.locator("#search-note")).to_contain_text("best first")
                first = hits.first
                await expect(first.locator(".by-words")).to_contain_text("words: ")
                await expect(first.locator(".by-words")).to_contain_text("greeting")
                await expect(first.locator(".by-meaning")).to_contain_text(re.compile(r"meaning #\d+ \(0\.\d\d\)"))
                # A hit found only by meaning says so, with no words.
                await page.fill("#search-q", "schema changes")
                await page.click("#search-form button[type=submit]")
                await expect(page.locator("#search-note")).to_contain_text("best first")
                meaning_only = page.locator("#search-hits > li", has=page.locator(".by-meaning"))
                await expect(meaning_only.first).to_be_visible()
                assert await page.locator("#search-hits .by-words").count() == 0
                assert "score" not in await page.locator("#search-hits").inner_text()
    finally:
        await memory.aclose()

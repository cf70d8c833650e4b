"""The console's layout and wording in Debian's chromium (Playwright): the session list fits a
1,400 px screen whatever its tasks, ids and owners; the runs page shows each run's place in a
delegation tree; tokens and cost are labelled and shown one way on every page; the delegation
line reads as words (no "null")."""

from __future__ import annotations

import time
from typing import Any

import pytest

from riverbed import events
from riverbed.agent import run_index
from riverbed.agent.hosted import open_run
from riverbed.client.session import Bus
from tests.kit.agents import record
from tests.kit.console import console, needs_chromium, record_session
from tests.kit.serve import new_key, running

pytestmark = [pytest.mark.anyio, needs_chromium]

WIDTH = 1400
OWNER = "riverbed-worker-7c9f8d6b5-x2x4q-1234567"
"""A worker's name as a Kubernetes pod makes it (host name, then process id)."""


async def box(locator: Any) -> dict[str, float]:
    found = await locator.bounding_box()
    assert found is not None
    return found


async def test_the_session_list_fits_1400_px_and_a_long_task_stays_in_its_column(bus: Bus) -> None:
    from playwright.async_api import expect  # noqa: PLC0415

    long_id = "nightly-" + "refactor-of-the-billing-service-" * 3
    tasks = {
        "short": "Fix the failing test",
        long_id: "Refactor /srv/app/" + "very-long-directory-name/" * 5 + "billing.py and keep its tests green",
        "words": "Summarise " + "every log line that mentions the payment gateway timing out " * 3,
    }
    for session, task in tasks.items():
        await bus.session(session, tenant="acme-corporation").append(events.Message(content=task, source="user"))
        for role in ("runtime", "memory", "condenser"):
            await bus.client.hset(bus.keys.meta(session), f"holder:{role}", OWNER)  # a lease, as a worker holds it
            await bus.client.hset(bus.keys.meta(session), f"expires:{role}", int((time.time() + 600) * 1000))
    admin = await new_key(bus, None, admin=True)
    async with running(bus) as base, console(base, admin, width=WIDTH) as page:
        rows = page.locator("#session-rows > tr")
        await expect(rows).to_have_count(3)
        await expect(page.locator("#session-rows td.roles .owner").first).to_have_text(OWNER)
        assert await page.evaluate("document.documentElement.scrollWidth") <= WIDTH  # the page never scrolls sideways
        table = await box(page.locator("#session-table"))
        assert table["x"] + table["width"] <= WIDTH, table
        for session, text in tasks.items():
            row = page.locator(f'tr[data-session="{session}"]')
            task, tenant = row.locator("td.task"), row.locator("td:nth-child(4)")
            await expect(tenant).to_have_text("acme-corporation")
            # The task wraps inside its cell: nothing of it runs into the tenant's column.
            assert await task.evaluate("td => td.scrollWidth <= td.clientWidth"), session
            task_box, tenant_box = await box(task), await box(tenant)
            assert task_box["x"] + task_box["width"] <= tenant_box["x"] + 0.5, (session, task_box, tenant_box)
            assert await task.get_attribute("title") == text.strip()
            # A long id is cut in its cell, and whole in its title and link.
            cell = row.locator("td.session")
            assert await cell.get_attribute("title") == session
            await expect(cell.locator("a")).to_have_attribute("href", f"#/s/{session}")
        await expect(page.locator(f'tr[data-session="{long_id}"] td.task')).to_contain_text("very-long-directory-name")


async def test_runs_show_their_tree_and_tokens_and_cost_one_way_on_every_page(bus: Bus) -> None:
    from playwright.async_api import expect  # noqa: PLC0415

    # A parent whose run made one model call (801 tokens) and handed one task to a sub-agent,
    # whose run spent 786: the tree spent 1,587. No price is configured: the cost is unknown.
    opened = await open_run(bus, "tree", "Count the words of every file", tenant="acme")
    parent = bus.session("tree", tenant="acme")
    call = {"id": "c1", "type": "function", "function": {"name": "delegate", "arguments": '{"task": "a.txt"}'}}
    usage = {"prompt_tokens": 700, "completion_tokens": 101}
    (response,) = await record(parent, events.LlmResponse(model="m", tool_calls=[call], usage=usage, source="agent"))
    (delegate,) = await record(parent, events.Delegate(task="count the words of a.txt", cause=response))
    child = bus.session(f"tree.sub{delegate}", tenant="acme")
    await record(
        child,
        events.Delegated(parent="tree", parent_action=delegate, depth=1),
        events.Message(content="count the words of a.txt", source="user"),
        events.RunStarted(),
        events.LlmResponse(model="m", usage={"prompt_tokens": 700, "completion_tokens": 86}, source="agent"),
        events.Finish(final_thought="42 words", source="agent"),
    )
    async with bus.client.pipeline() as pipe:  # as the agent role lists a child it made
        run_index.queue_opened(pipe, bus.keys, child.id, time.time(), "acme", None)
        await pipe.execute()
    await record(
        parent,
        events.DelegateResult(session=child.id, content="42 words", tokens=786, cost=None, cause=delegate),
    )
    await open_run(bus, "fresh", "Not started yet", tenant="acme")  # no model call yet
    await open_run(bus, "limit", "Refactor everything", tenant="acme")
    ended = events.Error(source="agent", reason="step_limit", content="stopped after 30 model calls", retryable=True)
    (end,) = await record(bus.session("limit", tenant="acme"), ended)
    key = await new_key(bus, "acme")
    async with running(bus) as base, console(base, key, "/runs", width=WIDTH) as page:
        row = lambda s: page.locator(f'#run-rows tr[data-session="{s}"]')  # noqa: E731
        await expect(page.locator("#run-rows > tr[data-session]")).to_have_count(4)
        headers = await page.locator("#run-table thead th").all_inner_texts()
        assert "tokens, with sub-agents" in headers
        assert "cost, with sub-agents" in headers
        assert "sub-agent of · sub-agents" in headers
        await expect(row("tree").locator("td.tree")).to_have_text("1 sub-agent")
        await expect(row(child.id).locator("td.tree")).to_have_text("sub-agent of tree")
        await expect(row("fresh").locator("td.tree")).to_have_text("—")
        await expect(row("tree").locator("td.tokens")).to_have_text("1,587")
        await expect(row(child.id).locator("td.tokens")).to_have_text("786")
        cost = lambda s: row(s).locator("td:nth-child(7)")  # noqa: E731
        await expect(cost("tree")).to_have_text("—")  # a model without a price
        await expect(cost("tree")).to_have_attribute(
            "title", "no price for this model: set RIVERBED_PRICES to count its cost"
        )
        await expect(cost("fresh")).to_have_text("$0.0000")  # nothing spent yet
        await row(child.id).locator("td.tree a").click()
        await expect(page.locator("#session-title")).to_have_text("tree")

        # The parent's page: its own tokens and the tree's, each labelled; the line has no "null".
        await expect(page.locator("#run-numbers")).to_have_text(
            f"run #{opened.opened}: 1 step of 30, its own calls 801 tokens, —; with its 1 sub-agent 1,587 tokens, —"
        )
        await expect(page.locator("#delegation")).to_have_text(f"sub-agents: {child.id}")
        # The child's page: its parent, in words.
        await page.goto(f"{base}/#/s/{child.id}")
        await expect(page.locator("#delegation")).to_have_text(f"sub-agent of tree (action #{delegate})")
        # A run with no model call yet: the same cost as on the runs page.
        await page.goto(f"{base}/#/s/fresh")
        await expect(page.locator("#run-numbers")).to_have_text("run #2: 0 steps of 30, 0 tokens, $0.0000")
        await expect(page.locator("#usage-rows")).to_contain_text("no model calls")
        # A run's end reads as one, not as an error to retry.
        await page.goto(f"{base}/#/s/limit")
        card = page.locator(f'#timeline > li[data-id="{end}"]')
        await expect(card).to_contain_text("step_limit, the run ended: stopped after 30 model calls")


async def test_restoring_what_a_condenser_hid_says_it_will_hide_them_again(bus: Bus) -> None:
    from playwright.async_api import expect  # noqa: PLC0415

    await record_session(bus, "fix-calc")  # the condenser's #12 hides #3-#6
    key = await new_key(bus, "acme")
    async with running(bus) as base, console(base, key, "/s/fix-calc", width=WIDTH) as page:
        await expect(page.locator("#at")).to_have_text("14")
        await expect(page.locator("#view-note")).to_contain_text("of 14 events in the context")
        await page.select_option("#ctx-op", "restore")
        await page.fill("#ctx-from", "3")
        await page.fill("#ctx-to", "6")
        await page.click("#ctx-preview")
        await expect(page.locator("#ctx-result")).to_contain_text("would show again 4 events")
        await page.click("#ctx-apply")
        result = page.locator("#ctx-result")
        await expect(result).to_contain_text("applied edit #15 (restore): showed again 4 events")
        await expect(result).to_contain_text("A condenser had hidden #3\u2013#6: it hides them again")
        await expect(result).to_contain_text("pin them to keep them in view")
        # The user's own forget, restored, warns of nothing.
        await page.select_option("#ctx-op", "forget")
        await page.click("#ctx-preview")
        await expect(result).to_contain_text("forget as edit #16: would hide 4 events")  # (read, then applied)
        await page.click("#ctx-apply")
        await expect(result).to_contain_text("applied edit #16 (forget)")
        await page.select_option("#ctx-op", "restore")
        await page.click("#ctx-preview")
        await expect(result).to_contain_text("restore as edit #17: would show again 4 events")
        await page.click("#ctx-apply")
        await expect(result).to_contain_text("applied edit #17 (restore)")
        await expect(result).not_to_contain_text("condenser")


async def test_the_edit_form_stays_under_the_pointer_while_the_view_reloads(bus: Bus) -> None:
    """A live session reloads the view at every event: the view keeps its box, so the edit and
    fork forms under it do not move (a click meant for Preview lands on Preview)."""
    from playwright.async_api import expect  # noqa: PLC0415

    await record_session(bus, "fix-calc")
    key = await new_key(bus, "acme")
    async with running(bus) as base, console(base, key, "/s/fix-calc", width=WIDTH) as page:
        note = page.locator("#view-note")
        await expect(note).to_contain_text("of 14 events in the context")
        full = await box(page.locator("#ctx-preview"))
        await page.locator("#slider").fill("3")
        await expect(note).to_contain_text("3 of 3 events in the context")
        assert await page.locator("#view > li").count() == 3
        short = await box(page.locator("#ctx-preview"))
        assert full["y"] == short["y"], (full, short)

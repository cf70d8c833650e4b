"""The console in a real headless browser: Debian's chromium driven by Playwright.

Playwright's own browser download is never used (``executable_path`` points at Debian's
chromium); without /usr/bin/chromium the test is skipped, saying so.  The demo session is a
recording (``tests/golden/demo-session.jsonl``: ``riverbed demo``, then ``riverbed export``),
imported as ``riverbed import`` does, so the test needs no demo run.  Set
``RIVERBED_CONSOLE_SCREENSHOT=path.png`` to keep the screenshot (docs/console.png is made so).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest

from riverbed import events
from riverbed.agent.transfer import import_session, parse_import
from riverbed.client.session import Bus
from riverbed.memory.embedders import LocalEmbedder
from riverbed.memory.recall import Memory
from riverbed.memory.store import Store
from tests.kit.console import console, needs_chromium, record_session
from tests.kit.serve import new_key, riverbed_command, running

pytestmark = pytest.mark.anyio


@needs_chromium
async def test_console_shows_the_timeline_time_travels_and_forks(bus: Bus, tmp_path: Path) -> None:
    from playwright.async_api import expect  # noqa: PLC0415  (only where chromium exists)

    await record_session(bus, "fix-calc")
    key = await new_key(bus, "acme")
    async with running(bus) as base, console(base, key, "/s/fix-calc") as page:
        timeline = page.locator("#timeline > li")
        await expect(timeline).to_have_count(10)  # 14 events, 4 observations shown under their actions
        await expect(page.locator("#timeline")).to_contain_text("hidden by #12")
        await expect(page.locator("#timeline")).to_contain_text("hid 4 events (#3\u2013#6)")
        await expect(page.locator("#timeline")).to_contain_text("cached 768")
        await expect(page.locator("#live")).to_have_class("live on")

        # At the end, the condensed view has the summary and not the events it hid.
        view = page.locator("#view > li")
        await expect(page.locator("#at")).to_have_text("14")
        await expect(page.locator("#view li.summary")).to_have_count(1)
        await expect(page.locator("#view-note")).to_contain_text("of 14 events in the context")
        condensed_at_end = await view.count()
        assert "#3" not in await page.locator("#view").inner_text()

        # Travel back to event 5: no condensation yet, so the hidden events are there.
        await page.locator("#slider").fill("5")
        await expect(page.locator("#at")).to_have_text("5")
        await expect(page.locator("#view-note")).to_contain_text("of 5 events in the context")
        await expect(page.locator("#view li.summary")).to_have_count(0)
        await expect(page.locator("#view")).to_contain_text("pytest -q")
        await expect(page.locator("#timeline > li.after").first).to_be_visible()

        # The full log at the end shows every event, the condensed view fewer.
        await page.locator("#slider").fill("14")
        await page.check('input[name="mode"][value="full"]')
        await expect(page.locator("#view-note")).to_contain_text("the full log: 14 events")
        await expect(view).to_have_count(14)
        assert condensed_at_end < 14

        # A live append shows up without a reload.
        await bus.session("fix-calc", tenant="acme").append(events.Message(content="Thanks!", source="user"))
        await expect(page.locator("#timeline")).to_contain_text("Thanks!")

        shot = tmp_path / "console.png"
        await page.locator("#slider").fill("12")
        await page.check('input[name="mode"][value="condensed"]')
        await expect(page.locator("#view li.summary")).to_have_count(1)
        await page.screenshot(path=str(shot))
        assert shot.stat().st_size > 10_000
        keep = os.environ.get("RIVERBED_CONSOLE_SCREENSHOT")
        if keep:
            Path(keep).write_bytes(shot.read_bytes())

        # Fork from an event chosen in the timeline.
        await page.locator('#timeline > li[data-id="7"] .fork-here').click()
        await expect(page.locator("#fork-at")).to_have_text("7")
        await page.fill("#fork-into", "fix-calc-retry")
        await page.click("#fork-form button")
        await expect(page.locator("#fork-result")).to_contain_text("fix-calc-retry")
        forked = [e async for e in bus.session("fix-calc-retry").log()]
        assert [e.kind for e in forked][-1] == "forked"
        assert len(forked) == 8

        # The session list: tenant, events, owners per role.
        await page.goto(f"{base}/#/")
        rows = page.locator("#session-rows > tr")
        await expect(rows).to_have_count(2)
        await expect(page.locator("#session-rows")).to_contain_text("fix-calc-retry")
        await expect(page.locator("#session-rows")).to_contain_text("acme")


DEMO_SESSION = Path(__file__).parent / "golden" / "demo-session.jsonl"
"""A session ``riverbed demo`` recorded (``riverbed export``), workspace paths made neutral: its
scripted agent's commands, recalls and condensations, as they came out of every role."""


async def load_demo(bus: Bus, memory: Memory, session: str) -> None:
    """The recorded demo session, imported as ``riverbed import`` does, and indexed for recall
    as its memory worker indexed it."""
    rows = parse_import(DEMO_SESSION.read_bytes().splitlines(), DEMO_SESSION.name)
    await import_session(bus, session, rows)
    await memory.store.start()
    await memory.index(session, [e async for e in bus.session(session).log()], tenant=rows[0].tenant)


def cli_json(env: dict[str, str], *args: str) -> list[dict[str, Any]]:
    result = subprocess.run(
        [*riverbed_command(), *args, "--json"], env=env, capture_output=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr.decode()
    return [json.loads(line) for line in result.stdout.splitlines() if line]


@needs_chromium
async def test_console_time_travels_a_demo_session_and_forgets_from_the_console(
    bus: Bus, redis_url: str, database_url: str, prefix: str
) -> None:
    from playwright.async_api import expect  # noqa: PLC0415  (only where chromium exists)

    session = "demo-recorded"
    # Recall search reads what is indexed in the test's Postgres schema.
    memory = Memory.cached(Store(database_url, schema=prefix), LocalEmbedder())
    await load_demo(bus, memory, session)
    log = [e async for e in bus.session(session).log()]
    last = log[-1].id
    assert last is not None
    visible = (await bus.session(session).context.show()).view.ids()
    # An observation the agent still sees at the end: the console forgets it (and its action).
    target = max(e.id for e in log if e.kind == "cmd_output" and e.id in visible and e.id is not None)
    action = next(e.cause for e in log if e.id == target)
    assert action is not None
    key = await new_key(bus, "demo")
    try:
        async with running(bus, memory=memory) as base, console(base, key, f"/s/{session}") as page:
            await expect(page.locator("#at")).to_have_text(str(last))
            await expect(page.locator("#timeline")).to_contain_text("hidden by #")  # the demo's condensation

            # Time travel: to event 8, before any condensation, every event is in the context.
            await page.locator("#slider").fill("8")
            await expect(page.locator("#at")).to_have_text("8")
            await expect(page.locator("#view-note")).to_contain_text("8 of 8 events in the context")

            # Recall search over the session: a hit travels to its event; nothing is appended.
            await page.fill("#search-q", "which script prints the greeting?")
            await page.click("#search-form button[type=submit]")
            hits = page.locator("#search-hits > li")
            await expect(page.locator("#search-note")).to_contain_text("best first")
            assert await hits.count() >= 1
            first = int(await hits.first.get_attribute("data-id") or 0)
            kinds = {e.id: e.kind for e in log}
            assert kinds[first] in {"file_write", "file_written", "file_edit", "file_edited", "cmd_run", "cmd_output"}
            assert "greet" in (await hits.first.inner_text())
            await hits.first.click()
            await expect(page.locator("#at")).to_have_text(str(first))
            assert await bus.session(session).last_id() == last

            # Travel to the target, and choose it for the edit (its answer under its action's card).
            await page.locator("#slider").fill(str(target))
            await expect(page.locator("#at")).to_have_text(str(target))
            card = page.locator(f'#timeline .answer[data-id="{target}"] .head .kind')
            for _ in range(3):  # (a refresh that re-renders the timeline under the pointer moves the card)
                await card.click()
                if await page.locator("#ctx-from").input_value() == str(target):
                    break
            await expect(page.locator("#ctx-from")).to_have_value(str(target))
            await expect(page.locator("#at")).to_have_text(str(target))
            await page.select_option("#ctx-op", "forget")
            await page.fill("#ctx-note", "noise")
            await page.click("#ctx-preview")
            await expect(page.locator("#ctx-result")).to_contain_text(f"would hide 2 events (#{action}, #{target})")
            await expect(page.locator(f'#timeline > li[data-id="{action}"]')).to_have_class(re.compile("would-hide"))
            assert await bus.session(session).last_id() == last  # a preview appends nothing
            await page.click("#ctx-apply")
            await expect(page.locator("#ctx-result")).to_contain_text(
                f"applied edit #{last + 1} (forget): hid 2 events"
            )
            await expect(page.locator(f'#timeline > li[data-id="{action}"]')).to_contain_text(f"hidden by #{last + 1}")
            await expect(page.locator("#usage-rows")).to_contain_text("no model calls")
    finally:
        await memory.aclose()

    env = {k: v for k, v in os.environ.items() if not k.startswith("RIVERBED_")}
    env.update(RIVERBED_REDIS_URL=redis_url, RIVERBED_PREFIX=prefix)
    viewed = [e["id"] for e in await anyio.to_thread.run_sync(cli_json, env, "view", session)]
    assert target not in viewed
    assert action not in viewed
    assert set(viewed) >= set(visible) - {action, target}
    logged = await anyio.to_thread.run_sync(cli_json, env, "log", session)
    assert [e["id"] for e in logged] == list(range(1, last + 2))
    assert logged[-1]["kind"] == "context_edit"
    assert logged[-1]["note"] == "noise"

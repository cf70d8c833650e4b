"""The console in a real headless browser: Debian's chromium driven by Playwright.

Playwright's own browser download is never used (``executable_path`` points at Debian's
chromium); without /usr/bin/chromium the test is skipped, saying so.  Set
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
from riverbed.agent.client import Bus
from riverbed.memory.embedders import LocalEmbedder
from riverbed.memory.recall import Memory
from riverbed.memory.store import Store
from tests.agentkit import record
from tests.servekit import new_key, riverbed_command, running

pytestmark = pytest.mark.anyio

CHROMIUM = Path("/usr/bin/chromium")


async def record_session(bus: Bus, name: str) -> None:
    """A short agent session: a failing test found, a fix, a condensation that hid the early steps."""
    s = bus.session(name, tenant="acme", agent="coder")
    usage = {"prompt_tokens": 812, "completion_tokens": 41, "total_tokens": 853}
    await record(
        s,
        events.Message(content="The test for calc.add fails. Please fix it.", source="user"),
        events.LlmResponse(model="gpt-4o-mini", content="Let me run the tests first.", usage=usage),
        events.CmdRun(command="pytest -q"),
    )
    await record(
        s,
        events.CmdOutput(
            content="F.\nFAILED test_calc.py::test_add - assert -1 == 5\n1 failed, 1 passed in 0.02s",
            exit_code=1,
            command="pytest -q",
            cause=3,
        ),
        events.FileRead(path="calc.py"),
    )
    await record(
        s,
        events.FileContent(path="calc.py", content="def add(a, b):\n    return a - b\n", cause=5),
        events.Think(thought="add() subtracts: the operator is wrong."),
        events.FileEdit(command="str_replace", path="calc.py", old_str="a - b", new_str="a + b"),
    )
    usage2 = {
        "prompt_tokens": 1390,
        "completion_tokens": 22,
        "total_tokens": 1412,
        "prompt_tokens_details": {"cached_tokens": 768},
    }
    await record(
        s,
        events.FileEdited(path="calc.py", diff="-    return a - b\n+    return a + b", cause=8),
        events.CmdRun(command="pytest -q"),
    )
    await record(
        s,
        events.CmdOutput(content="..\n2 passed in 0.01s", exit_code=0, command="pytest -q", cause=10),
        events.Condensation(
            forgotten=[(3, 6)], summary="Ran pytest: test_add failed (-1 != 5); calc.add used '-' instead of '+'."
        ),
        events.LlmResponse(model="gpt-4o-mini", content="The fix works: both tests pass.", usage=usage2),
        events.Finish(final_thought="Fixed calc.add: it subtracted instead of adding."),
    )


@pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)"
)
async def test_console_shows_the_timeline_time_travels_and_forks(bus: Bus, tmp_path: Path) -> None:
    from playwright.async_api import async_playwright, expect  # noqa: PLC0415  (only where chromium exists)

    await record_session(bus, "fix-calc")
    key = await new_key(bus, "acme")
    async with running(bus) as base, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            page = await browser.new_page(viewport={"width": 1440, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(f"{base}/#/s/fix-calc")
            await page.fill("#key", key)
            await page.click("#login-form button")

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
            await page.locator('#timeline > li[data-id="7"]').click()
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
            assert errors == []
        finally:
            await browser.close()


def record_demo(redis_url: str, database_url: str, prefix: str, workspace: Path) -> str:
    """A session recorded by ``riverbed demo`` (every role in its process) on the test services."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RIVERBED_")}
    env.update(
        RIVERBED_REDIS_URL=redis_url,
        RIVERBED_DATABASE_URL=database_url,
        RIVERBED_PREFIX=prefix,
        RIVERBED_WORKSPACE=str(workspace),
        COLUMNS="200",
    )
    env.pop("OPENAI_API_KEY", None)
    env.pop("OPENAI_BASE_URL", None)
    result = subprocess.run([*riverbed_command(), "demo"], env=env, capture_output=True, timeout=180, check=False)
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    found = re.search(r"riverbed log (demo-[0-9a-f]+)\b", out)
    assert found, out
    return found.group(1)


def cli_json(env: dict[str, str], *args: str) -> list[dict[str, Any]]:
    result = subprocess.run(
        [*riverbed_command(), *args, "--json"], env=env, capture_output=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr.decode()
    return [json.loads(line) for line in result.stdout.splitlines() if line]


@pytest.mark.slow
@pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)"
)
async def test_console_time_travels_a_demo_session_and_forgets_from_the_console(
    bus: Bus, redis_url: str, database_url: str, prefix: str, tmp_path: Path
) -> None:
    from playwright.async_api import async_playwright, expect  # noqa: PLC0415  (only where chromium exists)

    session = await anyio.to_thread.run_sync(record_demo, redis_url, database_url, prefix, tmp_path / "ws")
    log = [e async for e in bus.session(session).log()]
    last = log[-1].id
    assert last is not None
    visible = (await bus.session(session).context.show()).view.ids()
    # An observation the agent still sees at the end: the console forgets it (and its action).
    target = max(e.id for e in log if e.kind == "cmd_output" and e.id in visible and e.id is not None)
    action = next(e.cause for e in log if e.id == target)
    assert action is not None
    key = await new_key(bus, "demo")
    # Recall search reads what the demo's memory worker indexed, in the same Postgres schema.
    memory = Memory.cached(Store(database_url, schema=prefix), LocalEmbedder())
    async with running(bus, memory=memory) as base, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            page = await browser.new_page(viewport={"width": 1440, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(f"{base}/#/s/{session}")
            await page.fill("#key", key)
            await page.click("#login-form button")
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

            # Travel to the target; the slider chose it for the edit. Preview, then apply.
            await page.locator("#slider").fill(str(target))
            await expect(page.locator("#at")).to_have_text(str(target))
            await expect(page.locator("#ctx-from")).to_have_value(str(target))
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
            assert errors == []
        finally:
            await browser.close()
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

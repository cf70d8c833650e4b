"""The console's tests: a signed-in page in Debian's chromium, and a recorded agent session."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from riverbed import events
from riverbed.client.session import Bus
from tests.kit.agents import record

CHROMIUM = Path("/usr/bin/chromium")

#: Playwright's own browser download is never used: without Debian's chromium the test is skipped.
needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)"
)


@contextlib.asynccontextmanager
async def console(base: str, key: str, path: str = "/", *, width: int = 1440) -> AsyncIterator[Any]:
    """A signed-in page of the console at ``#path`` (``width`` px wide); fails the test on any page error."""
    from playwright.async_api import async_playwright  # noqa: PLC0415  (only where chromium exists)

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            page = await browser.new_page(viewport={"width": width, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(f"{base}/#{path}")
            await page.fill("#key", key)
            await page.click("#login-form button")
            yield page
            assert errors == []
        finally:
            await browser.close()


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

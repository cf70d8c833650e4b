"""People in the loop in the console, in Debian's chromium (Playwright): a call that waits for
approval shows its risk and Approve and Reject on the session's page and on the approvals page;
a click decides it with the console's key and the page follows the log to the call's answer; a
run pauses and resumes from its page; and what a model wrote (a call's arguments, its risk's
reason) is shown as text, never as HTML."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from riverbed import events
from riverbed.agent.hosted import RunLimits, list_runs, open_run
from riverbed.client.session import Bus
from riverbed.runtime.paths import workspace_name
from tests.kit.agent_role import ended, roles, server  # noqa: F401  (fixtures)
from tests.kit.agents import record
from tests.kit.console import console, needs_chromium
from tests.kit.openai_server import OpenAIServer
from tests.kit.serve import new_key, running

pytestmark = pytest.mark.anyio

STATIC = Path(__file__).parent.parent / "riverbed" / "serve" / "static"

PAYLOAD = '<img src=x onerror="window.pwned = 1">'
"""Markup in a model's output: shown as these characters, never made an element."""


async def box(locator: Any) -> dict[str, float]:
    found = await locator.bounding_box()
    assert found is not None
    return found


@needs_chromium
async def test_a_call_waits_is_approved_in_the_browser_and_runs_and_the_next_is_rejected(
    bus: Bus, workspace: Path, server: OpenAIServer
) -> None:
    from playwright.async_api import expect  # noqa: PLC0415

    server.reply(tool_calls=[("cmd_run", {"command": "rm -rf build && echo gone > b.txt"})])
    server.reply(tool_calls=[("cmd_run", {"command": "sudo reboot"})])
    server.reply(tool_calls=[("finish", {"final_thought": "done"})])
    key = await new_key(bus, "acme")
    async with roles(bus, workspace, server), running(bus) as base:
        opened = await open_run(bus, "ui", "clean up", limits=RunLimits(max_steps=5), confirm="risky", tenant="acme")
        async with console(base, key, "/s/ui") as page:
            waiting = page.locator("#timeline .risk-line.waiting")
            await expect(waiting).to_have_count(1)
            await expect(waiting).to_contain_text("high risk")
            await expect(waiting).to_contain_text("deletes files recursively")
            await expect(waiting).to_contain_text("waits for your approval")
            await expect(page.locator("#run-waiting")).to_have_text("1 call waits for your approval")
            card = page.locator("#timeline > li", has=page.locator(".risk-line.waiting"))
            action = int(await card.get_attribute("data-id") or 0)
            await expect(card).to_contain_text("$ rm -rf build && echo gone > b.txt")
            approve, reject = waiting.locator("button.approve"), waiting.locator("button.reject")
            await expect(approve).to_have_text("Approve")
            await expect(reject).to_have_text("Reject")
            card_box, approve_box, reject_box = await box(card), await box(approve), await box(reject)
            for button in (approve_box, reject_box):  # readable buttons, side by side, inside the card
                assert button["width"] >= 50, button
                assert button["height"] >= 20, button
                assert card_box["x"] <= button["x"], (card_box, button)
                assert button["x"] + button["width"] <= card_box["x"] + card_box["width"], (card_box, button)
            assert approve_box["y"] == reject_box["y"]
            assert approve_box["x"] + approve_box["width"] <= reject_box["x"]
            assert not (workspace / workspace_name("ui") / "b.txt").exists()

            # Pause and resume from the run's panel: the state reads so, and the log has both.
            await expect(page.locator("#run-resume")).to_be_hidden()
            await page.click("#run-pause")
            await expect(page.locator("#run-state")).to_have_text("paused")
            await expect(page.locator("#run-pause")).to_be_hidden()
            await page.click("#run-resume")
            await expect(page.locator("#run-state")).to_have_text("running")
            await expect(page.locator("#run-pause")).to_be_visible()
            kinds = [e.kind for e in await bus.session("ui").events()]
            assert kinds.index("run_paused") < kinds.index("run_resumed")

            # Approve: the command runs, and its output comes under the call.
            await approve.click()
            answer = page.locator(f'#timeline > li[data-id="{action}"] .answer')
            await expect(answer).to_contain_text("cmd_output")
            await expect(answer).to_contain_text("exit 0")
            line = page.locator(f'#timeline > li[data-id="{action}"] .risk-line')
            await expect(line).to_contain_text("approved (#")
            await expect(line).to_contain_text("by key:")
            await expect(line.locator("button")).to_have_count(0)

            # The next call waits on the approvals page: rejected there, with a reason.
            await page.goto(f"{base}/#/approvals")
            row = page.locator('#approval-rows > tr[data-session="ui"]')
            await expect(row).to_have_count(1)
            await expect(row).to_contain_text("sudo reboot")
            await expect(row).to_contain_text("high risk")
            await expect(row.locator("button.approve")).to_have_text("Approve")
            await row.locator("button.reject").click()
            reason = row.locator("input.reject-reason")
            await expect(reason).to_be_visible()
            await reason.fill("not on this")
            refreshed = await page.locator("#approvals-refreshed time").get_attribute("datetime")
            await expect(page.locator("#approvals-refreshed time")).not_to_have_attribute("datetime", refreshed or "")
            await expect(reason).to_have_value("not on this")  # a refresh of the list keeps what is typed
            await reason.fill("not on this box")
            await row.locator("button.reject-send").click()
            await expect(row).to_contain_text("rejected: the model reads why")
            seen = await ended(bus, "ui", opened.task)
            await expect(page.locator("#approval-rows")).to_contain_text("no call waits for approval")

            # Back on the session: the rejection is the call's answer.
            await page.goto(f"{base}/#/s/ui")
            rejected = next(e for e in seen if isinstance(e, events.Error) and e.reason == "rejected")
            card = page.locator(f'#timeline > li[data-id="{rejected.cause}"]')
            await expect(card.locator(".answer")).to_contain_text("rejected")
            await expect(card.locator(".answer")).to_contain_text("not on this box")
            await expect(card.locator(".risk-line")).to_contain_text("rejected (#")
            await expect(page.locator("#run-state")).to_have_text("finished")
            await expect(page.locator("#run-pause")).to_be_hidden()
    assert (workspace / workspace_name("ui") / "b.txt").read_text() == "gone\n"
    assert any(isinstance(e, events.CmdOutput) and e.cause == action for e in seen)
    assert "not on this box" in rejected.content
    approvals = [e for e in seen if isinstance(e, events.Approval)]
    assert [(a.decision, a.reason) for a in approvals] == [("approve", ""), ("reject", "not on this box")]
    assert all(a.by.startswith("key:") for a in approvals)  # the console's key decided


@needs_chromium
async def test_what_a_model_wrote_shows_as_text_on_both_pages(bus: Bus) -> None:
    from playwright.async_api import expect  # noqa: PLC0415

    # A run whose call waits, recorded as the agent writes it: the model's arguments and the
    # risk's reason carry markup (an analyzer may quote what the model wrote).
    await open_run(bus, "xss", "look", tenant="acme", confirm="always")
    s = bus.session("xss", tenant="acme")
    command = f"echo {PAYLOAD}"
    arguments = json.dumps({"command": command})
    call = {"id": "c1", "type": "function", "function": {"name": "cmd_run", "arguments": arguments}}
    (response,) = await record(s, events.LlmResponse(model="m", tool_calls=[call], source="agent"))
    risk = events.Risk(level="high", reason=f"it writes {PAYLOAD}", confirm=True)
    (action,) = await record(
        s, events.CmdRun(command=command, risk=risk, tool_call_id="c1", cause=response, source="agent")
    )
    (row,) = [r for r in await list_runs(bus) if r.session == "xss"]
    assert [p.action for p in row.awaiting] == [action]
    key = await new_key(bus, "acme")
    async with running(bus) as base, console(base, key, "/approvals") as page:
        listed = page.locator('#approval-rows > tr[data-session="xss"]')
        await expect(listed.locator(".risk-reason")).to_have_text(f"it writes {PAYLOAD}")
        await expect(listed.locator("td.args")).to_contain_text(PAYLOAD.replace('"', '\\"'))  # (JSON)
        assert await page.evaluate("document.querySelectorAll('#main img').length") == 0
        await page.evaluate(PANEL_WHEN_CARD_CAME, action)
        await page.goto(f"{base}/#/s/xss")
        line = page.locator(f'#timeline > li[data-id="{action}"] .risk-line')
        await expect(line.locator(".risk-reason")).to_have_text(f"it writes {PAYLOAD}")
        # The run's panel, above the timeline, was there when the call's card came: it does not
        # push the card down under the pointer once the run's usage arrives.
        assert await page.evaluate("window.panelWhenCardCame") is True
        # Reject with a reason that is markup too: the decision reads it back as text.
        await line.locator("button.reject").click()
        await line.locator("input.reject-reason").fill(PAYLOAD)
        await line.locator("button.reject-send").click()
        await expect(line).to_contain_text(f"rejected (#{action + 1}, by key:")
        await expect(line.locator(".decided")).to_contain_text(PAYLOAD)
        await expect(page.locator(f'#timeline > li[data-id="{action + 1}"]')).to_contain_text(f"rejected #{action}")
        assert await page.evaluate("document.querySelectorAll('#main img').length") == 0
        assert await page.evaluate("window.pwned === undefined")
    decided = [e for e in await bus.session("xss").events() if isinstance(e, events.Approval)]
    assert [(a.actions, a.decision, a.reason) for a in decided] == [([action], "reject", PAYLOAD)]


PANEL_WHEN_CARD_CAME = """(action) => {
  window.panelWhenCardCame = null;
  new MutationObserver((_, observer) => {
    if (!document.querySelector(`#timeline > li[data-id="${action}"]`)) return;
    window.panelWhenCardCame = !document.getElementById("run-panel").hidden;
    observer.disconnect();
  }).observe(document.getElementById("timeline"), { childList: true });
}"""
"""Records, when the call's card joins the timeline, whether the run's panel shows yet."""


def test_the_console_never_parses_text_as_html() -> None:
    # Every field goes on the page through textContent (el(..., {text})); none of the ways a
    # string becomes markup is in the console's code.
    code = (STATIC / "console.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "createContextualFragment"):
        assert sink not in code, sink
    assert "textContent" in code

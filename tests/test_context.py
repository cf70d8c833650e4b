"""A user's control of the context: the pure report, the session handle and the CLI."""

from __future__ import annotations

import json
from typing import Any

import pytest

from riverbed import events
from riverbed.client.session import Bus
from riverbed.errors import InputError
from riverbed.events import CmdOutput, CmdRun, Condensation, ContextEdit, Error, Event, Message, Think, with_id
from riverbed.memory.condensers import CondenserConfig, condense
from riverbed.memory.context import change, context_edit, describe, parse_range, report
from riverbed.memory.view import view
from tests.kit.cli import assert_one_sentence, fill, ok, run

pytestmark = pytest.mark.anyio


def story() -> list[Event]:
    """Two errors (one answering a command), a plain command, a message worth keeping."""
    return [
        Message(content="task", source="user"),  # 1
        CmdRun(command="ls"),  # 2
        Error(content="boom", cause=2),  # 3
        CmdRun(command="pwd"),  # 4
        CmdOutput(content="/", cause=4),  # 5
        Error(content="disk full"),  # 6
        Message(content="keep me", source="user"),  # 7
        Think(thought="hm"),  # 8
    ]


def numbered(batch: list[Event], start: int = 1) -> list[Event]:
    return [with_id(e, i) for i, e in enumerate(batch, start=start)]


# --- pure ---------------------------------------------------------------------------------------


def test_forget_by_kind_hides_each_error_with_its_call_and_restore_brings_them_back() -> None:
    log = numbered([*story(), ContextEdit(op="forget", kinds=["error"]), ContextEdit(op="restore", kinds=["error"])])
    before, forgotten, restored = report(log, 8), report(log, 9), report(log, 10)
    assert forgotten.view.ids() == [1, 4, 5, 7, 8]
    assert [(h.event.id, h.by.id) for h in forgotten.hidden] == [(2, 9), (3, 9), (6, 9)]
    assert describe(forgotten.hidden[0].by) == "user edit 9 (forget --kind error)"
    assert change(before, forgotten, 9).hidden == (2, 3, 6)
    assert restored.view.ids() == before.view.ids() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert change(forgotten, restored, 10).shown == (2, 3, 6)


def test_a_pin_holds_through_a_condensation_and_restore_adds_a_forgotten_event_back() -> None:
    log = numbered(
        [
            *story(),
            ContextEdit(op="pin", ranges=[(7, 7)]),  # 9
            Condensation(forgotten=[(1, 8)], summary="earlier work"),  # 10
            ContextEdit(op="restore", ranges=[(4, 4)]),  # 11: brings the command and its output back
            ContextEdit(op="unpin", ranges=[(7, 7)]),  # 12
            Condensation(forgotten=[(1, 8)]),  # 13
        ]
    )
    pinned = report(log, 10)
    assert pinned.view.ids() == [7]
    assert pinned.pinned == {7}
    assert {h.event.id: describe(h.by) for h in pinned.hidden}[2] == "condenser condensation 10 with a summary"
    assert report(log, 11).view.ids() == [4, 5, 7]
    assert report(log, 13).view.ids() == []
    assert view(log, until=11).ids() == report(log, 11).view.ids()


async def test_condensers_never_forget_pinned_events() -> None:
    log = numbered([Message(content=f"m{i}", source="user") for i in range(1, 21)])
    log.append(with_id(ContextEdit(op="pin", ranges=[(5, 6)]), 21))
    config = CondenserConfig.from_dict({"strategy": "amortized", "max_events": 10, "keep_first": 1})
    condensation = await condense(view(log), config)
    assert condensation is not None
    forgotten = {i for a, b in condensation.forgotten for i in range(a, b + 1)}
    assert forgotten
    assert not forgotten & {5, 6}
    after = view([*log, with_id(condensation, 22)])
    assert {5, 6} <= set(after.ids())
    assert len(after.ids()) <= 10  # the pins count against the limit


def test_edits_are_checked() -> None:
    assert parse_range("12-40") == (12, 40)
    assert parse_range("7") == (7, 7)
    for bad in ("40-12", "0", "x", "1-"):
        with pytest.raises(InputError):
            parse_range(bad)
    with pytest.raises(InputError, match="say which events"):
        context_edit("forget")
    with pytest.raises(InputError, match="unknown event kind 'eror'"):
        context_edit("forget", kinds_=["eror"])


# --- the session handle ---------------------------------------------------------------------------


async def test_the_session_handle_edits_the_context(bus: Bus) -> None:
    session = bus.session("ctx-api")
    await session.append(*story())
    forgot = await session.context.forget(kinds=["error"], note="noise")
    assert (forgot.edit, forgot.hidden) == (9, (2, 3, 6))
    assert [e.id for e in await session.view()] == [1, 4, 5, 7, 8]
    pinned = await session.context.pin(7)
    assert pinned.pinned == (7,)
    restored = await session.context.restore(1, 8)
    assert restored.shown == (2, 3, 6)
    shown = await session.context.show()
    assert shown.view.ids() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert shown.pinned == {7}
    edits = [e for e in await session.events() if isinstance(e, ContextEdit)]
    assert [(e.op, e.note) for e in edits] == [("forget", "noise"), ("pin", None), ("restore", None)]
    with pytest.raises(InputError):
        await session.context.forget()


# --- the CLI --------------------------------------------------------------------------------------


def view_ids(env: dict[str, str], session: str, until: int) -> list[int]:
    out = ok(env, "view", session, "--until", str(until), "--json")
    return [json.loads(line)["id"] for line in out.splitlines()]


def context_json(env: dict[str, str], session: str, *args: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(ok(env, "context", session, "--json", *args))
    return result


def test_cli_drops_every_error_restores_it_and_pins_through_a_condensation(
    cli_env: dict[str, str], redis_url: str, prefix: str
) -> None:
    fill(redis_url, prefix, "ctx", story())
    everything = [1, 2, 3, 4, 5, 6, 7, 8]
    assert view_ids(cli_env, "ctx", 8) == everything

    forgot = run(cli_env, "context", "ctx", "forget", "--kind", "error")
    assert forgot.returncode == 0, forgot.stderr.decode()
    assert json.loads(forgot.stdout) == {"edit": 9, "hidden": [2, 3, 6], "shown": [], "pinned": [], "unpinned": []}
    assert "context edit 9 (forget): hid 3 events (2-3, 6)" in forgot.stderr.decode()
    assert view_ids(cli_env, "ctx", 8) == everything  # time travel: before the edit
    assert view_ids(cli_env, "ctx", 9) == [1, 4, 5, 7, 8]
    shown = context_json(cli_env, "ctx")
    assert shown["visible"] == [1, 4, 5, 7, 8]
    assert [(h["id"], h["by"], h["by_kind"]) for h in shown["hidden"]] == [
        (2, 9, "context_edit"),
        (3, 9, "context_edit"),
        (6, 9, "context_edit"),
    ]
    text = ok(cli_env, "context", "ctx").decode()
    assert "5 events visible, 3 hidden" in text
    assert "hidden by user edit 9 (forget --kind error)" in text

    restored = json.loads(ok(cli_env, "context", "ctx", "restore", "--kind", "error"))
    assert restored["shown"] == [2, 3, 6]
    assert view_ids(cli_env, "ctx", 9) == [1, 4, 5, 7, 8]
    assert view_ids(cli_env, "ctx", 10) == everything

    assert json.loads(ok(cli_env, "context", "ctx", "pin", "7"))["pinned"] == [7]
    ok(cli_env, "append", "ctx", '{"kind": "condensation", "source": "user", "forgotten": [[1, 8]]}')
    assert view_ids(cli_env, "ctx", 11) == everything
    assert view_ids(cli_env, "ctx", 12) == [7]
    shown = context_json(cli_env, "ctx")
    assert shown["pinned"] == [7]
    assert {h["id"]: h["by"] for h in shown["hidden"]} == {i: 12 for i in everything if i != 7}
    assert "[pinned]" in ok(cli_env, "context", "ctx").decode()

    assert json.loads(ok(cli_env, "context", "ctx", "restore", "2-3"))["shown"] == [2, 3]
    assert view_ids(cli_env, "ctx", 13) == [2, 3, 7]
    assert json.loads(ok(cli_env, "context", "ctx", "unpin", "7"))["unpinned"] == [7]
    assert context_json(cli_env, "ctx", "--until", "12")["pinned"] == [7]

    # The log still holds every event, the edits among them.
    log = [json.loads(line) for line in ok(cli_env, "log", "ctx", "--json").splitlines()]
    assert [e["id"] for e in log] == list(range(1, 15))
    assert [e["op"] for e in log if e["kind"] == "context_edit"] == ["forget", "restore", "pin", "restore", "unpin"]
    readable = ok(cli_env, "log", "ctx").decode()
    assert "forget --kind error" in readable


def test_cli_context_refuses_bad_edits_in_one_sentence(cli_env: dict[str, str], redis_url: str, prefix: str) -> None:
    fill(redis_url, prefix, "ctx-bad", story())
    assert_one_sentence(run(cli_env, "context", "ctx-bad", "forget"), 2, "say which events")
    assert_one_sentence(run(cli_env, "context", "ctx-bad", "forget", "40-12"), 2, "40-12")
    assert_one_sentence(run(cli_env, "context", "ctx-bad", "pin", "--kind", "eror"), 2, "unknown event kind")
    assert_one_sentence(run(cli_env, "context", "nobody", "forget", "1"), 2, "no events")
    assert len(ok(cli_env, "log", "ctx-bad", "--json").splitlines()) == 8
    assert events.ContextEdit in events.kinds().values()

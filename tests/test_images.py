"""Images for vision models: a message's images and a Python cell's saved images become
``image_url`` parts; workspace files go through the confined reader and are size-bounded;
models without vision get none."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from riverbed import events
from riverbed.agent.images import WorkspaceImages, vision
from riverbed.agent.messages import to_messages
from riverbed.errors import DecodeError
from riverbed.settings import Settings
from tests.kit.images import PNG


def ids(*raw: events.Event) -> list[events.Event]:
    return [events.with_id(e, i) for i, e in enumerate(raw, 1)]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    (ws / "plots").mkdir(parents=True)
    (ws / "plots" / "a.png").write_bytes(PNG)
    (ws / "big.png").write_bytes(b"\x89PNG" + b"0" * 5000)
    (tmp_path / "secret.png").write_bytes(PNG)
    os.symlink(tmp_path / "secret.png", ws / "escape.png")
    return ws


def test_the_images_field_is_optional_bounded_and_not_written_when_unset() -> None:
    assert b"images" not in events.encode_json(events.Message(content="hi"))
    message = events.Message(content="hi", images=["plots/a.png"])
    assert events.decode_json(events.encode_json(message)) == message
    raw = events.encode_json(message).replace(b'["plots/a.png"]', b'["x"' + b',"x"' * 16 + b"]")
    with pytest.raises(DecodeError, match="length <= 16"):
        events.decode_json(raw)


def test_workspace_files_become_data_urls_through_the_confined_reader(root: Path) -> None:
    images = WorkspaceImages(root, max_bytes=1000)
    assert images("plots/a.png") == "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert images("https://example.com/a.png") == "https://example.com/a.png"
    assert images("big.png") is None  # over the bound
    assert images("escape.png") is None  # a symlink out of the workspace
    assert images("../secret.png") is None
    assert images("missing.png") is None
    assert images("notes.txt") is None


def test_vision_setting() -> None:
    assert not vision("0", "gpt-4o")
    assert vision("1", "anything")
    assert vision("gpt-4o, llava", "llava")
    assert not vision("gpt-4o,llava", "tiny")
    assert Settings.from_env({}).llm_vision == "0"


def test_a_message_carries_its_images_to_a_vision_model_only(root: Path) -> None:
    log = ids(events.Message(source="user", content="what is in these?", images=["plots/a.png", "gone.png"]))
    seen = to_messages(log, images=WorkspaceImages(root, max_bytes=1000))
    assert seen[0]["role"] == "user"
    parts = seen[0]["content"]
    assert parts[0] == {"type": "text", "text": "what is in these?"}
    assert parts[1]["type"] == "image_url"
    assert parts[1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert parts[2] == {"type": "text", "text": "[image gone.png left out: missing, too large or not readable]"}
    blind = to_messages(log)
    assert blind == [
        {"role": "user", "content": "what is in these?\n[images not shown to this model: plots/a.png, gone.png]"}
    ]


def test_images_a_cell_saved_follow_the_tool_results(root: Path) -> None:
    log = ids(
        events.Message(source="user", content="plot it"),
        events.PythonRun(code="plot()"),
        events.PythonOutput(cause=2, content="", files=["plots/a.png", "data.csv"]),
    )
    seen = to_messages(log, images=WorkspaceImages(root, max_bytes=1000))
    assert [m["role"] for m in seen] == ["user", "assistant", "tool", "user"]
    assert seen[3]["content"][0] == {"type": "text", "text": "Images saved by the Python cell (event 3):"}
    assert [p["type"] for p in seen[3]["content"]] == ["text", "image_url"]  # data.csv is no image
    assert [m["role"] for m in to_messages(log)] == ["user", "assistant", "tool"]

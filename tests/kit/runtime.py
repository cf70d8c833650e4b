"""A runtime on its own (no worker, no Redis) in the test's workspace, for the sandbox tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from riverbed.runtime import Limits, Runtime
from tests.kit.patience import within


@pytest.fixture
async def rt(workspace: Path) -> AsyncIterator[Runtime]:
    """A runtime whose interrupted processes get 1 s (scaled by the load) to stop before they are killed."""
    runtime = Runtime(workspace_root=workspace, limits=Limits(interrupt_grace=within(1.0)))
    yield runtime
    await runtime.aclose()

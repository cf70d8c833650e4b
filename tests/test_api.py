"""The declared public API (the import rules between the layers: tests/test_imports.py)."""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import riverbed

PACKAGE = Path(riverbed.__file__).parent


def test_public_names_exist_and_nothing_private_leaks() -> None:
    assert riverbed.__all__ == sorted(set(riverbed.__all__)), "__all__ should be sorted and unique"
    for name in riverbed.__all__:
        assert not name.startswith("_"), name
        assert hasattr(riverbed, name), f"riverbed.__all__ names {name!r} but it does not exist"
    public = {name for name in vars(riverbed) if not name.startswith("_")}
    submodules = {info.name for info in pkgutil.iter_modules(riverbed.__path__)}
    assert public - submodules <= set(riverbed.__all__), "exported names must be declared in __all__"


def test_every_declared_module_api_exists() -> None:
    for info in pkgutil.walk_packages(riverbed.__path__, "riverbed."):
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", ()):
            assert hasattr(module, name), f"{info.name}.__all__ names {name!r} but it does not exist"


def test_the_readme_api_names_are_public() -> None:
    for name in ("connect", "Bus", "Session", "RiverbedError", "AppendConflict", "ActTimeout"):
        assert name in riverbed.__all__


def readme_tested_blocks() -> list[str]:
    """The fenced python blocks of the README and docs/ that follow a ``<!-- tested`` marker
    (the same program shown on two pages is run once)."""
    pages = [PACKAGE.parent / "README.md", *sorted((PACKAGE.parent / "docs").glob("*.md"))]
    blocks: list[str] = []
    for page in pages:
        for part in page.read_text().split("<!-- tested")[1:]:
            body = part.split("```python\n", 1)[1].split("\n```", 1)[0]
            if body not in blocks:
                blocks.append(body)
    return blocks


def test_the_readme_program_runs(redis_url: str, prefix: str, tmp_path: Path) -> None:
    (block,) = readme_tested_blocks()
    program = tmp_path / "readme.py"
    program.write_text(block)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RIVERBED_")}
    env.update(RIVERBED_REDIS_URL=redis_url, RIVERBED_PREFIX=prefix)
    result = subprocess.run([sys.executable, str(program)], env=env, capture_output=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().splitlines() == ["1 message acme", "2 think acme"]

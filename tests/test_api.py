"""The declared public API, and the import rule between the layers (checked on the source)."""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import riverbed

PACKAGE = Path(riverbed.__file__).parent

# Which of our layers each layer may import (a layer is a top-level module or subpackage).
# errors and tracing (W3C trace context helpers) are shared leaves every layer may use;
# confine (file access confined to a workspace) is shared by runtime and memory; pg
# (Postgres plumbing) is shared by the two layers that own tables, bus (archive) and memory;
# settings (configuration) and logs (logging
# set-up at an entry point) are used only by the layers that compose the system; extras (the
# optional parts and the install command of each) is a leaf for the places that import one.
ALLOWED: dict[str, set[str]] = {
    "events": {"errors"},
    "errors": set(),
    "extras": {"errors"},
    "logs": set(),
    "tracing": set(),
    "confine": {"errors"},
    "pg": {"errors"},
    "settings": {"errors"},
    "services": {"errors", "extras"},
    "bus": {"events", "errors", "tracing", "pg", "bus"},
    "runtime": {"events", "errors", "tracing", "confine", "bus", "runtime"},
    "memory": {"events", "errors", "tracing", "confine", "pg", "bus", "memory"},
    "agent": {"events", "errors", "extras", "tracing", "settings", "logs", "bus", "runtime", "memory", "agent"},
    "workers": {
        "events",
        "errors",
        "tracing",
        "settings",
        "logs",
        "services",
        "bus",
        "runtime",
        "memory",
        "agent",
        "workers",
    },
    # The HTTP API composes the client API (agent) over the bus and the View fold (memory).
    "serve": {"events", "errors", "tracing", "settings", "logs", "bus", "memory", "agent", "serve"},
    "cli": {
        "serve",
        "events",
        "errors",
        "extras",
        "tracing",
        "settings",
        "logs",
        "services",
        "bus",
        "runtime",
        "memory",
        "agent",
        "workers",
    },
    "__init__": {"agent", "errors", "events"},
}

# Deliberate exceptions, each with its reason.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("riverbed.agent.client", "services"): "connect() without a URL starts the embedded services",
}


def layer_of_file(path: Path) -> tuple[str, str]:
    """(dotted module name, layer) of a source file of the package."""
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    module = ".".join(parts)
    layer = parts[1] if len(parts) > 1 else "__init__"
    return module, layer


def imported_layers(path: Path, module: str) -> set[str]:
    """Layers of riverbed a file imports, anywhere in it (also inside functions)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package_parts = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            if source == "riverbed":
                targets.update(f"riverbed.{alias.name}" for alias in node.names)
            else:
                targets.add(source)
    layers = set()
    for target in targets:
        parts = target.split(".")
        if parts[0] != "riverbed":
            continue
        layers.add(parts[1] if len(parts) > 1 else "__init__")
    return layers


def source_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_rule_table_knows_every_layer() -> None:
    layers = {layer_of_file(path)[1] for path in source_files()}
    assert layers <= set(ALLOWED), f"add {sorted(layers - set(ALLOWED))} to the import rule"


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_import_rule(path: Path) -> None:
    module, layer = layer_of_file(path)
    allowed = ALLOWED.get(layer, set())
    bad = {
        other
        for other in imported_layers(path, module) - allowed
        if (module, other) not in EXCEPTIONS and other != layer
    }
    assert not bad, f"{module} ({layer}) must not import riverbed layer(s) {sorted(bad)}"


def test_the_rule_checker_sees_every_import_form(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import riverbed.events\n"
        "from riverbed import settings\n"
        "from riverbed.bus.log import Log\n"
        "from ..memory import view\n"
        "from . import shell\n"
        "import redis\n"
        "def late():\n"
        "    from riverbed.services import up\n"
    )
    assert imported_layers(sample, "riverbed.runtime.sample") == {
        "events",
        "settings",
        "bus",
        "memory",
        "runtime",
        "services",
    }


def test_only_workers_and_cli_choose_concrete_adapters() -> None:
    users = {
        layer_of_file(path)[0] for path in source_files() if "services" in imported_layers(path, layer_of_file(path)[0])
    }
    choosers = {m for m in users if m.split(".")[1] in ("workers", "cli")}
    assert users - choosers <= {module for module, _ in EXCEPTIONS}


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

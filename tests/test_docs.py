"""The README is a front door and docs/ the manual behind it: short, and every link resolves."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import msgspec.inspect
import pytest

from riverbed.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _prose(path: Path) -> str:
    """The page without its fenced code blocks (a link in code is no link)."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of the page's headings."""
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _prose(path), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in _LINK.findall(_prose(page)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file})")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target} (no heading #{anchor} in {file.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"the README has {len(lines)} lines; the manual belongs in docs/"
    head = "\n".join(lines[:40])
    assert "pip install -e '.[dev]' && .venv/bin/riverbed demo" in head
    assert "pip install -e '.[dev]' && .venv/bin/pytest" in head


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    unlinked = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_the_configuration_page_documents_every_setting_and_only_settings() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"`((?:RIVERBED|OPENAI)_[A-Z_]+)`", page))
    info = msgspec.inspect.type_info(Settings)
    assert isinstance(info, msgspec.inspect.StructType)
    variables = {Settings.variable(field.name) for field in info.fields}
    assert not variables - documented, f"settings the configuration page leaves out: {sorted(variables - documented)}"
    assert not documented - variables, f"variables on the page that are no setting: {sorted(documented - variables)}"

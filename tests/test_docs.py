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


# --- documented defaults are the code's --------------------------------------------------------

_VALUE = r"`[^`]+`|\d{1,3}(?:,\d{3})+(?![\d])|\d+(?:\.\d+)?"
"""A default as the pages write one: `code`, or a number (``10,000``, ``1.2``)."""
_MENTION = re.compile(r"(?:`(?P<before>[^`]+)` )?\(default(?P<rest>[^)]*)")


def _defaults_said(text: str) -> list[str | None]:
    """The defaults one table cell (or sentence) says, in order: a value, or None for one said in
    words (``(default: one directory per …)``).  ``(default `127.0.0.1`, `8300`)`` says two."""
    said: list[str | None] = []
    for mention in _MENTION.finditer(text):
        rest = mention.group("rest")
        if mention.group("before") is not None and re.match(r"\s*(?:\)|:|$)", rest):
            said.append(mention.group("before"))  # `none` (default) or `none` (default: why)
        elif rest.startswith(":"):
            said.append(None)
        elif first := re.match(rf"\s+({_VALUE})((?:, `[^`]+`)*)", rest):
            said.append(first.group(1))
            said.extend(re.findall(r"`[^`]+`", first.group(2)))
        else:
            raise AssertionError(f"a default the test cannot read: {mention.group(0)!r}")
    return said


def _agrees(variable: str, said: str) -> str | None:
    """Why ``said`` is not the default of ``variable``'s setting (None: it is)."""
    field = next(f for f in Settings.__struct_fields__ if Settings.variable(f) == variable)
    actual = getattr(Settings(), field)
    value = said.strip("`")
    if re.fullmatch(r"(?:RIVERBED|OPENAI)_[A-Z_]+", value):  # "defaults to that setting": none of its own
        return None if actual is None else f"{variable} falls back to {value} but its default is {actual!r}"
    try:
        documented = getattr(msgspec.convert({field: value.replace(",", "")}, Settings, strict=False), field)
    except msgspec.ValidationError as exc:
        return f"{variable}: the documented default {said} is no valid value ({exc})"
    return None if documented == actual else f"{variable}: documented {said}, the code's default is {actual!r}"


def test_the_defaults_on_the_configuration_page_are_the_codes() -> None:
    checked, wrong = 0, []
    for row in (ROOT / "docs" / "configuration.md").read_text().splitlines():
        if not row.startswith("| `"):
            continue
        first, meaning = row.split(" | ", 1)
        variables = re.findall(r"`((?:RIVERBED|OPENAI)_[A-Z_]+)`", first)
        said = _defaults_said(meaning)
        if not said:
            continue
        assert len(said) == len(variables), f"{variables} but the row says {len(said)} defaults: {said}"
        for variable, value in zip(variables, said, strict=True):
            if value is not None:
                checked += 1
                wrong.append(_agrees(variable, value))
    assert [w for w in wrong if w] == []
    assert checked >= 35  # the page states most defaults as values, which are checked here


def test_the_defaults_the_other_pages_state_are_the_codes() -> None:
    """A page names a variable and its default in a sentence: "`RIVERBED_AGENT_MAX_DEPTH` levels
    below a top-level run (default 3)", "(`RIVERBED_AGENT_PACE_SLACK`, default 1.2)"."""
    checked: dict[str, set[str]] = {}
    wrong = []
    for page in PAGES:
        if page.name == "configuration.md":
            continue  # its table is read above
        text = " ".join(page.read_text().split())
        for found in re.finditer(r"`((?:RIVERBED|OPENAI)_[A-Z_]+)`", text):
            # Up to the next variable named, within the sentence.
            following = re.split(r"`(?:RIVERBED|OPENAI)_[A-Z_]+", text[found.end() :], maxsplit=1)[0]
            value = re.match(rf"[^.;]*?\(?default ({_VALUE})", following)
            if value is not None:
                checked.setdefault(page.name, set()).add(found.group(1))
                wrong.append(_agrees(found.group(1), value.group(1)))
    assert [w for w in wrong if w] == []
    agents = {f"RIVERBED_AGENT_{name}" for name in ("MAX_DEPTH", "MAX_FANOUT", "MIN_RUNS", "PACE_SLACK")}
    assert checked.get("agents.md", set()) >= agents
    assert sum(len(names) for names in checked.values()) >= 10

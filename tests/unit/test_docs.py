"""The README and the docs: the README fits a first read and shows the viewer; the screenshots
it and the docs show are the snapshot suite's; the hand-written tables name every rule and every
report key the code has (the generated ones cannot drift: tools/docs_hooks.py builds them)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.conftest import REPO
from torchtop.model.advice import RULES
from torchtop.report.job import summarize

DOCS = REPO / "docs"


def test_the_readme_is_short_and_shows_the_viewer() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", readme)
    assert images, "the README has no screenshot"
    for image in images:
        path = REPO / unquote(image)
        assert path.is_file(), image
        assert path.is_relative_to(REPO / "tests" / "viewer" / "__snapshots__"), image
    for section in ("## Install", "## Quick start", "## Commands", "## Keys", "## Documentation"):
        assert section in readme


def test_every_link_of_the_readme_resolves() -> None:
    readme = (REPO / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if target.startswith("http"):
            continue
        assert (REPO / unquote(target)).exists(), target


def test_the_docs_screenshots_are_the_snapshot_suites() -> None:
    from tools.docs_hooks import SNAPSHOTS

    names = {
        svg.stem.removeprefix("test_").replace("[", "-").replace("]", "").replace("_", "-")
        for svg in SNAPSHOTS.glob("*.svg")
    }
    shown = {
        Path(m).stem
        for page in DOCS.glob("*.md")
        for m in re.findall(r"\]\(screens/([^)]+)\)", page.read_text())
    }
    assert shown, "no page shows a screen"
    assert shown <= names, shown - names


def test_the_advice_page_explains_every_rule() -> None:
    page = (DOCS / "advice.md").read_text()
    explained = set(re.findall(r"^\| `([a-z0-9-]+)` \|", page, flags=re.M))
    missing = [rule.name for rule in RULES if rule.name not in explained]
    assert not missing, f"docs/advice.md does not explain {missing}"


def test_the_report_page_names_every_top_level_key() -> None:
    page = (DOCS / "report.md").read_text()
    hand = page.split("## Every key")[0]
    missing = [key for key in summarize([]) if f"`{key}`" not in hand]
    assert not missing, f"docs/report.md does not describe {missing}"


def test_the_generated_tables_list_what_the_code_has() -> None:
    from tools.docs_hooks import advice_rules, metrics, on_page_markdown, report_keys

    assert all(f"`{rule.name}`" in advice_rules() for rule in RULES)
    assert "`torchtop_steps_total` | counter" in metrics()
    assert "`step_time_s.median`" in report_keys()
    assert "<!--" not in on_page_markdown("<!-- torchtop:metrics -->")


def test_every_package_says_what_lives_there_and_what_it_may_import() -> None:
    from tools.docs_hooks import PACKAGE, first_paragraph, packages

    found = packages()
    assert {p.relative_to(PACKAGE).as_posix() for p in found} >= {"agent", "model", "tui"}
    for package in found:
        init = package / "__init__.py"
        assert first_paragraph(init), f"{init} has no docstring"
        assert "May import:" in init.read_text(), (
            f"{init}'s docstring does not say what it may import"
        )


def test_the_layout_page_lists_the_shared_ground_the_package_root_has() -> None:
    from tools.docs_hooks import ENTRY_POINTS, PACKAGE, layout, shared_ground

    at_root = {f"torchtop.{p.stem}" for p in PACKAGE.glob("*.py")} - {
        f"torchtop.{name}" for name in ENTRY_POINTS
    }
    assert set(shared_ground()) == at_root
    page = layout().split("\n## ")[0]
    listed = set(re.findall(r"^- `(torchtop\.[a-z_]+)`", page, flags=re.M))
    assert listed == at_root
    # The import rule that keeps the shared ground to the standard library names the same modules.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (rule,) = [c for c in config["contracts"] if c["name"].startswith("The shared ground")]
    assert set(rule["source_modules"]) == at_root


def test_the_layout_page_is_generated() -> None:
    from tools.docs_hooks import layout, on_page_markdown

    page = (DOCS / "layout.md").read_text()
    assert "<!-- torchtop:layout -->" in page
    assert "## torchtop.streams" in layout() and "- `relay.py`: " in layout()
    assert "<!--" not in on_page_markdown("<!-- torchtop:layout -->")


def test_every_test_file_is_in_a_group_folder() -> None:
    """Tests live in unit/, gpu/, viewer/ or processes/ (tests/README.md), so `make test
    TESTS=tests/unit` runs exactly one group and nothing is left out of every group."""
    tests = REPO / "tests"
    groups = {"unit", "gpu", "viewer", "processes"}
    loose = sorted(p.name for p in tests.glob("test_*.py"))
    assert not loose, f"test files outside a group folder: {loose}"
    found = {p.parent.name for p in tests.rglob("test_*.py") if "__snapshots__" not in p.parts}
    assert found == groups
    readme = (tests / "README.md").read_text()
    assert all(f"`{group}/`" in readme for group in groups)

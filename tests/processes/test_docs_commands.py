"""Every ``torchtop`` command line of the docs' shell blocks that the README does not already
hold is accepted by the real CLI and runs, as test_readme_commands.py runs the README's (a file
of its own, so the two share the test run's two workers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.processes.test_readme_commands import readme_commands, run_commands


def docs_commands() -> list[str]:
    readme = set(readme_commands())
    pages = sorted((REPO / "docs").glob("*.md"))
    return [line for line in readme_commands(pages) if line not in readme]


def test_the_docs_list_commands_beyond_the_readme() -> None:
    commands = docs_commands()
    assert "torchtop attach PID --python-path DIRS" in commands
    assert len(commands) >= 20


def test_every_docs_command_parses_and_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_commands(docs_commands(), tmp_path, monkeypatch)

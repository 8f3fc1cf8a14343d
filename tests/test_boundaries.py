"""Module boundaries: the viewer side never imports torch; the agent never imports the UI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _modules_after_import(module: str) -> set[str]:
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


@pytest.mark.parametrize(
    "module",
    [
        "torchtop",
        "torchtop.cli",
        "torchtop.protocol",
        "torchtop.transport",
        "torchtop.recording",
        "torchtop.report",
        "torchtop.feed",
        "torchtop.runner",
        "torchtop.tui.app",
        "torchtop.tui.sources",
        "torchtop.tui.state",
    ],
)
def test_viewer_side_never_imports_torch(module: str) -> None:
    loaded = _modules_after_import(module)
    assert "torch" not in loaded


@pytest.mark.parametrize(
    "module",
    ["torchtop.agent.core", "torchtop.agent.bootstrap", "torchtop.protocol", "torchtop.transport"],
)
def test_agent_side_never_imports_the_ui(module: str) -> None:
    loaded = _modules_after_import(module)
    assert not {"textual", "rich"} & {m.split(".")[0] for m in loaded}


def test_protocol_and_transport_use_the_standard_library_only() -> None:
    loaded = _modules_after_import("torchtop.transport")
    third_party = {"psutil", "pynvml", "torch", "textual", "rich", "numpy"}
    assert not third_party & {m.split(".")[0] for m in loaded}


def test_help_does_not_import_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "torchtop", "--help"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "usage: torchtop" in out.stdout
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines()}
    assert "torch" not in imported and "textual" not in imported

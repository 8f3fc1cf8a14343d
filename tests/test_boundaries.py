"""Module boundaries: the viewer side never imports torch; the agent never imports the UI; the
model imports the protocol, the sanitizer of untrusted text and the standard library only, and
does no I/O."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

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
        "torchtop.model.job",
        "torchtop.export.service",
        "torchtop.export.prometheus",
        "torchtop.export.otlp",
        "torchtop.relay",
        "torchtop.nodes",
        "torchtop.commands.doctor",
    ],
)
def test_viewer_side_never_imports_torch(module: str) -> None:
    loaded = _modules_after_import(module)
    assert "torch" not in loaded


@pytest.mark.parametrize(
    "module",
    [
        "torchtop.agent.core",
        "torchtop.agent.bootstrap",
        "torchtop.protocol",
        "torchtop.transport",
        "torchtop.model",
        # A node's relay and the viewer's end of it: the UI only in the viewer's process.
        "torchtop.relay",
        "torchtop.nodes",
    ],
)
def test_agent_side_never_imports_the_ui(module: str) -> None:
    loaded = _modules_after_import(module)
    assert not {"textual", "rich"} & {m.split(".")[0] for m in loaded}


@pytest.mark.parametrize("module", ["torchtop.transport", "torchtop.text"])
def test_shared_ground_uses_the_standard_library_only(module: str) -> None:
    loaded = _modules_after_import(module)
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


MODEL = Path(__file__).resolve().parent.parent / "torchtop" / "model"
#: Standard library modules that read or write the world (files, sockets, processes, clocks).
IO_MODULES = {
    "asyncio",
    "io",
    "os",
    "pathlib",
    "select",
    "shutil",
    "signal",
    "socket",
    "subprocess",
    "sys",
    "tempfile",
    "threading",
    "time",
}
IO_CALLS = {"open", "print", "input", "exec", "eval", "__import__"}


def test_the_model_imports_the_protocol_and_the_standard_library_only() -> None:
    # The package's own ``__init__`` (the job's ``torchtop.start()``) comes with any import.
    before = _modules_after_import("torchtop")
    loaded = _modules_after_import("torchtop.model") - before
    ours = {m for m in loaded if m.split(".")[0] == "torchtop"}
    shared = {"torchtop.protocol", "torchtop.text"}
    assert ours - shared == {m for m in ours if m.startswith("torchtop.model")}
    stdlib = set(sys.stdlib_module_names)
    third_party = {m.split(".")[0] for m in loaded} - stdlib - {"torchtop", "_distutils_hack"}
    assert not third_party


def test_the_model_does_no_io() -> None:
    files = sorted(MODEL.glob("*.py"))
    assert files
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
                if node.module == "torchtop" or (node.module or "").startswith("torchtop."):
                    assert node.module in (
                        "torchtop.protocol",
                        "torchtop.text",
                    ) or node.module.startswith("torchtop.model"), (
                        f"{path.name} imports {node.module}"
                    )
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in IO_CALLS, f"{path.name}:{node.lineno} {node.func.id}()"
                continue
            else:
                continue
            assert not names & IO_MODULES, f"{path.name}:{node.lineno} imports {names}"

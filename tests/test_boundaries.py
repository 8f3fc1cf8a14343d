"""Module boundaries: the viewer side never imports torch; the agent never imports the UI; the
model imports the protocol, the sanitizer of untrusted text, the byte-size writer and the
standard library only, does no I/O, and its modules import each other one way."""

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
        "torchtop.commands",
        "torchtop.protocol",
        "torchtop.transport",
        "torchtop.streams.recording",
        "torchtop.report.job",
        "torchtop.streams.feed",
        "torchtop.streams.runner",
        "torchtop.tui.app",
        "torchtop.streams.sources",
        "torchtop.model.job",
        "torchtop.export.service",
        "torchtop.export.prometheus",
        "torchtop.export.otlp",
        "torchtop.streams.relay",
        "torchtop.streams.nodes",
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
        "torchtop.streams.relay",
        "torchtop.streams.nodes",
    ],
)
def test_agent_side_never_imports_the_ui(module: str) -> None:
    loaded = _modules_after_import(module)
    assert not {"textual", "rich"} & {m.split(".")[0] for m in loaded}


@pytest.mark.parametrize("module", ["torchtop.transport", "torchtop.text", "torchtop.sizes"])
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


#: What the model may import of torchtop besides itself: the protocol it folds, the sanitizer of
#: untrusted text, and ``torchtop.sizes``, the one writer of byte sizes (standard library only,
#: shared ground like the other two), so the model's advice and the viewer write a size alike.
MODEL_MAY_IMPORT = ("torchtop.protocol", "torchtop.text", "torchtop.sizes")


def test_the_model_imports_the_protocol_and_the_standard_library_only() -> None:
    """The model imports the protocol, the text sanitizer, the byte-size writer
    (``torchtop.sizes``: standard library only, so the model's sentences and the viewer write a
    size the same way from one function) and the standard library; nothing else."""
    # The package's own ``__init__`` (the job's ``torchtop.start()``) comes with any import.
    before = _modules_after_import("torchtop")
    loaded = _modules_after_import("torchtop.model") - before
    ours = {m for m in loaded if m.split(".")[0] == "torchtop"}
    shared = set(MODEL_MAY_IMPORT)
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
                    assert node.module in MODEL_MAY_IMPORT or node.module.startswith(
                        "torchtop.model"
                    ), f"{path.name} imports {node.module}"
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in IO_CALLS, f"{path.name}:{node.lineno} {node.func.id}()"
                continue
            else:
                continue
            assert not names & IO_MODULES, f"{path.name}:{node.lineno} imports {names}"


#: Calls that turn data into code: torchtop never makes them on anything it reads (a recording,
#: a snapshot, a frame, a token file). ``pickle.dumps`` (the OOM snapshot it writes) is fine.
LOADS_CODE = {
    "eval",
    "exec",
    "pickle.load",
    "pickle.loads",
    "pickle.Unpickler",
    "marshal.load",
    "marshal.loads",
    "torch.load",
    "shelve.open",
    "yaml.load",
    "yaml.unsafe_load",
}


def _calls_that_load_code(source: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name):
            called = func.id
            # ``from pickle import loads``: a bare name that loads is suspect wherever it is from.
            suspect = called in LOADS_CODE or called in {"load", "loads", "Unpickler"}
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            called = f"{func.value.id}.{func.attr}"
            suspect = called in LOADS_CODE
        else:
            continue
        if suspect:
            found.append(f"{name}:{node.lineno} {called}()")
    return found


def test_nothing_torchtop_reads_is_unpickled_or_evaluated() -> None:
    """No unpickling, ``eval`` or ``exec`` anywhere in the package or its demos (the attach
    payload is a string run in the job, written by torchtop; the job's own script runs through
    ``runpy``, as ``python`` would run it)."""
    root = Path(__file__).resolve().parent.parent
    files = sorted([*(root / "torchtop").rglob("*.py"), *(root / "demos").rglob("*.py")])
    assert len(files) > 50
    found = [f for p in files for f in _calls_that_load_code(p.read_text(), str(p))]
    assert found == []
    # The check finds what it looks for.
    sample = "import pickle\nfrom pickle import loads\npickle.load(f)\neval(s)\nloads(b)\n"
    assert _calls_that_load_code(sample, "x") == ["x:3 pickle.load()", "x:4 eval()", "x:5 loads()"]


def _model_imports(path: Path) -> set[str]:
    """The ``torchtop.model`` modules ``path`` imports anywhere: at the top, under
    ``TYPE_CHECKING``, inside functions (``ast.walk`` sees them all)."""
    package = "torchtop.model"
    submodules = {p.stem for p in MODEL.glob("*.py") if p.stem != "__init__"}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: ``from .advice import x``, ``from . import advice``
                base = ".".join([package, base]) if base else package
            # ``from torchtop.model import advice`` imports the submodule.
            modules = [base] + [
                f"{base}.{a.name}" for a in node.names if base == package and a.name in submodules
            ]
        else:
            continue
        for module in modules:
            if module == package or module.startswith(package + "."):
                found.add(".".join(module.split(".")[:3]))
    return found


def _find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle a depth-first walk closes, as the modules along it, the first repeated last."""
    cycles: list[list[str]] = []
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        for target in sorted(graph.get(module, ())):
            if target in path:
                cycles.append([*path[path.index(target) :], target])
            elif target not in done:
                visit(target, [*path, target])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    return cycles


def test_the_model_has_no_import_cycles() -> None:
    """The model's modules import each other one way only: counting imports under
    ``TYPE_CHECKING`` and inside functions, which hide a cycle from Python but not from a
    reader (each side must be understood before the other)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(MODEL.glob("*.py")):
        name = "torchtop.model" if path.stem == "__init__" else f"torchtop.model.{path.stem}"
        graph[name] = _model_imports(path) - {name}
    assert len(graph) > 5
    cycles = _find_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
    # The check finds what it looks for.
    assert _find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]

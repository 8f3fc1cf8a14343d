"""Module boundaries: the viewer side never imports torch; the agent never imports the UI; the
model imports the protocol, the sanitizer of untrusted text, the byte-size writer and the
standard library only, and does no I/O; no two modules import each other round a cycle.

The rules between packages are import-linter contracts ([tool.importlinter] in pyproject.toml,
checked by ``make lint``); these tests check what an import really loads at run time, and what
the contracts cannot say.
"""

from __future__ import annotations

import ast
import itertools
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


MODEL = Path(__file__).resolve().parents[2] / "torchtop" / "model"
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
    root = Path(__file__).resolve().parents[2]
    files = sorted([*(root / "torchtop").rglob("*.py"), *(root / "demos").rglob("*.py")])
    assert len(files) > 50
    found = [f for p in files for f in _calls_that_load_code(p.read_text(), str(p))]
    assert found == []
    # The check finds what it looks for.
    sample = "import pickle\nfrom pickle import loads\npickle.load(f)\neval(s)\nloads(b)\n"
    assert _calls_that_load_code(sample, "x") == ["x:3 pickle.load()", "x:4 eval()", "x:5 loads()"]


ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "torchtop"


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(package: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """Every module of ``package`` and the modules of it that it imports, each with the line of
    the first such import: at the top, inside a function, under ``TYPE_CHECKING``, relative or
    absolute. ``from X import Y`` imports ``X.Y`` where that is a module, else ``X``. A module's
    parent packages, which Python runs first, are not counted: they are not its choice."""
    files = {_module_name(path, package): path for path in sorted(package.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    module = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    module = node.module or ""
                for alias in node.names:
                    submodule = f"{module}.{alias.name}"
                    targets.append(submodule if submodule in files else module)
            for target in targets:
                if target in files and target != name:
                    imported[target] = min(imported.get(target, node.lineno), node.lineno)
        graph[name] = imported
    return graph


def import_groups(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """The groups of modules of ``graph`` that import each other, directly or round a cycle
    (its strongly connected components of more than one module), in order."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(start: str) -> None:
        # Tarjan's algorithm, without recursion.
        work = [(start, iter(sorted(graph[start])))]
        order[start] = low[start] = len(order)
        stack.append(start)
        while work:
            module, targets = work[-1]
            for target in targets:
                if target not in order:
                    order[target] = low[target] = len(order)
                    stack.append(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in stack:
                    low[module] = min(low[module], order[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == order[module]:
                    group = set()
                    while True:
                        member = stack.pop()
                        group.add(member)
                        if member == module:
                            break
                    if len(group) > 1:
                        groups.append(group)

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return sorted(groups, key=sorted)


def shortest_cycle(graph: dict[str, dict[str, int]], group: set[str]) -> list[str]:
    """The shortest way round ``group`` (see :func:`import_groups`) from its first module, which
    ends the list too."""
    first = min(group)
    came_from: dict[str, str] = {}
    frontier = [first]
    while first not in came_from:
        following = []
        for module in frontier:
            for target in sorted(graph[module]):
                if target in group and target not in came_from:
                    came_from[target] = module
                    following.append(target)
        frontier = following
    path = [first]
    while len(path) == 1 or path[-1] != first:
        path.append(came_from[path[-1]])
    return path[::-1]


def _named(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    steps = [f"{a} (l.{graph[a][b]})" for a, b in itertools.pairwise(cycle)]
    return " -> ".join([*steps, cycle[-1]])


#: Cycles known and not yet broken, each as the set of modules in it. A new cycle fails the
#: test; so does one of these once it is gone (take it off the list).
def test_no_module_imports_itself_round_a_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 80
    groups = import_groups(graph)
    cycles = [
        f"{_named(shortest_cycle(graph, group), graph)} (modules in the cycle: {sorted(group)})"
        for group in groups
    ]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_cycle_finder_finds_cycles(tmp_path: Path) -> None:
    package = tmp_path / "torchtop"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from torchtop.sub import b\n")
    (package / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nfrom . import c\n")
    (package / "sub" / "c.py").write_text("if TYPE_CHECKING:\n    import torchtop.a\n")
    (package / "d.py").write_text("from torchtop import a\nimport torchtop\n")
    graph = import_graph(package)
    assert graph["torchtop.d"] == {"torchtop.a": 1, "torchtop": 2}
    (group,) = import_groups(graph)
    assert shortest_cycle(graph, group) == [
        "torchtop.a",
        "torchtop.sub.b",
        "torchtop.sub.c",
        "torchtop.a",
    ]
    assert _named(shortest_cycle(graph, group), graph).startswith("torchtop.a (l.2) -> ")


def test_the_rule_on_the_verbs_names_every_other_top_level_module() -> None:
    """import-linter's rule that only the verbs import the verbs and the viewer lists the
    modules it applies to: a new top-level module or package must join the list."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (rule,) = [c for c in config["contracts"] if c["name"].startswith("Only the verbs import")]
    allowed = {"torchtop.commands", "torchtop.tui", "torchtop.__main__"}
    top_level = {
        f"torchtop.{path.stem}"
        for path in PACKAGE.iterdir()
        if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").exists()
    }
    assert set(rule["source_modules"]) == top_level - allowed

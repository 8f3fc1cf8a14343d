"""The bundled demos, found without importing them (demos import torch; the CLI must not).

A demo is a module in ``torchtop.demos`` (the repository's ``demos/`` folder) whose name does not
start with ``_``. The first line of its docstring is its one-line description. A demo that needs
a device memory limit on the CPU (``oom``) says so in a module-level string constant,
``CPU_MEMORY_LIMIT = "512MiB"``, which ``torchtop demo`` passes as ``--memory-limit``.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "torchtop.demos"


class DemoNotFound(Exception):
    pass


@dataclass(frozen=True)
class Demo:
    name: str
    module: str
    path: Path
    description: str
    #: The ``--memory-limit`` this demo runs with on the CPU unless the user gives one.
    cpu_memory_limit: str | None = None


def _demo_dir() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DemoNotFound("the demos are not installed; reinstall torchtop")
    return Path(next(iter(spec.submodule_search_locations)))


def list_demos() -> list[Demo]:
    demos = []
    for path in sorted(_demo_dir().glob("*.py")):
        if path.name.startswith("_"):
            continue
        try:
            tree = ast.parse(path.read_text())
        except (OSError, SyntaxError):
            continue
        doc = ast.get_docstring(tree) or ""
        description = doc.strip().splitlines()[0] if doc.strip() else ""
        name = path.stem.replace("_", "-")
        demos.append(
            Demo(
                name=name,
                module=f"{PACKAGE}.{path.stem}",
                path=path,
                description=description,
                cpu_memory_limit=_string_constant(tree, "CPU_MEMORY_LIMIT"),
            )
        )
    return demos


def _string_constant(tree: ast.Module, name: str) -> str | None:
    """The value of ``NAME = "..."`` (or ``NAME: str = "..."``) at the top of a module."""
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        named = any(isinstance(t, ast.Name) and t.id == name for t in targets)
        if named and isinstance(value, ast.Constant) and isinstance(value.value, str):
            return value.value
    return None


def find_demo(name: str) -> Demo:
    demos = list_demos()
    wanted = name.replace("_", "-").lower()
    for demo in demos:
        if demo.name == wanted:
            return demo
    names = [d.name for d in demos]
    close = difflib.get_close_matches(wanted, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise DemoNotFound(f"no demo named {name!r}; {hint}the demos are: {', '.join(names)}")

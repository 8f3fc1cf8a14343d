"""The bundled demos, found without importing them (demos import torch; the CLI must not).

A demo is a module in ``torchtop.demos`` (the repository's ``demos/`` folder) whose name does not
start with ``_``. The first line of its docstring is its one-line description.
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
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        except (OSError, SyntaxError):
            continue
        description = doc.strip().splitlines()[0] if doc.strip() else ""
        name = path.stem.replace("_", "-")
        demos.append(
            Demo(name=name, module=f"{PACKAGE}.{path.stem}", path=path, description=description)
        )
    return demos


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

"""MkDocs hooks for torchtop's docs: the viewer's screenshots come from the snapshot suite, and
the reference tables are generated from the code, so neither can drift from the product.

A page asks for a table with a marker line: ``<!-- torchtop:advice-rules -->``,
``<!-- torchtop:metrics -->``, ``<!-- torchtop:report-keys -->`` or ``<!-- torchtop:layout -->``
(the packages and their modules, from their docstrings).
"""

from __future__ import annotations

import ast
import inspect
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOTS = ROOT / "tests" / "viewer" / "__snapshots__" / "test_snapshots"
PACKAGE = ROOT / "torchtop"
#: Modules at the package root that are not shared ground: the package itself (the job's API),
#: ``python -m torchtop``, and the command line while its verbs move to torchtop.commands.
ENTRY_POINTS = {"__init__", "__main__"}


def on_pre_build(config: Any) -> None:
    """Copy the snapshot suite's SVGs to ``docs/screens/`` (ignored by git)."""
    screens = Path(config["docs_dir"]) / "screens"
    screens.mkdir(exist_ok=True)
    for svg in SNAPSHOTS.glob("*.svg"):
        # "test_help[80x24].svg" -> "help-80x24.svg": brackets make awkward URLs.
        name = svg.stem.removeprefix("test_").replace("[", "-").replace("]", "").replace("_", "-")
        shutil.copyfile(svg, screens / f"{name}.svg")


def advice_rules() -> str:
    from torchtop.model.advice import RULES

    rows = ["| rule | held before shown | when it fires |", "| --- | --- | --- |"]
    for rule in RULES:
        doc = inspect.getdoc(rule.check) or ""
        first = " ".join(doc.split("\n\n")[0].split())
        rows.append(f"| `{rule.name}` | {rule.hold_s:g} s | {first} |")
    return "\n".join(rows)


def metrics() -> str:
    from torchtop.export.families import families

    rows = ["| metric | type | unit | labels | meaning |", "| --- | --- | --- | --- | --- |"]
    for family in families([]):
        labels = ", ".join(f"`{label}`" for label in family.labels)
        name = f"{family.name}_total" if family.kind == "counter" else family.name
        rows.append(f"| `{name}` | {family.kind} | `{family.unit}` | {labels} | {family.help} |")
    return "\n".join(rows)


def report_keys() -> str:
    from torchtop.report.job import summarize

    rows = ["| key | type |", "| --- | --- |"]

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict) and path:
            rows.append(f"| `{path}` | object |")
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(inner, f"{path}.{key}" if path else key)
            return
        kind = {list: "list", str: "string", int: "integer", float: "number", bool: "boolean"}
        name = "null until known" if value is None else kind.get(type(value), type(value).__name__)
        rows.append(f"| `{path}` | {name} |")

    walk(summarize([]), "")
    return "\n".join(rows)


def _markdown(text: str) -> str:
    """reStructuredText's inline marks as Markdown: ``code`` and :mod:`~a.b` as `a.b`."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: f"`{m.group(1)}`", text)
    return text.replace("``", "`")


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""


def first_paragraph(path: Path) -> str:
    """The first paragraph of a module's docstring, on one line."""
    return _markdown(" ".join(_docstring(path).split("\n\n")[0].split()))


def first_sentence(path: Path) -> str:
    """The first sentence of a module's docstring: its first paragraph up to the first full
    stop that ends a sentence."""
    paragraph = first_paragraph(path)
    return re.split(r"(?<=\.)\s+(?=[A-Z`(])", paragraph, maxsplit=1)[0]


def shared_ground() -> list[str]:
    """The modules at the package root that every package may import: standard library only."""
    return sorted(
        f"torchtop.{path.stem}" for path in PACKAGE.glob("*.py") if path.stem not in ENTRY_POINTS
    )


def packages() -> list[Path]:
    """Every package under torchtop/ (a folder with an ``__init__.py``), parents first."""
    return sorted(path.parent for path in PACKAGE.rglob("__init__.py") if path.parent != PACKAGE)


def _dotted(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def layout() -> str:
    lines = ["## Shared ground", ""]
    lines += [
        f"- `{name}`: {first_sentence(PACKAGE / (name.split('.')[-1] + '.py'))}"
        for name in shared_ground()
    ]
    inside = set(packages())
    for package in packages():
        lines += ["", f"## {_dotted(package)}", "", first_paragraph(package / "__init__.py"), ""]
        modules = sorted(
            path
            for path in package.rglob("*.py")
            if path.name != "__init__.py"
            # a subpackage has its own section; a plain folder (agent/rank_site) is listed here
            and not any(p in inside for p in path.parents if p != package and package in p.parents)
        )
        lines += [
            f"- `{path.relative_to(package).as_posix()}`: {first_sentence(path)}"
            for path in modules
        ]
    return "\n".join(lines)


TABLES: dict[str, Callable[[], str]] = {
    "advice-rules": advice_rules,
    "metrics": metrics,
    "report-keys": report_keys,
    "layout": layout,
}


def on_page_markdown(markdown: str, **_: Any) -> str:
    for name, table in TABLES.items():
        marker = f"<!-- torchtop:{name} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, table())
    return markdown

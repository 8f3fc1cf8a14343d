"""MkDocs hooks for torchtop's docs: the viewer's screenshots come from the snapshot suite, and
the reference tables are generated from the code, so neither can drift from the product.

A page asks for a table with a marker line: ``<!-- torchtop:advice-rules -->``,
``<!-- torchtop:metrics -->`` or ``<!-- torchtop:report-keys -->``.
"""

from __future__ import annotations

import inspect
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOTS = ROOT / "tests" / "__snapshots__" / "test_snapshots"


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


TABLES: dict[str, Callable[[], str]] = {
    "advice-rules": advice_rules,
    "metrics": metrics,
    "report-keys": report_keys,
}


def on_page_markdown(markdown: str, **_: Any) -> str:
    for name, table in TABLES.items():
        marker = f"<!-- torchtop:{name} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, table())
    return markdown

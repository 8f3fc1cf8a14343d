"""``torchtop compare``: two recordings compared, as JSON or as text.

Each recording is folded as ``torchtop report`` folds it (:func:`torchtop.report.job.fold`, or
rank by rank with :func:`torchtop.report.run.rank_models`); the comparison is the model's
(:mod:`torchtop.model.compare`), and this module renders it. The text (rich, imported only for
it) renders the JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torchtop.model import JobModel
from torchtop.model.compare import (
    BLOCK_STEPS,
    BOOTSTRAP_RESAMPLES,
    CONFIDENCE,
    Change,
    CompareError,
    JobComparison,
    StepAlignment,
    compare_jobs,
    compare_runs,
)
from torchtop.protocol import Message
from torchtop.report.run import is_multi_rank, rank_models
from torchtop.sizes import format_bytes

METHOD = (
    f"{CONFIDENCE:.0%} interval of B - A from a block bootstrap of each run's steps "
    f"({BOOTSTRAP_RESAMPLES} resamples of blocks of {BLOCK_STEPS} steps, fixed seed)"
)


@dataclass
class Side:
    """One recording folded: the job's model, or each rank's."""

    path: str
    multi_rank: bool
    jobs: list[JobModel]

    @property
    def kind(self) -> str:
        return f"a run of {len(self.jobs)} ranks" if self.multi_rank else "one process"


def fold_recording(path: str, messages: Sequence[Message], sources: Sequence[str | None]) -> Side:
    """A recording's models, as ``torchtop report`` folds them."""
    from torchtop.report.job import fold

    if is_multi_rank(sources):
        _, ranks, _ = rank_models(messages, sources)
        return Side(path, True, ranks)
    return Side(path, False, [fold(messages)])


def compare(a: Side, b: Side, skip: int | None = None) -> dict[str, Any]:
    """The comparison's JSON object; :class:`CompareError` for recordings that cannot be
    compared (of different kinds, without steps)."""
    if a.multi_rank != b.multi_rank or (a.multi_rank and not (a.jobs and b.jobs)):
        raise CompareError(
            f"cannot compare {a.kind} ({a.path}) with {b.kind} ({b.path}): record both the same way"
        )
    head = {"a": _side_json(a), "b": _side_json(b), "method": METHOD}
    if not a.multi_rank:
        job = compare_jobs(a.jobs[0], b.jobs[0], skip)
        return {**head, **job_json(job)}
    run = compare_runs(a.jobs, b.jobs, skip)
    ranks = [job_json(r) for r in run.ranks]
    changed = [c.label for c in run.run_steps if c.changed]
    for r in ranks:
        changed += [f"rank {r['rank']}: {label}" for label in r["changed"]]
    return {
        **head,
        "alignment": _alignment_json(run.alignment),
        "step_figures": [change_json(c) for c in run.run_steps],
        "ranks": ranks,
        "ranks_only_in_a": run.only_a,
        "ranks_only_in_b": run.only_b,
        "changed": changed,
    }


def _side_json(side: Side) -> dict[str, Any]:
    hello = side.jobs[0].hello if side.jobs else None
    return {
        "path": side.path,
        "kind": "run" if side.multi_rank else "process",
        "ranks": len(side.jobs) if side.multi_rank else None,
        "argv": hello.argv if hello is not None else None,
    }


def _alignment_json(a: StepAlignment) -> dict[str, Any]:
    return {
        "skipped_steps": a.start,
        "skip_given": a.given,
        "warmup_detected": {"a": a.warmup_a, "b": a.warmup_b},
        "compared_from": a.start,
        "compared_to": a.end,
        "compared_steps": {"a": a.compared_a, "b": a.compared_b},
        "steps": {"a": a.steps_a, "b": a.steps_b},
    }


def _round(value: float | None, unit: str) -> float | None:
    if value is None:
        return None
    if unit == "bytes":
        return round(value)
    return round(value, 6 if unit == "s" else 4)


def change_json(c: Change) -> dict[str, Any]:
    """One figure: A, B, the change and its interval, the verdict."""
    relative = c.relative
    return {
        "key": c.key,
        "label": c.label,
        "unit": c.unit,
        "a": _round(c.a, c.unit),
        "b": _round(c.b, c.unit),
        "change": _round(c.delta, c.unit),
        "relative": round(relative, 4) if relative is not None else None,
        "ci": [_round(c.ci[0], c.unit), _round(c.ci[1], c.unit)] if c.ci else None,
        "changed": c.changed,
        "better": c.better,
        "verdict": c.verdict,
    }


def job_json(job: JobComparison) -> dict[str, Any]:
    """One job's (or rank's) comparison."""
    findings: dict[str, list[dict[str, Any]]] = {"appeared": [], "went": [], "kept": []}
    for f in job.findings:
        findings[f.status].append(
            {"name": f.name, "title": f.title, "severity": f.severity, "rank": f.rank}
        )
    return {
        "rank": job.rank,
        "alignment": _alignment_json(job.alignment),
        "step_figures": [change_json(c) for c in job.steps],
        "memory": [
            {
                "device": d.device,
                "peak_allocated_bytes": change_json(d.peak_allocated),
                "peak_reserved_bytes": change_json(d.peak_reserved),
                "steady_allocated_bytes": change_json(d.steady_allocated),
            }
            for d in job.memory
        ],
        "host_peak_rss_bytes": change_json(job.host_peak_rss),
        "ops": [
            {
                "name": op.name,
                "self_cpu_per_step_s": change_json(op.cpu),
                "self_device_per_step_s": change_json(op.device) if op.device else None,
            }
            for op in job.ops
        ],
        "ops_note": job.ops_note,
        "counts": [change_json(c) for c in job.counts],
        "findings": findings,
        "energy": [
            {"device": e.device, "energy_per_step_j": change_json(e.per_step), "note": e.note}
            for e in job.energy
        ],
        "changed": job.changed,
    }


# -- text ----------------------------------------------------------------------------------------


def _value(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "s":
        return f"{value * 1e3:.2f} ms" if abs(value) < 1 else f"{value:.3f} s"
    if unit == "share":
        return f"{value:.1%}"
    if unit == "1/s":
        return f"{value:.2f}/s"
    if unit == "bytes":
        return format_bytes(int(value))
    if unit == "J":
        return f"{value:.2f} J"
    return f"{value:g}"


def _signed(value: float, unit: str) -> str:
    sign = "+" if value > 0 else "-" if value < 0 else "±"
    if unit == "share":
        return f"{sign}{abs(value) * 100:.1f} pts"
    return sign + _value(abs(value), unit)


def _interval_text(lo: float, hi: float, unit: str) -> str:
    """``-19.7 to -10.6 ms``: the unit once."""
    if unit == "s":
        scale, suffix = (1e3, " ms") if max(abs(lo), abs(hi)) < 1 else (1.0, " s")
    elif unit == "share":
        scale, suffix = 100.0, " pts"
    else:
        scale, suffix = 1.0, {"1/s": "/s", "J": " J"}.get(unit, "")
    return f"{lo * scale:+.1f} to {hi * scale:+.1f}{suffix}"


def change_cells(c: dict[str, Any]) -> list[Any]:
    """A figure as the table shows it: A, B, the change, its interval, the verdict (styled)."""
    from rich.text import Text

    unit = c["unit"]
    change = ""
    if c["change"] is not None:
        change = _signed(c["change"], unit)
        if c["relative"] is not None and unit != "share":
            change += f" ({c['relative']:+.0%})"
    interval = ""
    if c["ci"] is not None:
        interval = _interval_text(c["ci"][0], c["ci"][1], unit)
    style = "green" if c["better"] is True else "red" if c["better"] is False else ""
    if c["changed"] and not style:
        style = "yellow"
    short = {
        "no difference beyond noise": "within noise",
        "too few profiled steps to tell": "few steps",
        "too few energy readings to tell": "few readings",
    }
    verdict = Text(short.get(c["verdict"], c["verdict"]), style=style if c["changed"] else "dim")
    return [_value(c["a"], unit), _value(c["b"], unit), change, interval, verdict]


def _table(title: str, rows: list[tuple[str, dict[str, Any]]]) -> Any:
    from rich.table import Table
    from rich.text import Text

    from torchtop.report.job import add_text_row

    table = Table(title=title, title_justify="left")
    table.add_column("", ratio=None, min_width=16, overflow="ellipsis", no_wrap=True)
    for col in ("A", "B", "change", f"{CONFIDENCE:.0%} interval", "verdict"):
        table.add_column(col, justify="right" if col in ("A", "B", "change") else "left")
    for label, c in rows:
        add_text_row(table, Text(label, no_wrap=True, overflow="ellipsis"), *change_cells(c))
    return table


def _alignment_text(a: dict[str, Any]) -> str:
    how = "given" if a["skip_given"] else "warm-up detected"
    warm = a["warmup_detected"]
    return (
        f"steps {a['compared_from']} to {a['compared_to']} of each run "
        f"(A {a['compared_steps']['a']}, B {a['compared_steps']['b']} steps compared; "
        f"the first {a['skipped_steps']} skipped, {how}: A {warm['a']}, B {warm['b']})"
    )


def _job_parts(job: dict[str, Any], title: str) -> list[Any]:
    from rich.text import Text

    parts: list[Any] = [
        Text(_alignment_text(job["alignment"]), style="dim"),
        _table(title, [(c["label"], c) for c in job["step_figures"]]),
    ]
    memory_rows = []
    for d in job["memory"]:
        for key in ("peak_allocated_bytes", "peak_reserved_bytes", "steady_allocated_bytes"):
            c = d[key]
            memory_rows.append((f"{d['device']} {c['label']}", c))
    memory_rows.append(("host peak RSS", job["host_peak_rss_bytes"]))
    parts.append(_table("memory", memory_rows))
    if job["ops"]:
        rows = [(op["name"], op["self_cpu_per_step_s"]) for op in job["ops"]]
        rows += [
            (f"{op['name']} (device)", op["self_device_per_step_s"])
            for op in job["ops"]
            if op["self_device_per_step_s"] is not None
        ]
        rows += [(c["label"], c) for c in job["counts"] if c["a"] is not None or c["b"] is not None]
        parts.append(_table("top ops: self time per profiled step", rows))
    if job["ops_note"]:
        parts.append(Text(job["ops_note"], style="dim"))
    if job["energy"]:
        energy = [(e["device"], e["energy_per_step_j"]) for e in job["energy"]]
        parts.append(_table("GPU energy per step (NVML's counter)", energy))
        for e in job["energy"]:
            if e["note"]:
                parts.append(Text(f"{e['device']}: energy counter {e['note']}", style="dim"))
    findings = job["findings"]
    line = Text()
    line.append("findings", style="bold")
    if not any(findings.values()):
        line.append(" none in either run", style="dim")
    for status, style in (("appeared", "red"), ("went", "green"), ("kept", "dim")):
        for f in findings[status]:
            rank = f" (rank {f['rank']})" if f["rank"] is not None else ""
            line.append(f"\n  {status:<9}{f['severity']:<9}{f['title']}{rank}", style=style)
    parts.append(line)
    return parts


def render_text(report: dict[str, Any]) -> Any:
    """A rich renderable of the comparison (imports rich; the JSON path never does)."""
    from rich.console import Group
    from rich.text import Text

    head = Text()
    head.append("torchtop compare", style="bold")
    for side in ("a", "b"):
        s = report[side]
        kind = f"run of {s['ranks']} ranks" if s["kind"] == "run" else "one process"
        head.append(f"\n{side.upper()}: {s['path']} ({kind})")
    changed = report["changed"]
    head.append("\n")
    if changed:
        head.append("changed beyond noise: " + ", ".join(changed), style="bold yellow")
    else:
        head.append("no difference beyond noise", style="bold green")
    parts: list[Any] = [head]
    if "ranks" in report:
        parts.append(Text(_alignment_text(report["alignment"]), style="dim"))
        parts.append(
            _table(
                "the run (every rank's steps)", [(c["label"], c) for c in report["step_figures"]]
            )
        )
        for r in report["ranks"]:
            parts.extend(_job_parts(r, f"rank {r['rank']}"))
        for side in ("a", "b"):
            only = report[f"ranks_only_in_{side}"]
            if only:
                listed = ", ".join(map(str, only))
                parts.append(Text(f"ranks only in {side.upper()}: {listed}", style="yellow"))
    else:
        parts.extend(_job_parts(report, "steps"))
    parts.append(Text(METHOD, style="dim"))
    return Group(*parts)


__all__ = ["CompareError", "Side", "compare", "fold_recording", "render_text"]

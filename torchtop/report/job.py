"""``torchtop report``: a recording's model at its end, as JSON or as text.

The recording's messages are folded by :class:`torchtop.model.JobModel`, the same model the
viewer reads, and this module only renders it: the JSON keys are documented in the README, and
the text report (rich, imported only for it) renders the JSON.

Peaks are taken over the samples (10 per second by default). On CUDA the allocator's own peak
counters are exact for the whole run; per-phase peaks are the largest sampled values inside the
phase, since the agent never resets the job's peak counters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torchtop import __version__
from torchtop.model import CaptureEntry, JobModel, OpTimings, TrainingState
from torchtop.model.energy import NOT_SUPPORTED
from torchtop.model.job import agent_cost_summary
from torchtop.model.oom_advice import verdict_text
from torchtop.model.ops import op_avg_s
from torchtop.model.training import LoaderState
from torchtop.protocol import (
    MEASURED_BY_TICKS,
    MemorySnapshotTaken,
    Message,
    OpStat,
    OutOfMemory,
)
from torchtop.sizes import format_bytes


def fold(messages: Iterable[Message]) -> JobModel:
    """The model of a recording at its end."""
    model = JobModel(mode="replay")
    for message in messages:
        model.apply(message)
    return model


def summarize(messages: Iterable[Message]) -> dict[str, Any]:
    """The report's JSON object (keys documented in the README)."""
    return report_json(fold(messages))


def report_json(model: JobModel) -> dict[str, Any]:
    """The model rendered as the report's JSON object."""
    start = model.start
    duration = model.duration
    names = {d.id: d.name for d in model.devices}
    devices = [
        {
            "id": d.device,
            "name": names.get(d.device, d.device),
            "source": d.latest.source,
            "peak_allocated_bytes": d.peak_allocated,
            "peak_reserved_bytes": d.peak_reserved,
            "num_ooms": model.device_ooms(d.device),
            "num_alloc_retries": d.num_alloc_retries,
        }
        for d in model.memory.values()
    ]
    training = model.training
    phases = [
        {
            "name": p.name,
            "start_s": p.start - start if start is not None else 0.0,
            "duration_s": p.duration,
            "complete": p.end is not None,
            "samples": p.samples,
            "peak_allocated_bytes": p.peak_allocated,
            "peak_reserved_bytes": p.peak_reserved,
            "peak_rss_bytes": p.peak_rss,
            "steps": training.steps_between(p.start, p.end),
            "median_step_time_s": _r(training.step_time(0.5, p.start, p.end)),
            "energy": energy_json(model, p.start, p.end),
        }
        for p in model.phases
        if p.start is not None  # ended, but began before the recording
    ]
    hello = model.hello
    exit_ = model.exit
    return {
        "torchtop_version": __version__,
        "job": {
            "argv": hello.argv if hello else None,
            "pid": hello.pid if hello else None,
            "python": hello.python if hello else None,
            "torch": hello.torch if hello else None,
        },
        "duration_s": round(duration, 3),
        "samples": model.samples,
        "samples_per_s": round(model.samples / duration, 2) if duration > 0 else None,
        "dropped": model.dropped,
        "exit_code": exit_.exit_code if exit_ is not None else None,
        "exit_reason": exit_.reason if exit_ is not None else "no exit recorded",
        "phases": phases,
        "devices": devices,
        # What held each device's memory at the last sample (devices with an optimizer seen).
        "memory": {
            "by_category": {
                d.device: split
                for d in model.memory.values()
                if (split := d.by_category) is not None
            },
            "top_modules": [
                {"path": m.path, "bytes": m.bytes, "share": m.share}
                for m in model.top_modules or ()
            ],
        },
        "host": {"peak_rss_bytes": model.peak_rss},
        "gpus": [
            {"index": i, "peak_util_percent": u} for i, u in sorted(model.gpu_peak_util.items())
        ],
        "energy": energy_json(model),
        "probes_unavailable": {name: status.detail for name, status in model.probes.items()},
        "log_lines": model.log_total,
        "events": [_capture_json(entry, start) for entry in model.captures.entries],
        **_training_json(training),
        **_ops_json(model.op_timings, start),
        "findings": [f.to_json(start) for f in model.advice.all_findings],
        "agent_cost": agent_cost_summary(model),
    }


def energy_json(
    model: JobModel, start: float | None = None, end: float | None = None
) -> dict[str, Any]:
    """Per GPU the job used: joules from its first reading to its last (in ``[start, end]``,
    a phase's, when given), mean power, and joules per step over the steps between them; a GPU
    without the counter says so."""
    out: dict[str, Any] = {}
    for entry in model.energy.values():
        if entry.supported is False:
            out[entry.name] = {"supported": False, "detail": NOT_SUPPORTED}
            continue
        span = entry.span(model.training, start, end)
        per_step = span.per_step if span is not None else None
        power = span.mean_power_w if span is not None else None
        whole = start is None and end is None
        joules = entry.joules if whole else span.joules if span is not None else None
        out[entry.name] = {
            "supported": True,
            "joules": round(joules, 3) if joules is not None else None,
            "steps": span.steps if span is not None else None,
            "joules_per_step": round(per_step, 4) if per_step is not None else None,
            "mean_power_w": round(power, 2) if power is not None else None,
        }
    return out


def _r(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)


def _training_json(training: TrainingState) -> dict[str, Any]:
    run = training.run
    return {
        "steps": training.total,
        "skipped_steps": training.skipped_total,
        "step_time_s": {
            "median": _r(training.step_time(0.5)),
            "p90": _r(training.step_time(0.9)),
            "mean": _r(run.mean_step_s),
        },
        "throughput": {
            "steps_per_s": round(run.steps_per_s, 3) if run.steps_per_s is not None else None,
            "samples_per_s": (
                round(run.samples_per_s, 2) if run.samples_per_s is not None else None
            ),
        },
        "dataloader": {
            "wait_s": _r(run.wait_s),
            "wait_fraction": (
                round(run.wait_fraction, 4) if run.wait_fraction is not None else None
            ),
            "first_batch_s": _r(training.first_batch_s),
            "optimizer_s": _r(run.optimizer_s),
            "loaders": [_loader_json(x) for x in training.loader_list],
        },
    }


def _loader_json(state: LoaderState) -> dict[str, Any]:
    x = state.stats
    return {
        "index": x.index,
        "name": x.name,
        "dataset": x.dataset,
        "batch_size": x.batch_size,
        "num_workers": x.num_workers,
        "pin_memory": x.pin_memory,
        "prefetch_factor": x.prefetch_factor,
        "persistent_workers": x.persistent_workers,
        "start_method": x.start_method,
        "batches": x.batches,
        "samples": x.samples,
        "epochs": x.epochs,
        "wait_s": _r(x.wait_s),
        "first_batch_s": _r(x.first_batch_s),
        "workers_seen": state.workers_seen,
        "peak_workers_rss_bytes": state.peak_workers_rss or None,
        #: The workers' private memory summed (USS, read from outside on the job's host).
        "peak_workers_uss_bytes": state.peak_workers_uss or None,
        "dataset_storage": x.dataset_storage,
        "dataset_holds": x.dataset_detail,
    }


def _op_json(op: OpStat) -> dict[str, Any]:
    return {
        "name": op.name,
        "calls": op.calls,
        "self_cpu_s": op.self_cpu_s,
        "self_device_s": op.self_device_s,
        "total_cpu_s": op.total_cpu_s,
        "total_device_s": op.total_device_s,
        "avg_s": op_avg_s(op),
        "shapes": op.shapes,
        "site": op.site,
    }


def _ops_json(ops: OpTimings, start: float | None) -> dict[str, Any]:
    origin = start or 0.0
    latest = ops.latest
    return {
        "ops": [_op_json(op) for op in latest.cumulative] if latest else [],
        "profile_windows": ops.windows,
        "profiled_steps": ops.profiled_steps,
        # A sync point waits for a device: on a CPU job there is none to wait for.
        "sync_points_per_step": ops.sync_points_per_step,
        "host_reads_per_step": ops.host_reads_per_step,
        "copies_per_step": ops.copies_per_step,
        "trace_path": ops.last_trace,
        "requested_traces": list(ops.requested_traces),
        "ops_unavailable": [
            {
                "start_s": round(p.start - origin, 3),
                "end_s": round(p.end - origin, 3) if p.end is not None else None,
                "reason": p.reason,
            }
            for p in ops.unavailable
        ],
    }


def _frame(f: Any) -> str:
    return f"{f.file}:{f.line} {f.function}"


def _capture_json(entry: CaptureEntry, start: float | None) -> dict[str, Any]:
    capture = entry.capture
    item: dict[str, Any] = {
        "kind": "oom" if isinstance(capture, OutOfMemory) else "memory_snapshot",
        "t_s": round(capture.t - start, 3) if start is not None else None,
        "id": capture.id,
        "device": capture.device,
        "phase": entry.phase,
        "requested_bytes": capture.requested_bytes,
        "free_bytes": capture.free_bytes,
        "total_bytes": capture.total_bytes,
        "reserved_bytes": capture.reserved_bytes,
        "allocated_bytes": capture.allocated_bytes,
        "largest_free_block_bytes": capture.largest_free_block_bytes,
        "fragmented": capture.fragmented,
        "verdict": verdict_text(capture),
        "by_category": {c.category: c.bytes for c in capture.by_category},
        "emulated": capture.emulated,
        "grad_enabled": capture.grad_enabled,
        "live_count": capture.live_count,
        "top_sites": [
            {
                "file": s.file,
                "line": s.line,
                "function": s.function,
                "bytes": s.bytes,
                "count": s.count,
                "stack": [_frame(f) for f in s.stack],
            }
            for s in capture.top_sites
        ],
        "requested_at": [_frame(f) for f in capture.requested_stack],
        "snapshot_path": capture.snapshot_path,
        "snapshot_error": capture.snapshot_error,
        "suggestions": [
            {"id": s.id, "title": s.title, "evidence": s.evidence, "demo": s.demo_command}
            for s in entry.suggestions
        ],
    }
    if isinstance(capture, OutOfMemory):
        item["message"] = capture.message
        item["paused"] = capture.paused
    elif isinstance(capture, MemorySnapshotTaken):
        item["request_id"] = capture.request_id
    if entry.resumed is not None:
        item["resumed"] = entry.resumed
    return item


# -- text ----------------------------------------------------------------------------------------


def render_text(report: dict[str, Any]) -> Any:
    """A rich renderable of the report (imports rich; the JSON path never does)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    job = report["job"]
    head = Text()
    head.append("torchtop report", style="bold")
    if job["argv"]:
        head.append(f"  {' '.join(job['argv'])}  (pid {job['pid']})")
    code = report["exit_code"]
    head.append(
        f"\n{report['duration_s']:.1f} s · {report['samples']} samples"
        f" · {report['dropped']} dropped · {report['exit_reason']}",
        style="green" if code == 0 else "red" if code else "yellow",
    )
    recording = report.get("recording") or {}
    if recording.get("truncated"):
        head.append(
            f"\nthe recording is cut: it ends mid-frame at byte {recording['end_byte']:,}, "
            f"{report['duration_s']:.1f} s into the job (its writer stopped); "
            "this report covers the job up to there",
            style="yellow",
        )
    devices = Table(title="memory", title_justify="left")
    for col in ("device", "kind", "peak allocated", "peak reserved", "OOMs", "retries"):
        devices.add_column(col, justify="right" if col not in ("device", "kind") else "left")
    for d in report["devices"]:
        kind = {"cpu-heap": "heap / RSS", "cpu-rss": "RSS / RSS"}.get(d["source"], "allocator")
        add_text_row(
            devices,
            f"{d['id']} {d['name']}",
            kind,
            format_bytes(d["peak_allocated_bytes"]),
            format_bytes(d["peak_reserved_bytes"]),
            str(d["num_ooms"] if d["num_ooms"] is not None else "-"),
            str(d["num_alloc_retries"] if d["num_alloc_retries"] is not None else "-"),
        )
    parts: list[Any] = [head, devices]
    parts.append(Text(f"host peak RSS {format_bytes(report['host']['peak_rss_bytes'])}"))
    for name, energy in report.get("energy", {}).items():
        parts.append(Text(f"{name} energy: {energy_text(energy)}"))
    if report["phases"]:
        phases = Table(title="phases", title_justify="left")
        for col in ("phase", "start", "duration", "peak allocated", "peak RSS"):
            phases.add_column(col, justify="left" if col == "phase" else "right")
        for p in report["phases"]:
            duration = f"{p['duration_s']:.2f} s" if p["duration_s"] is not None else "unfinished"
            add_text_row(
                phases,
                p["name"],
                f"{p['start_s']:.2f} s",
                duration,
                format_bytes(p["peak_allocated_bytes"]),
                format_bytes(p["peak_rss_bytes"]),
            )
        parts.append(phases)
    parts.extend(training_parts(report))
    parts.extend(ops_parts(report))
    parts.extend(capture_parts(report.get("events", [])))
    parts.extend(finding_parts(report.get("findings", [])))
    cost = report.get("agent_cost")
    if cost:
        parts.append(Text(agent_cost_line(cost), style="dim"))
    for probe, detail in report["probes_unavailable"].items():
        if probe != "ops":  # given with its time span above
            parts.append(Text(f"{probe}: {detail}", style="dim"))
    return Group(*parts)


def energy_text(energy: dict[str, Any]) -> str:
    """``1234.5 J, 41.20 J/step over 30 steps, mean 612 W``, or why there is none."""
    if not energy["supported"]:
        return str(energy["detail"])
    if energy["joules"] is None:
        return "no reading yet"
    text = f"{energy['joules']:.1f} J"
    if energy["joules_per_step"] is not None:
        text += f", {energy['joules_per_step']:.2f} J/step over {energy['steps']} steps"
    if energy["mean_power_w"] is not None:
        text += f", mean {energy['mean_power_w']:.0f} W"
    return text


def agent_cost_line(cost: dict[str, Any]) -> str:
    """``torchtop's agent: 0.4% of step time (mean), 1.2 s of CPU (0.3% of a core); budget 1%``."""
    parts = []
    if cost.get("measured_step_share") is not None:
        measured = max(0.0, cost["measured_step_share"])
        if cost.get("measured_by") == MEASURED_BY_TICKS:
            how = f"on {cost.get('measured_steps')} steps its ticks overlapped"
        else:
            how = f"over {cost['measured_pairs']} pauses"
        if cost.get("windows_share") is not None:
            how += f" (its op windows {max(0.0, cost['windows_share']):.1%} of it)"
        parts.append(f"{measured:.1%} of step time measured {how}")
    if cost.get("mean_step_share") is not None:
        mean = f"{cost['mean_step_share']:.1%} of step time (mean"
        if cost.get("hooks_step_share") is not None:
            mean += f"; its hooks in the training thread {cost['hooks_step_share']:.1%}"
        parts.append(mean + ")")
    cpu = f"{cost['cpu_s']:.2f} s of CPU"
    if cost.get("core_share") is not None:
        cpu += f" ({cost['core_share']:.1%} of a core)"
    parts.append(cpu)
    line = "torchtop's agent: " + ", ".join(parts)
    if cost.get("budget"):
        line += f"; budget {cost['budget']:.1%} of step time"
    return line


def add_text_row(table: Any, *cells: Any) -> None:
    """A row of ``table`` whose cells are plain text: a phase or loader named ``[/bogus]`` or
    ``[warmup] epoch 1`` is shown as it is, never read as Rich markup. A cell already a
    ``Text`` (styled, or cut to fit) is kept as it is."""
    from rich.text import Text

    table.add_row(*(cell if isinstance(cell, Text) else Text(cell) for cell in cells))


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"


def training_parts(report: dict[str, Any]) -> list[Any]:
    """The report's steps and loaders as rich renderables (empty when the job took no steps)."""
    if not report.get("steps"):
        return []
    from rich.table import Table
    from rich.text import Text

    step_time = report["step_time_s"]
    throughput = report["throughput"]
    data = report["dataloader"]
    line = Text()
    line.append(f"steps {report['steps']}", style="bold")
    if report["skipped_steps"]:
        line.append(f" ({report['skipped_steps']} skipped by the GradScaler)")
    line.append(f" · step median {_ms(step_time['median'])}, p90 {_ms(step_time['p90'])}")
    if throughput["samples_per_s"] is not None:
        line.append(f" · {throughput['samples_per_s']:.1f} samples/s")
    if data["wait_fraction"] is not None:
        line.append(f" · data wait {data['wait_fraction']:.0%} of step time")
    parts: list[Any] = [line]
    if data["loaders"]:
        table = Table(title="data loaders", title_justify="left")
        for col in ("loader", "dataset", "batch", "workers", "batches", "wait", "first batch"):
            table.add_column(col, justify="left" if col in ("loader", "dataset") else "right")
        for x in data["loaders"]:
            workers = str(x["num_workers"])
            if x["start_method"]:
                workers += f" {x['start_method']}"
            if x.get("peak_workers_uss_bytes"):
                workers += f" · peak private {format_bytes(x['peak_workers_uss_bytes'])}"
            add_text_row(
                table,
                x["name"],
                x["dataset"],
                str(x["batch_size"] if x["batch_size"] is not None else "-"),
                workers,
                str(x["batches"]),
                f"{x['wait_s']:.2f} s",
                f"{x['first_batch_s']:.2f} s",
            )
        parts.append(table)
    return parts


def ops_parts(report: dict[str, Any]) -> list[Any]:
    """The report's op table as rich renderables (empty when no window was taken)."""
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = []
    for period in report.get("ops_unavailable", []):
        end = f"{period['end_s']:.1f} s" if period["end_s"] is not None else "the end"
        parts.append(
            Text(f"{period['reason']} (from {period['start_s']:.1f} s to {end})", style="yellow")
        )
    if not report.get("profile_windows"):
        return parts
    line = Text()
    line.append(f"op timings from {report['profile_windows']} profiler windows", style="bold")
    line.append(f" ({report['profiled_steps']} steps)")
    sync = report["sync_points_per_step"]
    copies = report["copies_per_step"]
    reads = report.get("host_reads_per_step")
    if sync is not None:
        line.append(f" · {sync:g} sync points per step")
    elif report["profiled_steps"]:
        line.append(" · sync points n/a (CPU only)")
    if reads:
        line.append(f" · {reads:g} host reads of CPU tensors per step")
    if copies is not None:
        line.append(f" · {copies:g} host-device copies per step")
    if report["trace_path"]:
        line.append(f"\nChrome trace of the last window: {report['trace_path']}", style="dim")
    table = Table(title="top ops by self time", title_justify="left")
    device = any(op["self_device_s"] is not None for op in report["ops"])
    columns = ["op", "calls", "self CPU", "total CPU", "avg"] + (["self device"] if device else [])
    table.add_column("op", justify="left")
    for col in columns[1:]:
        table.add_column(col, justify="right", no_wrap=True)
    for op in report["ops"][:15]:
        row: list[Any] = [
            # Narrowed to the room the figures leave, and cut there with an ellipsis: wrapped,
            # a long name made a row of empty cells.
            Text(op["name"], no_wrap=True, overflow="ellipsis"),
            str(op["calls"]),
            _us(op["self_cpu_s"]),
            _us(op["total_cpu_s"]),
            _us(op["avg_s"]),
        ]
        if device:
            row.append(_us(op["self_device_s"]))
        add_text_row(table, *row)
    return [*parts, line, table]


def _us(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 0.1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-4:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} µs"


def capture_parts(events: list[dict[str, Any]]) -> list[Any]:
    """The text report's lines for each failure and snapshot (imports rich; JSON never does)."""
    from rich.text import Text

    parts: list[Any] = []
    for event in events:
        text = Text()
        if event["kind"] == "oom":
            text.append("out of memory", "bold red")
        else:
            text.append("memory snapshot", "bold cyan")
        device = event["device"] + (" (emulated)" if event["emulated"] else "")
        text.append(f" on {device} at {event['t_s']} s")
        if event.get("phase"):
            text.append(f" in phase {event['phase']}")
        text.append(f"\n  {event['verdict']}")
        for site in event["top_sites"][:3]:
            where = f"{site['function']} ({site['file'].rsplit('/', 1)[-1]}:{site['line']})"
            text.append(
                f"\n  {format_bytes(site['bytes']):>10}  {site['count']:>4} live  {where}", "dim"
            )
        for suggestion in event["suggestions"]:
            text.append(f"\n  try: {suggestion['title']}  ({suggestion['demo']})", "green")
        where = event["snapshot_path"] or event["snapshot_error"] or "no snapshot"
        text.append(f"\n  snapshot: {where}", "dim")
        parts.append(text)
    return parts


SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


def finding_parts(findings: list[dict[str, Any]]) -> list[Any]:
    """The text report's advice: each finding with its evidence, window, fix and demo."""
    from rich.text import Text

    if not findings:
        return [Text("advice: no findings", style="dim")]
    parts: list[Any] = [Text("advice", style="bold")]
    for f in findings:
        text = Text()
        text.append(f"{f['severity']:<8}", SEVERITY_STYLE.get(f["severity"], ""))
        text.append(f" {f['title']}")
        if f["rank"] is not None:
            text.append(f" (rank {f['rank']})")
        until = "still true at the end" if f["active"] else f"until {f['last_s']:.1f} s"
        periods = f.get("periods_s") or [[f["first_s"], f["last_s"]]]
        # Held more than once (it cleared and came back): the earlier stretches, then the last.
        held = ", ".join(f"{a:.1f}-{b:.1f} s" for a, b in periods[:-1])
        held = f"held {held}; " if held else ""
        text.append(f"\n  {held}from {periods[-1][0]:.1f} s, {until}", "dim")
        start, end = f["window_s"]
        text.append(f"\n  evidence ({start:.1f}-{end:.1f} s): {f['summary']}")
        text.append(f"\n  fix: {f['fix']}", "green")
        if f["code"]:
            for line in f["code"].splitlines():
                text.append(f"\n      {line}", "green")
        if f.get("demo_command"):
            text.append(f"\n  see: {f['demo_command']}", "dim")
        parts.append(text)
    return parts

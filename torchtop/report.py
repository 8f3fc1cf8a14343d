"""``torchtop report``: a summary of a recording, as JSON or as a table. Standard library only.

Peaks are taken over the samples (10 per second by default). On CUDA the allocator's own peak
counters are exact for the whole run; per-phase peaks are the largest sampled values inside the
phase, since the agent never resets the job's peak counters.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torchtop.oom_report import CaptureCollector, capture_parts
from torchtop.ops_summary import OpsCollector, ops_parts
from torchtop.protocol import (
    Dropped,
    GpuSample,
    Hello,
    JobExited,
    LoaderInfo,
    LogLine,
    Message,
    PhaseBegan,
    PhaseEnded,
    ProbeStatus,
    Sample,
    StepStats,
)
from torchtop.sizes import format_bytes
from torchtop.steps_summary import TrainingSummary, training_parts


def _max(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


@dataclass
class _DevicePeaks:
    id: str
    source: str = ""
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    num_ooms: int | None = None
    num_alloc_retries: int | None = None


@dataclass
class _Phase:
    id: int
    name: str
    start: float
    end: float | None = None
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    peak_rss: int | None = None
    samples: int = 0


@dataclass
class _Summary:
    hello: Hello | None = None
    first_t: float | None = None
    last_t: float | None = None
    samples: int = 0
    gpu_samples: int = 0
    dropped: int = 0
    exit: JobExited | None = None
    devices: dict[str, _DevicePeaks] = field(default_factory=dict)
    peak_rss: int | None = None
    phases: list[_Phase] = field(default_factory=list)
    open_phases: dict[int, _Phase] = field(default_factory=dict)
    probes: dict[str, str] = field(default_factory=dict)
    log_lines: int = 0
    gpu_peak_util: dict[int, float] = field(default_factory=dict)
    training: TrainingSummary = field(default_factory=TrainingSummary)
    #: Out-of-memory failures and snapshots, with their evidence (``events``).
    captures: CaptureCollector = field(default_factory=CaptureCollector)
    #: Op-timing windows, and when they were unavailable.
    ops: OpsCollector = field(default_factory=OpsCollector)


def summarize(messages: Iterable[Message]) -> dict[str, Any]:
    """The report's JSON object (keys documented in the README)."""
    s = _Summary()
    for message in messages:
        t = getattr(message, "t", None)
        if isinstance(t, float):
            s.first_t = t if s.first_t is None else min(s.first_t, t)
            s.last_t = t if s.last_t is None else max(s.last_t, t)
        s.captures.observe(message)
        s.ops.add(message)
        if isinstance(message, Hello):
            s.hello = message
        elif isinstance(message, Sample):
            _add_sample(s, message)
        elif isinstance(message, GpuSample):
            s.gpu_samples += 1
            for gpu in message.gpus:
                if gpu.util_gpu_percent is not None:
                    s.gpu_peak_util[gpu.index] = max(
                        s.gpu_peak_util.get(gpu.index, 0.0), gpu.util_gpu_percent
                    )
        elif isinstance(message, Dropped):
            s.dropped = max(s.dropped, message.count)
        elif isinstance(message, JobExited):
            s.exit = message
        elif isinstance(message, PhaseBegan):
            phase = _Phase(id=message.id, name=message.name, start=message.t)
            s.phases.append(phase)
            s.open_phases[message.id] = phase
        elif isinstance(message, PhaseEnded):
            began = s.open_phases.pop(message.id, None)
            if began is not None:
                began.end = message.t
        elif isinstance(message, ProbeStatus):
            s.probes[message.probe] = message.detail
        elif isinstance(message, LogLine):
            s.log_lines += 1
        elif isinstance(message, (StepStats, LoaderInfo)):
            s.training.add(message)
    return _to_json(s)


def _add_sample(s: _Summary, sample: Sample) -> None:
    s.samples += 1
    rss = sample.host.rss_bytes if sample.host is not None else None
    s.peak_rss = _max(s.peak_rss, rss)
    for mem in sample.memory:
        peaks = s.devices.setdefault(mem.device, _DevicePeaks(id=mem.device))
        peaks.source = mem.source
        peaks.peak_allocated = _max(
            peaks.peak_allocated, _max(mem.allocated_bytes, mem.peak_allocated_bytes)
        )
        peaks.peak_reserved = _max(
            peaks.peak_reserved, _max(mem.reserved_bytes, mem.peak_reserved_bytes)
        )
        peaks.num_ooms = _max(peaks.num_ooms, mem.num_ooms)
        peaks.num_alloc_retries = _max(peaks.num_alloc_retries, mem.num_alloc_retries)
    primary = _primary(sample)
    for phase in s.open_phases.values():
        phase.samples += 1
        phase.peak_rss = _max(phase.peak_rss, rss)
        if primary is not None:
            phase.peak_allocated = _max(phase.peak_allocated, primary.allocated_bytes)
            phase.peak_reserved = _max(phase.peak_reserved, primary.reserved_bytes)


def _primary(sample: Sample) -> Any:
    for mem in sample.memory:
        if mem.device.startswith("cuda"):
            return mem
    return sample.memory[0] if sample.memory else None


def _to_json(s: _Summary) -> dict[str, Any]:
    start = s.hello.started_at if s.hello is not None else s.first_t
    end = s.exit.t if s.exit is not None else s.last_t
    duration = (end - start) if start is not None and end is not None else 0.0
    names = {d.id: d.name for d in s.hello.devices} if s.hello is not None else {}
    devices = [
        {
            "id": d.id,
            "name": names.get(d.id, d.id),
            "source": d.source,
            "peak_allocated_bytes": d.peak_allocated,
            "peak_reserved_bytes": d.peak_reserved,
            "num_ooms": d.num_ooms,
            "num_alloc_retries": d.num_alloc_retries,
        }
        for d in s.devices.values()
    ]
    phases = [
        {
            "name": p.name,
            "start_s": p.start - start if start is not None else 0.0,
            "duration_s": (p.end - p.start) if p.end is not None else None,
            "complete": p.end is not None,
            "samples": p.samples,
            "peak_allocated_bytes": p.peak_allocated,
            "peak_reserved_bytes": p.peak_reserved,
            "peak_rss_bytes": p.peak_rss,
            **s.training.phase(p.start, p.end),
        }
        for p in s.phases
    ]
    hello = s.hello
    return {
        "job": {
            "argv": hello.argv if hello else None,
            "pid": hello.pid if hello else None,
            "python": hello.python if hello else None,
            "torch": hello.torch if hello else None,
        },
        "duration_s": round(duration, 3),
        "samples": s.samples,
        "samples_per_s": round(s.samples / duration, 2) if duration > 0 else None,
        "dropped": s.dropped,
        "exit_code": s.exit.exit_code if s.exit is not None else None,
        "exit_reason": s.exit.reason if s.exit is not None else "no exit recorded",
        "phases": phases,
        "devices": devices,
        "host": {"peak_rss_bytes": s.peak_rss},
        "gpus": [{"index": i, "peak_util_percent": u} for i, u in sorted(s.gpu_peak_util.items())],
        "probes_unavailable": s.probes,
        "log_lines": s.log_lines,
        "events": s.captures.events(start),
        **s.training.to_json(),
        **s.ops.to_json(start),
    }


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
        devices.add_row(
            f"{d['id']} {d['name']}",
            kind,
            format_bytes(d["peak_allocated_bytes"]),
            format_bytes(d["peak_reserved_bytes"]),
            str(d["num_ooms"] if d["num_ooms"] is not None else "-"),
            str(d["num_alloc_retries"] if d["num_alloc_retries"] is not None else "-"),
        )
    parts: list[Any] = [head, devices]
    parts.append(Text(f"host peak RSS {format_bytes(report['host']['peak_rss_bytes'])}"))
    if report["phases"]:
        phases = Table(title="phases", title_justify="left")
        for col in ("phase", "start", "duration", "peak allocated", "peak RSS"):
            phases.add_column(col, justify="left" if col == "phase" else "right")
        for p in report["phases"]:
            duration = f"{p['duration_s']:.2f} s" if p["duration_s"] is not None else "unfinished"
            phases.add_row(
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
    for probe, detail in report["probes_unavailable"].items():
        if probe != "ops":  # given with its time span above
            parts.append(Text(f"{probe}: {detail}", style="dim"))
    return Group(*parts)

"""The report's op timings: the ops over every profiler window, sync points and copies per step,
the last window's Chrome trace, and when op timings were unavailable.

Standard library only; built from a recording's ``ops`` and ``probe_status`` frames. The keys
are documented in the README.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchtop.protocol import Message, OpStat, OpsWindow, ProbeStatus

PROBE = "ops"


def op_avg_s(op: OpStat) -> float:
    """Time per call: CPU time for an op, device time for a kernel or a copy."""
    total = op.total_cpu_s if op.total_cpu_s > 0 else (op.total_device_s or 0.0)
    return total / op.calls if op.calls else 0.0


def per_step(count: int, steps: int | None) -> float | None:
    """``count`` per step, ``None`` when the windows spanned no whole step."""
    return round(count / steps, 3) if steps else None


def op_json(op: OpStat) -> dict[str, Any]:
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


@dataclass
class OpsCollector:
    """Feed it every message with :meth:`add`; :meth:`to_json` gives the report's keys."""

    last: OpsWindow | None = None
    #: Some window recorded device activity: copies can be counted.
    device: bool = False
    trace_path: str | None = None
    requested_traces: list[str] = field(default_factory=list)
    unavailable: list[dict[str, Any]] = field(default_factory=list)
    _since: float | None = None
    _reason: str | None = None

    def add(self, message: Message) -> None:
        if isinstance(message, OpsWindow):
            self.last = message
            self.device = self.device or message.device
            if message.trace_path is not None:
                if message.requested:
                    self.requested_traces.append(message.trace_path)
                else:
                    self.trace_path = message.trace_path
        elif isinstance(message, ProbeStatus) and message.probe == PROBE:
            if not message.available and self._since is None:
                self._since, self._reason = message.t, message.detail
            elif message.available and self._since is not None:
                self._close(message.t)

    def _close(self, end: float | None) -> None:
        self.unavailable.append({"t": self._since, "end": end, "reason": self._reason})
        self._since = self._reason = None

    def to_json(self, start: float | None) -> dict[str, Any]:
        if self._since is not None:
            self._close(None)
        origin = start or 0.0
        periods = [
            {
                "start_s": round(p["t"] - origin, 3),
                "end_s": round(p["end"] - origin, 3) if p["end"] is not None else None,
                "reason": p["reason"],
            }
            for p in self.unavailable
        ]
        last = self.last
        trace = self.trace_path or (self.requested_traces[-1] if self.requested_traces else None)
        return {
            "ops": [op_json(op) for op in last.cumulative] if last else [],
            "profile_windows": last.window if last else 0,
            "profiled_steps": last.total_steps if last else 0,
            # A sync point waits for a device: on a CPU job there is none to wait for.
            "sync_points_per_step": per_step(last.total_sync_points, last.total_steps)
            if last and self.device
            else None,
            "host_reads_per_step": per_step(last.total_host_reads, last.total_steps)
            if last
            else None,
            # Without device activity (a CPU job) there is nothing to copy to or from.
            "copies_per_step": per_step(last.total_copies, last.total_steps)
            if last and self.device
            else None,
            "trace_path": trace,
            "requested_traces": list(self.requested_traces),
            "ops_unavailable": periods,
        }


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
    for col in columns:
        table.add_column(col, justify="left" if col == "op" else "right")
    for op in report["ops"][:15]:
        row = [
            op["name"],
            str(op["calls"]),
            _us(op["self_cpu_s"]),
            _us(op["total_cpu_s"]),
            _us(op["avg_s"]),
        ]
        if device:
            row.append(_us(op["self_device_s"]))
        table.add_row(*row)
    return [*parts, line, table]


def _us(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 0.1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-4:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} µs"

"""The ``oom`` (and ``memory_snapshot``) entries of ``torchtop report``'s ``events``.

Standard library only. :class:`CaptureCollector` watches a recording's messages as the report
reads them: it keeps the primary device's recent allocated memory, the phases and the step
ends, so that each failure gets its phase, its verdict and the suggestions of
:mod:`torchtop.model.oom_advice`, as the viewer's OOM screen shows them.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from torchtop.model.oom_advice import Evidence, phase_at, step_floors, suggest, verdict_text
from torchtop.protocol import (
    MemoryCapture,
    MemorySnapshotTaken,
    Message,
    OomResumed,
    OutOfMemory,
    PhaseBegan,
    PhaseEnded,
    Sample,
)

#: Samples of allocated memory kept for the step-over-step evidence (ten minutes at 10 Hz).
HISTORY_POINTS = 6000
#: Step ends kept.
STEP_ENDS = 5000


class CaptureCollector:
    """Feed it every message with :meth:`observe`; :meth:`events` gives the JSON entries."""

    def __init__(self) -> None:
        self._points: dict[str, deque[tuple[float, int | None]]] = {}
        self._phases: list[list[Any]] = []  # [name, start, end, id]
        self._open: dict[int, list[Any]] = {}
        self._step_ends: deque[float] = deque(maxlen=STEP_ENDS)
        self._entries: list[dict[str, Any]] = []
        self._by_id: dict[int, dict[str, Any]] = {}

    def observe(self, message: Message) -> None:
        if isinstance(message, Sample):
            for mem in message.memory:
                series = self._points.get(mem.device)
                if series is None:
                    series = self._points[mem.device] = deque(maxlen=HISTORY_POINTS)
                series.append((message.t, mem.allocated_bytes))
        elif isinstance(message, PhaseBegan):
            phase = [message.name, message.t, None, message.id]
            self._phases.append(phase)
            self._open[message.id] = phase
        elif isinstance(message, PhaseEnded):
            began = self._open.pop(message.id, None)
            if began is not None:
                began[2] = message.t
        elif isinstance(message, MemoryCapture):
            self._add(message)
        elif isinstance(message, OomResumed):
            entry = self._by_id.get(message.id)
            if entry is not None:
                entry["resumed"] = message.reason
        else:
            ends = getattr(message, "ends", None)  # ``steps`` frames carry their step ends
            if getattr(message, "KIND", "") == "steps" and isinstance(ends, list):
                self._step_ends.extend(e for e in ends if isinstance(e, float))

    def _add(self, capture: MemoryCapture) -> None:
        phase = phase_at(((p[0], p[1], p[2]) for p in self._phases), capture.t)
        points = self._points.get(capture.device, ())
        floors = step_floors(points, capture.t, self._step_ends)
        evidence = Evidence.of(capture, phase=phase, floors=floors)
        entry: dict[str, Any] = {
            "kind": "oom" if isinstance(capture, OutOfMemory) else "memory_snapshot",
            "t": capture.t,
            "id": capture.id,
            "device": capture.device,
            "phase": phase,
            "requested_bytes": capture.requested_bytes,
            "free_bytes": capture.free_bytes,
            "total_bytes": capture.total_bytes,
            "reserved_bytes": capture.reserved_bytes,
            "allocated_bytes": capture.allocated_bytes,
            "largest_free_block_bytes": capture.largest_free_block_bytes,
            "fragmented": capture.fragmented,
            "verdict": verdict_text(capture),
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
                    "stack": [f"{f.file}:{f.line} {f.function}" for f in s.stack],
                }
                for s in capture.top_sites
            ],
            "requested_at": [f"{f.file}:{f.line} {f.function}" for f in capture.requested_stack],
            "snapshot_path": capture.snapshot_path,
            "snapshot_error": capture.snapshot_error,
            "suggestions": [
                {"id": s.id, "title": s.title, "evidence": s.evidence, "demo": s.demo_command}
                for s in suggest(evidence)
            ],
        }
        if isinstance(capture, OutOfMemory):
            entry["message"] = capture.message
            entry["paused"] = capture.paused
        elif isinstance(capture, MemorySnapshotTaken):
            entry["request_id"] = capture.request_id
        self._entries.append(entry)
        self._by_id[capture.id] = entry

    def events(self, start: float | None) -> list[dict[str, Any]]:
        """The entries in order, each with ``t_s``: seconds since ``start`` (the job's)."""
        out = []
        for entry in self._entries:
            item = dict(entry)
            t = item.pop("t")
            item["t_s"] = round(t - start, 3) if start is not None else None
            out.append(item)
        return out


def capture_parts(events: list[dict[str, Any]]) -> list[Any]:
    """The text report's lines for each failure and snapshot (imports rich; JSON never does)."""
    from rich.text import Text

    from torchtop.model.oom_advice import size

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
            text.append(f"\n  {size(site['bytes']):>10}  {site['count']:>4} live  {where}", "dim")
        for suggestion in event["suggestions"]:
            text.append(f"\n  try: {suggestion['title']}  ({suggestion['demo']})", "green")
        where = event["snapshot_path"] or event["snapshot_error"] or "no snapshot"
        text.append(f"\n  snapshot: {where}", "dim")
        parts.append(text)
    return parts

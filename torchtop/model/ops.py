"""A job's op timings: its profiler windows, their traces, and when op timings were unavailable.

Pure Python, folded from ``ops`` and the ``ops`` probe's ``probe_status`` messages. Each window
carries its own table and the cumulative one over every window so far, so the latest window is
all a reader needs for totals; what is kept besides is bounded.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from torchtop.protocol import Message, OpStat, OpsWindow, ProbeStatus

#: The probe name under which the agent reports whether op timings run.
PROBE = "ops"
#: Traces of requested windows kept, and periods without op timings kept.
MAX_TRACES = 50
MAX_PERIODS = 100


def op_avg_s(op: OpStat) -> float:
    """Time per call: CPU time for an op, device time for a kernel or a copy."""
    total = op.total_cpu_s if op.total_cpu_s > 0 else (op.total_device_s or 0.0)
    return total / op.calls if op.calls else 0.0


def per_step(count: int, steps: int | None) -> float | None:
    """``count`` per step, ``None`` when the windows spanned no whole step."""
    return round(count / steps, 3) if steps else None


@dataclass(frozen=True)
class UnavailablePeriod:
    """A time op timings did not run, and why; ``end`` is ``None`` while it lasts."""

    start: float
    end: float | None
    reason: str


@dataclass
class OpTimings:
    """The op windows seen so far. Feed it every message with :meth:`apply`."""

    #: The latest window: its own ops and the cumulative ops over every window so far.
    latest: OpsWindow | None = None
    #: The latest window that measured its first step's activations by module.
    activations: OpsWindow | None = None
    #: Windows this model received (the agent may have taken some before it attached).
    received: int = 0
    #: Some window recorded device activity, so host-device copies can be counted.
    device: bool = False
    #: The latest sampled window's Chrome trace, and those of windows asked for.
    trace_path: str | None = None
    requested_traces: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_TRACES))
    closed_periods: deque[UnavailablePeriod] = field(
        default_factory=lambda: deque(maxlen=MAX_PERIODS)
    )
    _since: tuple[float, str] | None = None

    def apply(self, message: Message) -> bool:
        """Fold in an ``ops`` window or the ``ops`` probe's status; True if anything changed."""
        if isinstance(message, OpsWindow):
            if message == self.latest:
                return False
            self.latest = message
            if message.activations:
                self.activations = message
            self.received += 1
            self.device = self.device or message.device
            if message.trace_path is not None:
                if message.requested:
                    self.requested_traces.append(message.trace_path)
                else:
                    self.trace_path = message.trace_path
            return True
        if isinstance(message, ProbeStatus) and message.probe == PROBE:
            if not message.available and self._since is None:
                self._since = (message.t, message.detail)
                return True
            if message.available and self._since is not None:
                start, reason = self._since
                self.closed_periods.append(UnavailablePeriod(start, message.t, reason))
                self._since = None
                return True
        return False

    # -- queries -----------------------------------------------------------------------------

    @property
    def windows(self) -> int:
        """Windows the agent has taken so far (0 before the first arrives)."""
        return self.latest.window if self.latest is not None else 0

    @property
    def profiled_steps(self) -> int:
        return self.latest.total_steps if self.latest is not None else 0

    @property
    def unavailable(self) -> list[UnavailablePeriod]:
        """Every period without op timings, the one still open last."""
        periods = list(self.closed_periods)
        if self._since is not None:
            periods.append(UnavailablePeriod(self._since[0], None, self._since[1]))
        return periods

    @property
    def sync_points_per_step(self) -> float | None:
        """Waits for the device per profiled step; ``None`` on a CPU job (no device to wait
        for) or without a whole step profiled."""
        latest = self.latest
        if latest is None or not self.device:
            return None
        return per_step(latest.total_sync_points, latest.total_steps)

    @property
    def host_reads_per_step(self) -> float | None:
        """``.item()`` and the like on CPU tensors per profiled step (no device waited for)."""
        latest = self.latest
        return per_step(latest.total_host_reads, latest.total_steps) if latest else None

    @property
    def copies_per_step(self) -> float | None:
        """``None`` without device activity (a CPU job has nothing to copy to or from)."""
        latest = self.latest
        if latest is None or not self.device:
            return None
        return per_step(latest.total_copies, latest.total_steps)

    @property
    def last_trace(self) -> str | None:
        """The trace a reader should open: the latest sampled window's, else the latest asked."""
        return self.trace_path or (self.requested_traces[-1] if self.requested_traces else None)

    def top_ops(self, n: int | None = None, *, cumulative: bool = True) -> list[OpStat]:
        """The ops by self time (CPU, then device), largest first: over every window, or the
        latest window's own."""
        latest = self.latest
        if latest is None:
            return []
        ops = latest.cumulative if cumulative else latest.ops
        ranked = sorted(ops, key=lambda op: (op.self_cpu_s, op.self_device_s or 0.0), reverse=True)
        return ranked if n is None else ranked[:n]

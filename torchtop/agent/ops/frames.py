"""Closed windows into ``ops`` frames (sampler thread): their events read and ranked, the
run's cumulative table and totals, the Chrome trace, and what the window cost the job.

The training thread only hands over a :class:`Closed` window; everything here runs in the
sampler thread, under the sampler's lock.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtop.agent.ops.aggregation import OpKey, OpTotals, aggregate, merge, ranked
from torchtop.agent.ops.torch_events import _library_dirs, read_events, site_reader
from torchtop.private_files import written_privately
from torchtop.protocol import MatmulDtype, ModuleBytes, OpsWindow

#: What one profiled event costs the job until windows over steps have measured it: about
#: 2 µs on a CPU (measured on many tiny ops: 1.8 µs; on a small MLP: 1-4 µs).
EVENT_COST_S = 2e-6
#: How long a window's frame waits for a step after it to measure its cost (else: estimated).
MEASURE_WAIT_S = 2.0
#: Steps before a window whose median is the usual step time.
USUAL_STEPS = 64
#: Traces of requested windows kept (the last KEPT_TRACES).
KEPT_TRACES = 20


@dataclass(slots=True)
class Closed:
    """A window the training thread closed, waiting for the sampler thread."""

    result: Any
    began: float
    #: When the profiler began starting (``perf_counter``).
    opened_at: float
    wall_s: float
    start_cost_s: float
    stop_cost_s: float
    steps: int | None
    device: bool
    requested: bool
    #: The window recorded the ops' inputs (their dtypes).
    inputs: bool = False
    #: ``torch.get_num_threads()`` in the thread that opened it.
    torch_threads: int | None = None
    #: The first step's activation bytes in all, and by top module (path, bytes).
    activation_bytes: int = 0
    activations: list[tuple[str, int]] = field(default_factory=list)


@dataclass(slots=True)
class Measuring:
    """A window's frame, held until the steps after it tell what it cost the job."""

    frame: OpsWindow
    start: float
    done: float
    usual: float
    events: int
    start_cost_s: float
    stop_cost_s: float
    estimate: float
    deadline: float


def _dtype_list(counts: dict[str, int]) -> list[MatmulDtype]:
    return [MatmulDtype(d, n) for d, n in sorted(counts.items(), key=lambda item: -item[1])]


def usual_step(ends: deque[tuple[float, float]] | None, before: float) -> float | None:
    """The median duration of the latest steps that ended before ``before``."""
    if not ends:
        return None
    durations = [d for e, d in ends if e <= before][-USUAL_STEPS:]
    return statistics.median(durations) if durations else None


def excess(
    ends: deque[tuple[float, float]], start: float, done: float, usual: float
) -> float | None:
    """What the steps from ``start`` to the first that ended after ``done`` took beyond
    ``usual`` each; ``None`` until such a step has ended (or if the steps from ``start`` on are
    no longer all at hand)."""
    if not ends or ends[0][0] > start or ends[-1][0] <= done:
        return None
    last = next(e for e, _ in ends if e > done)
    return sum(max(0.0, d - usual) for e, d in ends if start < e <= last)


class FrameMaker:
    """Turns the windows the training thread closed into ``ops`` frames, and keeps the run's
    cumulative table and totals (sampler thread)."""

    def __init__(
        self, *, trace_dir: Path, trace_prefix: str, record_shapes: bool, with_stack: bool
    ) -> None:
        self.trace_dir = trace_dir
        self.trace_prefix = trace_prefix
        self.record_shapes = record_shapes
        self.with_stack = with_stack
        self.windows = 0
        #: Seconds spent reading closed windows so far, in the sampler thread (what the op
        #: windows' own budget, ``--ops-budget``, pays for; the agent's budget leaves it out).
        self.read_s = 0.0
        #: What one profiled event costs the job in seconds: learned from windows over steps
        #: (their slowdown per event), to price time-based windows, whose slowdown is unseen.
        self.event_costs: deque[float] = deque([EVENT_COST_S], maxlen=16)
        self._cumulative: dict[OpKey, OpTotals] = {}
        self._total_steps = 0
        self._total_duration = 0.0
        self._total_sync = 0
        self._total_host_reads = 0
        self._total_copies = 0
        self._total_matmuls: dict[str, int] = {}
        #: Some window recorded device activity: the tables keep their device columns.
        self._device_seen = False
        #: Traces of windows a viewer asked for, oldest first (at most KEPT_TRACES kept).
        self._kept_traces: deque[Path] = deque()
        self._site_of: Callable[[str], str | None] | None = None

    def make(
        self, closed: Closed, recent_steps: deque[float], spacing_s: float, cut_s: float = 0.0
    ) -> tuple[OpsWindow, float, int] | None:
        """The window's frame, what it cost the job as far as known now, and how many events
        it held. ``recent_steps`` are the latest steps' durations; ``spacing_s`` is the spacing
        the frame reports until its cost sets the next.

        ``None`` for a window not over steps that was cut short (it ran under ``cut_s``) before
        any op ran: say one that opened on a job's last bytecodes, which the exit then closed
        (the main thread may take a time window's opening call only as it leaves its loop).
        It says nothing of the job: no frame, no trace (``ops-last.json`` keeps the last
        window's), and it counts in no total."""
        t0 = time.perf_counter()
        events = read_events(
            closed.result,
            record_shapes=self.record_shapes,
            links=closed.device,
            python=self.with_stack,
            dtypes=closed.inputs,
        )
        if not events and closed.steps is None and closed.wall_s < cut_s:
            closed.result = None
            return None
        if self.with_stack and self._site_of is None:
            self._site_of = site_reader(_library_dirs())
        window = aggregate(events, site_of=self._site_of)
        self.windows += 1
        path = self.save_trace(closed)
        merge(self._cumulative, window.ops)
        steps = closed.steps
        self._total_duration += closed.wall_s
        if steps:  # per-step figures come from windows that spanned steps
            self._total_steps += steps
            self._total_sync += window.sync_points
            self._total_host_reads += window.host_reads
            self._total_copies += window.copies
        for dtype, calls in window.matmuls.items():
            self._total_matmuls[dtype] = self._total_matmuls.get(dtype, 0) + calls
        device = closed.device and window.device
        self._device_seen = self._device_seen or device
        ops, other = ranked(window.ops, device=device)
        cumulative, cumulative_other = ranked(self._cumulative, device=self._device_seen)
        # What the window cost the job: starting and stopping, the profiled steps' slowdown
        # against the recent median step, and our own reading (it holds the GIL). A window
        # with no steps to compare has its events priced instead: its length is no cost (the
        # job may have been waiting or setting up all along).
        if steps and recent_steps:
            slowdown = max(0.0, closed.wall_s - steps * statistics.median(recent_steps))
            if events:
                self.event_costs.append(slowdown / len(events))
        else:
            slowdown = len(events) * statistics.median(self.event_costs)
        read = time.perf_counter() - t0
        self.read_s += read
        cost = closed.start_cost_s + closed.stop_cost_s + slowdown + read
        frame = OpsWindow(
            t=time.time(),
            window=self.windows,
            began=closed.began,
            duration_s=closed.wall_s,
            steps=steps,
            cost_s=cost,
            spacing_s=spacing_s,
            device=device,
            sync_points=window.sync_points,
            copies=window.copies,
            ops=ops,
            total_steps=self._total_steps,
            total_duration_s=self._total_duration,
            total_sync_points=self._total_sync,
            total_copies=self._total_copies,
            cumulative=cumulative,
            other_self_cpu_s=other,
            cumulative_other_self_cpu_s=cumulative_other,
            trace_path=path,
            requested=closed.requested,
            record_shapes=self.record_shapes,
            with_stack=self.with_stack,
            host_reads=window.host_reads,
            total_host_reads=self._total_host_reads,
            matmuls=_dtype_list(window.matmuls),
            total_matmuls=_dtype_list(self._total_matmuls),
            torch_threads=closed.torch_threads,
            activation_bytes=closed.activation_bytes,
            activations=[ModuleBytes(path, nbytes) for path, nbytes in closed.activations],
        )
        closed.result = None  # kineto's events are freed here, inside what is measured
        return frame, cost, len(events)

    def save_trace(self, closed: Closed) -> str | None:
        """Write the window's Chrome trace: ``<prefix>ops-last.json`` (replaced each window),
        or ``<prefix>ops-<N>.json`` (kept) for a window a viewer asked for."""
        name = f"ops-{self.windows}.json" if closed.requested else "ops-last.json"
        target = self.trace_dir / f"{self.trace_prefix}{name}"
        if closed.requested:
            self._kept_traces.append(target)
            while len(self._kept_traces) > KEPT_TRACES:
                with contextlib.suppress(OSError):
                    self._kept_traces.popleft().unlink()
        try:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            with written_privately(target) as partial:  # 0600: traces name the job's files
                closed.result.save(str(partial))
        except Exception:
            return None
        return str(target)

"""The model of one job: current values, bounded time series and events, folded from messages.

Pure Python (standard library and the protocol only: no Textual, no Rich, no torch, no I/O), so
every rule about what a message means is unit tested without an app. A source (live, a
recording, a fake) delivers messages one by one to :meth:`JobModel.apply`; the viewer's widgets,
the report and the exporters read the model at any time. ``version`` goes up on every change, so
a reader redraws only when something changed. Time comes from the messages, never from the wall
clock, so a replay shows the times it recorded.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from torchtop.model.advice import Advisor
from torchtop.model.captures import MemoryCaptures
from torchtop.model.collectives import MAX_KEPT, CollectiveRecord
from torchtop.model.connection import (
    SourceConnected,
    SourceDisconnected,
    SourceSilent,
    SourceStatus,
)
from torchtop.model.energy import GpuEnergy, fold_gpu_energy
from torchtop.model.memory import DeviceMemory, MemoryPoint, ModuleMemory
from torchtop.model.oom_advice import Evidence, phase_at, step_floors
from torchtop.model.ops import OpTimings
from torchtop.model.training import DEFAULT_HISTORY_STEPS, DEFAULT_STEP_POINTS, TrainingState
from torchtop.protocol import (
    MEASURED_BY,
    AgentStats,
    CollectivesSeen,
    DeviceHolding,
    DeviceInfo,
    Dropped,
    GpuSample,
    GpuStats,
    Hello,
    HostStats,
    JobExited,
    LoaderInfo,
    LogLine,
    Marked,
    MemoryCapture,
    MemoryHolders,
    MemoryStats,
    Message,
    OomResumed,
    OpsWindow,
    PhaseBegan,
    PhaseEnded,
    ProbeStatus,
    Sample,
    StackSampled,
    StepStats,
)
from torchtop.text import printable, printable_message

#: Points kept per series: ten minutes at the agent's default 10 Hz.
DEFAULT_HISTORY_POINTS = 6000
#: Log lines kept for the log panel.
DEFAULT_LOG_LINES = 5000
#: Phases and marks kept (a script may open a phase per step).
DEFAULT_EVENTS = 2000

ConnectionState = Literal["connecting", "live", "disconnected", "ended"]


@dataclass
class Phase:
    """A labelled span of the job. ``start`` is ``None`` when it began before our history."""

    id: int
    name: str
    start: float | None
    end: float | None = None
    #: What the phase does and why, in a few sentences (``torchtop.phase(name, description)``).
    description: str | None = None
    #: The largest sampled values while it ran: the primary device's allocated and reserved
    #: memory (the job's peak counters are never reset, so these are sampled) and the RSS.
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    peak_rss: int | None = None
    #: Samples taken while it ran.
    samples: int = 0

    @property
    def duration(self) -> float | None:
        if self.start is None or self.end is None:
            return None
        return self.end - self.start

    @property
    def running(self) -> bool:
        return self.end is None


@dataclass(frozen=True)
class Mark:
    t: float
    name: str


@dataclass(frozen=True)
class LogEntry:
    """A line of the job's output as shown: after a progress bar's last ``\\r``."""

    t: float
    stream: str
    text: str


def _max(a: int | None, b: int | None) -> int | None:
    """The larger of two readings, either of which may be missing (called per sample: kept
    to two arguments and no allocation)."""
    if a is None:
        return b
    if b is None or a >= b:
        return a
    return b


def _primary_stats(memory: list[MemoryStats]) -> MemoryStats | None:
    """The sample's first CUDA device, else its first device: what phase peaks follow."""
    for stats in memory:
        if stats.device.startswith("cuda"):
            return stats
    return memory[0] if memory else None


def _device_order(device: str) -> tuple[int, int, str]:
    """CUDA devices first, by index; then anything else by name."""
    kind, _, index = device.partition(":")
    if kind == "cuda":
        return (0, int(index) if index.isdigit() else 0, device)
    return (1, 0, device)


def visible_text(text: str) -> str:
    """The text a terminal would show for a line that redraws itself with ``\\r``.

    A progress bar writes ``"10%\\r20%\\r30%"``; the reader saw ``"30%"``. A trailing ``\\r`` (or
    ``\\r\\n`` line ending) is not a redraw.
    """
    text = text.rstrip("\r\n")
    if "\r" in text:
        text = text.rsplit("\r", 1)[1]
    return text


@dataclass(frozen=True)
class JobIdentity:
    """Which job a model is: its host, its pid, and its rank in a multi-process run (``None``
    for a single process). Models of the ranks of one run are kept side by side by it."""

    host: str
    pid: int
    rank: int | None = None

    @classmethod
    def of(cls, hello: Hello) -> JobIdentity:
        return cls(hello.hostname, hello.pid, hello.rank)

    def __str__(self) -> str:
        where = f"{self.host}:{self.pid}" if self.host else str(self.pid)
        return where if self.rank is None else f"{where} rank {self.rank}"


@dataclass
class JobModel:
    """Everything known about one job, built only from messages.

    Bounded: series, logs, phases and marks keep their most recent items only; whole-run
    figures (peaks, totals, step percentiles) are kept as running values.
    """

    mode: str = "live"
    history_points: int = DEFAULT_HISTORY_POINTS
    log_lines: int = DEFAULT_LOG_LINES
    max_events: int = DEFAULT_EVENTS
    #: The steps' recent points and the run's sample of step times (see
    #: :class:`~torchtop.model.training.TrainingState`): a viewer keeps many; an exporter of a
    #: thousand ranks keeps few.
    step_points: int = DEFAULT_STEP_POINTS
    history_steps: int = DEFAULT_HISTORY_STEPS
    #: ``steps`` frames kept for the recent figures (:attr:`TrainingState.max_frames`).
    step_frames: int = DEFAULT_STEP_POINTS

    #: Goes up by one on every change; the app redraws when it differs from what it drew.
    version: int = 0
    hello: Hello | None = None
    #: The latest time any message carried; ``None`` before the first.
    now: float | None = None
    #: The earliest time any message carried.
    first_t: float | None = None

    #: Samples (``sample`` messages) and GPU readings folded.
    samples: int = 0
    gpu_samples: int = 0
    memory: dict[str, DeviceMemory] = field(default_factory=dict)
    #: The latest read of what holds each device's memory (``holders`` frames), by device.
    holders: dict[str, DeviceHolding] = field(default_factory=dict)
    host: HostStats | None = None
    peak_rss: int | None = None
    rss_series: deque[tuple[float, int | None]] = field(init=False)
    gpus: dict[int, GpuStats] = field(default_factory=dict)
    #: The latest NVML reading, in the agent's order: the job's GPUs first (matched to its CUDA
    #: devices by UUID), then the others; MIG instances after their GPU.
    gpu_rows: list[GpuStats] = field(default_factory=list)
    gpu_t: float | None = None
    #: Each GPU's highest utilization, in percent.
    gpu_peak_util: dict[int, float] = field(default_factory=dict)
    #: Each GPU's energy counter readings (:mod:`.energy`), by (MIG parent, index).
    energy: dict[tuple[int | None, int], GpuEnergy] = field(default_factory=dict)
    probes: dict[str, ProbeStatus] = field(default_factory=dict)

    phases: deque[Phase] = field(init=False)
    marks: deque[Mark] = field(init=False)
    logs: deque[LogEntry] = field(init=False)
    #: Every log line ever applied, including those the bounded deque has let go.
    log_total: int = 0

    dropped: int = 0
    job_ended: bool = False
    exit: JobExited | None = None
    exit_code: int | None = None
    exit_reason: str = ""
    connection: ConnectionState = "connecting"
    disconnect_reason: str = ""
    address: str = ""
    status_text: str = ""
    #: Seconds the connected agent has sent nothing, once the source calls it silent.
    silent_s: float | None = None
    #: Steps and DataLoaders (``steps`` and ``loaders`` messages).
    training: TrainingState = field(default_factory=TrainingState)
    #: Out-of-memory failures and snapshots (``oom``, ``memory_snapshot``, ``oom_resumed``).
    captures: MemoryCaptures = field(default_factory=MemoryCaptures)
    #: Op-timing windows (``ops``), their traces, and when op timings were unavailable.
    op_timings: OpTimings = field(default_factory=OpTimings)
    #: The advice rules' findings, evaluated as message time passes (:mod:`.advice`).
    advice: Advisor = field(default_factory=Advisor)
    #: The training thread's stack, as the agent last sent it because the steps had stopped.
    stack: StackSampled | None = None
    #: This rank's collectives as its flight recorder saw them (``collectives``), the newest
    #: :data:`~torchtop.model.collectives.MAX_KEPT`; the run model joins the ranks on them.
    collectives: deque[CollectiveRecord] = field(default_factory=lambda: deque(maxlen=MAX_KEPT))
    #: The agent's latest account of itself: its own cost, its budget, its clients.
    agent_stats: AgentStats | None = None
    #: The sum and count of the agent's step-time shares (one a second while the job steps),
    #: for its mean over the job.
    agent_step_share_sum: float = 0.0
    agent_step_share_count: int = 0
    #: The sum of the hooks' part of those shares; ``None`` from an agent that does not time
    #: its hooks.
    agent_hooks_share_sum: float | None = None

    _open_phases: dict[int, Phase] = field(default_factory=dict, init=False, repr=False)

    @property
    def top_modules(self) -> list[ModuleMemory] | None:
        """The modules that held the activations of the latest op window's first step, largest
        first (``None``: no window has measured them yet); the view of what holds memory and the
        report show them."""
        window = self.op_timings.activations
        if window is None or window.activation_bytes <= 0:
            return None
        return [
            ModuleMemory(printable(m.path), m.bytes, round(m.bytes / window.activation_bytes, 4))
            for m in window.activations
        ]

    def __post_init__(self) -> None:
        bounds = (self.step_points, self.history_steps, self.step_frames)
        if bounds != (DEFAULT_STEP_POINTS, DEFAULT_HISTORY_STEPS, DEFAULT_STEP_POINTS):
            self.training = TrainingState(
                max_points=self.step_points,
                history_steps=self.history_steps,
                max_frames=self.step_frames,
            )
        self.rss_series = deque(maxlen=self.history_points)
        self.phases = deque(maxlen=self.max_events)
        self.marks = deque(maxlen=self.max_events)
        self.logs = deque(maxlen=self.log_lines)

    # -- applying messages -----------------------------------------------------------------------

    def apply(self, message: Message) -> None:
        """Fold one message into the state. Kinds this viewer does not know are ignored.

        Every string the message carries is made :func:`~torchtop.text.printable` first: the
        model holds no control character that a reader could write to a terminal. A log line's
        redraws (``\\r``) are applied before its text is (see ``_apply``)."""
        if not isinstance(message, LogLine):
            message = printable_message(message)
        changed = self._apply(message)
        # At most once a second of message time: a replay finds what the live view found.
        if changed:
            self.advice.observe(self)
            self.version += 1

    def apply_all(self, messages: Iterable[Message]) -> None:
        for message in messages:
            self.apply(message)

    def _apply(self, message: Message) -> bool:
        t = getattr(message, "t", None)
        changed = self._advance_time(t) if isinstance(t, (float, int)) else False
        if isinstance(message, SourceSilent):
            if message.silent_s == self.silent_s:
                return changed
            self.silent_s = message.silent_s
            return True
        if self.silent_s is not None:  # anything else: the agent speaks again
            self.silent_s = None
            changed = True
        # The kinds of every tick first: this runs for every frame of a day-long job.
        if isinstance(message, Sample):
            return self._apply_sample(message) or changed
        if isinstance(message, (StepStats, LoaderInfo)):
            return self.training.apply(message) or changed
        if isinstance(message, GpuSample):
            self.gpus = {gpu.index: gpu for gpu in message.gpus if gpu.mig_parent is None}
            self.gpu_rows = list(message.gpus)
            self.gpu_t = message.t
            self.gpu_samples += 1
            fold_gpu_energy(self.energy, message.t, message.gpus)
            for gpu in message.gpus:
                # Peaks are the job's GPUs' (all of them while the agent cannot tell).
                if gpu.mig_parent is not None or gpu.in_job is False:
                    continue
                if gpu.util_gpu_percent is not None:
                    self.gpu_peak_util[gpu.index] = max(
                        self.gpu_peak_util.get(gpu.index, 0.0), gpu.util_gpu_percent
                    )
            return True
        if isinstance(message, Hello):
            return self._apply_hello(message) or changed
        if isinstance(message, ProbeStatus):
            self.op_timings.apply(message)
            if self.probes.get(message.probe) == message:
                return changed
            self.probes[message.probe] = message
            return True
        if isinstance(message, PhaseBegan):
            phase = Phase(message.id, message.name, message.t, description=message.description)
            self.phases.append(phase)
            self._open_phases[message.id] = phase
            if len(self._open_phases) > self.max_events:  # never ended: stop following it
                del self._open_phases[next(iter(self._open_phases))]
            return True
        if isinstance(message, PhaseEnded):
            return self._apply_phase_ended(message) or changed
        if isinstance(message, Marked):
            self.marks.append(Mark(message.t, message.name))
            return True
        if isinstance(message, LogLine):
            text = printable(visible_text(message.text))
            self.logs.append(LogEntry(message.t, printable(message.stream), text))
            self.log_total += 1
            return True
        if isinstance(message, Dropped):
            if message.count <= self.dropped:  # a count only grows; an older frame says less
                return changed
            self.dropped = message.count
            return True
        if isinstance(message, JobExited):
            return self._apply_exit(message) or changed
        if isinstance(message, MemoryCapture):
            return self.captures.apply(message, self.evidence_for(message)) or changed
        if isinstance(message, OomResumed):
            return self.captures.apply(message) or changed
        if isinstance(message, MemoryHolders):
            self.holders = {holding.device: holding for holding in message.devices}
            for name, device in self.memory.items():
                device.holding = self.holders.get(name)
            return True
        if isinstance(message, OpsWindow):
            return self.op_timings.apply(message) or changed
        if isinstance(message, StackSampled):
            self.stack = message
            return True
        if isinstance(message, CollectivesSeen):
            self.collectives.extend(CollectiveRecord.of(entry) for entry in message.entries)
            return bool(message.entries) or changed
        if isinstance(message, AgentStats):
            previous, self.agent_stats = self.agent_stats, message
            if message.step_share is not None:
                self.agent_step_share_sum += message.step_share
                self.agent_step_share_count += 1
                if message.hooks_share is not None:
                    self.agent_hooks_share_sum = (
                        self.agent_hooks_share_sum or 0.0
                    ) + message.hooks_share
            # Shown to a tenth of a percent: a change below that redraws nothing.
            return changed or previous is None or _cost_key(previous) != _cost_key(message)
        if isinstance(message, SourceConnected):
            before = (self.connection, self.address)
            if not self.job_ended:
                self.connection = "live"
                self.disconnect_reason = ""
            self.address = message.address
            return (self.connection, self.address) != before or changed
        if isinstance(message, SourceDisconnected):
            before_state = (self.connection, self.disconnect_reason)
            if self.job_ended:
                self.connection = "ended"
            else:
                self.connection = "disconnected"
                self.disconnect_reason = message.reason
            return (self.connection, self.disconnect_reason) != before_state or changed
        if isinstance(message, SourceStatus):
            if message.text == self.status_text:
                return changed
            self.status_text = message.text
            return True
        return changed

    def _advance_time(self, t: float) -> bool:
        changed = False
        if self.first_t is None or t < self.first_t:
            self.first_t = t
            changed = True
        if self.now is None or t > self.now:
            self.now = t
            changed = True
        return changed

    def _apply_hello(self, message: Hello) -> bool:
        changed = False
        if message != self.hello:
            self.hello = message
            changed = True
        if self.now is None:
            self.now = message.started_at
            changed = True
        if self.connection == "connecting" or (
            self.connection == "disconnected" and not self.job_ended
        ):
            # A hello means the agent is talking to us, whether or not the source said so.
            self.connection = "live"
            self.disconnect_reason = ""
            changed = True
        return changed

    def _apply_sample(self, message: Sample) -> bool:
        self.samples += 1
        rss = message.host.rss_bytes if message.host is not None else None
        if message.host is not None:
            self.host = message.host
            self.rss_series.append((message.t, rss))
            self.peak_rss = _max(self.peak_rss, rss)
        for stats in message.memory:
            device = self.memory.get(stats.device)
            if device is None:
                device = DeviceMemory(stats.device, stats, deque(maxlen=self.history_points))
                device.holding = self.holders.get(stats.device)
                self.memory[stats.device] = device
            device.latest = stats
            device.series.append(
                MemoryPoint(
                    message.t,
                    stats.allocated_bytes,
                    stats.reserved_bytes,
                    device.holding,
                    stats.inactive_split_bytes,
                )
            )
            device.peak_allocated = _max(
                _max(device.peak_allocated, stats.peak_allocated_bytes), stats.allocated_bytes
            )
            device.peak_reserved = _max(
                _max(device.peak_reserved, stats.peak_reserved_bytes), stats.reserved_bytes
            )
            device.num_ooms = _max(device.num_ooms, stats.num_ooms)
            device.num_alloc_retries = _max(device.num_alloc_retries, stats.num_alloc_retries)
        primary = _primary_stats(message.memory)
        for phase in self._open_phases.values():
            phase.samples += 1
            phase.peak_rss = _max(phase.peak_rss, rss)
            if primary is not None:
                phase.peak_allocated = _max(phase.peak_allocated, primary.allocated_bytes)
                phase.peak_reserved = _max(phase.peak_reserved, primary.reserved_bytes)
        return True

    def _apply_phase_ended(self, message: PhaseEnded) -> bool:
        phase = self._open_phases.pop(message.id, None)
        if phase is None:
            # It began before the history this viewer received.
            phase = Phase(message.id, message.name, None, message.t)
            self.phases.append(phase)
        else:
            phase.end = message.t
        return True

    def _apply_exit(self, message: JobExited) -> bool:
        before = (self.job_ended, self.exit_code, self.exit_reason, self.connection)
        self.job_ended = True
        self.exit = message
        self.exit_code = message.exit_code
        self.exit_reason = message.reason
        self.connection = "ended"
        return (self.job_ended, self.exit_code, self.exit_reason, self.connection) != before

    # -- derived values --------------------------------------------------------------------------

    @property
    def devices(self) -> list[DeviceInfo]:
        return list(self.hello.devices) if self.hello is not None else []

    @property
    def device_ids(self) -> list[str]:
        """Every device seen in the hello or in memory samples, CUDA first."""
        ids = {d.id for d in self.devices} | set(self.memory)
        return sorted(ids, key=_device_order)

    @property
    def used_devices(self) -> list[str]:
        """The devices the memory panel shows: the CUDA devices the job has held memory on,
        in index order, or the CPU when it has none. The hello lists every visible GPU; a job
        on ``cuda:3`` of an 8-GPU node (or a CPU job there) uses only some, or none."""
        used = [
            device
            for device in self.device_ids
            if device.startswith("cuda")
            and (memory := self.memory.get(device)) is not None
            and memory.in_use
        ]
        return used or ["cpu"]

    @property
    def primary_device(self) -> str:
        """The device whose figures and chart the memory panel shows: the first device in
        :attr:`used_devices`."""
        return self.used_devices[0]

    @property
    def primary_memory(self) -> DeviceMemory | None:
        return self.memory.get(self.primary_device)

    @property
    def nvml(self) -> ProbeStatus | None:
        """The NVML probe's latest status, whatever the agent named it ("nvml", "NVML …")."""
        for name, status in self.probes.items():
            if name.lower().startswith("nvml"):
                return status
        return None

    @property
    def ops(self) -> OpsWindow | None:
        """The latest op-timing window: its own table and the cumulative one."""
        return self.op_timings.latest

    @property
    def ops_received(self) -> int:
        """Op windows this model received (the agent may have taken some before it attached)."""
        return self.op_timings.received

    @property
    def ops_windows(self) -> int:
        """Op windows the agent has taken so far (0 before the first arrives)."""
        return self.op_timings.windows

    @property
    def ops_probe(self) -> ProbeStatus | None:
        """The op-timing probe's latest status; ``None`` until the agent says anything."""
        return self.probes.get("ops")

    @property
    def ops_unavailable(self) -> str | None:
        """Why there are no op timings now (off, or backed off); ``None`` while they run."""
        status = self.ops_probe
        if status is None or status.available:
            return None
        return status.detail or "op timings unavailable"

    @property
    def identity(self) -> JobIdentity | None:
        """Which job this is, once its hello arrived."""
        return JobIdentity.of(self.hello) if self.hello is not None else None

    @property
    def start(self) -> float | None:
        """When the job started (its hello), else the first time any message carried."""
        return self.hello.started_at if self.hello is not None else self.first_t

    @property
    def end(self) -> float | None:
        """When the job exited, else the latest time any message carried."""
        return self.exit.t if self.exit is not None else self.now

    @property
    def duration(self) -> float:
        """Seconds from :attr:`start` to :attr:`end` (0 before both are known)."""
        start, end = self.start, self.end
        return end - start if start is not None and end is not None else 0.0

    @property
    def uptime(self) -> float | None:
        if self.hello is None or self.now is None:
            return None
        return max(0.0, self.now - self.hello.started_at)

    @property
    def lost(self) -> bool:
        """The connection ended without the job's exit: it was killed, or the agent went away."""
        return self.connection == "disconnected"

    @property
    def status_label(self) -> str:
        """The connection in words: "connecting", "live", "ended (exit 0)", "lost: <reason>"."""
        if self.connection == "ended":
            return f"ended (exit {self.exit_code if self.exit_code is not None else '?'})"
        if self.connection == "disconnected":
            return f"lost: {self.disconnect_reason}" if self.disconnect_reason else "lost"
        return self.connection

    def phases_between(self, start: float, end: float) -> list[Phase]:
        """Phases that overlap ``[start, end]`` (a phase without a start overlaps the past)."""
        return [
            p
            for p in self.phases
            if (p.start is None or p.start <= end) and (p.end is None or p.end >= start)
        ]

    def marks_between(self, start: float, end: float) -> list[Mark]:
        return [m for m in self.marks if start <= m.t <= end]

    def device_ooms(self, device: str) -> int | None:
        """Out-of-memory failures on ``device`` that reached the job: the allocator's count
        (torch's own handled retries left out) or the failures captured, whichever is larger,
        as each can miss some; ``None`` when neither is known."""
        memory = self.memory.get(device)
        counted = memory.ooms if memory is not None else None
        captured = sum(1 for e in self.captures.entries if e.is_oom and e.capture.device == device)
        if counted is None and not captured:
            return None
        return max(counted or 0, captured)

    def phase_at(self, t: float) -> str | None:
        """The innermost phase running at ``t`` (the latest to begin), if any."""
        return phase_at(((p.name, p.start, p.end) for p in self.phases), t)

    def evidence_for(self, capture: MemoryCapture) -> Evidence:
        """What the advice rules need about ``capture``, from the job as it is now: the phase
        open at it, and its device's allocated memory at the low point of each step before it."""
        memory = self.memory.get(capture.device)
        points = [(p.t, p.allocated) for p in memory.series] if memory is not None else []
        ends = [p.t for p in self.training.points]
        floors = step_floors(points, capture.t, ends)
        return Evidence.of(capture, phase=self.phase_at(capture.t), floors=floors)

    @property
    def explained_phase(self) -> Phase | None:
        """The phase the side panel explains: the latest running phase with a description, else
        the described phase that ended last; ``None`` when no phase has a description (a
        normal training job), and the panel stays hidden."""
        ended: Phase | None = None
        for phase in reversed(self.phases):
            if not phase.description:
                continue
            if phase.running:
                return phase
            if ended is None or (phase.end or 0.0) > (ended.end or 0.0):
                ended = phase
        return ended


def capture_evidence(model: JobModel, capture: MemoryCapture) -> Evidence:
    """The evidence the model gathered for ``capture`` when it arrived."""
    for entry in model.captures.entries:
        if entry.capture == capture:
            return entry.evidence
    return model.evidence_for(capture)


def agent_cost_summary(model: JobModel) -> dict[str, float | str | None] | None:
    """The agent's cost over the job: its threads' CPU seconds, their share of one core over
    the job's time, the mean of its step-time shares, and its budget; ``None`` from an agent
    that did not measure itself."""
    stats = model.agent_stats
    if stats is None or stats.cpu_s is None:
        return None
    started = model.hello.started_at if model.hello is not None else None
    span = stats.t - started if started is not None else None
    count = model.agent_step_share_count
    return {
        "cpu_s": round(stats.cpu_s, 3),
        "core_share": round(stats.cpu_s / span, 5) if span else None,
        "mean_step_share": round(model.agent_step_share_sum / count, 5) if count else None,
        "budget": stats.cost_budget,
        "interval_s": stats.interval_s,
        "measured_step_share": stats.measured_step_share,
        "measured_pairs": stats.measured_pairs,
        # A recording's word is one of the two, or none.
        "measured_by": (
            stats.measured_by
            if stats.measured_step_share is not None and stats.measured_by in MEASURED_BY
            else None
        ),
        "measured_steps": stats.measured_steps,
        # The op windows' part of the measured share (null without op windows, or from an
        # agent that does not price them).
        "windows_share": stats.windows_share,
        # The hooks' part of the mean (null from an agent that does not time its hooks).
        "hooks_step_share": (
            round(model.agent_hooks_share_sum / count, 5)
            if count and model.agent_hooks_share_sum is not None
            else None
        ),
    }


def _cost_key(stats: AgentStats) -> tuple[object, ...]:
    def tenth(share: float | None) -> int | None:
        return None if share is None else round(share * 1000)

    return (
        tenth(stats.step_share),
        tenth(stats.cpu_share),
        stats.interval_s,
        tenth(stats.measured_step_share),
    )

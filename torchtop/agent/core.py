"""The agent: probes, sampler thread and socket server, started once per training process.

``start()`` is idempotent and returns in milliseconds. The agent lives in daemon threads, is
disabled in forked children (DataLoader workers must not run a copy of it), and on exit sends a
final ``exit`` message and removes its socket.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import platform
import signal
import socket
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from torchtop.agent.collectives import BUDGET_PART, FINAL_WAIT_S, CollectiveMonitor
from torchtop.agent.cost import (
    MAX_INTERVAL_S,
    CostMeter,
    Measured,
    PausedSteps,
    TickedSteps,
    windows_budget,
)
from torchtop.agent.identity import rank_identity
from torchtop.agent.oom import OomController
from torchtop.agent.ops import PROBE as OPS_PROBE
from torchtop.agent.ops import OpsSampler, quiet_kineto
from torchtop.agent.output import OutputCapture
from torchtop.agent.sampler import Sampler, SamplerStats, torch_imported
from torchtop.agent.server import ANSWERS, EVENTS, LOGS, OPS, SAMPLES, AgentServer, RingLimit
from torchtop.agent.stall import StallWatch
from torchtop.agent.steps import HOOK_S
from torchtop.agent.threads import agent_thread
from torchtop.agent.training import TrainingMonitor
from torchtop.protocol import (
    DEFAULT_INTERVAL_S,
    DEFAULT_OPS_BUDGET,
    MEASURED_BY_PAUSES,
    MEASURED_BY_TICKS,
    PACED_SAMPLE_S,
    PROTOCOL_VERSION,
    REQUEST_PROFILE,
    REQUEST_SNAPSHOT,
    AgentStats,
    CollectivesSeen,
    DeviceInfo,
    GpuSample,
    Hello,
    JobExited,
    LoaderInfo,
    LogLine,
    MemorySnapshotTaken,
    Message,
    OpsWindow,
    ProbeStatus,
    Request,
    Sample,
    StepStats,
    encode,
)
from torchtop.transport import bind_server, describe_agent, remove_server_files, runtime_dir

#: Bytes of history each ring keeps, whatever ``history_s`` asks (the agent's memory stays
#: bounded over a job of any length), and the frames kept in the rings not sized by time.
HISTORY_BYTES = {
    SAMPLES: 8 << 20,
    EVENTS: 4 << 20,
    LOGS: 1 << 20,
    OPS: 1 << 20,
    ANSWERS: 1 << 20,
}
RINGS = {EVENTS: 10_000, LOGS: 2_000, OPS: 500, ANSWERS: 20}
#: Snapshots a job's viewers may request (each writes a file of up to ``snapshot_max_bytes``).
MAX_REQUESTED_SNAPSHOTS = 20
#: Seconds a SIGTERM'd job waits for its viewers to get the exit before it dies.
SIGTERM_DRAIN_S = 0.5
#: The longest a SIGTERM'd job waits for the agent to close before dying anyway.
SIGTERM_WAIT_S = 3.0
#: ``probe_status`` names for the agent's own parts.
SERVER_PROBE = "server"
SNAPSHOTS_PROBE = "snapshots"
COST_PROBE = "cost"
#: The longest the cost budget spaces op windows apart.
MAX_OPS_SPACING_S = 300.0


def _say(message: str) -> None:
    """One line on the job's stderr, written to the fd so that a replaced sys.stderr or a
    dying interpreter cannot lose it."""
    with contextlib.suppress(OSError):
        os.write(2, f"torchtop: {message}\n".encode(errors="replace"))


@dataclass
class AgentConfig:
    """How the agent samples and serves. Every field can come from ``torchtop run`` options."""

    #: Seconds between reads of the cheap counters (memory, host).
    interval_s: float = DEFAULT_INTERVAL_S
    #: Seconds between NVML reads.
    nvml_interval_s: float = 0.5
    #: Seconds of history a late viewer still sees.
    history_s: float = 300.0
    #: Frames queued per viewer before the oldest are dropped.
    client_queue: int = 4096
    #: Read GPUs through NVML.
    nvml: bool = True
    #: Tee fds 1 and 2 into ``log`` frames (``torchtop run`` turns this on).
    capture_output: bool = False
    #: At exit, wait up to this long for a viewer that is expected to attach to get everything.
    linger_s: float = 0.0
    #: Write the agent's notices (over its budget, its server restarted) on the job's stderr
    #: as well as to viewers. An attached agent writes none: the job's output is the job's own.
    stderr_notices: bool = True
    #: The share of the job's step time the agent's threads may use (``--cost-budget``); above
    #: it the sampler samples less often. 0: no budget.
    cost_budget: float = 0.01
    #: Measure the agent's cost on the steps by pausing its sampler for 2 s a minute
    #: (:class:`~torchtop.agent.cost.PausedSteps`).
    measure_cost: bool = True
    cost_pause_every_s: float = 60.0

    # -- out of memory (torchtop.agent.oom) --------------------------------------------------
    #: Record CUDA allocator history and capture out-of-memory failures (``--no-oom-capture``).
    oom_capture: bool = True
    #: Allocator history entries kept (``_record_memory_history(max_entries=...)``), and the
    #: emulation's alloc/free ring; 0 keeps the stacks of live blocks only.
    oom_history_entries: int = 10_000
    #: Emulate a device of this many bytes on the CPU (``--memory-limit``); off when ``None``.
    memory_limit_bytes: int | None = None
    #: Hold the job at an OOM until a viewer dismisses it or ``pause_timeout_s`` passes.
    pause_on_oom: bool = False
    pause_timeout_s: float = 300.0
    #: Where snapshots go (default: the runtime directory) and how their names begin
    #: (default ``<pid>-``): ``<prefix>oom-1.pickle``, ``<prefix>snapshot-2.pickle``.
    snapshot_dir: str | None = None
    snapshot_prefix: str | None = None
    #: History entries kept in a saved snapshot, and its size bound (traces go first).
    snapshot_trace_entries: int = 2000
    snapshot_max_bytes: int = 64 << 20
    #: Failures captured in full per run; later ones are reported without a snapshot.
    max_captures: int = 5

    # -- stuck jobs (torchtop.agent.stall) ---------------------------------------------------
    #: The job counts as stuck after this many seconds without a step (or HANG_STEPS median
    #: steps, if longer); its training thread's stack is then sent (``--hang-after``).
    hang_after_s: float = 30.0

    # -- op timings (torchtop.agent.ops) ----------------------------------------------------
    #: Sample torch.profiler windows (``--no-ops`` turns this off).
    ops: bool = True
    #: Steps per window, and the share of the job's time the windows may cost.
    ops_window_steps: int = 2
    ops_budget: float = DEFAULT_OPS_BUDGET
    #: The shortest time between two windows, whatever their cost.
    ops_min_spacing_s: float = 5.0
    #: Record input shapes / the job's call site of each op (``--profile-shapes/-stack``).
    profile_shapes: bool = False
    profile_stack: bool = False

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> AgentConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(options) - known
        if unknown:
            raise TypeError(f"unknown agent option(s): {', '.join(sorted(unknown))}")
        config = cls(**options)
        if config.interval_s <= 0 or config.nvml_interval_s <= 0:
            raise ValueError("sampling intervals must be positive")
        if config.pause_timeout_s <= 0:
            raise ValueError("the pause timeout must be positive")
        if config.memory_limit_bytes is not None and config.memory_limit_bytes < 1:
            raise ValueError("the memory limit must be at least one byte")
        if config.ops_window_steps < 1:
            raise ValueError("an op window must span at least one step")
        if not 0 < config.ops_budget <= 0.5:
            raise ValueError("the op-sampling budget must be above 0 and at most 0.5 (50%)")
        if config.hang_after_s <= 0:
            raise ValueError("--hang-after must be positive")
        if not 0 <= config.cost_budget <= 0.5:
            raise ValueError("the cost budget must be between 0 and 0.5 (50%)")
        if config.ops_min_spacing_s < 0:
            raise ValueError("the spacing between op windows cannot be negative")
        return config


class Agent:
    def __init__(self, config: AgentConfig, identity: dict[str, Any] | None = None) -> None:
        """``identity``: which rank of which run (``Hello``'s fields), if not the one the
        launcher's environment says (:func:`rank_identity`)."""
        self.config = config
        self.identity = dict(identity) if identity is not None else rank_identity()
        #: Goes up when the identity changes: a hello built before is stale.
        self._identity_version = 0
        self.pid = os.getpid()
        #: When the next sample goes to the viewers that take one a second.
        self._next_paced_sample = 0.0
        #: The last sample sent, to leave out the ones that repeat it (see :meth:`publish`).
        self._last_sample: Sample | None = None
        self.started_at = time.time()
        self.finished = False
        self._finish_lock = threading.Lock()
        self._capture: OutputCapture | None = None

        from torchtop.agent.probes.cpu_memory import CpuMemoryProbe
        from torchtop.agent.probes.cuda_memory import CudaMemoryProbe
        from torchtop.agent.probes.host import HostProbe

        self._cuda = CudaMemoryProbe()
        nvml = None
        if config.nvml:
            from torchtop.agent.probes.nvml import NvmlProbe

            # GPUs matched to the job's CUDA devices by UUID once it has initialized CUDA.
            nvml = NvmlProbe(job_uuids=self._cuda.job_uuids)
        self._nvml = nvml
        # Out-of-memory capture, the --memory-limit emulation and snapshot requests.
        self.oom = OomController(
            config,
            self.publish,
            pid=self.pid,
            snapshot_dir=runtime_dir(),
            flush_events=lambda: self.sampler.drain_events(),
        )
        self._cuda.handled_ooms = self.oom.handled_ooms

        listener, self.info = bind_server(self.pid, sys.argv, self.started_at, self.identity)
        samples_ring = int(config.history_s / config.interval_s) + int(
            config.history_s / config.nvml_interval_s
        )
        # Steps and DataLoaders: a ``steps`` frame per tick with steps, ``loaders`` at 1 Hz.
        samples_ring += int(config.history_s / config.interval_s) + int(config.history_s)
        self.ops: OpsSampler | None = None
        if config.ops:
            self.ops = OpsSampler(
                trace_dir=self.oom.snapshot_dir,
                trace_prefix=self.oom.snapshot_prefix,
                window_steps=config.ops_window_steps,
                budget=config.ops_budget,
                min_spacing_s=config.ops_min_spacing_s,
                record_shapes=config.profile_shapes,
                with_stack=config.profile_stack,
            )
        self.training = TrainingMonitor(ops=self.ops, stall=StallWatch(config.hang_after_s))
        self._hello_cache: tuple[tuple[bool, bool, int], bytes] | None = None
        self._snapshots_requested = 0
        self.server = AgentServer(
            listener,
            self._hello_frame,
            rings={
                SAMPLES: RingLimit(frames=samples_ring, bytes=HISTORY_BYTES[SAMPLES]),
                **{name: RingLimit(frames, HISTORY_BYTES[name]) for name, frames in RINGS.items()},
            },
            client_queue=config.client_queue,
            on_error=self._server_failed,
            on_give_up=self._server_gave_up,
        )
        self.server.on_request = self._on_request
        # psutil once a second (the process table walk for children every 5 s); the RSS alone
        # from /proc on the ticks between.
        self._host = HostProbe(children_every=5, full_every=max(1, round(1.0 / config.interval_s)))
        #: The flight recorder's reader: its reads within a fifth of the cost budget.
        self.collectives = CollectiveMonitor(share=config.cost_budget * BUDGET_PART)
        self.sampler = Sampler(
            self.publish,
            host=self._host,
            # The C heap twice a second (mallinfo2 takes the allocator's locks), the RSS each tick.
            cpu_memory=self.oom.cpu_probe(
                CpuMemoryProbe(heap_every=max(1, round(0.5 / config.interval_s)))
            ),
            cuda_memory=self._cuda,
            nvml=nvml,
            interval_s=config.interval_s,
            nvml_interval_s=config.nvml_interval_s,
            # Viewers that attached before the job imported torch learn its version and devices.
            on_torch_imported=lambda: self.server.publish(self._hello_frame(), EVENTS),
            stats_every=max(1, round(1.0 / config.interval_s)),
            agent_stats=self._agent_stats,
            training=self.training,
            collectives=self.collectives,
            # What every viewer reads from outside the job (/proc, NVML) the agent leaves to it.
            outside=self.server.read_outside,
            batched=self.server.batched,
            on_resumed=self.training.resumed_after,
        )
        ops = self.ops
        #: The cost on the steps, measured by pausing the sampler now and then, and by the
        #: steps its ticks overlapped.
        self.paused_steps = (
            PausedSteps(every_s=config.cost_pause_every_s) if config.measure_cost else None
        )
        self.ticked_steps = TickedSteps() if config.measure_cost else None
        self.cost = CostMeter(
            config.cost_budget,
            lambda: self.training.steps.total,
            # Its shares are of the time the sampler ran (not of the overhead benchmark's
            # "off" blocks, when it is paused and its hooks out).
            clock=self.sampler.sampling_time,
            exempt_s=(lambda: ops.read_s) if ops is not None else (lambda: 0.0),
            hooks_s=lambda: HOOK_S[0],
        )
        #: Said once, on the job's stderr, when that leaves the windows half their own or less.
        self._windows_said = False

    def _on_request(self, request: Request) -> None:
        """A viewer's request, in the server's I/O thread: hand it over and return.

        The server has rate-limited it already; snapshots, which write a file each, are also
        capped per job.
        """
        if request.action == REQUEST_PROFILE:
            if self.ops is not None:
                self.ops.request_window()
            return
        if request.action == REQUEST_SNAPSHOT:
            self._snapshots_requested += 1
            if self._snapshots_requested > MAX_REQUESTED_SNAPSHOTS:
                if self._snapshots_requested == MAX_REQUESTED_SNAPSHOTS + 1:
                    detail = (
                        f"at most {MAX_REQUESTED_SNAPSHOTS} requested snapshots per job; "
                        f"the saved ones are in {self.oom.snapshot_dir}"
                    )
                    self.publish(
                        ProbeStatus(
                            t=time.time(), probe=SNAPSHOTS_PROBE, available=False, detail=detail
                        )
                    )
                return
        self.oom.handle_request(request)

    def _say(self, message: str) -> None:
        if self.config.stderr_notices:
            _say(message)

    def _server_failed(self, message: str) -> None:
        """The server's I/O thread failed and was restarted: say so, on stderr and to viewers."""
        self._say(message)
        self.publish(ProbeStatus(t=time.time(), probe=SERVER_PROBE, available=True, detail=message))

    def _server_gave_up(self, message: str) -> None:
        """The server stopped for good: say so and remove its socket, so `ps` no longer lists
        an agent that cannot be attached."""
        self._say(message)
        self.publish(
            ProbeStatus(t=time.time(), probe=SERVER_PROBE, available=False, detail=message)
        )
        remove_server_files(self.pid)

    def _devices(self) -> list[DeviceInfo]:
        devices = [DeviceInfo(id="cpu", name=platform.processor() or platform.machine())]
        if torch_imported():
            with contextlib.suppress(Exception):
                devices.extend(self._cuda.devices())
        return devices

    def _hello_frame(self) -> bytes:
        """The agent's hello, built once before torch is imported and once after (a burst of
        viewers must not make the agent query its devices for each)."""
        imported = torch_imported()
        # Built again once the job has initialized CUDA: the devices' names and UUIDs.
        state = (imported, imported and self._cuda.cuda_initialized(), self._identity_version)
        cached = self._hello_cache
        if cached is not None and cached[0] == state:
            return cached[1]
        frame = self._build_hello(imported)
        self._hello_cache = (state, frame)
        return frame

    def _build_hello(self, imported: bool) -> bytes:
        torch_version = None
        if imported:
            torch_version = str(getattr(sys.modules["torch"], "__version__", None))
        return encode(
            Hello(
                protocol=PROTOCOL_VERSION,
                pid=self.pid,
                argv=list(sys.argv),
                cwd=os.getcwd(),
                started_at=self.started_at,
                python=platform.python_version(),
                torch=torch_version,
                devices=self._devices(),
                interval_s=self.config.interval_s,
                hostname=socket.gethostname(),
                **self.identity,
                hang_after_s=self.config.hang_after_s,
            )
        )

    def announce_identity(self, identity: dict[str, Any]) -> None:
        """The process became a rank (its process group exists now): its description file
        and a fresh hello say which, to ``ps`` and to every viewer and recording."""
        identity = {**self.identity, **identity}
        if identity == self.identity:
            return
        self.identity = identity
        self._identity_version += 1
        self.info = describe_agent(dataclasses.replace(self.info, identity=identity))
        self.server.publish(self._hello_frame(), EVENTS)

    def _agent_stats(self, stats: SamplerStats) -> AgentStats:
        self.server.check()  # about once a second: restart the I/O thread if it died
        cost = self.cost.read()
        if self.cost.over_budget(cost) and cost.budgeted_share is not None:
            # As many times less often as the cost is over the budget (twice at least).
            factor = max(2.0, cost.budgeted_share / self.cost.budget)
            before = self.sampler.interval_s
            after = self.sampler.slow_down(
                factor, max(MAX_INTERVAL_S, self.sampler.base_interval_s)
            )
            if self.ops is not None:  # the op windows, read in the sampler, space out too
                self.ops.min_spacing_s = min(
                    max(self.ops.min_spacing_s, 1.0) * factor, MAX_OPS_SPACING_S
                )
            if after != before and self.cost.slowdowns == 1:
                detail = (
                    f"the agent used {cost.budgeted_share:.1%} of the step time, over its budget "
                    f"of {self.cost.budget:.1%}: it samples every {after:.3g} s instead of "
                    f"{self.sampler.base_interval_s:g} s, and spaces its op windows out "
                    "(--cost-budget)"
                )
                self._say(detail)
                self.publish(
                    ProbeStatus(t=time.time(), probe=COST_PROBE, available=True, detail=detail)
                )
        rest = self.cost.rest_share()
        if self.ops is not None and rest is not None:
            # The next window's spacing is set by its cost over this budget.
            self.ops.budget = windows_budget(self.config.ops_budget, self.cost.budget, rest)
            if not self._windows_said and self.ops.budget <= self.config.ops_budget / 2:
                self._windows_said = True
                self._say(
                    f"the agent's sampler and hooks take {rest:.1%} of the step time, against its"
                    f" budget of {self.cost.budget:.1%}: its op windows get {self.ops.budget:.2%}"
                    f" of the time instead of {self.config.ops_budget:.2%}, and come further "
                    "apart (--cost-budget, --ops-budget)"
                )
        measured, measured_by = self._measure_cost()
        windows = self.ops.windows_share() if self.ops is not None else None
        measured_share = None
        if measured is not None:
            # Neither measure sees the hooks or the op windows: their own measures are added.
            measured_share = round(
                measured.step_share + (cost.hooks_share or 0.0) + (windows or 0.0), 5
            )
        return AgentStats(
            t=time.time(),
            clients=self.server.client_count,
            queued_bytes=self.server.pending_bytes(),
            dropped=self.server.total_dropped(),
            ticks=stats.ticks,
            late_ticks=stats.late_ticks,
            mean_tick_s=stats.total_tick_s / stats.ticks if stats.ticks else 0.0,
            max_tick_s=stats.max_tick_s,
            cpu_s=cost.cpu_s,
            cpu_share=cost.cpu_share,
            step_share=cost.step_share,
            cost_budget=self.cost.budget,
            interval_s=self.sampler.interval_s,
            measured_step_share=measured_share,
            measured_pairs=self.paused_steps.compared if self.paused_steps is not None else None,
            measured_by=measured_by,
            measured_steps=(
                measured.pairs
                if measured is not None and measured_by == MEASURED_BY_TICKS
                else None
            ),
            hooks_share=None if cost.hooks_share is None else round(cost.hooks_share, 5),
            windows_share=None if windows is None else round(windows, 5),
        )

    def _measure_cost(self) -> tuple[Measured | None, str | None]:
        """In the sampler thread, once a second: compare the last pause's steps with those
        around it, and pause again when one is due (not while an op window is under way);
        class the steps since by the ticks that overlapped them. The measure, and what it was
        measured by: the pauses once they agree, else the ticks."""
        paused = self.paused_steps
        if paused is None or self.ticked_steps is None:
            return None, None
        steps = self.training.steps
        ticks, known_from, known_until = self.sampler.known_ticks()
        ops = self.ops
        windows: Sequence[tuple[float, float]] = ()
        if ops is not None:  # an op window's steps are its own cost, once its span is known
            windows = ops.spans
            unsettled = ops.unsettled_since()
            if unsettled is not None:
                known_until = min(known_until, unsettled)
        self.ticked_steps.add(steps.ends, ticks, known_until, known_from, windows)
        paused.add(steps.ends)
        usual = statistics.median(steps.recent) if steps.recent else None
        busy = ops is not None and not ops.idle
        if paused.due(usual, busy=busy):
            began, ended = self.sampler.pause_for(paused.pause_s)
            self.training.drain()  # the steps taken in the pause, from the hooks' events
            paused.paused(began, ended, steps.ends)
        measured = paused.measured()
        if measured is not None:
            return measured, MEASURED_BY_PAUSES
        ticked = self.ticked_steps.measured()
        return ticked, MEASURED_BY_TICKS if ticked is not None else None

    def publish(self, message: Message) -> None:
        if isinstance(message, Sample) and self._repeats_last_sample(message):
            return
        try:
            frame = encode(message)
        except Exception:
            return
        aged = None
        detail_only = False
        if isinstance(message, Sample):
            ring = SAMPLES
            # Viewers at their own pace get one a second.
            detail_only = message.t < self._next_paced_sample
            if not detail_only:
                self._next_paced_sample = message.t + PACED_SAMPLE_S
        elif isinstance(message, (GpuSample, AgentStats, StepStats, LoaderInfo, CollectivesSeen)):
            ring = SAMPLES
        elif isinstance(message, LogLine):
            ring = LOGS
        elif isinstance(message, OpsWindow):
            ring = OPS
            # Older windows keep their figures but not their op tables: the latest window's
            # cumulative table covers them all.
            with contextlib.suppress(Exception):
                aged = encode(dataclasses.replace(message, ops=[], cumulative=[]))
        elif isinstance(message, MemorySnapshotTaken):
            ring = ANSWERS
        else:
            ring = EVENTS  # rare and important: phases, marks, statuses, OOMs, the exit
        self.server.publish(frame, ring, aged, detail_only)

    def _repeats_last_sample(self, sample: Sample) -> bool:
        """True for a sample with the same figures as the last one sent, less than
        :data:`PACED_SAMPLE_S` after it: a job that holds still (waiting, sleeping, hung) sends
        one a second, not ten, so that it and its viewers spend nothing on figures that did not
        move. Nothing is lost: the charts hold a value until the next sample, and a figure that
        moves is sent at the tick it moved."""
        last = self._last_sample
        if (
            last is not None
            and 0 <= sample.t - last.t < PACED_SAMPLE_S
            and sample.memory == last.memory
            and sample.host == last.host
        ):
            return True
        self._last_sample = sample
        return False

    def start(self) -> None:
        self.server.start()
        if self.config.capture_output:
            self._capture = OutputCapture(
                lambda stream, text: self.publish(LogLine(t=time.time(), stream=stream, text=text))
            )
            self._capture.start()
        if self.ops is None:
            detail = "op sampling is off (--no-ops)"
            self.publish(
                ProbeStatus(t=time.time(), probe=OPS_PROBE, available=False, detail=detail)
            )
        else:
            quiet_kineto()  # kineto's two lines per window stay off the job's stderr
        self.training.start()  # the step and DataLoader hooks, as soon as torch is loaded
        self.oom.start()  # in the job's thread: the --memory-limit dispatch mode is per thread
        self.sampler.start()

    def finish(
        self,
        exit_code: int | None,
        reason: str = "",
        drain_s: float = 1.0,
        linger_s: float = float("inf"),
    ) -> None:
        """Send the final state and the exit status, then close. Safe to call more than once."""
        with self._finish_lock:
            if self.finished or os.getpid() != self.pid:
                return
            self.finished = True
        self.oom.stop()
        self.sampler.stop(timeout=FINAL_WAIT_S, final=True)  # its last collectives read
        with contextlib.suppress(Exception):
            self.sampler.tick(collectives=False)  # one last sample: the state at the end
        with contextlib.suppress(Exception):
            for message in self.training.stop(time.time()):  # hooks out; the last steps
                self.publish(message)
        if self._capture is not None:
            self._capture.stop()
        self.publish(JobExited(t=time.time(), exit_code=exit_code, reason=reason))
        if self.config.linger_s > 0:
            # A job being stopped (SIGTERM) waits no longer than its short drain.
            self.server.wait_for_clients_drained(min(self.config.linger_s, linger_s))
        self.server.stop(drain_s=drain_s)
        remove_server_files(self.pid)
        self._host.close()
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.close()

    def forget_in_child(self) -> None:
        """In a forked child: close our copies of the agent's descriptors; threads are gone."""
        self.finished = True
        self.server.close_fds_in_child()
        if self._capture is not None:
            self._capture.close_fds_in_child()


_agent: Agent | None = None
_agent_lock = threading.Lock()
_uncaught: list[BaseException] = []
#: The exit status the main script ended with while other threads still trained: the agent
#: sends it when the process really ends (atexit runs after the non-daemon threads are joined).
_deferred: list[tuple[int | None, str]] = []


def current() -> Agent | None:
    return _agent


def start(identity: dict[str, Any] | None = None, **options: Any) -> Agent:
    """Start the agent in this process, once. Options are :class:`AgentConfig` fields;
    ``identity`` says which rank of which run, where the environment does not."""
    global _agent
    with _agent_lock:
        if _agent is not None and _agent.pid == os.getpid() and not _agent.finished:
            return _agent
        agent = Agent(AgentConfig.from_options(options), identity)
        agent.start()
        _agent = agent
    atexit.register(_finish_at_exit)
    _chain_excepthook()
    _handle_sigterm()
    return agent


def stop() -> None:
    agent = _agent
    if agent is not None:
        agent.finish(None, "agent stopped")


def finish(exit_code: int | None, reason: str = "") -> None:
    """The job's main script ended. While other (non-daemon) threads go on training, the
    process lives on, and so does the agent: it finishes at exit, after them."""
    agent = _agent
    if agent is None:
        return
    if _training_threads():
        _deferred.append((exit_code, reason))
        return
    agent.finish(exit_code, reason)


def _training_threads() -> list[threading.Thread]:
    """Threads that keep the process alive after the main script: the ones Python joins at
    exit (non-daemon), other than this one."""
    current = threading.current_thread()
    return [t for t in threading.enumerate() if t is not current and not t.daemon and t.is_alive()]


def _finish_at_exit() -> None:
    if _deferred:
        exit_code, reason = _deferred[-1]
        _deferred.clear()
        finish(exit_code, reason)
    elif _uncaught:
        exc = _uncaught[-1]
        finish(1, f"uncaught {type(exc).__name__}: {exc}")
    else:
        finish(None, "interpreter exited")


def _handle_sigterm() -> None:
    """On SIGTERM, send the exit and remove the socket, then die of SIGTERM as before.

    Only where SIGTERM would kill the job (the default action): a handler of the job's own is
    left in place (its exit runs the agent's atexit), and an ignored SIGTERM stays ignored.
    """
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        return


def _on_sigterm(signum: int, _frame: Any) -> None:
    agent = _agent
    if agent is not None and agent.pid == os.getpid():
        # In a thread of its own, waited for a bounded time: the handler runs in the main
        # thread between two bytecodes, perhaps while that thread holds a lock the agent needs.
        closing = agent_thread(
            agent.finish,
            "torchtop-sigterm",
            args=(-signum, "killed by SIGTERM", SIGTERM_DRAIN_S, SIGTERM_DRAIN_S),
        )
        closing.start()
        closing.join(SIGTERM_WAIT_S)
    # The default action, as if we had never been here: the job dies of SIGTERM.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _chain_excepthook() -> None:
    previous = sys.excepthook
    if getattr(previous, "_torchtop", False):
        return

    def hook(exc_type: Any, exc: BaseException, tb: Any) -> None:
        _uncaught.append(exc)
        previous(exc_type, exc, tb)

    hook._torchtop = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _after_fork_in_child() -> None:
    global _agent
    agent = _agent
    _agent = None
    if agent is not None:
        with contextlib.suppress(Exception):
            agent.forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)

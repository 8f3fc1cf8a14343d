"""The wire protocol between the agent and its viewers.

Standard library only. A frame is one JSON object on one line (UTF-8, ``\\n``-terminated) with a
``kind`` field naming the message. Each message kind is a frozen dataclass below; decoding
validates every field against the dataclass's type hints, so nothing from the wire is ever
unpickled, evaluated or trusted. Readers skip kinds they do not know (a newer agent may send
more), and reject a malformed or oversized frame with :class:`ProtocolError`.

Units: bytes are ``int``, seconds and timestamps are ``float`` (``time.time()`` wall clock), and a
value that could not be read is ``None``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

PROTOCOL_VERSION = 1
#: The largest frame a reader accepts, newline included.
MAX_FRAME_BYTES = 1 << 20


class ProtocolError(Exception):
    """A frame that is malformed, too large, or of an unsupported protocol version."""


# --------------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """Base of every message kind. ``KIND`` is the value of the ``kind`` field on the wire."""

    KIND: ClassVar[str] = ""


@dataclass(frozen=True)
class DeviceInfo:
    """A device the job can use: ``cpu`` or ``cuda:N``.

    ``uuid`` is a GPU's UUID as NVML and DCGM spell it (``GPU-xxxxxxxx-…``), so that figures
    about the device join DCGM's; ``None`` for the CPU or where it cannot be read.
    """

    id: str
    name: str
    total_bytes: int | None = None
    uuid: str | None = None
    #: A CUDA device's compute capability (``"8.0"``); 7.0 and up have tensor cores.
    capability: str | None = None


@dataclass(frozen=True)
class ClientHello(Message):
    """First frame from a viewer. The agent closes a connection whose version differs."""

    KIND: ClassVar[str] = "client_hello"
    protocol: int
    client: str = "viewer"
    token: str | None = None
    #: What this viewer reads of the job from outside it (``/proc``, NVML): names from
    #: :data:`OUTSIDE_READS`. While every viewer reads a figure from outside, the agent leaves it
    #: to them and sends only what the job alone can read (see ``torchtop.streams.outside``).
    outside: list[str] = field(default_factory=list)
    #: Above 0: this viewer wants the job's samples at its pace, not the agent's (a viewer of
    #: many ranks, an exporter): one ``sample`` a second (:data:`PACED_SAMPLE_S`); every other
    #: frame as usual. 0: every sample.
    pace_s: float = 0.0


#: The agent's seconds between samples by default (``--interval``).
DEFAULT_INTERVAL_S = 0.1
#: What the agent's measured cost was measured by (``AgentStats.measured_by``).
MEASURED_BY_PAUSES = "pauses"
MEASURED_BY_TICKS = "ticks"
MEASURED_BY = (MEASURED_BY_PAUSES, MEASURED_BY_TICKS)
#: The share of the job's time the op windows may cost by default (``--ops-budget``). On the
#: tiny-ops benchmark the windows were most of what the mean step time has beyond the median:
#: 1.0% of the time at a budget of 1% (a window every 5 s), 0.54% and 0.56% at 0.5% (one every
#: 10 s), in the steps the windows slowed (``python -m benchmarks.agent_overhead``). A model
#: whose windows cost little is held to the least spacing, whatever the budget.
DEFAULT_OPS_BUDGET = 0.005

#: The pace of ``sample`` frames for a viewer that asks for its own pace (``pace_s``).
PACED_SAMPLE_S = 1.0

#: The figures a viewer on the job's machine can read from outside it: the process's CPU,
#: threads, children and the machine's memory (``host``; the agent still sends the RSS, one
#: ``pread``), and the GPUs as NVML sees them (``nvml``).
OUTSIDE_READS = ("host", "nvml")


@dataclass(frozen=True)
class Hello(Message):
    """First frame from the agent: who the job is.

    A rank of a distributed job also says which: ``rank``, ``local_rank``, ``world_size`` and
    ``node_rank`` (``GROUP_RANK``), ``run_id`` (``TORCHELASTIC_RUN_ID``) and ``restart_count``,
    read from the environment torchrun (or the user) set; ``None`` for a single process.
    """

    KIND: ClassVar[str] = "hello"
    protocol: int
    pid: int
    argv: list[str]
    cwd: str
    started_at: float
    python: str
    torch: str | None
    devices: list[DeviceInfo]
    interval_s: float
    hostname: str = ""
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    node_rank: int | None = None
    run_id: str | None = None
    restart_count: int | None = None
    #: The agent's floor for calling its job stuck (``--hang-after``): no step for this many
    #: seconds, or for ``HANG_STEPS`` median steps if longer. ``None`` from an older agent.
    hang_after_s: float | None = None


@dataclass(frozen=True)
class HostStats:
    """The training process and its machine, read with psutil.

    ``cpus`` is how many CPUs the process may run on (its affinity, else the machine's), and
    ``local_processes`` how many processes of the job share this node (torchrun's
    ``LOCAL_WORLD_SIZE``; ``None`` for a single process).
    """

    rss_bytes: int | None
    cpu_percent: float | None
    threads: int | None
    children: int | None
    system_used_bytes: int | None
    system_total_bytes: int | None
    cpus: int | None = None
    local_processes: int | None = None


@dataclass(frozen=True)
class MemoryStats:
    """One device's memory as its allocator sees it.

    On CUDA, ``allocated`` and ``reserved`` come from the caching allocator (``reserved`` is its
    cache). On a CPU-only job there is no caching allocator: ``allocated`` is the C heap in use
    (``source == "cpu-heap"``) or RSS where the heap cannot be read (``source == "cpu-rss"``),
    and ``reserved`` is the process RSS.
    """

    device: str
    source: str
    allocated_bytes: int | None
    reserved_bytes: int | None
    active_bytes: int | None = None
    inactive_split_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    num_alloc_retries: int | None = None
    num_ooms: int | None = None
    free_bytes: int | None = None
    total_bytes: int | None = None
    #: Of ``num_ooms``, the failures the job never saw: torch caught them itself (cuDNN's
    #: workspace search retries with a smaller workspace). ``None`` where not counted.
    handled_ooms: int | None = None


@dataclass(frozen=True)
class Sample(Message):
    """One tick of the cheap counters."""

    KIND: ClassVar[str] = "sample"
    t: float
    host: HostStats | None
    memory: list[MemoryStats]


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int | None


@dataclass(frozen=True)
class GpuStats:
    """One NVIDIA GPU as NVML sees it. ``lost`` is set once NVML reports the GPU gone."""

    index: int
    name: str | None
    util_gpu_percent: float | None = None
    util_memory_percent: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    clock_sm_mhz: int | None = None
    clock_memory_mhz: int | None = None
    processes: list[GpuProcess] | None = None
    lost: bool = False
    #: NVML's UUID of the GPU (``GPU-…``) or MIG instance (``MIG-…``).
    uuid: str | None = None
    #: The job's CUDA device on this GPU (``cuda:N``), matched by UUID; ``None`` when the job
    #: does not use it or has not initialized CUDA yet (then ``in_job`` is ``None`` too).
    cuda_device: str | None = None
    #: ``True`` for a GPU the job can use, ``False`` for another job's, ``None`` while unknown.
    in_job: bool | None = None
    #: For a MIG instance, the NVML index of its parent GPU (``index`` is then the instance's
    #: index on that parent).
    mig_parent: int | None = None
    #: NVML's total energy counter: millijoules since the driver was loaded (updated about
    #: every 100 ms). ``None`` where it could not be read.
    energy_mj: int | None = None
    #: ``False`` where NVML says the GPU has no energy counter (older than Volta, a MIG
    #: instance), ``True`` once read, ``None`` while unknown (or from an older agent).
    energy_supported: bool | None = None


@dataclass(frozen=True)
class GpuSample(Message):
    KIND: ClassVar[str] = "gpu"
    t: float
    gpus: list[GpuStats]


@dataclass(frozen=True)
class ProbeStatus(Message):
    """A probe became available or unavailable, with the reason in words."""

    KIND: ClassVar[str] = "probe_status"
    t: float
    probe: str
    available: bool
    detail: str


@dataclass(frozen=True)
class PhaseBegan(Message):
    """A phase began. ``description`` (optional) says in a few sentences what the phase does
    and why: the demos use it for the viewer's side panel."""

    KIND: ClassVar[str] = "phase_began"
    t: float
    name: str
    id: int
    description: str | None = None


@dataclass(frozen=True)
class PhaseEnded(Message):
    KIND: ClassVar[str] = "phase_ended"
    t: float
    name: str
    id: int


@dataclass(frozen=True)
class Marked(Message):
    KIND: ClassVar[str] = "mark"
    t: float
    name: str


@dataclass(frozen=True)
class LogLine(Message):
    """A line of the job's own output. ``stream`` is ``stdout`` or ``stderr``."""

    KIND: ClassVar[str] = "log"
    t: float
    stream: str
    text: str


@dataclass(frozen=True)
class Dropped(Message):
    """How many frames the agent has dropped for this client so far (a running total)."""

    KIND: ClassVar[str] = "dropped"
    t: float
    count: int


@dataclass(frozen=True)
class AgentStats(Message):
    """The agent's own cost and health, about once a second."""

    KIND: ClassVar[str] = "agent_stats"
    t: float
    clients: int
    queued_bytes: int
    dropped: int
    ticks: int
    late_ticks: int
    mean_tick_s: float
    max_tick_s: float
    #: CPU seconds the agent's threads have used so far, and over the last second their share
    #: of one core and, with the hooks' own time (``hooks_share``), of the job's training time
    #: (``None`` while the job takes no step; on a job whose step holds the GIL, the time the
    #: agent takes from it). ``None`` from an agent that does not measure them.
    cpu_s: float | None = None
    cpu_share: float | None = None
    step_share: float | None = None
    #: The agent's budget (a share of step time) and the sampling interval it keeps to now:
    #: above the budget it samples less often than its configured interval.
    cost_budget: float | None = None
    interval_s: float | None = None
    #: The agent's cost on the steps as measured on the steps themselves (``measured_by``):
    #: by pausing it now and then and comparing the steps in the pauses with those around
    #: them (``measured_pairs`` comparisons so far; their median, less one), or by the steps
    #: its ticks overlapped; plus ``hooks_share`` and ``windows_share``. Includes the time a
    #: step waits for the GIL while the agent's threads hold it, which ``step_share`` cannot
    #: see. ``None`` until measured, and while the measure varies too much to say.
    measured_step_share: float | None = None
    measured_pairs: int | None = None
    #: What ``measured_step_share`` was measured by: :data:`MEASURED_BY_PAUSES` (the pauses
    #: above, once they agree) or, until then, :data:`MEASURED_BY_TICKS`: the steps a sampler
    #: tick overlapped (``measured_steps`` of them) against the others: their mean's excess
    #: times the overlapped steps over the steps' time. ``None`` with no measure.
    measured_by: str | None = None
    measured_steps: int | None = None
    #: The training thread's own time in the agent's hooks over the last second, as a share
    #: of its training time (included in ``step_share`` and ``measured_step_share``).
    hooks_share: float | None = None
    #: What the op windows cost the job, as a share of its time: the latest windows' costs,
    #: measured on its steps, over the time they spanned (included in
    #: ``measured_step_share``). ``None`` before a window is priced, or with no op windows.
    windows_share: float | None = None


@dataclass(frozen=True)
class JobExited(Message):
    """The job ended. ``exit_code`` is ``None`` when unknown; negative means killed by a signal."""

    KIND: ClassVar[str] = "exit"
    t: float
    exit_code: int | None
    reason: str = ""


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (
        ClientHello,
        Hello,
        Sample,
        GpuSample,
        ProbeStatus,
        PhaseBegan,
        PhaseEnded,
        Marked,
        LogLine,
        Dropped,
        AgentStats,
        JobExited,
    )
}


# --------------------------------------------------------------------------------------------
# Out of memory, memory snapshots and viewer requests
# --------------------------------------------------------------------------------------------

#: The most allocation sites an ``oom`` or ``memory_snapshot`` message carries, and the most
#: frames of each site's stack: together they keep such a frame far below MAX_FRAME_BYTES.
MAX_SITES = 20
MAX_STACK_FRAMES = 8
#: ``Request.action`` values. An agent ignores actions it does not know.
REQUEST_SNAPSHOT = "snapshot"
REQUEST_RESUME = "resume"
#: Take an op-timing window now and keep its Chrome trace under its own name.
REQUEST_PROFILE = "profile"


@dataclass(frozen=True)
class StackFrame:
    """One Python frame of an allocation's stack."""

    file: str
    line: int
    function: str


@dataclass(frozen=True)
class AllocationSite:
    """Live memory grouped by the line of the job's code that allocated it.

    ``file``/``line``/``function`` are the innermost frame outside torch and torchtop;
    ``stack`` is the allocation's stack, innermost first, cut to ``MAX_STACK_FRAMES``.
    """

    file: str
    line: int
    function: str
    bytes: int
    count: int
    stack: list[StackFrame] = field(default_factory=list)


@dataclass(frozen=True)
class CategoryBytes:
    """Bytes held by one category (``parameters``, ``gradients``, ``optimizer_state``,
    ``other_allocated``)."""

    category: str
    bytes: int


@dataclass(frozen=True)
class MemoryCapture(Message):
    """What held one device's memory at one moment: the body of ``oom`` and ``memory_snapshot``.

    ``largest_free_block_bytes`` is the largest free block inside the allocator's reserved
    segments. ``fragmented`` is the verdict: enough memory free in total, but no block big
    enough (``None`` when it cannot be told, as for a snapshot that requested nothing).
    ``emulated`` marks a CPU job under ``--memory-limit``. ``snapshot_path`` is a pickle that
    PyTorch's memory_viz opens, or ``None`` with ``snapshot_error`` saying why.
    """

    t: float
    id: int
    device: str
    emulated: bool
    requested_bytes: int | None
    free_bytes: int | None
    total_bytes: int | None
    reserved_bytes: int | None
    allocated_bytes: int | None
    largest_free_block_bytes: int | None
    fragmented: bool | None
    top_sites: list[AllocationSite]
    snapshot_path: str | None
    snapshot_error: str = ""
    #: ``torch.is_grad_enabled()`` in the thread that allocated (``None`` for snapshots).
    grad_enabled: bool | None = None
    #: Live allocations in all, of which ``top_sites`` shows the largest groups.
    live_count: int | None = None
    #: The stack of the allocation that failed, innermost first (empty when unknown). For a
    #: failure in backward, the training thread's stack at that moment (the engine's threads
    #: run no Python).
    requested_stack: list[StackFrame] = field(default_factory=list)
    #: The failure came from the autograd engine's thread, in a backward pass.
    in_backward: bool | None = None
    #: What held ``allocated_bytes``: blocks attributed by address to the optimizers'
    #: parameters, gradients and state, the rest ``other_allocated`` (empty: no optimizer).
    by_category: list[CategoryBytes] = field(default_factory=list)


@dataclass(frozen=True)
class OutOfMemory(MemoryCapture):
    """The job failed to allocate; sent before its ``OutOfMemoryError`` unwinds.

    ``paused``: the agent holds the job at the failure until a viewer sends ``resume`` or
    ``pause_timeout_s`` passes (``--pause-on-oom``).
    """

    KIND: ClassVar[str] = "oom"
    message: str = ""
    paused: bool = False
    pause_timeout_s: float | None = None


@dataclass(frozen=True)
class MemorySnapshotTaken(MemoryCapture):
    """A snapshot a viewer asked for with a ``snapshot`` request."""

    KIND: ClassVar[str] = "memory_snapshot"
    request_id: int = 0


@dataclass(frozen=True)
class OomResumed(Message):
    """A job held at an out-of-memory failure goes on (``reason``: dismissed, timeout)."""

    KIND: ClassVar[str] = "oom_resumed"
    t: float
    id: int
    reason: str


@dataclass(frozen=True)
class Request(Message):
    """A viewer's request to the agent, sent after its hello (``REQUEST_*`` actions)."""

    KIND: ClassVar[str] = "request"
    action: str
    id: int = 0


MESSAGE_TYPES.update(
    {cls.KIND: cls for cls in (OutOfMemory, MemorySnapshotTaken, OomResumed, Request)}
)


# --------------------------------------------------------------------------------------------
# Relays: the agents of another node, over ssh or TCP
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RelayHello(Message):
    """First frame from a relay (``torchtop relay``), once the viewer's hello passed its checks:
    which node and torchtop it is. Then come its agents' frames, each tagged with its source
    (``"src"``: the agent's pid), as a recording of several agents holds them."""

    KIND: ClassVar[str] = "relay_hello"
    protocol: int
    version: str
    host: str
    pid: int
    #: The one run it follows (``--run``), or ``None`` for every agent of the node.
    run_id: str | None = None


@dataclass(frozen=True)
class Refused(Message):
    """A relay's only frame to a viewer it refuses (a bad token, another protocol version):
    why, and what to do; then it closes."""

    KIND: ClassVar[str] = "refused"
    reason: str


MESSAGE_TYPES.update({cls.KIND: cls for cls in (RelayHello, Refused)})


# --------------------------------------------------------------------------------------------
# Training steps and DataLoaders
# --------------------------------------------------------------------------------------------

#: The most steps a ``steps`` frame lists one by one; more are sampled evenly (counts and sums
#: stay exact), which keeps the frame a few KiB at any step rate.
MAX_STEP_DETAIL = 64
#: The most frames a ``stack`` message carries (the innermost ones).
MAX_HANG_FRAMES = 40
#: A job is stuck once no step has ended for this many median steps, and at least for its
#: agent's ``hang_after_s`` (default :data:`HANG_AFTER_S`, ``torchtop run --hang-after``).
HANG_STEPS = 10.0
HANG_AFTER_S = 30.0


def hang_threshold(median_step_s: float | None, hang_after_s: float = HANG_AFTER_S) -> float:
    """Seconds without a step after which a job counts as stuck (the agent, which sends its
    stack then, and the model, which names the hang, use the same)."""
    if median_step_s is None:
        return hang_after_s
    return max(hang_after_s, HANG_STEPS * median_step_s)


@dataclass(frozen=True)
class StepStats(Message):
    """Training steps that ended since the previous ``steps`` frame (sent on ticks with any).

    A step ends when the step clock's ``optimizer.step()`` returns (or a ``GradScaler`` skips
    it, or ``torchtop.step()`` is called) and lasts from the end of the previous step, so the
    job's first step has no duration. ``timed`` counts the steps with one; the sums cover those.
    ``wait_s`` is the time the training thread blocked in ``DataLoader`` ``__next__`` (each
    iterator's first batch excluded: that is ``startup_s``, worker start-up); compute is the
    step's time less both, and ``optimizer_s`` is inside compute.

    The lists describe up to :data:`MAX_STEP_DETAIL` of the ``count`` steps: all of them, or
    evenly spaced ones where entry ``j`` stands for the steps ``⌊j·count/n⌋`` up to
    ``⌊(j+1)·count/n⌋`` (``n`` entries). ``ends`` are wall-clock times; a ``None`` duration is
    the job's first step.
    """

    KIND: ClassVar[str] = "steps"
    t: float
    #: Steps so far in the job, skipped ones included.
    total: int
    #: Steps a GradScaler skipped so far (inf or NaN gradients): no optimizer step ran.
    skipped_total: int
    count: int
    skipped: int
    timed: int
    time_s: float
    wait_s: float
    startup_s: float
    optimizer_s: float
    #: Samples in the timed steps (leading dimension of each batch's first tensor); 0: unknown.
    samples: int
    ends: list[float] = field(default_factory=list)
    durations: list[float | None] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    startups: list[float] = field(default_factory=list)
    optimizer: list[float] = field(default_factory=list)
    batch_samples: list[int] = field(default_factory=list)
    backward_s: float = 0.0
    backwards: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class StackSampled(Message):
    """The training (main) thread's Python stack, read by the agent's own thread because the
    job has not finished a step for ``stale_s`` seconds (at least ``threshold_s``). ``frames``
    run outermost first, the line it is on last, cut to :data:`MAX_HANG_FRAMES` innermost.
    Repeated every few seconds while the job stays stuck."""

    KIND: ClassVar[str] = "stack"
    t: float
    stale_s: float
    threshold_s: float
    steps: int
    thread: str
    frames: list[StackFrame]


@dataclass(frozen=True)
class WorkerStats:
    """A DataLoader worker process, read with psutil.

    ``uss_bytes`` (private), ``pss_bytes`` and ``shared_bytes`` are read from outside the job
    (``/proc/PID/smaps_rollup``, :mod:`torchtop.streams.worker_memory`) where the viewer runs on
    the job's host; ``None`` elsewhere.
    """

    pid: int
    alive: bool
    cpu_percent: float | None = None
    rss_bytes: int | None = None
    uss_bytes: int | None = None
    pss_bytes: int | None = None
    shared_bytes: int | None = None


@dataclass(frozen=True)
class LoaderStats:
    """One DataLoader: its settings, its totals so far and its current iterator's workers.

    ``index`` numbers loaders in the order the job first iterated them, and stays the same
    across epochs (``name`` is ``"loader N"``); ``dataset`` is the dataset's class name.
    ``start_method`` is the workers' (``fork``, ``spawn``, ``forkserver``), once known.
    ``wait_s`` excludes each new iterator's first batch (worker start-up), which
    ``first_batch_s`` sums; ``epochs`` counts passes over the loader. ``grad_batches`` counts
    the batches fetched with grad mode on (an evaluation loop without ``no_grad`` shows there).
    """

    index: int
    name: str
    dataset: str
    batch_size: int | None
    num_workers: int
    pin_memory: bool
    prefetch_factor: int | None
    persistent_workers: bool
    start_method: str | None = None
    batches: int = 0
    samples: int = 0
    wait_s: float = 0.0
    epochs: int = 0
    first_batch_s: float = 0.0
    last_first_batch_s: float | None = None
    workers: list[WorkerStats] = field(default_factory=list)
    #: Batches fetched while autograd was on (``torch.is_grad_enabled()`` in ``__next__``).
    grad_batches: int = 0
    #: What the dataset keeps its data in, from its attributes' types: ``"python"`` (a big
    #: list/dict of Python objects, which forked workers copy page by page), ``"arrays"``
    #: (NumPy, tensors, Arrow, a memory map), ``None`` where not known; and in words
    #: (``"list of 1,200,000 dict in .rows"``).
    dataset_storage: str | None = None
    dataset_detail: str | None = None


@dataclass(frozen=True)
class LoaderInfo(Message):
    """Every DataLoader the job has iterated, about once a second while any is in use."""

    KIND: ClassVar[str] = "loaders"
    t: float
    loaders: list[LoaderStats]


MESSAGE_TYPES.update({cls.KIND: cls for cls in (StepStats, LoaderInfo)})


# --------------------------------------------------------------------------------------------
# Op timings (sampled torch.profiler windows)
# --------------------------------------------------------------------------------------------

#: The most ops an ``ops`` message lists per table, by self time; the rest are summed in
#: ``OpsWindow.other_*``.
MAX_OPS = 40


@dataclass(frozen=True)
class OpStat:
    """One op (or kernel) over a profiler window, or over all windows so far.

    ``total`` includes the time of the ops it called; ``self`` excludes it. Device times are the
    kernels the op launched (``None`` where no device activity was recorded: a CPU-only job).
    ``shapes`` (``--profile-shapes``) and ``site`` (``--profile-stack``: the innermost frame of
    the job's own code) split an op by input shapes and by call site when they are on.
    """

    name: str
    calls: int
    total_cpu_s: float
    self_cpu_s: float
    total_device_s: float | None = None
    self_device_s: float | None = None
    shapes: str | None = None
    site: str | None = None


@dataclass(frozen=True)
class ModuleBytes:
    """Activation memory one module of the job held at a step's peak, its submodules
    included. ``path`` is the module's name in the job's model (the job's text)."""

    path: str
    bytes: int


@dataclass(frozen=True)
class MatmulDtype:
    """Matrix-multiply and convolution calls (``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``,
    ``_convolution``...) by the dtype of their first input, as the profiler names it
    (``float``, ``c10::BFloat16``, ``c10::Half``)."""

    dtype: str
    calls: int


@dataclass(frozen=True)
class OpsWindow(Message):
    """One torch.profiler window the agent took, and the running totals over all windows.

    A window opens and closes at step boundaries (``steps`` steps; ``None`` for a time-based
    window, when the job has no steps). ``cost_s`` is what the window cost the training thread
    (starting and stopping the profiler, and the slowdown of the profiled steps); ``spacing_s``
    the time to the next window, adapted so that the cost stays within the agent's budget.
    ``sync_points`` counts waits for the device (the runtime's ``cuda*Synchronize`` and
    synchronous ``cudaMemcpy``, an ``.item()`` of a device tensor counting once), meaningful
    only in windows with ``device`` activity; ``host_reads`` counts ``.item()`` and the like on
    CPU tensors, which wait for no device; ``copies`` counts host-device copies (memcpy
    HtoD/DtoH/DtoD). ``trace_path`` is the window's Chrome trace.
    """

    KIND: ClassVar[str] = "ops"
    t: float
    #: Windows taken so far, this one included.
    window: int
    began: float
    duration_s: float
    steps: int | None
    cost_s: float
    spacing_s: float
    #: Device (CUDA) activity was recorded in this window.
    device: bool
    sync_points: int
    copies: int
    ops: list[OpStat]
    #: The same over every window so far.
    total_steps: int
    total_duration_s: float
    total_sync_points: int
    total_copies: int
    cumulative: list[OpStat]
    #: Self time of the ops past the first MAX_OPS (window, cumulative).
    other_self_cpu_s: float = 0.0
    cumulative_other_self_cpu_s: float = 0.0
    trace_path: str | None = None
    #: Taken on a viewer's request (its trace is kept under its own name).
    requested: bool = False
    #: The options it ran with.
    record_shapes: bool = False
    with_stack: bool = False
    #: Reads of CPU tensors' values (this window, and every window over steps so far).
    host_reads: int = 0
    total_host_reads: int = 0
    #: Matmuls by input dtype, in windows that recorded inputs (``--profile-shapes``, or
    #: every few windows of a CUDA job): this window's (empty when it did not), and over
    #: every such window so far.
    matmuls: list[MatmulDtype] = field(default_factory=list)
    total_matmuls: list[MatmulDtype] = field(default_factory=list)
    #: ``torch.get_num_threads()`` in the thread that opened the window (the training
    #: thread's intra-op threads; the setting is per thread, so only that thread can tell).
    torch_threads: int | None = None
    #: The window's first step: what autograd saved for backward (the activations held at
    #: the step's peak), in all, and the top modules holding it. Empty when not measured.
    activation_bytes: int = 0
    activations: list[ModuleBytes] = field(default_factory=list)


MESSAGE_TYPES.update({OpsWindow.KIND: OpsWindow, StackSampled.KIND: StackSampled})


@dataclass(frozen=True)
class DeviceHolding:
    """Bytes on one device held by the parameters, the optimizers' gradients and the
    optimizers' state, each storage counted once (tied and shared weights once)."""

    device: str
    parameters: int
    gradients: int
    optimizer_state: int
    #: Of ``parameters``, those under no optimizer (frozen, an EMA copy, a teacher model).
    frozen: int = 0


@dataclass(frozen=True)
class MemoryHolders(Message):
    """What holds the memory, read at most once a second from the optimizers whose ``step``
    ran (``optimizers`` of them), with the parameters of the job's modules under no optimizer
    when ``modules_seen`` (the agent saw the modules built); else those are missing (counted
    as other allocated). A reader that does not know this kind skips it."""

    KIND: ClassVar[str] = "holders"
    t: float
    optimizers: int
    devices: list[DeviceHolding]
    modules_seen: bool = False


MESSAGE_TYPES[MemoryHolders.KIND] = MemoryHolders


@dataclass(frozen=True)
class CollectiveEntry:
    """One collective as one rank's flight recorder saw it: its process group, its sequence
    id in that group, the op, the input sizes, and when this rank enqueued, started and
    completed it (ns on the node's wall clock; 0 where the backend records none: gloo records
    the enqueue only)."""

    pg: str
    seq: int
    op: str
    sizes: list[list[int]]
    enqueued_ns: int
    started_ns: int = 0
    completed_ns: int = 0


@dataclass(frozen=True)
class CollectivesSeen(Message):
    """The collectives this rank's flight recorder holds that were not sent yet (read at most
    once a second)."""

    KIND: ClassVar[str] = "collectives"
    t: float
    entries: list[CollectiveEntry]


MESSAGE_TYPES[CollectivesSeen.KIND] = CollectivesSeen


def step_detail_weights(count: int, listed: int) -> list[int]:
    """How many steps each of the ``listed`` entries of a ``steps`` frame stands for."""
    if listed <= 0:
        return []
    if listed >= count:
        return [1] * listed
    return [(j + 1) * count // listed - j * count // listed for j in range(listed)]


# --------------------------------------------------------------------------------------------
# Encoding and decoding
# --------------------------------------------------------------------------------------------


def to_dict(message: Message) -> dict[str, Any]:
    """The JSON-ready dict of a message, with its ``kind``."""
    body = _plain(message)
    return {"kind": message.KIND, **body}


_SCALARS = (int, float, str, bool, type(None))
#: Each dataclass's field names, looked up once: ``dataclasses.fields`` costs more than the
#: copy itself, and the sampler encodes a few frames every tick.
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = tuple(f.name for f in dataclasses.fields(cls))
        _FIELD_NAMES[cls] = names
    return names


def _plain(value: Any) -> Any:
    """``dataclasses.asdict`` for message fields, several times faster on lists of numbers
    (a ``steps`` frame carries a few hundred): those are copied whole, not item by item."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if isinstance(value, list):
        if all(type(v) in _SCALARS for v in value):
            return list(value)
        return [_plain(v) for v in value]
    if kind in _FIELD_NAMES or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
        return {name: _plain(getattr(value, name)) for name in _field_names(kind)}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def encode(message: Message) -> bytes:
    """One frame: compact JSON and a newline."""
    data = json.dumps(to_dict(message), separators=(",", ":"), allow_nan=False).encode()
    if len(data) + 1 > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(data) + 1} bytes exceeds the {MAX_FRAME_BYTES} limit")
    return data + b"\n"


def decode(frame: bytes | str) -> Message | None:
    """Decode one frame; ``None`` for a well-formed frame of a kind this reader doesn't know.

    Raises :class:`ProtocolError` for anything malformed.
    """
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES} limit")
    try:
        obj = json.loads(frame)
    except RecursionError:
        raise ProtocolError("frame is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"frame is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("frame is not a JSON object")
    kind = obj.get("kind")
    if not isinstance(kind, str):
        raise ProtocolError("frame has no string 'kind'")
    cls = MESSAGE_TYPES.get(kind)
    if cls is None:
        return None
    try:
        try:
            message = _decoder(cls)(obj)
        except _Invalid:  # checked again, slower, to say which field is wrong and why
            message = _build(cls, {k: v for k, v in obj.items() if k != "kind"}, kind)
    except ProtocolError:
        raise
    except Exception as exc:  # a reader must never fail on a frame other than as malformed
        raise ProtocolError(f"{kind}: unreadable frame ({type(exc).__name__})") from None
    if not isinstance(message, Message):
        raise ProtocolError(f"{kind}: unreadable frame")
    return message


class _Invalid(Exception):
    """A value a compiled decoder refused; :func:`_build` then says which and why."""


#: Each class's compiled decoder (:func:`_decoder`).
_DECODERS: dict[type, Callable[[Any], Any]] = {}


def _decoder(cls: type) -> Callable[[Any], Any]:
    """A function that builds ``cls`` from a decoded JSON object with the same checks as
    :func:`_build`, compiled once from the type hints. It raises only :class:`_Invalid`, with
    no message: the agent sends tens of frames a second, and naming each value's place
    (``sample.memory[0].allocated_bytes``) cost the reader ten times the JSON parse. A frame
    it refuses is checked again by :func:`_build`, which names the fault."""
    decoder = _DECODERS.get(cls)
    if decoder is None:
        hints = _hints(cls)
        checks = [
            (
                f.name,
                _compile(hints[f.name]),
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in dataclasses.fields(cls)
        ]

        def decoder(obj: Any) -> Any:
            if not isinstance(obj, dict):
                raise _Invalid
            kwargs: dict[str, Any] = {}
            for name, check, required in checks:
                if name in obj:
                    kwargs[name] = check(obj[name])
                elif required:
                    raise _Invalid
            return cls(**kwargs)

        _DECODERS[cls] = decoder
    return decoder


def _compile(tp: Any) -> Callable[[Any], Any]:
    """The check of one field's type, as :func:`_check` does it."""
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        options = typing.get_args(tp)
        nullable = type(None) in options
        checks = [_compile(option) for option in options if option is not type(None)]

        def check_union(value: Any) -> Any:
            if value is None and nullable:
                return None
            for check in checks:
                try:
                    return check(value)
                except _Invalid:
                    pass
            raise _Invalid

        return check_union
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        item = _compile(item_tp)

        def check_list(value: Any) -> Any:
            if not isinstance(value, list):
                raise _Invalid
            return [item(v) for v in value]

        return check_list
    if tp is bool:
        return _check_bool
    if tp is int:
        return _check_int
    if tp is float:
        return _check_float
    if tp is str:
        return _check_str
    if dataclasses.is_dataclass(tp):
        return lambda value: _decoder(tp)(value)  # type: ignore[arg-type]
    return _refuse  # pragma: no cover


def _check_bool(value: Any) -> Any:
    if not isinstance(value, bool):
        raise _Invalid
    return value


def _check_int(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid
    return value


def _check_float(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Invalid
    value = float(value)
    if not math.isfinite(value):
        raise _Invalid
    return value


def _check_str(value: Any) -> Any:
    if not isinstance(value, str):
        raise _Invalid
    return value


def _refuse(value: Any) -> Any:  # pragma: no cover
    raise _Invalid


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = hints
    return hints


def _build(cls: type, obj: Any, where: str) -> Any:
    if not isinstance(obj, dict):
        raise ProtocolError(f"{where}: expected an object")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in obj:
            kwargs[f.name] = _check(hints[f.name], obj[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ProtocolError(f"{where}: missing field {f.name!r}")
    # Fields this reader does not know are ignored: a newer writer may add them.
    return cls(**kwargs)


def _check(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check(option, value, where)
            except ProtocolError as exc:
                errors.append(str(exc))
        raise ProtocolError(errors[0] if errors else f"{where}: unexpected value")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list")
        return [_check(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{where}: expected a boolean")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{where}: expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{where}: expected a number")
        value = float(value)
        if not math.isfinite(value):
            raise ProtocolError(f"{where}: expected a finite number")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{where}: expected a string")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)  # type: ignore[arg-type]
    raise ProtocolError(f"{where}: unsupported field type {tp!r}")  # pragma: no cover


# --------------------------------------------------------------------------------------------
# Framing
# --------------------------------------------------------------------------------------------


@dataclass
class FrameSplitter:
    """Cuts a byte stream into frames, refusing any frame longer than ``limit``.

    Feed it what ``recv`` returned; it yields each complete line (without the newline).
    """

    limit: int = MAX_FRAME_BYTES
    _buffer: bytearray = field(default_factory=bytearray)

    def feed(self, data: bytes) -> Iterator[bytes]:
        self._buffer += data
        start = 0
        while True:
            end = self._buffer.find(b"\n", start)
            if end < 0:
                break
            if end - start + 1 > self.limit:
                raise ProtocolError(f"frame exceeds the {self.limit}-byte limit")
            yield bytes(self._buffer[start:end])
            start = end + 1
        del self._buffer[:start]
        if len(self._buffer) >= self.limit:
            raise ProtocolError(f"frame exceeds the {self.limit}-byte limit")

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held back."""
        return len(self._buffer)

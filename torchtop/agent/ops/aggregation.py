"""Aggregation: plain events in, ranked ops and counts out.

Pure (no torch), so it is tested with made-up events; :mod:`.torch_events` copies torch's
events into :class:`Event` s, in the sampler thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torchtop.protocol import MAX_OPS, OpStat

#: The device runtime's calls that wait for the device: a sync point is one of these.
SYNC_CALLS = frozenset(
    {
        "cudaDeviceSynchronize",
        "cudaStreamSynchronize",
        "cudaEventSynchronize",
        "cudaMemcpy",
        "hipDeviceSynchronize",
        "hipStreamSynchronize",
        "hipEventSynchronize",
        "hipMemcpy",
    }
)
#: Reads of a tensor's value into Python: ``aten::item`` calls ``aten::_local_scalar_dense``
#: (which is also what ``bool(t)``, ``int(t)`` and ``.tolist()`` end in). On a device tensor
#: one waits for the device (the runtime's sync call nests inside it) and counts as one sync
#: point; on a CPU tensor (AdamW's ``step`` counters, even on a CUDA job) it waits for
#: nothing and counts as a host read.
HOST_READ_OPS = frozenset({"aten::item", "aten::_local_scalar_dense"})
#: Device activities that are copies: ``Memcpy HtoD (Pageable -> Device)`` and the like.
COPY_PREFIXES = ("Memcpy ", "Memcpy(")
#: Bookkeeping the profiler records around the ops, never listed (as ``key_averages`` does).
IGNORED = frozenset(
    {
        "[memory]",
        "[OutOfMemory]",
        "profiler::_record_function_enter",
        "profiler::_record_function_enter_new",
        "profiler::_record_function_exit",
        "aten::is_leaf",
        "aten::output_nr",
        "aten::_version",
    }
)
#: Distinct ops kept in the cumulative table; past that, new ones go to "other".
MAX_CUMULATIVE_KEYS = 5000
#: The ops whose input dtype tells whether matmuls run in float32 or a 16-bit type: the
#: matrix multiplies and convolutions that end on the GPU's tensor cores (or not).
MATMUL_OPS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::addbmm",
        "aten::_convolution",
    }
)


@dataclass(slots=True)
class Event:
    """One profiler event, copied out of torch's ``_KinetoEvent``. Times in nanoseconds."""

    name: str
    start: int
    end: int
    thread: int = 0
    #: Ran on a device (a kernel, a memcpy); CPU-side events are nested by time per thread.
    device: bool = False
    #: An op's own id (torch's counter), or a runtime call's or a kernel's (CUPTI's, another
    #: counter); ``linked``: for kernels and runtime calls, the id of the op that launched them.
    correlation: int = 0
    linked: int = 0
    #: A torch op or ``record_function`` range, whose ``correlation`` is torch's id; ``False``
    #: for a runtime or driver call (``cudaDeviceSynchronize``), whose id is CUPTI's.
    op: bool = True
    python: bool = False
    shapes: str | None = None
    #: The first input's dtype, for :data:`MATMUL_OPS` in windows that record inputs.
    dtype: str | None = None


@dataclass(slots=True)
class OpTotals:
    """Sums for one op (nanoseconds)."""

    calls: int = 0
    total_cpu: int = 0
    self_cpu: int = 0
    total_device: int = 0
    self_device: int = 0

    def add(self, other: OpTotals) -> None:
        self.calls += other.calls
        self.total_cpu += other.total_cpu
        self.self_cpu += other.self_cpu
        self.total_device += other.total_device
        self.self_device += other.self_device

    @property
    def self_ns(self) -> int:
        return self.self_cpu + self.self_device


#: An op's key: its name, its input shapes (``--profile-shapes``), its call site
#: (``--profile-stack``).
OpKey = tuple[str, str | None, str | None]


@dataclass(slots=True)
class WindowTotals:
    ops: dict[OpKey, OpTotals]
    sync_points: int = 0
    #: Reads of CPU tensors' values (``.item()`` and the like that waited for no device).
    host_reads: int = 0
    copies: int = 0
    device: bool = False
    #: Matmul calls by their input dtype (windows that recorded inputs).
    matmuls: dict[str, int] = dataclasses.field(default_factory=dict)


def aggregate(
    events: Iterable[Event], *, site_of: Callable[[str], str | None] | None = None
) -> WindowTotals:
    """Rank a window's events into per-op totals, and count its sync points, host reads and
    copies.

    CPU events nest by time within their thread: an op's self time is its duration less its
    children's. Device events (kernels, memcpy) are listed under their own names, and their
    time is also added to the op that launched them (self) and to that op's callers (total).
    Python function events (``--profile-stack``) are not listed; ``site_of(name)`` turns one
    into the call site of the ops under it (``None``: not the job's own code).
    """
    cpu: list[Event] = []
    device: list[Event] = []
    for event in events:
        if event.name in IGNORED:
            continue
        (device if event.device else cpu).append(event)
    cpu.sort(key=lambda e: (e.thread, e.start, -e.end))

    totals: dict[OpKey, OpTotals] = {}
    result = WindowTotals(ops=totals, device=bool(device))
    n = len(cpu)
    parent: list[int] = [-1] * n
    child_ns: list[int] = [0] * n
    #: The outermost host read each event runs inside (itself included), -1 outside any.
    read_of: list[int] = [-1] * n
    #: Host reads (outermost) that waited for the device.
    synced: set[int] = set()
    sites: list[str | None] = [None] * n
    keys: list[OpKey | None] = [None] * n
    by_correlation: dict[int, int] = {}
    stack: list[int] = []
    thread: int | None = None
    for i, event in enumerate(cpu):
        if event.thread != thread:
            thread = event.thread
            stack.clear()
        while stack and cpu[stack[-1]].end <= event.start:
            stack.pop()
        # An event that outlives the one on top (async or badly nested) is nobody's child.
        up = stack[-1] if stack and event.end <= cpu[stack[-1]].end else -1
        parent[i] = up
        if up >= 0:
            child_ns[up] += event.end - event.start
            sites[i] = sites[up]
        read_of[i] = read_of[up] if up >= 0 else -1
        if read_of[i] < 0 and event.name in HOST_READ_OPS:
            read_of[i] = i
            result.host_reads += 1
        if event.name in SYNC_CALLS:
            if read_of[i] < 0:
                result.sync_points += 1  # the job's own synchronize() or copy
            elif read_of[i] not in synced:
                synced.add(read_of[i])  # a read of a device tensor: one sync point
                result.sync_points += 1
                result.host_reads -= 1
        if event.python:
            if site_of is not None:
                site = site_of(event.name)
                if site is not None:
                    sites[i] = site
        else:
            keys[i] = (event.name, event.shapes, sites[i])
            if event.op and event.correlation:
                by_correlation[event.correlation] = i
            if event.dtype is not None:
                result.matmuls[event.dtype] = result.matmuls.get(event.dtype, 0) + 1
        stack.append(i)

    for i, event in enumerate(cpu):
        key = keys[i]
        if key is None:
            continue
        op = totals.get(key)
        if op is None:
            op = totals[key] = OpTotals()
        duration = event.end - event.start
        op.calls += 1
        op.total_cpu += duration
        op.self_cpu += max(0, duration - child_ns[i])

    for event in device:
        duration = max(0, event.end - event.start)
        if event.name.startswith(COPY_PREFIXES):
            result.copies += 1
        key = (event.name, None, None)
        op = totals.get(key)
        if op is None:
            op = totals[key] = OpTotals()
        op.calls += 1
        op.total_device += duration
        op.self_device += duration
        # The launching op (found by correlation) gets the time as its own, its callers as
        # part of their totals.
        i = by_correlation.get(event.linked, -1) if event.linked else -1
        first = True
        while i >= 0:
            key_i = keys[i]
            if key_i is not None:
                owner = totals[key_i]
                owner.total_device += duration
                if first:
                    owner.self_device += duration
                    first = False
            i = parent[i]
    return result


def merge(into: dict[OpKey, OpTotals], window: dict[OpKey, OpTotals]) -> None:
    """Add a window's ops to the cumulative table, bounded at MAX_CUMULATIVE_KEYS ops."""
    for key, op in window.items():
        mine = into.get(key)
        if mine is None:
            if len(into) >= MAX_CUMULATIVE_KEYS:
                key = ("(other ops)", None, None)
                mine = into.setdefault(key, OpTotals())
            else:
                mine = into[key] = OpTotals()
        mine.add(op)


def ranked(
    ops: dict[OpKey, OpTotals], *, device: bool, limit: int = MAX_OPS
) -> tuple[list[OpStat], float]:
    """The ``limit`` ops with the most self time (CPU plus device), and the self CPU seconds of
    the rest."""
    order = sorted(ops.items(), key=lambda item: (-item[1].self_ns, -item[1].calls, item[0][0]))
    listed = [
        OpStat(
            name=name,
            calls=op.calls,
            total_cpu_s=op.total_cpu / 1e9,
            self_cpu_s=op.self_cpu / 1e9,
            total_device_s=op.total_device / 1e9 if device else None,
            self_device_s=op.self_device / 1e9 if device else None,
            shapes=shapes,
            site=site,
        )
        for (name, shapes, site), op in order[:limit]
    ]
    other = sum(op.self_cpu for _, op in order[limit:]) / 1e9
    return listed, other

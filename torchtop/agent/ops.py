"""Op timings from sampled ``torch.profiler`` windows.

The profiler costs too much to leave on (a small model runs 1.5 times slower or worse), so
the agent samples it: a *window* of a step or two, then a pause long enough that the
windows' measured cost stays within a budget (2 % by default). The profiler records the ops
of the thread that starts it, so windows open and close in the training thread, at step
boundaries: the sampler thread *arms* a window and the step hook of
:mod:`torchtop.agent.steps` opens it at the next boundary of the step clock and closes it
``window_steps`` boundaries later. Until then the hook costs one list lookup. A job with no
steps gets time-based windows, opened and closed between two bytecodes of the main thread
(``Py_AddPendingCall``).

Only starting and stopping the profiler happen in the training thread (well under a
millisecond each, measured per window). Reading the events, ranking the ops, counting sync
points and copies and writing the Chrome trace happen in the sampler thread.

The job's own profiler always wins: while it runs, no window opens; if it starts while one of
ours is open, ours is stopped first and thrown away, and the viewer is told "op timings
unavailable" until the job's profiler ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from torchtop.agent import steps as step_hooks
from torchtop.private_files import written_privately
from torchtop.protocol import MAX_OPS, MatmulDtype, Message, OpStat, OpsWindow, ProbeStatus

PROBE = "ops"
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
OWN_PROFILER = "the job is running its own torch.profiler"
WAITING_FOR_CUDA = (
    "waiting for the job to use CUDA: on this CUDA build of PyTorch, a window opened earlier "
    "would initialize CUDA in the job"
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
#: On a CUDA job, one window in this many records its ops' inputs (their dtypes) even
#: without ``--profile-shapes``: recording inputs makes each profiled op dearer, and the
#: matmuls' dtype seldom changes.
DTYPE_WINDOW_EVERY = 4


# --------------------------------------------------------------------------------------------
# Aggregation: plain events in, ranked ops and counts out (pure, tested with made-up events)
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Reading torch's events (sampler thread)
# --------------------------------------------------------------------------------------------


def _shapes(value: Any) -> str | None:
    if not value:
        return None
    if all(not shape for shape in value):
        return None
    return ", ".join("[" + ", ".join(str(d) for d in shape) + "]" for shape in value)


#: kineto's activity types of torch's own events (``CPU_OP``, ``USER_ANNOTATION``): their
#: correlation id is torch's op id, which kernels and runtime calls link to.
TORCH_OP_ACTIVITIES = (0, 1)


def _runtime_call(name: str) -> bool:
    """A CUDA or HIP runtime or driver call, by its name (``cudaLaunchKernel``,
    ``cuLaunchKernel``, ``hipMemcpyAsync``): for a torch with no ``activity_type``."""
    return name.startswith(("cuda", "hip")) or (name.startswith("cu") and name[2:3].isupper())


def read_events(
    result: Any,
    *,
    record_shapes: bool,
    links: bool = True,
    python: bool = False,
    dtypes: bool = False,
) -> list[Event]:
    """Copy a ``_ProfilerResult``'s events into :class:`Event` s.

    Each method call on torch's event costs a fraction of a microsecond and a window may hold
    thousands of events, so only what is needed is read: correlations (``links``) only when
    device activity was recorded, Python frames (``python``) only with ``--profile-stack``,
    the input dtype (``dtypes``, a window that recorded inputs) only of :data:`MATMUL_OPS`.
    """
    from torch.autograd import DeviceType

    raw_events = result.events()
    if not raw_events:
        return []
    first = raw_events[0]
    has_ns = hasattr(first, "start_ns")  # torch 2.0: microseconds only
    has_hidden = hasattr(first, "is_hidden_event")
    has_annotation = hasattr(first, "is_user_annotation")  # torch 2.1 on
    has_activity = links and hasattr(first, "activity_type")
    python = python and hasattr(first, "is_python_function")
    cpu_type = DeviceType.CPU
    out: list[Event] = []
    append = out.append
    for raw in raw_events:
        if has_hidden and raw.is_hidden_event():
            continue
        device = raw.device_type() != cpu_type
        # A range of record_function on the device's timeline (``Optimizer.step#AdamW.step``
        # around the kernels it launched) is no op: its time is its kernels' time, counted
        # already. torch's own tables leave it out of device time too.
        if device and has_annotation and raw.is_user_annotation():
            continue
        if has_ns:
            start = raw.start_ns()
            end = raw.end_ns()
        else:
            start = int(raw.start_us() * 1000)
            end = start + int(raw.duration_us() * 1000)
        is_python = python and raw.is_python_function()
        name = raw.name()
        dtype = None
        if dtypes and name in MATMUL_OPS:
            inputs = raw.dtypes()
            dtype = str(inputs[0]) if inputs and inputs[0] else None
        append(
            Event(
                name=name,
                start=start,
                end=end,
                thread=raw.start_thread_id(),
                device=device,
                correlation=raw.correlation_id() if links else 0,
                linked=raw.linked_correlation_id() if links else 0,
                op=(
                    raw.activity_type() in TORCH_OP_ACTIVITIES
                    if has_activity
                    else not _runtime_call(name)
                ),
                python=is_python,
                shapes=_shapes(raw.shapes()) if record_shapes and not is_python else None,
                dtype=dtype,
            )
        )
    return out


def site_reader(exclude: Iterable[str]) -> Callable[[str], str | None]:
    """``site_of`` for :func:`aggregate`: a Python event's name (``file.py(12): fn``) when the
    file is the job's own, else ``None``.

    Library files are those under one of the ``exclude`` directories. The profiler names a
    file relative to the first of ``sys.path`` (and the site directories) that holds it, so a
    relative name is looked for under those, longest first, as torch made it.
    """
    prefixes = tuple(str(Path(p)) + os.sep for p in exclude)
    roots = _path_roots()
    cache: dict[str, str | None] = {}

    def resolve(path: str) -> str | None:
        if os.path.isabs(path):
            return path
        for root in roots:
            candidate = os.path.join(root, path)
            if os.path.exists(candidate):
                return candidate
        return None

    def site_of(name: str) -> str | None:
        if name in cache:
            return cache[name]
        site: str | None = None
        paren = name.find("(")
        if paren > 0 and not name.startswith("<"):
            path = resolve(name[:paren])
            if path is not None and not path.startswith(prefixes):
                site = f"{os.path.basename(path)}{name[paren:]}"
        cache[name] = site
        return site

    return site_of


def _path_roots() -> list[str]:
    """The directories torch's Python tracer strips from file names, longest first."""
    import site

    raw = list(sys.path)
    with contextlib.suppress(Exception):
        raw += [*site.getsitepackages(), site.getuserbase(), site.getusersitepackages()]
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    if isinstance(torch_file, str):
        raw.append(os.path.dirname(os.path.dirname(torch_file)))
    return sorted({os.path.abspath(p) for p in raw if isinstance(p, str)}, reverse=True)


def _library_dirs() -> list[str]:
    """Directories whose frames are never a call site: torch, torchtop, the standard library,
    installed packages."""
    import site

    dirs = [os.path.dirname(os.__file__)]
    for name in ("torch", "torchtop"):
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if file:
            dirs.append(os.path.dirname(file))
    with contextlib.suppress(Exception):
        dirs.extend(site.getsitepackages())
        dirs.append(site.getusersitepackages())
    return dirs


# --------------------------------------------------------------------------------------------
# Starting and stopping the profiler (training thread)
# --------------------------------------------------------------------------------------------


#: Functions torch calls back from C++ with its own thread-local state around the call.
CALLBACK_NAMES = frozenset({"__torch_dispatch__", "__torch_function__"})
#: Parts of torch whose Python code runs under C++ that saved the thread's state (the autograd
#: engine, custom autograd Functions, dispatch modes, custom ops, the compiler).
CALLBACK_PARTS = ("autograd", "utils/_python_dispatch.py", "_ops.py", "overrides.py", "_dynamo")
_callback_prefixes: tuple[str, ...] | None = None


def inside_torch_callback(frame: FrameType | None) -> bool:
    """Is this Python stack running inside C++ code of torch that called back into Python?

    There, torch restores the thread's state when the call returns: a profiler started (or
    stopped) inside would be undone behind its back, and the job could crash. So windows only
    open and close where the stack holds none of that: in the job's own loop, or in an
    optimizer step the job called from it (not one called from a backward hook).
    """
    global _callback_prefixes
    prefixes = _callback_prefixes
    if prefixes is None:
        root = os.path.dirname(getattr(sys.modules.get("torch"), "__file__", None) or "")
        prefixes = tuple(os.path.join(root, *p.split("/")) for p in CALLBACK_PARTS)
        if root:
            _callback_prefixes = prefixes
        else:  # not loaded yet: no torch code on any stack
            prefixes = ()
    while frame is not None:
        code = frame.f_code
        if code.co_name in CALLBACK_NAMES or code.co_filename.startswith(prefixes):
            return True
        frame = frame.f_back
    return False


def user_profiler_running() -> bool:
    """The job (or anyone but us) has a profiler on in this thread, or torch says one is on."""
    profiler = sys.modules.get("torch.autograd.profiler")
    if profiler is not None and getattr(profiler, "_is_profiler_enabled", False):
        return True
    torch = sys.modules.get("torch")
    try:
        return bool(torch._C._autograd._profiler_enabled())  # type: ignore[union-attr]
    except Exception:
        return False


def cuda_not_started() -> bool:
    """On a CUDA (or ROCm) build of torch, the job has not initialized CUDA yet. Starting the
    profiler then, even for CPU activities only, asks for the device count and loads CUPTI:
    it would initialize CUDA in the job (and break the CUDA of children it forks later)."""
    cuda = sys.modules.get("torch.cuda")
    try:
        return cuda is not None and bool(cuda._is_compiled()) and not cuda.is_initialized()
    except Exception:
        return False


class _Profiler:
    """torch's profiler entry points, found once torch is loaded."""

    def __init__(self, *, record_shapes: bool, with_stack: bool) -> None:
        import torch
        from torch._C._profiler import (
            ProfilerActivity,
            ProfilerConfig,
            ProfilerState,
            _ExperimentalConfig,
        )
        from torch.autograd import profiler

        def config(shapes: bool) -> Any:
            args = (ProfilerState.KINETO, shapes, False, with_stack, False, False)
            try:
                return ProfilerConfig(*args, _ExperimentalConfig(), "")
            except TypeError:  # before torch 2.4: no trace id
                return ProfilerConfig(*args, _ExperimentalConfig())

        self.config = config(record_shapes)
        #: The same, recording the ops' inputs (for their dtypes).
        self.inputs_config = self.config if record_shapes else config(True)
        self.get_num_threads = torch.get_num_threads
        self.cpu = {ProfilerActivity.CPU}
        self.cuda = {ProfilerActivity.CPU, ProfilerActivity.CUDA}
        self._cuda = torch.cuda
        self._prepare = profiler._prepare_profiler
        self._enable = profiler._enable_profiler
        self._disable = profiler._disable_profiler
        self.device_failed = False

    def cuda_initialized(self) -> bool:
        return bool(self._cuda.is_initialized())

    def start(self, *, inputs: bool = False) -> bool:
        """Start (recording the ops' inputs too if ``inputs``); True when device activity is
        recorded too."""
        _KINETO_STARTED[0] = True
        config = self.inputs_config if inputs else self.config
        device = not self.device_failed and self._cuda.is_initialized()
        if device:
            try:
                self._prepare(config, self.cuda)
                self._enable(config, self.cuda)
                return True
            except Exception:
                self.device_failed = True  # no CUPTI: CPU-side ops only from now on
                with contextlib.suppress(Exception):
                    self._disable()
        self._prepare(config, self.cpu)
        self._enable(config, self.cpu)
        return False

    def sync(self) -> None:
        """Wait for the kernels the job queued (what torch's ``profile.__exit__`` does
        before it stops), so that they are inside the window."""
        self._cuda.synchronize()

    def stop(self) -> Any:
        return self._disable()


IDLE, ARMED, OPEN = range(3)
#: Step boundaries in a row inside torch's callbacks before windows stop waiting for steps.
REFUSED_LIMIT = 16
#: How long the job's profiler, starting in another thread, waits for ours to stop.
OWNER_WAIT_S = 2.0
#: What one profiled event costs the job until windows over steps have measured it: about
#: 2 µs on a CPU (measured on many tiny ops: 1.8 µs; on a small MLP: 1-4 µs).
EVENT_COST_S = 2e-6
#: How long a window's frame waits for a step after it to measure its cost (else: estimated).
MEASURE_WAIT_S = 2.0
#: Steps before a window whose median is the usual step time.
USUAL_STEPS = 64
#: Requested windows: at most one a second, and the last KEPT_TRACES traces kept.
REQUEST_GAP_S = 1.0
KEPT_TRACES = 20
#: Kineto's log level that keeps its per-window start/stop lines off the job's stderr.
KINETO_QUIET = "6"
#: The agent set KINETO_LOG_LEVEL (the job had not): taken back once kineto has read it.
_KINETO_DEFAULTED = [False]
#: A profiler (ours or the job's) has started in this process, so kineto's config thread runs.
_KINETO_STARTED = [False]


def kineto_started() -> bool:
    """Has kineto started its config thread in this process (a profiler ran, or the job asked
    for kineto's daemon mode, which starts it at import)?"""
    return _KINETO_STARTED[0] or bool(os.environ.get("KINETO_USE_DAEMON"))


def skip_inherited_destructors() -> bool:
    """In a child forked from a process where kineto ran: end the child, once Python has
    finished (its ``atexit`` handlers run and its files are flushed), without the C++
    destructors of the state it inherited, as ``os._exit`` would, with the same exit status.

    Kineto's config thread waits on a condition variable most of the time; a fork copies the
    variable with that thread counted as a waiter, but not the thread, so destroying it in the
    child (a static destructor, at exit) waits forever: ``sys.exit()`` in a forked child hung.
    glibc's ``on_exit`` runs the handlers registered after the fork first, then this one,
    which is ``_exit(status)`` itself (no Python runs that late). False where libc has no
    ``on_exit``.
    """
    try:
        libc = ctypes.CDLL(None)
        on_exit = libc.on_exit
        exit_now = ctypes.cast(libc._exit, ctypes.c_void_p)
    except (OSError, AttributeError):
        return False
    on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    on_exit.restype = ctypes.c_int
    return on_exit(exit_now, None) == 0


def quiet_kineto() -> None:
    """Keep kineto's two lines per window off the job's stderr, unless the job chose a level.
    This level hides kineto's own warnings too, for as long as it is set: until the first
    window has started (kineto reads it once), so that the job's children do not inherit it."""
    if "KINETO_LOG_LEVEL" not in os.environ:
        os.environ["KINETO_LOG_LEVEL"] = KINETO_QUIET
        _KINETO_DEFAULTED[0] = True


def _raise_in_this_thread_later(exc: BaseException) -> None:
    """Have ``exc`` raised in this thread as its next Python function (outside this module) is
    entered: a pending call runs inside C code of the interpreter, where an exception cannot
    be raised. A profile function (``sys.setprofile``) raises it once and removes itself."""
    previous = sys.getprofile()
    here = __file__

    def deliver(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or frame.f_code.co_filename == here:
            return
        sys.setprofile(previous)
        raise exc

    sys.setprofile(deliver)


#: Nesting depth of :func:`paused` sections: no window opens while above zero.
_paused = [0]
#: The agent's sampler, for :func:`paused` to close a window that is open.
_active: list[OpsSampler | None] = [None]


def window() -> contextlib.AbstractContextManager[bool]:
    """A window around a section, now, if an agent samples op timings in this process (yields
    whether one opened): see :meth:`OpsSampler.window`."""
    sampler = _active[0]
    if sampler is None:
        return contextlib.nullcontext(False)
    return sampler.window()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No op window in this section: one open in this thread closes first, and none opens
    until the section ends. For code that times itself (the demos' timing passes), which a
    profiled step would slow down several times."""
    _paused[0] += 1
    sampler = _active[0]
    if sampler is not None:
        sampler.close_now(disarm=False)
    try:
        yield
    finally:
        _paused[0] -= 1


@dataclass(slots=True)
class _Closed:
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


@dataclass(slots=True)
class _Measuring:
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


def records_inputs(opened: int, *, shapes: bool, cuda: bool) -> bool:
    """Does the window after ``opened`` windows record its ops' inputs? Always with
    ``--profile-shapes``; on a CUDA job, the first and every DTYPE_WINDOW_EVERY-th after it
    (for the matmuls' dtypes); on a CPU job, never (float32 is the CPU's usual type)."""
    return shapes or (cuda and opened % DTYPE_WINDOW_EVERY == 0)


def _dtype_list(counts: dict[str, int]) -> list[MatmulDtype]:
    return [MatmulDtype(d, n) for d, n in sorted(counts.items(), key=lambda item: -item[1])]


def _usual_step(ends: deque[tuple[float, float]] | None, before: float) -> float | None:
    """The median duration of the latest steps that ended before ``before``."""
    if not ends:
        return None
    durations = [d for e, d in ends if e <= before][-USUAL_STEPS:]
    return statistics.median(durations) if durations else None


def _excess(
    ends: deque[tuple[float, float]], start: float, done: float, usual: float
) -> float | None:
    """What the steps from ``start`` to the first that ended after ``done`` took beyond
    ``usual`` each; ``None`` until such a step has ended (or if the steps from ``start`` on are
    no longer all at hand)."""
    if not ends or ends[0][0] > start or ends[-1][0] <= done:
        return None
    last = next(e for e, _ in ends if e > done)
    return sum(max(0.0, d - usual) for e, d in ends if start < e <= last)


class OpsSampler:
    """Schedules the windows, opens and closes them in the training thread, and turns their
    events into ``ops`` frames in the sampler thread."""

    def __init__(
        self,
        *,
        trace_dir: Path,
        trace_prefix: str,
        window_steps: int = 2,
        budget: float = 0.02,
        min_spacing_s: float = 5.0,
        first_after_steps: int = 3,
        time_window_s: float = 0.2,
        time_fallback_s: float = 5.0,
        record_shapes: bool = False,
        with_stack: bool = False,
    ) -> None:
        self.trace_dir = Path(trace_dir)
        self.trace_prefix = trace_prefix
        self.window_steps = max(1, window_steps)
        self.budget = budget
        self.min_spacing_s = min_spacing_s
        self.first_after_steps = first_after_steps
        self.time_window_s = time_window_s
        self.time_fallback_s = time_fallback_s
        self.record_shapes = record_shapes
        self.with_stack = with_stack
        #: The step clock's key (:attr:`StepCollector.clock`), set by the sampler thread.
        self.clock: int | str | None = None
        self.spacing_s = min_spacing_s
        self.windows = 0
        #: (start, stop, total) cost of the latest windows, in seconds (benchmarks read it).
        self.costs: deque[tuple[float, float, float]] = deque(maxlen=256)
        # -- training-thread state (changed only there once a window is armed) ------------
        self._state = IDLE
        self._thread: int | None = None
        self._steps_in = 0
        self._opened_at = 0.0
        self._began = 0.0
        self._start_cost = 0.0
        self._device = False
        self._inputs = False
        self._torch_threads: int | None = None
        #: Windows opened so far (training thread).
        self._opened = 0
        self._requested_window = False
        self._time_based = False
        #: Opened by :meth:`window` around a section: only its end closes it.
        self._explicit = False
        self._closed: deque[_Closed] = deque(maxlen=4)
        #: Windows whose cost is measured on the steps that follow them (sampler thread).
        self._measuring: deque[_Measuring] = deque()
        #: The window's owner (the thread that opened it) should close it at its next chance:
        #: the profiler can only be stopped from that thread.
        self._close_requested = False
        self._discard = False
        #: Boundaries in a row refused (inside torch's callbacks): past REFUSED_LIMIT the
        #: steps are no place for windows, and time-based windows take over.
        self._refused = 0
        self._steps_unsafe = False
        self._pid = os.getpid()
        #: A pending call to open (close) the window in the main thread is queued.
        self._opening = False
        self._closing = False
        #: Armed for a time-based window (no step clock).
        self._time_armed = False
        self._profiler: _Profiler | None = None
        # -- sampler-thread state ---------------------------------------------------------
        self._request = threading.Event()
        self._next_due = 0.0
        self._started = time.monotonic()
        #: A window over steps has been armed (the first comes as soon as steps do).
        self._step_window_armed = False
        #: What one profiled event costs the job in seconds: learned from windows over steps
        #: (their slowdown per event), to price time-based windows, whose slowdown is unseen.
        self._event_costs: deque[float] = deque([EVENT_COST_S], maxlen=16)
        #: Why the last window failed (cleared by the next that opens).
        self._failure: str | None = None
        #: The job's own profiler is on: from our guard on its start and stop, or seen running
        #: when a window was due to open.
        self._user_profiler = False
        self._blocked = False
        #: On a CUDA build, the job has not initialized CUDA: no window may open yet.
        self._cuda_wait = False
        self._reported: str | None = None
        self._failures = 0
        self._stopped = False
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
        self._last_closed = 0.0
        #: The step collector's latest step durations.
        self._recent_steps: deque[float] = deque()
        self._pending_calls: list[Any] = []  # ctypes callbacks must outlive the call
        self._site_of: Callable[[str], str | None] | None = None
        self._lock = threading.Lock()
        _active[0] = self

    def forget_in_child(self) -> None:
        """In a forked child: no agent, so no windows (a pending call queued before the fork
        finds the pid changed and does nothing), and an exit that cannot hang in kineto."""
        self._stopped = True
        self._state = IDLE
        if _active[0] is self:
            _active[0] = None
        if kineto_started():
            skip_inherited_destructors()

    # -- requests from other threads ---------------------------------------------------------

    def resumed_after(self, paused_s: float) -> None:
        """The agent's sampler was paused for ``paused_s`` seconds (the overhead benchmark's
        "off" blocks): no window could open meanwhile, so that time does not count toward the
        spacing, which keeps the windows' share of the time sampled within the budget."""
        self._next_due += paused_s

    def request_window(self) -> None:
        """A viewer asked for a window now (server I/O thread): the next tick arms one."""
        self._request.set()

    # -- training thread ---------------------------------------------------------------------

    def at_boundary(self, key: int | str) -> None:
        """A step ended (the optimizer post hook or ``torchtop.step()``). Never raises."""
        try:
            if key != self.clock:
                return
            if self._state == ARMED:
                if _paused[0]:
                    return
                if inside_torch_callback(sys._getframe(1)):
                    self._refuse()
                    return
                self._refused = 0
                self._open(time_based=False)
            elif self._state == OPEN and self._thread == threading.get_ident():
                if not self._time_based:
                    self._steps_in += 1
                due = self._close_requested or (
                    not self._time_based
                    and not self._explicit
                    and self._steps_in >= self.window_steps
                )
                if due and not inside_torch_callback(sys._getframe(1)):
                    self._close(keep=not self._discard)
        except Exception as exc:  # pragma: no cover - the profiler failed in a new way
            self._fail(exc)

    def _open(self, *, time_based: bool) -> None:
        self._state = IDLE
        self._time_armed = False
        step_hooks.BOUNDARY[0] = None if time_based else self.at_boundary
        if os.getpid() != self._pid or self._stopped:  # a forked child, or after the agent
            step_hooks.BOUNDARY[0] = None
            return
        if user_profiler_running():
            self._blocked = True
            step_hooks.BOUNDARY[0] = None
            return
        began = time.time()
        t0 = time.perf_counter()
        try:
            profiler = self._profiler
            if profiler is None:
                profiler = self._profiler = _Profiler(
                    record_shapes=self.record_shapes, with_stack=self.with_stack
                )
            self._inputs = records_inputs(
                self._opened, shapes=self.record_shapes, cuda=profiler.cuda_initialized()
            )
            self._opened += 1
            self._torch_threads = profiler.get_num_threads()
            self._device = profiler.start(inputs=self._inputs)
        except Exception as exc:
            step_hooks.BOUNDARY[0] = None
            self._fail(exc)
            return
        t1 = time.perf_counter()
        self._thread = threading.get_ident()
        self._time_based = time_based
        self._explicit = False
        self._began = began
        self._start_cost = t1 - t0
        self._opened_at = t1
        self._steps_in = 0
        self._close_requested = False
        self._discard = False
        self._state = OPEN
        self._failures = 0
        self._failure = None
        if _KINETO_DEFAULTED[0]:
            # Kineto has read its log level by now: the job's children need not inherit ours.
            _KINETO_DEFAULTED[0] = False
            if os.environ.get("KINETO_LOG_LEVEL") == KINETO_QUIET:
                del os.environ["KINETO_LOG_LEVEL"]

    def _close(self, *, keep: bool = True) -> None:
        """Stop the profiler: only the thread that started it can (torch's profiler state is
        per thread). From any other thread, the owner is asked to, at its next boundary."""
        if self._thread != threading.get_ident():
            self._discard = self._discard or not keep
            self._close_requested = True
            return
        profiler = self._profiler
        # No tick arms the next window while this one stops (it may take a while).
        self._next_due = time.monotonic() + max(self.min_spacing_s, self.spacing_s)
        self._state = IDLE
        step_hooks.BOUNDARY[0] = None
        self._close_requested = False
        if profiler is None:
            return
        t0 = time.perf_counter()
        if self._device:
            # Kernels still queued would fall outside the window; the wait is its cost.
            with contextlib.suppress(Exception):
                profiler.sync()
        try:
            result = profiler.stop()
        except Exception as exc:
            self._fail(exc)
            return
        t1 = time.perf_counter()
        if keep:
            self._closed.append(
                _Closed(
                    result=result,
                    began=self._began,
                    opened_at=self._opened_at - self._start_cost,
                    wall_s=t0 - self._opened_at,
                    start_cost_s=self._start_cost,
                    stop_cost_s=t1 - t0,
                    steps=None
                    if self._time_based or (self._explicit and not self._steps_in)
                    else self._steps_in,
                    device=self._device,
                    requested=self._requested_window,
                    inputs=self._inputs,
                    torch_threads=self._torch_threads,
                )
            )
        self._requested_window = False
        self._last_closed = time.monotonic()

    def _refuse(self) -> None:
        """A boundary inside torch's callbacks (an optimizer stepped from backward, or in a
        compiled region): no window there. Too many in a row, and the steps are given up."""
        self._refused += 1
        if self._refused >= REFUSED_LIMIT:
            self._steps_unsafe = True
            self._state = IDLE
            step_hooks.BOUNDARY[0] = None

    def _fail(self, exc: BaseException) -> None:
        self._failures += 1
        self._failure = f"the profiler failed: {exc!r}"

    @contextlib.contextmanager
    def window(self) -> Iterator[bool]:
        """A window around a section of this thread, now, whatever the spacing (the demos
        profile one call of each phase this way). Yields whether a window opened: none opens
        while another is open, the job's own profiler runs, or inside a callback from torch.
        Its frame counts the steps that ended inside (``None`` if none did)."""
        opened = False
        if (
            self._state != OPEN
            and not self._user_profiler
            and self._failures < 3
            and not inside_torch_callback(sys._getframe(2))
            and not cuda_not_started()
        ):
            self._open(time_based=False)
            opened = self._state == OPEN
            if opened:
                self._explicit = True
                step_hooks.BOUNDARY[0] = self.at_boundary
        try:
            yield opened
        finally:
            if opened and self._state == OPEN and self._explicit:
                self._close()

    def user_profiler_starting(self) -> None:
        """The job is starting its own profiler (our guard on ``profile._prepare_trace``).

        Ours stops first, so that the job's own profile is complete and unchanged; the window
        is thrown away."""
        self._user_profiler = True
        _KINETO_STARTED[0] = True
        if self._state == OPEN:
            self._close(keep=False)
            # Opened by another thread: its owner stops it at its next step boundary. Give it
            # that long (bounded), so that the two profilers never run at once.
            deadline = time.monotonic() + OWNER_WAIT_S
            while self._state == OPEN and time.monotonic() < deadline:
                time.sleep(0.001)
        elif self._state == ARMED:
            self._state = IDLE
            step_hooks.BOUNDARY[0] = None

    def user_profiler_stopped(self) -> None:
        self._user_profiler = False

    def close_now(self, *, disarm: bool = True) -> None:
        """Close an open window if this thread opened it (at the agent's stop, at exit), and
        unless told otherwise disarm one that waits for a step."""
        if self._state == OPEN:
            with contextlib.suppress(Exception):
                self._close()  # from another thread: asks the owner
            if self._state == OPEN and self._thread == threading.main_thread().ident:
                self._closing = self._in_main_thread(self._close_in_main_thread)
        elif self._state == ARMED and disarm:
            self._state = IDLE
            step_hooks.BOUNDARY[0] = None

    # -- the main thread, for time-based windows ----------------------------------------------

    def _in_main_thread(self, fn: Callable[[FrameType | None], None]) -> bool:
        """Run ``fn(frame)`` in the main thread between two of its bytecodes (``frame`` is the
        one it was running then). False if it could not be queued."""

        def call(_arg: Any) -> int:
            try:
                try:
                    # The frame the main thread was running when the call came in.
                    fn(sys._getframe(1))
                finally:
                    with contextlib.suppress(ValueError):
                        self._pending_calls.remove(callback)
            except Exception:
                pass
            except BaseException as exc:
                # A signal's handler ran in here (Ctrl-C, a SIGTERM handler calling sys.exit):
                # raised through ctypes it would be lost, so the job gets it right after.
                _raise_in_this_thread_later(exc)
            return 0

        callback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(call)
        self._pending_calls.append(callback)
        if ctypes.pythonapi.Py_AddPendingCall(callback, None) != 0:
            self._pending_calls.remove(callback)
            return False
        return True

    def _open_time_window(self, frame: FrameType | None) -> None:
        self._opening = False
        if (
            self._state == ARMED
            and self._time_armed
            and not _paused[0]
            and not inside_torch_callback(frame)
        ):
            self._open(time_based=True)
        # Else the main thread was inside a callback from torch: the next tick asks again.

    def _close_in_main_thread(self, frame: FrameType | None) -> None:
        self._closing = False
        if self._state != OPEN or self._thread != threading.get_ident():
            return
        if not inside_torch_callback(frame):
            self._close(keep=not self._discard)

    def _overdue_s(self) -> float:
        """How long a step window may stay open: ten times its steps' usual time, 2 s at least."""
        typical = statistics.median(self._recent_steps) if self._recent_steps else 0.0
        return max(2.0, 10 * self.window_steps * typical)

    # -- sampler thread ----------------------------------------------------------------------

    def tick(self, now: float, steps: Any) -> list[Message]:
        """Schedule windows and turn closed ones into frames. ``steps`` is the
        :class:`~torchtop.agent.steps.StepCollector`."""
        with self._lock:
            if self._stopped:
                return []
            return self._tick(now, steps)

    def _tick(self, now: float, steps: Any) -> list[Message]:
        messages: list[Message] = []
        self.clock = steps.clock
        self._recent_steps = steps.recent
        monotonic = time.monotonic()
        while self._closed:
            frame = self._frame(self._closed.popleft(), getattr(steps, "ends", None))
            if frame is not None:
                messages.append(frame)
        messages.extend(self._measured(getattr(steps, "ends", None)))
        if self._blocked and not user_profiler_running():
            self._blocked = False  # the job's profiler has ended
        self._cuda_wait = self._state == IDLE and cuda_not_started()
        status = self._status(now)
        if status is not None:
            messages.append(status)
        if self._failures >= 3:
            return messages
        if self._state == OPEN and self._explicit:
            return messages
        if self._state == OPEN:
            # A time-based window is done; a step window that ran far past its steps (the
            # job left its training loop) must not go on recording everything.
            limit = self.time_window_s if self._time_based else self._overdue_s()
            if time.perf_counter() - self._opened_at >= limit and not self._closing:
                self._closing = self._in_main_thread(self._close_in_main_thread)
            return messages
        if self._state == ARMED and self._time_armed and not self._opening:
            self._opening = self._in_main_thread(self._open_time_window)
        if self._state != IDLE or self._user_profiler or self._blocked or self._cuda_wait:
            return messages
        # A viewer's request is honoured at most once a second.
        requested = self._request.is_set() and monotonic - self._last_closed >= REQUEST_GAP_S
        # The first window over training steps comes as soon as there are steps, whatever
        # the spacing that time-based windows (taken while the job set up) left.
        first_steps = self.clock is not None and not self._step_window_armed
        due = monotonic >= self._next_due or first_steps
        if not requested and not due:
            return messages
        if self.clock is not None and not self._steps_unsafe:
            if requested or steps.total >= self.first_after_steps:
                self._arm(requested, monotonic)
                self._step_window_armed = True
                step_hooks.BOUNDARY[0] = self.at_boundary
        elif requested or monotonic - self._started >= self.time_fallback_s:
            self._arm(requested, monotonic)
            self._time_armed = True
            self._opening = self._in_main_thread(self._open_time_window)
        return messages

    def _arm(self, requested: bool, monotonic: float) -> None:
        self._request.clear()
        self._requested_window = requested
        # Until the window's frame sets the adapted spacing (and after a failure).
        self._next_due = monotonic + max(self.min_spacing_s, self.spacing_s)
        self._state = ARMED

    def _status(self, now: float) -> ProbeStatus | None:
        if self._user_profiler or self._blocked:
            reason: str | None = OWN_PROFILER
        else:
            reason = WAITING_FOR_CUDA if self._cuda_wait else self._failure
        if self._failures >= 3 and reason is not None:
            reason = f"{reason}; op sampling stopped after {self._failures} failures"
        if reason == self._reported:
            return None
        self._reported = reason
        if reason is None:
            return ProbeStatus(t=now, probe=PROBE, available=True, detail="op timings resumed")
        return ProbeStatus(
            t=now, probe=PROBE, available=False, detail=f"op timings unavailable: {reason}"
        )

    def _frame(self, closed: _Closed, ends: deque[tuple[float, float]] | None) -> OpsWindow | None:
        """The window's frame; ``None`` while its cost is being measured (see
        :meth:`_measured`). ``ends`` are the latest steps' (end, duration)."""
        t0 = time.perf_counter()
        events = read_events(
            closed.result,
            record_shapes=self.record_shapes,
            links=closed.device,
            python=self.with_stack,
            dtypes=closed.inputs,
        )
        if self.with_stack and self._site_of is None:
            self._site_of = site_reader(_library_dirs())
        window = aggregate(events, site_of=self._site_of)
        self.windows += 1
        path = self._save_trace(closed)
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
        if steps and self._recent_steps:
            slowdown = max(0.0, closed.wall_s - steps * statistics.median(self._recent_steps))
            if events:
                self._event_costs.append(slowdown / len(events))
        else:
            slowdown = len(events) * statistics.median(self._event_costs)
        cost = closed.start_cost_s + closed.stop_cost_s + slowdown + (time.perf_counter() - t0)
        frame = OpsWindow(
            t=time.time(),
            window=self.windows,
            began=closed.began,
            duration_s=closed.wall_s,
            steps=steps,
            cost_s=cost,
            spacing_s=self.spacing_s,
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
        )
        closed.result = None  # kineto's events are freed here, inside what is measured
        usual = _usual_step(ends, closed.opened_at) if steps else None
        if usual is None:
            return self._priced(frame, closed.start_cost_s, closed.stop_cost_s, cost)
        # What the job lost is measured on its steps: from the window's start to the first
        # step that ends after all the work above.
        self._next_due = float("inf")
        self._measuring.append(
            _Measuring(
                frame=frame,
                start=closed.opened_at,
                done=time.perf_counter(),
                usual=usual,
                events=len(events),
                start_cost_s=closed.start_cost_s,
                stop_cost_s=closed.stop_cost_s,
                estimate=cost,
                deadline=time.monotonic() + MEASURE_WAIT_S,
            )
        )
        return None

    def _priced(self, frame: OpsWindow, start: float, stop: float, cost: float) -> OpsWindow:
        """The frame with its cost, and the spacing to the next window that the cost sets."""
        self.costs.append((start, stop, cost))
        self.spacing_s = max(self.min_spacing_s, cost / self.budget)
        self._next_due = time.monotonic() + self.spacing_s
        return dataclasses.replace(frame, cost_s=cost, spacing_s=self.spacing_s)

    def _measured(
        self, ends: deque[tuple[float, float]] | None, *, final: bool = False
    ) -> list[Message]:
        """Frames of windows whose cost to the job is now known: the steps from the window's
        start to the first that ended after the agent was done with it, less what those steps
        usually take. Without such a step in time, the estimate stands."""
        out: list[Message] = []
        while self._measuring:
            m = self._measuring[0]
            cost = _excess(ends, m.start, m.done, m.usual) if ends else None
            if cost is None and not final and time.monotonic() < m.deadline:
                break
            self._measuring.popleft()
            if cost is None:
                cost = m.estimate
            elif m.events:
                self._event_costs.append(cost / m.events)
            out.append(self._priced(m.frame, m.start_cost_s, m.stop_cost_s, cost))
        return out

    def _save_trace(self, closed: _Closed) -> str | None:
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

    def stop(self, now: float) -> list[Message]:
        """Close a window this thread has open (one that another thread opened closes at its
        owner's next boundary), and the frames of those not yet sent."""
        self.close_now()
        if self._state != OPEN:
            step_hooks.BOUNDARY[0] = None
        if _active[0] is self:
            _active[0] = None
        with self._lock:
            messages: list[Message] = []
            while self._closed:
                with contextlib.suppress(Exception):
                    frame = self._frame(self._closed.popleft(), None)
                    if frame is not None:
                        messages.append(frame)
            messages.extend(self._measured(None, final=True))
            self._stopped = True
            return messages

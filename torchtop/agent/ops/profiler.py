"""Starting and stopping torch's profiler, and living with Kineto (training thread).

Where a window may open (never inside C++ code of torch that called back into Python), whether
the job's own profiler is on, torch's profiler entry points, and what Kineto's config thread
needs in this process and in children forked from it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from types import FrameType
from typing import Any

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


#: On a CUDA job, one window in this many records its ops' inputs (their dtypes) even
#: without ``--profile-shapes``: recording inputs makes each profiled op dearer, and the
#: matmuls' dtype seldom changes.
DTYPE_WINDOW_EVERY = 4


def records_inputs(opened: int, *, shapes: bool, cuda: bool) -> bool:
    """Does the window after ``opened`` windows record its ops' inputs? Always with
    ``--profile-shapes``; on a CUDA job, the first and every DTYPE_WINDOW_EVERY-th after it
    (for the matmuls' dtypes); on a CPU job, never (float32 is the CPU's usual type)."""
    return shapes or (cuda and opened % DTYPE_WINDOW_EVERY == 0)


#: Kineto's log level that keeps its per-window start/stop lines off the job's stderr.
KINETO_QUIET = "6"
#: The agent set KINETO_LOG_LEVEL (the job had not): taken back once kineto has read it.
_KINETO_DEFAULTED = [False]
#: A profiler (ours or the job's) has started in this process, so kineto's config thread runs.
_KINETO_STARTED = [False]


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

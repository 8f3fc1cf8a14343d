"""Telling handled failures from those that reach the job.

The allocator calls the observer before it throws, and torch may catch the error in C++ and go
on (cuDNN retries with a smaller workspace). A failure in a thread with Python frames is
followed there (:class:`_Watch`, a trace function on the frames of the failure); one in the
autograd engine's thread, which runs no Python, waits in a :class:`_BackwardWatch` until the
training thread leaves ``run_backward``, and the controller's worker thread resolves it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torchtop.agent.memory_snapshot import _is_torchtop, _torch_dir, is_library_frame
from torchtop.protocol import MemoryCapture, Request

#: Wakes the worker thread to look at backward failures.
_WAKE = Request(action="_wake")
#: How often the worker looks whether a backward with a failure has ended.
BACKWARD_POLL_S = 0.02


@dataclass
class _Pending:
    """A failure captured at the observer, not yet known to reach the job's code."""

    capture: MemoryCapture
    snap: Mapping[str, Any]
    message: str
    stream: int | None
    done: bool = False


@dataclass
class _BackwardWatch:
    """A failure in the autograd engine's thread, waiting for backward to end."""

    pending: _Pending
    thread: int
    index: int
    time_us: int | None
    stream: int | None


class _Watch:
    """Follows a failure in the thread that failed, until it reaches the job's code or not.

    The allocator calls its observers, in the order attached, before it throws; torch may
    catch the error in C++ and go on (cuDNN retries with a smaller workspace). Between this
    observer and the throw other Python may run: the job's own observer (a snapshot dump, as
    PyTorch's docs suggest), a finalizer, garbage collection. So only the frames that were on
    the stack at the failure are followed, and only where the error goes decides: an
    ``exception`` event in one of the job's frames (not torch's, not torchtop's) means it
    reached the job (published, and paused there with ``--pause-on-oom``); a frame the error
    has not gone through moving on to another line or returning means torch handled it
    (counted). Lines that torch's frames run while the error goes through them (a finally, a
    context manager's exit, a handler) and calls into new frames decide nothing. Tracing ends
    at the first decision, and whatever trace function was there before (a debugger,
    coverage) is put back.
    """

    def __init__(
        self,
        finished: Callable[[_Watch, bool], None],
        pending: _Pending,
        frames: list[Any],
    ) -> None:
        """``finished(watch, reached)``: called once the watch has decided, in the thread that
        failed, with whether the error reached the job's code."""
        self._finished = finished
        self.pending = pending
        self._frames = frames  # innermost first
        self._outermost = frames[-1]
        self._saved = [(f, f.f_trace, f.f_trace_lines) for f in frames]
        self._previous = sys.gettrace()
        self._torch_dir = _torch_dir()
        #: The frames the error has gone through so far (torch's).
        self._raised_through: list[Any] = []
        self._done = False
        # One bound method, so that the trace function set can be recognised again.
        self._tracer = self._global
        self._frame_tracer = self._local

    @property
    def done(self) -> bool:
        return self._done or self.pending.done

    @done.setter
    def done(self, value: bool) -> None:
        if value:
            self._stop()
        self.pending.done = value

    def arm(self) -> None:
        for frame in self._frames:
            frame.f_trace = self._frame_tracer
            # Line events tell a frame that moved on past the failing call.
            frame.f_trace_lines = True
        sys.settrace(self._tracer)

    def _global(self, frame: Any, event: str, arg: Any) -> Any:
        # New frames (other observers, finalizers, the job going on) are not followed: only
        # the frames of the failure decide. This function only keeps their tracing on.
        return None

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if self._done:
            return None
        reached = any(frame is f for f in self._raised_through)
        if event == "exception":
            if not reached:
                self._raised_through.append(frame)
            if frame is self._outermost or not is_library_frame(
                frame.f_code.co_filename, self._torch_dir
            ):
                # Another error (torch caught the OOM, then failed otherwise): the job saw
                # no out-of-memory error, so torch handled this one.
                self._finish(reached=_is_oom(arg[1]))
                return None
        elif event in ("line", "return") and not reached:
            # A frame the error never reached runs on (its callee, or the op, came back
            # normally): torch handled the failure.
            self._finish(reached=False)
            return None
        elif event == "return" and frame is self._outermost:
            # Out of the thread's last frame with the error in it: the thread ends by it.
            self._finish(reached=True)
            return None
        # Otherwise a frame of torch's the error went through: its cleanups (a finally, a
        # context manager's exit) or a handler run; what decides is where it goes next.
        return self._frame_tracer

    def _stop(self) -> None:
        if self._done:
            return
        self._done = True
        if sys.gettrace() is self._tracer:
            sys.settrace(self._previous)
        for frame, trace, lines in self._saved:
            with contextlib.suppress(Exception):
                frame.f_trace = trace
                frame.f_trace_lines = lines
        # Hold no frame (nor the tensors in their locals) past the end of the watch.
        self._saved = []
        self._frames = []
        self._raised_through = []

    def _finish(self, *, reached: bool) -> None:
        self._stop()
        self._outermost = None
        self._finished(self, reached)


def _is_oom(exc: BaseException | None) -> bool:
    """An out-of-memory error, or an error raised from or while handling one."""
    for _ in range(8):
        if exc is None:
            return False
        if type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _python_frames(frame: Any) -> list[Any]:
    """The frames of the calling thread outside torchtop, innermost first."""
    frames = []
    while frame is not None:
        if not _is_torchtop(frame.f_code.co_filename):
            frames.append(frame)
        frame = frame.f_back
    return frames


def _run_backward_frame(frame: Any) -> Any:
    """autograd's ``_engine_run_backward`` frame in a thread's stack, or ``None``."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_engine_run_backward" and _AUTOGRAD in code.co_filename:
            return frame
        frame = frame.f_back
    return None


_AUTOGRAD = f"{os.sep}torch{os.sep}autograd{os.sep}"


def _backward_threads() -> dict[int, Any]:
    """Threads waiting in autograd's ``run_backward`` (the engine runs their backward), with
    the frame that waits there."""
    waiting = {}
    for ident, frame in sys._current_frames().items():
        found = _run_backward_frame(frame)
        if found is not None:
            waiting[ident] = found
    return waiting


def _training_thread() -> tuple[int, Any] | None:
    """The thread whose backward the engine runs (the main thread first, if several)."""
    waiting = _backward_threads()
    if not waiting:
        return None
    main = threading.main_thread().ident
    ident = main if main in waiting else next(iter(waiting))
    return ident, waiting[ident]


def _frames_of(frame: Any) -> list[dict[str, Any]]:
    """A thread's stack in a snapshot's frame format, innermost first."""
    out = []
    while frame is not None:
        out.append(
            {
                "filename": frame.f_code.co_filename,
                "line": frame.f_lineno,
                "name": frame.f_code.co_name,
            }
        )
        frame = frame.f_back
    return out


def _went_on(snap: Mapping[str, Any], watch: _BackwardWatch) -> bool:
    """An allocation without Python frames (the engine's) on the failing stream after the
    failure: backward went on past it."""
    if watch.time_us is None:
        return False
    traces = snap.get("device_traces") or []
    trace = traces[watch.index] if 0 <= watch.index < len(traces) else []
    return any(
        entry.get("action") == "alloc"
        and not entry.get("frames")
        and int(entry.get("time_us", 0) or 0) > watch.time_us
        and (watch.stream is None or entry.get("stream", watch.stream) == watch.stream)
        for entry in trace
    )

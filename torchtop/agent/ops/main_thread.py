"""Calls into the main thread, for time-based windows (a job with no steps): run between two
of its bytecodes (``Py_AddPendingCall``), since the profiler records the ops of the thread
that starts it."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

#: The folder of this package: the frames in its files are the agent's own, not the job's.
_HERE = os.path.dirname(__file__)


def call_in_main_thread(fn: Callable[[FrameType | None], None], keep: list[Any]) -> bool:
    """Run ``fn(frame)`` in the main thread between two of its bytecodes (``frame`` is the
    one it was running then). False if it could not be queued. ``keep`` holds the ctypes
    callback until it has run (it must outlive the call)."""

    def call(_arg: Any) -> int:
        try:
            try:
                # The frame the main thread was running when the call came in.
                fn(sys._getframe(1))
            finally:
                with contextlib.suppress(ValueError):
                    keep.remove(callback)
        except Exception:
            pass
        except BaseException as exc:
            # A signal's handler ran in here (Ctrl-C, a SIGTERM handler calling sys.exit):
            # raised through ctypes it would be lost, so the job gets it right after.
            _raise_in_this_thread_later(exc)
        return 0

    callback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(call)
    keep.append(callback)
    if ctypes.pythonapi.Py_AddPendingCall(callback, None) != 0:
        keep.remove(callback)
        return False
    return True


def _raise_in_this_thread_later(exc: BaseException) -> None:
    """Have ``exc`` raised in this thread as its next Python function (outside this package) is
    entered: a pending call runs inside C code of the interpreter, where an exception cannot
    be raised. A profile function (``sys.setprofile``) raises it once and removes itself."""
    previous = sys.getprofile()

    def deliver(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or os.path.dirname(frame.f_code.co_filename) == _HERE:
            return
        sys.setprofile(previous)
        raise exc

    sys.setprofile(deliver)

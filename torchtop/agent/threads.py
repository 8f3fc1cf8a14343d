"""The agent's threads, which leave the job's signals to the job.

A signal sent to a process (Ctrl-C's SIGINT, SIGTERM, a job's own SIGUSR1 or SIGALRM) goes to
one of its threads that does not block it. If the kernel picks one of the agent's threads,
Python runs the handler in the main thread only when that thread next runs Python code: a main
thread asleep in ``time.sleep`` or blocked in a C call sleeps on, and Ctrl-C seems lost (one in
about a hundred tries with three busy threads). Plain Python has no other threads, so the main
thread always gets them; blocking these signals in every thread of the agent keeps it so.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

#: Signals sent to the whole process that a job may handle (synchronous ones, such as
#: SIGSEGV or SIGPIPE, go to the thread that caused them and are left alone).
JOB_SIGNALS = frozenset(
    getattr(signal, name)
    for name in (
        "SIGINT",
        "SIGTERM",
        "SIGHUP",
        "SIGQUIT",
        "SIGUSR1",
        "SIGUSR2",
        "SIGALRM",
        "SIGCHLD",
        "SIGWINCH",
    )
    if hasattr(signal, name)
)


def leave_signals_to_the_job() -> None:
    """Block :data:`JOB_SIGNALS` in the calling thread (the job's threads are untouched)."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)


def agent_thread(
    target: Callable[..., object], name: str, args: tuple[Any, ...] = ()
) -> threading.Thread:
    """A daemon thread for the agent's work that leaves the job's signals to the job."""

    def run(*call_args: Any) -> None:
        leave_signals_to_the_job()
        target(*call_args)

    thread = threading.Thread(target=run, args=args, name=name, daemon=True)
    AGENT_THREADS.add(thread)
    return thread


#: Every thread the agent started, for :func:`agent_cpu_s` (a thread that ended drops out).
AGENT_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def agent_cpu_s() -> float | None:
    """The CPU time the agent's running threads have used, in seconds: each thread's own CPU
    clock, read from this thread (one ``clock_gettime`` each, no file read). ``None`` where the
    platform has no per-thread clocks."""
    getclock = getattr(time, "pthread_getcpuclockid", None)
    if getclock is None:
        return None
    total = 0.0
    for thread in list(AGENT_THREADS):
        ident = thread.ident
        if ident is None or not thread.is_alive():
            continue
        with contextlib.suppress(OSError, ValueError, OverflowError):
            total += time.clock_gettime(getclock(ident))
    return total

"""Where the training thread is stuck, read from the agent's own thread.

A rank blocked before a collective holds every other rank inside it: the job hangs with no
error until the collective's timeout (30 minutes by default). :class:`StallWatch` runs in the
sampler thread; once the job has taken a step and then finished none for its threshold
(``HANG_STEPS`` median steps, and at least ``hang_after_s``; a batch taken counts as
progress too, as in an evaluation loop), it reads the main thread's
Python stack with ``sys._current_frames()``, which never stops or signals the job, and sends
it as a ``stack`` message, again every :data:`REPEAT_S` while the job stays stuck. The
message goes through the agent's bounded queues like any other: dropped, never waited for.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
import traceback

from torchtop.agent.steps import StepCollector
from torchtop.protocol import (
    HANG_AFTER_S,
    MAX_HANG_FRAMES,
    StackFrame,
    StackSampled,
    hang_threshold,
)

#: Seconds between two stacks of a job that stays stuck.
REPEAT_S = 10.0


#: torchtop's own frames (the hooks around ``backward`` and ``__next__``) are left out.
_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def main_thread_stack(limit: int = MAX_HANG_FRAMES) -> list[StackFrame]:
    """The main thread's stack, outermost first, its innermost ``limit`` frames."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return []
    # No source lines looked up: the frames' file and line are enough, and cost no file reads.
    summary = traceback.StackSummary.extract(
        traceback.walk_stack(frame), limit=limit + 4, lookup_lines=False
    )
    summary.reverse()
    frames = [
        StackFrame(f.filename, f.lineno or 0, f.name)
        for f in summary
        if not f.filename.startswith(_OWN)
    ]
    return frames[-limit:]


class StallWatch:
    """Sends the training thread's stack while the job's steps have stopped."""

    def __init__(self, hang_after_s: float = HANG_AFTER_S, repeat_s: float = REPEAT_S) -> None:
        self.hang_after_s = hang_after_s
        self.repeat_s = repeat_s
        self._last_sent: float | None = None
        #: The step end the last stack was sent after: a new step starts a new stall.
        self._stall_of: float | None = None

    def check(self, steps: StepCollector, now: float) -> StackSampled | None:
        """A ``stack`` message if the job is stuck and one is due; ``now`` is wall time."""
        last_end = steps.last_end
        if last_end is None:
            return None
        # A batch since counts as progress (an evaluation loop takes batches, not steps).
        if steps.last_batch is not None and steps.last_batch > last_end:
            last_end = steps.last_batch
        stale = time.perf_counter() - last_end
        if stale < self.hang_after_s:  # the threshold is never shorter: no median to sort
            return None
        median = statistics.median(steps.recent) if steps.recent else None
        threshold = hang_threshold(median, self.hang_after_s)
        if stale < threshold:
            return None
        mono = time.monotonic()
        if (
            self._stall_of == last_end
            and self._last_sent is not None
            and mono - self._last_sent < self.repeat_s
        ):
            return None
        frames = main_thread_stack()
        if not frames:
            return None
        self._stall_of = last_end
        self._last_sent = mono
        return StackSampled(
            t=now,
            stale_s=round(stale, 3),
            threshold_s=round(threshold, 3),
            steps=steps.total,
            thread="MainThread",
            frames=frames,
        )

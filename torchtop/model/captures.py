"""Out-of-memory failures and memory snapshots as the viewer knows them. Pure Python.

:class:`MemoryCaptures` folds ``oom``, ``memory_snapshot`` and ``oom_resumed`` messages; the
app opens the OOM screen when :attr:`MemoryCaptures.opened` goes up, and
:func:`capture_evidence` gathers, from the rest of the state, what the advice rules
(:mod:`torchtop.model.oom_advice`) need: the phase of the failure and the memory step over step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torchtop.model.oom_advice import Evidence, phase_at, step_floors
from torchtop.protocol import MemoryCapture, Message, OomResumed, OutOfMemory

if TYPE_CHECKING:
    from torchtop.model.job import JobModel

#: Captures kept (each is small: at most 20 sites of 8 frames).
MAX_CAPTURES = 50


@dataclass
class CaptureEntry:
    """One capture, and how a pause at it ended (``None`` while the job is held)."""

    capture: MemoryCapture
    resumed: str | None = None

    @property
    def is_oom(self) -> bool:
        return isinstance(self.capture, OutOfMemory)

    @property
    def holding(self) -> bool:
        """The agent holds the job at this failure, waiting for ``resume``."""
        return (
            isinstance(self.capture, OutOfMemory) and self.capture.paused and self.resumed is None
        )


@dataclass
class MemoryCaptures:
    """The captures so far, newest last; ``opened`` counts those that should open the screen."""

    entries: deque[CaptureEntry] = field(default_factory=lambda: deque(maxlen=MAX_CAPTURES))
    #: Goes up with each new capture the viewer should show at once.
    opened: int = 0

    def apply(self, message: Message) -> bool:
        if isinstance(message, MemoryCapture):
            for entry in self.entries:
                if entry.capture == message:
                    return False  # the same capture again (a replayed history)
            self.entries.append(CaptureEntry(message))
            self.opened += 1
            return True
        if isinstance(message, OomResumed):
            for entry in self.entries:
                if entry.capture.id == message.id and entry.is_oom and entry.resumed is None:
                    entry.resumed = message.reason
                    return True
        return False

    @property
    def latest(self) -> CaptureEntry | None:
        return self.entries[-1] if self.entries else None

    @property
    def ooms(self) -> int:
        return sum(1 for e in self.entries if e.is_oom)

    @property
    def holding(self) -> CaptureEntry | None:
        """The failure the job is held at, if any."""
        for entry in reversed(self.entries):
            if entry.holding:
                return entry
        return None


def capture_evidence(state: JobModel, capture: MemoryCapture) -> Evidence:
    """The advice rules' evidence for ``capture``: its figures, the phase open at it, and the
    device's allocated memory at the low point of each step before it."""
    phase = phase_at(((p.name, p.start, p.end) for p in state.phases), capture.t)
    memory = state.memory.get(capture.device)
    points = [(p.t, p.allocated) for p in memory.series] if memory is not None else []
    training = getattr(state, "training", None)
    ends = [p.t for p in getattr(training, "points", ())]
    return Evidence.of(capture, phase=phase, floors=step_floors(points, capture.t, ends))

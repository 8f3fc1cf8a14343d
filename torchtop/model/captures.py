"""A job's out-of-memory failures and memory snapshots, each with its evidence and advice.

Pure Python. :class:`MemoryCaptures` folds ``oom``, ``memory_snapshot`` and ``oom_resumed``
messages. :class:`torchtop.model.JobModel` hands it each capture with the evidence the advice
rules (:mod:`torchtop.model.oom_advice`) need, gathered from the job at the moment of the
capture (the phase open then, the device's memory step over step), so the viewer's OOM screen
and the report give the same verdict and suggestions however much history came after.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from torchtop.model.oom_advice import Evidence, Suggestion, suggest
from torchtop.protocol import MemoryCapture, Message, OomResumed, OutOfMemory

#: Captures kept (each is small: at most 20 sites of 8 frames).
MAX_CAPTURES = 50


@dataclass
class CaptureEntry:
    """One capture, its evidence, and how a pause at it ended (``None`` while the job is held)."""

    capture: MemoryCapture
    evidence: Evidence
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

    @property
    def phase(self) -> str | None:
        """The innermost phase open at the capture."""
        return self.evidence.phase

    @property
    def suggestions(self) -> list[Suggestion]:
        """What to try, most specific first (:func:`torchtop.model.oom_advice.suggest`)."""
        return suggest(self.evidence)


@dataclass
class MemoryCaptures:
    """The captures so far, newest last; ``opened`` counts those that should open the screen."""

    entries: deque[CaptureEntry] = field(default_factory=lambda: deque(maxlen=MAX_CAPTURES))
    #: Goes up with each new capture a viewer should show at once.
    opened: int = 0

    def apply(self, message: Message, evidence: Evidence | None = None) -> bool:
        """Fold in a capture (with its evidence; the capture's own figures alone without) or a
        resume; True if anything changed."""
        if isinstance(message, MemoryCapture):
            for entry in self.entries:
                if entry.capture == message:
                    return False  # the same capture again (a replayed history)
            self.entries.append(CaptureEntry(message, evidence or Evidence.of(message)))
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

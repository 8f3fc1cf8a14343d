"""Which arriving messages are worth waking the viewer for.

The agent samples ten times a second, also when the job does nothing. A sample whose figures
look the same on screen as the last one's need not wake the app: it waits in the queue and is
applied with the next frame, which comes at the latest two seconds of the job's time later
(when the uptime, the charts and the host figures move anyway). Everything else (log lines, steps,
events, the connection) wakes the app at once. Decided in the source's thread, so it is cheap:
a few comparisons per sample, no folding and no formatting.
"""

from __future__ import annotations

from dataclasses import fields

from torchtop.protocol import AgentStats, GpuSample, MemoryStats, Message, Sample

#: Seconds of the job's time after which a routine sample wakes the app even when its figures
#: look the same: the uptime, the charts and the host figures move. Every two seconds, as
#: nvitop refreshes by default: a job with nothing new costs the viewer a frame each time (the
#: uptime then moves two seconds at a time; anything new is drawn at once).
ROUTINE_WAKE_S = 2.0
#: Significant digits the memory figures are shown with (``12.3 GiB``): a change below them is
#: not seen.
SHOWN_DIGITS = 3

_MEMORY_FIELDS = tuple(f.name for f in fields(MemoryStats))


def _shown(value: object) -> object:
    """``value`` at the precision the screen shows it."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 1000:
        return float(f"{value:.{SHOWN_DIGITS}g}")
    return value


def memory_key(sample: Sample) -> tuple[object, ...]:
    """What a sample's memory figures look like on screen, to compare with another's."""
    return tuple(
        tuple(_shown(getattr(stats, name)) for name in _MEMORY_FIELDS) for stats in sample.memory
    )


class WakeFilter:
    """Tells, message by message, whether the app should draw a frame for it."""

    def __init__(self, routine_wake_s: float = ROUTINE_WAKE_S) -> None:
        self.routine_wake_s = routine_wake_s
        self._woke_at: float | None = None
        self._memory: tuple[object, ...] | None = None

    def wakes(self, message: Message) -> bool:
        """True if ``message`` may change what the screen shows now."""
        if isinstance(message, Sample):
            key = memory_key(message)
            if key != self._memory:
                self._memory = key
                return self._woke(message.t)
            return self._routine(message.t)
        if isinstance(message, (GpuSample, AgentStats)):
            return self._routine(message.t)
        t = getattr(message, "t", None)
        if isinstance(t, float) and (self._woke_at is None or t > self._woke_at):
            self._woke_at = t
        return True

    def _routine(self, t: float) -> bool:
        woke = self._woke_at
        if woke is None or not 0 <= t - woke < self.routine_wake_s:
            return self._woke(t)
        return False

    def _woke(self, t: float) -> bool:
        self._woke_at = t
        return True

"""One device's memory as the model keeps it: the latest reading, its history, its peaks.

Pure Python. :class:`torchtop.model.JobModel` keeps one :class:`DeviceMemory` per device it
has seen; the advice rules (:mod:`torchtop.model.advice`) read it too.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from torchtop.protocol import DeviceHolding, MemoryStats

#: The split of a device's memory, in order (what :attr:`DeviceMemory.by_category` names).
CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_state",
    "other_allocated",
    "cache",
    "fragmentation",
)
#: Allocated memory whose holders are not read yet (before the job's first optimizer step, or
#: in a job that steps none): :attr:`MemoryPoint.held`.
UNSPLIT = "unsplit"
_NONE_HELD = DeviceHolding("", 0, 0, 0)
_SHOWN = ("other_allocated", "cache", "fragmentation")


@dataclass(frozen=True)
class ModuleMemory:
    """One row of a memory window's module table: a module's path (made printable), the
    bytes of activations it held at the step's peak, and their share of that peak."""

    path: str
    bytes: int
    share: float


@dataclass(slots=True)
class MemoryPoint:
    """One sample of a device's memory on the time axis, with what held it: the latest
    holders read at the time of the sample (``None``: not read yet) and the fragmented
    bytes."""

    t: float
    allocated: int | None
    reserved: int | None
    holding: DeviceHolding | None = None
    fragmented: int | None = None

    @property
    def by_category(self) -> dict[str, int] | None:
        """What held this sample's memory (:func:`split_memory`)."""
        return split_memory(self.holding, self.allocated, self.reserved, self.fragmented)

    @property
    def held(self) -> dict[str, int] | None:
        """:attr:`by_category`, or before the holders are known, allocated as one
        :data:`UNSPLIT` part beside the cache and fragmentation; ``None``: allocated unread."""
        if self.holding is not None:
            return self.by_category
        split = split_memory(_NONE_HELD, self.allocated, self.reserved, self.fragmented)
        if split is None:
            return None
        return {
            UNSPLIT if c == "other_allocated" else c: v for c, v in split.items() if c in _SHOWN
        }


def split_memory(
    holding: DeviceHolding | None,
    allocated: int | None,
    reserved: int | None,
    fragmented: int | None,
) -> dict[str, int] | None:
    """What holds a device's memory, in :data:`CATEGORIES`' order: parameters, gradients and
    optimizer state (read from the job's optimizers), everything else allocated (activations,
    temporaries, buffers, inputs, parameters under no optimizer), the cache (reserved less
    allocated less fragmentation) and fragmentation. The first four sum to allocated, all six
    to reserved (the last two only where reserved is known). ``None`` until both the holders
    and allocated are known."""
    if holding is None or allocated is None:
        return None
    held = holding.parameters + holding.gradients + holding.optimizer_state
    split = {
        "parameters": holding.parameters,
        "gradients": holding.gradients,
        "optimizer_state": holding.optimizer_state,
        # The holders are read a little apart from allocated: never below zero.
        "other_allocated": max(0, allocated - held),
    }
    if reserved is not None:
        fragmented = min(fragmented or 0, max(0, reserved - allocated))
        split["cache"] = max(0, reserved - allocated - fragmented)
        split["fragmentation"] = fragmented
    return split


@dataclass
class DeviceMemory:
    """One device's memory: the latest reading, its history and its running peaks."""

    device: str
    latest: MemoryStats
    series: deque[MemoryPoint]
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    #: The allocator's own counters, at their highest (``None`` where it has none).
    num_ooms: int | None = None
    num_alloc_retries: int | None = None
    #: The optimizers' parameters, gradients and state on this device (``None``: not known).
    holding: DeviceHolding | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def cache(self) -> int | None:
        """Reserved but not allocated: the caching allocator's cache, all of it (segments
        ``empty_cache()`` would hand back included); on the CPU, RSS above the heap."""
        allocated = self.latest.allocated_bytes
        reserved = self.latest.reserved_bytes
        if allocated is None or reserved is None:
            return None
        return reserved - allocated

    @property
    def fragmented(self) -> int | None:
        """Free bytes inside segments that are split between live blocks (the allocator's
        ``inactive_split_bytes``): memory a larger request cannot use, and ``empty_cache()``
        cannot free. ``None`` where the allocator does not say (the CPU)."""
        return self.latest.inactive_split_bytes

    @property
    def in_use(self) -> bool:
        """The job has held memory here: allocated or reserved above 0, now or at a peak (or
        nothing could be read)."""
        stats = self.latest
        known = [
            value
            for value in (
                stats.allocated_bytes,
                stats.reserved_bytes,
                self.peak_allocated,
                self.peak_reserved,
            )
            if value is not None
        ]
        # A device whose figures could not be read at all is shown (with dashes), not hidden.
        return not known or any(value > 0 for value in known)

    @property
    def ooms(self) -> int | None:
        """Out-of-memory failures the job saw: the allocator's count less those torch handled
        itself (cuDNN's retries with a smaller workspace)."""
        total = self.latest.num_ooms
        if total is None:
            return None
        return max(0, total - (self.latest.handled_ooms or 0))

    @property
    def allocated_label(self) -> str:
        """What ``allocated`` means on this device: "allocated", "heap" or "RSS"."""
        if self.latest.source == "cpu-heap":
            return "heap"
        if self.latest.source == "cpu-rss":
            return "RSS"
        return "allocated"

    @property
    def reserved_label(self) -> str:
        """What ``reserved`` means on this device: "reserved" on CUDA, "RSS" on the CPU."""
        if self.latest.source.startswith("cpu"):
            return "RSS"
        return "reserved"

    @property
    def by_category(self) -> dict[str, int] | None:
        """What holds this device's memory now (:func:`split_memory`): the first four sum to
        allocated, all six to reserved. ``None`` until both the holders and allocated are
        known."""
        stats = self.latest
        return split_memory(
            self.holding, stats.allocated_bytes, stats.reserved_bytes, self.fragmented
        )

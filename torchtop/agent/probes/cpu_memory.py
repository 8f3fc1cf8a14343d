"""Memory of a CPU-only job: the C heap in use, against the process RSS.

CPU tensors are allocated with ``malloc``/``posix_memalign``, so on glibc the heap in use (small
chunks in the arenas plus large chunks mapped on their own) follows tensor memory closely, while
RSS also holds freed-but-kept pages, code and Python's own arenas. ``mallinfo2()`` gives that
figure in a few microseconds without walking the address space. Where it does not exist (musl,
macOS, glibc before 2.33) the probe reports RSS as the allocated figure and says so in
``source``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable
from typing import Literal, Protocol

from torchtop.protocol import MemoryStats

#: ``MemoryStats.source`` when ``allocated_bytes`` is the C heap in use.
SOURCE_HEAP = "cpu-heap"
#: ``MemoryStats.source`` when the heap cannot be read and ``allocated_bytes`` is the RSS.
SOURCE_RSS = "cpu-rss"


class HeapInfo(Protocol):
    """The two fields of glibc's ``struct mallinfo2`` the probe uses."""

    @property
    def uordblks(self) -> int:
        """Bytes in chunks handed out from the arenas."""
        ...

    @property
    def hblkhd(self) -> int:
        """Bytes in chunks mapped on their own with ``mmap`` (the large ones)."""
        ...


class Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (since 2.33): the same fields as ``mallinfo``, as ``size_t``."""

    _fields_ = [
        ("arena", ctypes.c_size_t),
        ("ordblks", ctypes.c_size_t),
        ("smblks", ctypes.c_size_t),
        ("hblks", ctypes.c_size_t),
        ("hblkhd", ctypes.c_size_t),
        ("usmblks", ctypes.c_size_t),
        ("fsmblks", ctypes.c_size_t),
        ("uordblks", ctypes.c_size_t),
        ("fordblks", ctypes.c_size_t),
        ("keepcost", ctypes.c_size_t),
    ]


MallinfoFunction = Callable[[], HeapInfo]


def find_mallinfo2() -> MallinfoFunction | None:
    """glibc's ``mallinfo2`` as a callable, or ``None`` where this C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        # The already-loaded process image resolves libc's symbols without naming a file.
        libc = ctypes.CDLL(None)
        function = libc.mallinfo2
    except (OSError, AttributeError):
        name = ctypes.util.find_library("c")
        if name is None:
            return None
        try:
            function = ctypes.CDLL(name).mallinfo2
        except (OSError, AttributeError):
            return None
    function.restype = Mallinfo2
    function.argtypes = []
    mallinfo2: MallinfoFunction = function
    return mallinfo2


class CpuMemoryProbe:
    """Reads :class:`~torchtop.protocol.MemoryStats` for device ``cpu``.

    ``allocated_bytes`` is the C heap in use (``uordblks + hblkhd``, source ``cpu-heap``) or,
    without ``mallinfo2``, the RSS (source ``cpu-rss``). ``reserved_bytes`` is the RSS, which
    the caller already has from :class:`~torchtop.agent.probes.host.HostProbe` and passes in, so
    one tick reads it once. The peaks are the largest values this probe has seen: sampled, so a
    spike shorter than the sampling interval can be missed.

    ``mallinfo`` is ``"glibc"`` to look the function up in the C library, ``None`` to go without
    a heap reading, or a callable returning an object with ``uordblks`` and ``hblkhd`` (tests).

    ``mallinfo2`` walks every arena's free lists holding each arena's lock, so the job's own
    ``malloc`` calls wait on it (100-200 us a read with torch's threads); with ``heap_every``
    above 1 only every ``heap_every``-th read asks it, the reads between repeat its last value
    (the RSS is read every time).
    """

    def __init__(
        self,
        mallinfo: MallinfoFunction | Literal["glibc"] | None = "glibc",
        heap_every: int = 1,
    ) -> None:
        if heap_every < 1:
            raise ValueError("heap_every must be at least 1")
        self._mallinfo = find_mallinfo2() if isinstance(mallinfo, str) else mallinfo
        self._heap_every = heap_every
        self._reads = 0
        self._heap: int | None = None
        self._peak_allocated: int | None = None
        self._peak_reserved: int | None = None
        self._last_allocated: int | None = None
        self._last_reserved: int | None = None

    @property
    def source(self) -> str:
        """What ``allocated_bytes`` measures: ``cpu-heap`` or ``cpu-rss``."""
        return SOURCE_HEAP if self._mallinfo is not None else SOURCE_RSS

    def read(self, rss_bytes: int | None) -> MemoryStats:
        """The CPU memory now, with ``rss_bytes`` as read by the host probe (``None`` if unread)."""
        allocated = rss_bytes
        if self._mallinfo is not None:
            if self._reads % self._heap_every == 0 or self._heap is None:
                self._heap = self._heap_bytes()
            self._reads += 1
            allocated = self._heap
        self._last_allocated, self._last_reserved = allocated, rss_bytes
        self._peak_allocated = _max(self._peak_allocated, allocated)
        self._peak_reserved = _max(self._peak_reserved, rss_bytes)
        return MemoryStats(
            device="cpu",
            source=self.source,
            allocated_bytes=allocated,
            reserved_bytes=rss_bytes,
            peak_allocated_bytes=self._peak_allocated,
            peak_reserved_bytes=self._peak_reserved,
        )

    def reset_peaks(self) -> None:
        """Start the peaks again from the last values read, as ``reset_peak_memory_stats`` does."""
        self._peak_allocated = self._last_allocated
        self._peak_reserved = self._last_reserved

    def _heap_bytes(self) -> int | None:
        assert self._mallinfo is not None
        try:
            info = self._mallinfo()
            return int(info.uordblks) + int(info.hblkhd)
        except Exception:
            # An injected reader may fail; the sampler must never see it.
            return None


def _max(peak: int | None, value: int | None) -> int | None:
    if value is None:
        return peak
    return value if peak is None or value > peak else peak

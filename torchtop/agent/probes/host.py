"""The training process and its machine: RSS, CPU, threads, child processes and system memory."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import TypeVar

import psutil

from torchtop.agent.probes.base import ProbeUnavailable
from torchtop.protocol import HostStats

_T = TypeVar("_T")


class HostProbe:
    """Reads :class:`~torchtop.protocol.HostStats` for one process with psutil.

    Each field is read on its own: a field psutil cannot read (access denied, an odd platform)
    is ``None`` and the rest still come through. Only a process that no longer exists makes
    ``read()`` raise :class:`ProbeUnavailable`.

    Counting child processes walks the whole process table, which costs far more than the other
    fields, so it runs only on every ``children_every``-th read and the count is reused in
    between. DataLoader workers come and go on a scale of seconds, so that loses nothing.

    With ``full_every`` above 1, only every ``full_every``-th read goes through psutil; the
    reads in between take the RSS alone from ``/proc/PID/statm`` (one ``pread`` on a file kept
    open) and repeat the other fields of the last full read. Inside a job that keeps psutil's
    dozen file reads (each one a hand-over of the GIL) out of most sampler ticks, while the
    memory graph keeps its resolution; CPU, threads and children change on a scale of seconds.
    """

    def __init__(
        self,
        process: psutil.Process | None = None,
        children_every: int = 10,
        full_every: int = 1,
        count_children: Callable[[psutil.Process], int] | None = None,
    ) -> None:
        if children_every < 1:
            raise ValueError("children_every must be at least 1")
        if full_every < 1:
            raise ValueError("full_every must be at least 1")
        self._process = process if process is not None else psutil.Process()
        self._children_every = children_every
        self._full_every = full_every
        self._reads = 0
        self._fast_reads = 0
        self._last: HostStats | None = None
        self._statm: int | None = None
        if full_every > 1:
            self._statm = _open_statm(self._process.pid)
        self._page_size = _page_size()
        self._children: int | None = None
        #: How the children are counted: a walk of the process table from this process, or a
        #: table shared by several readers (see ``torchtop.streams.outside``).
        self._count_children = count_children or _count_children
        # psutil's cpu_percent(interval=None) measures since its previous call; the first call
        # only starts the measurement, so its 0.0 means nothing and is reported as None.
        self._cpu_primed = False
        # Fixed for the process's life (the job may change its affinity; few do): read once.
        self._cpus = usable_cpus()
        self._local_processes = local_processes()

    def read(self) -> HostStats:
        """The current numbers. Raises :class:`ProbeUnavailable` once the process is gone."""
        last = self._last
        if last is not None and self._statm is not None:
            self._fast_reads += 1
            if self._fast_reads % self._full_every != 0:
                rss = self._statm_rss()
                if rss is not None:
                    return dataclasses.replace(last, rss_bytes=rss)
        stats = self._read_full()
        self._last = stats
        return stats

    def read_rss(self) -> HostStats:
        """The RSS alone, from ``/proc/PID/statm`` (one ``pread`` on a file kept open), for a job
        whose viewers read the rest from outside it: the other fields are ``None`` but the ones
        fixed for the process's life. A full read where ``statm`` cannot be read."""
        if self._statm is None:
            self._statm = _open_statm(self._process.pid)
        rss = self._statm_rss()
        if rss is None:
            return self.read()
        return HostStats(
            rss_bytes=rss,
            cpu_percent=None,
            threads=None,
            children=None,
            system_used_bytes=None,
            system_total_bytes=None,
            cpus=self._cpus,
            local_processes=self._local_processes,
        )

    def close(self) -> None:
        statm, self._statm = self._statm, None
        if statm is not None:
            try:
                os.close(statm)
            except OSError:
                pass

    def _statm_rss(self) -> int | None:
        """The RSS from ``statm``'s second field (pages); ``None`` where it cannot be read."""
        statm = self._statm
        if statm is None or self._page_size is None:
            return None
        try:
            return int(os.pread(statm, 128, 0).split()[1]) * self._page_size
        except (OSError, ValueError, IndexError):
            return None

    def _read_full(self) -> HostStats:
        process = self._process
        try:
            with process.oneshot():
                rss = _field(lambda: int(process.memory_info().rss))
                cpu = _field(lambda: float(process.cpu_percent(interval=None)))
                threads = _field(lambda: int(process.num_threads()))
            if self._reads % self._children_every == 0:
                self._children = _field(lambda: self._count_children(process))
        except psutil.NoSuchProcess:
            raise ProbeUnavailable(f"process {process.pid} is gone") from None
        self._reads += 1
        if cpu is not None and not self._cpu_primed:
            self._cpu_primed = True
            cpu = None

        used, total = system_memory()

        return HostStats(
            rss_bytes=rss,
            cpu_percent=cpu,
            threads=threads,
            children=self._children,
            system_used_bytes=used,
            system_total_bytes=total,
            cpus=self._cpus,
            local_processes=self._local_processes,
        )


#: Seconds a reading of the machine's memory serves every probe of this process: a viewer of
#: 64 ranks read ``/proc/meminfo`` 64 times a second for the same figures.
SYSTEM_MEMORY_EVERY_S = 0.5
_system_memory: tuple[float, int | None, int | None] = (-float("inf"), None, None)


def system_memory() -> tuple[int | None, int | None]:
    """The machine's used and total memory (``None`` where unreadable), read at most every
    :data:`SYSTEM_MEMORY_EVERY_S` for the whole process."""
    global _system_memory
    at, used, total = _system_memory
    now = time.monotonic()
    if now - at < SYSTEM_MEMORY_EVERY_S:
        return used, total
    try:
        memory = psutil.virtual_memory()
        used, total = int(memory.used), int(memory.total)
    except (psutil.Error, OSError, AttributeError):
        used = total = None
    _system_memory = (now, used, total)
    return used, total


def _count_children(process: psutil.Process) -> int:
    return len(process.children(recursive=True))


def _open_statm(pid: int) -> int | None:
    try:
        return os.open(f"/proc/{pid}/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except (OSError, TypeError):
        return None


def _page_size() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None


def usable_cpus() -> int | None:
    """The CPUs this process may run on: its affinity where the platform has one."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def local_processes() -> int | None:
    """The job's processes on this node, as torchrun says (``LOCAL_WORLD_SIZE``)."""
    try:
        value = int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    return value if value > 0 else None


def _field(get: Callable[[], _T]) -> _T | None:
    """One psutil value, or ``None`` where it cannot be read. A vanished process propagates."""
    try:
        return get()
    except psutil.NoSuchProcess:
        raise
    except (psutil.Error, OSError, NotImplementedError, AttributeError):
        return None

"""DataLoader workers' memory, read from outside the job (``/proc/PID/smaps_rollup``).

RSS counts every page a worker maps, shared or not, so a forked worker that shares the parent's
dataset looks as big as the parent. ``smaps_rollup`` splits it: the private part (USS, pages only
this worker holds: ``Private_Clean + Private_Dirty``), PSS (each shared page divided among the
processes that map it) and the shared part. A dataset of Python objects inherited by ``fork``
shows as USS growing in every worker, page by page, as reference counts are written
(copy-on-write); a NumPy array or a memory-mapped file stays shared.

:func:`read_workers` is a pure function of a pid list: a pid that has ended, or whose file cannot
be read (another user, no ``/proc``), is left out of the result, never an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from torchtop.protocol import LoaderInfo

#: The fields read, as ``smaps_rollup`` names them; values are in kB.
_FIELDS = ("Rss", "Pss", "Shared_Clean", "Shared_Dirty", "Private_Clean", "Private_Dirty")


@dataclass(frozen=True, slots=True)
class WorkerMemory:
    """One process's memory, in bytes."""

    pid: int
    rss: int
    pss: int
    uss: int  #: private: Private_Clean + Private_Dirty
    shared: int  #: Shared_Clean + Shared_Dirty


@dataclass(frozen=True, slots=True)
class LoaderMemory:
    """A loader's workers, each and summed (bytes)."""

    workers: tuple[WorkerMemory, ...]

    @property
    def uss(self) -> int:
        return sum(w.uss for w in self.workers)

    @property
    def pss(self) -> int:
        return sum(w.pss for w in self.workers)

    @property
    def shared(self) -> int:
        return sum(w.shared for w in self.workers)


def parse_smaps_rollup(text: str, pid: int) -> WorkerMemory | None:
    """The memory in one ``smaps_rollup`` text, or None when it holds none of its fields.

    Tolerant: unknown lines, a missing unit, a field that is absent (an older kernel) or a value
    that is not a number are skipped; an absent field counts as 0.
    """
    kb: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if not sep or name not in _FIELDS:
            continue
        parts = rest.split()
        if not parts or not parts[0].isdigit():
            continue
        kb[name] = int(parts[0])
    if not kb:
        return None
    private = kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)
    shared = kb.get("Shared_Clean", 0) + kb.get("Shared_Dirty", 0)
    return WorkerMemory(
        pid=pid,
        rss=kb.get("Rss", private + shared) * 1024,
        pss=kb.get("Pss", 0) * 1024,
        uss=private * 1024,
        shared=shared * 1024,
    )


def read_worker(pid: int, proc: Path = Path("/proc")) -> WorkerMemory | None:
    """One process's memory, or None when it has ended or cannot be read."""
    try:
        text = (proc / str(pid) / "smaps_rollup").read_text(encoding="ascii", errors="replace")
    except OSError:  # ended, another user's, or no smaps_rollup (kernel < 4.14)
        return None
    return parse_smaps_rollup(text, pid)


def read_workers(pids: Iterable[int], proc: Path = Path("/proc")) -> LoaderMemory:
    """The memory of the workers in ``pids`` that can be read, in the order given."""
    found = (read_worker(pid, proc) for pid in pids)
    return LoaderMemory(workers=tuple(w for w in found if w is not None))


def parent_pid(pid: int, proc: Path = Path("/proc")) -> int | None:
    """``pid``'s parent from ``/proc/PID/stat``, or None when it cannot be read."""
    try:
        stat = (proc / str(pid) / "stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses; the last ')' ends it.
    fields = stat[stat.rfind(")") + 1 :].split()
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


def with_worker_memory(info: LoaderInfo, job_pid: int, proc: Path = Path("/proc")) -> LoaderInfo:
    """``info`` with each live worker's USS, PSS and shared memory filled in.

    Only the workers that are children of ``job_pid`` on this host are read: a job on another
    node names pids that mean other processes here. Returns ``info`` itself when none is read.
    """
    loaders = []
    changed = False
    for loader in info.loaders:
        workers = []
        for worker in loader.workers:
            mem = None
            if worker.alive and parent_pid(worker.pid, proc) == job_pid:
                mem = read_worker(worker.pid, proc)
            if mem is not None:
                changed = True
                worker = dataclasses.replace(
                    worker, uss_bytes=mem.uss, pss_bytes=mem.pss, shared_bytes=mem.shared
                )
            workers.append(worker)
        loaders.append(dataclasses.replace(loader, workers=workers))
    return dataclasses.replace(info, loaders=loaders) if changed else info

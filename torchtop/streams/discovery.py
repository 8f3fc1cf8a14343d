"""Finding agents: which of this user's agents a consumer follows (:class:`Agents`, the one
filter) and noticing them as they start (:class:`AgentScan`, the one scan loop).

Every consumer that follows more than one agent goes through here: the runner's ranks
(:class:`~torchtop.streams.runs.RankFeeds`), a node's relay, ``torchtop attach --node``, the
exporter (:mod:`torchtop.export.service`) and ``torchtop ps``'s grouping of ranks under the job
that launched them. Standard library and psutil only (psutil when a process's ancestry is asked).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from torchtop.transport import AgentInfo, list_agents, runtime_dir

#: Seconds between two full reads of the runtime directory while its entries do not change (an
#: agent that starts or rewrites its description replaces a file there, which changes them at
#: once): what may change meanwhile is a refusal that does not depend on the files, such as a
#: process's ancestry psutil could not read. Reading every description costs a scan a few
#: hundred microseconds, a quarter of a viewer's CPU on a quiet job at five scans a second.
FULL_SCAN_S = 2.0
#: A directory changed this recently may change again within its timestamp's granularity,
#: unseen: it is read in full at the next scan as well.
SETTLED_S = 0.1


def _ancestors(pid: int) -> list[int] | None:
    """``pid``'s parent, grandparent and so on; ``None`` if the process is gone or hidden."""
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).parents()]
    except psutil.Error:
        return None


def launcher_of(pid: int, candidates: Collection[int]) -> int | None:
    """The nearest ancestor of ``pid`` among ``candidates`` (agents of single processes): the
    job that started this rank (``torch.multiprocessing.spawn``'s parent, a job whose
    subprocesses are a scheduler's tasks), or ``None``."""
    if not candidates:
        return None
    return next((p for p in _ancestors(pid) or () if p in candidates), None)


def run_of(info: AgentInfo) -> str:
    """The run an agent belongs to: its run id, or, for a single process, its pid."""
    return str(info.identity.get("run_id") or info.pid)


@dataclass(frozen=True)
class Agents:
    """Which agents to follow; called with an agent's description, it says whether this one.

    Every condition given must hold: ``pid``, exactly that process; ``ranks_only``, only agents
    that say which rank they are; ``run``, only the agents of that run (:func:`run_of`);
    ``below``, only processes that descend from that pid (a launcher's ranks, a job's
    subprocesses). ``unidentified``: an agent whose description names no identity yet passes
    the ``run`` condition (its hello decides later)."""

    pid: int | None = None
    ranks_only: bool = False
    run: str | None = None
    below: int | None = None
    unidentified: bool = False
    #: An agent in this process is never followed (the exporter's own, in a test).
    not_pid: int | None = None

    def __call__(self, info: AgentInfo) -> bool:
        if self.pid is not None and info.pid != self.pid:
            return False
        if self.not_pid is not None and info.pid == self.not_pid:
            return False
        if self.ranks_only and info.identity.get("rank") is None:
            return False
        if (
            self.run is not None
            and run_of(info) != self.run
            and not (self.unidentified and not info.identity)
        ):
            return False
        # Last: the only condition that reads other processes.
        return self.below is None or self.below in (_ancestors(info.pid) or ())


#: Each agent a scan found, handed on once.
Found = Callable[[AgentInfo], None]


class AgentScan:
    """Reads the runtime directory every ``interval_s`` in a thread of its own and hands each
    new agent that ``agents`` accepts to ``found``, once, until closed.

    ``remember_refused``: an agent refused once is not asked about again (the exporter's
    choice: a job is in or out for good); otherwise it is asked again at each scan (a process
    that becomes a rank later, an ancestry psutil could not read this time)."""

    def __init__(
        self,
        agents: Callable[[AgentInfo], bool],
        found: Found,
        *,
        interval_s: float,
        name: str,
        remember_refused: bool = False,
    ) -> None:
        self._agents = agents
        self._found = found
        self._interval_s = interval_s
        self._remember_refused = remember_refused
        self._seen: set[str] = set()
        #: The runtime directory's entries as of the last full read (``None``: read next
        #: time), and when that read was (``time.monotonic()``).
        self._entries: tuple[int, int, int] | None = None
        self._read_at = 0.0
        self.closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> AgentScan:
        self._thread.start()
        return self

    def refuse(self, address: str) -> None:
        """Never hand ``address`` on (again)."""
        self._seen.add(address)

    def _loop(self) -> None:
        while not self.closed.is_set():
            try:
                if self._may_have_news():
                    self.scan_once()
            except Exception:  # a bad description file must not stop the scan; try again
                pass
            self.closed.wait(self._interval_s)

    def _may_have_news(self) -> bool:
        """Whether the next scan may find something the last did not: the directory's entries
        changed, or the last full read is :data:`FULL_SCAN_S` old. The directory is looked at
        before it is read, so a change while it is read shows at the next look."""
        now = time.monotonic()
        try:
            info = os.stat(runtime_dir())
            entries: tuple[int, int, int] | None = (info.st_ino, info.st_mtime_ns, info.st_size)
            if time.time_ns() - info.st_mtime_ns < SETTLED_S * 1e9:
                entries = None  # a change within the same tick of its clock would be unseen
        except OSError:
            entries = None
        if entries is not None and entries == self._entries and now - self._read_at < FULL_SCAN_S:
            return False
        self._entries, self._read_at = entries, now
        return True

    def scan_once(self) -> None:
        for info in list_agents(clean_stale=False):
            if self.closed.is_set():
                return  # closed meanwhile: nothing new may outlive close()
            if info.address in self._seen:
                continue
            if not self._agents(info):
                if self._remember_refused:
                    self._seen.add(info.address)
                continue
            self._seen.add(info.address)
            self._found(info)

    def close(self, wait_s: float | None = 5.0) -> None:
        """Stop scanning; once this returns (from another thread, within ``wait_s``; ``None``:
        however long it takes), nothing more is found."""
        self.closed.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=wait_s)

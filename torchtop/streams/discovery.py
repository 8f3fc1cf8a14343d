"""Finding agents: which of this user's agents a consumer follows (:class:`Agents`, the one
filter) and noticing them as they start (:class:`AgentScan`, the one scan loop).

Every consumer that follows more than one agent goes through here: the runner's ranks
(:class:`~torchtop.streams.runs.RankFeeds`), a node's relay, ``torchtop attach --node``, the
exporter (:mod:`torchtop.export.service`) and ``torchtop ps``'s grouping of ranks under the job
that launched them. Standard library and psutil only (psutil when a process's ancestry is asked).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass

from torchtop.transport import AgentInfo, list_agents


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
        self.closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> AgentScan:
        self._thread.start()
        return self

    def forget(self, address: str) -> None:
        """Let the next scan find ``address`` again."""
        self._seen.discard(address)

    def refuse(self, address: str) -> None:
        """Never hand ``address`` on (again)."""
        self._seen.add(address)

    def _loop(self) -> None:
        while not self.closed.is_set():
            try:
                self.scan_once()
            except Exception:  # a bad description file must not stop the scan; try again
                pass
            self.closed.wait(self._interval_s)

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

    def close(self, wait_s: float = 5.0) -> None:
        """Stop scanning; once this returns (from another thread), nothing more is found."""
        self.closed.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=wait_s)

    def join(self, timeout: float | None = None) -> None:
        self.closed.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

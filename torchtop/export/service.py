"""The exporter: follows agents on this node, folds each one's stream, serves the figures.

``torchtop run --metrics`` follows the agents that descend from the runner (the job, or every
rank under torchrun); ``torchtop export`` follows one PID, one run, or every agent of this user,
picking up jobs that start later. Each agent gets its own connection (client ``exporter``); one
thread reads them all (:class:`~torchtop.streams.reader.FeedReader`: a node of many ranks, or
1,024 simulated ones, would otherwise be as many threads contending for the interpreter and the
job set's lock); scrapes and OTLP pushes read immutable figures and never wait for a feed.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchtop.export.figures import JobFigures, figures_of
from torchtop.model.advice import RANK_EVAL_INTERVAL_S, Advisor
from torchtop.model.job import JobModel
from torchtop.model.run import RunModel
from torchtop.protocol import Hello, Message
from torchtop.streams.discovery import AgentScan, launcher_of, run_of
from torchtop.streams.feed import AgentFeed
from torchtop.streams.heap import EXPORTER_OLD_THRESHOLD, SettledHeap
from torchtop.streams.reader import FeedReader
from torchtop.transport import AgentInfo

#: Seconds between looks for new agents.
DISCOVER_INTERVAL_S = 0.5
#: Seconds a job that ended stays exported, so that a scrape after its end sees its last values.
ENDED_KEEP_S = 60.0
#: A followed job's recent step points and run sample of step times (see :func:`_exported_job`).
EXPORTED_STEP_POINTS = 256
EXPORTED_HISTORY_STEPS = 64
EXPORTED_STEP_FRAMES = 256


@dataclass
class _Followed:
    info: AgentInfo
    feed: AgentFeed
    #: Its hello arrived, of the run asked for: its stream is folded into the run's model.
    accepted: bool = False
    figures: JobFigures | None = None
    ended_at: float | None = None
    dirty: bool = False


def _exported_job() -> JobModel:
    # Only the latest readings and the totals are exported: keep no long series. The steps'
    # recent points serve the run's rules (hangs, stragglers: their 10 s window, whole up to 25
    # steps a second; a faster job's window is its last 256 steps); the run's sample of step
    # times, for percentiles no exported figure uses, stays small. A model of the defaults
    # holds about 3 MiB of steps: 1,024 ranks took 1.2 GiB; 600 points, 0.29 MiB a rank after
    # ten minutes; 256, 0.14 MiB.
    return JobModel(
        history_points=1, log_lines=1, max_events=1, step_points=EXPORTED_STEP_POINTS,
        history_steps=EXPORTED_HISTORY_STEPS, step_frames=EXPORTED_STEP_FRAMES,
        advice=Advisor(interval_s=RANK_EVAL_INTERVAL_S),
    )  # fmt: skip


AgentFilter = Callable[[AgentInfo], bool]


@dataclass
class JobSet:
    """The jobs being exported: one stream per agent (keyed by its address) folded into the
    jobs' :class:`RunModel`."""

    ended_keep_s: float = ENDED_KEEP_S
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _jobs: dict[str, _Followed] = field(default_factory=dict)
    model: RunModel = field(default_factory=lambda: RunModel(new_job=_exported_job))
    #: Only jobs whose hello says this run id (``torchtop export RUN``).
    run: str | None = None

    def follows(self, address: str) -> bool:
        with self._lock:
            return address in self._jobs

    def add(self, info: AgentInfo, feed: AgentFeed) -> None:
        with self._lock:
            self._jobs[info.address] = _Followed(info, feed)

    def apply(self, address: str, message: Message) -> None:
        """Fold one message of the agent at ``address`` (called in its feed thread)."""
        with self._lock:
            job = self._jobs.get(address)
            if job is None:
                return
            if not job.accepted:
                if not isinstance(message, Hello):
                    return
                if self.run is not None and (message.run_id or str(message.pid)) != self.run:
                    job.feed.close()  # another run: not ours
                    return
                job.accepted = True
            self.model.apply(address, message)
            job.dirty = True

    def ended(self, address: str) -> bool:
        """The agent's stream ended; False if it never said hello (or is not our run)."""
        with self._lock:
            job = self._jobs.get(address)
            if job is None:
                return False
            job.ended_at = time.monotonic()
            if not job.accepted:
                del self._jobs[address]
                return False
            return True

    def figures(self) -> list[JobFigures]:
        """The figures of every job, as of now (ended jobs for ``ended_keep_s``)."""
        now = time.monotonic()
        out = []
        with self._lock:
            for address, job in list(self._jobs.items()):
                if job.ended_at is not None and now - job.ended_at > self.ended_keep_s:
                    del self._jobs[address]
                    self.model.jobs.pop(address, None)
                    continue
                if not job.accepted:
                    continue
                if job.dirty or job.figures is None:
                    model = self.model.jobs[address]
                    hello = model.hello
                    late = (
                        self.model.advisor.lateness.get((hello.run_id, hello.rank))
                        if hello is not None and hello.rank is not None
                        else None
                    )
                    job.figures = figures_of(model, self.model.advisor.findings, late)
                    job.dirty = False
                if job.figures is not None:
                    out.append(job.figures)
        # A job that only started its run's ranks and waits (mp.spawn's parent) is their
        # launcher, not a job of 0 steps: its figures are the ranks'.
        singles = {s.labels.pid for s in out if s.labels.rank is None}
        launchers = {launcher_of(s.labels.pid, singles) for s in out if s.labels.rank is not None}
        out = [s for s in out if s.labels.pid not in launchers]
        out.sort(key=lambda s: (s.labels.run, s.labels.rank or 0, s.labels.pid))
        return out

    def feeds(self) -> list[AgentFeed]:
        with self._lock:
            return [job.feed for job in self._jobs.values()]

    def all_ended(self) -> bool:
        with self._lock:
            return all(job.ended_at is not None for job in self._jobs.values())

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for job in self._jobs.values() if job.accepted)


class Exporter:
    """Follows agents that pass ``accept`` and serves their figures (Prometheus and/or OTLP)."""

    def __init__(
        self,
        accept: AgentFilter,
        *,
        metrics: tuple[str, int] | None = None,
        otlp: str | None = None,
        otlp_interval_s: float = 10.0,
        run: str | None = None,
    ) -> None:
        self.jobs = JobSet(run=run)
        self._reader = FeedReader(name="torchtop-export-feeds")
        # A job is in or out for good; one whose description names no run yet is followed,
        # and its hello decides (:class:`JobSet`).
        self._scan = AgentScan(
            lambda info: info.pid != os.getpid() and accept(info) and self._of_run(info),
            self.follow,
            interval_s=DISCOVER_INTERVAL_S,
            name="torchtop-export",
            remember_refused=True,
        )
        self.server: Any = None
        self.otlp: Any = None
        self._heap = SettledHeap(old=EXPORTER_OLD_THRESHOLD)
        if metrics is not None:
            from torchtop.export.prometheus import serve

            self.server = serve(self.jobs.figures, metrics)
        if otlp is not None:
            from torchtop.export.otlp import push

            try:
                self.otlp = push(self.jobs.figures, otlp, interval_s=otlp_interval_s)
            except Exception:
                self.close()
                raise

    def start(self) -> Exporter:
        self._heap.settle()  # what exists now lives as long as the exporter
        self._scan.start()
        return self

    def announce(self) -> None:
        """Say where the figures go, on stderr (a test or a user reads the chosen port here)."""
        if self.server is not None:
            print(f"torchtop: serving metrics on {self.server.url}", file=sys.stderr, flush=True)
        if self.otlp is not None:
            print(f"torchtop: pushing metrics to {self.otlp.endpoint}", file=sys.stderr, flush=True)

    def discover_once(self) -> None:
        self._scan.scan_once()

    def _of_run(self, info: AgentInfo) -> bool:
        """Whether the agent's description file places it in the run asked for (its hello
        is checked again: a file without the identity is followed and decided then)."""
        run = self.jobs.run
        if run is None or not info.identity:
            return True
        return run_of(info) == run

    def follow(self, info: AgentInfo) -> None:
        address = info.address
        feed = AgentFeed(
            address=address,
            client="exporter",
            paced=True,  # scraped every few seconds: a sample a second is plenty
            on_message=lambda m: self.jobs.apply(address, m),
            on_end=lambda _reason: self._ended(address),
            reader=self._reader,
        )
        self.jobs.add(info, feed)
        feed.start()

    def _ended(self, address: str) -> None:
        if not self.jobs.ended(address):
            self._scan.refuse(address)  # not one to export: do not connect again

    def close(self, wait_s: float = 0.0) -> None:
        """Stop following and serving. ``wait_s``: first give feeds whose job has exited that
        long to read the job's last frames, so the final push carries its final figures."""
        self._scan.close(wait_s=0.0)
        deadline = time.monotonic() + wait_s
        for feed in self.jobs.feeds():
            feed.join(max(0.0, deadline - time.monotonic()))
        if self.otlp is not None:
            self.otlp.close()
        for feed in self.jobs.feeds():
            feed.close()
        self._reader.close()
        if self.server is not None:
            self.server.close()
        self._heap.release()

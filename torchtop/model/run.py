"""Several jobs side by side: the ranks of one run, or every job a viewer follows.

Pure Python. Each stream (a connection to one agent, one recording) is fed to the model of its
job with :meth:`RunModel.apply`, under a key the feeder chooses (its address, a file name);
once the stream's ``hello`` arrives, the job is also known by its :class:`JobIdentity` (host,
pid, rank). Nothing here assumes there is only one job.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from torchtop.model.job import JobIdentity, JobModel
from torchtop.model.run_advice import RankAdvisor
from torchtop.protocol import JobExited, Message, StackSampled


@dataclass
class RunModel:
    """One :class:`JobModel` per stream, in the order the streams first spoke."""

    #: Makes the model of a new stream (tests and replays pass their own settings).
    new_job: Callable[[], JobModel] = JobModel
    jobs: dict[str, JobModel] = field(default_factory=dict)
    #: Findings about the ranks of each run together: a straggler, a hang, a dead rank.
    advisor: RankAdvisor = field(default_factory=RankAdvisor)
    #: The latest message time of any job, kept as the messages come.
    latest: float | None = None

    def apply(self, stream: str, message: Message) -> JobModel:
        """Fold ``message`` from ``stream`` into its job's model (made on first use)."""
        job = self.jobs.get(stream)
        if job is None:
            job = self.jobs[stream] = self.new_job()
        before = job.version
        job.apply(message)
        if job.version != before:
            # A stack or an exit changes what the run-wide rules say at once (both are rare).
            urgent = isinstance(message, (StackSampled, JobExited))
            now = job.now
            if now is not None and (self.latest is None or now > self.latest):
                self.latest = now
            # The rules read every rank: asked when an evaluation is due, not at each message
            # of each rank (at 256 ranks, a walk over 256 models for every message).
            if self.latest is not None and (urgent or self.advisor.due(self.latest)):
                self.advisor.evaluate(list(self.jobs.values()), self.latest)
        return job

    def __iter__(self) -> Iterator[JobModel]:
        return iter(self.jobs.values())

    def __len__(self) -> int:
        return len(self.jobs)

    def by_identity(self) -> dict[JobIdentity, JobModel]:
        """The jobs whose hello arrived, by identity (a later stream of the same job wins)."""
        return {job.identity: job for job in self.jobs.values() if job.identity is not None}

    def job(self, identity: JobIdentity) -> JobModel | None:
        return self.by_identity().get(identity)

    @property
    def version(self) -> int:
        """Goes up whenever any job's model changes."""
        return sum(job.version for job in self.jobs.values())

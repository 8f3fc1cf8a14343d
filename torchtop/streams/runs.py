"""Every rank of a multi-rank job in one recording. Standard library and psutil only.

Under ``torchtop run torchrun ...`` each rank runs its own agent (:mod:`torchtop.agent.rank_start`).
:class:`RankFeeds` finds them in the runtime directory as they start (the agents whose process
descends from the launcher) and streams each into the one recording, every frame tagged with its
source: a ``"src"`` field naming the rank's pid, which readers that do not know it ignore. Lines
without it (the job's output as the runner copied it, the launcher's exit) belong to the run.
:attr:`RecordingContents.sources` reads the tags back, so a report can fold each rank into its
own model (:mod:`torchtop.report.run`).
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from torchtop.job_output import rank_prefix, split_rank
from torchtop.model import JobModel
from torchtop.model.advice import RANK_EVAL_INTERVAL_S, Advisor, Finding
from torchtop.model.run import RunModel
from torchtop.protocol import JobExited, LogLine, Message, encode
from torchtop.streams.discovery import Agents, AgentScan
from torchtop.streams.feed import AgentFeed
from torchtop.streams.reader import FeedReader
from torchtop.streams.recording import FrameSink, tag_frame
from torchtop.transport import AgentInfo, pid_alive

if TYPE_CHECKING:
    from torchtop.streams.nodes import NodeFeed

#: How often the runtime directory is scanned for new ranks.
SCAN_INTERVAL_S = 0.2

#: What a run's view keeps of each rank; a rank's own screen, once opened, follows the rank's
#: full stream with a model of its own. A minute of samples at 10 Hz; the run's log holds each
#: rank's lines (prefixed), so the rank's model needs few; steps for the strips' minute and the
#: rules' windows; a sample of the run's step times for the hang rule's median. A single job's
#: defaults hold about 5 MiB a rank: 64 ranks grew the view to 400 MiB in 8 minutes, and the
#: collector's work with it (13% of a core after a minute, 24% after 8).
RANK_SAMPLE_POINTS = 600
RANK_LOG_LINES = 100
RANK_STEP_POINTS = 2048
RANK_HISTORY_STEPS = 1024
#: ``steps`` frames for the recent window: an agent sends one or two a second (at most ten), so
#: the default 6,000 took an hour and 2 MiB a rank to fill, a run's view growing all that time.
RANK_STEP_FRAMES = 256


def rank_model() -> JobModel:
    """The model of one rank in a run's view (see :data:`RANK_STEP_POINTS`)."""
    return JobModel(
        history_points=RANK_SAMPLE_POINTS,
        log_lines=RANK_LOG_LINES,
        step_points=RANK_STEP_POINTS,
        history_steps=RANK_HISTORY_STEPS,
        step_frames=RANK_STEP_FRAMES,
        advice=Advisor(interval_s=RANK_EVAL_INTERVAL_S),
    )


class TaggedWriter:
    """Writes one source's frames into a shared recording, each tagged with the source."""

    def __init__(self, writer: FrameSink, source: str) -> None:
        self._writer = writer
        self.source = source

    def write_frame(self, frame: bytes) -> None:
        self._writer.write_frame(tag_frame(frame, self.source))


def lost_exit_to(
    feed: AgentFeed, writer: FrameSink | None, deliver: Callable[[Message], None]
) -> None:
    """At the end of a rank's feed: if its stream broke off without its exit (killed), that
    exit, saying so, into ``writer`` (the rank's tagged recording) and to ``deliver``, so the
    view and the report show the rank dead."""
    lost = feed.lost_exit()
    if lost is None:
        return
    if writer is not None:
        writer.write_frame(encode(lost).rstrip(b"\n"))
    deliver(lost)


class RankFeeds:
    """Follows each agent that ``follows(info)`` accepts (the ranks below a launcher, those of
    one run) as it appears, into ``writer`` (a recording, a relay's output) until closed."""

    def __init__(
        self,
        follows: Callable[[AgentInfo], bool],
        writer: FrameSink | None,
        on_message: Callable[[Message], None] | None = None,
        on_rank: Callable[[str, Message], None] | None = None,
        client: str = "recorder",
    ) -> None:
        """``on_message(message)`` and ``on_rank(stream, message)`` get every rank's messages,
        the second with the rank's stream (its pid, as the recording tags it)."""
        self._follows = follows
        self._client = client
        self._writer = writer
        self._on_message = on_message
        self._on_rank = on_rank
        self.feeds: dict[int, AgentFeed] = {}
        #: One thread reads every rank (a thread per rank: 64 threads waking for each frame).
        self._reader = FeedReader(name="torchtop-rank-feeds")
        self._scan = AgentScan(
            follows, self._follow, interval_s=SCAN_INTERVAL_S, name="torchtop-ranks"
        )
        #: The launcher's exit is the job's: no rank's exit stands for it.
        self.saw_exit = None

    def start(self) -> RankFeeds:
        self._scan.start()
        return self

    def scan(self) -> None:
        """Start following each new rank's agent."""
        self._scan.scan_once()

    def _follow(self, info: AgentInfo) -> None:
        pid = info.pid
        writer = TaggedWriter(self._writer, str(pid)) if self._writer is not None else None
        feed = AgentFeed(
            pid=pid,
            alive=functools.partial(pid_alive, pid),
            writer=writer,
            client=self._client,
            paced=True,  # a rank's row needs a sample a second; a recording gets them all
            on_message=functools.partial(self._received, str(pid)),
            on_end=functools.partial(self._ended, pid, writer),
            reader=self._reader,
        )
        self.feeds[pid] = feed
        feed.start()

    def _received(self, stream: str, message: Message) -> None:
        if self._on_message is not None:
            self._on_message(message)
        if self._on_rank is not None:
            self._on_rank(stream, message)

    def _ended(self, pid: int, writer: TaggedWriter | None, reason: str) -> None:
        """A rank whose stream broke off without its exit (killed): its exit, saying so, goes
        into the recording as the rank's own, so the report shows it dead."""
        lost_exit_to(self.feeds[pid], writer, functools.partial(self._received, str(pid)))

    def join(self, timeout: float | None = None) -> bool:
        """Stop looking for new ranks; wait until every followed rank's stream has ended."""
        self._scan.close(wait_s=timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        done = True
        for feed in list(self.feeds.values()):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done = feed.join(left) and done
        return done

    def close(self) -> None:
        """Stop following: every agent's connection is closed when this returns."""
        self._scan.close()
        for feed in list(self.feeds.values()):
            feed.close()
        self._reader.close()

    @property
    def frames(self) -> int:
        return sum(feed.frames for feed in self.feeds.values())

    @property
    def end_reason(self) -> str:
        if not self.feeds:
            return (
                "no rank started an agent (torchtop starts one in each process torchelastic "
                "starts with RANK, LOCAL_RANK and TORCHELASTIC_RUN_ID set)"
            )
        return "; ".join(sorted({feed.end_reason for feed in self.feeds.values()}))


def below(launcher_pid: int) -> Agents:
    """The agents whose process descends from ``launcher_pid``: the ranks it started."""
    return Agents(below=launcher_pid)


def ranks_below(job_pid: int) -> Agents:
    """The agents below a job's own process that say which rank they are: the ranks that
    ``torch.multiprocessing.spawn``, Lightning's launcher or a scheduler's tasks started."""
    return Agents(below=job_pid, ranks_only=True)


class JobFeeds:
    """A job's own agent, untagged as for a single process, and the agents of the processes
    below it that become ranks (:class:`RankFeeds`, tagged): a job that never starts a rank
    is recorded exactly as a single process is; one that does is a run whose own stream is
    the launcher's (the parent that waits, or rank 0 itself, whose hello then says so)."""

    def __init__(self, job: AgentFeed, ranks: RankFeeds) -> None:
        self.job = job
        self.ranks = ranks

    def start(self) -> JobFeeds:
        self.job.start()
        self.ranks.start()
        return self

    @property
    def saw_exit(self) -> JobExited | None:
        return self.job.saw_exit

    def join(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        done = self.job.join(timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self.ranks.join(left) and done

    def close(self) -> None:
        self.job.close()
        self.ranks.close()

    @property
    def frames(self) -> int:
        return self.job.frames + self.ranks.frames

    @property
    def end_reason(self) -> str:
        return self.job.end_reason


class RunFold:
    """What the view of a run reads: its ranks side by side (:class:`RunModel`, with the
    run's findings) and the run's own stream (the job's output, the launcher's exit), folded
    by whoever calls :meth:`drain` (the viewer's thread) from what the feeds only queue."""

    #: Messages queued between two drains, at most (the oldest go first past it).
    MAX_PENDING = 200_000
    #: What quitting the view does to the job, for the view to say.
    on_quit = "stops the job"
    #: Where each rank's output comes from, so that no line shows twice: the launcher's output
    #: (False: a launcher torchtop started, whose lines carry their rank's prefix), or each
    #: rank's agent (True: what a rank's agent captured, if it captures, prefixed here).
    rank_lines = True
    #: The view's columns this source has no figure for (Prometheus: no pid, no backward).
    not_carried: tuple[str, ...] = ()
    #: Whether the run has output lines for the view's log (Prometheus carries none).
    has_output = True

    def __init__(self) -> None:
        self.model = RunModel(new_job=rank_model)
        #: The run's own stream: the job's output and the launcher's exit.
        self.launcher = JobModel()
        self._pending: deque[tuple[str | None, Message]] = deque(maxlen=self.MAX_PENDING)
        #: The node of each stream from another node (``torchtop attach --node``), as the user
        #: named it; local streams are absent.
        self.remote: dict[str, str] = {}
        #: Nodes whose relay was lost, with why: their ranks show as lost.
        self.lost_nodes: dict[str, str] = {}
        #: The rank whose screen is open, and where its lines go (:meth:`follow_rank_lines`).
        self._rank_follower: tuple[int, Callable[[LogLine], None]] | None = None

    def node_of(self, stream: str) -> str:
        """Where a rank runs: the node as the user named it (``--node``), else the host its
        hello names."""
        node = self.remote.get(stream)
        if node is not None:
            return node
        job = self.model.jobs.get(stream)
        return job.hello.hostname if job is not None and job.hello is not None else ""

    @property
    def findings(self) -> list[Finding]:
        """The run's findings the view shows: its advisor's over the ranks' streams."""
        return self.model.advisor.findings

    def is_lost(self, stream: str) -> bool:
        """The rank's node was lost before the rank ended: its state is unknown."""
        node = self.remote.get(stream)
        job = self.model.jobs.get(stream)
        return node in self.lost_nodes and not (job is not None and job.job_ended)

    def opens_elsewhere(self, stream: str) -> str | None:
        """Why a rank's full screens cannot open here, with where they can; None if they can
        (a rank of this machine)."""
        node = self.remote.get(stream)
        if node is None:
            return None
        job = self.model.jobs.get(stream)
        hello = job.hello if job is not None else None
        pid = hello.pid if hello is not None else "PID"
        rank = f"rank {hello.rank}" if hello is not None and hello.rank is not None else "it"
        return (
            f"{rank} runs on node {node}: its full screens open there "
            f"(`torchtop attach {pid}` on that node); this view shows its row only"
        )

    def queue(self, stream: str | None, message: Message) -> None:
        """From any thread: a rank's message (``stream``: its pid), or the run's own."""
        self._pending.append((stream, message))
        follower = self._rank_follower
        if follower is not None and stream is None and isinstance(message, LogLine):
            rank, text = split_rank(message.text)
            if rank == follower[0]:
                follower[1](LogLine(t=message.t, stream=message.stream, text=text))

    def follow_rank_lines(self, rank: int, emit: Callable[[LogLine], None] | None) -> None:
        """Hand each line of the run's output that rank ``rank`` wrote, as it is queued and
        without its prefix, to ``emit`` (from the thread that queues it); None stops."""
        self._rank_follower = (rank, emit) if emit is not None else None

    def rank_lines_so_far(self, rank: int) -> list[LogLine]:
        """The lines of rank ``rank`` in the run's output folded so far, without their prefix."""
        lines = []
        for entry in self.launcher.logs:
            line_rank, text = split_rank(entry.text)
            if line_rank == rank:
                lines.append(LogLine(t=entry.t, stream=entry.stream, text=text))
        return lines

    def drain(self) -> bool:
        """Fold what arrived since the last call; True if anything did."""
        pending = self._pending
        changed = False
        while pending:
            stream, message = pending.popleft()
            if stream is None:
                self.launcher.apply(message)
            else:
                job = self.model.apply(stream, message)
                if self.rank_lines and isinstance(message, LogLine):
                    self.launcher.apply(self._prefixed(job, message))
            changed = True
        return changed

    @staticmethod
    def _prefixed(job: JobModel, line: LogLine) -> LogLine:
        """A rank's own line as the run's log shows it: with its rank's prefix."""
        rank = job.hello.rank if job.hello is not None else None
        if rank is None:
            return line
        return LogLine(t=line.t, stream=line.stream, text=rank_prefix(rank) + line.text)

    @property
    def started(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def running(self) -> bool:
        raise NotImplementedError

    def stop_job(self) -> None:
        """What quitting the view does (:attr:`on_quit`)."""
        raise NotImplementedError

    def status(self) -> tuple[str, bool]:
        """The view's line about the job, and whether it is still going."""
        raise NotImplementedError


class AttachedRun(RunFold):
    """The ranks of a run torchtop did not start (``torchtop attach`` with no PID): this
    machine's agents, and those of other nodes through their relays (``--node``: connected
    already, :class:`~torchtop.streams.nodes.NodeFeed`), followed live until their streams end;
    quitting detaches and leaves the job running."""

    on_quit = "detaches (the job runs on)"

    def __init__(
        self,
        agents: Sequence[AgentInfo],
        nodes: Sequence[NodeFeed] = (),
        writer: FrameSink | None = None,
    ) -> None:
        """``writer``: a recording of every rank, each frame tagged with its stream (a local
        rank's pid, a node's rank's ``NODE/PID``: the nodes' feeds were given it too)."""
        super().__init__()
        self.agents = list(agents)
        self.nodes = list(nodes)
        self.writer = writer
        self.feeds: list[AgentFeed] = []
        self._reader = FeedReader(name="torchtop-rank-feeds")  # one thread reads every rank
        self._by_stream: dict[str, AgentFeed] = {}
        self._started = False
        self._leaving = False

    @property
    def started(self) -> bool:
        return self._started

    def start(self) -> None:
        self._started = True
        for info in self.agents:
            stream = str(info.pid)
            writer = TaggedWriter(self.writer, stream) if self.writer else None
            feed = AgentFeed(
                address=info.address,
                paced=True,  # a rank's row needs a sample a second; a recording gets them all
                on_message=functools.partial(self.queue, stream),
                writer=writer,
                on_end=functools.partial(self._rank_ended, stream, writer),
                reader=self._reader,
            )
            self.feeds.append(feed)
            self._by_stream[stream] = feed
            feed.start()
        for node in self.nodes:
            node.start(
                on_message=functools.partial(self._remote_message, node.label),
                on_end=functools.partial(self._node_ended, node.label),
            )

    def _rank_ended(self, stream: str, writer: TaggedWriter | None, reason: str) -> None:
        """A local rank killed while the view ran shows dead, as under ``torchtop run``."""
        if not self._leaving:
            lost_exit_to(self._by_stream[stream], writer, functools.partial(self.queue, stream))

    def _remote_message(self, node: str, stream: str, message: Message) -> None:
        self.remote[stream] = node
        self.queue(stream, message)

    def _node_ended(self, node: str, reason: str) -> None:
        """A node's relay ended while the view ran: its ranks show as lost, the others go on."""
        if self._leaving:
            return
        self.lost_nodes[node] = reason
        text = f"torchtop: node {node} lost: {reason}"
        self.queue(None, LogLine(t=time.time(), stream="stderr", text=text))

    def running(self) -> bool:
        return any(not feed.ended.is_set() for feed in self.feeds) or any(
            not node.ended.is_set() for node in self.nodes
        )

    def stop_job(self) -> None:
        self._leaving = True
        for feed in self.feeds:
            feed.close()
        self._reader.close()
        for node in self.nodes:
            node.close()

    def status(self) -> tuple[str, bool]:
        going = self.running()
        parts = []
        if self.agents:
            parts.append(f"attached to {len(self.agents)} agents")
        for node in self.nodes:
            if node.label in self.lost_nodes:
                parts.append(f"node {node.label} lost")
            else:
                dropped = f", {node.dropped} frames dropped" if node.dropped else ""
                parts.append(f"node {node.label}: {len(node.sources)} agents{dropped}")
        if not going:
            return "every rank's stream has ended", False
        return " · ".join(parts), True

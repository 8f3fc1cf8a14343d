"""The concrete sources: a job torchtop runs, a running agent, and a recording."""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from torchtop.job_output import LogFollower
from torchtop.protocol import Hello, JobExited, LogLine, Message, Request
from torchtop.report.exit_summary import JobEnd, StderrTail, exit_status
from torchtop.streams.feed import AgentFeed
from torchtop.streams.recording import RecordingWriter
from torchtop.streams.runner import Job, LogLines, RunSpec, say
from torchtop.streams.runs import RankFeeds, RunFold, ranks_below
from torchtop.streams.source import (
    Sink,
    Source,
    SourceConnected,
    SourceDisconnected,
    SourceSilent,
    SourceStatus,
)
from torchtop.transport import find_agent


class JobLines:
    """The job's output for a viewer whose agent does not send it (torchtop copies it outside
    the job): fed to the viewer's sink from :meth:`start` until :meth:`close`."""

    def start(self, sink: Sink) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Stop feeding."""


class LogFileLines(JobLines):
    """The log file of a job ``torchtop run`` left running: its recent lines, then the rest as
    they are written, under a line that says where its output goes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._follower: LogFollower | None = None

    def start(self, sink: Sink) -> None:
        note = f"── the job's output goes to {self.path} ──"
        sink(LogLine(t=time.time(), stream="torchtop", text=note))
        self._follower = LogFollower(
            self.path, lambda text: sink(LogLine(t=time.time(), stream="", text=text))
        ).start()

    def close(self) -> None:
        if self._follower is not None:
            self._follower.close()


class RankLines(JobLines):
    """One rank's lines in the output of the run ``torchtop run`` launched (each carries its
    rank's prefix there): those folded so far, then each as it comes, without the prefix."""

    def __init__(self, run: RunFold, rank: int) -> None:
        self.run = run
        self.rank = rank
        self._lock = threading.Lock()
        self._held: list[LogLine] | None = []  # what arrives while the past is handed over

    def start(self, sink: Sink) -> None:
        def arrived(line: LogLine) -> None:
            with self._lock:
                if self._held is not None:
                    self._held.append(line)
                    return
            sink(line)

        self.run.follow_rank_lines(self.rank, arrived)
        self.run.drain()  # the run's view is closed: nothing else folds it now
        past = self.run.rank_lines_so_far(self.rank)
        for line in past:
            sink(line)
        last_t = past[-1].t if past else float("-inf")
        with self._lock:
            held, self._held = self._held or [], None
        for line in held:
            if line.t > last_t:  # queued before the fold above, so already handed over
                sink(line)

    def close(self) -> None:
        self.run.follow_rank_lines(self.rank, None)


class LiveSource(Source):
    """A running agent, optionally recorded to a file; ``lines``: the job's output, where its
    agent does not send it."""

    mode = "live"

    def __init__(
        self,
        address: str,
        writer: RecordingWriter | None = None,
        lines: JobLines | None = None,
    ) -> None:
        self.address = address
        self.writer = writer
        self.lines = lines
        self._feed: AgentFeed | None = None

    def start(self, sink: Sink) -> None:
        if self.lines is not None:
            self.lines.start(sink)

        def connected(address: object) -> None:
            sink(SourceConnected(t=time.time(), address=str(address)))

        def ended(reason: str) -> None:
            if self.writer is not None:
                # The recording says the stream broke off; the viewer shows it as lost.
                lost = self._feed.lost_exit() if self._feed is not None else None
                if lost is not None:
                    self.writer.write(lost)
                self.writer.close()
            sink(SourceDisconnected(t=time.time(), reason=reason))

        self._feed = AgentFeed(
            address=self.address,
            writer=self.writer,
            on_message=sink,
            on_connect=connected,
            on_end=ended,
            on_silence=_silence_to(sink),
        ).start()

    def close(self) -> None:
        if self.lines is not None:
            self.lines.close()
        if self._feed is not None:
            self._feed.close()
            self._feed.join(2.0)
        if self.writer is not None:
            self.writer.close()

    def send_request(self, action: str) -> bool:
        return _request(self._feed, action)


class RunSource(Source):
    """A job started by ``torchtop run``: the viewer owns it, so quitting asks what to do."""

    mode = "run"
    owns_job = True

    #: A rank's messages held until a run's view takes them (the oldest go first past it).
    MAX_HELD = 200_000

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.job = Job(spec, on_line=self._line)
        self.writer = RecordingWriter(spec.record) if spec.record is not None else None
        self._feed: AgentFeed | None = None
        self._sink: Sink | None = None
        self._log: LogLines | None = None  # the job's output, copied by this process
        self._stderr = StderrTail()  # where the summary after the viewer finds a traceback
        self.detached = False
        self.stopping = False
        #: The processes of the job that became ranks (mp.spawn's, Lightning's, a scheduler's
        #: tasks), recorded tagged; set once the first speaks.
        self.ranks: RankFeeds | None = None
        self.ranks_found = threading.Event()
        #: Called (from a feed's thread) when the first rank speaks: the viewer makes way for
        #: the run's view (:class:`ScriptRun`).
        self.on_ranks: Callable[[], None] | None = None
        self._rank_sink: Callable[[str, Message], None] | None = None
        self._held: deque[tuple[str, Message]] = deque(maxlen=self.MAX_HELD)
        self._rank_lock = threading.Lock()
        #: The job's own agent's latest hello (it says so when the job's process is a rank).
        self.hello: Hello | None = None

    def _emit(self, message: Message) -> None:
        """To whoever shows the job now: the viewer's sink, then a run's view."""
        sink = self._sink
        if sink is not None:
            sink(message)

    def start(self, sink: Sink) -> None:
        self._sink = sink
        log = self._log = LogLines(self.writer, self._emit)
        self.job.start()
        text = f"started pid {self.job.pid}; waiting for its agent"
        self._emit(SourceStatus(t=time.time(), text=text))

        def connected(address: object) -> None:
            self._emit(SourceConnected(t=time.time(), address=str(address)))

        def received(message: Message) -> None:
            log.agent_spoke()
            if isinstance(message, Hello):
                self.hello = message
            self._emit(message)

        self._feed = AgentFeed(
            pid=self.job.pid,
            alive=self.job.running,
            writer=self.writer,
            on_message=received,
            on_connect=connected,
            on_end=self._ended,
            on_silence=_silence_to(self._emit),
        ).start()
        self.ranks = RankFeeds(
            ranks_below(self.job.pid),
            self.writer,
            on_message=lambda _m: log.agent_spoke(),
            on_rank=self._rank_message,
        ).start()

    def _rank_message(self, stream: str, message: Message) -> None:
        with self._rank_lock:
            if self._rank_sink is not None:
                self._rank_sink(stream, message)
                return
            self._held.append((stream, message))
        if not self.ranks_found.is_set():
            self.ranks_found.set()
            if self.on_ranks is not None:
                self.on_ranks()

    def hand_over(self, sink: Sink, rank_sink: Callable[[str, Message], None]) -> None:
        """From now on the job's messages go to ``sink`` and its ranks' to ``rank_sink`` (a
        run's view), the ranks' held so far first."""
        self._sink = sink
        with self._rank_lock:
            while self._held:
                rank_sink(*self._held.popleft())
            self._rank_sink = rank_sink

    def _ended(self, reason: str) -> None:
        sink = self._emit
        assert self._feed is not None
        if self.ranks is not None:
            self.ranks.join(5.0)  # the ranks end before the job that waits for them
        if not self.detached:
            returncode = self.job.wait(timeout=10.0)
            if self._log is not None:
                self._log.close()
            if returncode is not None and self._feed.saw_exit is None:
                _code, why = exit_status(returncode)
                exited = JobExited(t=time.time(), exit_code=returncode, reason=why)
                if self.writer is not None:
                    self.writer.write(exited)
                sink(exited)
        if self.writer is not None:
            self.writer.close()
        sink(SourceDisconnected(t=time.time(), reason=reason))

    def _line(self, stream: str, text: str) -> None:
        self._stderr.line(stream, text)
        if self._log is not None:
            self._log.line(stream, text)

    def job_running(self) -> bool:
        return self.job.running()

    def send_request(self, action: str) -> bool:
        return _request(self._feed, action)

    def stop_job(self) -> None:
        self.stopping = True
        self.job.stop()

    def wait_after_viewer(self) -> None:
        """After the viewer has gone: let a stopping job end and the recording be finished."""
        if self.stopping:
            print(f"torchtop: stopping job pid {self.job.pid}…", file=sys.stderr)
            self.job.wait_stopping(say)
        if self._feed is not None:
            self._feed.join(10.0)
        self.close()

    def close(self) -> None:
        if self.job.running():
            self.detached = True
            self.job.detach()
        if self._feed is not None:
            self._feed.close()
            self._feed.join(2.0)
        if self.ranks is not None:
            self.ranks.close()
        if self.writer is not None:
            self.writer.close()

    def job_end(self) -> JobEnd:
        """How the job stands once the viewer is gone, for the summary printed then."""
        process = self.job.process
        return JobEnd(
            pid=self.job.pid,
            returncode=None if process is None or self.job.running() else process.returncode,
            log_path=self.job.log_path,
            record=self.spec.record,
            stopped=self.stopping,
            stderr=tuple(self._stderr.lines()),
        )


class ScriptRun(RunFold):
    """A job ``torchtop run`` started as a script whose processes became ranks
    (``torch.multiprocessing.spawn``, Lightning's launcher, a scheduler's tasks), taken over
    from its :class:`RunSource` for the view of its ranks. The job's own process is the run's
    launcher (its output and exit are the run's), and a rank too once its hello says so."""

    #: The ranks' lines come through the job's output, as the job wrote them.
    rank_lines = False

    def __init__(self, source: RunSource) -> None:
        super().__init__()
        self.source = source
        self.stopped = False
        #: The job's own stream as a rank's (its pid), once its hello names a rank.
        self._own: str | None = None
        if source.hello is not None:
            self._job_message(source.hello)
        source.hand_over(self._job_message, self.queue)

    def _job_message(self, message: Message) -> None:
        self.queue(None, message)
        if isinstance(message, Hello) and message.rank is not None:
            self._own = str(message.pid)
        if self._own is not None and not isinstance(message, LogLine):
            self.queue(self._own, message)

    @property
    def started(self) -> bool:
        return True

    def start(self) -> None:
        pass  # started already, under the single job's viewer

    def running(self) -> bool:
        return self.source.job_running()

    def status(self) -> tuple[str, bool]:
        if self.running():
            return f"launcher pid {self.source.job.pid} running", True
        return f"job ended, exit code {self.source.job.exit_code}", False

    def stop_job(self) -> None:
        self.stopped = self.stopped or self.running()
        self.source.stop_job()


class RecordingSource(Source):
    """A recording played back at its own pace (times ``speed``), pausable and seekable."""

    mode = "replay"
    seekable = True
    takes_requests = False

    def __init__(self, messages: list[Message], speed: float = 1.0) -> None:
        self._messages = messages
        self._speed = speed
        self._paused = False
        self._to_end = False
        self._closed = False
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self.delivered = 0

    def start(self, sink: Sink) -> None:
        self._thread = threading.Thread(
            target=self._play, args=(sink,), name="torchtop-replay", daemon=True
        )
        self._thread.start()

    def _play(self, sink: Sink) -> None:
        # Times come from the recording, never the wall clock: the viewer's "now" is the
        # recording's.
        times = [t for m in self._messages if isinstance(t := getattr(m, "t", None), float)]
        first_t, last_t = (times[0], max(times)) if times else (time.time(), time.time())
        sink(SourceConnected(t=first_t, address="recording"))
        record_start: float | None = None
        position = 0.0  # seconds into the recording that playback has reached
        last = time.monotonic()
        for message in self._messages:
            t = getattr(message, "t", None)
            if isinstance(t, float):
                if record_start is None:
                    record_start = t
                while True:
                    with self._changed:
                        if self._closed:
                            return
                        now = time.monotonic()
                        if not self._paused:
                            position += (now - last) * self._speed
                        last = now
                        if self._to_end or position >= t - record_start:
                            break
                        wait = 0.5 if self._paused else (t - record_start - position) / self._speed
                        self._changed.wait(min(wait, 0.25))
            sink(message)
            self.delivered += 1
        sink(SourceDisconnected(t=last_t, reason="end of recording"))

    def _update(self, **changes: object) -> None:
        with self._changed:
            for name, value in changes.items():
                setattr(self, name, value)
            self._changed.notify_all()

    def close(self) -> None:
        self._update(_closed=True)

    @property
    def paused(self) -> bool:
        return self._paused

    def set_paused(self, paused: bool) -> None:
        self._update(_paused=paused)

    def jump_to_end(self) -> None:
        self._update(_to_end=True)

    def set_speed(self, speed: float) -> None:
        self._update(_speed=max(0.1, min(speed, 1000.0)))

    @property
    def speed(self) -> float:
        return self._speed


def _silence_to(sink: Sink) -> Callable[[float], None]:
    """The feed's silence callback: tell the viewer how long the agent has said nothing."""
    return lambda silent_s: sink(SourceSilent(t=time.time(), silent_s=round(silent_s)))


_request_ids = itertools.count(1)


def _request(feed: AgentFeed | None, action: str) -> bool:
    """Send ``action`` to the agent behind ``feed``, numbered so its answer can be told."""
    if feed is None:
        return False
    return feed.send(Request(action=action, id=next(_request_ids)))


def attach_rank(run: RunFold, pid: int) -> tuple[Source, str] | None:
    """A source on rank ``pid``'s agent and the title of its screen; None if its agent is
    gone. A run torchtop launched has its ranks' output (their agents do not send it)."""
    info = find_agent(pid)
    if info is None:
        return None
    rank = info.identity.get("rank")
    lines = RankLines(run, rank) if isinstance(rank, int) and not run.rank_lines else None
    return LiveSource(info.address, lines=lines), f"rank {rank}: {info.command}"

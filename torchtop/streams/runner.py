"""``torchtop run``: start the user's unchanged script in a child process with the agent inside.

Standard library only: the child imports torch, this process never does. The job's stdout and
stderr are copied by this process (:mod:`torchtop.job_output`), so they arrive complete however
the job ends. Headless, they pass straight through to our terminal and we exit with the job's
exit code. With a viewer, the child gets its own session and no terminal, so it can outlive a
viewer that detaches; its output goes to a log file and the viewer.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtop.agent.rank_start import job_environment, new_run_id, rank_environment, unbuffered
from torchtop.job_output import JobOutput
from torchtop.launch import python_module
from torchtop.private_files import open_private
from torchtop.protocol import JobExited, LogLine, Message, OutOfMemory
from torchtop.report.exit_summary import JobEnd, StderrTail, exit_status
from torchtop.streams.feed import AgentFeed
from torchtop.streams.recording import RecordingWriter
from torchtop.streams.runs import JobFeeds, RankFeeds, RunFold, below, ranks_below
from torchtop.transport import TransportError, ensure_runtime_dir, job_log_path

OPTIONS_ENV = "TORCHTOP_AGENT_OPTIONS"
#: Modules that launch the ranks of a distributed job: run as launchers (:attr:`RunSpec.launcher`).
LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")
#: How long a job stopped from the viewer has to stop by itself after SIGINT (its own handlers
#: run: a checkpoint saved on KeyboardInterrupt, ranks torn down) before SIGTERM, and after
#: SIGTERM before SIGKILL. Ctrl-C while torchtop waits cuts the wait short.
INTERRUPT_GRACE_S = 30.0
TERM_GRACE_S = 5.0
#: While a job stops, how often torchtop says it still waits.
STOPPING_SAY_EVERY_S = 10.0


class RunError(Exception):
    """The job cannot be started; the message says why and what to do."""


@dataclass
class RunSpec:
    """What to run and how to watch it."""

    #: ``["train.py", *args]`` or ``["-m", "pkg.module", *args]``.
    target: list[str]
    agent_options: dict[str, Any] = field(default_factory=dict)
    headless: bool = False
    record: Path | None = None

    @property
    def launcher(self) -> bool:
        """The target starts the job's ranks (``torchrun ...``, ``-m torch.distributed.run ...``,
        ``python -m torch.distributed.run ...``: any program, on PATH or by its path, that is not
        a ``.py`` script): it runs without an agent, and each rank torchelastic starts gets one
        (:mod:`torchtop.agent.rank_start`)."""
        first = self.target[0] if self.target else ""
        if first == "-m":
            return len(self.target) > 1 and self.target[1] in LAUNCHER_MODULES
        path = Path(first)
        if path.is_file():  # a program named by its path, not a Python script
            return path.suffix != ".py" and os.access(path, os.X_OK)
        return os.sep not in first and shutil.which(first) is not None

    def validate(self) -> None:
        if not self.target:
            raise RunError("nothing to run: give a script or -m MODULE (see `torchtop run --help`)")
        if self.launcher:
            pass  # the launcher checks its own arguments
        elif self.target[0] == "-m":
            if len(self.target) < 2 or not self.target[1]:
                raise RunError("-m needs a module name, e.g. `torchtop run -m mypkg.train`")
        else:
            script = Path(self.target[0])
            if not script.exists():
                raise RunError(f"no such script: {script} (check the path; to run a module use -m)")
            if script.is_dir():
                raise RunError(f"{script} is a directory; give the training script inside it")
        if self.record is not None and not self.record.parent.resolve().is_dir():
            raise RunError(f"cannot record to {self.record}: its directory does not exist")

    @property
    def description(self) -> str:
        return " ".join(self.target[1:] if self.target[0] == "-m" else self.target)


class LogLines:
    """The job's output lines as ``log`` messages for a recording (and a viewer's ``sink``).

    A recording starts with the agent's hello: lines that come before it are held until the
    agent has spoken (:meth:`agent_spoke`) or the job has ended (:meth:`close`).
    """

    def __init__(
        self, writer: RecordingWriter | None, sink: Callable[[Message], None] | None = None
    ) -> None:
        self._writer = writer
        self._sink = sink
        self._pending: list[LogLine] | None = []
        self._lock = threading.Lock()

    def line(self, stream: str, text: str) -> None:
        message = LogLine(t=time.time(), stream=stream, text=text)
        if self._sink is not None:
            self._sink(message)
        with self._lock:
            if self._pending is not None:
                self._pending.append(message)
            elif self._writer is not None:
                self._writer.write(message)

    def agent_spoke(self) -> None:
        """The agent's first frame is in the recording: held lines follow it, the rest as they
        come."""
        with self._lock:
            pending, self._pending = self._pending, None
            if pending and self._writer is not None:
                for message in pending:
                    self._writer.write(message)

    close = agent_spoke


class Job:
    """The child process running the user's code under the agent.

    ``on_line(stream, text)`` receives each line the job writes to stdout or stderr.
    """

    def __init__(self, spec: RunSpec, on_line: Callable[[str, str], None] | None = None) -> None:
        self.spec = spec
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        self._log_fd: int | None = None
        self._on_line = on_line
        self._output: JobOutput | None = None
        self._stopping = False
        #: Set to cut the current wait of the stop short (Ctrl-C while waiting).
        self._hurry = threading.Event()
        #: The run's id, for ranks whose launcher gives none (``TORCHTOP_RUN_ID``).
        self.run_id = new_run_id()

    def start(self) -> None:
        spec = self.spec
        # A viewer or recorder will attach: at exit the agent waits (briefly) until it has all.
        expects_client = not spec.headless or spec.record is not None
        options = {
            "linger_s": 5.0 if expects_client else 0.0,
            **spec.agent_options,
            # Copied here, outside the job, so that nothing it wrote dies with it.
            "capture_output": False,
        }
        if spec.launcher:
            # No agent in the launcher: one in each rank it starts, from its sitecustomize.
            target = spec.target
            env = rank_environment(os.environ, options, target, self.run_id)
            cmd = [sys.executable, *target] if target[0] == "-m" else list(target)
        else:
            # The job's agent, and one in each process of it that becomes a rank.
            env = job_environment(os.environ, options, self.run_id)
            env[OPTIONS_ENV] = json.dumps(options)
            cmd = [*python_module("torchtop.agent.bootstrap"), *spec.target]
        unbuffered(env)
        try:
            # The agent listens there: a folder that is not the user's own is refused up front.
            directory = ensure_runtime_dir()
        except TransportError as exc:
            raise RunError(str(exc)) from None
        if spec.headless:
            destinations = {"stdout": sys.stdout.fileno(), "stderr": sys.stderr.fileno()}
        else:
            self.log_path = directory / f"starting-{os.getpid()}-{time.time_ns()}.log"
            log = open_private(self.log_path)
            self._log_fd = os.dup(log.fileno())
            log.close()
            destinations = dict.fromkeys(JobOutput.STREAMS, self._log_fd)
        output = JobOutput(destinations, self._on_line)
        stdout, stderr = output.child_fds
        try:
            if spec.headless:
                self.process = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr)
            else:
                self.process = subprocess.Popen(
                    cmd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=stdout,
                    stderr=stderr,
                    start_new_session=True,
                )
        except OSError as exc:
            output.close_unstarted()
            raise RunError(f"cannot start {cmd[0]}: {exc.strerror}") from None
        output.start()
        self._output = output
        if self.log_path is not None:
            # Named after the job, so the runtime directory's cleanup knows whose it is.
            named = job_log_path(self.process.pid, self.log_path.parent)
            with contextlib.suppress(OSError):
                os.rename(self.log_path, named)
                self.log_path = named

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait(self, timeout: float | None = None) -> int | None:
        """The job's return code once it has exited and its output is all copied; None if it
        still runs after ``timeout``."""
        assert self.process is not None
        try:
            returncode = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        if self._output is not None:
            self._output.finish()
        self._close_log()
        return returncode

    @property
    def exit_code(self) -> int | None:
        """The shell-style exit code of a job that has ended (``128 + N`` for signal N, so a job
        stopped by its SIGINT gives 130); None while it runs or before it started."""
        if self.process is None or self.process.returncode is None:
            return None
        return exit_status(self.process.returncode)[0]

    def detach(self) -> None:
        """The job runs on without us: its output goes on into the log file through a relay."""
        if self._output is not None and self._log_fd is not None and self.running():
            self._output.hand_over(self._log_fd)
            self._output = None
            self._close_log()

    def _close_log(self) -> None:
        if self._log_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._log_fd)
            self._log_fd = None

    def signal(self, signum: int) -> None:
        if self.running():
            with contextlib.suppress(OSError):
                os.kill(self.pid, signum)

    def stop(self) -> None:
        """Interrupt the job, then terminate and kill it if it will not stop. Returns at once."""
        if self._stopping or not self.running():
            return
        self._stopping = True
        threading.Thread(target=self._escalate, name="torchtop-stop", daemon=True).start()

    def _escalate(self) -> None:
        # A job in a session of its own (under a viewer) is stopped as a terminal's Ctrl-C
        # stops one: every process of it gets the signal, so the ranks that the job's process
        # started itself (mp.spawn's, Lightning's) stop with it instead of outliving it.
        kill = os.killpg if not self.spec.headless else os.kill
        steps = (
            (signal.SIGINT, INTERRUPT_GRACE_S),
            (signal.SIGTERM, TERM_GRACE_S),
            (signal.SIGKILL, TERM_GRACE_S),
        )
        for signum, grace in steps:
            if not self.running():
                return
            self._hurry.clear()
            with contextlib.suppress(OSError):
                kill(self.pid, signum)
            deadline = time.monotonic() + grace
            while self.running() and time.monotonic() < deadline and not self._hurry.is_set():
                self._hurry.wait(0.1)
            if not self.running():
                return

    def wait_stopping(self, say: Callable[[str], None]) -> int | None:
        """Wait for a job being stopped to end, saying every few seconds that it still stops;
        Ctrl-C here goes on to the next signal at once (SIGTERM, then SIGKILL)."""
        began = time.monotonic()
        next_say = began + min(STOPPING_SAY_EVERY_S, 3.0)
        while True:
            try:
                code = self.wait(0.2)
            except KeyboardInterrupt:
                self._hurry.set()
                say(f"torchtop: terminating job pid {self.pid}")
                continue
            if code is not None:
                return code
            if time.monotonic() >= next_say:
                next_say = time.monotonic() + STOPPING_SAY_EVERY_S
                say(
                    f"torchtop: job pid {self.pid} is still stopping "
                    f"({time.monotonic() - began:.0f} s; its own KeyboardInterrupt handling runs "
                    f"for up to {INTERRUPT_GRACE_S:.0f} s); Ctrl-C terminates it now"
                )


def run_headless(spec: RunSpec) -> int:
    """Run the job with its output passing straight through; return its exit code."""
    writer = RecordingWriter(spec.record) if spec.record is not None else None
    log = LogLines(writer)
    job = Job(spec, on_line=log.line)
    job.start()
    # Ctrl-C reaches the job from the terminal; we outlive it to finish the recording.
    # SIGTERM sent to us is passed on to the job.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    previous_term = signal.signal(signal.SIGTERM, lambda signum, frame: job.signal(signum))
    feed: JobFeeds | RankFeeds | None = None
    ooms: list[OutOfMemory] = []

    def received(message: Message) -> None:
        log.agent_spoke()
        if isinstance(message, OutOfMemory):
            ooms.append(message)

    try:
        if writer is not None and spec.launcher:
            # Every rank's agent, each tagged with its source in the one recording.
            feed = RankFeeds(below(job.pid), writer, on_message=received).start()
        elif writer is not None:
            # The job's agent; and those of its processes that become ranks, if any do.
            feed = JobFeeds(
                AgentFeed(
                    pid=job.pid,
                    alive=job.running,
                    writer=writer,
                    client="recorder",
                    on_message=received,
                ),
                RankFeeds(ranks_below(job.pid), writer, on_message=received),
            ).start()
        returncode = job.wait()
        assert returncode is not None
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, previous_term)
    code, reason = exit_status(returncode)
    if feed is not None and writer is not None:
        feed.join(timeout=10.0)
        feed.close()
        log.close()
        if feed.saw_exit is None:
            writer.write(JobExited(t=time.time(), exit_code=returncode, reason=reason))
        writer.close()
        if feed.frames == 0:
            print(
                "torchtop: the recording holds only the job's output and exit, no figures: "
                f"{feed.end_reason or 'no agent'}",
                file=sys.stderr,
            )
        for oom in ooms:
            where = oom.snapshot_path or oom.snapshot_error or "no snapshot"
            print(
                f"torchtop: out of memory on {oom.device} captured; snapshot: {where}; "
                f"`torchtop report {spec.record}` explains it",
                file=sys.stderr,
            )
    if returncode == -signal.SIGINT:
        raise KeyboardInterrupt  # the job ended by Ctrl-C: so do we, as python would
    return code


class RankRun(RunFold):
    """A multi-rank job ``torchtop run`` starts under a viewer: the launcher, each rank's agent
    (:class:`RankFeeds`) and the job's output, folded for the view (:class:`RunFold`)."""

    #: The ranks' lines come through the launcher's output, each with its rank's prefix.
    rank_lines = False

    def __init__(self, spec: RunSpec) -> None:
        super().__init__()
        self.spec = spec
        self.job = Job(spec, on_line=self._line)
        self.writer = RecordingWriter(spec.record) if spec.record is not None else None
        self._log = LogLines(self.writer, functools.partial(self.queue, None))
        self._stderr = StderrTail()  # where the summary after the viewer finds a traceback
        self.feeds: RankFeeds | None = None
        self.stopped = False

    @property
    def started(self) -> bool:
        return self.job.process is not None

    def start(self) -> None:
        self.job.start()
        self.feeds = RankFeeds(
            below(self.job.pid),
            self.writer,
            on_message=lambda _m: self._log.agent_spoke(),
            on_rank=self.queue,
        ).start()

    def _line(self, stream: str, text: str) -> None:
        self._stderr.line(stream, text)
        self._log.line(stream, text)

    def status(self) -> tuple[str, bool]:
        if self.running():
            return f"launcher pid {self.job.pid} running", True
        return f"job ended, exit code {self.job.exit_code}", False

    def running(self) -> bool:
        return self.job.running()

    def stop_job(self) -> None:
        """Interrupt the launcher (it stops its ranks), then terminate and kill it."""
        self.stopped = self.stopped or self.job.running()
        self.job.stop()

    def finish(self) -> int | None:
        """After the viewer: wait for the job to end, finish the recording; its exit code."""
        returncode = self.job.wait_stopping(say) if self.stopped else self.job.wait()
        assert returncode is not None
        feeds = self.feeds
        if feeds is not None:
            feeds.join(timeout=10.0)
            feeds.close()
        self._log.close()
        if self.writer is not None:
            _code, reason = exit_status(returncode)
            self.writer.write(JobExited(t=time.time(), exit_code=returncode, reason=reason))
            self.writer.close()
        return self.job.exit_code

    def job_end(self) -> JobEnd:
        """How the job ended, for the summary printed after the viewer."""
        assert self.job.process is not None
        return JobEnd(
            pid=self.job.pid,
            returncode=self.job.process.returncode,
            log_path=self.job.log_path,
            record=self.spec.record,
            stopped=self.stopped,
            stderr=tuple(self._stderr.lines()),
        )


def say(line: str) -> None:
    """One line to the user on stderr, at once."""
    print(line, file=sys.stderr, flush=True)

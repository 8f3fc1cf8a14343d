"""Recording without a viewer (``torchtop attach --headless --record FILE``): one loop,
:func:`record`, for whatever is followed: one agent (:class:`AgentRecording`), the ranks of a run
(:class:`RunRecording`), or a job watched from outside (:class:`OutsideRecording`).

The loop runs until what it follows ends, ``duration`` passes or Ctrl-C; it shows progress on a
terminal, closes the recording with everything received, and says in one line what was recorded.
(``torchtop run --headless`` is the runner's: it waits on the job it started,
:func:`torchtop.streams.runner.run_headless`.)
"""

from __future__ import annotations

import sys
import time
from typing import Protocol

from torchtop.streams.feed import AgentFeed
from torchtop.streams.outside import OutsideWatch
from torchtop.streams.recording import RecordingWriter
from torchtop.streams.runs import AttachedRun
from torchtop.text import printable
from torchtop.transport import AgentInfo


class Recorded(Protocol):
    """What :func:`record` follows."""

    def start(self) -> None: ...

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout``; whether what is followed has ended."""
        ...

    def stop(self) -> None:
        """Stop following; what was received is in the recording when this returns."""
        ...

    def progress(self) -> str: ...

    def summary(self) -> str: ...

    def exit_code(self) -> int: ...


def record(target: Recorded, writer: RecordingWriter, duration: float | None) -> int:
    """Record ``target`` into ``writer`` until it ends, ``duration`` passes or Ctrl-C; the exit
    code (1 when nothing was heard)."""
    start = time.monotonic()
    interactive = sys.stderr.isatty()
    target.start()
    try:
        while True:
            elapsed = time.monotonic() - start
            if duration is not None and elapsed >= duration:
                break
            if interactive:
                limit = f"/{duration:.0f}" if duration else ""
                print(f"\r{target.progress()}: {elapsed:5.1f}{limit} s", end="", file=sys.stderr)
            wait = 0.5 if duration is None else min(0.5, duration - elapsed)
            if target.wait(wait):
                break
    except KeyboardInterrupt:
        pass
    finally:
        try:
            target.stop()
        finally:
            writer.close()
    if interactive:
        print(file=sys.stderr)
    print(target.summary(), file=sys.stderr)
    return target.exit_code()


class AgentRecording:
    """One agent's stream."""

    def __init__(self, info: AgentInfo, writer: RecordingWriter) -> None:
        self.pid = info.pid
        self.writer = writer
        self.feed = AgentFeed(address=info.address, writer=writer, client="recorder")

    def start(self) -> None:
        self.feed.start()

    def wait(self, timeout: float) -> bool:
        return self.feed.ended.wait(timeout)

    def stop(self) -> None:
        self.feed.close()
        self.feed.join(2.0)
        lost = self.feed.lost_exit()
        if lost is not None:
            self.writer.write(lost)

    def progress(self) -> str:
        return f"recording pid {self.pid}, {self.feed.frames} frames"

    def summary(self) -> str:
        reason = printable(self.feed.end_reason or "stopped")
        return (
            f"recorded {self.feed.frames} frames from pid {self.pid} to {self.writer.path} "
            f"({reason})"
        )

    def exit_code(self) -> int:
        return 0 if self.feed.frames else 1


class RunRecording:
    """Every rank of a run, this node's and other nodes' (through their relays)."""

    #: How often the ranks' queued messages are folded.
    DRAIN_S = 0.25

    def __init__(self, run: AttachedRun, writer: RecordingWriter) -> None:
        self.run = run
        self.writer = writer

    def start(self) -> None:
        self.run.start()

    def wait(self, timeout: float) -> bool:
        time.sleep(min(timeout, self.DRAIN_S))
        self.run.drain()
        return not self.run.running()

    def stop(self) -> None:
        self.run.stop_job()
        self.run.drain()

    def progress(self) -> str:
        return f"recording {len(self.run.model)} ranks, {self.writer.frames} frames"

    def summary(self) -> str:
        ranks = len(self.run.model)
        nodes = len({self.run.node_of(stream) for stream in self.run.model.jobs})
        line, _going = self.run.status()
        return (
            f"recorded {self.writer.frames} frames of {ranks} ranks on {nodes} nodes to "
            f"{self.writer.path} ({printable(line)})"
        )

    def exit_code(self) -> int:
        return 0 if len(self.run.model) else 1


class OutsideRecording:
    """A job no agent could be started in: ``/proc`` and NVML, read from outside. Exit code 1
    all the same: the attach was refused."""

    def __init__(self, pid: int, reason: str, writer: RecordingWriter) -> None:
        self.pid = pid
        self.writer = writer
        self.watch = OutsideWatch(pid, writer.write, reason=reason)

    def start(self) -> None:
        self.watch.start()

    def wait(self, timeout: float) -> bool:
        return self.watch.ended.wait(timeout)

    def stop(self) -> None:
        self.watch.stop()

    def progress(self) -> str:
        return f"recording pid {self.pid} from outside"

    def summary(self) -> str:
        return f"recorded pid {self.pid} from outside to {self.writer.path}"

    def exit_code(self) -> int:
        return 1

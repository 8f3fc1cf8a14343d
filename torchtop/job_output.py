"""The job's stdout and stderr, copied outside the job. Standard library only.

Under ``torchtop run`` the job writes its fds 1 and 2 into pipes that torchtop's own process
reads. A copy made inside the job would die with it: the line printed just before ``os._exit``,
faulthandler's report on a segfault or a C library's message before ``abort()`` sit in a pipe
that nobody reads any more. Read from outside, every byte the job (and any process it forked)
wrote arrives, however it ends. Each byte goes on unchanged to its destination (the terminal, or
the live run's log file) and each line is handed on for the recording and the viewer.

When a viewer leaves a job running, the pipes pass to a small relay process
(``python -m torchtop.job_output``) that goes on copying them into the log file until the job
and its children have closed them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import select
import subprocess
import sys
import threading
from collections.abc import Callable

from torchtop.launch import python_module

#: A longer line is cut: frames stay far below the protocol's size limit.
MAX_LINE_CHARS = 16_384
#: Once the job has exited, a pipe quiet this long is done: a forked worker that outlived the
#: job may hold its write end open forever.
QUIET_AFTER_EXIT_S = 0.2
#: After reading a little (less than :data:`BATCH_BELOW_BYTES` from each pipe), the copy waits
#: this long before it reads again, so that a job printing a line every few milliseconds wakes
#: it a few dozen times a second rather than once a line: each wake-up costs tens of
#: microseconds of CPU, most of what copying a chatty job's output costs. A line reaches its
#: destination this much later at most; a job writing more than that is read without pause.
BATCH_S = 0.03
BATCH_BELOW_BYTES = 16_384
#: The pipes' capacity where the system allows it (Linux): a burst this large written while
#: the copy waits never blocks the job.
PIPE_BYTES = 1 << 20
#: How each line a rank of a torchrun job wrote reaches the launcher's output under ``torchtop
#: run``: torchrun's ``--tee`` prefix (its ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``), with the
#: global rank rather than torchrun's default ``[default<local rank>]:``.
RANK_PREFIX_TEMPLATE = "[rank${rank}]:"
_RANK_PREFIX = re.compile(r"\[rank(\d+)\]:")


def rank_prefix(rank: int) -> str:
    """The prefix of a line that rank ``rank`` wrote (:data:`RANK_PREFIX_TEMPLATE`)."""
    return f"[rank{rank}]:"


def split_rank(text: str) -> tuple[int | None, str]:
    """A line of a multi-rank job's output: the rank whose line it is (``None``: the
    launcher's own) and the rank's text without its prefix."""
    match = _RANK_PREFIX.match(text)
    if match is None:
        return None, text
    return int(match.group(1)), text[match.end() :]


class LineSplitter:
    """Bytes of one stream in, whole lines out (``emit(text)``); over-long lines are cut."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self._emit = emit
        self._partial = b""

    def feed(self, data: bytes) -> None:
        *lines, rest = (self._partial + data).split(b"\n")
        for line in lines:
            self._emit_line(line)
        if len(rest) > MAX_LINE_CHARS * 4:
            self._emit_line(rest)
            rest = b""
        self._partial = rest

    def flush(self) -> None:
        """The last line, even without its newline."""
        if self._partial:
            self._emit_line(self._partial)
            self._partial = b""

    def _emit_line(self, raw: bytes) -> None:
        text = raw.decode("utf-8", errors="replace").rstrip("\r")
        if len(text) > MAX_LINE_CHARS:
            text = text[:MAX_LINE_CHARS] + " …"
        with contextlib.suppress(Exception):
            self._emit(text)


def write_all(fd: int, data: bytes) -> bool:
    """Write all of ``data``; False once the destination is gone (a closed terminal or pipe)."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        return False
    return True


class JobOutput:
    """Pipes for the job's stdout and stderr, copied by a thread of this process.

    ``destinations`` maps ``"stdout"``/``"stderr"`` to the fd each stream is copied to;
    ``on_line(stream, text)`` receives every line.
    """

    STREAMS = ("stdout", "stderr")

    def __init__(
        self, destinations: dict[str, int], on_line: Callable[[str, str], None] | None = None
    ) -> None:
        self._destinations = dict(destinations)
        self._on_line = on_line
        self._read: dict[str, int] = {}
        self._write: dict[str, int] = {}
        for stream in self.STREAMS:
            self._read[stream], self._write[stream] = os.pipe()
            _enlarge(self._read[stream])
        #: Written to when the job has exited or is handed over: the copy waits on it too.
        self._wake_read, self._wake_write = os.pipe()
        self._splitters = {
            stream: LineSplitter(lambda text, s=stream: self._line(s, text))  # type: ignore[misc]
            for stream in self.STREAMS
        }
        self._job_exited = threading.Event()
        self._handover = threading.Event()
        self._thread = threading.Thread(target=self._copy, name="torchtop-output", daemon=True)

    @property
    def child_fds(self) -> tuple[int, int]:
        """The write ends, for the job's stdout and stderr."""
        return self._write["stdout"], self._write["stderr"]

    def start(self) -> None:
        """Once the job has started: our copies of the write ends go, so EOF means it is done."""
        for fd in self._write.values():
            os.close(fd)
        self._write.clear()
        self._thread.start()

    def close_unstarted(self) -> None:
        """The job could not be started: release every pipe end."""
        for fd in [*self._write.values(), *self._read.values()]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._write.clear()
        self._read.clear()
        self._close_wake()

    def finish(self, timeout: float = 5.0) -> None:
        """After the job has exited: copy what is left in the pipes, then stop."""
        self._job_exited.set()
        self._wake()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_wake()

    def hand_over(self, log_fd: int) -> None:
        """The job runs on without us: a detached relay process copies the rest to ``log_fd``."""
        self._handover.set()
        self._wake()
        self._thread.join()
        self._close_wake()
        remaining = list(self._read.values())
        if remaining:
            with contextlib.suppress(OSError):
                subprocess.Popen(
                    [*python_module("torchtop.job_output"), str(log_fd), *map(str, remaining)],
                    pass_fds=(log_fd, *remaining),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
        self._close_read_ends()

    def _line(self, stream: str, text: str) -> None:
        if self._on_line is not None:
            self._on_line(stream, text)

    def _wake(self) -> None:
        if self._wake_write >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake_write, b"x")

    def _close_wake(self) -> None:
        """Once the copying thread is done (a closed descriptor's number may be reused)."""
        for fd in (self._wake_read, self._wake_write):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_read = self._wake_write = -1

    def _copy(self) -> None:
        by_fd = {fd: stream for stream, fd in self._read.items()}
        passthrough = dict.fromkeys(self.STREAMS, True)
        wake = self._wake_read
        while by_fd and not self._handover.is_set():
            exited = self._job_exited.is_set()
            try:
                ready, _, _ = select.select(
                    [*by_fd, wake], [], [], QUIET_AFTER_EXIT_S if exited else None
                )
            except (OSError, ValueError):
                break
            if not ready and exited:
                break
            if wake in ready:  # the job exited or is handed over: looked at above, next turn
                ready.remove(wake)
                with contextlib.suppress(OSError):
                    os.read(wake, 64)
            light = True
            for fd in ready:
                stream = by_fd[fd]
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    data = b""
                if not data:
                    del by_fd[fd]
                    continue
                light = light and len(data) < BATCH_BELOW_BYTES
                if passthrough[stream]:
                    # Keep reading whatever happens to the destination: the job must never block.
                    passthrough[stream] = write_all(self._destinations[stream], data)
                self._splitters[stream].feed(data)
            if ready and light and not exited:
                # Let a chatty job's next lines gather; the end or a hand-over cuts this short.
                with contextlib.suppress(OSError, ValueError):
                    select.select([wake], [], [], BATCH_S)
        if not self._handover.is_set():
            for splitter in self._splitters.values():
                splitter.flush()
            self._close_read_ends()

    def _close_read_ends(self) -> None:
        for fd in self._read.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._read.clear()


#: The lines of a job's log file shown when a viewer comes to a job left running, read from at
#: most this many bytes at its end.
RECENT_LOG_LINES = 200
RECENT_LOG_BYTES = 256 << 10
#: How often the log file of a job left running is read for what it wrote since.
FOLLOW_INTERVAL_S = 0.25


class LogFollower:
    """The log file of a job a viewer left running (its output goes on into it): its last
    :data:`RECENT_LOG_LINES` lines, then each line as it is written, to ``emit(text)`` from a
    thread of its own until :meth:`close`."""

    def __init__(
        self, path: str | os.PathLike[str], emit: Callable[[str], None], *, interval_s: float = 0
    ) -> None:
        self.path = path
        self._emit = emit
        self._interval_s = interval_s or FOLLOW_INTERVAL_S
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="torchtop-log", daemon=True)

    def start(self) -> LogFollower:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        self._thread.join(2.0)

    def _follow(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return
        try:
            start = max(0, os.fstat(fd).st_size - RECENT_LOG_BYTES)
            os.lseek(fd, start, os.SEEK_SET)
            recent: list[str] = []
            splitter = LineSplitter(recent.append)
            data = _read_all(fd)
            if start > 0:  # the first line read is a piece of one
                data = data[data.find(b"\n") + 1 :] if b"\n" in data else b""
            splitter.feed(data)
            for text in recent[-RECENT_LOG_LINES:]:
                self._emit(text)
            recent.clear()
            while not self._closed.wait(self._interval_s):
                splitter.feed(_read_all(fd))
                for text in recent:
                    self._emit(text)
                recent.clear()
        finally:
            os.close(fd)


def _read_all(fd: int) -> bytes:
    chunks = []
    with contextlib.suppress(OSError):
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _enlarge(fd: int) -> None:
    """Give the pipe of ``fd`` :data:`PIPE_BYTES` of room where the system allows it."""
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    if set_size is not None:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, set_size, PIPE_BYTES)


def relay(log_fd: int, read_fds: list[int]) -> None:
    """Copy ``read_fds`` into ``log_fd`` until every writer has closed them, a whole line at a
    time: the streams share the file, and a line one of them wrote in two pieces (``print``
    writes its text, then the newline) must not take in the other's between them. A piece
    without its newline waits for it (or for the end, or :data:`MAX_LINE_CHARS` of it)."""
    open_fds = set(read_fds)
    partial = dict.fromkeys(read_fds, b"")
    while open_fds:
        ready, _, _ = select.select(list(open_fds), [], [])
        for fd in ready:
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            if not data:
                open_fds.discard(fd)
                data, partial[fd] = partial[fd], b""
                write_all(log_fd, data)
                continue
            lines, newline, rest = (partial[fd] + data).rpartition(b"\n")
            if len(rest) > MAX_LINE_CHARS:
                lines, newline, rest = lines + newline + rest, b"", b""
            partial[fd] = rest
            write_all(log_fd, lines + newline)


if __name__ == "__main__":
    relay(int(sys.argv[1]), [int(fd) for fd in sys.argv[2:]])

"""Capture of the job's stdout and stderr at the file-descriptor level, inside the job.

With ``capture_output=True`` the agent puts a pipe behind fds 1 and 2. A reader thread copies every
byte on to the original destination unchanged (so the output still passes straight through) and
publishes each line as a ``log`` frame. Output written by C code and by forked DataLoader workers
is caught too, since it is the descriptor that is redirected, not ``sys.stdout``. The copy dies
with the process, so ``torchtop run`` does not use it: it copies the job's output from outside
(:mod:`torchtop.job_output`), where nothing written before an abrupt end is lost.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
from collections.abc import Callable

from torchtop.agent.threads import agent_thread
from torchtop.job_output import LineSplitter, write_all


class OutputCapture:
    """Tees fds 1 and 2 through pipes; ``emit(stream, text)`` receives each line."""

    def __init__(self, emit: Callable[[str, str], None]) -> None:
        self._emit = emit
        self._streams: list[tuple[str, int, int, int]] = []  # (name, fd, saved fd, read end)
        self._splitters: dict[int, LineSplitter] = {}
        self._passthrough: dict[int, bool] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        for name, fd in (("stdout", 1), ("stderr", 2)):
            saved = os.dup(fd)
            read_end, write_end = os.pipe()
            os.set_inheritable(saved, False)
            os.dup2(write_end, fd)
            os.close(write_end)
            self._streams.append((name, fd, saved, read_end))
            self._splitters[read_end] = LineSplitter(
                lambda text, stream=name: self._emit(stream, text)  # type: ignore[misc]
            )
            self._passthrough[read_end] = True
        self._thread = agent_thread(self._run, "torchtop-output")
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        """Put the original descriptors back and forward what is still in the pipes."""
        if not self._streams:
            return
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for _name, fd, saved, _read_end in self._streams:
            os.dup2(saved, fd)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.close_fds_in_child()

    def close_fds_in_child(self) -> None:
        """Close the pipes' read ends and the saved descriptors: after fork, in the child, they
        are not ours to keep; at :meth:`stop`, once the originals are back, they are done."""
        for _name, _fd, saved, read_end in self._streams:
            with contextlib.suppress(OSError):
                os.close(saved)
            with contextlib.suppress(OSError):
                os.close(read_end)
        self._streams = []

    def _run(self) -> None:
        by_read_end = {read_end: (name, saved) for name, _fd, saved, read_end in self._streams}
        open_ends = set(by_read_end)
        while open_ends:
            # Once stopping, a quiet pipe means done: a forked worker may hold the write end open.
            timeout = 0.1 if self._stop.is_set() else 0.5
            try:
                ready, _, _ = select.select(list(open_ends), [], [], timeout)
            except (OSError, ValueError):
                break
            if not ready:
                if self._stop.is_set():
                    break
                continue
            for read_end in ready:
                try:
                    data = os.read(read_end, 65536)
                except OSError:
                    data = b""
                _name, saved = by_read_end[read_end]
                if not data:
                    open_ends.discard(read_end)
                    continue
                if self._passthrough[read_end]:
                    # The original destination gone (a closed terminal): capture regardless.
                    self._passthrough[read_end] = write_all(saved, data)
                self._splitters[read_end].feed(data)
        for splitter in self._splitters.values():
            splitter.flush()

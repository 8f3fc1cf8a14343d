"""Capture of the job's stdout and stderr at the file-descriptor level.

Under ``torchtop run`` the agent puts a pipe behind fds 1 and 2. A reader thread copies every
byte on to the original destination unchanged (so the output still passes straight through) and
publishes each line as a ``log`` frame. Output written by C code and by forked DataLoader workers
is caught too, since it is the descriptor that is redirected, not ``sys.stdout``.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
from collections.abc import Callable

#: A longer line is cut: frames stay far below the protocol's size limit.
MAX_LINE_CHARS = 16_384


class OutputCapture:
    """Tees fds 1 and 2 through pipes; ``emit(stream, text)`` receives each line."""

    def __init__(self, emit: Callable[[str, str], None]) -> None:
        self._emit = emit
        self._streams: list[tuple[str, int, int, int]] = []  # (name, fd, saved fd, read end)
        self._partial: dict[int, bytes] = {}
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
            self._partial[read_end] = b""
            self._passthrough[read_end] = True
        self._thread = threading.Thread(target=self._run, name="torchtop-output", daemon=True)
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
        for _name, _fd, saved, read_end in self._streams:
            with contextlib.suppress(OSError):
                os.close(saved)
            with contextlib.suppress(OSError):
                os.close(read_end)
        self._streams = []

    def close_fds_in_child(self) -> None:
        """After fork, in the child: the pipes' read ends and saved fds are not ours to keep."""
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
                name, saved = by_read_end[read_end]
                if not data:
                    open_ends.discard(read_end)
                    continue
                self._forward(read_end, saved, data)
                self._split(read_end, name, data)
        for read_end, (name, _saved) in by_read_end.items():
            rest = self._partial.get(read_end, b"")
            if rest:
                self._emit_line(name, rest)
                self._partial[read_end] = b""

    def _forward(self, read_end: int, saved: int, data: bytes) -> None:
        if not self._passthrough[read_end]:
            return
        view = memoryview(data)
        try:
            while view:
                written = os.write(saved, view)
                view = view[written:]
        except OSError:
            # The original destination is gone (a closed terminal): keep capturing regardless.
            self._passthrough[read_end] = False

    def _split(self, read_end: int, name: str, data: bytes) -> None:
        buffered = self._partial[read_end] + data
        *lines, rest = buffered.split(b"\n")
        for line in lines:
            self._emit_line(name, line)
        if len(rest) > MAX_LINE_CHARS * 4:
            self._emit_line(name, rest)
            rest = b""
        self._partial[read_end] = rest

    def _emit_line(self, name: str, raw: bytes) -> None:
        text = raw.decode("utf-8", errors="replace").rstrip("\r")
        if len(text) > MAX_LINE_CHARS:
            text = text[:MAX_LINE_CHARS] + " …"
        with contextlib.suppress(Exception):
            self._emit(name, text)

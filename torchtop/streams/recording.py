"""Recordings: the agent's frames, as received, in a file (``.ttr``). Standard library only.

A recording is the same JSON-lines frames the socket carries, so one code path feeds the viewer
live and from a file. Frames are flushed at least twice a second, so a crash loses at most that;
a file cut short reads up to its last whole frame.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from torchtop.private_files import UnsafeFile, open_private
from torchtop.protocol import MAX_FRAME_BYTES, Message, decode, encode

FLUSH_INTERVAL_S = 0.5
#: A recording of several agents (the ranks of one job) tags each agent's frames with its source.
_SRC = re.compile(rb',"src":"([^"\\]*)"\}\s*$')


def tag_frame(frame: bytes, source: str) -> bytes:
    """``frame`` (one JSON object) with ``"src": source`` added as its last field, which
    readers that do not know it ignore."""
    body = frame.rstrip()
    if not body.endswith(b"}"):
        return frame  # not an object: left as it is, for the reader to skip
    return body[:-1] + b',"src":"' + source.encode() + b'"}'


def retag_frame(frame: bytes, source: str) -> bytes:
    """``frame`` tagged with ``source`` in place of the source it was tagged with (a relay's
    frame, tagged with its agent's pid, recorded under its node's name and that pid)."""
    match = _SRC.search(frame)
    return tag_frame(frame[: match.start()] + b"}" if match else frame, source)


def frame_source(frame: bytes) -> str | None:
    """The source a frame was tagged with by :func:`tag_frame`, or None (the run's own)."""
    match = _SRC.search(frame)
    return match.group(1).decode() if match else None


class FrameSink(Protocol):
    """Where raw frames go: a recording (:class:`RecordingWriter`), or a relay's output."""

    def write_frame(self, frame: bytes) -> None: ...


class RecordingError(Exception):
    """A recording cannot be written or read; the message says why and what to do."""


class RecordingWriter:
    """Appends frames to a file. Thread-safe; flushes at least every half second."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self._file: IO[bytes] = open_private(self.path)  # closed in close()
        except UnsafeFile as exc:
            message = f"cannot write the recording {self.path}: {exc.strerror}"
            raise RecordingError(message) from None
        except OSError as exc:
            raise RecordingError(
                f"cannot write the recording {self.path}: {exc.strerror}; "
                "check that its directory exists and is writable"
            ) from None
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()
        self.frames = 0
        self.closed = False

    def write_frame(self, frame: bytes) -> None:
        """Write one raw frame (without its newline) that has already been decoded once."""
        with self._lock:
            if self.closed:
                return
            self._file.write(frame)
            self._file.write(b"\n")
            self.frames += 1
            now = time.monotonic()
            if now - self._last_flush >= FLUSH_INTERVAL_S:
                self._file.flush()
                self._last_flush = now

    def write(self, message: Message) -> None:
        self.write_frame(encode(message).rstrip(b"\n"))

    def flush(self) -> None:
        with self._lock:
            if not self.closed:
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._file.close()


@dataclass
class RecordingContents:
    messages: list[Message]
    #: Lines that were not valid frames (a torn write, a damaged file); they are skipped.
    skipped: int
    #: True when the file ended mid-frame (the writer was killed).
    truncated: bool
    #: Where the whole frames end: the byte offset of the cut-off frame when ``truncated``.
    end_byte: int = 0
    #: Each message's source (:func:`tag_frame`), None for untagged ones; all None in a
    #: recording of one process.
    sources: list[str | None] = field(default_factory=list)


def read_recording(path: str | os.PathLike[str]) -> RecordingContents:
    """All messages of a recording, skipping unknown kinds and damaged lines. A file without a
    single readable frame (empty, or not a recording) is a :class:`RecordingError`."""
    messages: list[Message] = []
    sources: list[str | None] = []
    skipped = 0
    truncated = False
    end_byte = 0
    for line, complete in _lines(path):
        if not complete:
            truncated = True
            break
        end_byte += len(line) + 1
        if not line.strip():
            continue
        try:
            message = decode(line)
        except Exception:  # ProtocolError, or anything else a damaged line provokes
            skipped += 1
            continue
        if message is not None:
            messages.append(message)
            sources.append(frame_source(line))
    if not messages:
        if end_byte == 0 and not truncated:
            raise RecordingError(
                f"{path} is empty: nothing was recorded in it; "
                "record a job with `torchtop run --record FILE`"
            )
        raise RecordingError(f"{path} is not a torchtop recording (no readable frames)")
    return RecordingContents(
        messages=messages,
        skipped=skipped,
        truncated=truncated,
        end_byte=end_byte,
        sources=sources,
    )


def _lines(path: str | os.PathLike[str]) -> Iterator[tuple[bytes, bool]]:
    try:
        f = open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        raise RecordingError(
            f"no recording at {path}; record one with `torchtop run --record`"
        ) from None
    except OSError as exc:
        raise RecordingError(f"cannot read {path}: {exc.strerror}") from None
    with f:
        while True:
            line = f.readline(MAX_FRAME_BYTES + 1)
            if not line:
                return
            if line.endswith(b"\n"):
                yield line[:-1], True
            elif len(line) > MAX_FRAME_BYTES:
                # An oversized line: skip to its end and count it as damaged.
                while line and not line.endswith(b"\n"):
                    line = f.readline(MAX_FRAME_BYTES + 1)
                yield b"\xff", True
            else:
                yield line, False

"""What ``torchtop run`` prints once its viewer has closed, so the terminal keeps what happened:
how the job ended (its exit code, the signal that killed it, or that it runs on), its last
traceback if it crashed, and where its output and its recording are, each with the command that
reads it. Standard library only."""

from __future__ import annotations

import shlex
import signal
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from torchtop.job_output import split_rank
from torchtop.text import printable

TRACEBACK_START = "Traceback (most recent call last):"
#: The job's last stderr lines kept to find its traceback in (a deep recursion's is cut).
STDERR_TAIL_LINES = 400
#: A traceback longer than this shows its last lines, after a line that says how many are left out.
TRACEBACK_SHOWN_LINES = 40


class StderrTail:
    """The job's most recent stderr lines, fed from its output copier's thread."""

    def __init__(self, size: int = STDERR_TAIL_LINES) -> None:
        self._lines: deque[str] = deque(maxlen=size)
        self._lock = threading.Lock()

    def line(self, stream: str, text: str) -> None:
        if stream == "stderr":
            with self._lock:
                self._lines.append(text.rstrip("\r\n"))

    def lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)


def last_traceback(lines: Iterable[str]) -> list[str]:
    """The last Python traceback among ``lines``, from its first line to the last one written
    after it by the same process. A rank's traceback (its lines carry torchrun's ``[rankN]:``)
    comes before the launcher's own, which only says that a rank failed."""
    split = [split_rank(line) for line in lines]
    for ranked in (True, False):
        starts = [
            i
            for i, (rank, text) in enumerate(split)
            if (rank is not None) == ranked and text.strip(" +|").startswith(TRACEBACK_START)
        ]
        if starts:
            rank = split[starts[-1]][0]
            return [text for r, text in split[starts[-1] :] if r == rank]
    return []


@dataclass(frozen=True)
class JobEnd:
    """How a job the viewer watched stands once the viewer has closed."""

    pid: int
    #: The job's return code (negative: the signal that killed it); None while it runs on.
    returncode: int | None
    log_path: Path | None = None
    record: Path | None = None
    #: The job was stopped from the viewer (its interrupt's traceback is no news).
    stopped: bool = False
    stderr: tuple[str, ...] = ()
    #: False with no ``returncode``: it has ended, but how is not known (a job watched by
    #: ``torchtop attach`` whose stream broke off).
    running: bool = True


def exit_summary(end: JobEnd) -> list[str]:
    """The lines to print: the exit, the traceback if the job crashed, the log and the
    recording, each with the command that reads it. Every string from the job is shown with its
    control characters escaped."""
    lines: list[str] = []
    log = shlex.quote(_visible(str(end.log_path))) if end.log_path is not None else None
    record = shlex.quote(_visible(str(end.record))) if end.record is not None else None
    if end.returncode is None and end.running:
        lines.append(
            f"torchtop: left job pid {end.pid} running; watch it again: torchtop attach {end.pid}"
        )
        if log is not None:
            lines.append(f"torchtop: its output goes on into its log: tail -f {log}")
        if record is not None:
            lines.append(f"torchtop: recorded until now: torchtop report {record}")
        return lines
    if end.returncode is None:
        lines.append(f"torchtop: job pid {end.pid} has ended; its exit status is unknown")
    else:
        lines.extend(_exit_lines(end))
    if log is not None:
        lines.append(f"torchtop: its output is kept in its log: less {log}")
    if record is not None:
        lines.append(
            f"torchtop: the recording: torchtop report {record} (or torchtop replay {record})"
        )
    return lines


def _exit_lines(end: JobEnd) -> list[str]:
    """How the job ended, and its last traceback if it crashed."""
    assert end.returncode is not None
    ended = _ended(end.returncode)
    if end.stopped:
        code = end.returncode if end.returncode >= 0 else 128 - end.returncode
        ended = f"was stopped from the viewer (exit code {code})"
    traceback = last_traceback(end.stderr) if end.returncode != 0 and not end.stopped else []
    if not traceback:
        return [f"torchtop: job pid {end.pid} {ended}"]
    if len(traceback) > TRACEBACK_SHOWN_LINES:
        left_out = len(traceback) - TRACEBACK_SHOWN_LINES
        traceback = [f"… {left_out} lines, in the log", *traceback[-TRACEBACK_SHOWN_LINES:]]
    return [
        f"torchtop: job pid {end.pid} {ended}; its last traceback:",
        *(f"  {_visible(text)}" for text in traceback),
    ]


def exit_status(returncode: int) -> tuple[int, str]:
    """The shell-style exit code of a finished child and its reason in words."""
    if returncode < 0:
        signum = -returncode
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return 128 + signum, f"killed by {name}"
    return returncode, f"exited with code {returncode}"


def _ended(returncode: int) -> str:
    if returncode < 0:
        code, reason = exit_status(returncode)
        return f"was {reason} (exit code {code})"
    return f"exited with code {returncode}"


def _readers(record: str) -> str:
    quoted = shlex.quote(record)
    return f"`torchtop report {quoted}`, or `torchtop replay {quoted}` to watch it again"


def _visible(text: str) -> str:
    """``text`` on one line, with what a terminal would act on shown as escapes."""
    return printable(text, one_line=True)

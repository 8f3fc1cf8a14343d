"""The job's output arrives complete however the job ends: copied outside the job process."""

from __future__ import annotations

import itertools
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import torchtop
from torchtop.protocol import LogLine
from torchtop.streams.recording import read_recording
from torchtop.streams.runner import Job, RunSpec

#: name: (the job, torchtop's exit code, the stream, lines that must arrive)
ABRUPT_ENDS = {
    "os_exit": (
        "print('last words before os._exit')\nimport os\nos._exit(7)\n",
        7,
        "stdout",
        ["last words before os._exit"],
    ),
    "segfault": (
        "import ctypes, faulthandler\nfaulthandler.enable()\nprint('before the crash')\n"
        "ctypes.string_at(0)\n",
        128 + signal.SIGSEGV,
        "stderr",
        ["Fatal Python error: Segmentation fault", 'job.py", line 4 in <module>'],
    ),
    "abort": (
        "import os, sys\nsys.stderr.write('a C library says why, then aborts\\n')\nos.abort()\n",
        128 + signal.SIGABRT,
        "stderr",
        ["a C library says why, then aborts"],
    ),
}


def started(tmp_path: Path, on_line: Callable[[str, str], None]) -> Job:
    """``tmp_path/job.py`` started as ``torchtop run`` starts a job for its viewer."""
    job = Job(
        RunSpec(target=[str(tmp_path / "job.py")], agent_options={"ops": False}), on_line=on_line
    )
    job.start()
    return job


@pytest.mark.parametrize("end", sorted(ABRUPT_ENDS))
def test_output_before_an_abrupt_end_reaches_the_terminal_and_the_recording(
    tmp_path: Path, end: str
) -> None:
    source, code, stream, expected = ABRUPT_ENDS[end]
    (tmp_path / "job.py").write_text(source)
    rec = tmp_path / "r.ttr"
    out = torchtop("run", "--headless", "--no-ops", "--record", str(rec), "job.py", cwd=tmp_path)
    assert out.returncode == code, out.stderr
    printed = out.stdout if stream == "stdout" else out.stderr
    for text in expected:
        assert text in printed, (end, out.stdout, out.stderr)
    recorded = [m for m in read_recording(rec).messages if isinstance(m, LogLine)]
    for text in expected:
        assert any(m.stream == stream and text in m.text for m in recorded), (end, recorded)


def test_a_live_runs_output_reaches_its_log_and_the_viewer(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(ABRUPT_ENDS["os_exit"][0])
    lines: list[tuple[str, str]] = []
    job = started(tmp_path, lambda stream, text: lines.append((stream, text)))
    assert job.wait(60) == 7
    assert ("stdout", "last words before os._exit") in lines
    assert job.log_path is not None
    assert job.log_path.read_text() == "last words before os._exit\n"


def test_a_detached_jobs_output_goes_on_into_its_log(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(
        "import sys, time\n"
        "print('first', flush=True)\n"
        "time.sleep(1.5)\n"
        "print('after the viewer left')\n"
        "sys.stderr.write('and on stderr\\n')\n"
    )
    lines: list[tuple[str, str]] = []
    job = started(tmp_path, lambda stream, text: lines.append((stream, text)))
    while ("stdout", "first") not in lines:
        time.sleep(0.05)
    job.detach()
    assert job.process is not None and job.process.wait(60) == 0
    assert job.log_path is not None
    deadline = time.monotonic() + 30  # the relay writes the last lines once they come
    while "and on stderr" not in job.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    # Two pipes: the last two lines may reach the log in either order.
    first, *rest = job.log_path.read_text().splitlines()
    assert first == "first" and sorted(rest) == ["after the viewer left", "and on stderr"]


def test_a_chatty_jobs_lines_are_copied_in_batches_and_a_burst_fits_its_pipe(
    tmp_path: Path,
) -> None:
    """A job printing a line every 2 ms wakes the copy a few dozen times a second, not once a
    line (each wake-up is most of what copying costs); its pipe holds a 1 MiB burst, so the
    copy's pause between reads never blocks the job; and every line arrives, in order."""
    (tmp_path / "job.py").write_text(
        "import fcntl, sys, time\n"
        "print('pipe', fcntl.fcntl(1, getattr(fcntl, 'F_GETPIPE_SZ', 1032)), flush=True)\n"
        "for i in range(300):\n"
        "    print(f'line {i}', flush=True)\n"
        "    time.sleep(0.002)\n"
    )
    arrivals: list[tuple[float, str]] = []
    job = started(tmp_path, lambda _stream, text: arrivals.append((time.monotonic(), text)))
    assert job.wait(60) == 0
    texts = [text for _t, text in arrivals]
    assert texts[0] == f"pipe {1 << 20}"
    assert texts[1:] == [f"line {i}" for i in range(300)]
    # Lines handed on together (one read) arrive within a fraction of a millisecond.
    batches = 1 + sum(1 for (a, _), (b, _) in itertools.pairwise(arrivals) if b - a > 0.001)
    assert batches < 300 / 3, batches


def test_the_detached_copy_writes_whole_lines_when_the_streams_interleave(tmp_path: Path) -> None:
    """A line written in two pieces (``print``: its text, then the newline) while the other
    stream writes a line of its own: the log has both lines whole."""
    import os
    import threading

    from torchtop.job_output import relay

    log = tmp_path / "job.log"
    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT, 0o600)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    copying = threading.Thread(target=relay, args=(log_fd, [out_r, err_r]))
    copying.start()
    os.write(out_w, b"after the viewer left")
    time.sleep(0.2)  # copied alone, before its newline comes
    os.write(err_w, b"and on stderr\n")
    time.sleep(0.2)
    os.write(out_w, b"\nno newline at the end")
    for fd in (out_w, err_w):
        os.close(fd)
    copying.join(10)
    os.close(log_fd)
    lines = log.read_text().splitlines()
    assert sorted(lines) == ["after the viewer left", "and on stderr", "no newline at the end"]


def test_torchtops_own_children_do_not_import_torchtop_from_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``torchtop/`` folder in the directory a job starts from is not imported by the job's
    bootstrap nor by the detached copy of its output (plain ``python job.py`` would not)."""
    planted = tmp_path / "torchtop"
    planted.mkdir()
    mark = tmp_path / "imported"
    (planted / "__init__.py").write_text(f"open({str(mark)!r}, 'a').write('planted\\n')\n")
    (tmp_path / "job.py").write_text(
        "import sys, time\n"
        "print('first', flush=True)\n"
        "time.sleep(1.5)\n"
        "print('after the viewer left', flush=True)\n"
    )
    monkeypatch.chdir(tmp_path)
    lines: list[tuple[str, str]] = []
    job = started(tmp_path, lambda stream, text: lines.append((stream, text)))
    deadline = time.monotonic() + 60
    while ("stdout", "first") not in lines and job.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    job.detach()
    assert job.process is not None and job.process.wait(60) == 0
    assert job.log_path is not None
    deadline = time.monotonic() + 30  # the detached copy writes the last line once it comes
    while "viewer left" not in job.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.log_path.read_text() == "first\nafter the viewer left\n"
    assert not mark.exists()


@pytest.mark.parametrize("form", ["3.11+", "3.10"])
def test_the_jobs_bootstrap_runs_it_as_plain_python_would_without_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    """Both launchers (``-P -m``, and the ``-c`` that stands in for it on Python 3.10): the
    job's argv, ``sys.path[0]`` and traceback are plain python's; a ``torchtop/`` in the cwd
    is not imported."""
    import os
    import subprocess
    import sys

    from torchtop import launch

    planted = tmp_path / "torchtop"
    planted.mkdir()
    (planted / "__init__.py").write_text("raise SystemExit('the planted torchtop ran')\n")
    (tmp_path / "job.py").write_text(
        "import os, sys\n"
        "print(sys.argv, sys.path[0] == os.path.dirname(os.path.abspath(__file__)), flush=True)\n"
        "raise ValueError('boom')\n"
    )
    monkeypatch.chdir(tmp_path)  # where torchtop starts the job from
    if form == "3.10":
        command = [sys.executable, "-c", launch._WITHOUT_CWD, "torchtop.agent.bootstrap"]
    else:
        command = launch.python_module("torchtop.agent.bootstrap")
    out = subprocess.run(
        [*command, "job.py", "a"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "TORCHTOP_AGENT_OPTIONS": '{"ops": false}'},
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    assert out.stdout == f"['{tmp_path / 'job.py'}', 'a'] True\n", out.stderr
    assert out.stderr.splitlines()[:2] == [
        "Traceback (most recent call last):",
        f'  File "{tmp_path / "job.py"}", line 3, in <module>',
    ]
    assert "planted" not in out.stderr


def test_a_log_follower_shows_the_files_last_lines_then_what_is_written_since(
    tmp_path: Path,
) -> None:
    from torchtop.job_output import RECENT_LOG_LINES, LogFollower

    log = tmp_path / "42-job.log"
    log.write_text("".join(f"line {i}\n" for i in range(RECENT_LOG_LINES + 50)) + "half")
    seen: list[str] = []
    recent_shown, arrived = threading.Event(), threading.Event()

    def emit(text: str) -> None:
        seen.append(text)
        if len(seen) == RECENT_LOG_LINES:
            recent_shown.set()
        if text == "half and its end":
            arrived.set()

    follower = LogFollower(log, emit, interval_s=0.01).start()
    try:
        assert recent_shown.wait(10)
        with open(log, "a") as f:
            f.write(" and its end\nnext\n")
        assert arrived.wait(10)
    finally:
        follower.close()
    recent = [f"line {i}" for i in range(50, RECENT_LOG_LINES + 50)]
    assert seen[:RECENT_LOG_LINES] == recent
    assert seen[RECENT_LOG_LINES:] in (["half and its end"], ["half and its end", "next"])

"""The summary ``torchtop run`` prints after its viewer closes."""

from __future__ import annotations

from pathlib import Path

from torchtop.report.exit_summary import JobEnd, StderrTail, exit_summary, last_traceback

CRASH = [
    "step 0 loss 2.3",
    "Traceback (most recent call last):",
    '  File "first.py", line 3, in <module>',
    "KeyError: 'x'",
    "",
    "During handling of the above exception, another exception occurred:",
    "",
    "Traceback (most recent call last):",
    '  File "train.py", line 9, in <module>',
    "    raise RuntimeError('boom')",
    "RuntimeError: boom",
]


def test_the_last_traceback_is_the_one_that_ended_the_job() -> None:
    assert last_traceback(CRASH) == CRASH[7:]
    assert last_traceback(["all fine", "done"]) == []


def test_a_ranks_traceback_comes_before_the_launchers() -> None:
    lines = [
        "[rank1]:Traceback (most recent call last):",
        "[rank0]:step 3",
        '[rank1]:  File "train.py", line 9, in <module>',
        "[rank1]:ValueError: bad batch",
        "Traceback (most recent call last):",
        '  File "torch/distributed/run.py", line 1, in main',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
    ]
    assert last_traceback(lines) == [
        "Traceback (most recent call last):",
        '  File "train.py", line 9, in <module>',
        "ValueError: bad batch",
    ]


def test_a_crash_shows_its_exit_traceback_log_and_recording() -> None:
    end = JobEnd(
        pid=42,
        returncode=1,
        log_path=Path("/run/t/42-job.log"),
        record=Path("my run.ttrec"),
        stderr=tuple(CRASH),
    )
    lines = exit_summary(end)
    assert lines[0] == "torchtop: job pid 42 exited with code 1; its last traceback:"
    assert lines[1:5] == [f"  {line}" for line in CRASH[7:]]
    assert "less /run/t/42-job.log" in lines[5]
    assert "torchtop report 'my run.ttrec'" in lines[6]


def test_a_signal_a_stop_and_a_job_left_running() -> None:
    killed = exit_summary(JobEnd(pid=7, returncode=-9, stderr=tuple(CRASH)))
    assert killed[0] == (
        "torchtop: job pid 7 was killed by SIGKILL (exit code 137); its last traceback:"
    )
    stopped = exit_summary(JobEnd(pid=7, returncode=-2, stopped=True, stderr=tuple(CRASH)))
    assert stopped == ["torchtop: job pid 7 was stopped from the viewer (exit code 130)"]
    running = exit_summary(JobEnd(pid=7, returncode=None, log_path=Path("/r/7-job.log")))
    assert running[0].startswith("torchtop: left job pid 7 running")
    assert "torchtop attach 7" in running[0]
    assert running[1].endswith("tail -f /r/7-job.log")
    clean = exit_summary(JobEnd(pid=7, returncode=0, stderr=tuple(CRASH)))
    assert clean == ["torchtop: job pid 7 exited with code 0"]


def test_a_long_traceback_shows_its_end_and_control_characters_are_escaped() -> None:
    frames = [f'  File "r.py", line {i}, in f' for i in range(100)]
    end = JobEnd(
        pid=1,
        returncode=1,
        stderr=("Traceback (most recent call last):", *frames, "RecursionError: \x1b[2Jdeep"),
    )
    lines = exit_summary(end)
    assert lines[1] == "  … 62 lines, in the log"
    assert lines[-1] == "  RecursionError: \\x1b[2Jdeep"
    assert all("\x1b" not in line for line in lines)


def test_the_tail_keeps_stderr_only_and_its_last_lines() -> None:
    tail = StderrTail(size=2)
    for i, stream in enumerate(["stderr", "stdout", "stderr", "stderr"]):
        tail.line(stream, f"line {i}\n")
    assert tail.lines() == ["line 2", "line 3"]


def test_a_job_that_ended_without_an_exit_status_says_so() -> None:
    lines = exit_summary(JobEnd(pid=9, returncode=None, running=False))
    assert lines == ["torchtop: job pid 9 has ended; its exit status is unknown"]

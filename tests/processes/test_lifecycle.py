"""The agent's life against the job's: threads that outlive the main script, SIGTERM, SIGKILL.

Real processes: a job under ``torchtop run`` or ``python -m torchtop.agent.bootstrap``, and the
real command line as a user would run it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import SCRIPTS, torchtop
from tests.conftest import report_json as _report
from torchtop.protocol import JobExited, StepStats
from torchtop.streams.recording import read_recording
from torchtop.transport import list_agents, socket_path_for

IDLE = str(SCRIPTS / "idle_job.py")
OPTIONS = {"TORCHTOP_AGENT_OPTIONS": json.dumps({"ops": False, "nvml": False})}


def _wait_for_agent(pid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not any(a.pid == pid for a in list_agents()):
        assert time.monotonic() < deadline, "no agent appeared"
        time.sleep(0.05)


def _bootstrap(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "torchtop.agent.bootstrap", *args],
        env={**os.environ, **OPTIONS},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _recorded_job(path: Path) -> tuple[subprocess.Popen[str], subprocess.Popen[str]]:
    """An idle job, and a headless ``attach`` recorder that has recorded it for a while."""
    job = _bootstrap(IDLE, "60")
    _wait_for_agent(job.pid)
    attach = [sys.executable, "-m", "torchtop", "attach", str(job.pid), "--headless"]
    recorder = subprocess.Popen(
        [*attach, "--record", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # Recording: its file has a sample of the job (the recorder flushes twice a second).
    deadline = time.monotonic() + 30
    while not (path.exists() and b'"kind":"sample"' in path.read_bytes()):
        assert time.monotonic() < deadline, "the recorder recorded nothing"
        assert recorder.poll() is None, recorder.communicate()
        time.sleep(0.1)
    return job, recorder


def test_a_training_thread_that_outlives_main_keeps_the_agent(tmp_path: Path) -> None:
    rec = tmp_path / "r.ttr"
    run = [sys.executable, "-m", "torchtop", "run", "--headless", "--no-ops", "--record", str(rec)]
    job = subprocess.Popen(
        [*run, IDLE, "4", "--thread"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert job.stdout is not None
        line = job.stdout.readline()
        assert line.startswith("MAIN_RETURNED"), line
        main_returned = float(line.split()[1])
        time.sleep(1.0)
        # The main script has returned; the thread trains on, and the agent with it.
        listing = json.loads(torchtop("ps", "--json").stdout)
        assert len(listing) == 1
        pid = listing[0]["pid"]
        attached = tmp_path / "a.ttr"
        out = torchtop(
            "attach", str(pid), "--headless", "--record", str(attached), "--duration", "1"
        )
        assert out.returncode == 0, out.stderr
        assert _report(attached)["samples"] >= 5
    finally:
        job.communicate(timeout=60)
    assert job.returncode == 0
    messages = read_recording(rec).messages
    steps = [m for m in messages if isinstance(m, StepStats)]
    assert steps and steps[-1].t > main_returned + 3  # steps counted to the thread's end
    exits = [m for m in messages if isinstance(m, JobExited)]
    assert len(exits) == 1 and exits[0].t > main_returned + 3
    assert exits[0].exit_code == 0
    assert list_agents() == []


def test_sigterm_removes_the_socket_and_the_job_still_dies_of_it(tmp_path: Path) -> None:
    rec = tmp_path / "r.ttr"
    job, recorder = _recorded_job(rec)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=30)
    assert job.returncode == -signal.SIGTERM  # as without torchtop
    assert "Traceback" not in err
    assert not socket_path_for(job.pid).exists()  # gone at once, not at the next `ps`
    recorder.communicate(timeout=30)
    report = _report(rec)
    assert report["exit_code"] == -signal.SIGTERM
    assert report["exit_reason"] == "killed by SIGTERM"


def test_the_jobs_own_sigterm_handler_still_runs(tmp_path: Path) -> None:
    job = _bootstrap(str(SCRIPTS / "sigterm_job.py"), "60")
    assert job.stdout is not None and job.stdout.readline().strip() == "READY"
    _wait_for_agent(job.pid)
    job.send_signal(signal.SIGTERM)
    out, _ = job.communicate(timeout=30)
    assert "GRACEFUL" in out and job.returncode == 3
    assert not socket_path_for(job.pid).exists()


def test_a_recorder_whose_job_was_killed_says_so(tmp_path: Path) -> None:
    rec = tmp_path / "r.ttr"
    job, recorder = _recorded_job(rec)
    job.kill()
    job.communicate(timeout=30)
    _, err = recorder.communicate(timeout=30)
    assert recorder.returncode == 0, err
    report = _report(rec)
    assert report["exit_code"] is None
    assert report["exit_reason"].startswith("connection lost")
    assert "killed" in report["exit_reason"]

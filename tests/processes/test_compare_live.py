"""``torchtop compare A PID``: a recording against a running job, over its steps so far."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import kill_tree, torchtop
from tests.processes.test_compare_run import JOB, finish, record
from torchtop.transport import list_agents

pytestmark = pytest.mark.slow


@pytest.fixture
def running() -> Iterator[list[subprocess.Popen[bytes]]]:
    jobs: list[subprocess.Popen[bytes]] = []
    yield jobs
    for job in jobs:
        kill_tree(job)


def _start(jobs: list[subprocess.Popen[bytes]], *argv: str) -> int:
    """``torchtop run --headless`` of ``argv``; the job's pid once its agent listens."""
    command = [sys.executable, "-m", "torchtop", "run", "--headless", *argv]
    jobs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    deadline = time.monotonic() + 300  # generous: a loaded machine imports torch slowly
    while time.monotonic() < deadline:
        agents = list_agents()
        if agents:
            return agents[0].pid
        assert jobs[-1].poll() is None, "the job ended before its agent listened"
        time.sleep(0.2)
    raise AssertionError("no agent appeared")


def test_a_recording_against_a_running_job(tmp_path: Path, running: list) -> None:
    before = tmp_path / "before.ttr"
    finish(record(before, 4))
    # The same job, far longer: it is still running when compared.
    pid = _start(running, JOB[0], "--batches", "2000", "--epochs", "1", "--batch-size", "4")
    while True:  # until the job has taken steps enough: each try reads its history again
        out = torchtop("compare", str(before), str(pid), "--json", "--live-s", "1")
        if out.returncode == 0:
            break
        assert "timed steps so far" in out.stderr and "Traceback" not in out.stderr
        assert running[0].poll() is None, out.stderr
    report = json.loads(out.stdout)
    assert report["b"]["path"] == f"pid {pid}"
    assert report["step_figures"]


def test_a_running_job_without_steps_and_no_such_pid(tmp_path: Path, running: list) -> None:
    before = tmp_path / "before.ttr"
    finish(record(before, 4))
    sleeper = tmp_path / "loading.py"  # a job still loading its data: no step yet
    sleeper.write_text("import time\ntime.sleep(300)\n")
    pid = _start(running, str(sleeper))
    out = torchtop("compare", str(before), str(pid), "--live-s", "0.5")
    assert out.returncode == 1
    assert f"pid {pid} has 0 timed steps so far" in out.stderr and "run longer" in out.stderr
    kill_tree(running[0])
    out = torchtop("compare", str(before), "999999999")
    assert out.returncode == 1 and "torchtop ps" in out.stderr and "Traceback" not in out.stderr

"""``torchtop compare`` on real recordings of a small CPU job whose dataset is slow: with no
DataLoader workers the step waits for data; with 4 it waits much less. The step-time difference
is found with its interval and the data-wait share drops; the same job twice is no difference
beyond noise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SCRIPTS, torchtop

pytestmark = pytest.mark.slow

#: 80 steps whose batch takes 60 ms to load and 4 ms or more to compute, in one epoch (a second
#: epoch starts its workers again: a second warm-up in the middle of the run).
JOB = [
    str(SCRIPTS / "train_loader.py"),
    "--batches", "80", "--epochs", "1", "--batch-size", "4", "--item-sleep", "0.015",
]  # fmt: skip


def record(path: Path, workers: int, batches: int = 80) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "torchtop", "run", "--headless", "--record", str(path)]
    return subprocess.Popen(
        [*command, *JOB, "--workers", str(workers), "--batches", str(batches)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(job: subprocess.Popen[str]) -> None:
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0, out


def compared(a: Path, b: Path) -> dict[str, Any]:
    out = torchtop("compare", str(a), str(b), "--json")
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def figure(report: dict[str, Any], key: str) -> dict[str, Any]:
    (change,) = [c for c in report["step_figures"] if c["key"] == key]
    return change


def test_workers_make_the_step_faster_and_the_same_job_twice_is_noise(tmp_path: Path) -> None:
    # Four workers, each sleeping in its dataset, keep the batches coming well ahead of a
    # 2-core machine's training thread: with two, the step still waited half its time, and
    # the drop in data wait sat at the edge of the noise.
    none, two, again = tmp_path / "w0.ttr", tmp_path / "w4.ttr", tmp_path / "w4b.ttr"
    # Runs of several seconds each: under CI's load the steps of an 80-step run settled only
    # after 40 of them, and two 1.2 s runs side by side could each meet a different burst.
    finish(record(none, 0, batches=160))
    # The same job twice runs side by side: whatever else the machine does meanwhile slows
    # both alike (one after the other, a busy minute made the second twice as slow).
    twins = [record(two, 4, batches=320), record(again, 4, batches=320)]
    for job in twins:
        finish(job)

    report = compared(none, two)
    median = figure(report, "step_time_median_s")
    assert median["verdict"] == "faster" and median["better"] is True, median
    low, high = median["ci"]
    assert low <= median["change"] <= high < 0, median
    wait = figure(report, "data_wait_share")
    assert wait["verdict"] == "lower" and wait["a"] > 0.25 and wait["b"] < wait["a"], wait
    assert report["alignment"]["compared_steps"]["a"] >= 60
    # The process's memory did not change. (Its compute per step may: on a machine of two
    # cores the workers, and the second job, take CPU from the training thread.)
    for device in report["memory"]:
        assert not device["peak_allocated_bytes"]["changed"], device

    same = compared(two, again)
    for key in ("step_time_median_s", "data_wait_share"):
        change = figure(same, key)
        assert not change["changed"] and change["verdict"] == "no difference beyond noise", change

    text = torchtop("compare", str(none), str(two))
    assert text.returncode == 0, text.stderr
    assert "changed beyond noise: step time median" in text.stdout

"""Steps and DataLoader waits under ``torchtop run``, against the job's own measurements.

``scripts/train_loader.py`` knows nothing of torchtop: it times its own optimizer steps and its
own blocking on ``next()`` (its Dataset sleeps in ``__getitem__``), and prints what it measured.
The report of the recording must agree: the same step count exactly, the wait fraction within
0.05, each loader told apart with its settings, and no worker left running after the job.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import SCRIPTS, torchtop
from torchtop.protocol import LoaderInfo
from torchtop.streams.recording import read_recording

SCRIPT = str(SCRIPTS / "train_loader.py")
SHORT = ["--epochs", "2", "--batches", "16"]

CASES = {
    # In the main process, with a GradScaler that skips every 5th step and a validation loader.
    "no-workers-scaler-val": ["--workers", "0", "--val", "--scaler", "--skip-every", "5"],
    "fork-val-scaler": [
        *("--workers", "2", "--start-method", "fork", "--val", "--item-sleep", "0.004"),
        *("--scaler", "--skip-every", "4"),
    ],
    # Training workers spawned once (persistent), validation workers from a fork server.
    "spawn-persistent-forkserver": [
        *("--workers", "2", "--start-method", "spawn", "--val-start-method", "forkserver"),
        *("--persistent", "--val", "--item-sleep", "0.004"),
    ],
}


def _option(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("case", list(CASES))
def test_report_agrees_with_the_jobs_own_measurements(tmp_path: Path, case: str) -> None:
    args = CASES[case]
    rec = tmp_path / "r.ttr"
    out = torchtop("run", "--headless", "--record", str(rec), SCRIPT, *SHORT, *args)
    assert out.returncode == 0, out.stderr
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    own = json.loads(line.removeprefix("RESULT "))
    report_out = torchtop("report", str(rec), "--json")
    assert report_out.returncode == 0, report_out.stderr
    report = json.loads(report_out.stdout)

    assert report["steps"] == own["steps"] == 32
    assert report["skipped_steps"] == own["skipped"]
    if "--skip-every" in args:
        assert own["skipped"] > 0
    measured = report["dataloader"]["wait_fraction"]
    print(f"{case}: wait fraction {measured:.4f} (job's own {own['wait_fraction']:.4f})")
    assert abs(measured - own["wait_fraction"]) <= 0.05
    assert report["step_time_s"]["median"] > 0 and report["throughput"]["samples_per_s"] > 0

    workers = int(args[args.index("--workers") + 1])
    loaders = report["dataloader"]["loaders"]
    expected = [("loader 0", "SleepySet", 4)] + (
        [("loader 1", "ValSet", 8)] if "--val" in args else []
    )
    assert [(x["name"], x["dataset"], x["batch_size"]) for x in loaders] == expected
    methods = [_option(args, "--start-method"), _option(args, "--val-start-method")]
    for loader, method in zip(loaders, methods, strict=False):
        assert loader["num_workers"] == workers and loader["epochs"] == 2, loaders
        if workers:
            method = method or methods[0]
            assert loader["start_method"] == method and loader["prefetch_factor"] == 2
            assert loader["persistent_workers"] == ("--persistent" in args)
    assert loaders[0]["batches"] == 32

    # No worker outlives the job: neither those the job saw nor those the agent reported.
    seen = {
        w.pid
        for m in read_recording(rec).messages
        if isinstance(m, LoaderInfo)
        for x in m.loaders
        for w in x.workers
    }
    if workers:
        assert seen and seen <= set(own["worker_pids"])
    deadline = time.monotonic() + 5
    while not all(_gone(pid) for pid in own["worker_pids"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in own["worker_pids"])

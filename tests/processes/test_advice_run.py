"""The advisor on real CPU jobs: each problem found from the job's recording, the fixed job not.

``scripts/advice_jobs.py`` knows nothing of torchtop; each case is a small job with one common
problem, or the same job with the fix applied. The report of its recording (the model fed from
it, as ``torchtop replay`` and the live viewer feed theirs) must hold the finding with its
evidence, or no warning at all.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SCRIPTS, cuda_available, kill_tree, torchtop

SCRIPT = str(SCRIPTS / "advice_jobs.py")


def _report(tmp_path: Path, *argv: str) -> dict[str, Any]:
    (report,) = _reports(tmp_path, list(argv))
    return report


def _reports(tmp_path: Path, *jobs: list[str]) -> list[dict[str, Any]]:
    """Each job run under ``torchtop run --headless``, all at once (they mostly sleep: the
    creep jobs must outlast the advisor's 20 s warm-up), and each one's report."""
    running = []
    for n, argv in enumerate(jobs):
        rec = tmp_path / f"r{n}.ttr"
        command = [sys.executable, "-m", "torchtop", "run", "--headless", "--interval", "0.02",
                   "--record", str(rec), *argv]  # fmt: skip
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        running.append((rec, subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.PIPE, text=True)))  # fmt: skip
    reports = []
    try:
        for rec, process in running:
            # A few seconds alone; minutes on a machine shared by many jobs.
            _, err = process.communicate(timeout=240)
            assert process.returncode == 0, err
            report = torchtop("report", str(rec), "--json")
            assert report.returncode == 0, report.stderr
            reports.append(json.loads(report.stdout))
    finally:  # a run that failed or timed out leaves no job behind
        for _, process in running:
            if process.poll() is None:
                kill_tree(process)
    return reports


def _serious(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["severity"] in ("warning", "critical")]


@pytest.mark.parametrize(
    ("bad", "good", "name"),
    [
        ("input-bound", "input-ok", "input-bound"),
        ("creep", "creep-fixed", "memory-creep"),
        # DataLoader workers: their start and the warm-up are not creep; a real leak is.
        ("workers-leak", "workers", "memory-creep"),
        ("eval-grad", "eval-nograd", "eval-with-grad"),
        ("threads", "threads-fixed", "cpu-oversubscription"),
    ],
)
def test_a_job_with_the_problem_has_the_finding_and_the_fixed_job_none(
    tmp_path: Path, bad: str, good: str, name: str
) -> None:
    report, fixed = _reports(tmp_path, [SCRIPT, "--case", bad], [SCRIPT, "--case", good])
    found = {f["name"]: f for f in report["findings"]}
    assert name in found, report["findings"]
    finding = found[name]
    print(f"{bad}: {finding['severity']} {finding['summary']}")
    assert finding["severity"] in ("warning", "critical")
    assert finding["first_s"] <= finding["last_s"] <= report["duration_s"] + 1
    start, end = finding["window_s"]
    assert start <= end
    assert finding["demo_command"] == f"torchtop demo {finding['demo']}"
    evidence = finding["evidence"]
    if name == "input-bound":
        assert evidence["num_workers"] == 0 and evidence["wait_fraction"] >= 0.10
        assert evidence["pin_memory"] is False and evidence["persistent_workers"] is False
        assert "num_workers=0" in finding["fix"]
    elif name == "memory-creep":
        assert evidence["steps"] >= 50 and evidence["rise_bytes"] >= 16 << 20
    elif name == "cpu-oversubscription":
        cpus = len(os.sched_getaffinity(0))
        assert evidence["torch_threads"] == 4 * cpus and evidence["cpus"] == cpus
    else:
        assert evidence["dataset"] == "Items" and evidence["grad_batches"] >= 2

    print(f"{good}: {[f['summary'] for f in fixed['findings']]}")
    assert _serious(fixed) == []
    assert name not in {f["name"] for f in fixed["findings"]}


@pytest.mark.parametrize(
    "argv",
    [
        ["train_mlp.py", "--steps", "60", "--sleep", "0.02"],
        ["train_loader.py", "--workers", "2", "--persistent", "--val", "--start-method", "fork"],
    ],
)
def test_healthy_jobs_have_no_warning(tmp_path: Path, argv: list[str]) -> None:
    report = _report(tmp_path, str(SCRIPTS / argv[0]), *argv[1:])
    assert report["steps"] > 0
    assert _serious(report) == [], report["findings"]


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
def test_float32_matmuls_on_a_real_gpu_and_none_under_autocast(tmp_path: Path) -> None:
    """The dtypes the agent reads on a GPU are the ones the rule looks for (its unit tests
    use them): float32 without autocast, bf16 with it. Its GPU has tensor cores (7.0 on)."""
    report = _report(tmp_path, SCRIPT, "--case", "fp32-matmuls")
    found = {f["name"]: f for f in report["findings"]}
    assert "float32-matmuls" in found, report["findings"]
    evidence = found["float32-matmuls"]["evidence"]
    assert evidence["dtypes"].get("float", 0) >= 10 and evidence["device"] == "cuda:0"
    fixed = _report(tmp_path, SCRIPT, "--case", "bf16-autocast")
    assert "float32-matmuls" not in {f["name"] for f in fixed["findings"]}, fixed["findings"]


def test_forked_workers_copying_python_objects_and_the_numpy_fix(tmp_path: Path) -> None:
    """About 300 MB of Python dicts read by two forked workers: each worker's private memory
    (USS, read from outside the job) grows through the epoch and the rule fires with its fix;
    the same rows as a NumPy array stay shared: no growth, no finding."""
    objects, array = _reports(tmp_path, [SCRIPT, "--case", "cow"], [SCRIPT, "--case", "cow-numpy"])
    (cow,) = [f for f in objects["findings"] if f["name"] == "worker-copy-on-write"]
    assert cow["evidence"]["growth_bytes"] >= 64 << 20
    assert "NumPy" in cow["fix"] and "spawn" in cow["fix"]
    assert not [f for f in array["findings"] if f["name"] == "worker-copy-on-write"]
    (loader,) = objects["dataloader"]["loaders"]
    assert loader["peak_workers_uss_bytes"] >= 2 * (64 << 20)
    # The agent read what the dataset holds: the rule's evidence names the list of dicts.
    assert cow["evidence"]["dataset_storage"] == loader["dataset_storage"] == "python"
    assert re.fullmatch(r"list of [\d,]+ dict in \.rows", cow["evidence"]["dataset_holds"])
    (shared,) = array["dataloader"]["loaders"]
    assert (shared["dataset_storage"], shared["dataset_holds"]) == (
        "arrays",
        "numpy.ndarray in .rows",
    )

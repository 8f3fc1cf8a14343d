"""Runs a demo as a user does (``torchtop demo NAME --headless --quick``) and reads its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from torchtop.protocol import PhaseBegan
from torchtop.recording import read_recording

RESULT_PREFIX = "TORCHTOP_DEMO_RESULT "

Results = dict[str, dict[str, Any]]


def run_demo(name: str, tmp_path: Path | None = None) -> str:
    """The demo's output; fails the test on a non-zero exit, with the output in the message,
    or when one of its phases has no description for the viewer's phase panel."""
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "TORCHTOP_DEMO_RESULT": "1",
        # On a busy 2-core CI machine, two OpenMP threads per op spin-wait on each other and
        # run many times slower than one; the checks here are directions, not speeds.
        "OMP_NUM_THREADS": "1",
    }
    if tmp_path is not None:
        env["TMPDIR"] = str(tmp_path)  # e.g. where the profiling demo leaves its Chrome trace
    with tempfile.TemporaryDirectory(dir=tmp_path) as folder:
        record = Path(folder) / f"{name}.ttr"
        command = [sys.executable, "-m", "torchtop", "demo", name, "--headless", "--quick"]
        proc = subprocess.run(
            [*command, "--record", str(record)],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
        )
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        check_phase_descriptions(record)
    return proc.stdout


def check_phase_descriptions(record: Path) -> None:
    """Every phase the demo began carries two or three sentences for the viewer's panel."""
    began = [m for m in read_recording(record).messages if isinstance(m, PhaseBegan)]
    assert began, "the demo marked no phases"
    for phase in began:
        text = phase.description or ""
        assert 80 <= len(text) <= 320, phase


def results_of(output: str) -> Results:
    lines = [line for line in output.splitlines() if line.startswith(RESULT_PREFIX)]
    assert len(lines) == 1, output
    payload = json.loads(lines[0][len(RESULT_PREFIX) :])
    return {entry["name"]: entry for entry in payload["results"]}


def peak(results: Results, name: str) -> int:
    return int(results[name]["peak_bytes"])


def seconds(results: Results, name: str) -> float:
    return float(results[name]["seconds"])

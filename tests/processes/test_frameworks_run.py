"""Real training frameworks under ``torchtop run --headless --record``, tiny and CPU-only: a
Lightning ``Trainer.fit`` with a validation loader and DataLoader workers, and a Hugging Face
``Trainer`` on a GPT-2 built from a config (no download). Their scripts know nothing of
torchtop and print the framework's own counts; the recording must agree.

The frameworks come from ``tests/requirements-frameworks.txt`` (``make setup``); torchtop
itself depends on neither.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SCRIPTS, torchtop
from torchtop.protocol import OpsWindow, StepStats
from torchtop.streams.recording import read_recording

pytestmark = pytest.mark.slow

#: No network: nothing may be fetched from a hub.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)


def _run(tmp_path: Path, script: str, *args: str) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """The job's own RESULT line, torchtop's JSON report, and the recording."""
    rec = tmp_path / "r.ttr"
    out = torchtop(
        "run", "--headless", "--record", str(rec), str(SCRIPTS / script), *args,
        timeout=240, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    report = torchtop("report", str(rec), "--json")
    assert report.returncode == 0, report.stderr
    return json.loads(line.removeprefix("RESULT ")), json.loads(report.stdout), rec


def _windows_over_steps(rec: Path) -> list[OpsWindow]:
    return [m for m in read_recording(rec).messages if isinstance(m, OpsWindow) and m.steps]


def test_lightning_fit_with_a_validation_loader_and_workers(tmp_path: Path) -> None:
    forward_sleep = 0.02
    own, report, rec = _run(
        tmp_path, "lightning_fit.py", "--epochs", "2", "--forward-sleep", str(forward_sleep)
    )
    # Lightning's own count: 96 samples / 8 a batch, two epochs.
    assert report["steps"] == own["global_step"] == 24
    # The train and validation loaders told apart, each with its workers and batches.
    loaders = report["dataloader"]["loaders"]
    assert [(x["name"], x["dataset"], x["num_workers"]) for x in loaders] == [
        ("loader 0", "TrainSet", 2),
        ("loader 1", "ValSet", 2),
    ]
    assert loaders[0]["batches"] == 24 and loaders[1]["batches"] == own["val_batches"] == 8
    assert loaders[0]["epochs"] == loaders[1]["epochs"] == 2
    # Lightning calls optimizer.step(closure): forward (>= 20 ms here) and backward run
    # inside it, and are compute. SGD's own step on this model takes well under a millisecond.
    frames = [m for m in read_recording(rec).messages if isinstance(m, StepStats)]
    timed = sum(f.timed for f in frames)
    optimizer_s = sum(f.optimizer_s for f in frames)
    time_s = sum(f.time_s for f in frames)
    assert timed == 23 and time_s >= timed * forward_sleep
    assert optimizer_s < 0.25 * timed * forward_sleep, (optimizer_s, time_s)
    # At least one op window spans training steps.
    windows = _windows_over_steps(rec)
    assert windows, "no op window over training steps"
    assert report["profiled_steps"] >= 1
    assert report["sync_points_per_step"] is None  # a CPU job: no device to wait for


def test_hugging_face_trainer_on_a_tiny_gpt2(tmp_path: Path) -> None:
    own, report, rec = _run(tmp_path, "hf_trainer.py", "--steps", "30")
    assert report["steps"] == own["global_step"] == 30
    (loader,) = report["dataloader"]["loaders"]
    # The Trainer fetches a batch ahead of the step it is for.
    assert loader["dataset"] == "Tokens" and loader["batches"] in (30, 31)
    # The model is built before the first step (the Trainer's set-up): the first window
    # over training steps comes all the same, and its ops are the model's.
    windows = _windows_over_steps(rec)
    assert windows, "no op window over training steps"
    names = {op.name for op in windows[0].ops}
    assert names & {"aten::addmm", "aten::mm", "aten::bmm", "aten::matmul"}
    assert report["sync_points_per_step"] is None

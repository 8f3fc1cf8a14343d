"""The oom demo: a batch that doubles until the device runs out of memory, then three ways to
fit the batch that failed. ``torchtop demo oom`` on a CPU runs it on an emulated 512 MiB device.

As in the other demo tests the checks are directions and counts from measured values: the
out-of-memory error was raised, captured and recorded with the figures of a full device, and
each way that fits twice the samples of the last batch that fit needs less memory than it did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from demo_runner import false_findings, results_of

from torchtop import commands as cli
from torchtop.commands import demo as demo_verb
from torchtop.protocol import PhaseBegan
from torchtop.streams.recording import read_recording

MiB = 1 << 20
LIMIT = 512 * MiB


def run_oom_demo(tmp_path: Path) -> tuple[str, dict[str, Any], Path]:
    """``torchtop demo oom --headless --quick --record``: its output, the report's JSON and the
    recording."""
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "TORCHTOP_DEMO_RESULT": "1",
        "OMP_NUM_THREADS": "1",  # see demo_runner.run_demo
        "TMPDIR": str(tmp_path),
    }
    record = tmp_path / "oom.ttr"
    command = [sys.executable, "-m", "torchtop", "demo", "oom", "--headless", "--quick"]
    proc = subprocess.run(
        [*command, "--record", str(record)], capture_output=True, text=True, timeout=180, env=env
    )
    # The demo catches the error it provoked: the job ends well.
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    report = subprocess.run(
        [sys.executable, "-m", "torchtop", "report", str(record), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert report.returncode == 0, report.stderr
    return proc.stdout, json.loads(report.stdout), record


@pytest.mark.slow
def test_the_batch_runs_out_of_memory_and_three_ways_fit_it(tmp_path: Path) -> None:
    output, report, record = run_oom_demo(tmp_path)
    assert false_findings("oom", record) == []  # the ways that fit find nothing wrong
    lines = output.splitlines()
    conclusions = [line for line in lines if line.startswith("batch ") and " ran out of " in line]
    assert len(conclusions) == 1, output
    table = [line for line in lines if line.startswith(("|", "+"))]
    assert table and max(len(line) for line in table) <= 78, output

    results = results_of(output)
    rows = list(results.values())
    fitted, failed, *ways = rows
    # The doubling: the last batch that fit, then twice it, which did not.
    assert fitted["extra"]["fits"] == "yes" and failed["extra"]["fits"] == "no"
    batch = failed["extra"]["batch"]
    assert batch == 2 * fitted["extra"]["batch"]
    assert failed["extra"]["asked"] > 0
    # The same samples as the failed batch, three ways, each fits with a lower peak than half
    # of them needed in one piece; evaluation under no_grad needs least of all.
    assert [way["extra"]["fits"] for way in ways] == ["yes"] * 3, rows
    assert all(way["extra"]["batch"] == batch for way in ways)
    for way in ways:
        assert 0 < way["peak_bytes"] < fitted["peak_bytes"], way
        assert way["seconds"] > 0
    assert results["no_grad() eval"]["peak_bytes"] < results["4 micro-batches"]["peak_bytes"]

    # Every phase told the viewer what it does, in a few sentences.
    began = [m for m in read_recording(record).messages if isinstance(m, PhaseBegan)]
    assert [m.name for m in began] == ["doubling the batch", *(way["name"] for way in ways)]
    for message in began:
        assert message.description and 80 < len(message.description) <= 320, message

    if not output.startswith("device: cpu"):
        return
    # On the CPU, the emulated device: the agent captured one OOM in the doubling phase, from a
    # request larger than what was free, and the device's figures add up to its size.
    assert " ran out of the emulated 512 MiB device" in conclusions[0]
    (oom,) = [event for event in report["events"] if event["kind"] == "oom"]
    assert oom["emulated"] is True and oom["phase"] == "doubling the batch"
    assert oom["total_bytes"] == LIMIT
    assert oom["requested_bytes"] > oom["free_bytes"]
    assert oom["free_bytes"] + oom["allocated_bytes"] == LIMIT
    assert oom["requested_bytes"] == failed["extra"]["asked"]
    assert report["devices"][0]["source"] == "cpu-tensors"
    assert report["devices"][0]["num_ooms"] == 1
    # The phases after it stayed under the limit, as the agent sampled them.
    phases = {phase["name"]: phase for phase in report["phases"]}
    for way in ways:
        assert phases[way["name"]]["peak_allocated_bytes"] < LIMIT
    assert report["exit_code"] == 0


def test_without_a_limit_on_the_cpu_it_refuses_to_fill_the_ram() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torchtop.demos.oom", "--device", "cpu", "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 2
    assert "needs a memory limit" in proc.stderr and "torchtop demo oom" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- the memory limit torchtop demo passes ----------------------------------------------------


def spec_of(monkeypatch: pytest.MonkeyPatch, argv: list[str], default_device: str) -> Any:
    """The run ``torchtop demo ...`` would start, without starting it."""
    started: list[Any] = []
    monkeypatch.setattr(demo_verb, "run_spec", lambda spec: started.append(spec) or 0)
    monkeypatch.setattr(demo_verb, "_default_device", lambda: default_device)
    assert cli.main(argv) == 0
    (spec,) = started
    return spec


@pytest.mark.parametrize(
    ("argv", "default_device", "limit", "device"),
    [
        (["demo", "oom", "--headless"], "cpu", LIMIT, "cpu"),
        (["demo", "oom", "--device", "cpu"], "cuda", LIMIT, "cpu"),
        (["demo", "oom", "--memory-limit", "256MiB"], "cpu", 256 * MiB, None),
        (["demo", "oom", "--headless"], "cuda", None, "cuda"),
        (["demo", "oom", "--device", "cuda"], "cuda", None, "cuda"),
        (["demo", "memory", "--headless"], "cpu", None, None),
    ],
)
def test_demo_oom_emulates_its_device_on_the_cpu_only(
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    default_device: str,
    limit: int | None,
    device: str | None,
) -> None:
    spec = spec_of(monkeypatch, argv, default_device)
    assert spec.agent_options["memory_limit_bytes"] == limit
    target = spec.target
    if device is None:
        assert "--device" not in target
    else:
        assert target[target.index("--device") + 1] == device


def test_the_catalog_reads_the_limit_without_importing_the_demo() -> None:
    from torchtop.commands.demo_catalog import find_demo, list_demos

    assert find_demo("oom").cpu_memory_limit == "512MiB"
    assert [d.name for d in list_demos() if d.cpu_memory_limit] == ["oom"]
    assert "torchtop.demos.oom" not in sys.modules

"""Op timings under ``torchtop run --headless --record``, read back through ``torchtop report``.

``scripts/train_ops.py`` knows nothing of torchtop; it trains a two-layer MLP on the CPU, and
with ``--own-profiler-at`` runs its own ``torch.profiler`` and prints what that recorded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.conftest import SCRIPTS, torchtop

SCRIPT = str(SCRIPTS / "train_ops.py")
MATMULS = {"aten::addmm", "aten::mm", "aten::linear", "aten::matmul"}


def _run(tmp_path: Path, *args: str, script_args: tuple[str, ...] = ()) -> tuple[Any, dict]:
    rec = tmp_path / "r.ttr"
    out = torchtop("run", "--headless", "--record", str(rec), *args, SCRIPT, *script_args)
    assert out.returncode == 0, out.stderr
    report = torchtop("report", str(rec), "--json")
    assert report.returncode == 0, report.stderr
    return out, json.loads(report.stdout)


def test_mlp_ops_trace_and_no_sync_points(tmp_path: Path) -> None:
    out, report = _run(tmp_path, script_args=("--seconds", "2"))
    assert report["profile_windows"] >= 1
    ops = report["ops"]
    assert len(ops) >= 5
    assert MATMULS & {op["name"] for op in ops[:10]}
    selfs = [op["self_cpu_s"] for op in ops]
    assert selfs == sorted(selfs, reverse=True)
    for op in ops:
        assert op["calls"] >= 1 and op["self_device_s"] is None
        assert op["avg_s"] > 0 or op["total_cpu_s"] == 0
    # No device: nothing to wait for, nothing to copy to or from.
    assert report["sync_points_per_step"] is None and report["copies_per_step"] is None
    assert report["host_reads_per_step"] == 0
    trace = json.loads(Path(report["trace_path"]).read_text())
    events = trace["traceEvents"]
    assert events and any(e.get("name") in MATMULS for e in events)
    # Kineto's per-window start and stop lines stay off the job's output.
    assert "USDT" not in out.stderr
    text = torchtop("report", str(tmp_path / "r.ttr"))
    assert "top ops by self time" in text.stdout and "aten::" in text.stdout


def test_item_on_a_cpu_tensor_is_a_host_read_not_a_sync_point(tmp_path: Path) -> None:
    """A CPU job reading its loss with ``.item()`` every step waits for no device."""
    _, report = _run(tmp_path, script_args=("--seconds", "2", "--item"))
    assert report["profile_windows"] >= 1 and report["profiled_steps"] >= 2
    assert report["sync_points_per_step"] is None
    assert report["host_reads_per_step"] == 1.0
    text = " ".join(torchtop("report", str(tmp_path / "r.ttr")).stdout.split())  # unwrapped
    assert "sync points n/a (CPU only) · 1 host reads of CPU tensors per step" in text


def test_the_jobs_own_profiler_is_complete_and_torchtop_steps_aside(tmp_path: Path) -> None:
    # A window of 1000 steps opens within the first steps (a tick comes every 0.1 s, a step
    # every 0.02 s), so it is open when the script starts its own profiler at step 40.
    out, report = _run(
        tmp_path,
        "--ops-window",
        "1000",
        script_args=(
            *("--steps", "80", "--sleep", "0.02"),
            *("--own-profiler-at", "40", "--own-profiler-steps", "6"),
        ),
    )
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("OWN_PROFILE ")]
    own = json.loads(line.removeprefix("OWN_PROFILE "))
    assert own["optimizer_steps"] == 6 and own["addmm"] == 12
    assert "done 80 steps" in out.stdout
    (period,) = report["ops_unavailable"]
    assert "running its own torch.profiler" in period["reason"]
    assert period["end_s"] is not None and period["end_s"] >= period["start_s"]


def test_no_ops_turns_sampling_off(tmp_path: Path) -> None:
    _, report = _run(tmp_path, "--no-ops", script_args=("--seconds", "1"))
    assert report["profile_windows"] == 0 and report["ops"] == []
    assert report["ops_unavailable"][0]["reason"] == "op sampling is off (--no-ops)"
    assert not list(tmp_path.glob("*ops*.json"))


def test_bad_op_options_are_one_line_errors(tmp_path: Path) -> None:
    for args, words in (
        (("--ops-budget", "0"), "above 0"),
        (("--ops-budget", "lots"), "percentage"),
        (("--ops-window", "0"), "at least 1"),
    ):
        out = torchtop("run", "--headless", *args, SCRIPT)
        assert out.returncode == 2
        assert words in out.stderr and "Traceback" not in out.stderr


def test_time_based_windows_under_the_memory_limit_emulation(tmp_path: Path) -> None:
    """No optimizer: windows open between bytecodes of the main thread, never inside the
    emulation's dispatch mode or the autograd engine (where starting the profiler crashed)."""
    # The main thread takes a window's opening call only between the emulation's dispatches:
    # a tick every 20 ms asks five times as often, so that one opens within the job's seconds
    # on a loaded machine too (at 0.1 s, once in ~13 CI runs none did before the loop ended).
    _, report = _run(
        tmp_path,
        "--memory-limit",
        "1GiB",
        "--interval",
        "0.02",
        script_args=("--no-optimizer", "--backward", "--seconds", "7"),
    )
    assert report["profile_windows"] >= 1
    assert report["profiled_steps"] == 0 and report["sync_points_per_step"] is None
    assert MATMULS & {op["name"] for op in report["ops"][:10]}


def test_shapes_and_call_sites_split_the_ops(tmp_path: Path) -> None:
    # Long enough for a window on a busy machine (shapes and stacks make each one dearer).
    _, report = _run(
        tmp_path, "--profile-shapes", "--profile-stack", script_args=("--seconds", "5")
    )
    addmm = [op for op in report["ops"] if op["name"] == "aten::addmm"]
    assert addmm, [op["name"] for op in report["ops"]]
    # Two Linear layers, inputs [32, 128] and [32, 256]: a row for each.
    shapes = [op["shapes"] or "" for op in addmm]
    assert len(addmm) >= 2
    assert any("[32, 128]" in x for x in shapes) and any("[32, 256]" in x for x in shapes)
    sites = {op["site"] for op in report["ops"] if op["site"]}
    assert any(site.startswith("train_ops.py(") for site in sites), sites

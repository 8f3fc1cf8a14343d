"""Training jobs of unusual shapes under ``torchtop run``, as real processes: a child forked
after op windows ran, and a job that trains in two stages with two optimizers."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import SCRIPTS, torchtop
from torchtop.protocol import OpsWindow, StepStats
from torchtop.streams.recording import read_recording


def _result(stdout: str) -> dict:
    (line,) = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def test_a_forked_child_that_calls_sys_exit_ends_after_op_windows(tmp_path: Path) -> None:
    """Kineto's config thread, started by the first window, is not in the child: its exit
    must neither hang nor lose the child's exit code or output."""
    rec = tmp_path / "r.ttr"
    out = torchtop(
        "run", "--headless", "--record", str(rec), str(SCRIPTS / "fork_exit.py"), timeout=90
    )
    assert out.returncode == 0, out.stderr
    assert _result(out.stdout) == {"child": "exited", "code": 5}
    assert "child: done" in out.stdout
    windows = [m for m in read_recording(rec).messages if isinstance(m, OpsWindow)]
    assert windows, "no op window ran before the fork: the test proves nothing"


def test_a_second_stage_with_another_optimizer_is_counted(tmp_path: Path) -> None:
    rec = tmp_path / "r.ttr"
    out = torchtop("run", "--headless", "--record", str(rec), str(SCRIPTS / "two_stages.py"))
    assert out.returncode == 0, out.stderr
    own = _result(out.stdout)["steps"]
    report = json.loads(torchtop("report", str(rec), "--json").stdout)
    assert report["steps"] == own == 250
    frames = [m for m in read_recording(rec).messages if isinstance(m, StepStats)]
    assert frames[-1].total == 250 and sum(f.count for f in frames) == 250

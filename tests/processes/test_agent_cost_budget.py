"""A job made to pay for its agent (a sampler every millisecond) is slowed back to its budget."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import SCRIPTS, torchtop
from tests.conftest import report_json as _report
from torchtop.protocol import AgentStats
from torchtop.streams.recording import read_recording


def test_an_agent_over_its_budget_samples_less_often_and_says_so(tmp_path: Path) -> None:
    rec = tmp_path / "r.ttr"
    out = torchtop(
        "run",
        "--headless",
        "--record",
        str(rec),
        "--interval",
        "0.001",
        str(SCRIPTS / "train_mlp.py"),
        "--steps",
        "600",
        "--sleep",
        "0.01",
    )
    assert out.returncode == 0, out.stderr
    said = [line for line in out.stderr.splitlines() if "over its budget of 1.0%" in line]
    assert len(said) == 1, out.stderr  # once
    stats = [m for m in read_recording(rec).messages if isinstance(m, AgentStats)]
    assert stats and stats[-1].interval_s is not None and stats[-1].interval_s >= 0.004
    assert stats[-1].cost_budget == 0.01
    report = _report(rec)
    cost = report["agent_cost"]
    assert isinstance(cost, dict) and cost["cpu_s"] > 0
    assert "over its budget" in str(report["probes_unavailable"])

"""The recording rules shipped beside the Grafana dashboard, checked by Prometheus's promtool.

``promtool check rules`` lints the file; ``promtool test rules`` evaluates it over series shaped
as torchtop exports them (three ranks of one run, one waiting longer for its data) and checks
that the straggler score names that rank and only it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.prometheus_server import SKIP_REASON

RULES = Path(__file__).resolve().parents[2] / "dashboards" / "torchtop.rules.yml"
SCORE = "rank:torchtop_straggler_score:1m"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.skip(SKIP_REASON)
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60)


def test_rules_pass_promtool_check() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 rules found" in result.stdout


def _series(name: str, rank: int, per_interval: float) -> dict[str, str]:
    return {"series": f'{name}{{run="r",rank="{rank}"}}', "values": f"0+{per_interval}x10"}


def test_straggler_score_names_the_slow_rank(tmp_path: Path) -> None:
    # Every rank takes 8 steps of 2 s each per 15 s interval; ranks 0 and 1 wait 0.25 s a step
    # for data, rank 2 waits 0.75 s: 0.5 s beyond the median, a quarter of the median step.
    series = []
    for rank, wait in ((0, 2), (1, 2), (2, 6)):
        series += [
            _series("torchtop_step_duration_seconds_count", rank, 8),
            _series("torchtop_step_duration_seconds_sum", rank, 16),
            _series("torchtop_steps_total", rank, 8),
            _series("torchtop_dataloader_wait_seconds_total", rank, wait),
        ]
    expected = [
        {"labels": f'{SCORE}{{run="r",rank="{rank}"}}', "value": score}
        for rank, score in ((0, 0), (1, 0), (2, 0.25))
    ]
    test = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": series,
                "promql_expr_test": [{"expr": SCORE, "eval_time": "2m", "exp_samples": expected}],
            }
        ],
    }
    path = tmp_path / "rules_test.yml"
    path.write_text(json.dumps(test))  # JSON is YAML
    result = promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr

"""The recording rules shipped beside the Grafana dashboard, checked by Prometheus's promtool.

``promtool check rules`` lints the file; ``promtool test rules`` evaluates it over series shaped
as torchtop exports them (three ranks of one run, one waiting longer for its data) and checks
that the straggler score names that rank and only it, as the recorded series and as the one
expression ``torchtop attach --prometheus`` asks where the rules are not loaded.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.prometheus_server import SKIP_REASON
from torchtop.streams.prometheus_run import straggler_score_inline

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


@pytest.mark.parametrize(
    ("ranks", "scores"),
    [
        # Every rank takes 8 steps of 2 s each per 15 s interval; ranks 0 and 1 wait 0.25 s a
        # step for data, rank 2 waits 0.75 s: 0.5 s beyond the median, a quarter of the
        # median step.
        (((0, 16, 2), (1, 16, 2), (2, 16, 6)), (0, 0, 0.25)),
        # No DataLoader (no wait at all); rank 2's steps take 2.5 s against 2 s: a quarter of
        # the median step beyond it, from the step time alone.
        (((0, 16, 0), (1, 16, 0), (2, 20, 0)), (0, 0, 0.25)),
    ],
    ids=["data-wait", "no-dataloader"],
)
def test_straggler_score_names_the_slow_rank(
    tmp_path: Path, ranks: tuple[tuple[int, float, float], ...], scores: tuple[float, ...]
) -> None:
    """The recorded score, and the same expression as ``attach --prometheus`` asks it where
    the rules are not loaded, give each rank's expected score."""
    series = []
    for rank, step_sum, wait in ranks:
        series += [
            _series("torchtop_step_duration_seconds_count", rank, 8),
            _series("torchtop_step_duration_seconds_sum", rank, step_sum),
            _series("torchtop_steps_total", rank, 8),
            _series("torchtop_dataloader_wait_seconds_total", rank, wait),
        ]
    tests = []
    for expr, name in ((SCORE, SCORE), (straggler_score_inline("r"), "")):
        expected = [
            {"labels": f'{name}{{run="r",rank="{rank}"}}', "value": score}
            for (rank, _, _), score in zip(ranks, scores, strict=True)
        ]
        tests.append({"expr": expr, "eval_time": "2m", "exp_samples": expected})
    test = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "15s",
        "tests": [{"interval": "15s", "input_series": series, "promql_expr_test": tests}],
    }
    path = tmp_path / "rules_test.yml"
    path.write_text(json.dumps(test))  # JSON is YAML
    result = promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr

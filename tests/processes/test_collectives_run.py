"""Real torchrun jobs on gloo (CPU) under ``torchtop run``: each rank's agent reads its flight
recorder and the run model joins the ranks on (process group, sequence id). The job
(``tests/scripts/collectives_job.py``) also writes what its own reader saw, per rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SCRIPTS, kill_tree, report_json
from torchtop.agent.collectives import DEFAULT_RING
from torchtop.model.collectives import CollectiveRecord, lateness

ROOT = Path(__file__).resolve().parents[2]


def run(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, nproc: int = 4
) -> tuple[dict, dict]:
    """``torchtop run`` on ``nproc`` ranks: the report, and each rank's own file."""
    out, record = tmp_path / "out", tmp_path / "r.ttr"
    out.mkdir()
    job = subprocess.Popen(
        [sys.executable, "-m", "torchtop", "run", "--headless", "--record", str(record),
         "--no-ops", "--hang-after", "2", sys.executable, "-m", "torch.distributed.run",
         "--standalone", f"--nproc_per_node={nproc}", str(SCRIPTS / "collectives_job.py"),
         "--out", str(out), *args],
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _, err = job.communicate(timeout=240)
    finally:
        if job.poll() is None:  # a failed test leaves no launcher or rank behind
            kill_tree(job)
    assert job.returncode == 0, err
    ranks = {r: json.loads((out / f"rank-{r}.json").read_text()) for r in range(nproc)}
    return dict(report_json(record)), ranks


def named(report: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["name"] == name]


def test_the_rank_slow_inside_backward_is_named_by_its_arrivals(tmp_path: Path) -> None:
    report, ranks = run(tmp_path, "--slow-rank", "2", "--slow-ms", "30", "--steps", "120")
    (finding,) = named(report, "straggler")
    assert finding["rank"] == 2
    evidence = finding["evidence"].get("arrivals", finding["evidence"])
    assert evidence["source"] == "arrivals"
    per_rank = {r["rank"]: r for r in evidence["ranks"]}
    assert per_rank[2]["last_share"] >= 0.9
    assert 0.020 <= per_rank[2]["median_late_s"] <= 0.040
    # Its data wait, forward and optimizer match the others': the delay is inside backward.
    assert evidence["cause"] == "backward"
    assert "the delay is inside its backward" in finding["summary"]
    # Each all-reduce, from what the ranks' readers saw: rank 2 late by 30 +- 10 ms at >= 90%.
    records = {
        r: [
            c
            for c in map(CollectiveRecord.from_wire, d["collectives"])
            if c and c.op == "all_reduce"
        ]
        for r, d in ranks.items()
    }
    late = lateness(records)[2]
    assert late.joined == 120
    # The agents sent every collective, the last second's too (read as the job ends).
    joined = {r["rank"]: r["collectives"]["joined"] for r in report["ranks"]}
    assert joined == {r: len(d["collectives"]) for r, d in ranks.items()}
    assert sum(0.020 <= s <= 0.040 for s in late.samples) >= 0.9 * late.joined
    assert report["ranks"][2]["collectives"]["last_share"] >= 0.9
    # The three others spend most of their time waiting for rank 2; the run's share of it.
    waits = {r["rank"]: r["collectives"]["wait_share"] for r in report["ranks"]}
    assert waits[2] < 0.2 and all(waits[r] > 0.4 for r in (0, 1, 3))
    assert 0.3 < report["collectives"]["wait_share"] < 1
    # torchtop run turned the recorder on at its size.
    assert {d["buffer"] for d in ranks.values()} == {str(DEFAULT_RING)}


def test_a_balanced_run_names_none(tmp_path: Path) -> None:
    report, _ = run(tmp_path, "--steps", "120")
    assert named(report, "straggler") == []


def test_a_blocked_rank_is_named_never_entered_with_its_stack_and_groups_join_apart(
    tmp_path: Path,
) -> None:
    report, ranks = run(
        tmp_path, "--block-rank", "1", "--block-at", "3", "--second-group", "--hang-s", "6",
        env={"TORCH_FR_BUFFER_SIZE": "300"},
    )  # fmt: skip
    hangs = [f for f in named(report, "hang") if f["evidence"].get("collectives")]
    assert hangs, report["findings"]
    (where,) = hangs[-1]["evidence"]["collectives"]
    assert (where["pg"], where["op"]) == ("0", "all_reduce")
    assert where["waiting"] == [0, 2, 3] and where["never_entered"] == [1]
    assert where["seq"] == where["last_completed_seq"] + 1
    assert f"pg 0 seq {where['seq']} all_reduce: ranks 0,2,3 waiting" in hangs[-1]["summary"]
    assert "rank 1 never entered: collectives_job.py:" in hangs[-1]["summary"]
    assert "in block_here" in hangs[-1]["summary"]
    # The second group (ranks 0 and 1) numbers its collectives apart from group 0.
    second = {r: [c["seq"] for c in ranks[r]["collectives"] if c["pg"] == "1"] for r in (0, 1)}
    assert second[0] == [1, 2, 3] == second[1]
    # The user's ring size was kept.
    assert {d["buffer"] for d in ranks.values()} == {"300"}


@pytest.mark.parametrize(
    ("how", "why"),
    [
        ({"args": ("--hide-recorder",)}, "this torch has no flight recorder"),
        ({"env": {"TORCH_FR_BUFFER_SIZE": "0"}}, "turned torch's flight recorder off"),
    ],
    ids=["no-recorder", "size-0"],
)
def test_without_a_recorder_the_rule_outside_backward_decides_and_one_line_says_why(
    tmp_path: Path, how: dict[str, Any], why: str
) -> None:
    # Rank 1 sleeps 30 ms in its forward: the time outside backward names it.
    report, ranks = run(
        tmp_path, "--slow-rank", "1", "--slow-in", "forward", "--steps", "150",
        *how.get("args", ()), env=how.get("env"), nproc=2,
    )  # fmt: skip
    (finding,) = named(report, "straggler")
    assert finding["rank"] == 1
    assert "source" not in finding["evidence"] and "arrivals" not in finding["evidence"]
    assert finding["evidence"]["cause"] == "compute"
    # No collectives reached the run model, and the rank's agent said why, once.
    assert all(r["collectives"] is None for r in report["ranks"])
    assert report["collectives"] is None
    (line,) = [v for k, v in report["probes_unavailable"].items() if k == "collectives"]
    assert why in line and "stragglers are told from the time outside backward" in line
    assert all(d["collectives"] == [] for d in ranks.values())

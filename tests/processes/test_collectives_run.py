"""Real torchrun jobs on gloo (CPU): each rank's flight recorder read by the agent's reader
(``tests/scripts/collectives_job.py``), the ranks joined on (process group, sequence id)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import SCRIPTS
from torchtop.agent.collectives import DEFAULT_RING
from torchtop.model.collectives import CollectiveRecord, hang_triage, lateness, straggler

ROOT = Path(__file__).resolve().parents[2]


def job(out: Path, *args: str, env: dict[str, str] | None = None) -> dict[int, dict]:
    out.mkdir()
    full = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         str(SCRIPTS / "collectives_job.py"), "--out", str(out), *args],
        env=full, check=True, capture_output=True, timeout=240,
    )  # fmt: skip
    return {r: json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)}


def records(data: dict[int, dict], op: str | None = None) -> dict[int, list[CollectiveRecord]]:
    out: dict[int, list[CollectiveRecord]] = {}
    for rank, d in data.items():
        recs = [CollectiveRecord.from_wire(c) for c in d["collectives"]]
        out[rank] = [r for r in recs if r is not None and (op is None or r.op == op)]
    return out


def test_the_rank_slow_inside_backward_is_named_by_its_arrivals(tmp_path: Path) -> None:
    data = job(tmp_path / "slow", "--slow-rank", "2", "--slow-ms", "30", "--steps", "12")
    per_rank = lateness(records(data, "all_reduce"))
    late = straggler(per_rank)
    assert late is not None and late.rank == 2
    assert late.joined == 12 and late.last_share >= 0.9
    assert 0.020 <= late.median_s <= 0.040
    on_time = [s for s in late.samples if 0.020 <= s <= 0.040]
    assert len(on_time) >= 0.9 * late.joined
    # The recorder was turned on at the default size.
    assert {d["buffer"] for d in data.values()} == {str(DEFAULT_RING)}


def test_a_balanced_run_names_none(tmp_path: Path) -> None:
    data = job(tmp_path / "even", "--steps", "12")
    assert straggler(lateness(records(data, "all_reduce"))) is None


def test_a_blocked_rank_is_named_never_entered_with_its_stack_and_groups_join_apart(
    tmp_path: Path,
) -> None:
    data = job(
        tmp_path / "hang",
        "--block-rank",
        "1",
        "--block-at",
        "3",
        "--second-group",
        env={"TORCH_FR_BUFFER_SIZE": "300", "KEEP_ENV": "1"},
    )
    recs = records(data)
    stacks = {r: d["stack"] for r, d in data.items() if d["stack"]}
    found = hang_triage(recs, stacks)
    assert len(found) == 1
    hang = found[0]
    assert (hang.pg, hang.op) == ("0", "all_reduce")
    assert hang.waiting == (0, 2, 3) and hang.missing == (1,)
    assert hang.seq == hang.last_completed_seq + 1
    assert "rank 1 never entered: collectives_job.py:" in hang.line()
    assert "in block_here" in hang.line()
    # The second group (ranks 0 and 1) has its own sequence ids, joined apart from group 0.
    second = {r: [c for c in recs[r] if c.pg == "1"] for r in (0, 1)}
    assert [c.seq for c in second[0]] == [1, 2, 3] == [c.seq for c in second[1]]
    assert lateness(second)[0].joined == 3
    # The user's ring size was kept.
    assert {d["buffer"] for d in data.values()} == {"300"}

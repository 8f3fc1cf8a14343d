"""The live view of a torchrun job's ranks, in a real terminal (tmux) at 80x24, as a user
drives it: every rank's row fills in, the straggler is named while the job runs, q stops the
job and quits."""

from __future__ import annotations

import re
import shutil
import sys

import psutil
import pytest

from tests.conftest import SCRIPTS
from tests.test_tui_tmux import Terminal, terminal  # noqa: F401  (the fixture)

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")


def _rows(screen: str) -> dict[int, list[str]]:
    """The ranks table's rows by rank: rank, pid, state, steps, ..."""
    rows = {}
    for line in screen.splitlines():
        cells = line.split()
        if len(cells) >= 4 and cells[0].isdigit() and cells[1].isdigit():
            rows[int(cells[0])] = cells
    return rows


def test_the_run_view_shows_each_rank_names_the_straggler_and_stops_the_job(
    terminal: Terminal,  # noqa: F811
) -> None:
    command = (
        f"{sys.executable} -m torchtop run --no-ops -m torch.distributed.run --standalone "
        f"--nproc_per_node=3 {SCRIPTS / 'ddp.py'} --steps 3000 --slow-rank 2 --slow-in data"
        "; echo EXIT=$?"
    )
    terminal.keys(command, "Enter")

    def stepping(screen: str) -> bool:
        rows = _rows(screen)
        return sorted(rows) == [0, 1, 2] and all(int(r[3]) > 0 for r in rows.values())

    screen = terminal.wait_for(stepping, timeout=120)
    assert "3 ranks of 3" in screen and "launcher pid" in screen
    pids = [int(row[1]) for row in _rows(screen).values()]
    assert all(row[2] == "running" for row in _rows(screen).values())
    screen = terminal.wait_for(lambda s: "rank 2 holds the others back" in s, timeout=120)
    # Rank 2's data wait shows in its row; the others wait in backward.
    rows = _rows(screen)
    assert int(rows[2][6].rstrip("%")) > int(rows[0][6].rstrip("%"))
    terminal.keys("q")
    screen = terminal.wait_for(lambda s: re.search(r"EXIT=\d+", s), timeout=120)
    assert not any(psutil.pid_exists(pid) for pid in pids)

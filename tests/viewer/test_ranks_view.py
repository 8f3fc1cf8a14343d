"""The live view of a torchrun job's ranks, in a real terminal (tmux) at 80x24 and 160x50, as a
user drives it: every rank's row fills in, the straggler is named and its strip of the step
time chart stands higher while the job runs, each rank's lines show once behind its prefix, q
stops the job and quits."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import SCRIPTS, kill_tree
from tests.processes.test_ranks_output import _heights
from tests.viewer.test_tui_tmux import Terminal, terminal, tmux_terminal  # noqa: F401  (the fixture)
from torchtop.transport import list_agents
from torchtop.tui.screens.run import BARS, trend

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")


@pytest.fixture
def launchers() -> Iterator[list[int]]:
    """Launcher pids the test saw: a failed test kills each with its ranks (the launcher runs
    in its own session, so a viewer killed with its terminal leaves it running)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            launcher = psutil.Process(pid)
            for process in [*launcher.children(recursive=True), launcher]:
                process.kill()


def _launcher(screen: str) -> int:
    match = re.search(r"launcher pid (\d+)", screen)
    assert match, screen
    return int(match.group(1))


def _rows(screen: str) -> dict[int, list[str]]:
    """The ranks table's rows by rank: rank, pid, state, steps, ..."""
    rows = {}
    for line in screen.splitlines():
        cells = line.split()
        if len(cells) >= 4 and cells[0].isdigit() and cells[1].isdigit():
            rows[int(cells[0])] = cells
    return rows


def _strips(screen: str) -> dict[int, list[str]]:
    """The step time chart's strips by rank: each strip's plot lines, top first."""
    strips: dict[int, list[str]] = {}
    current: list[str] | None = None
    for line in screen.splitlines():
        label = re.match(r"^ *r(\d+)┤", line)
        if label:
            current = strips[int(label.group(1))] = [line[6:]]
        elif current is not None and re.match(r"^ {5}│", line):
            current.append(line[6:])
        else:
            current = None
    return strips


def _strip_levels(screen: str) -> dict[int, float]:
    """Each strip's median height (in braille dots) over its last ten columns with steps."""
    levels = {}
    for rank, strip in _strips(screen).items():
        heights = [h for h in _heights(strip) if h > 0][-10:]
        levels[rank] = sorted(heights)[len(heights) // 2] if heights else 0
    return levels


def _said_once(screen: str, ranks: int) -> bool:
    """Each rank's line (``--say 1``) shows once, behind its own rank's prefix."""
    lines = [line.strip() for line in screen.splitlines()]
    return all(
        lines.count(f"[rank{r}]:rank {r} {word} 0") == 1
        and sum(f"rank {r} {word} 0" in line for line in lines) == 1
        for r in range(ranks)
        for word in ("says", "warns")
    )


def test_the_run_view_shows_each_rank_names_the_straggler_and_stops_the_job(
    terminal: Terminal,  # noqa: F811
    launchers: list[int],
) -> None:
    command = (
        f"{sys.executable} -m torchtop run --no-ops -m torch.distributed.run --standalone "
        f"--nproc_per_node=4 {SCRIPTS / 'ddp.py'} --steps 3000 --slow-rank 2 --slow-in data "
        "--say 1; echo EXIT=$?"
    )
    terminal.keys(command, "Enter")

    def stepping(screen: str) -> bool:
        rows = _rows(screen)
        return sorted(rows) == [0, 1, 2, 3] and all(int(r[3]) > 0 for r in rows.values())

    screen = terminal.wait_for(stepping, timeout=120)
    launchers.append(_launcher(screen))
    assert "4 ranks of 4" in screen
    pids = [int(row[1]) for row in _rows(screen).values()]
    assert all(row[2] == "running" for row in _rows(screen).values())
    screen = terminal.wait_for(lambda s: "rank 2 holds the others back" in s, timeout=120)
    # Rank 2's data wait shows in its row; the others wait in backward.
    rows = _rows(screen)
    assert int(rows[2][6].rstrip("%")) > int(rows[0][6].rstrip("%"))
    # The chart has a strip for every rank, on one scale, with its range; rank 2's stands
    # higher once its recent steps are on it.
    screen = terminal.wait_for(
        lambda s: (
            sorted(_strips(s)) == [0, 1, 2, 3]
            and _strip_levels(s)[2] > max(v for r, v in _strip_levels(s).items() if r != 2)
        ),
        timeout=60,
    )
    assert re.search(r"each row 0 to \d+ms · last 60s", screen)
    assert all(len(strip) == 1 for strip in _strips(screen).values())
    # The log's last lines (the rest scrolled up): each once, behind its own rank's prefix.
    said = re.findall(r"\S*rank \d (?:says|warns) 0", screen)
    assert len(said) >= 4 and len(set(said)) == len(said), screen
    assert all(re.fullmatch(r"\[rank(\d)\]:rank \1 (says|warns) 0", line) for line in said)
    terminal.keys("q")
    screen = terminal.wait_for(lambda s: re.search(r"EXIT=\d+", s), timeout=120)
    assert not any(psutil.pid_exists(pid) for pid in pids)


@pytest.fixture
def wide_terminal() -> Iterator[Terminal]:
    """A 160x50 terminal, the environment passed as the 80x24 one's."""
    with tmux_terminal(160, 50) as opened:
        yield opened


def test_a_rank_opens_in_the_full_viewer_and_closes_back_to_the_run(
    wide_terminal: Terminal, launchers: list[int]
) -> None:
    term = wide_terminal
    command = (
        f"{sys.executable} -m torchtop run --no-ops -m torch.distributed.run --standalone "
        f"--nproc_per_node=4 {SCRIPTS / 'ddp.py'} --steps 3000 --sleep-ms 10 --slow-rank 1 "
        "--slow-in forward --say 1; echo EXIT=$?"
    )
    term.keys(command, "Enter")

    def stepping(screen: str) -> bool:
        rows = _rows(screen)
        return sorted(rows) == [0, 1, 2, 3] and all(int(r[3]) > 3 for r in rows.values())

    screen = term.wait_for(stepping, timeout=120)
    launchers.append(_launcher(screen))
    # The chart uses the room: a strip of several lines per rank; rank 1's (slower in its
    # forward) stands higher.
    screen = term.wait_for(
        lambda s: (
            sorted(_strips(s)) == [0, 1, 2, 3]
            and _strip_levels(s)[1] > max(v for r, v in _strip_levels(s).items() if r != 1)
        ),
        timeout=60,
    )
    assert all(len(strip) == 3 for strip in _strips(screen).values())
    assert _said_once(screen, 4), screen
    rank1 = _rows(screen)[1][1]
    # Each rank's trend: its last steps' times as bars.
    assert all(set(row[-1]) <= set(BARS) and len(row[-1]) > 1 for row in _rows(screen).values())
    # The cursor starts on rank 0: down to rank 1, and open it.
    term.keys("Down", "Enter")
    # Its full screens: memory, then steps once its history has arrived.
    term.wait_for(lambda s: "Memory" in s and "Steps" in s and f"pid {rank1}" in s, timeout=60)
    # Its log panel: rank 1's own lines, from the launcher's output, without their prefix.
    screen = term.wait_for(lambda s: "rank 1 says 0" in s and "rank 1 warns 0" in s, timeout=30)
    assert "[rank1]:" not in screen and "rank 0 says" not in screen, screen
    # Its q comes back to the run's view, with every rank still running.
    term.keys("q")
    screen = term.wait_for(lambda s: sorted(_rows(s)) == [0, 1, 2, 3], timeout=60)
    assert all(row[2] == "running" for row in _rows(screen).values())
    pids = [int(row[1]) for row in _rows(screen).values()]
    term.keys("q")
    term.wait_for(lambda s: re.search(r"EXIT=\d+", s), timeout=120)
    assert not any(psutil.pid_exists(pid) for pid in pids)


def test_the_trend_draws_every_rank_on_one_scale() -> None:
    assert trend([0.01, 0.02, 0.03], 0.01, 0.03) == "▁▅█"
    # A rank whose steps all take the run's shortest time stays at the bottom.
    assert trend([0.01, 0.01], 0.01, 0.05) == "▁▁"
    assert trend([0.02], 0.02, 0.02) == "▁"


RANK_JOB = """\
import os, time, torchtop
torchtop.start(ops=False, capture_output=True)
print(f"rank {os.environ['RANK']} ready", flush=True)
for _ in range(1200):
    time.sleep(0.1)
"""


def test_attach_with_no_pid_opens_the_run_and_q_leaves_it_running(
    terminal: Terminal,  # noqa: F811
    tmp_path: Path,
) -> None:
    (tmp_path / "job.py").write_text(RANK_JOB)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "job.py"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(list_agents()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = {a.identity["rank"]: a.pid for a in list_agents()}
        assert sorted(ranks) == [0, 1]
        terminal.keys(f"{sys.executable} -m torchtop attach; echo EXIT=$?", "Enter")
        screen = terminal.wait_for(lambda s: sorted(_rows(s)) == [0, 1], timeout=60)
        assert "2 ranks of 2" in screen and "attached to 2 agents" in screen
        assert {int(r[1]) for r in _rows(screen).values()} == set(ranks.values())
        # Each rank's lines, from its agent (the launcher's output is not ours), behind its
        # rank's prefix, once.
        screen = terminal.wait_for(lambda s: "rank 1 ready" in s and "rank 0 ready" in s)
        assert re.findall(r"\S*rank \d ready", screen) in (
            ["[rank0]:rank 0 ready", "[rank1]:rank 1 ready"],
            ["[rank1]:rank 1 ready", "[rank0]:rank 0 ready"],
        ), screen
        terminal.keys("q")
        terminal.wait_for(lambda s: "EXIT=0" in s, timeout=60)
        # Detached: the job runs on.
        assert launcher.poll() is None and all(psutil.pid_exists(p) for p in ranks.values())
    finally:
        kill_tree(launcher)


def test_mp_spawn_ranks_show_live_in_the_run_view(
    terminal: Terminal,  # noqa: F811
    launchers: list[int],
) -> None:
    # The PyTorch DDP tutorial's shape: the script starts its ranks with mp.spawn and waits.
    command = (
        f"{sys.executable} -m torchtop run --no-ops {SCRIPTS / 'ddp.py'} --spawn 3 "
        "--steps 3000 --sleep-ms 5; echo EXIT=$?"
    )
    terminal.keys(command, "Enter")

    def stepping(screen: str) -> bool:
        rows = _rows(screen)
        return sorted(rows) == [0, 1, 2] and all(int(r[3]) > 0 for r in rows.values())

    screen = terminal.wait_for(stepping, timeout=120)
    # The parent that only waits is the launcher, not a rank.
    launcher = _launcher(screen)
    launchers.append(launcher)
    assert "3 ranks of 3" in screen
    rows = _rows(screen)
    pids = [int(row[1]) for row in rows.values()]
    assert launcher not in pids and all(row[2] == "running" for row in rows.values())
    # Live: the steps go on.
    before = {rank: int(row[3]) for rank, row in rows.items()}
    screen = terminal.wait_for(
        lambda s: all(int(r[3]) > before[k] for k, r in _rows(s).items()), timeout=60
    )
    terminal.keys("q")
    screen = terminal.wait_for(lambda s: re.search(r"EXIT=\d+", s), timeout=120)
    # The job was stopped as Ctrl-C stops it, ranks and all.
    assert "EXIT=130" in screen
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(psutil.pid_exists(pid) for pid in pids)

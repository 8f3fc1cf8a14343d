"""The run view at 256 ranks, at 80x24: lost ranks first, then the rank a finding names, then the
slowest; a page line that says which rows show and follows pgdn; a heat strip of every rank's
step time that fits the width and marks the lost ranks; the chart's strips for the table's first
ranks only; the columns the source has no figure for left out. Then the same in a real terminal
(tmux), following 256 live simulated ranks (:mod:`benchmarks.fleet`) as ``torchtop attach``
does."""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.text import Text
from textual.widgets import DataTable, RichLog, Static
from textual.widgets.data_table import ColumnKey

from benchmarks.fleet import Fleet
from tests.viewer.test_tui_tmux import Terminal, terminal  # noqa: F401  (the fixture)
from torchtop.model.advice import Finding
from torchtop.protocol import Hello, LogLine, Message, StepStats
from torchtop.streams.runs import RunFold
from torchtop.streams.sources import attach_rank
from torchtop.tui.app import TorchtopApp
from torchtop.tui.screens.run import COLUMNS, RankStepChart
from torchtop.tui.screens.run_order import FOLD_AFTER, GONE

RANKS = 256
SLOW = 200
NAMED = 17
LOST = range(250, 256)


def hello(rank: int) -> Hello:
    return Hello(
        protocol=1, pid=0, argv=[], cwd="", started_at=1000.0, python="", torch=None,
        devices=[], interval_s=1.0, hostname=f"node{rank // 128}", rank=rank,
        local_rank=rank % 128, run_id="wide",
    )  # fmt: skip


def steps(t: float, total: int, mean: float) -> StepStats:
    """One scrape's worth of steps, as the Prometheus fold sends it: one entry for all."""
    return StepStats(
        t=t, total=total, skipped_total=0, count=10, skipped=0, timed=10, time_s=10 * mean,
        wait_s=0.0, startup_s=0.0, optimizer_s=0.0, samples=0, ends=[t], durations=[mean],
    )  # fmt: skip


class WideRun(RunFold):
    """256 ranks on two nodes, fed as the Prometheus fold feeds them: rank 200 the slowest,
    rank 17 named by a finding, ranks 250-255 lost, no pid or backward."""

    on_quit = "closes the view"
    rank_lines = False
    not_carried = ("pid", "bwd")
    has_output = False

    def __init__(self) -> None:
        super().__init__()
        self.named: list[Finding] = []

    @property
    def started(self) -> bool:
        return True

    def start(self) -> None:
        pass

    def feed(self, stream: str, message: Message) -> None:
        self.queue(stream, message)

    @property
    def findings(self) -> list[Finding]:
        return self.named

    def is_lost(self, stream: str) -> bool:
        return int(stream) in LOST

    def running(self) -> bool:
        return True

    def stop_job(self) -> None:
        pass

    def status(self) -> tuple[str, bool]:
        return "Prometheus", True


def finding(rank: int) -> Finding:
    return Finding(
        name="input-bound", severity="warning", title="input-bound", rank=rank, evidence={},
        summary=f"rank {rank} on node0: input-bound", window_start=0.0, window_end=0.0, fix="",
        code=None, demo="", first_t=0.0, last_t=0.0, active=True,
    )  # fmt: skip


def fed() -> WideRun:
    run = WideRun()
    for rank in range(RANKS):
        run.feed(str(rank), hello(rank))
        mean = 0.050 if rank == SLOW else 0.020 + 0.0001 * (rank % 7)
        for i in range(1, 8):
            run.feed(str(rank), steps(1000.0 + i, 10 * i, mean))
    run.named = [finding(NAMED)]
    return run


def ranks_in_order(table: DataTable[Text]) -> list[int]:
    column = [str(c.label) for c in table.columns.values()].index("rank")
    return [int(str(table.get_row_at(i)[column])) for i in range(table.row_count)]


def test_256_ranks_at_80x24_sorted_paged_and_folded() -> None:
    run = fed()

    async def drive() -> None:
        app = TorchtopApp.for_run(run, "run wide through Prometheus", open_rank=attach_rank)
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.run_screen
            table: DataTable[Text] = screen.query_one("#ranks", DataTable)
            await pilot.pause(1.2)
            assert table.row_count == RANKS
            order = ranks_in_order(table)
            # Lost first, then the named rank, then the slowest step.
            assert sorted(order[: len(LOST)]) == list(LOST)
            assert order[len(LOST)] == NAMED and order[len(LOST) + 1] == SLOW
            labels = [str(c.label) for c in table.columns.values()]
            assert "pid" not in labels and "bwd" not in labels and labels[0] == "node"
            fold = str(screen.query_one("#run-fold", Static).render())
            strip, page = fold.split("\n")
            assert page.startswith("ranks 1-") and "of 256" in page
            assert len(strip) <= 78 and GONE in strip and "r0-r255" in strip
            # Every rank has its place: 256 ranks, several a cell, the lost ones at the end.
            per = int(strip.split(" · ")[-1].split()[0])
            cells = strip[strip.index("▕") + 1 : strip.index("▏")]
            assert len(cells) == -(-RANKS // per) and cells.endswith(GONE)
            assert "█" in cells  # rank 200's cell, the slowest
            # pgdn shows the next rows, and the page line says so.
            first_page = page
            await pilot.press("pagedown")
            await pilot.pause(0.5)
            page = str(screen.query_one("#run-fold", Static).render()).split("\n")[1]
            assert page != first_page and not page.startswith("ranks 1-")
            # The chart: strips for the table's first ranks only, the whole step (no backward).
            chart = screen.query_one(RankStepChart)
            assert 0 < len(chart.series) < RANKS
            assert str(chart.border_title).startswith("step time per rank · the table's first")
            assert "outside backward" not in str(chart.border_title)
            # It all fits 80x24 without scrolling the screen: the table shows a page of ranks,
            # the findings and the chart their lines; no log (the source has no lines).
            regions = [screen.query_one(w).region for w in ("#ranks", "#run-chart")]
            assert all(r.width == 80 and r.bottom <= 23 and r.height > 0 for r in regions)
            assert regions[0].height >= 8 and not screen.query_one("#run-log").display

    asyncio.run(drive())


def test_a_few_ranks_stay_in_rank_order_without_the_fold() -> None:
    run = WideRun()
    for rank in range(FOLD_AFTER):
        run.feed(str(rank), hello(rank))
        mean = 0.050 if rank == 5 else 0.020
        for i in range(1, 8):
            run.feed(str(rank), steps(1000.0 + i, 10 * i, mean))

    async def drive() -> None:
        app = TorchtopApp.for_run(run, "run", open_rank=attach_rank)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause(1.2)
            table: DataTable[Text] = app.run_screen.query_one("#ranks", DataTable)
            assert ranks_in_order(table) == list(range(FOLD_AFTER))
            assert not app.run_screen.query_one("#run-fold", Static).display

    asyncio.run(drive())


def test_the_table_refresh_at_256_ranks_costs_little() -> None:
    """One refresh of the table with every rank's figures changed draws them all; its CPU time
    is printed for the record (no bound: the machine is shared)."""
    run = fed()

    async def drive() -> None:
        app = TorchtopApp.for_run(run, "run", open_rank=attach_rank)
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.run_screen
            await pilot.pause(1.2)
            for rank in range(RANKS):
                run.feed(str(rank), steps(1009.0, 90, 0.021))
            screen._table_at = 0.0
            began = time.process_time()
            screen.refresh_run()
            took = time.process_time() - began
            print(f"table refresh at {RANKS} ranks: {1000 * took:.1f} ms of CPU")
            table: DataTable[Text] = screen.query_one("#ranks", DataTable)
            column = [str(c.label) for c in table.columns.values()].index("steps")
            shown = {str(table.get_row_at(i)[column]) for i in range(table.row_count)}
            assert shown == {"90"}

    asyncio.run(drive())


def test_a_column_widens_for_figures_that_come_after_the_row() -> None:
    """A rank's row drawn from its hello alone (``-`` for its step) widens its columns once its
    steps come: a row is not cut to the width of what it first showed."""
    run = WideRun()
    for rank in range(2):
        run.feed(str(rank), hello(rank))

    async def drive() -> None:
        app = TorchtopApp.for_run(run, "run", open_rank=attach_rank)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause(1.2)
            table: DataTable[Text] = app.run_screen.query_one("#ranks", DataTable)
            assert table.row_count == 2
            for rank in range(2):
                for i in range(1, 8):
                    run.feed(str(rank), steps(1000.0 + i, 10 * i, 0.0205))
            await pilot.pause(1.5)
            step = table.columns[ColumnKey("step")]
            assert (
                str(table.get_row_at(0)[list(table.columns).index(ColumnKey("step"))]) == "20.5ms"
            )
            assert step.get_render_width(table) >= len("20.5ms") + 2

    asyncio.run(drive())


@pytest.fixture
def wide_fleet(
    fleet_recording: Path, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Fleet]:
    """256 simulated ranks of one run on this machine (the straggler synchronous: the others
    wait for it inside backward), in the socket directory the terminal's viewer looks in."""
    fleet = Fleet(
        fleet_recording, ranks=RANKS, nodes=1, root=runtime_dir, run_id="wide", synced=True,
        straggler=SLOW, slow=3.0, dead=NAMED, dead_after_s=1e9,
    )  # fmt: skip
    monkeypatch.setenv("TORCHTOP_RUNTIME_DIR", str(fleet.node_dir(0)))
    yield fleet.start()
    fleet.stop()


def _rows_shown(screen: str) -> list[list[str]]:
    """The ranks table's rows on the screen, top first: rank, pid, state, steps, ..."""
    return [
        cells
        for cells in (line.split() for line in screen.splitlines())
        if len(cells) >= 4 and cells[0].isdigit() and cells[1].isdigit()
    ]


def _first(screen: str, *columns: str) -> list[str]:
    """The first row's rank, and its cells of ``columns``."""
    rows = _rows_shown(screen)[:1]
    return [cell for row in rows for cell in [row[0], *(row[COLUMNS.index(c)] for c in columns)]]


def _page(screen: str) -> str:
    return next((line.strip() for line in screen.splitlines() if "pgup/pgdn" in line), "")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_256_live_ranks_in_a_real_terminal_at_80x24_sorted_and_paged(
    wide_fleet: Fleet,
    terminal: Terminal,  # noqa: F811
) -> None:
    """``torchtop attach`` on a run of 256 live ranks, at 80x24: the straggler named and first,
    a rank killed shown dead above it, marked in the heat strip, and pgdn showing other ranks."""
    terminal.keys(f"{sys.executable} -m torchtop attach; echo EXIT=$?", "Enter")
    screen = terminal.wait_for(lambda s: "256 ranks of 256" in s and "of 256 ·" in s, 180)
    assert "step by rank" in screen and "r0-r255" in screen
    # The straggler: named in the findings and its row first.
    terminal.wait_for(lambda s: f"rank {SLOW} holds" in s and _first(s) == [str(SLOW)], 120)
    # A rank killed: dead, above it.
    wide_fleet.kill_dead()
    screen = terminal.wait_for(lambda s: _first(s, "state") == [str(NAMED), "dead"], 60)
    rows = _rows_shown(screen)
    assert rows[1][0] == str(SLOW) and all(r[2] == "running" for r in rows[1:]), screen
    assert GONE in screen.split("step by rank", 1)[1].splitlines()[0]
    first_page = _page(screen)
    assert first_page.startswith(f"ranks 1-{len(rows)} of 256"), screen
    terminal.keys("PageDown")
    screen = terminal.wait_for(lambda s: _page(s) and not _page(s).startswith("ranks 1-"), 30)
    shown = {r[0] for r in _rows_shown(screen)}
    assert shown and not shown & {r[0] for r in rows}, screen
    terminal.keys("q")
    terminal.wait_for(lambda s: "EXIT=0" in s, 60)


def test_the_lines_of_one_look_go_into_the_log_each_on_its_own_line_in_order() -> None:
    """The lines that arrived between two looks are written at once, one log line each, each
    behind its rank's prefix."""

    class WithOutput(WideRun):
        has_output = True

    run = WithOutput()
    run.feed("0", hello(0))
    for i, rank in enumerate((3, 0, 12)):
        run.queue(None, LogLine(t=1000.0 + i, stream="stdout", text=f"[rank{rank}]:line {i}"))

    async def drive() -> None:
        app = TorchtopApp.for_run(run, "run", open_rank=attach_rank)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause(0.8)
            log = app.run_screen.query_one("#run-log", RichLog)
            shown = [strip.text.rstrip() for strip in log.lines]
            assert shown == ["[rank3]:line 0", "[rank0]:line 1", "[rank12]:line 2"]

    asyncio.run(drive())

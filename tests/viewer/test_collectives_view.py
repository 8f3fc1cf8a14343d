"""The run view's lanes of the ranks' arrivals at their collectives and the collectives' table
behind ``c``, at 80x24, on the rings of a real 4-rank gloo run where rank 2 slept 30 ms inside
its backward (``tests/fixtures/fr_rings_gloo_slow4.json``)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from test_nodes_view import TwoNodes, hello, rows
from test_tui_app import pilot_test
from textual.widgets import DataTable, Static

from torchtop.protocol import CollectiveEntry, CollectivesSeen, Sample
from torchtop.tui.app import TorchtopApp
from torchtop.tui.screens.collectives import MAX_RANK_COLUMNS, CollectivesScreen, sizes_text
from torchtop.tui.screens.run import RankStepChart, RunScreen
from torchtop.tui.widgets.collectives import (
    LANE_MARKS,
    ArrivalLanes,
    lane_ranks,
    lane_scale,
    render_lanes,
)

FIXTURES = Path(__file__).parents[1] / "fixtures"
SIZE = (80, 24)


def rings() -> dict[int, list[CollectiveEntry]]:
    data = json.loads((FIXTURES / "fr_rings_gloo_slow4.json").read_text())
    return {int(r): [CollectiveEntry(**e) for e in ring] for r, ring in data["ranks"].items()}


def slow_run(hostile_op: str | None = None) -> TwoNodes:
    """Four ranks of one node that sent their rings (and, for ranks 0 and 1, a second group's
    three all-reduces), queued as the feeds queue them, then a sample a second later."""
    run = TwoNodes()
    ring = rings()
    for rank in ring:
        run.feed(str(100 + rank), hello(rank, 100 + rank, "a"))
    for rank, entries in ring.items():
        if hostile_op is not None:
            entries = [*entries[:-1], replace(entries[-1], op=hostile_op)]
        run.feed(str(100 + rank), CollectivesSeen(t=5.0, entries=entries))
    for rank in (0, 1):
        second = [
            CollectiveEntry("1", seq, "all_reduce", [[4]], ring[0][-1].enqueued_ns + seq * 10**6)
            for seq in (1, 2, 3)
        ]
        run.feed(str(100 + rank), CollectivesSeen(t=6.0, entries=second))
    run.feed("100", Sample(t=8.0, host=None, memory=[]))
    return run


def test_each_rank_gets_a_lane_on_one_scale_and_the_straggler_s_stands_high() -> None:
    run = slow_run()
    run.drain()
    joined = run.model.advisor.joined["run"]
    ranks, left_out = lane_ranks(joined, 4)
    assert ranks == [0, 1, 2, 3] and left_out == 0
    text, scale = render_lanes(joined, ranks, 80)
    lanes = {
        int(line.split("│")[0].strip()[1:]): line.split("│")[1] for line in text.plain.split("\n")
    }
    assert all(len(lane) == 80 - 6 for lane in lanes.values())
    # One scale: the latest arrival among the collectives shown is the top mark; rank 2's lane
    # stands high (about 30 ms late) where the others' lie low.
    high = LANE_MARKS[len(LANE_MARKS) // 2 :]
    assert sum(mark in high for mark in lanes[2]) >= 0.9 * len(lanes[2])
    assert all(sum(mark in high for mark in lanes[r]) <= 0.1 * len(lanes[r]) for r in (0, 1, 3))
    assert 0.030 <= scale <= 0.045
    # With room for two lanes, rank 2 (last at nearly all) keeps its lane.
    two, left_out = lane_ranks(joined, 2)
    assert 2 in two and len(two) == 2 and left_out == 2


@pilot_test
async def test_the_run_view_shows_the_lanes_and_c_opens_the_collectives_at_80x24() -> None:
    run = slow_run(hostile_op="\x1b[2Jall_reduce")
    app = TorchtopApp.for_run(run, "run", open_rank=lambda run, pid: None)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.6)
        screen = app.screen
        assert isinstance(screen, RunScreen)
        lanes, chart = screen.query_one(ArrivalLanes), screen.query_one(RankStepChart)
        # At 80x24 the chart and the lanes take turns in one place, the chart first (the log
        # keeps its rows); v shows the lanes.
        assert chart.display and not lanes.display
        log_rows = screen.query_one("#run-log").region.height
        await pilot.press("v")
        await pilot.pause()
        assert lanes.display and not chart.display and lanes.region.height >= 5
        assert screen.query_one("#run-log").region.height >= log_rows
        # The lanes fit the screen, below the ranks' table, which still shows every rank.
        assert lanes.region.bottom <= SIZE[1] - 1
        assert [r[0] for r in rows(screen.query_one("#ranks", DataTable))] == ["0", "1", "2", "3"]
        assert "lateness per collective" in str(lanes.border_title)
        assert "c: the table" in str(lanes.border_title)

        await pilot.press("c")
        await pilot.pause()
        table_screen = app.screen
        assert isinstance(table_screen, CollectivesScreen)
        table: DataTable[str] = table_screen.query_one("#collectives", DataTable)
        labels = [str(c.label) for c in table.columns.values()]
        assert labels == ["seq", "op", "sizes", "r0 ms", "r1 ms", "r2 ms", "r3 ms", "last"]
        shown = rows(table)
        assert len(shown) == len([j for j in run.model.advisor.joined["run"] if j.pg == "0"])
        # Newest first; the job's op name shown as printable text, its escape not acted on.
        assert int(shown[0][0]) > int(shown[-1][0])
        assert shown[0][1] == "\\x1b[2Jall_reduce"
        # Rank 2 is the last to arrive at nearly every collective, about 30 ms after the first.
        steady = [r for r in shown if r[1] == "all_reduce"]
        assert sum(r[-1] == "r2" for r in steady) >= 0.9 * len(steady)
        assert sum(20 <= float(r[5]) <= 45 for r in steady) >= 0.9 * len(steady)
        head = str(table_screen.query_one("#collectives-head", Static).render())
        assert "process group 0" in head and "group 1 of 2 (g: next)" in head
        assert table.region.right <= SIZE[0] and table.region.bottom <= SIZE[1]

        # The second group: ranks 0 and 1 only, its own sequence ids.
        await pilot.press("g")
        await pilot.pause()
        shown = rows(table)
        assert [r[0] for r in shown] == ["3", "2", "1"]
        assert [str(c.label) for c in table.columns.values()] == [
            "seq",
            "op",
            "sizes",
            "r0 ms",
            "r1 ms",
            "last",
        ]
        assert "group 2 of 2" in str(table_screen.query_one("#collectives-head", Static).render())

        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is screen
        await pilot.press("v")
        await pilot.pause()
        assert chart.display and not lanes.display
        await pilot.press("q")
        await pilot.pause()
    assert not app.is_running


@pilot_test
async def test_without_collectives_the_lanes_stay_hidden_and_the_table_says_why() -> None:
    run = TwoNodes()
    run.feed("100", hello(0, 100, "a"))
    run.feed("101", hello(1, 101, "a"))
    app = TorchtopApp.for_run(run, "run", open_rank=lambda run, pid: None)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.6)
        assert not app.screen.query_one(ArrivalLanes).display
        await pilot.press("c")
        await pilot.pause()
        head = str(app.screen.query_one("#collectives-head", Static).render())
        assert "no collectives joined yet" in head
        await pilot.press("q")
        await pilot.pause()
        assert isinstance(app.screen, RunScreen)


def test_sizes_read_as_shapes() -> None:
    assert sizes_text(((1000,), (16, 16))) == "1000 16x16"
    assert sizes_text(((),)) == "scalar" and sizes_text(()) == "-"


@pilot_test
async def test_of_many_ranks_the_table_keeps_those_last_most_often() -> None:
    # 24 ranks; ranks 5 and 17 arrive last in turn, 20 ms after the others.
    run = TwoNodes()
    for rank in range(24):
        run.feed(str(100 + rank), hello(rank, 100 + rank, "a"))
    for rank in range(24):
        entries = [
            CollectiveEntry("0", seq, "all_reduce", [[8]], seq * 10**9 + rank * 1000
                            + (20 * 10**6 if rank == (5 if seq % 2 else 17) else 0))
            for seq in range(1, 41)
        ]  # fmt: skip
        run.feed(str(100 + rank), CollectivesSeen(t=5.0, entries=entries))
    run.feed("100", Sample(t=8.0, host=None, memory=[]))
    app = TorchtopApp.for_run(run, "run", open_rank=lambda run, pid: None)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.6)
        lanes = app.screen.query_one(ArrivalLanes)
        assert 5 in lane_ranks(lanes.joined, lanes.lanes)[0]
        await pilot.press("c")
        await pilot.pause()
        table: DataTable[str] = app.screen.query_one("#collectives", DataTable)
        labels = [str(c.label) for c in table.columns.values()]
        ranks = [int(label[1:-3]) for label in labels if label.endswith(" ms")]
        assert len(ranks) == MAX_RANK_COLUMNS and {5, 17} <= set(ranks)
        assert ranks == sorted(ranks)
        head = str(app.screen.query_one("#collectives-head", Static).render())
        assert f"{24 - MAX_RANK_COLUMNS} more" in head
        assert {row[-1] for row in rows(table)} == {"r5", "r17"}


@pilot_test
async def test_on_a_tall_screen_the_lanes_show_beside_the_chart() -> None:
    app = TorchtopApp.for_run(slow_run(), "run", open_rank=lambda run, pid: None)
    async with app.run_test(size=(120, 44)) as pilot:
        await pilot.pause(0.6)
        lanes = app.screen.query_one(ArrivalLanes)
        assert lanes.display and app.screen.query_one(RankStepChart).display
        assert lanes.region.height == 5  # its title, then a lane per rank
        assert lanes.region.bottom <= 44 - 1


def test_the_scale_is_not_flattened_by_the_first_collectives() -> None:
    run = slow_run()
    run.drain()
    joined = run.model.advisor.joined["run"]
    # The job's first collectives (ranks ending their start-up apart) were up to 89 ms late;
    # the scale follows the run's steady arrivals: rank 2's ~30 ms stands near the top.
    assert max(j.last_s for j in joined) > 0.05
    assert lane_scale(joined) < 0.045

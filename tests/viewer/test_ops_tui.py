"""The ops panel: op timings from the agent's profiler windows, driven by Pilot at 80x24.

The window's table and the cumulative one hold different ops and figures, so a test that reads
the wrong one fails; each sort order puts the rows in a different order for the same reason.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any, cast

from fakes.source import FakeSource, RequestingSource
from rich.console import Console
from test_tui_app import SIZE, T0, cuda_job, drained, pilot_test, static_text
from textual.pilot import Pilot
from textual.widget import Widget
from textual.widgets import DataTable, Input, Static

from torchtop.model.job import JobModel
from torchtop.protocol import (
    REQUEST_PROFILE,
    JobExited,
    Message,
    OpStat,
    OpsWindow,
    ProbeStatus,
    Request,
)
from torchtop.streams.feed import AgentFeed
from torchtop.streams.source import Sink
from torchtop.streams.sources import LiveSource
from torchtop.tui.app import TorchtopApp
from torchtop.tui.format import format_share
from torchtop.tui.screens.help import HelpScreen
from torchtop.tui.screens.quit import QuitScreen
from torchtop.tui.widgets.ops import (
    OTHER_LABEL,
    OpsFilter,
    OpsPanel,
    elide_start,
    filter_ops,
    name_width,
    next_sort,
    op_label,
    op_rows,
    ops_summary,
    per_step,
    shows_device,
    sort_ops,
)

# Self time, calls and average each put these in a different order:
#   self:  mm (40 ms) > conv (30 ms) > add (10 ms) > item (5 ms)
#   calls: add (400) > item (200) > mm (120) > conv (12)
#   avg:   conv (3.5 ms) > mm (0.35 ms) > item (0.03 ms) > add (0.03 ms, less total)
WINDOW_OPS = [
    OpStat("aten::add_", 400, 0.0110, 0.0100, 0.004, 0.004),
    OpStat("aten::mm", 120, 0.0420, 0.0400, 0.300, 0.300),
    OpStat("aten::item", 200, 0.0060, 0.0050, None, None),
    OpStat("aten::conv2d", 12, 0.0420, 0.0300, 0.200, 0.150),
]
# Over all windows: other ops, so a view that shows the wrong table fails.
CUMULATIVE_OPS = [
    OpStat("aten::bmm", 900, 1.2000, 1.1000, 3.0, 2.9),
    OpStat("aten::softmax", 300, 0.4000, 0.3000, 0.5, 0.5),
    OpStat("aten::mm", 1200, 0.4200, 0.4000, 2.0, 2.0),
]


def window(**changes: Any) -> OpsWindow:
    """The agent's seventh window: 0.5 s over 5 steps, with kernels on the device."""
    base = OpsWindow(
        t=T0 + 20,
        window=7,
        began=T0 + 19.5,
        duration_s=0.5,
        steps=5,
        cost_s=0.045,
        spacing_s=30.0,
        device=True,
        sync_points=15,
        copies=10,
        ops=WINDOW_OPS,
        total_steps=40,
        total_duration_s=4.0,
        total_sync_points=20,
        total_copies=80,
        cumulative=CUMULATIVE_OPS,
        other_self_cpu_s=0.002,
        cumulative_other_self_cpu_s=0.25,
        trace_path="/tmp/torchtop-4242/ops/window-7.pt.trace.json",
    )
    return dataclasses.replace(base, **changes)


def ops_job(*extra: Message) -> list[Message]:
    return [*cuda_job(), ProbeStatus(T0, "ops", True, "torch.profiler"), *extra]


def table_of(app: TorchtopApp) -> DataTable[Any]:
    return cast("DataTable[Any]", app.job.query_one("#ops-table", DataTable))


def names(app: TorchtopApp) -> list[str]:
    """The op column of the table, top to bottom."""
    table = table_of(app)
    return [str(table.get_row_at(i)[0]) for i in range(table.row_count)]


def column(app: TorchtopApp, label: str) -> list[str]:
    table = table_of(app)
    index = [str(c.label) for c in table.columns.values()].index(label)
    return [str(table.get_row_at(i)[index]) for i in range(table.row_count)]


def summary(app: TorchtopApp) -> str:
    return static_text(app.job.query_one("#ops-summary", Static))


def shown(widget: Widget) -> bool:
    return widget.display and widget.size.height > 0 and widget.size.width > 0


def plain(renderable: Any, width: int = 200) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    with console.capture() as capture:
        console.print(renderable)
    return capture.get()


async def open_ops(pilot: Pilot[int]) -> OpsPanel:
    await drained(pilot)
    await pilot.press("t")
    await pilot.pause()
    app = pilot.app
    assert isinstance(app, TorchtopApp)
    return app.job.query_one(OpsPanel)


class FeedStub:
    """Stands in for a connected :class:`AgentFeed`: keeps what the source sends."""

    def __init__(self) -> None:
        self.sent: list[Message] = []

    def send(self, message: Message) -> bool:
        self.sent.append(message)
        return True

    def close(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> bool:
        return True


class ConnectedLiveSource(LiveSource):
    """The real live source, its socket feed replaced by a stub that records requests."""

    def __init__(self, messages: list[Message]) -> None:
        super().__init__("/run/torchtop/4242.sock")
        self.messages = messages
        self.stub = FeedStub()

    def start(self, sink: Sink) -> None:
        self._feed = cast(AgentFeed, self.stub)
        for message in self.messages:
            sink(message)


# -- pure helpers ----------------------------------------------------------------------------------


def test_sort_orders() -> None:
    by = {key: [op.name for op in sort_ops(WINDOW_OPS, key)] for key in ("self", "calls", "avg")}
    assert by["self"] == ["aten::mm", "aten::conv2d", "aten::add_", "aten::item"]
    assert by["calls"] == ["aten::add_", "aten::item", "aten::mm", "aten::conv2d"]
    assert by["avg"] == ["aten::conv2d", "aten::mm", "aten::item", "aten::add_"]
    assert [next_sort(k) for k in ("self", "calls", "avg")] == ["calls", "avg", "self"]


def test_sort_ties_go_by_self_time_then_name() -> None:
    ops = [OpStat("b", 1, 1.0, 0.5), OpStat("a", 1, 1.0, 0.5), OpStat("c", 1, 1.0, 0.9)]
    assert [op.name for op in sort_ops(ops, "calls")] == ["c", "a", "b"]
    assert [op.name for op in sort_ops(ops, "avg")] == ["c", "a", "b"]
    assert [op.name for op in sort_ops([OpStat("z", 0, 0.0, 0.0)], "avg")] == ["z"]  # no calls


def test_filter_is_a_case_insensitive_substring_of_the_label() -> None:
    assert [op.name for op in filter_ops(WINDOW_OPS, "MM")] == ["aten::mm"]
    assert [op.name for op in filter_ops(WINDOW_OPS, " aten::a ")] == ["aten::add_"]
    assert filter_ops(WINDOW_OPS, "") == WINDOW_OPS
    assert filter_ops(WINDOW_OPS, "nothing like it") == []
    sited = OpStat("aten::mm", 1, 1.0, 1.0, shapes="[[8, 4], [4, 2]]", site="model.py:12")
    assert op_label(sited) == "aten::mm [[8, 4], [4, 2]] @ model.py:12"
    assert filter_ops([sited], "MODEL.py") == [sited]


def test_rows_for_the_window_and_for_all_windows() -> None:
    rows = op_rows(window())
    assert [r.name for r in rows] == [
        "aten::mm",
        "aten::conv2d",
        "aten::add_",
        "aten::item",
        OTHER_LABEL,
    ]
    mm = rows[0]
    assert (mm.calls, mm.total, mm.self_time, mm.avg) == ("120", "42.0 ms", "40.0 ms", "350 µs")
    assert mm.share == "8.0%"  # 40 ms of the 0.5 s window
    assert mm.device_self == "300 ms"
    assert rows[3].device_self == "—"  # a host-only op in a window with kernels
    assert rows[-1].self_time == "2.00 ms" and rows[-1].calls == "—"

    everything = op_rows(window(), cumulative=True, sort="calls")
    assert [r.name for r in everything] == ["aten::mm", "aten::bmm", "aten::softmax", OTHER_LABEL]
    assert everything[1].share == "28%"  # 1.1 s of the 4 s profiled
    assert everything[-1].self_time == "250 ms"

    filtered = op_rows(window(), text="mm")
    assert [r.name for r in filtered] == ["aten::mm"]  # no "other" row under a filter


def test_device_column_only_with_device_times() -> None:
    cpu_ops = [
        dataclasses.replace(op, total_device_s=None, self_device_s=None) for op in WINDOW_OPS
    ]
    cpu = window(device=False, ops=cpu_ops, cumulative=cpu_ops)
    assert not shows_device(cpu, False) and not shows_device(cpu, True)
    assert all(r.device_self is None for r in op_rows(cpu))
    assert shows_device(window(), False) and shows_device(window(), True)
    assert name_width(80, False) > name_width(80, True) >= 16
    assert name_width(20, True) == 16


def test_small_formatters() -> None:
    assert per_step(15, 5) == "3.0"
    assert per_step(15, None) == "—" and per_step(15, 0) == "—"
    assert format_share(0.04, 0.5) == "8.0%" and format_share(1, 0) == "—"
    assert format_share(0.5, 0.5) == "100%"
    assert elide_start("/a/long/path/trace.json", 12) == "…/trace.json"
    assert elide_start("short", 12) == "short"


def test_summary_lines() -> None:
    state = JobModel()
    state.apply_all([*ops_job(), window()])
    now = state.now
    assert now is not None
    text = plain(ops_summary(state))
    assert "window 7 · " in text and "500 ms · 5 steps · cost 45.0 ms" in text
    assert "next in ~" in text
    assert "sync points 3.0/step · copies 2.0/step" in text
    assert "trace /tmp/torchtop-4242/ops/window-7.pt.trace.json" in text
    everything = plain(ops_summary(state, cumulative=True))
    assert "all 7 windows · 4.00 s profiled · 40 steps" in everything
    assert "sync points 0.5/step · copies 2.0/step" in everything
    state.apply(window(steps=None, t=now + 1))  # a time-based window: no steps to divide by
    assert "sync points —/step · copies —/step" in plain(ops_summary(state))
    # A CPU-only job: no device to wait for; its .item() calls are host reads.
    state.apply(window(device=False, sync_points=0, host_reads=10, t=now + 2))
    text = plain(ops_summary(state))
    assert "sync points n/a · CPU only: no host-device copies · host reads 2.0/step" in text


def test_state_keeps_the_latest_window_and_the_probe() -> None:
    state = JobModel()
    assert state.ops is None and state.ops_windows == 0 and state.ops_unavailable is None
    state.apply(window())
    state.apply(window(window=8, t=T0 + 50))
    assert state.ops is not None and state.ops.window == 8
    assert state.ops_windows == 8 and state.ops_received == 2
    version = state.version
    state.apply(window(window=8, t=T0 + 50))  # the same window again changes nothing
    assert state.version == version and state.ops_received == 2
    state.apply(ProbeStatus(T0 + 51, "ops", False, "op timings unavailable: the job profiles"))
    assert state.ops_unavailable == "op timings unavailable: the job profiles"
    state.apply(ProbeStatus(T0 + 60, "ops", True, "resumed"))
    assert state.ops_unavailable is None


# -- the panel in the app ------------------------------------------------------------------------


@pilot_test
async def test_t_shows_the_ops_panel_in_place_of_the_rest() -> None:
    app = TorchtopApp(FakeSource(ops_job(window())))
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        assert not shown(app.job.query_one(OpsPanel))
        assert shown(app.job.query_one("#log"))
        panel = await open_ops(pilot)
        assert shown(panel) and shown(table_of(app))
        assert not shown(app.job.query_one("#log")) and not shown(app.job.query_one("#memory"))
        assert panel.size.height >= 18  # the body's full height at 80x24
        assert table_of(app).has_focus
        assert "window 7" in summary(app)
        await pilot.press("t")
        await pilot.pause()
        assert (
            not shown(panel)
            and shown(app.job.query_one("#log"))
            and shown(app.job.query_one("#memory"))
        )
        await pilot.press("t", "l")  # the log alone replaces the ops panel
        await pilot.pause()
        assert not shown(panel) and shown(app.job.query_one("#log"))
        assert not shown(app.job.query_one("#memory"))
        assert not panel.has_focus_within
        await pilot.press("k")  # the hidden panel's keys do nothing
        await pilot.pause()
        assert panel.sort == "self"
        await pilot.press("t")  # and the ops panel replaces the log
        await pilot.pause()
        assert shown(panel) and not shown(app.job.query_one("#log"))
        await pilot.press("t")
        await pilot.pause()
        assert shown(app.job.query_one("#memory")) and shown(app.job.query_one("#log"))


@pilot_test
async def test_the_table_sorts_by_self_time_calls_and_average() -> None:
    app = TorchtopApp(FakeSource(ops_job(window())))
    async with app.run_test(size=SIZE) as pilot:
        panel = await open_ops(pilot)
        self_order = ["aten::mm", "aten::conv2d", "aten::add_", "aten::item", OTHER_LABEL]
        assert names(app) == self_order
        assert column(app, "self") == ["40.0 ms", "30.0 ms", "10.0 ms", "5.00 ms", "2.00 ms"]
        assert column(app, "dev self")[0] == "300 ms"
        assert "by self time" in str(panel.border_title)
        await pilot.press("k")
        await pilot.pause()
        assert names(app) == ["aten::add_", "aten::item", "aten::mm", "aten::conv2d", OTHER_LABEL]
        assert "by calls" in str(panel.border_title)
        await pilot.press("k")
        await pilot.pause()
        assert names(app) == ["aten::conv2d", "aten::mm", "aten::item", "aten::add_", OTHER_LABEL]
        assert "by average" in str(panel.border_title)
        await pilot.press("k")
        await pilot.pause()
        assert names(app) == self_order
        await pilot.press("2")
        await pilot.pause()
        assert names(app)[0] == "aten::add_"
        await pilot.press("3")
        await pilot.pause()
        assert names(app)[0] == "aten::conv2d"
        await pilot.press("1")
        await pilot.pause()
        assert names(app) == self_order


@pilot_test
async def test_w_switches_between_the_last_window_and_all_windows() -> None:
    app = TorchtopApp(FakeSource(ops_job(window())))
    async with app.run_test(size=SIZE) as pilot:
        panel = await open_ops(pilot)
        assert "aten::bmm" not in names(app)
        await pilot.press("w")
        await pilot.pause()
        assert names(app) == ["aten::bmm", "aten::mm", "aten::softmax", OTHER_LABEL]
        assert column(app, "%") == ["28%", "10%", "7.5%", "6.2%"]
        assert "all windows" in str(panel.border_title)
        assert "all 7 windows" in summary(app)
        await pilot.press("w")
        await pilot.pause()
        assert names(app)[:2] == ["aten::mm", "aten::conv2d"]
        assert "last window" in str(panel.border_title)


@pilot_test
async def test_slash_filters_by_name_and_letters_type_into_the_filter() -> None:
    app = TorchtopApp(FakeSource(ops_job(window())))
    async with app.run_test(size=SIZE) as pilot:
        panel = await open_ops(pilot)
        await pilot.press("slash")
        await pilot.pause()
        field = app.job.query_one(OpsFilter)
        assert shown(field) and field.has_focus
        # "l" and "e" are the app's keys (log, end) and "q" quits: here they only type.
        await pilot.press("l", "e", "q")
        await pilot.pause()
        assert field.value == "leq" and app.is_running
        assert not isinstance(app.screen, QuitScreen)
        assert "log-only" not in app.job.query_one("#body").classes
        assert names(app) == []
        await pilot.press("backspace", "backspace", "backspace", "A", "D", "D")
        await pilot.pause()
        assert names(app) == ["aten::add_"]
        assert "“ADD” 1/4" in str(panel.border_title)
        await pilot.press("enter")
        await pilot.pause()
        assert table_of(app).has_focus and shown(field)
        await pilot.press("w")  # the filter holds for the cumulative table too
        await pilot.pause()
        assert names(app) == []
        await pilot.press("w", "slash")
        await pilot.pause()
        await pilot.press("escape")  # clears the filter
        await pilot.pause()
        assert field.value == "" and not shown(field)
        assert len(names(app)) == 5 and table_of(app).has_focus


@pilot_test
async def test_ctrl_c_in_the_filter_still_quits() -> None:
    app = TorchtopApp(FakeSource(ops_job(window())))
    async with app.run_test(size=SIZE) as pilot:
        await open_ops(pilot)
        await pilot.press("slash")
        await pilot.pause()
        assert isinstance(app.focused, Input)
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert not app.is_running


@pilot_test
async def test_the_unavailable_reason_is_shown_with_the_last_window() -> None:
    backed_off = ProbeStatus(
        T0 + 25, "ops", False, "op timings unavailable: the job runs its own torch.profiler"
    )
    app = TorchtopApp(FakeSource(ops_job(window(), backed_off)))
    async with app.run_test(size=SIZE) as pilot:
        await open_ops(pilot)
        text = summary(app)
        assert "op timings unavailable: the job runs its own torch.profiler" in text
        assert "window 7" in text and "next in" not in text
        assert names(app)[0] == "aten::mm"


@pilot_test
async def test_before_any_window_and_with_ops_off() -> None:
    source = FakeSource(ops_job())
    app = TorchtopApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await open_ops(pilot)
        assert "no op window yet" in summary(app) and "press p" in summary(app)
        assert not shown(table_of(app))
        source.deliver([ProbeStatus(T0 + 31, "ops", False, "op sampling is off (--no-ops)")])
        await drained(pilot)
        assert summary(app).strip() == "op sampling is off (--no-ops)"
        source.deliver([ProbeStatus(T0 + 32, "ops", True, "on"), window(t=T0 + 32)])
        await drained(pilot)
        assert shown(table_of(app)) and table_of(app).has_focus
        assert names(app)[0] == "aten::mm"


@pilot_test
async def test_a_job_that_ended_without_a_window_says_so() -> None:
    source = FakeSource(ops_job(JobExited(T0 + 30.5, 0, "exited")))
    app = TorchtopApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await open_ops(pilot)
        assert "no op window was taken" in summary(app)
        assert "press p" not in summary(app)


@pilot_test
async def test_p_on_a_live_source_sends_a_profile_request_and_opens_the_window() -> None:
    source = ConnectedLiveSource(ops_job())
    app = TorchtopApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        await pilot.press("p")
        await pilot.pause()
        (request,) = source.stub.sent
        assert isinstance(request, Request) and request.action == REQUEST_PROFILE == "profile"
        assert not shown(app.job.query_one(OpsPanel))
        app.job.sink(window(requested=True, window=8))
        await drained(pilot)
        assert shown(app.job.query_one(OpsPanel))  # the window it asked for opens the panel
        assert "on request" in summary(app)


@pilot_test
async def test_a_recording_does_not_offer_to_take_a_window() -> None:
    source = RequestingSource(ops_job(), reachable=False, mode="replay", seekable=True)
    app = TorchtopApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        assert (
            app.check_action("profile", ()) is False and app.check_action("snapshot", ()) is False
        )
        await pilot.press("p")
        await pilot.pause()
        assert source.requests() == []
        await pilot.press("t")
        await pilot.pause()
        assert "no op window in the recording" in summary(app)


@pilot_test
async def test_help_lists_the_ops_keys() -> None:
    app = TorchtopApp(FakeSource(ops_job()))
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        text = static_text(app.screen.query_one("#help-text", Static))
        assert "op-timing window now" in text and "filter by name" in text


def test_a_window_names_the_phase_it_was_taken_in() -> None:
    from torchtop.protocol import PhaseBegan, PhaseEnded

    state = JobModel()
    state.apply_all(ops_job())
    state.apply_all(
        [
            PhaseBegan(T0 + 10, "warm-up", 11),
            PhaseEnded(T0 + 15, "warm-up", 11),
            PhaseBegan(T0 + 18, "train", 12),
            PhaseBegan(T0 + 19, "epoch 3", 13),  # nested: the innermost is named
            window(),  # began at T0 + 19.5
        ]
    )
    assert " · in epoch 3" in plain(ops_summary(state))
    state.apply(PhaseEnded(T0 + 19.2, "epoch 3", 13))
    assert " · in train" in plain(ops_summary(state))
    state.apply(window(began=T0 + 16, t=T0 + 21))  # between those: the job's own phase
    assert " · in broadcast" in plain(ops_summary(state))
    state.apply(window(began=T0 - 5, t=T0 + 22))  # before any phase
    assert " · in " not in plain(ops_summary(state)).replace("next in", "")

"""The viewer draws a frame when data comes, not on a clock, and redraws only what changed.

Counts refreshes and frames, never time: a widget whose data did not change is not refreshed,
and data the source delivers from its own thread reaches the screen without the test draining.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest
from fakes.source import FakeSource
from rich.style import Style
from test_steps_tui import training_job
from test_steps_view import steps_frame
from test_tui_app import (
    HOST,
    T0,
    cuda_job,
    drained,
    log_text,
    memory_text,
    pilot_test,
    running,
    static_text,
)
from textual.pilot import Pilot
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Static

import torchtop.tui.screens.job as app_module
import torchtop.tui.widgets.memory as memory_module
from torchtop.model.job import LogEntry
from torchtop.protocol import LogLine, MemoryStats, Message, Sample
from torchtop.tui.app import TorchtopApp
from torchtop.tui.wake import WakeFilter
from torchtop.tui.widgets.chart import TimeSeriesChart
from torchtop.tui.widgets.device import DevicePanel
from torchtop.tui.widgets.header import JobHeader
from torchtop.tui.widgets.host import HostPanel
from torchtop.tui.widgets.log import LogPanel, log_line
from torchtop.tui.widgets.memory import MemoryPanel
from torchtop.tui.widgets.ops import OpsPanel
from torchtop.tui.widgets.steps import StepBars, StepPanel

GiB = 1 << 30


@contextmanager
def counting_calls(method: str, *objects: object) -> Iterator[dict[object, int]]:
    """Count each object's calls of ``method`` (``refresh``: Textual's request to render a
    widget again), the method still doing its work."""
    counts = dict.fromkeys(objects, 0)
    for obj in objects:
        original = getattr(obj, method)

        def counted(*args: object, _obj: object = obj, _o: Any = original, **kw: object) -> Any:
            counts[_obj] += 1
            return _o(*args, **kw)

        setattr(obj, method, counted)
    try:
        yield counts
    finally:
        for obj in objects:
            delattr(obj, method)


def counting_refreshes(*widgets: Widget) -> AbstractContextManager[dict[object, int]]:
    return counting_calls("refresh", *widgets)


def sample(t: float, allocated: int) -> Sample:
    return Sample(t, HOST, [MemoryStats("cuda:0", "cuda-allocator", allocated, 6 * GiB)])


@pilot_test
async def test_a_panel_whose_data_did_not_change_is_not_redrawn() -> None:
    source = FakeSource(cuda_job(), deliver_on_start=True)
    async with running(source) as (app, pilot):
        host = app.job.query_one(HostPanel)
        device = app.job.query_one(DevicePanel)
        figures = app.job.query_one(MemoryPanel).query_one("#memory-figures")
        with counting_refreshes(host, device, figures) as counts:
            # New memory figures, the same host readings and no new GPU reading.
            end = T0 + 30
            for i in range(5):
                app.job.sink(sample(end + i / 10, 9 * GiB + i))
            await drained(pilot)
        assert counts[figures] >= 1  # what changed is drawn
        assert counts[host] == 0
        assert counts[device] == 0


@pilot_test
async def test_a_flat_series_a_moment_later_does_not_redraw_the_chart() -> None:
    async with running(cuda_job()) as (app, pilot):
        chart = app.job.query_one(MemoryPanel).query_one(TimeSeriesChart)
        last = app.job.state.primary_memory
        assert last is not None
        allocated = last.latest.allocated_bytes
        with counting_refreshes(chart) as counts:
            # The same value 10 ms later: the chart looks the same.
            app.job.sink(sample(T0 + 29.9 + 0.01, allocated))
            await drained(pilot)
        assert counts[chart] == 0


@pilot_test
async def test_data_from_the_source_thread_reaches_the_screen_without_a_tick() -> None:
    source = FakeSource(cuda_job(), deliver_on_start=True)
    async with running(source) as (app, pilot):
        frames = getattr(app.job, "frames", 0)
        line = LogLine(T0 + 31, "stdout", "new line from the job")
        feeder = threading.Thread(target=app.job.sink, args=(line,))
        feeder.start()
        feeder.join()
        # No drain from the test: the delivery itself asks for a frame.
        for _ in range(200):
            await pilot.pause()
            if getattr(app.job, "frames", 0) > frames:
                break
        await pilot.pause()
        assert getattr(app.job, "frames", 0) == frames + 1
        assert log_text(app)[-1].endswith("new line from the job")


async def fed_one_by_one(pilot: Pilot[int], messages: list[Message]) -> None:
    """Hand each message to the app's sink as a source would, letting the app run between
    them: only what the sink asks for is drawn (the test never drains)."""
    app = pilot.app
    assert isinstance(app, TorchtopApp)
    for message in messages:
        app.job.sink(message)
        await pilot.pause()


def idle_samples(start: float, count: int, allocated: int = 9 * GiB) -> list[Message]:
    """An idle job's samples: ten a second, the same figures each time."""
    return [sample(start + i / 10, allocated) for i in range(count)]


@pilot_test
async def test_an_idle_job_draws_a_frame_every_two_seconds() -> None:
    async with running(cuda_job()) as (app, pilot):
        start = T0 + 31
        await fed_one_by_one(pilot, [sample(start - 0.1, 9 * GiB)])
        frames, applied = app.job.frames, app.job.state.samples
        chart = app.job.query_one(MemoryPanel).query_one(TimeSeriesChart)
        host = app.job.query_one(HostPanel)
        with counting_refreshes(chart, host, app.job.query_one(JobHeader)) as counts:
            await fed_one_by_one(pilot, idle_samples(start, 100))  # 10 s of the job's time
        # 100 samples, a frame for each two seconds of the job's time (the uptime moves, as
        # nvitop's does by default), and the chart and host figures redrawn at most as often.
        assert 4 <= app.job.frames - frames <= 6
        assert all(count <= 6 for count in counts.values()), counts
        await drained(pilot)
        assert app.job.state.samples == applied + 100  # none lost: applied with the next frame


@pilot_test
async def test_a_sample_that_changes_a_figure_is_drawn_at_once() -> None:
    async with running(cuda_job()) as (app, pilot):
        start = T0 + 31
        await fed_one_by_one(pilot, idle_samples(start, 3))
        frames = app.job.frames
        await fed_one_by_one(pilot, [sample(start + 0.3, 11 * GiB)])
        assert app.job.frames == frames + 1
        assert "11.0 GiB" in memory_text(app)


@pilot_test
async def test_new_figures_and_log_lines_do_not_lay_the_screen_out_again() -> None:
    async with running(cuda_job()) as (app, pilot):
        await pilot.pause()
        messages: list[Message] = []
        for i in range(10):
            t = T0 + 31 + i / 10
            messages += [sample(t, 9 * GiB + i * GiB // 4), LogLine(t, "stdout", f"line {i}")]
        with counting_calls("_refresh_layout", app.screen) as layouts:
            await fed_one_by_one(pilot, messages)
            await pilot.pause()
        assert log_text(app)[-1].endswith("line 9")
        assert layouts[app.screen] == 0


@pilot_test
async def test_the_hidden_ops_panel_is_not_redrawn() -> None:
    async with running(cuda_job()) as (app, pilot):
        panel = app.job.query_one(OpsPanel)
        with counting_calls("show_state", panel) as shown:
            samples = [sample(T0 + 31 + i, 9 * GiB + i * GiB) for i in range(3)]
            await fed_one_by_one(pilot, samples)
            assert shown[panel] == 0
            await pilot.press("t")  # shown: up to date at once
            assert shown[panel] >= 1


def test_the_wake_filter_wakes_for_changed_figures_events_and_each_second() -> None:
    wake = WakeFilter(routine_wake_s=1.0)
    assert wake.wakes(sample(T0, 9 * GiB))  # the first
    assert not wake.wakes(sample(T0 + 0.1, 9 * GiB))  # looks the same
    assert not wake.wakes(sample(T0 + 0.2, 9 * GiB + 1000))  # below the shown precision
    assert wake.wakes(sample(T0 + 0.3, 10 * GiB))  # a figure changed
    assert wake.wakes(LogLine(T0 + 0.4, "stdout", "hello"))  # anything but a routine reading
    assert not wake.wakes(sample(T0 + 1.3, 10 * GiB))
    assert wake.wakes(sample(T0 + 1.4, 10 * GiB))  # a second after the last wake


@pytest.fixture(autouse=True)
def no_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames as soon as data comes: the counts do not depend on the gap between frames."""
    monkeypatch.setattr(app_module, "MIN_FRAME_GAP_S", 0.0, raising=False)
    monkeypatch.setattr(app_module, "MAX_FRAME_GAP_S", 0.0, raising=False)


@pilot_test
async def test_step_bars_fill_their_width_once_the_row_appears() -> None:
    # The row appears with the first steps, before its size is known; the bars are paced to
    # a second of the job's time, but a new size draws them at once.
    async with running(training_job(wait=0.05)) as (app, pilot):
        await pilot.pause()
        bars = app.job.query_one(StepBars)
        assert bars.size.width > 1
        assert len(bars.points) == bars.size.width


def _cells(strip: Strip) -> list[tuple[str, Style]]:
    """A strip as what it shows: each cell's character and style (None drawn as no style)."""
    return [(char, seg.style or Style()) for seg in strip for char in seg.text]


@pilot_test
async def test_plain_log_lines_are_drawn_without_rich_and_look_the_same() -> None:
    async with running(cuda_job()) as (app, pilot):
        log = app.job.query_one(LogPanel)
        width = log.scrollable_content_region.width
        plain = [LogLine(T0 + 31, "stdout", f"step {i} loss 0.{i:04d}") for i in range(40)]
        plain.append(LogLine(T0 + 31, "stderr", "UserWarning: in yellow"))
        plain.append(LogLine(T0 + 31, "stdout", ""))
        with counting_calls("write", log) as writes, counting_calls("_rendered", log) as rich:
            await fed_one_by_one(pilot, plain)
        # A plain line is one strip, made without Rich's rendering (RichLog.write's).
        assert writes[log] == 0 and rich[log] == 0
        odd = [
            LogLine(T0 + 32, "stdout", "x" * (width + 7)),  # wraps
            LogLine(T0 + 32, "stdout", "tab\there"),
            LogLine(T0 + 32, "stderr", "naïve ✓ 日本"),
        ]
        await fed_one_by_one(pilot, odd)
        # What Rich draws for each line at the panel's width, as RichLog.write does.
        expected = [
            strip
            for line in [*plain, *odd]
            for strip in log._rendered(log_line(LogEntry(line.t, line.stream, line.text)), width)
        ]
        shown = log.lines[-len(expected) :]
        assert [_cells(s) for s in shown] == [_cells(s) for s in expected]


@pilot_test
async def test_the_steps_row_is_redrawn_once_a_second_of_the_job_s_time() -> None:
    # A fast job's counter and rates move at every step: drawn as often, they cost a chatty
    # job's viewer a frame's worth of drawing each time for a figure the eye cannot follow.
    async with running(training_job(wait=0.01)) as (app, pilot):
        steps = app.job.query_one(StepPanel)
        total = app.job.state.training.total
        frames = [
            steps_frame(T0 + 30 + (i + 1) / 20, total + 5 * (i + 1), [0.01] * 5) for i in range(40)
        ]
        with counting_calls("show_state", steps) as shown:
            await fed_one_by_one(pilot, frames)  # 2 s of the job's time, a frame each
        assert app.job.frames >= 40
        assert 1 <= shown[steps] <= 3
        await fed_one_by_one(pilot, [sample(T0 + 33, 9 * GiB)])  # a second later: drawn
        assert f"{total + 200:,}" in static_text(steps.query_one("#step-figures", Static))


def test_costly_frames_make_the_next_ones_wait_for_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(app_module, "MIN_FRAME_GAP_S", 0.1)
    monkeypatch.setattr(app_module, "MAX_FRAME_GAP_S", 0.2)
    monkeypatch.setattr(app_module, "FRAME_BUDGET", 0.04)
    app = TorchtopApp(FakeSource([]))

    def frame(spent: float) -> float:
        app.job._last_frame_cpu = time.thread_time() - spent
        app.job._pace()
        return app.job.frame_gap_s

    assert 0.125 <= frame(0.005) < 0.135  # a frame that cost 5 ms: the next waits 5 ms / 4%
    assert 0.1 <= min(frame(0.0) for _ in range(20)) < 0.11  # cheap frames: the shortest gap
    # Four cheap frames and one that redraws the charts (16 ms: alone, 0.4 s of budget, more
    # than the longest gap), over and over: each costly frame's cost is spread over the gaps
    # after it, so the thread's share of a core stays the budget.
    spent = [0.004, 0.004, 0.004, 0.004, 0.016] * 12
    gaps = [frame(s) for s in spent]
    assert gaps[-1] > gaps[-2]  # right after a costly frame, a longer wait
    share = sum(spent[-25:]) / sum(gaps[-26:-1])
    assert 0.036 <= share <= 0.044, share
    assert frame(1.0) == 0.2  # at most the longest gap


@pilot_test
async def test_frames_that_change_no_figure_do_not_build_the_memory_figures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[int] = []
    original = memory_module.memory_figures

    def counted(state: Any, width: int | None = None) -> Any:
        built.append(state.samples)
        return original(state, width)

    monkeypatch.setattr(memory_module, "memory_figures", counted)
    async with running(cuda_job()) as (app, pilot):
        built.clear()
        lines = [LogLine(T0 + 31 + i / 10, "stdout", f"line {i}") for i in range(10)]
        await fed_one_by_one(pilot, lines)
        assert app.job.frames >= 10 and built == []
        await fed_one_by_one(pilot, [sample(T0 + 32, 11 * GiB)])
        assert len(built) == 1 and "11.0 GiB" in memory_text(app)
        # A chatty job's frames each bring a sample; those whose figures read the same as the
        # last build nothing.
        frames = app.job.frames
        chatty: list[Message] = []
        for i in range(5):
            t = T0 + 32.1 + i / 10
            chatty += [sample(t, 11 * GiB + i), LogLine(t, "stdout", f"more {i}")]
        await fed_one_by_one(pilot, chatty)
        assert app.job.frames >= frames + 5 and app.job.state.samples >= 6
        assert len(built) == 1
        await fed_one_by_one(pilot, [sample(T0 + 33, 11 * GiB + 200 * 2**20)])
        assert len(built) == 2 and "11.2 GiB" in memory_text(app)


@pilot_test
async def test_the_collector_leaves_the_running_apps_objects_alone_and_all_of_them_after() -> None:
    import gc

    threshold = gc.get_threshold()
    async with running(cuda_job()):
        # What exists once the app is mounted lives as long as it: no collection walks it.
        assert gc.get_freeze_count() > 10_000
        assert gc.get_threshold()[0] >= 10_000
    # Once the app has gone, every object is collected as usual again (none kept for good).
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == threshold

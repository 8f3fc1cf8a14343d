"""The viewer draws a frame when data comes, not on a clock, and redraws only what changed.

Counts refreshes and frames, never time: a widget whose data did not change is not refreshed,
and data the source delivers from its own thread reaches the screen without the test draining.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fakes.source import FakeSource
from test_tui_app import HOST, SIZE, T0, cuda_job, drained, log_text, pilot_test
from textual.widget import Widget

import torchtop.tui.app as app_module
from torchtop.protocol import LogLine, MemoryStats, Sample
from torchtop.tui.app import TorchtopApp
from torchtop.tui.widgets.chart import TimeSeriesChart
from torchtop.tui.widgets.device import DevicePanel
from torchtop.tui.widgets.host import HostPanel
from torchtop.tui.widgets.memory import MemoryPanel

GiB = 1 << 30


@contextmanager
def counting_refreshes(*widgets: Widget) -> Iterator[dict[Widget, int]]:
    """Count each widget's ``refresh`` calls (Textual's request to render it again)."""
    counts = dict.fromkeys(widgets, 0)
    for widget in widgets:
        original = widget.refresh

        def counted(*args: object, _w: Widget = widget, _o: object = original, **kw: object):  # type: ignore[no-untyped-def]
            counts[_w] += 1
            return _o(*args, **kw)  # type: ignore[operator]

        widget.refresh = counted  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        for widget in widgets:
            del widget.refresh


def sample(t: float, allocated: int) -> Sample:
    return Sample(t, HOST, [MemoryStats("cuda:0", "cuda-allocator", allocated, 6 * GiB)])


@pilot_test
async def test_a_panel_whose_data_did_not_change_is_not_redrawn() -> None:
    source = FakeSource(cuda_job(), deliver_on_start=True)
    app = TorchtopApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        host = app.query_one(HostPanel)
        device = app.query_one(DevicePanel)
        figures = app.query_one(MemoryPanel).query_one("#memory-figures")
        with counting_refreshes(host, device, figures) as counts:
            # New memory figures, the same host readings and no new GPU reading.
            end = T0 + 30
            for i in range(5):
                app.sink(sample(end + i / 10, 9 * GiB + i))
            await drained(pilot)
        assert counts[figures] >= 1  # what changed is drawn
        assert counts[host] == 0
        assert counts[device] == 0


@pilot_test
async def test_a_flat_series_a_moment_later_does_not_redraw_the_chart() -> None:
    app = TorchtopApp(FakeSource(cuda_job()))
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        chart = app.query_one(MemoryPanel).query_one(TimeSeriesChart)
        last = app.state.primary_memory
        assert last is not None
        allocated = last.latest.allocated_bytes
        with counting_refreshes(chart) as counts:
            # The same value 10 ms later: the chart looks the same.
            app.sink(sample(T0 + 29.9 + 0.01, allocated))
            await drained(pilot)
        assert counts[chart] == 0


@pilot_test
async def test_data_from_the_source_thread_reaches_the_screen_without_a_tick() -> None:
    source = FakeSource(cuda_job(), deliver_on_start=True)
    app = TorchtopApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        frames = getattr(app, "frames", 0)
        line = LogLine(T0 + 31, "stdout", "new line from the job")
        feeder = threading.Thread(target=app.sink, args=(line,))
        feeder.start()
        feeder.join()
        # No drain from the test: the delivery itself asks for a frame.
        for _ in range(200):
            await pilot.pause()
            if getattr(app, "frames", 0) > frames:
                break
        await pilot.pause()
        assert getattr(app, "frames", 0) == frames + 1
        assert log_text(app)[-1].endswith("new line from the job")


@pytest.fixture(autouse=True)
def no_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames as soon as data comes: the counts do not depend on the gap between frames."""
    monkeypatch.setattr(app_module, "MIN_FRAME_GAP_S", 0.0, raising=False)

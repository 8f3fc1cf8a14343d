"""Viewer faults found on real jobs: the log keeps following after it changes height, the step
time chart scales each series to fit, and every screen fits 80x24 (issue 11: 2, 3, 12)."""

from __future__ import annotations

from fakes.source import FakeSource
from test_steps_view import steps_frame
from test_tui_app import SIZE, T0, cuda_job, drained, pilot_test
from textual.pilot import Pilot

from torchtop.protocol import LogLine, Message
from torchtop.tui.app import TorchtopApp
from torchtop.tui.widgets.chart import AXIS_WIDTH
from torchtop.tui.widgets.log import LogPanel
from torchtop.tui.widgets.steps import StepTimeChart


def _lines(start: int, n: int, t: float = T0 + 40) -> list[Message]:
    return [LogLine(t, "stdout", f"line {i}") for i in range(start, start + n)]


async def _at_end(pilot: Pilot[int], log: LogPanel) -> bool:
    await pilot.pause()
    await pilot.pause()
    return log.max_scroll_y > 0 and log.scroll_y == log.max_scroll_y


@pilot_test
async def test_the_log_keeps_following_after_l_twice() -> None:
    source = FakeSource(cuda_job())
    app = TorchtopApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        log = app.query_one(LogPanel)
        source.deliver(_lines(0, 60))
        await drained(pilot)
        assert await _at_end(pilot, log)
        for n, key in enumerate("ll"):
            await pilot.press(key)
            await pilot.pause()
            source.deliver(_lines(100 * (n + 1), 30))
            await drained(pilot)
            assert await _at_end(pilot, log), (key, log.scroll_y, log.max_scroll_y)


@pilot_test
async def test_the_log_keeps_following_when_the_steps_panel_appears() -> None:
    source = FakeSource(cuda_job())
    app = TorchtopApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        log = app.query_one(LogPanel)
        source.deliver(_lines(0, 60))
        await drained(pilot)
        assert await _at_end(pilot, log)
        source.deliver([steps_frame(T0 + 41, 5, [0.1] * 5)])
        await drained(pilot)
        source.deliver(_lines(100, 30))
        await drained(pilot)
        assert await _at_end(pilot, log), (log.scroll_y, log.max_scroll_y)


@pilot_test
async def test_a_reader_who_scrolled_up_stays_put() -> None:
    source = FakeSource(cuda_job())
    app = TorchtopApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        log = app.query_one(LogPanel)
        source.deliver(_lines(0, 60))
        await drained(pilot)
        log.scroll_to(y=3, animate=False)
        await pilot.pause()
        source.deliver(_lines(100, 30))
        await drained(pilot)
        await pilot.pause()
        assert log.scroll_y == 3
        log.scroll_end(animate=False)  # back at the end: following again
        await pilot.pause()
        source.deliver(_lines(200, 30))
        await drained(pilot)
        assert await _at_end(pilot, log)


@pilot_test
async def test_the_step_time_chart_fits_seconds_long_steps_with_millisecond_waits() -> None:
    # 1 s steps (0.8 to 1.2 s) that wait 2 ms each for data.
    frames: list[Message] = []
    total = 0
    for k in range(6):
        durations = [0.8 + 0.1 * (i % 5) for i in range(5)]
        total += 5
        frames.append(steps_frame(T0 + 5 * (k + 1), total, list(durations), wait=0.002))
    app = TorchtopApp(FakeSource([*cuda_job(), *frames]))
    async with app.run_test(size=(120, 40)) as pilot:
        await drained(pilot)
        chart = app.query_one(StepTimeChart)
        rows = chart.render_text().plain.splitlines()
        top = rows[0][: AXIS_WIDTH - 1].strip()
        assert top == "2s", rows[0]
        # The line sits inside the plot, not pinned against its top.
        plot = [row[AXIS_WIDTH:] for row in rows[:-1]]
        assert plot[0].strip() == "", rows

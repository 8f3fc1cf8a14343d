"""Viewer faults found on real jobs: the log keeps following after it changes height, the step
time chart scales each series to fit, and every screen fits 80x24."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fakes.source import FakeSource
from rich.text import Text
from test_steps_tui import training_job
from test_steps_view import steps_frame
from test_tui_app import HOST, T0, cuda_job, drained, hello, pilot_test, running, static_text
from test_viewer_idioms import open_help
from textual.content import Content
from textual.geometry import Region, Size
from textual.pilot import Pilot
from textual.widgets import Static
from textual.widgets._toast import Toast

from torchtop.model.connection import SourceDisconnected
from torchtop.protocol import JobExited, LogLine, MemoryStats, Message, PhaseBegan, Sample
from torchtop.tui.app import TorchtopApp
from torchtop.tui.widgets.chart import AXIS_WIDTH
from torchtop.tui.widgets.device import DevicePanel
from torchtop.tui.widgets.header import JobHeader
from torchtop.tui.widgets.host import HostPanel
from torchtop.tui.widgets.loaders import LoaderPanel
from torchtop.tui.widgets.log import LogPanel
from torchtop.tui.widgets.memory import MemoryPanel
from torchtop.tui.widgets.steps import StepPanel, StepTimeChart

MiB = 1 << 20
GiB = 1 << 30


def _lines(start: int, n: int, t: float = T0 + 40) -> list[Message]:
    return [LogLine(t, "stdout", f"line {i}") for i in range(start, start + n)]


async def _at_end(pilot: Pilot[int], log: LogPanel) -> bool:
    await pilot.pause()
    await pilot.pause()
    return log.max_scroll_y > 0 and log.scroll_y == log.max_scroll_y


@asynccontextmanager
async def _following_log() -> AsyncIterator[tuple[Pilot[int], FakeSource, LogPanel]]:
    """The viewer with 60 lines in its log, following its end."""
    source = FakeSource(cuda_job())
    async with running(source) as (app, pilot):
        log = app.job.query_one(LogPanel)
        source.deliver(_lines(0, 60))
        await drained(pilot)
        assert await _at_end(pilot, log)
        yield pilot, source, log


@pilot_test
async def test_the_log_keeps_following_after_l_twice() -> None:
    async with _following_log() as (pilot, source, log):
        for n, key in enumerate("ll"):
            await pilot.press(key)
            await pilot.pause()
            source.deliver(_lines(100 * (n + 1), 30))
            await drained(pilot)
            assert await _at_end(pilot, log), (key, log.scroll_y, log.max_scroll_y)


@pilot_test
async def test_the_log_keeps_following_when_the_steps_panel_appears() -> None:
    async with _following_log() as (pilot, source, log):
        source.deliver([steps_frame(T0 + 41, 5, [0.1] * 5)])
        await drained(pilot)
        source.deliver(_lines(100, 30))
        await drained(pilot)
        assert await _at_end(pilot, log), (log.scroll_y, log.max_scroll_y)


@pilot_test
async def test_a_reader_who_scrolled_up_stays_put() -> None:
    async with _following_log() as (pilot, source, log):
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
    async with running([*cuda_job(), *frames], size=(120, 40)) as (app, _pilot):
        chart = app.job.query_one(StepTimeChart)
        rows = chart.render_text().plain.splitlines()
        top = rows[0][: AXIS_WIDTH - 1].strip()
        assert top == "2s", rows[0]
        # The line sits inside the plot, not pinned against its top.
        plot = [row[AXIS_WIDTH:] for row in rows[:-1]]
        assert plot[0].strip() == "", rows


# -- 80x24 --------------------------------------------------------------------------------------


def _inside(region: Region, screen: Size) -> bool:
    return (
        region.x >= 0
        and region.y >= 0
        and region.right <= screen.width
        and (region.bottom <= screen.height)
    )


@pilot_test
async def test_the_help_scrolls_to_its_last_line_at_80x24() -> None:
    async with running(cuda_job()) as (app, pilot):
        help_screen = await open_help(pilot)
        dialog = help_screen.query_one("#help-dialog")
        assert _inside(dialog.region, app.size)
        for _ in range(6):
            await pilot.press("pagedown")
        await pilot.pause()
        assert dialog.max_scroll_y > 0 and dialog.scroll_y == dialog.max_scroll_y
        text = help_screen.query_one("#help-text")
        # The last row, the log's, is on screen inside the box.
        assert text.region.y + text.region.height - dialog.scroll_y <= dialog.region.bottom


#: The panels that show figures: a notification may cover none of their rows.
DATA_PANELS = (JobHeader, MemoryPanel, StepPanel, LoaderPanel, DevicePanel, HostPanel, LogPanel)


async def _toasts_cover_no_data(pilot: Pilot[int]) -> list[Region]:
    """The toasts shown, once settled (the rack scrolls a new one into place), checked to lie
    inside the screen, one row each, over no panel."""
    app = pilot.app
    assert isinstance(app, TorchtopApp)
    for _ in range(40):
        await pilot.pause(0.05)
        toasts = [toast.region for toast in app.screen.query(Toast)]
        if toasts and all(_inside(toast, app.size) for toast in toasts):
            break
    panels = [app.job.query_one(kind).region for kind in DATA_PANELS]
    assert all(region.area for region in panels)  # each panel is on screen
    for toast in toasts:
        assert _inside(toast, app.size) and toast.height == 1, toast
        for panel in panels:
            assert not toast.overlaps(panel), (toast, panel)
    return toasts


@pilot_test
async def test_notifications_cover_no_panel_s_rows_at_80x24() -> None:
    source = FakeSource(training_job(wait=0.01))
    source.reachable = False
    async with running(source, notifications=True) as (app, pilot):
        await pilot.pause()
        await pilot.press("p")  # a long warning: no agent to take an op window
        assert len(await _toasts_cover_no_data(pilot)) == 1
        source.deliver([JobExited(T0 + 31, 1, ""), SourceDisconnected(T0 + 31, "job exited")])
        await drained(pilot)
        # The newest in place of the one before: two would stack over the log.
        assert len(await _toasts_cover_no_data(pilot)) == 1
        toast = app.screen.query_one(Toast)
        assert "The job ended" in str(toast.render())


def _figures(app: TorchtopApp) -> str:
    return static_text(app.job.query_one(MemoryPanel).query_one("#memory-figures", Static))


def _figure_lines(app: TorchtopApp) -> tuple[list[str], int]:
    """The memory figures' lines as written (before the panel cuts them), and its width."""
    figures = app.job.query_one(MemoryPanel).query_one("#memory-figures", Static)
    content = figures.visual
    assert isinstance(content, Content | Text)
    return content.plain.splitlines(), figures.content_region.width


@pilot_test
async def test_the_memory_figures_fit_beside_the_phase_panel() -> None:
    heap = MemoryStats("cpu", "cpu-heap", int(1.23 * GiB), int(2.34 * GiB))
    cpu = [hello(cuda=False), *(Sample(T0 + i / 10, HOST, [heap]) for i in range(20))]
    for job in (cpu, cuda_job()):
        described = PhaseBegan(T0 + 1, "repeat", 7, description="Repeats a tensor. " * 8)
        async with running([*job, described]) as (app, pilot):
            await pilot.pause()
            lines, width = _figure_lines(app)
            assert 30 < width < 60  # beside the phase panel
            for line in lines:
                assert len(line) <= width, (line, width)
            # Each figure whole (its value with it), the peak among them.
            assert any(re.search(r"peak [\d.]+ GiB", line) for line in lines), lines


@pilot_test
async def test_rss_below_the_heap_is_explained_not_shown_negative() -> None:
    stats = MemoryStats("cpu", "cpu-heap", 620 * MiB, 564 * MiB)
    async with running([hello(cuda=False), Sample(T0, HOST, [stats])]) as (app, _pilot):
        figures = _figures(app)
        assert "-56" not in figures and "\u221256" not in figures, figures
        assert "heap > RSS" in figures, figures


@pilot_test
async def test_the_memory_panel_shows_what_holds_the_memory_at_80x24() -> None:
    from torchtop.protocol import DeviceHolding, MemoryHolders

    job = cuda_job()
    last = max(m.t for m in job if isinstance(m, Sample))
    held = MemoryHolders(last, 1, [DeviceHolding("cuda:0", GiB // 2, GiB // 2, GiB)])
    async with running([*job, held], size=(80, 24)) as (app, pilot):
        await pilot.pause()
        lines, width = _figure_lines(app)
        (bar,) = [line for line in lines if line.startswith("held ")]
        assert len(bar) <= width
        # One letter per cell, in the order of the split, and each category's bytes.
        cells = bar.split()[1]
        assert re.fullmatch(r"P+G+O+A*C*F*", cells), bar
        assert "P 512 MiB" in bar and "O 1.00 GiB" in bar
        assert cells.count("O") >= cells.count("P")

"""Textual's idioms in the viewer: the command palette, themes remembered between runs, the
mouse (a heading sorts the ops, the wheel scrolls the log, a click focuses a panel), and the help
generated from the key bindings."""

from __future__ import annotations

import re
import stat

from fakes.source import FakeSource
from test_ops_tui import ops_job, table_of, window
from test_tui_app import SIZE, T0, GiB, cuda_job, drained, hello, pilot_test, running, static_text
from test_viewer_redraw import sample
from textual.command import CommandPalette
from textual.events import MouseScrollUp
from textual.pilot import Pilot
from textual.widgets import Input

from torchtop.protocol import LogLine, Message
from torchtop.tui.app import HIGH_CONTRAST, TorchtopApp
from torchtop.tui.screens.help import HelpScreen
from torchtop.tui.settings import load_settings, settings_path
from torchtop.tui.widgets.chart import AXIS_WIDTH, TimeSeriesChart
from torchtop.tui.widgets.host import HostPanel
from torchtop.tui.widgets.log import LogPanel
from torchtop.tui.widgets.memory import MemoryPanel
from torchtop.tui.widgets.ops import OpsPanel


async def open_help(pilot: Pilot[int]) -> HelpScreen:
    """Press ``?``, as a user would; the help shown."""
    await pilot.press("question_mark")
    await pilot.pause()
    screen = pilot.app.screen
    assert isinstance(screen, HelpScreen)
    return screen


async def open_palette(pilot: Pilot[int]) -> None:
    """ctrl+p, and the palette ready for typing: its input focused (on a busy machine a
    moment after the screen is there; a letter typed before that is a key of the app's)."""
    await pilot.press("ctrl+p")
    for _ in range(100):
        await pilot.pause(0.01)
        screen = pilot.app.screen
        if isinstance(screen, CommandPalette) and isinstance(screen.focused, Input):
            return
    raise AssertionError(f"the palette did not take the keyboard: {pilot.app.screen!r}")


async def palette_choose(pilot: Pilot[int], query: str) -> None:
    """Open the palette, type ``query`` and take the best match, as a user would."""
    await open_palette(pilot)
    await pilot.press(*query)
    for _ in range(50):  # the palette searches in a worker
        await pilot.pause(0.02)
        if pilot.app.screen.query("CommandList Option"):
            break
    await pilot.press("down", "enter")
    await pilot.pause()


# -- the command palette -----------------------------------------------------------------------


@pilot_test
async def test_the_palette_offers_every_key_s_action_and_runs_one() -> None:
    async with running(ops_job(window())) as (app, pilot):
        titles = {action.title for action, _run in app.palette_commands()}
        for action in app.actions():
            if app.check_action(action.action, ()):
                assert action.title in titles, action
        for action in app.ops_actions():
            assert action.title in titles
        assert {"Stop the job and quit", "Detach"}.isdisjoint(titles)  # not ours to stop
        await palette_choose(pilot, "by calls")
        panel = app.job.query_one(OpsPanel)
        assert "ops-only" in app.job.query_one("#body").classes  # shown for the order to be seen
        assert panel.sort == "calls"


@pilot_test
async def test_letters_typed_into_the_palette_are_not_keys() -> None:
    async with running(cuda_job()) as (app, pilot):
        await open_palette(pilot)
        await pilot.press(*"quit l e")
        await pilot.pause()
        assert app.is_running and isinstance(app.screen, CommandPalette)
        assert "log-only" not in app.job.query_one("#body").classes


# -- themes --------------------------------------------------------------------------------------


@pilot_test
async def test_a_theme_chosen_is_remembered_privately_for_the_next_run() -> None:
    app = TorchtopApp(FakeSource(cuda_job()))
    assert not settings_path().exists()
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        assert HIGH_CONTRAST.name in app.available_themes
        assert "nord" in app.available_themes  # Textual's own themes too
        app.theme = HIGH_CONTRAST.name
        await pilot.pause()
    path = settings_path()
    assert load_settings() == {"theme": HIGH_CONTRAST.name}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    again = TorchtopApp(FakeSource(cuda_job()))
    async with again.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert again.theme == HIGH_CONTRAST.name
        assert again.current_theme.background == HIGH_CONTRAST.background


@pilot_test
async def test_an_unreadable_settings_file_starts_with_the_default_theme() -> None:
    path = settings_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    app = TorchtopApp(FakeSource(cuda_job()))
    default = app.theme
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert app.theme == default and app.is_running


# -- the mouse -----------------------------------------------------------------------------------


@pilot_test
async def test_a_click_on_an_ops_heading_sorts_by_it() -> None:
    async with running(ops_job(window())) as (app, pilot):
        await pilot.press("t")
        await pilot.pause()
        panel = app.job.query_one(OpsPanel)
        table = table_of(app)
        assert panel.sort == "self"
        for label, sort in (("calls", "calls"), ("avg", "avg"), ("self", "self")):
            x = 0
            for column in table.ordered_columns:
                if str(column.label) == label:
                    break
                x += column.get_render_width(table)
            await pilot.click(table, offset=(x + 2, 0))
            await pilot.pause()
            assert panel.sort == sort, label


def log_lines(count: int) -> list[Message]:
    return [LogLine(T0 + 30 + i / 100, "stdout", f"line {i}") for i in range(count)]


@pilot_test
async def test_the_wheel_scrolls_the_log_back_and_it_stops_following() -> None:
    async with running([*cuda_job(), *log_lines(60)]) as (app, pilot):
        log = app.job.query_one(LogPanel)
        assert log.max_scroll_y > 0 and log.scroll_y == log.max_scroll_y
        x, y = log.region.x + 2, log.region.y + 1
        for _ in range(3):
            log.post_message(MouseScrollUp(log, x, y, 0, 0, 0, False, False, False))
        await pilot.pause()
        assert log.scroll_y < log.max_scroll_y
        assert not log.following
        top = log.scroll_y
        app.job.source.deliver(log_lines(1))  # type: ignore[attr-defined]
        await drained(pilot)
        assert log.scroll_y == top  # the reader's place is kept


@pilot_test
async def test_a_click_focuses_a_panel() -> None:
    async with running(cuda_job()) as (app, pilot):
        assert isinstance(app.focused, LogPanel)  # the arrow keys scroll the log at first
        await pilot.click(HostPanel)
        assert isinstance(app.focused, HostPanel)
        await pilot.click(MemoryPanel, offset=(30, 5))  # on its chart
        assert isinstance(app.focused, MemoryPanel)


def _top_line(chart: TimeSeriesChart) -> str:
    return chart.render_text().plain.splitlines()[0]


@pilot_test
async def test_a_click_on_the_memory_chart_reads_the_values_at_that_time() -> None:
    # 1 GiB allocated for 15 s, then 3 GiB; 6 GiB reserved throughout.
    job = [
        hello(cuda=True),
        *(sample(T0 + i / 10, (1 if i < 150 else 3) * GiB) for i in range(300)),
    ]
    async with running(job) as (app, pilot):
        chart = app.job.query_one(MemoryPanel).query_one(TimeSeriesChart)
        plot_width = chart.content_region.width - AXIS_WIDTH
        span = chart.t_end - chart.t_start
        assert "allocated" not in _top_line(chart)
        for cell, allocated in ((10, "1.0G"), (plot_width - 8, "3.0G")):
            await pilot.click(chart, offset=(AXIS_WIDTH + cell, 1))
            line = _top_line(chart)
            found = re.search(rf"-(\d+)s allocated {allocated} reserved 6\.0G", line)
            assert found, line
            # The time read is the clicked column's, counted back from the window's end.
            assert abs(int(found[1]) - span * (1 - (cell + 0.5) / plot_width)) <= 1, line
            if allocated == "1.0G":
                await pilot.click(chart, offset=(AXIS_WIDTH + cell, 1))  # a second click
            else:
                await pilot.press("escape")
            await pilot.pause()
            assert "allocated" not in _top_line(chart)
        assert isinstance(app.focused, MemoryPanel)  # the click focused the panel as well


# -- the help --------------------------------------------------------------------------------------


@pilot_test
async def test_the_help_lists_every_key_binding_from_the_bindings() -> None:
    async with running(cuda_job()) as (_app, pilot):
        help_screen = await open_help(pilot)
        text = " ".join(static_text(help_screen.query_one("#help-text")).split())
        for binding in [*TorchtopApp.BINDINGS, *OpsPanel.BINDINGS]:
            tooltip = getattr(binding, "tooltip", "")
            if tooltip:
                assert " ".join(tooltip.split()) in text, tooltip
        assert "q ^c" in text  # the keys of one action together

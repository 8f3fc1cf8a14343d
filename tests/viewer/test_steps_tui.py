"""The step and loader panels, driven by Pilot at 80x24 with scripted steps and loaders."""

from __future__ import annotations

import io

from fakes.source import FakeSource
from rich.console import Console
from test_steps_view import loaders_frame, steps_frame
from test_tui_app import SIZE, T0, cuda_job, drained, header_text, log_text, pilot_test
from textual.widget import Widget
from textual.widgets import Static

from torchtop.protocol import Message
from torchtop.tui.app import TorchtopApp
from torchtop.tui.screens.help import HelpScreen
from torchtop.tui.widgets.host import HostPanel
from torchtop.tui.widgets.loaders import LoaderPanel
from torchtop.tui.widgets.memory import MemoryPanel
from torchtop.tui.widgets.steps import StepBars, StepPanel, StepTimeChart


def training_job(*, wait: float, seconds: int = 30) -> list[Message]:
    """``cuda_job`` with ten steps a second, each waiting ``wait`` of its 0.1 s for data."""
    messages = cuda_job(seconds)
    messages.append(steps_frame(T0, 1, [None]))
    for i in range(1, seconds + 1):
        durations: list[float | None] = [0.1] * 10
        messages.append(steps_frame(T0 + i, 1 + 10 * i, durations, wait=wait))
        if i % 5 == 0:
            messages.append(loaders_frame(T0 + i))
    return messages


def text_of(widget: Static) -> str:
    console = Console(width=200, file=io.StringIO(), color_system=None)
    with console.capture() as capture:
        console.print(widget.content)
    return capture.get()


def figures(app: TorchtopApp) -> str:
    return text_of(app.job.query_one("#step-figures", Static))


def loaders(app: TorchtopApp) -> str:
    return text_of(app.job.query_one("#loader-text", Static))


def shown(widget: Widget) -> bool:
    return widget.display and widget.size.height > 0 and widget.size.width > 0


@pilot_test
async def test_the_panels_stay_hidden_until_the_job_steps() -> None:
    app = TorchtopApp(FakeSource(cuda_job()))
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        assert not shown(app.job.query_one("#training"))
        assert "has-training" not in app.job.query_one("#body").classes


@pilot_test
async def test_step_and_loader_panels_show_live_figures_at_80x24() -> None:
    source = FakeSource(training_job(wait=0.01))
    app = TorchtopApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        steps = app.job.query_one(StepPanel)
        assert shown(steps) and shown(app.job.query_one(LoaderPanel))
        text = figures(app)
        assert "step 301" in text and "100 ms" in text and "10.0 steps/s" in text
        assert "320 samples/s" in text
        assert "wait 10% (avg 10%)" in text and "compute 90.0 ms" in text and "opt 1.00 ms" in text
        assert "INPUT-BOUND" not in str(steps.border_title)
        # The bars and the step time chart fill their space with data.
        bars = app.job.query_one(StepBars).render_text().plain
        assert "█" in bars and bars.splitlines()[0].startswith("100ms┤")
        history = app.job.query_one(StepTimeChart).render_text().plain
        assert any(0x2800 < ord(c) < 0x2900 for c in history)
        listing = loaders(app)
        assert "0 ImageFolder · batch 32 · first 1.20 s" in listing
        assert "4 workers fork · pin · prefetch 2" in listing
        assert "●●○ 2/3 alive CPU 192% RSS 610 MiB" in listing
        assert "1 ValSet · batch 64" in listing and "main process" in listing
        assert app.job.query_one(LoaderPanel).border_title == "Loaders · 2 "
        # Everything else still has its room at 80x24.
        assert app.job.query_one(MemoryPanel).outer_size.height >= 7  # rule, figures, chart of 4
        assert app.job.query_one(StepPanel).outer_size.height >= 6
        assert app.job.query_one(HostPanel).outer_size.height >= 4
        assert len(log_text(app)) == 2 and "● live" in header_text(app)
        # More steps arrive: the figures follow.
        source.deliver([steps_frame(T0 + 31, 400, [0.2] * 10, wait=0.01)])
        await drained(pilot)
        assert "step 400" in figures(app)


@pilot_test
async def test_a_job_waiting_on_data_is_flagged_input_bound() -> None:
    app = TorchtopApp(FakeSource(training_job(wait=0.06)))
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        title = str(app.job.query_one(StepPanel).border_title)
        assert "INPUT-BOUND: 60% waiting for data" in title
        assert "wait 60%" in figures(app)


@pilot_test
async def test_skipped_steps_show_in_the_title() -> None:
    messages = training_job(wait=0.0)
    messages.append(steps_frame(T0 + 31, 320, [0.1] * 10, skipped_total=3))
    app = TorchtopApp(FakeSource(messages))
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        assert "3 skipped" in str(app.job.query_one(StepPanel).border_title)


@pilot_test
async def test_log_only_hides_the_panels_and_help_explains_them() -> None:
    app = TorchtopApp(FakeSource(training_job(wait=0.0)))
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        await pilot.press("l")
        await pilot.pause()
        assert not app.job.query_one("#training").display or not shown(app.job.query_one(StepPanel))
        await pilot.press("l")
        await pilot.pause()
        assert shown(app.job.query_one(StepPanel))
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        help_text = text_of(app.screen.query_one("#help-text", Static))
        assert "INPUT-BOUND" in help_text and "Loaders" in help_text

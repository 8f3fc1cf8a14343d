"""The phase panel beside the memory chart, driven by Pilot at 80x24 with scripted phases.

It explains the running phase when the job sends descriptions (the demos do), switches when the
next phase begins, keeps the last one marked as ended, and never shows for a job whose phases
have no descriptions.
"""

from __future__ import annotations

from fakes.source import FakeSource
from rich.text import Text
from test_steps_view import steps_frame
from test_tui_app import SIZE, T0, cpu_job, cuda_job, drained, pilot_test
from textual.widget import Widget

from torchtop.model.job import JobModel
from torchtop.protocol import Message, PhaseBegan, PhaseEnded, ProbeStatus
from torchtop.tui.app import TorchtopApp
from torchtop.tui.widgets.chart import TimeSeriesChart
from torchtop.tui.widgets.memory import MemoryPanel
from torchtop.tui.widgets.phase_info import PhaseInfo, fit_lines, phase_text, phase_title

REPEAT = (
    "row.repeat(rows, 1) copies the row into a full matrix before the add. The copy is as "
    "big as the result, so peak memory doubles."
)
BROADCAST = (
    "matrix + row reads the row as if stretched: nothing is copied. Only the result is "
    "allocated, so the peak is one matrix."
)


def described_job() -> list[Message]:
    """A CPU job whose first phase, ``repeat``, is running with a description."""
    return [*cpu_job(), PhaseBegan(T0 + 1, "repeat", 1, description=REPEAT)]


def panel_text(app: TorchtopApp) -> str:
    """What the panel shows, its title first, as plain text wrapped and cut to its size."""
    panel = app.job.query_one(PhaseInfo)
    rendered = panel.render()
    title = Text.from_markup(str(panel.border_title)).plain  # Textual keeps titles as markup
    return f"{title}\n{getattr(rendered, 'plain', rendered)}"


def shown(widget: Widget) -> bool:
    return widget.display and widget.size.height > 0 and widget.size.width > 0


def words(text: str) -> str:
    """Wrapped text as one line of single-spaced words, to look for a sentence in it."""
    return " ".join(text.split())


@pilot_test
async def test_the_running_phase_is_explained_and_the_next_one_replaces_it() -> None:
    source = FakeSource(described_job())
    app = TorchtopApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        panel = app.job.query_one(PhaseInfo)
        assert shown(panel)
        text = panel_text(app)
        assert text.splitlines()[:2] == [" Phase · ▶ running · 3.9 s ", "repeat"]
        assert "■ ended" not in text
        assert "copies the row into a full matrix" in words(text)

        source.deliver(
            [
                PhaseEnded(T0 + 4, "repeat", 1),
                PhaseBegan(T0 + 4.5, "broadcasting", 2, description=BROADCAST),
            ]
        )
        await drained(pilot)
        text = panel_text(app)
        assert text.splitlines()[1] == "broadcasting"
        assert "▶ running" in text.splitlines()[0]
        assert "nothing is copied" in words(text)
        assert "copies the row" not in words(text)

        # After the last phase ends its explanation stays, marked as ended, with its length.
        source.deliver([PhaseEnded(T0 + 6, "broadcasting", 2)])
        await drained(pilot)
        assert shown(panel)
        text = panel_text(app)
        assert text.splitlines()[:2] == [" Phase · ■ ended · took 1.5 s ", "broadcasting"]
        assert "▶ running" not in text
        assert "nothing is copied" in words(text)


@pilot_test
async def test_the_panel_fits_beside_the_chart_at_80x24() -> None:
    app = TorchtopApp(FakeSource(described_job()))
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        panel = app.job.query_one(PhaseInfo)
        chart = app.job.query_one(TimeSeriesChart)
        # Side by side on the chart's rows, inside the screen, the chart keeping most columns.
        assert panel.region.x >= chart.region.right
        assert panel.region.right <= SIZE[0]
        assert panel.region.y <= chart.region.y and panel.region.bottom >= chart.region.bottom
        assert chart.size.width >= 40
        # Both sentences of the description are on screen, not cut off.
        text = panel_text(app)
        assert len(text.splitlines()) - 1 <= panel.content_region.height
        assert words(REPEAT) in words(text)


@pilot_test
async def test_no_panel_without_descriptions() -> None:
    # cuda_job has two phases, neither with a description: the layout is as it always was.
    app = TorchtopApp(FakeSource(cuda_job()))
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        assert app.job.state.phases and not app.job.state.explained_phase
        assert not shown(app.job.query_one(PhaseInfo))
        assert "has-phase-info" not in app.job.query_one("#memory-row").classes
        assert app.job.query_one(MemoryPanel).outer_size.width == SIZE[0]


def test_a_long_description_ends_in_an_ellipsis() -> None:
    state = JobModel()
    state.apply(PhaseBegan(T0, "long", 1, description="word " * 200))
    phase = state.explained_phase
    assert phase is not None
    fitted = fit_lines(phase_text(phase), 30, 6).plain.splitlines()
    assert len(fitted) == 6 and all(len(line) <= 30 for line in fitted)
    assert fitted[0] == "long" and fitted[1].startswith("word word")
    assert fitted[-1].endswith("…")
    assert phase_title(phase, T0 + 2).plain == " Phase · ▶ running · 2.0 s "


def test_the_explained_phase_is_the_latest_described_running_one() -> None:
    state = JobModel()
    assert state.explained_phase is None
    state.apply(PhaseBegan(T0, "outer", 1, description="what outer does"))
    # A nested phase without a description leaves the explanation where it is.
    state.apply(PhaseBegan(T0 + 1, "step 1", 2))
    assert state.explained_phase is not None and state.explained_phase.name == "outer"
    state.apply(PhaseBegan(T0 + 2, "inner", 3, description="what inner does"))
    assert state.explained_phase.name == "inner"
    state.apply(PhaseEnded(T0 + 3, "inner", 3))
    # The running outer phase comes back before the inner one that ended; once all ended,
    # the one that ended last stays.
    assert state.explained_phase.name == "outer"
    state.apply(PhaseEnded(T0 + 4, "step 1", 2))
    state.apply(PhaseEnded(T0 + 5, "outer", 1))
    explained = state.explained_phase
    assert explained is not None and explained.name == "outer" and not explained.running


@pilot_test
async def test_with_the_steps_row_and_a_taller_device_panel_everything_stays_on_screen() -> None:
    # A demo that steps, on a CPU machine: no NVML (three lines) and the op sampler's status
    # make the device panel five rows; the charts must not push the panels and log away.
    job = [
        *cpu_job(),
        ProbeStatus(T0, "nvml", False, "NVML not available: " + "libnvidia-ml.so.1 " * 3),
        ProbeStatus(T0, "ops", False, "op sampling is off"),
        PhaseBegan(T0 + 1, "total_loss += loss", 1, description=REPEAT),
    ]
    source = FakeSource(job)
    app = TorchtopApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        source.deliver([steps_frame(T0 + 2, 1, [None]), steps_frame(T0 + 3, 11, [0.1] * 10)])
        await drained(pilot)
        assert "has-training" in app.job.query_one("#body").classes
        rows = [
            app.job.query_one(s).region for s in ("#memory-row", "#training", "#panels", "#log")
        ]
        assert all(r.height > 0 for r in rows)
        assert rows[-1].bottom <= SIZE[1] - 1  # above the footer
        assert shown(app.job.query_one(PhaseInfo))

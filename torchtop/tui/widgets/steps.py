"""The step panel: how fast training goes, and how much of each step waits for data.

Two lines of figures (recent steps/s, samples/s, step time split into data wait and compute,
with the optimizer's share of compute), then two charts side by side: the last steps as stacked
bars (:func:`render_step_bars`: one column per step, its height the step time, its colours the
wait, the compute and the optimizer inside it) and the step time over the last minutes with
the wait beneath it. The panel's title turns into a red INPUT-BOUND flag while the recent wait
fraction stays high.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.events import Resize
from textual.widget import Widget
from textual.widgets import Static

from torchtop.model.job import JobModel
from torchtop.model.training import INPUT_BOUND_FRACTION, StepPoint, TrainingState
from torchtop.tui.format import format_percent, format_rate, format_seconds, format_seconds_short
from torchtop.tui.widgets.chart import (
    AXIS_WIDTH,
    ChartSeries,
    ChartSpan,
    TimeSeriesChart,
)
from torchtop.tui.widgets.compare import Against, against_series
from torchtop.tui.widgets.quiet import set_titles, update_if_changed

WAIT_STYLE = "yellow"
STARTUP_STYLE = "magenta"
COMPUTE_STYLE = "green"
OPTIMIZER_STYLE = "blue"
#: How much of the past the step time chart shows while the job runs.
LIVE_WINDOW_S = 120.0
MIN_WINDOW_S = 10.0
#: Eighths of a cell, for the bars.
_BLOCKS = " ▁▂▃▄▅▆▇█"


def nice_seconds(value: float) -> float:
    """A round number of seconds at or above ``value`` (1, 2 or 5 times a power of ten)."""
    if value <= 0:
        return 0.0
    scale = 1e-9
    while True:
        for step in (1, 2, 5):
            if step * scale >= value * (1 - 1e-9):
                return step * scale
        scale *= 10


def scale_top(values: Sequence[float]) -> float:
    """The top of a step-time axis: the largest value, but at most four times the median, so
    that one slow step (an epoch's start, a validation pass) does not flatten the rest."""
    present = sorted(v for v in values if v > 0)
    if not present:
        return 0.0
    median = present[(len(present) - 1) // 2]
    return nice_seconds(min(present[-1], 4 * median))


def series_top(series: Sequence[ChartSeries]) -> float:
    """The top of an axis that several series share: the highest of each series' own
    :func:`scale_top`. Each series is scaled by its own values, so millisecond waits under
    second-long steps do not pull the axis down to their median (and pin the steps at the top).
    """
    return max((scale_top([v for _, v in s.points if v is not None]) for s in series), default=0.0)


def _wait_style(fraction: float | None) -> str:
    if fraction is None:
        return ""
    if fraction >= INPUT_BOUND_FRACTION:
        return "bold red"
    if fraction >= 0.1:
        return "bold yellow"
    return "bold"


def step_figures(state: JobModel) -> Text:
    """Two lines of recent figures: step count, step time, steps/s and samples/s; then the
    share of step time waiting for data (recent and whole run), compute and optimizer time.
    The words wait, compute and opt are coloured as their parts of the bars."""
    training = state.training
    if training.total == 0:
        return Text("no steps yet: an optimizer step or torchtop.step() ends one", "dim")
    recent = training.recent(state.now)
    first = Text()
    first.append("step ", "dim")
    first.append(f"{training.total:,}", "bold")
    first.append("  ")
    first.append(format_seconds(recent.mean_step_s), "bold")
    first.append("  ")
    first.append(format_rate(recent.steps_per_s), "bold")
    first.append(" steps/s", "dim")
    if recent.samples_per_s is not None:
        first.append("  ")
        first.append(format_rate(recent.samples_per_s), "bold")
        first.append(" samples/s", "dim")
    second = Text()
    fraction = recent.wait_fraction
    second.append("wait ", WAIT_STYLE)
    second.append(
        format_percent(None if fraction is None else fraction * 100), _wait_style(fraction)
    )
    run_fraction = training.run.wait_fraction
    if run_fraction is not None:
        # The whole run's average beside the recent figure, said as such ("run" alone was read
        # as a state, not a span); the panel's tooltip spells both out.
        second.append(f" (avg {format_percent(run_fraction * 100)})", "dim")
    second.append("  compute ", COMPUTE_STYLE)
    second.append(format_seconds(recent.mean_compute_s), "bold")
    second.append("  opt ", OPTIMIZER_STYLE)
    second.append(format_seconds(recent.mean_optimizer_s))
    return Text("\n", no_wrap=True, overflow="ellipsis").join([first, second])


def step_title(state: JobModel) -> str:
    """The panel's title (Textual markup): the input-bound flag, and skipped steps."""
    training = state.training
    title = " Steps "
    if training.skipped_total:
        title += f"· [yellow]{training.skipped_total} skipped[/] "
    if training.input_bound(state.now):
        fraction = training.recent(state.now).wait_fraction or 0.0
        title += f"[b reverse red]⚠ INPUT-BOUND: {fraction:.0%} waiting for data[/] "
    return title


def _segments(point: StepPoint) -> list[tuple[float, str]]:
    """A step's stacked parts from the bottom: first-batch wait, wait, compute, optimizer."""
    compute = point.compute or 0.0
    optimizer = min(point.optimizer, compute)
    return [
        (point.startup, STARTUP_STYLE),
        (point.wait, WAIT_STYLE),
        (compute - optimizer, COMPUTE_STYLE),
        (optimizer, OPTIMIZER_STYLE),
    ]


def render_step_bars(points: Sequence[StepPoint], *, width: int, height: int) -> Text:
    """The last steps as stacked bars, one column each, newest on the right, in exactly
    ``height`` lines of ``width`` cells; the axis on the left is labelled with the top's time.

    Each cell holds up to eight levels (``▁``…``█``); where two parts meet inside a cell the
    lower part colours the block and the upper one its background.
    """
    width = max(0, width)
    height = max(0, height)
    if width == 0 or height == 0:
        return Text()
    axis = AXIS_WIDTH if width > AXIS_WIDTH + 4 else 0
    columns = width - axis
    shown = [p for p in points if p.duration is not None][-columns:] if columns else []
    y_max = scale_top([p.duration or 0.0 for p in shown])
    levels = height * 8
    # Per column: the level (in eighths) at which each part ends, and its style.
    bars: list[list[tuple[int, str]]] = []
    for point in shown:
        edges: list[tuple[int, str]] = []
        total = 0.0
        for seconds, style in _segments(point):
            total += max(0.0, seconds)
            level = min(levels, round(total / y_max * levels)) if y_max > 0 else 0
            edges.append((level, style))
        bars.append(edges)
    text = Text(no_wrap=True, overflow="crop")
    pad = columns - len(bars)
    for row in range(height):
        base = (height - 1 - row) * 8  # the cell's bottom, in eighths
        if axis:
            if row == 0 and y_max > 0:
                label = format_seconds_short(y_max)
            elif row == height - 1:
                label = "0"
            else:
                label = ""
            text.append(f"{label:>{axis - 1}}{'┤' if label else '│'}", "dim")
        text.append(" " * pad)
        for edges in bars:
            text.append(*_cell(edges, base))
        text.append("\n" if row < height - 1 else "")
    return text


def _cell(edges: list[tuple[int, str]], base: int) -> tuple[str, str]:
    """The character and style of a bar's cell whose bottom is at level ``base``."""
    top = edges[-1][0] if edges else 0
    if top <= base:
        return " ", ""
    below = ""
    for level, style in edges:
        if level > base:
            below = style
            break
    # The first part boundary inside the cell, above its bottom: split the cell there.
    for level, _style in edges:
        if base < level < base + 8 and level < top:
            above = next((s for lv, s in edges if lv > level), "")
            return _BLOCKS[level - base], f"{below} on {above}" if above else below
    fill = min(8, top - base)
    return _BLOCKS[fill], below


class StepBars(Widget):
    """The last steps as stacked bars, as many as the width holds."""

    DEFAULT_CSS = """
    StepBars {
        height: 1fr;
        min-height: 2;
    }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.points: list[StepPoint] = []

    def set_points(self, points: Sequence[StepPoint]) -> None:
        """Show ``points``; redraw only if they are not the ones shown."""
        points = list(points)
        if points == self.points:
            return
        self.points = points
        self.refresh()

    def render_text(self) -> Text:
        size = self.content_region.size
        return render_step_bars(self.points, width=size.width, height=size.height)

    def render(self) -> Text:
        return self.render_text()


class StepTimeChart(TimeSeriesChart):
    """Step time over time, with the data wait filled beneath it; the axis in seconds."""

    def scale(self) -> tuple[float | None, Callable[[float], str]]:
        return series_top(self.series), format_seconds_short


def history_data(
    state: JobModel, against: Against | None = None
) -> tuple[list[ChartSeries], list[ChartSpan], float, float]:
    """The step time and wait series, and the phases, over the chart's window; with
    ``against``, a second recording's step time and wait, aligned by step
    (:func:`~torchtop.tui.widgets.compare.against_series`)."""
    training: TrainingState = state.training
    end = state.now if state.now is not None else 0.0
    points = training.points
    if points:
        end = max(end, points[-1].t)
        first = points[0].t
        over = state.job_ended or state.lost
        start = first if over else max(first, end - LIVE_WINDOW_S)
    else:
        start = end - LIVE_WINDOW_S
    start = min(start, end - MIN_WINDOW_S)
    durations: list[tuple[float, float | None]] = []
    waits: list[tuple[float, float | None]] = []
    # The model's folded series: a fast job's thousands of steps as a few points per column.
    for bucket in reversed(training.chart):
        if bucket.step_t < start and bucket.wait_t < start:
            break
        if bucket.step_t >= start:
            durations.append((bucket.step_t, bucket.step))
        if bucket.wait_t >= start:
            waits.append((bucket.wait_t, bucket.wait))
    durations.reverse()
    waits.reverse()
    series = [
        ChartSeries("wait", waits, WAIT_STYLE, fill=True),
        ChartSeries("step", durations, COMPUTE_STYLE),
    ]
    if against is not None:
        series += against_series(state, against, start, end)
    spans = [ChartSpan(p.name, p.start, p.end) for p in state.phases_between(start, end)]
    return series, spans, start, end


#: What the figures above the bars are, on hovering them.
STEP_FIGURES_TOOLTIP = (
    "Over the last steps (about 10 s): the step count, mean step time, steps and samples per "
    "second; wait = share of step time blocked on the DataLoader (avg: over the whole run), "
    "compute = forward and backward, opt = optimizer.step()."
)


class StepPanel(Vertical):
    """Step figures over the last steps' bars and the step time history."""

    #: A click focuses the panel (and the palette can maximize it).
    can_focus = True

    DEFAULT_CSS = """
    StepPanel {
        height: 1fr;
    }
    StepPanel > #step-figures {
        height: 2;
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    StepPanel > #step-charts {
        height: 1fr;
    }
    StepPanel #step-bars {
        width: 1fr;
    }
    StepPanel #step-history {
        width: 1fr;
        margin-left: 1;
        min-height: 2;
    }
    """

    _state: JobModel | None = None
    #: A second recording drawn against this job's steps (``replay --against``).
    against: Against | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="step-figures").with_tooltip(STEP_FIGURES_TOOLTIP)
        with Horizontal(id="step-charts"):
            yield StepBars(id="step-bars")
            yield StepTimeChart(id="step-history")

    def show_state(self, state: JobModel, *, charts: bool = True) -> None:
        """Redraw the figures from ``state``, and the bars and chart too when ``charts``."""
        set_titles(self, step_title(state))
        update_if_changed(self.query_one("#step-figures", Static), step_figures(state))
        self._state = state
        if charts:
            self._show_charts()

    @on(Resize)
    def _show_charts(self) -> None:
        """The bars hold as many steps as their width: drawn again when it changes (the row
        appears with the first steps, before its size is known), whatever the pace."""
        state = self._state
        if state is None:
            return
        bars = self.query_one(StepBars)
        bars.set_points(state.training.last_points(max(1, bars.size.width)))
        series, spans, t_start, t_end = history_data(state, self.against)
        self.query_one(StepTimeChart).set_data(series, t_start=t_start, t_end=t_end, spans=spans)

"""The live view of a multi-rank job ``torchtop run`` launched (``torchtop run torchrun ...``).

One table of ranks (step, recent step time, steps/s, data wait, time in backward, memory, last
seen, state, and a trend: the last steps' times as bars on one scale for every rank; a node
column once ranks of more than one node are shown, ``torchtop attach --node``), the run's
findings (straggler, hang, dead ranks: :mod:`torchtop.model.run_advice`), a chart of each rank's
step time over the last minute (:class:`RankStepChart`), a lane per rank with its lateness at
each collective (:class:`~torchtop.tui.widgets.collectives.ArrivalLanes`; ``c`` opens the table
of the collectives) and the job's output, each rank's lines
behind its rank's prefix (``[rank2]:``, as ``torchrun --tee`` shows them). It reads the
:class:`~torchtop.model.run.RunModel` that :class:`~torchtop.streams.runs.RunFold` folds, four
times a second, and redraws only when something arrived. ``enter`` on a rank's row opens that rank's
full screens (a job screen attached to its agent, pushed over this one: its ``q`` comes back
here, to the run as it was; a rank of another node says where to open it); ``q`` stops the job
(the launcher stops its ranks) and quits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from rich.cells import cell_len
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.coordinate import Coordinate
from textual.screen import Screen
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import DataTable, Footer, RichLog, Static
from textual.widgets.data_table import ColumnKey

from torchtop.job_output import rank_prefix, split_rank
from torchtop.model.run_advice import died
from torchtop.sizes import format_bytes
from torchtop.streams.heap import SettledHeap
from torchtop.text import printable
from torchtop.tui.format import format_seconds_short, format_span
from torchtop.tui.screens.collectives import CollectivesScreen
from torchtop.tui.screens.job import JobScreen
from torchtop.tui.screens.run_order import FOLD_AFTER, heat_strip, ordered, page_line
from torchtop.tui.widgets.chart import AXIS_WIDTH, ChartSeries, render_chart
from torchtop.tui.widgets.collectives import ArrivalLanes
from torchtop.tui.widgets.steps import series_top

if TYPE_CHECKING:
    from torchtop.model import JobModel
    from torchtop.streams.runs import RunFold
    from torchtop.streams.source import Source

#: Gives a rank's source and title, from its run and pid (None: the rank cannot be reached).
RankOpener = Callable[["RunFold", int], "tuple[Source, str] | None"]

#: Seconds between two looks at what arrived, and the least between two redraws of the table.
REFRESH_S = 0.25
TABLE_S = 1.0
COLUMNS = ("rank", "pid", "state", "steps", "step", "/s", "wait", "bwd", "memory", "seen", "trend")
#: Steps the trend column shows, and its marks from shortest to longest.
TREND_STEPS = 12
BARS = "▁▂▃▄▅▆▇█"
SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}
#: Each rank's colour, in the chart and on its log lines' prefix (red is stderr's).
RANK_STYLES = ("cyan", "magenta", "green", "yellow", "blue", "bright_cyan", "bright_magenta",
               "bright_green")  # fmt: skip
STDERR_STYLE = "red"
#: The chart's window while the job runs, and the most rows a rank's strip takes.
CHART_WINDOW_S = 60.0
CHART_MAX_ROWS = 4
#: The share of the screen's height the chart takes at most (the table and log keep the rest).
CHART_SHARE = 0.35
#: ... and the lanes of the ranks' arrivals at the collectives. Below LANES_HEIGHT rows the
#: chart and the lanes take turns in one place (``v``), the chart first.
LANES_SHARE = 0.25
LANES_HEIGHT = 40


def rank_style(rank: int) -> str:
    return RANK_STYLES[rank % len(RANK_STYLES)]


def log_line(stream: str, text: str) -> Text:
    """A line of the run's log: a rank's prefix in the rank's colour, stderr in red."""
    style = STDERR_STYLE if stream == "stderr" else ""
    rank, rest = split_rank(text)
    if rank is None:
        return Text(text, style)
    line = Text()
    line.append(rank_prefix(rank), rank_style(rank))
    line.append(rest, style)
    return line


def outside_backward(job: JobModel, start: float) -> list[tuple[float, float | None]]:
    """The rank's steps since ``start`` as ``(t, seconds)``: each step's time less its time in
    ``loss.backward()``. In a synchronous job every rank's whole step takes the same time (the
    early ranks wait for the last inside backward's all-reduce); what is left differs, and is
    highest on the rank the others wait for."""
    out: list[tuple[float, float | None]] = []
    for point in reversed(job.training.points):
        if point.t < start:
            break
        if point.duration is not None:
            out.append((point.t, max(0.0, point.duration - point.backward)))
    out.reverse()
    return out


def render_rank_strips(
    series: list[tuple[int, ChartSeries]],
    *,
    width: int,
    rows: int,
    t_start: float,
    t_end: float,
    y_max: float,
) -> Text:
    """One strip of ``rows`` lines per rank (a filled braille chart, :func:`render_chart`),
    aligned in time and all on the scale ``[0, y_max]``, each labelled with its rank; then the
    time axis."""
    text = Text(no_wrap=True, overflow="crop")
    if width <= AXIS_WIDTH + 4 or rows <= 0:
        return text
    for rank, one in series:
        strip = render_chart(
            [one], width=width, height=rows + 1, t_start=t_start, t_end=t_end, y_max=y_max
        ).split("\n")
        for row, line in enumerate(strip[:rows]):
            label = f"r{rank}" if row == 0 else ""
            text.append(f"{label:>{AXIS_WIDTH - 1}}", rank_style(rank) if label else "")
            text.append("┤" if label else "│", "dim")
            text.append_text(line[AXIS_WIDTH:])
            text.append("\n")
    plot = width - AXIS_WIDTH
    window = t_end - t_start
    middle = f"-{format_span(window / 2)}"
    axis = "─" * plot
    half = (plot - len(middle)) // 2
    axis = axis[:half] + middle + axis[half + len(middle) : plot - 3] + "now"
    text.append(f"{'-' + format_span(window):>{AXIS_WIDTH - 1}}└{axis[1:]}", "dim")
    return text


class RankStepChart(Widget):
    """Each rank's step time (outside backward) over the last minute: a strip per rank on one
    scale, so the rank the others wait for stands higher. Redrawn by :meth:`set_data` when
    steps arrived, and at its own size when the layout changes it."""

    DEFAULT_CSS = """
    RankStepChart {
        height: auto;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.series: list[tuple[int, ChartSeries]] = []
        self.t_start = 0.0
        self.t_end = 0.0
        self.y_max = 0.0
        #: Lines each rank's strip takes (the app sets it from the screen's height).
        self.rows = 1
        #: What a strip is: the step outside backward, or the whole step where the source
        #: has no time in backward (Prometheus); and how many ranks the run has in all.
        self.whole_step = False
        self.of_ranks = 0

    def set_data(self, jobs: list[JobModel]) -> None:
        """Each rank's steps over the window that ends at the latest message."""
        ends = [j.now for j in jobs if j.now is not None]
        self.t_end = max(ends) if ends else 0.0
        self.t_start = self.t_end - CHART_WINDOW_S
        series = []
        for job in jobs:
            rank = job.hello.rank if job.hello is not None else None
            if rank is None:
                continue
            points = outside_backward(job, self.t_start)
            series.append((rank, ChartSeries(f"rank {rank}", points, rank_style(rank), True)))
        self.series = sorted(series, key=lambda item: item[0])
        self.y_max = series_top([one for _, one in self.series])
        what = "step time per rank" if self.whole_step else "step time per rank, outside backward"
        if self.of_ranks > len(self.series):
            what += f" · the table's first {len(self.series)} of {self.of_ranks}"
        self.border_title = (
            f"{what} · each row 0 to {format_seconds_short(self.y_max)} · "
            f"last {format_span(CHART_WINDOW_S)}"
        )
        self.refresh(layout=True)

    def get_content_height(self, container: object, viewport: object, width: int) -> int:
        return len(self.series) * self.rows + 1 if self.series else 1

    def render(self) -> Text:
        if not self.series:
            return Text("no steps yet", "dim")
        return render_rank_strips(
            self.series,
            width=self.content_region.width,
            rows=self.rows,
            t_start=self.t_start,
            t_end=self.t_end,
            y_max=self.y_max,
        )


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def trend(durations: list[float], low: float, high: float) -> str:
    """The last steps' durations as bars on the run's common scale ``[low, high]``."""
    span = high - low
    if span <= 0:
        return BARS[0] * len(durations)
    top = len(BARS) - 1
    return "".join(BARS[min(top, int((d - low) / span * top + 0.5))] for d in durations)


def recent_durations(job: JobModel) -> list[float]:
    return [p.duration for p in job.training.last_points(TREND_STEPS) if p.duration is not None]


def rank_row(
    job: JobModel,
    now: float | None,
    launcher: dict[int, int],
    scale: tuple[float, float] = (0.0, 0.0),
) -> tuple[str, ...]:
    """One rank's row of the table; ``scale`` is the step-time range its trend is drawn on
    (the same for every rank, so a slower rank's bars stand higher)."""
    hello = job.hello
    recent = job.training.recent(job.now)
    step = recent.mean_step_s
    backward = recent.backward_s / recent.time_s if recent.time_s > 0 else None
    memory = None
    for device in job.memory.values():
        memory = device.latest.allocated_bytes
        break
    if died(job, launcher):
        state = "dead"
    elif job.job_ended:
        state = "exited"
    else:
        state = "running"
    seen = "-" if now is None or job.now is None else f"{max(0.0, now - job.now):.0f}s"
    return (
        str(hello.rank if hello is not None and hello.rank is not None else "?"),
        str(hello.pid if hello is not None else "?"),
        state,
        str(job.training.total),
        "-" if step is None else f"{1000 * step:.1f}ms",
        "-" if recent.steps_per_s is None else f"{recent.steps_per_s:.1f}",
        _pct(recent.wait_fraction),
        _pct(backward),
        format_bytes(memory),
        seen,
        trend(recent_durations(job), *scale),
    )


class RunScreen(Screen[None]):
    """Every rank of one run, side by side, while the job runs. ``open_rank(run, pid)`` gives
    the source of the rank ``enter`` opens, and its title (:func:`attach_rank`)."""

    CSS_PATH = "run.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "stop", "quit"),
        Binding("enter", "open_rank", "open the rank"),
        Binding("c", "collectives", "collectives"),
        Binding("v", "swap_lanes", "lanes/chart"),
        Binding("pagedown", "page(1)", "more ranks", show=False),
        Binding("pageup", "page(-1)", "previous ranks", show=False),
        # Textual's own: ctrl+c says how to quit (the job screen's ctrl+c is off here).
        Binding("ctrl+c", "app.help_quit", show=False, system=True),
    ]

    def __init__(self, run: RunFold, title: str, *, open_rank: RankOpener) -> None:
        super().__init__()
        self.run_ = run
        self.sub_title = printable(title, one_line=True)  # a run's id: not ours
        self._open_rank = open_rank
        self._logged = 0
        self._drawn = -1
        #: The pid of the rank last opened (``None``: none yet).
        self.open_pid: int | None = None
        #: Looks at what arrived; paused while a rank's screen is over this one.
        self._refresh_timer: Timer | None = None
        #: Each rank's row as drawn, by stream; when the table was last drawn.
        self._rows: dict[str, tuple[str, ...]] = {}
        self._table_at = 0.0
        self._shown_findings: Text | None = None
        #: The table's columns: a node column first once ranks of several nodes are shown; none
        #: the source has no figure for.
        self._columns: tuple[str, ...] = tuple(c for c in COLUMNS if c not in run.not_carried)
        #: The rows' order as last sorted (by rank up to :data:`FOLD_AFTER` ranks, else by
        #: what needs a look) and the page line as drawn.
        self._order: list[str] = []
        self._page: Text | None = None
        self._strip = Text()
        #: Each rank's step count when the chart was last drawn.
        self._charted: tuple[int, ...] = ()
        #: The run model's evaluation the lanes were drawn from; whether the lanes take the
        #: chart's place on a short screen.
        self._laned: float | None = None
        self._lanes_first = False
        #: The garbage collector set for drawing, while the view runs (:mod:`.heap`).
        self._heap = SettledHeap()

    def compose(self) -> ComposeResult:
        yield Static("starting the launcher…", id="run-head")
        yield Static("", id="run-fold")
        yield DataTable[Text](id="ranks", cursor_type="row", zebra_stripes=True)
        yield Static("", id="run-findings")
        yield RankStepChart(id="run-chart")
        yield ArrivalLanes(id="run-lanes")
        yield RichLog(id="run-log", max_lines=2000, wrap=False)
        yield Footer()

    def on_mount(self) -> None:
        table: DataTable[Text] = self.query_one("#ranks", DataTable)
        for column in self._columns:
            table.add_column(column, key=column)
        if not self.run_.has_output:
            self.query_one("#run-log", RichLog).display = False
        if not self.run_.started:
            self.run_.start()
        self._refresh_timer = self.set_interval(REFRESH_S, self.refresh_run)
        self._heap.settle()

    def on_unmount(self) -> None:
        self._heap.release()

    def on_screen_suspend(self) -> None:
        """A rank's screen is over this one: the run waits (its rank's lines still reach it)."""
        if self._refresh_timer is not None:
            self._refresh_timer.pause()

    def on_screen_resume(self) -> None:
        """Back from a rank's screen: what arrived meanwhile is drawn at once."""
        if self._refresh_timer is not None:
            self._refresh_timer.resume()
            self.refresh_run()

    def refresh_run(self) -> None:
        run = self.run_
        run.drain()
        launcher = run.launcher
        logs = list(launcher.logs)
        new = launcher.log_total - self._logged
        if new > 0:
            # One write for the lines since the last look: each write measures, scrolls and
            # resizes the log (64 ranks print a hundred lines a second).
            lines = [log_line(entry.stream, entry.text) for entry in logs[-min(new, len(logs)) :]]
            self.query_one("#run-log", RichLog).write(Text("\n").join(lines))
            self._logged = launcher.log_total
        self._show_page()
        version = run.model.version + launcher.version + int(run.running())
        if version == self._drawn:
            return
        findings = self._findings()
        moment = time.monotonic()
        # The table once a second (its figures change at that pace), sooner if a rank
        # appeared or the findings changed; each cell only when its text changed. Once a
        # second is every fourth look: half a look's slack, or a look a hair early would put
        # it off to the fifth (1.25 s).
        if (
            len(run.model) == len(self._rows)
            and findings == self._shown_findings
            and moment - self._table_at < TABLE_S - REFRESH_S / 2
        ):
            return
        self._drawn = version
        self._table_at = moment
        jobs = run.model.jobs
        now = max((j.now for j in jobs.values() if j.now is not None), default=None)
        table: DataTable[Text] = self.query_one("#ranks", DataTable)
        exits = run.model.advisor.launcher_exits
        every = [d for job in jobs.values() for d in recent_durations(job)]
        scale = (min(every), max(every)) if every else (0.0, 0.0)
        added = False
        if len({run.node_of(stream) for stream in jobs}) > 1 and "node" not in self._columns:
            self._columns = ("node", *self._columns)
            table.clear(columns=True)
            for column in self._columns:
                table.add_column(column, key=column)
            self._rows = {}
        widths = {column: table.columns[ColumnKey(column)] for column in self._columns}
        for stream, job in jobs.items():
            row = rank_row(job, now, exits, scale)
            if run.is_lost(stream):
                row = (*row[:2], "lost", *row[3:])
            if run.not_carried:
                row = tuple(
                    v for c, v in zip(COLUMNS, row, strict=True) if c not in run.not_carried
                )
            if "node" in self._columns:
                row = (printable(run.node_of(stream), one_line=True), *row)
            old = self._rows.get(stream)
            # Plain text: a DataTable reads a string cell as markup, and a node's name, a
            # rank's exit reason are not ours.
            if old is None:
                table.add_row(*(Text(cell) for cell in row), key=stream)
                added = True
            else:
                for column, before, after in zip(self._columns, old, row, strict=True):
                    if before != after:
                        # A column widens for a wider figure (a row first drawn before its
                        # figures came) and never narrows: narrowing has the table measure
                        # every cell of the column again, for each cell (at 64 ranks, most
                        # of the view's time).
                        wider = cell_len(after) > widths[column].content_width
                        table.update_cell(stream, column, Text(after), update_width=wider)
            self._rows[stream] = row
        self._sort(table, added)
        if len(jobs) > FOLD_AFTER:
            fold = self.query_one("#run-fold", Static)
            width = fold.content_region.width if fold.display else self.size.width - 2
            self._strip = heat_strip(run, max(20, width))
            self._show_page(force=True)
        self.query_one("#run-head", Static).update(self._head(list(jobs.values())))
        if findings != self._shown_findings:
            self._shown_findings = findings
            self.query_one("#run-findings", Static).update(findings)
        # The chart only when steps arrived (at the table's pace).
        charted = tuple(job.training.total for job in jobs.values())
        if charted != self._charted:
            self._charted = charted
            chart = self.query_one(RankStepChart)
            shown = self._chart_ranks()
            chart.rows = self._chart_rows(len(shown))
            chart.whole_step = "bwd" in run.not_carried
            chart.of_ranks = len(jobs)
            chart.set_data(shown)
        self._draw_lanes()

    def _draw_lanes(self) -> None:
        """The ranks' arrivals at the collectives, when the run model joined them anew."""
        advisor = self.run_.model.advisor
        if advisor.last_eval == self._laned:
            return
        self._laned = advisor.last_eval
        joined = [item for one in advisor.joined.values() for item in one]
        lanes = self.query_one(ArrivalLanes)
        lanes.lanes = self._lane_rows()
        lanes.set_data(joined)
        self._place_lanes()

    def _place_lanes(self) -> None:
        """The lanes beside the chart where the screen is tall enough, else one of the two
        (``v`` swaps them); none before a collective was joined."""
        lanes, chart = self.query_one(ArrivalLanes), self.query_one(RankStepChart)
        both = self.size.height >= LANES_HEIGHT
        lanes.display = bool(lanes.joined) and (both or self._lanes_first)
        chart.display = both or not lanes.display

    def action_swap_lanes(self) -> None:
        """Where the chart and the lanes take turns: show the other."""
        self._lanes_first = not self._lanes_first
        self._place_lanes()
        if not self.query_one(ArrivalLanes).joined:
            self.app.notify("no collectives joined yet: no lanes to show", timeout=3)
        elif self.size.height < LANES_HEIGHT:
            shown = "lanes of arrivals" if self._lanes_first else "step time chart"
            self.app.notify(f"{shown} shown (v swaps)", timeout=3)

    def _lane_rows(self) -> int:
        """Lanes shown at most: :data:`LANES_SHARE` of the screen (one line each)."""
        return max(1, int(self.size.height * LANES_SHARE) - 1)

    def action_collectives(self) -> None:
        """The table of the run's collectives, over this view (its escape comes back)."""
        self.app.push_screen(CollectivesScreen(self.run_))

    def _sort(self, table: DataTable[Text], added: bool) -> None:
        """Rows by rank while they fit a screen; past :data:`FOLD_AFTER` ranks, by what needs
        a look (:func:`~.run_order.ordered`), re-sorted when that order changes."""
        jobs = self.run_.model.jobs
        if len(jobs) <= FOLD_AFTER:
            if added:
                table.sort(
                    "rank", key=lambda rank: int(rank.plain) if rank.plain.isdigit() else 1 << 30
                )
            return
        order = ordered(self.run_)
        if order == self._order and not added:
            return
        self._order = order
        # ``DataTable.sort`` hands each row's cells: each row is known by its cells as drawn.
        position = {self._rows[stream]: i for i, stream in enumerate(order) if stream in self._rows}
        table.sort(key=lambda row: position.get(tuple(cell.plain for cell in row), 1 << 30))

    def _show_page(self, *, force: bool = False) -> None:
        """The heat strip and the page line, once the table holds more than
        :data:`FOLD_AFTER` ranks (the page line follows the table's scrolling)."""
        table: DataTable[Text] = self.query_one("#ranks", DataTable)
        total = table.row_count
        if total <= FOLD_AFTER:
            return
        first = int(table.scroll_y) + 1
        # The region is the table's less its scrollbars already.
        rows = table.scrollable_content_region.height - table.header_height
        last = min(total, first + max(1, rows) - 1)
        page = page_line(first, last, total)
        if force or self._page is None or page.plain != self._page.plain:
            self._page = page
            fold = self.query_one("#run-fold", Static)
            fold.display = True
            both = Text("\n", no_wrap=True, overflow="crop").join([self._strip, page])
            both.no_wrap, both.overflow = True, "crop"
            fold.update(both)

    def action_page(self, pages: int) -> None:
        table: DataTable[Text] = self.query_one("#ranks", DataTable)
        if pages > 0:
            table.action_page_down()
        else:
            table.action_page_up()
        self._show_page()

    def _chart_ranks(self) -> list[JobModel]:
        """The ranks the chart has strips for: every rank while one line each fits its share
        of the screen, else the table's first ones."""
        jobs = self.run_.model.jobs
        room = max(1, int(self.size.height * CHART_SHARE) - 2)
        if len(jobs) <= room:
            return list(jobs.values())
        if len(jobs) > FOLD_AFTER:
            # What the other panels leave: the head, the strip and page lines, the table (at
            # most half the screen), the findings, the log's least, the footer, the chart's
            # border and axis.
            width = max(20, self.size.width - 2)
            findings = sum(-(-(9 + len(f.summary)) // width) for f in self.run_.findings)
            log = 2 if self.run_.has_output else 0
            table = min(len(jobs) + 1, int(self.size.height * 0.5))
            left = self.size.height - 3 - table - min(6, max(1, findings)) - log - 1 - 2
            room = max(1, min(room, left))
        order = self._order or list(jobs)
        return [jobs[stream] for stream in order[:room] if stream in jobs]

    def _chart_rows(self, ranks: int) -> int:
        """Lines per rank's strip: as many as :data:`CHART_SHARE` of the screen holds (the
        axis and the border take two), from one to :data:`CHART_MAX_ROWS`."""
        room = int(self.size.height * CHART_SHARE) - 2
        return max(1, min(CHART_MAX_ROWS, room // max(1, ranks)))

    def on_resize(self) -> None:
        self._place_lanes()
        self.query_one(ArrivalLanes).lanes = self._lane_rows()
        chart = self.query_one(RankStepChart)
        rows = self._chart_rows(len(self._chart_ranks()))
        if rows != chart.rows:
            chart.rows = rows
            chart.refresh(layout=True)

    def _head(self, jobs: list[JobModel]) -> Text:
        run = self.run_
        hello = next((j.hello for j in jobs if j.hello is not None), None)
        text = Text()
        world = hello.world_size if hello is not None else None
        text.append(f"{len(jobs)} rank{'s' if len(jobs) != 1 else ''}", "bold")
        if world is not None:
            text.append(f" of {world}")
        if hello is not None and hello.run_id:
            text.append(f" · run {hello.run_id}")
        line, going = run.status()
        text.append(f" · {line}", "green" if going else "yellow")
        text.append(f" · q {run.on_quit}", "dim")
        return text

    def _findings(self) -> Text:
        findings = self.run_.findings
        if not findings:
            return Text("no straggler, hang or dead rank", style="dim")
        text = Text()
        for i, finding in enumerate(findings):
            if i:
                text.append("\n")
            text.append(f"{finding.severity:<8} ", SEVERITY_STYLE.get(finding.severity, ""))
            text.append(finding.summary)
        return text

    def action_open_rank(self) -> None:
        table: DataTable[Text] = self.query_one("#ranks", DataTable)
        if table.row_count == 0:
            return
        stream = table.coordinate_to_cell_key(Coordinate(table.cursor_row, 0)).row_key.value
        elsewhere = self.run_.opens_elsewhere(stream or "")
        if elsewhere is not None:
            self.app.notify(elsewhere, timeout=8, markup=False)  # it names a node
            return
        pid = str(table.get_row_at(table.cursor_row)[self._columns.index("pid")])
        if not pid.isdigit():
            return
        self.open_pid = int(pid)
        opened = self._open_rank(self.run_, int(pid))
        if opened is not None:
            source, title = opened
            self.app.push_screen(JobScreen(source, title=title, opened_over=True))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_open_rank()

    def action_stop(self) -> None:
        if self.run_.running():
            self.run_.stop_job()
        self.app.exit(0)

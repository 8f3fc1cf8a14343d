"""The live view of a multi-rank job ``torchtop run`` launched (``torchtop run torchrun ...``).

One table of ranks (step, recent step time, steps/s, data wait, time in backward, memory, last
seen, state, and a trend: the last steps' times as bars on one scale for every rank; a node
column once ranks of more than one node are shown, ``torchtop attach --node``), the
run's findings (straggler, hang, dead ranks: :mod:`torchtop.model.ranks`)
and the job's output. It reads the :class:`~torchtop.model.run.RunModel` that
:class:`~torchtop.ranks.RunFold` folds, four times a second, and redraws only when something
arrived. ``enter`` on a rank's row opens that rank's full screens (the single-process viewer
attached to its agent; its ``q`` comes back here; a rank of another node says where to open it);
``q`` stops the job (the launcher stops its
ranks) and quits.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, ClassVar

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.coordinate import Coordinate
from textual.widgets import DataTable, Footer, RichLog, Static

from torchtop.model.ranks import died
from torchtop.sizes import format_bytes

if TYPE_CHECKING:
    from torchtop.model import JobModel
    from torchtop.ranks import RunFold

#: Seconds between two looks at what arrived, and the least between two redraws of the table.
REFRESH_S = 0.25
TABLE_S = 1.0
COLUMNS = ("rank", "pid", "state", "steps", "step", "/s", "wait", "bwd", "memory", "seen", "trend")
#: Steps the trend column shows, and its marks from shortest to longest.
TREND_STEPS = 12
BARS = "▁▂▃▄▅▆▇█"
SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


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


class RunView(App[int]):
    """Every rank of one run, side by side, while the job runs."""

    CSS_PATH = "run_view.tcss"
    TITLE = "torchtop"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "stop", "quit"),
        Binding("enter", "open_rank", "open the rank"),
    ]

    def __init__(self, run: RunFold, title: str) -> None:
        super().__init__()
        self.run_ = run
        self.sub_title = title
        self._logged = 0
        self._drawn = -1
        #: The pid of the rank to open once this view has closed (``None``: quit).
        self.open_pid: int | None = None
        #: Each rank's row as drawn, by stream; when the table was last drawn.
        self._rows: dict[str, tuple[str, ...]] = {}
        self._table_at = 0.0
        self._shown_findings: Text | None = None
        #: The table's columns: a node column first once ranks of several nodes are shown.
        self._columns: tuple[str, ...] = COLUMNS

    def compose(self) -> ComposeResult:
        yield Static("starting the launcher…", id="run-head")
        yield DataTable[str](id="ranks", cursor_type="row", zebra_stripes=True)
        yield Static("", id="run-findings")
        yield RichLog(id="run-log", max_lines=2000, wrap=False)
        yield Footer()

    def on_mount(self) -> None:
        table: DataTable[str] = self.query_one("#ranks", DataTable)
        for column in COLUMNS:
            table.add_column(column, key=column)
        if not self.run_.started:
            self.run_.start()
        self.set_interval(REFRESH_S, self.refresh_run)

    def refresh_run(self) -> None:
        run = self.run_
        run.drain()
        launcher = run.launcher
        logs = list(launcher.logs)
        new = launcher.log_total - self._logged
        if new > 0:
            log = self.query_one("#run-log", RichLog)
            for entry in logs[-min(new, len(logs)) :]:
                log.write(Text(entry.text, style="red" if entry.stream == "stderr" else ""))
            self._logged = launcher.log_total
        version = run.model.version + launcher.version + int(run.running())
        if version == self._drawn:
            return
        findings = self._findings()
        moment = time.monotonic()
        # The table at most once a second (its figures change at that pace), unless a rank
        # appeared or the findings changed; each cell only when its text changed.
        if (
            len(run.model) == len(self._rows)
            and findings == self._shown_findings
            and moment - self._table_at < TABLE_S
        ):
            return
        self._drawn = version
        self._table_at = moment
        jobs = run.model.jobs
        now = max((j.now for j in jobs.values() if j.now is not None), default=None)
        table: DataTable[str] = self.query_one("#ranks", DataTable)
        exits = run.model.ranks.launcher_exits
        every = [d for job in jobs.values() for d in recent_durations(job)]
        scale = (min(every), max(every)) if every else (0.0, 0.0)
        added = False
        if len({run.node_of(stream) for stream in jobs}) > 1 and "node" not in self._columns:
            self._columns = ("node", *COLUMNS)
            table.clear(columns=True)
            for column in self._columns:
                table.add_column(column, key=column)
            self._rows = {}
        for stream, job in jobs.items():
            row = rank_row(job, now, exits, scale)
            if run.is_lost(stream):
                row = (*row[:2], "lost", *row[3:])
            if "node" in self._columns:
                row = (run.node_of(stream), *row)
            old = self._rows.get(stream)
            if old is None:
                table.add_row(*row, key=stream)
                added = True
            else:
                for column, before, after in zip(self._columns, old, row, strict=True):
                    if before != after:
                        table.update_cell(stream, column, after)
            self._rows[stream] = row
        if added:
            table.sort("rank", key=lambda rank: int(rank) if rank.isdigit() else 1 << 30)
        self.query_one("#run-head", Static).update(self._head(list(jobs.values())))
        if findings != self._shown_findings:
            self._shown_findings = findings
            self.query_one("#run-findings", Static).update(findings)

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
        findings = self.run_.model.ranks.findings
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
        table: DataTable[str] = self.query_one("#ranks", DataTable)
        if table.row_count == 0:
            return
        stream = table.coordinate_to_cell_key(Coordinate(table.cursor_row, 0)).row_key.value
        elsewhere = self.run_.opens_elsewhere(stream or "")
        if elsewhere is not None:
            self.notify(elsewhere, timeout=8)
            return
        pid = table.get_row_at(table.cursor_row)[self._columns.index("pid")]
        if pid.isdigit():
            self.open_pid = int(pid)
            self.exit(0)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_open_rank()

    def action_stop(self) -> None:
        if self.run_.running():
            self.run_.stop_job()
        self.exit(0)

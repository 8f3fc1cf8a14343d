"""The OOM screen: what held the memory, whether it was full or fragmented, and what to try.

It opens by itself when an ``oom`` event arrives (``o`` opens it again, and a snapshot taken
with ``m`` shows here too). From the top:

- a banner: requested against free, reserved and allocated; the verdict; the line that failed;
  the snapshot file; and, with ``--pause-on-oom``, that the job is held (``esc`` resumes it);
- the live allocations grouped by the job's allocating line, with the highlighted site's stack
  beside them (``enter`` widens the stack to full paths);
- what to try, each suggestion with its evidence and the demo that shows it;
- the memory timeline up to the failure, marked.

The text of each part comes from a pure function below, tested without an app.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import DataTable, Footer, Static

from torchtop.model.captures import CaptureEntry
from torchtop.model.job import JobModel
from torchtop.model.oom_advice import Suggestion, verdict_text
from torchtop.protocol import AllocationSite, MemoryCapture, OutOfMemory, StackFrame
from torchtop.tui.format import MISSING, format_bytes, format_clock
from torchtop.tui.widgets.chart import ChartMark, ChartSeries, ChartSpan, TimeSeriesChart
from torchtop.tui.widgets.memory import (
    ALLOCATED_STYLE,
    RESERVED_STYLE,
    flow,
    split_cells,
    split_key,
)

#: Seconds of memory history the timeline shows before the failure (at most).
TIMELINE_S = 120.0
LIMIT_STYLE = "red"


def _where(frame: StackFrame | AllocationSite, full: bool = False) -> str:
    path = frame.file if full else frame.file.rsplit("/", 1)[-1]
    return f"{path}:{frame.line}"


#: Cells of the bar of what held the memory at the failure, at most.
HELD_BAR_CELLS = 32


def held_bar(capture: MemoryCapture, width: int = 80) -> list[Text]:
    """What held the allocated memory at the failure (the capture's split): a bar, one letter
    per cell as the memory panel's, then each category's name, bytes and share, over two
    lines at most of ``width`` cells; none when the split is not known."""
    # The job's own words: each category is shown by its letter, or made printable.
    split: dict[str, int] = {}
    for part in capture.by_category:
        split[part.category] = split.get(part.category, 0) + max(0, part.bytes)
    if sum(split.values()) <= 0:
        return []
    bar = Text(" held ", "dim")
    bar.append_text(split_cells(split, max(8, min(HELD_BAR_CELLS, width // 3))))
    return flow([bar, *split_key(split, names=True, shares=True)], width, 2)


def banner_text(
    entry: CaptureEntry, state: JobModel, now: float | None = None, width: int = 80
) -> Text:
    """The banner's lines: what failed, the figures, the verdict and what held the memory,
    where, the snapshot, the hold; fitted to ``width`` cells."""
    capture = entry.capture
    started = state.hello.started_at if state.hello is not None else None
    at = format_clock(capture.t - started) if started is not None else MISSING
    device = f"{capture.device} (emulated)" if capture.emulated else capture.device or "?"
    text = Text(no_wrap=False)
    if isinstance(capture, OutOfMemory):
        text.append(" OUT OF MEMORY ", "bold white on red")
    else:
        text.append(" MEMORY SNAPSHOT ", "bold black on cyan")
    text.append(f"  {device}  at {at}", "bold")
    if entry.phase:
        text.append(f" · phase {entry.phase}")
    if capture.grad_enabled is not None:
        text.append(" · autograd on" if capture.grad_enabled else " · autograd off", "dim")
    text.append("\n")
    if capture.requested_bytes is not None:
        text.append(" requested ", "dim")
        text.append(format_bytes(capture.requested_bytes), "bold red")
        text.append("  ")
    else:
        text.append(" ")
    text.append("free ", "dim")
    text.append(format_bytes(capture.free_bytes), "bold")
    if capture.total_bytes is not None:
        text.append(f" / {format_bytes(capture.total_bytes)}", "dim")
    if not capture.emulated:  # an emulated device reserves exactly what it allocates
        text.append("  reserved ", "dim")
        text.append(format_bytes(capture.reserved_bytes), RESERVED_STYLE)
    text.append("  allocated ", "dim")
    text.append(format_bytes(capture.allocated_bytes), ALLOCATED_STYLE)
    text.append("\n")
    held_lines = held_bar(capture, width)
    verdict = verdict_text(capture, held=not held_lines)
    style = {True: "bold yellow", False: "bold red"}.get(bool(capture.fragmented), "")
    text.append(f" {verdict}", style if capture.fragmented is not None else "dim")
    text.append("\n")
    for line in held_lines:
        text.append_text(line)
        text.append("\n")
    parts = 0
    if capture.requested_stack:
        failed = next(
            (f for f in capture.requested_stack if not _is_torch(f.file)),
            capture.requested_stack[0],
        )
        text.append(" failed at ", "dim")
        text.append(f"{failed.function} ({_where(failed)})", "bold")
        parts += 1
    if capture.snapshot_path:
        text.append(" · snapshot " if parts else " snapshot ", "dim")
        text.append(capture.snapshot_path)
    elif capture.snapshot_error:
        text.append(
            f" · {capture.snapshot_error}" if parts else f" {capture.snapshot_error}", "yellow"
        )
    held = state.captures.holding
    if held is not None and isinstance(held.capture, OutOfMemory):
        # The hold belongs to the job, whichever capture this screen shows (a snapshot taken
        # while the job is held shows it too).
        text.append("\n")
        where = "THIS FAILURE" if held is entry else f"OOM #{held.capture.id}"
        text.append(f" ⏸ THE JOB IS HELD AT {where} ", "bold black on yellow")
        timeout = held.capture.pause_timeout_s
        if timeout is not None:
            left = held.capture.t + timeout - (now if now is not None else time.time())
            text.append(f"  esc resumes it (by itself in {format_clock(max(0.0, left))})", "bold")
    elif entry.resumed is not None:
        why = "dismissed" if entry.resumed == "dismissed" else "after its timeout"
        text.append(f"\n the job went on ({why}); its OutOfMemoryError unwinds", "dim")
    return text


def _is_torch(path: str) -> bool:
    return "/torch/" in path or "/torchtop/" in path


def site_rows(capture: MemoryCapture) -> list[tuple[str, str, str]]:
    """One row per site: bytes, count, and the site (``function file:line``)."""
    return [
        (format_bytes(site.bytes), str(site.count), f"{site.function} {_where(site)}")
        for site in capture.top_sites
    ]


def _share(capture: MemoryCapture, site: AllocationSite) -> str:
    whole = capture.allocated_bytes or sum(s.bytes for s in capture.top_sites)
    return f"{site.bytes / whole:.0%}" if whole else MISSING


def stack_text(site: AllocationSite | None, *, share: str = "", full: bool = False) -> Text:
    """A site's stack, innermost first, the site's own frame marked: each frame's function,
    then its file and line beneath (full paths when ``full``)."""
    text = Text()
    if site is None:
        text.append("no site: nothing was live, or no stack was recorded", "dim")
        return text
    text.append(format_bytes(site.bytes), "bold")
    text.append(f" · {site.count} live" + (f" · {share}" if share else "") + "\n", "dim")
    if not site.stack:
        text.append("no Python stack recorded", "dim")
    for frame in site.stack:
        own = frame.file == site.file and frame.line == site.line
        text.append("→ " if own else "  ", "bold cyan")
        text.append(frame.function + "\n", "bold" if own else "")
        text.append(f"    {_where(frame, full)}\n", "" if own else "dim")
    return text


def advice_text(suggestions: Sequence[Suggestion]) -> Table | Text:
    """Each suggestion: what to do, the evidence, how, and the demo that shows it, in a grid so
    that wrapped lines stay under their number."""
    if not suggestions:
        return Text("Nothing failed here: see the allocation sites above.", "dim")
    grid = Table.grid(padding=(0, 1, 0, 0))
    grid.add_column(no_wrap=True, style="bold")
    grid.add_column()
    for i, suggestion in enumerate(suggestions):
        body = Text()
        body.append(f"{suggestion.title}\n", "bold")
        body.append(f"{suggestion.evidence}\n")
        body.append(suggestion.how, "dim")
        body.append(f"  ▶ {suggestion.demo_command}", "bold green")
        grid.add_row(f"{i + 1}.", body)
    return grid


def timeline(
    state: JobModel, capture: MemoryCapture
) -> tuple[list[ChartSeries], list[ChartSpan], list[ChartMark], float, float]:
    """The capture's device memory up to the capture, marked, with the phases beneath."""
    end = capture.t
    memory = state.memory.get(capture.device)
    first = memory.series[0].t if memory is not None and memory.series else end - 10.0
    start = max(first, end - TIMELINE_S)
    start = min(start, end - 5.0)
    span = end - start
    end += span * 0.03  # a little room after the mark, so it is not on the edge
    series: list[ChartSeries] = []
    if memory is not None:
        points = [p for p in memory.series if start <= p.t <= end]
        series = [
            ChartSeries(
                memory.allocated_label,
                [(p.t, p.allocated) for p in points],
                ALLOCATED_STYLE,
                fill=True,
            ),
            ChartSeries(memory.reserved_label, [(p.t, p.reserved) for p in points], RESERVED_STYLE),
        ]
        if capture.emulated and capture.total_bytes is not None:
            # The emulated device's limit, not the process RSS, is what allocated ran into.
            limit = float(capture.total_bytes)
            series[1] = ChartSeries("limit", [(start, limit), (end, limit)], LIMIT_STYLE)
    spans = [ChartSpan(p.name, p.start, p.end) for p in state.phases_between(start, end)]
    label = "OOM" if isinstance(capture, OutOfMemory) else "snapshot"
    return series, spans, [ChartMark(capture.t, label)], start, end


class OomScreen(Screen[None]):
    """One capture, explained. ``on_close(entry)`` runs when the user closes the screen (the app
    then resumes a job held at a failure); ``on_resume(held)`` on ``r``."""

    CSS_PATH = "oom.tcss"
    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("o", "close", "Close", show=False),
        Binding("enter", "toggle_stack", "Wide stack"),
        Binding("r", "resume", "Resume the job"),
    ]

    def __init__(
        self,
        entry: CaptureEntry,
        state: JobModel,
        *,
        on_close: Callable[[CaptureEntry], None] | None = None,
        on_resume: Callable[[CaptureEntry], None] | None = None,
    ) -> None:
        super().__init__()
        self.entry = entry
        self.state = state
        self._on_close = on_close
        self._on_resume = on_resume
        self._wide = False
        self._ticker: Timer | None = None
        self.suggestions: list[Suggestion] = []

    def compose(self) -> ComposeResult:
        yield Static(id="oom-banner")
        with Horizontal(id="oom-middle"):
            table: DataTable[Text] = DataTable(
                id="oom-sites", cursor_type="row", zebra_stripes=True
            )
            table.border_title = " Live allocations by site "
            yield table
            with VerticalScroll(id="oom-stack-pane") as pane:
                pane.border_title = " Stack "
                yield Static(id="oom-stack")
        with VerticalScroll(id="oom-advice-pane") as advice:
            advice.border_title = " What to try "
            yield Static(id="oom-advice")
        chart = TimeSeriesChart(id="oom-timeline")
        chart.border_title = " Memory up to it (◆) "
        yield chart
        yield Footer(show_command_palette=False)  # ctrl+p is in the help

    def on_mount(self) -> None:
        table = self.query_one("#oom-sites", DataTable)
        table.add_columns("bytes", "count", "site")
        self.show_entry(self.entry)
        self._ticker = self.set_interval(1.0, self._tick)

    # -- showing -------------------------------------------------------------------------------

    def show_entry(self, entry: CaptureEntry) -> None:
        """Show ``entry`` (a newer capture replaces the one shown)."""
        changed = entry is not self.entry
        self.entry = entry
        capture = entry.capture
        if changed or not self.query_one("#oom-sites", DataTable).row_count:
            table = self.query_one("#oom-sites", DataTable)
            table.clear()
            for i, row in enumerate(site_rows(capture)):
                # Plain text: a DataTable reads a string cell as markup, and a site is the job's.
                table.add_row(*(Text(cell) for cell in row), key=str(i))
            table.border_subtitle = (
                f" {len(capture.top_sites)} sites · {capture.live_count} live "
                if capture.live_count is not None
                else ""
            )
            self._show_stack(0)
        self.refresh_from(self.state)

    def refresh_from(self, state: JobModel) -> None:
        """Redraw what depends on the rest of the state: the banner, advice and timeline."""
        self.state = state
        capture = self.entry.capture
        self._show_banner()
        self.suggestions = self.entry.suggestions
        self.query_one("#oom-advice", Static).update(advice_text(self.suggestions))
        series, spans, marks, start, end = timeline(state, capture)
        self.query_one(TimeSeriesChart).set_data(
            series, t_start=start, t_end=end, spans=spans, marks=marks
        )
        self.refresh_bindings()  # ``r`` only while the job is held

    def _show_banner(self) -> None:
        banner = self.query_one("#oom-banner", Static)
        width = banner.content_region.width or self.app.size.width
        banner.update(banner_text(self.entry, self.state, width=width))

    def _show_stack(self, row: int) -> None:
        capture = self.entry.capture
        sites = capture.top_sites
        site = sites[row] if 0 <= row < len(sites) else None
        share = _share(capture, site) if site is not None else ""
        self.query_one("#oom-stack", Static).update(stack_text(site, share=share, full=self._wide))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_stack(event.cursor_row)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        """``enter`` on a site (the table takes the key itself): widen its stack."""
        self.action_toggle_stack()

    def _tick(self) -> None:
        if self.state.captures.holding is not None:
            self._show_banner()

    # -- actions -------------------------------------------------------------------------------

    def action_toggle_stack(self) -> None:
        self._wide = not self._wide
        self.query_one("#oom-middle").set_class(self._wide, "-wide")
        self._show_stack(self.query_one("#oom-sites", DataTable).cursor_row)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """``r`` shows only while the job is held at this failure."""
        if action == "resume":
            return self.state.captures.holding is not None
        return True

    def action_resume(self) -> None:
        held = self.state.captures.holding
        if held is not None and self._on_resume is not None:
            self._on_resume(held)

    def action_close(self) -> None:
        if self._on_close is not None:
            self._on_close(self.entry)
        self.dismiss(None)

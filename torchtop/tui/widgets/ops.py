"""The ops panel: where the time went, op by op, in the agent's sampled profiler windows.

The agent takes a short torch.profiler window now and then (``ops`` messages) and sends two
tables: the last window's and the running totals over every window. The panel shows one of them
(``w`` switches) as a table of ops with their calls, total and self time, the average per call,
the share of the profiled time they took and, when the job ran kernels, the device self time::

    window 12 · 4 s ago · 1.23 s · 5 steps · cost 45 ms · next in ~25 s
    sync points 3.0/step · copies 2.0/step
    trace /tmp/torchtop-4242/ops-12.json
     op                    calls     total      self       avg      %  dev self
     aten::mm                120   41.0 ms   40.2 ms    342 µs  3.3%   310 ms

Sorted by self time (``k`` cycles self time, calls, average; ``1`` ``2`` ``3`` pick one), filtered
by a name substring (``/``). The sorting and filtering are pure functions, tested on their own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Literal, NamedTuple

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.events import Resize
from textual.widgets import DataTable, Input, Static

from torchtop.model.job import JobModel
from torchtop.model.ops import op_avg_s
from torchtop.model.ops import per_step as count_per_step
from torchtop.protocol import OpStat, OpsWindow
from torchtop.tui.format import MISSING, format_duration, format_seconds, format_share
from torchtop.tui.widgets.quiet import set_titles, update_if_changed

SortKey = Literal["self", "calls", "avg"]
#: The orders ``k`` cycles through, the first the default.
SORT_KEYS: tuple[SortKey, ...] = ("self", "calls", "avg")
SORT_LABELS: dict[SortKey, str] = {"self": "self time", "calls": "calls", "avg": "average"}
#: The table's figure columns and their widths in cells (without the cell padding).
FIGURE_COLUMNS: tuple[tuple[str, int], ...] = (
    ("calls", 7),
    ("total", 8),
    ("self", 8),
    ("avg", 8),
    ("%", 5),
)
DEVICE_COLUMN = ("dev self", 8)
#: The narrowest the op name column gets, however narrow the panel.
MIN_NAME_WIDTH = 16
#: Cells a DataTable puts around each cell, and its vertical scrollbar.
_CELL_PADDING = 2
_SCROLLBAR = 1
OTHER_LABEL = "(other ops)"
UNAVAILABLE_STYLE = "yellow"


# -- pure helpers ---------------------------------------------------------------------------------


def op_label(op: OpStat) -> str:
    """The op's name, with its input shapes and call site when the agent split by them."""
    label = op.name
    if op.shapes:
        label += f" {op.shapes}"
    if op.site:
        label += f" @ {op.site}"
    return label


def sort_ops(ops: Iterable[OpStat], key: SortKey = "self") -> list[OpStat]:
    """Largest first by ``key``: self time, calls or average time per call. Ties go by self
    time, then by name, so the order is stable from one window to the next."""
    if key == "calls":
        return sorted(ops, key=lambda op: (-op.calls, -op.self_cpu_s, op_label(op)))
    if key == "avg":
        return sorted(ops, key=lambda op: (-op_avg_s(op), -op.self_cpu_s, op_label(op)))
    return sorted(ops, key=lambda op: (-op.self_cpu_s, op_label(op)))


def filter_ops(ops: Iterable[OpStat], text: str) -> list[OpStat]:
    """The ops whose label (name, shapes, site) contains ``text``, ignoring case; all of them
    for an empty ``text``."""
    needle = text.strip().casefold()
    if not needle:
        return list(ops)
    return [op for op in ops if needle in op_label(op).casefold()]


def next_sort(key: SortKey) -> SortKey:
    """The order after ``key`` in :data:`SORT_KEYS`, wrapping round."""
    return SORT_KEYS[(SORT_KEYS.index(key) + 1) % len(SORT_KEYS)]


def per_step(count: int, steps: int | None) -> str:
    """``count`` per step in one decimal; :data:`MISSING` without steps to divide by."""
    value = count_per_step(count, steps)
    return MISSING if value is None else f"{value:.1f}"


def shows_device(window: OpsWindow, cumulative: bool) -> bool:
    """Whether the table gets a device self-time column: the window ran kernels (or, for the
    cumulative table, some window did)."""
    if not cumulative and window.device:
        return True
    ops = window.cumulative if cumulative else window.ops
    return any(op.self_device_s is not None for op in ops)


def elide_start(text: str, width: int) -> str:
    """``text`` in at most ``width`` cells, cut at the start: a path keeps its file name."""
    if width <= 0 or len(text) <= width:
        return text
    if width == 1:
        return "…"
    return "…" + text[-(width - 1) :]


def elide_end(text: str, width: int) -> str:
    """``text`` in at most ``width`` cells, cut at the end."""
    if width <= 0 or len(text) <= width:
        return text
    return text[: max(0, width - 1)] + "…"


class OpRow(NamedTuple):
    """One row of the table as shown; ``device_self`` is ``None`` without a device column."""

    name: str
    calls: str
    total: str
    self_time: str
    avg: str
    share: str
    device_self: str | None = None


def op_rows(
    window: OpsWindow,
    *,
    cumulative: bool = False,
    sort: SortKey = "self",
    text: str = "",
) -> list[OpRow]:
    """The table's rows: the window's (or the cumulative) ops, filtered and sorted, then a row
    for the self time of the ops past the agent's limit when there is no filter."""
    ops = window.cumulative if cumulative else window.ops
    whole = window.total_duration_s if cumulative else window.duration_s
    device = shows_device(window, cumulative)
    rows = [
        OpRow(
            op_label(op),
            f"{op.calls:,}",
            format_seconds(op.total_cpu_s),
            format_seconds(op.self_cpu_s),
            format_seconds(op_avg_s(op)),
            format_share(op.self_cpu_s, whole),
            format_seconds(op.self_device_s) if device else None,
        )
        for op in sort_ops(filter_ops(ops, text), sort)
    ]
    other = window.cumulative_other_self_cpu_s if cumulative else window.other_self_cpu_s
    if other > 0 and not text.strip():
        rows.append(
            OpRow(
                OTHER_LABEL,
                MISSING,
                MISSING,
                format_seconds(other),
                MISSING,
                format_share(other, whole),
                MISSING if device else None,
            )
        )
    return rows


def _ago(state: JobModel, t: float) -> str:
    if state.now is None:
        return ""
    return f"{format_duration(max(0.0, state.now - t))} ago"


def ops_summary(state: JobModel, *, cumulative: bool = False, width: int = 0) -> Text:
    """The lines above the table: which window (or all of them), what it cost, when the next
    comes, host-device syncs and copies per step and the trace file; or why there is none."""
    window = state.ops
    lines: list[Text] = []
    unavailable = state.ops_unavailable
    if unavailable is not None:
        reason = unavailable
        if not reason.startswith(("op timings", "op sampling")):
            reason = f"op timings unavailable: {reason}"
        lines.append(Text(reason, UNAVAILABLE_STYLE))
    if window is None:
        if unavailable is None:
            if state.mode == "replay":
                lines.append(Text("no op window in the recording so far", "dim"))
            elif state.job_ended or state.lost:
                lines.append(
                    Text(
                        "no op window was taken: the first comes after a few steps, "
                        "or after 5 s for a job without steps",
                        "dim",
                    )
                )
            else:
                lines.append(
                    Text(
                        "no op window yet — the first comes after a few steps; "
                        "press p to take one now",
                        "dim",
                    )
                )
        return Text("\n", no_wrap=True, overflow="ellipsis").join(lines)

    head = Text()
    if cumulative:
        head.append("all ", "dim")
        head.append(f"{window.window}", "bold")
        head.append(" windows" if window.window != 1 else " window", "dim")
        head.append(" · ", "dim")
        head.append(format_seconds(window.total_duration_s), "bold")
        head.append(" profiled · ", "dim")
        head.append(f"{window.total_steps:,}", "bold")
        head.append(" steps" if window.total_steps != 1 else " step", "dim")
        syncs = per_step(window.total_sync_points, window.total_steps)
        copies = per_step(window.total_copies, window.total_steps)
        reads = per_step(window.total_host_reads, window.total_steps)
    else:
        head.append("window ", "dim")
        head.append(f"{window.window}", "bold")
        ago = _ago(state, window.t)
        if ago:
            head.append(f" · {ago}", "dim")
        head.append(" · ", "dim")
        head.append(format_seconds(window.duration_s), "bold")
        if window.steps is not None:
            head.append(" · ", "dim")
            head.append(f"{window.steps:,}", "bold")
            head.append(" steps" if window.steps != 1 else " step", "dim")
        head.append(" · cost ", "dim")
        head.append(format_seconds(window.cost_s))
        if window.requested:
            head.append(" · on request", "dim")
        phase = state.phase_at(window.began)
        if phase is not None:
            head.append(" · in ", "dim")
            head.append(phase, "bold")
        syncs = per_step(window.sync_points, window.steps)
        copies = per_step(window.copies, window.steps)
        reads = per_step(window.host_reads, window.steps)
    if unavailable is None and not (state.job_ended or state.lost):
        head.append(" · next in ", "dim")
        due = window.spacing_s
        if state.now is not None:
            due -= max(0.0, state.now - window.t)
        # Whole seconds below a minute: a figure that changes at every frame reads as noise.
        soon = f"~{math.ceil(due)} s" if due < 60 else f"~{format_duration(due)}"
        head.append(soon if due > 0 else "due now")
    lines.append(head)

    figures = Text()
    if window.device:
        figures.append("sync points ", "dim")
        figures.append(syncs, "bold")
        figures.append("/step", "dim")
        figures.append(" · copies ", "dim")
        figures.append(copies, "bold")
        figures.append("/step", "dim")
    else:  # no device activity recorded: no device to wait for, nothing to copy to or from
        figures.append("sync points n/a · CPU only: no host-device copies", "dim")
    figures.append(" · host reads ", "dim")
    figures.append(reads, "bold")
    figures.append("/step", "dim")
    if window.record_shapes:
        figures.append(" · by shapes", "dim")
    if window.with_stack:
        figures.append(" · by call site", "dim")
    lines.append(figures)

    if window.trace_path:
        trace = Text("trace ", "dim")
        trace.append(elide_start(window.trace_path, width - len("trace ") if width else 0))
        lines.append(trace)
    return Text("\n", no_wrap=True, overflow="ellipsis").join(lines)


def name_width(panel_width: int, device: bool) -> int:
    """The op name column's width: what the figure columns leave of ``panel_width``."""
    figures = [*FIGURE_COLUMNS, DEVICE_COLUMN] if device else list(FIGURE_COLUMNS)
    used = sum(width + _CELL_PADDING for _, width in figures) + _CELL_PADDING + _SCROLLBAR
    return max(MIN_NAME_WIDTH, panel_width - used)


# -- the widget -----------------------------------------------------------------------------------


class OpsFilter(Input):
    """The name filter. ``enter`` keeps it, ``escape`` clears it; either goes back to the table."""

    BINDINGS = [
        Binding("escape", "leave(True)", "Clear filter", show=False),
    ]

    def action_leave(self, clear: bool = False) -> None:
        if clear:
            self.value = ""
        self.post_message(self.Submitted(self, self.value))


class OpsPanel(Vertical):
    """The last op window's (or every window's) ops as a sortable, filterable table.

    The app feeds it with :meth:`show_state`; the keys that sort, filter and switch tables are
    the panel's own, active while the focus is in it.
    """

    DEFAULT_CSS = """
    OpsPanel {
        height: 1fr;
    }
    OpsPanel > #ops-summary {
        height: auto;
        max-height: 4;
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    OpsPanel > #ops-table {
        height: 1fr;
        scrollbar-size-vertical: 1;
        overflow-x: hidden;
    }
    OpsPanel > #ops-filter {
        display: none;
        height: 1;
        border: none;
        padding: 0 1;
    }
    OpsPanel > #ops-filter.-shown {
        display: block;
    }
    """

    # The tooltips are the help's and the command palette's lines (tui/commands.py).
    BINDINGS = [
        Binding("k", "cycle_sort", "Sort", tooltip="ops: the next sort order (k cycles)"),
        Binding("1", "sort('self')", "By self time", show=False, tooltip="ops: sort by self time"),
        Binding("2", "sort('calls')", "By calls", show=False, tooltip="ops: sort by calls"),
        Binding("3", "sort('avg')", "By average", show=False, tooltip="ops: sort by average"),
        Binding(
            "slash",
            "filter",
            "Filter",
            key_display="/",
            tooltip="ops: filter by name (enter keeps it, esc clears it)",
        ),
        # Shown in the title rather than the footer, which has no room left at 80 columns.
        Binding(
            "w",
            "toggle_view",
            "Window/all",
            show=False,
            tooltip="ops: the last window, or all windows so far",
        ),
    ]

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.sort: SortKey = "self"
        self.cumulative = False
        self.filter_text = ""
        self.state: JobModel | None = None
        #: What the table was last built from; it is rebuilt only when this changes.
        self._shown_table: tuple[object, ...] | None = None
        self.rows: list[OpRow] = []

    def compose(self) -> ComposeResult:
        yield Static(id="ops-summary")
        yield DataTable[str | Text](id="ops-table", cursor_type="row", zebra_stripes=True)
        yield OpsFilter(placeholder="filter ops by name (enter keeps, esc clears)", id="ops-filter")

    # -- showing ----------------------------------------------------------------------------------

    def show_state(self, state: JobModel) -> None:
        """Redraw from ``state``: the summary each time, the table only when its data changed."""
        self.state = state
        width = self.content_region.width
        update_if_changed(
            self.query_one("#ops-summary", Static),
            ops_summary(state, cumulative=self.cumulative, width=width),
        )
        self._show_table(state, width)
        set_titles(self, self._title())

    def _title(self) -> Text:
        """Which table, its order, the filter and how many ops pass it; ``w``'s other table
        (plain text: the filter is the user's typing)."""
        view, other = ("all windows", "last window") if self.cumulative else ("last window", "all")
        title = f" Ops · {view} · by {SORT_LABELS[self.sort]} "
        window = self.state.ops if self.state is not None else None
        if self.filter_text.strip() and window is not None:
            total = len(window.cumulative if self.cumulative else window.ops)
            shown = sum(1 for row in self.rows if row.name != OTHER_LABEL)
            title += f"· “{self.filter_text.strip()}” {shown}/{total} "
        return Text(title + f"· w: {other} ")

    def _show_table(self, state: JobModel, width: int) -> None:
        window = state.ops
        key = (window, self.cumulative, self.sort, self.filter_text, width)
        if key == self._shown_table:
            return
        self._shown_table = key
        table: DataTable[str | Text] = self.query_one("#ops-table", DataTable)
        cursor = table.cursor_row
        table.clear(columns=True)
        if window is None:
            self.rows = []
            table.display = False
            return
        table.display = True
        device = shows_device(window, self.cumulative)
        names = name_width(width or 80, device)
        table.add_column(Text("op"), width=names, key="op")
        for label, cells in [*FIGURE_COLUMNS, DEVICE_COLUMN] if device else FIGURE_COLUMNS:
            table.add_column(Text(label, justify="right"), width=cells, key=label)
        self.rows = op_rows(
            window, cumulative=self.cumulative, sort=self.sort, text=self.filter_text
        )
        for row in self.rows:
            table.add_row(*self._cells(row, names))
        if self.rows:
            table.move_cursor(row=min(cursor, len(self.rows) - 1), animate=False)

    @staticmethod
    def _cells(row: OpRow, names: int) -> Sequence[str | Text]:
        style = "dim" if row.name == OTHER_LABEL else ""
        figures = [row.calls, row.total, row.self_time, row.avg, row.share]
        if row.device_self is not None:
            figures.append(row.device_self)
        return [
            Text(elide_end(row.name, names), style),
            *(Text(value, style, justify="right") for value in figures),
        ]

    def _redraw(self) -> None:
        if self.state is not None:
            self.show_state(self.state)

    def on_resize(self, event: Resize) -> None:
        self._redraw()

    def focus_table(self) -> None:
        """Put the focus on the table, so the panel's keys apply."""
        self.query_one("#ops-table", DataTable).focus()

    # -- keys -------------------------------------------------------------------------------------

    @on(DataTable.HeaderSelected)
    def _sort_by_header(self, event: DataTable.HeaderSelected) -> None:
        """A click on the calls, self or avg heading sorts by it."""
        self.action_sort(str(event.column_key.value))

    def action_cycle_sort(self) -> None:
        self.sort = next_sort(self.sort)
        self._redraw()

    def action_sort(self, key: str) -> None:
        for known in SORT_KEYS:
            if known == key:
                self.sort = known
                self._redraw()

    def action_toggle_view(self) -> None:
        self.cumulative = not self.cumulative
        self._redraw()

    def action_filter(self) -> None:
        field = self.query_one(OpsFilter)
        field.add_class("-shown")
        field.focus()

    @on(Input.Changed, "#ops-filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value
        self._redraw()

    @on(Input.Submitted, "#ops-filter")
    def _filter_done(self, event: Input.Submitted) -> None:
        event.stop()
        self.filter_text = event.value
        field = self.query_one(OpsFilter)
        field.set_class(bool(event.value.strip()), "-shown")
        self.focus_table()
        self._redraw()

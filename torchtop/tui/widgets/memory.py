"""The memory panel: the primary device's figures and its memory chart with phases."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.events import Resize
from textual.widgets import Static

from torchtop.model.job import JobModel
from torchtop.model.memory import UNSPLIT, DeviceMemory
from torchtop.text import printable
from torchtop.tui.format import MISSING, format_bytes, format_used_total
from torchtop.tui.widgets.chart import ChartMark, ChartSeries, ChartSpan, TimeSeriesChart
from torchtop.tui.widgets.quiet import set_titles, update_if_changed

#: How much of the past the live chart shows; an ended job's chart shows all it kept.
LIVE_WINDOW_S = 120.0
#: The shortest window, so the first few samples do not each fill the width.
MIN_WINDOW_S = 10.0
#: The minus sign, for "RSS - heap".
MINUS = "\u2212"
ALLOCATED_STYLE = "cyan"
RESERVED_STYLE = "magenta"


#: Shorter names for the figures' labels, for a narrow panel.
_SHORT = {"allocated": "alloc", "reserved": "resv"}
#: How a line's figures are set apart at full width, and when the line is tight.
WIDE = "   "
TIGHT = "  "


@dataclass(frozen=True)
class Figure:
    """One figure of the panel's lines, and a shorter way to write it when the line is tight."""

    full: Text
    short: Text | None = None


def _figure(label: str, value: str, *, short_label: str | None = None, style: str = "") -> Figure:
    full = Text.assemble((f"{label} ", "dim"), (value, style))
    if short_label is None:
        return Figure(full)
    return Figure(full, Text.assemble((f"{short_label} ", "dim"), (value, style)))


def _square(style: str, label: str, value: str) -> Figure:
    """A figure behind its colour square, the chart's legend."""
    full = Text.assemble(("■ ", style), (f"{label} ", "dim"), (value, "bold"))
    short_label = _SHORT.get(label)
    if short_label is None:
        return Figure(full)
    return Figure(full, Text.assemble(("■ ", style), (f"{short_label} ", "dim"), (value, "bold")))


def fit_lines(lines: list[tuple[list[Figure], str]], width: int | None) -> Text:
    """The figures as written on their lines (each with its separator) when they fit ``width``
    (or no width is known); else written short and flowed over as many lines, in order,
    leaving out what does not fit rather than cutting a figure in the middle."""
    wide = [Text(sep).join(f.full for f in figures) for figures, sep in lines]
    if width is None or width <= 0 or all(line.cell_len <= width for line in wide):
        return Text("\n", no_wrap=True, overflow="ellipsis").join(wide)
    out: list[Text] = [Text()]
    for figure in (f for figures, _ in lines for f in figures):
        part = figure.short or figure.full
        current = out[-1]
        if not current.plain:
            if part.cell_len <= width:
                current.append_text(part)
        elif current.cell_len + len(TIGHT) + part.cell_len <= width:
            current.append(TIGHT)
            current.append_text(part)
        elif len(out) < len(lines) and part.cell_len <= width:
            out.append(part.copy())
    return Text("\n", no_wrap=True, overflow="ellipsis").join(out)


def figures_key(state: JobModel) -> tuple[object, ...] | None:
    """What the figures show of the primary device's memory, as written (a byte count to its
    shown digits, a count whole): two states with the same key show the same figures."""
    memory = state.primary_memory
    if memory is None:
        return None
    stats = memory.latest
    return (
        stats.source,
        memory.allocated_label,
        memory.reserved_label,
        *(
            format_bytes(value) if name.endswith("_bytes") else value
            for name, value in stats.__dict__.items()
            if name not in ("device", "source")
        ),
        format_bytes(memory.peak_allocated),
        format_bytes(memory.peak_reserved),
        format_bytes(memory.cache),
        format_bytes(memory.fragmented),
    )


def memory_figures(state: JobModel, width: int | None = None) -> Text:
    """Two lines of figures for the primary device, fitted to ``width`` cells when given; its
    colour squares are the chart's legend."""
    memory = state.primary_memory
    device = state.primary_device
    if memory is None:
        waiting = "waiting for the first sample…" if not state.lost else "no memory samples"
        return Text.assemble((device, "bold"), "  ", (waiting, "dim"))
    stats = memory.latest
    allocated = memory.allocated_label
    first = [_square(ALLOCATED_STYLE, allocated, format_bytes(stats.allocated_bytes))]
    if memory.reserved_label != allocated:  # RSS alone (the heap unread) is one figure
        first.append(
            _square(RESERVED_STYLE, memory.reserved_label, format_bytes(stats.reserved_bytes))
        )
    peak = format_bytes(memory.peak_allocated)
    if memory.is_cuda:
        reserved_peak = format_bytes(memory.peak_reserved)
        full = Text.assemble(("peak ", "dim"), peak, (" / ", "dim"), reserved_peak)
        first.append(Figure(full, Text.assemble(("peak ", "dim"), peak)))
    else:
        first.append(_figure(f"peak {allocated}", peak, short_label="peak"))
    figures = fit_lines([(first, WIDE), _second_line(state, memory)], width)
    held = holders_line(memory, width or 80)
    if held is not None:
        figures.append("\n")
        figures.append_text(held)
    return figures


#: The split's categories: key letter, label and colour, in the order of the bar. The letter
#: makes the bar read without colour; "·" is allocated memory whose holders are not read yet.
HOLDER_STYLES = {
    "parameters": ("P", "params", "blue"),
    "gradients": ("G", "grads", "magenta"),
    "optimizer_state": ("O", "optim", "yellow"),
    "other_allocated": ("A", "other", "cyan"),
    "cache": ("C", "cache", "bright_black"),
    "fragmentation": ("F", "frag", "red"),
    UNSPLIT: ("·", "not split", "dim"),
}


def holder_style(category: str) -> tuple[str, str, str]:
    """A category's letter, label and colour; one the viewer does not know (a newer agent's,
    or any text a job sent) as ``?`` and its name made printable."""
    known = HOLDER_STYLES.get(category)
    if known is not None:
        return known
    return "?", printable(category, one_line=True)[:16], ""


def stack_cells(split: Mapping[str, int], rows: int, top: float) -> list[str]:
    """A stacked bar's cells from its base, each the category it shows: as many as its total
    takes on a scale of ``top`` bytes over ``rows`` cells; each category held gets one cell at
    least (a few MiB of parameters beside GiB of activations still show), the rest go by share
    (largest remainders). Blank cells beyond the total are not in the list."""
    if top <= 0 or rows <= 0:
        return []
    unit = top / rows
    held = [(category, value / unit) for category, value in split.items() if value > 0]
    if len(held) > rows:  # more categories than cells: the largest ones
        kept = sorted(held, key=lambda item: -item[1])[:rows]
        held = [item for item in held if item in kept]
    height = min(rows, max(len(held), round(sum(e for _, e in held))))
    spare = height - len(held)
    # One cell each, then the spare cells by what each holds beyond its first cell.
    beyond = [max(0.0, e - 1) for _, e in held]
    whole = sum(beyond)
    quotas = [b * spare / whole if whole > 0 else 0.0 for b in beyond]
    counts = [1 + int(q) for q in quotas]
    order = sorted(range(len(held)), key=lambda i: -(quotas[i] - int(quotas[i])))
    for i in order[: height - sum(counts)]:
        counts[i] += 1
    return [category for (category, _), n in zip(held, counts, strict=True) for _ in range(n)]


def split_cells(split: Mapping[str, int], cells: int) -> Text:
    """The split as a bar of ``cells`` cells (:func:`stack_cells`), each cell its category's
    letter in reverse colour, in the split's order; empty when the total is 0."""
    bar = Text()
    for category in stack_cells(split, cells, sum(split.values())):
        letter, _, style = holder_style(category)
        bar.append(letter, f"reverse {style}".strip())
    return bar


#: The cache's name on the CPU, which has no caching allocator: RSS above the heap.
CPU_CACHE_LABEL = "RSS>heap"


def split_key(
    split: Mapping[str, int], *, names: bool = False, cpu: bool = False, shares: bool = False
) -> list[Text]:
    """Each category held, as its letter and bytes (``P 512 MiB``), or with its name too
    (``P params 512 MiB``), and its share of the whole (``25%``), in its colour; ``cpu``: the
    cache is named as the CPU's."""
    parts = []
    total = sum(split.values())
    for category, value in split.items():
        if value <= 0:
            continue
        letter, label, style = holder_style(category)
        if cpu and category == "cache":
            label = CPU_CACHE_LABEL
        words = f"{letter} {label} " if names else f"{letter} "
        words += format_bytes(value)
        if shares and total > 0:
            words += f" {value / total:.0%}"
        parts.append(Text(words, style))
    return parts


def flow(parts: Sequence[Text], width: int, max_lines: int, sep: str = "  ") -> list[Text]:
    """``parts`` in order over at most ``max_lines`` lines of ``width`` cells, leaving out what
    does not fit rather than cutting a part in the middle."""
    lines: list[Text] = [Text(no_wrap=True, overflow="ellipsis")]
    for part in parts:
        current = lines[-1]
        if not current.plain:
            current.append_text(part)
        elif current.cell_len + len(sep) + part.cell_len <= width:
            current.append(sep)
            current.append_text(part)
        elif len(lines) < max_lines:
            lines.append(Text(no_wrap=True, overflow="ellipsis").append_text(part))
    for line in lines:
        line.truncate(width)
    return lines


def holders_line(memory: DeviceMemory, width: int) -> Text | None:
    """What holds the memory, in one line: a stacked bar (one letter per cell, in its colour,
    so it reads without colour too) and each category's bytes; ``None`` until known."""
    split = memory.by_category
    if not split:
        return None
    keys = split_key(split)
    key_width = sum(k.cell_len + 1 for k in keys)
    cells = max(8, min(30, width - key_width - 6))
    line = Text("held ", "dim")
    line.append_text(split_cells(split, cells))
    for key in keys:
        line.append(" ")
        line.append_text(key)
    line.truncate(width)
    return line


def _second_line(state: JobModel, memory: DeviceMemory) -> tuple[list[Figure], str]:
    stats = memory.latest
    if memory.is_cuda:
        # cache: reserved less allocated, what empty_cache() could partly hand back;
        # fragmented: free pieces of split segments (inactive_split_bytes).
        retries = stats.num_alloc_retries
        ooms = state.device_ooms(memory.device)
        ooms_text = Text(MISSING if ooms is None else str(ooms), "bold red" if ooms else "")
        if stats.handled_ooms:
            ooms_text.append(f" +{stats.handled_ooms} handled", "dim")
        line = [
            _figure("cache", format_bytes(memory.cache)),
            _figure("fragmented", format_bytes(memory.fragmented), short_label="frag"),
            _figure(
                "retries",
                MISSING if retries is None else str(retries),
                style="bold yellow" if retries else "",
            ),
            Figure(Text.assemble(("OOMs ", "dim"), ooms_text)),
        ]
        if stats.free_bytes is not None or stats.total_bytes is not None:
            used = None
            if stats.free_bytes is not None and stats.total_bytes is not None:
                used = stats.total_bytes - stats.free_bytes
            line.append(_figure("device", format_used_total(used, stats.total_bytes)))
        return line, TIGHT
    if stats.source == "cpu-tensors" and stats.total_bytes is not None:
        # ``torchtop run --memory-limit``: live tensor bytes against the emulated limit.
        ooms = state.device_ooms(memory.device)
        limit = [
            _figure("emulated limit", format_bytes(stats.total_bytes), short_label="limit"),
            _figure("free", format_bytes(stats.free_bytes)),
            _figure(
                "OOMs", MISSING if ooms is None else str(ooms), style="bold red" if ooms else ""
            ),
        ]
        return limit, WIDE
    if memory.reserved_label == memory.allocated_label:
        # RSS alone: the heap cannot be read (from outside the job, or no mallinfo).
        return [Figure(Text("heap not readable: RSS only", "dim"))], WIDE
    over = memory.cache
    if over is not None and over < 0:
        # The heap counts what malloc handed out, RSS the pages touched: a heap above RSS is
        # memory allocated but not yet written (or swapped out), not a negative amount.
        gap = Figure(Text("heap > RSS: untouched pages", "dim"), Text("heap > RSS", "dim"))
    else:
        gap = _figure(f"RSS {MINUS} {memory.allocated_label}", format_bytes(over))
    return [gap, _figure("peak RSS", format_bytes(memory.peak_reserved))], WIDE


def other_devices(state: JobModel) -> str:
    """The job's other devices, when it uses several: ``cuda:3 4.00 GiB · cuda:5 3.50 GiB``
    (allocated), for the panel's bottom border."""
    others = []
    for device in state.used_devices[1:]:
        memory = state.memory.get(device)
        allocated = memory.latest.allocated_bytes if memory is not None else None
        others.append(f"{device} {format_bytes(allocated)}")
    return f" also {' · '.join(others)} " if others else ""


def chart_window(state: JobModel) -> tuple[float, float]:
    """The chart's time window: the last two minutes while live (less while the job is younger,
    so the curve fills the width), and everything kept once the job is over."""
    memory = state.primary_memory
    end = state.now if state.now is not None else 0.0
    if memory is None or not memory.series:
        return end - LIVE_WINDOW_S, end
    end = max(end, memory.series[-1].t)
    first = memory.series[0].t
    over = state.job_ended or state.lost
    start = first if over else max(first, end - LIVE_WINDOW_S)
    return min(start, end - MIN_WINDOW_S), end


def chart_data(
    state: JobModel,
) -> tuple[list[ChartSeries], list[ChartSpan], list[ChartMark], float, float]:
    """The primary device's series, phases and marks for the chart, within its window."""
    t_start, t_end = chart_window(state)
    memory = state.primary_memory
    series: list[ChartSeries] = []
    if memory is not None:
        allocated: list[tuple[float, float | None]] = []
        reserved: list[tuple[float, float | None]] = []
        for point in reversed(memory.series):
            if point.t < t_start:
                break
            allocated.append((point.t, point.allocated))
            reserved.append((point.t, point.reserved))
        allocated.reverse()
        reserved.reverse()
        series = [ChartSeries(memory.allocated_label, allocated, ALLOCATED_STYLE, fill=True)]
        if memory.reserved_label != memory.allocated_label:  # RSS alone: one series
            series.append(ChartSeries(memory.reserved_label, reserved, RESERVED_STYLE))
    spans = [ChartSpan(p.name, p.start, p.end) for p in state.phases_between(t_start, t_end)]
    marks = [ChartMark(m.t, m.name) for m in state.marks_between(t_start, t_end)]
    return series, spans, marks, t_start, t_end


class MemoryPanel(Vertical):
    """Allocated, reserved, peak, cache and fragmentation of the primary device, over their
    chart; the job's other devices in one line beneath."""

    #: A click focuses the panel (and the palette can maximize it).
    can_focus = True

    DEFAULT_CSS = """
    MemoryPanel {
        height: auto;
    }
    MemoryPanel > #memory-figures {
        height: auto;
        max-height: 3;
    }
    """

    _state: JobModel | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="memory-figures")
        yield TimeSeriesChart(id="memory-chart")

    #: What the figures were last built from: a frame whose samples show the same figures (a
    #: chatty job's frames of log lines and steps) need not build them again to find so.
    _figures_from: tuple[object, ...] | None = None

    def _show_figures(self) -> None:
        state = self._state
        if state is None:
            return
        figures = self.query_one("#memory-figures", Static)
        width = figures.content_region.width
        device = state.primary_device
        built_from = (figures_key(state), device, state.lost, state.device_ooms(device), width)
        if built_from == self._figures_from:
            return
        self._figures_from = built_from
        update_if_changed(figures, memory_figures(state, width))

    @on(Resize)
    def _fit_figures(self) -> None:
        """The figures are fitted to the width: a panel beside the phase panel is narrower."""
        self._show_figures()

    def show_state(self, state: JobModel, *, chart: bool = True) -> None:
        """Redraw the figures from ``state``, and the chart too when ``chart``."""
        device = state.primary_device
        set_titles(self, Text(f" Memory · {device} "), Text(other_devices(state)))
        self._state = state
        self._show_figures()
        if not chart:
            return
        series, spans, marks, t_start, t_end = chart_data(state)
        self.query_one(TimeSeriesChart).set_data(
            series, t_start=t_start, t_end=t_end, spans=spans, marks=marks
        )

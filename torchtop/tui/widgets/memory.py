"""The memory panel: the primary device's figures and its memory chart with phases."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from torchtop.model.job import DeviceMemory, JobModel
from torchtop.tui.format import MISSING, format_bytes, format_used_total
from torchtop.tui.widgets.chart import ChartMark, ChartSeries, ChartSpan, TimeSeriesChart

#: How much of the past the live chart shows; an ended job's chart shows all it kept.
LIVE_WINDOW_S = 120.0
#: The shortest window, so the first few samples do not each fill the width.
MIN_WINDOW_S = 10.0
#: The minus sign, for "RSS - heap".
MINUS = "\u2212"
ALLOCATED_STYLE = "cyan"
RESERVED_STYLE = "magenta"


def memory_figures(state: JobModel) -> Text:
    """Two lines of figures for the primary device; its colour squares are the chart's legend."""
    memory = state.primary_memory
    device = state.primary_device
    if memory is None:
        waiting = "waiting for the first sample…" if not state.lost else "no memory samples"
        return Text.assemble((device, "bold"), "  ", (waiting, "dim"))
    stats = memory.latest
    first = Text()
    first.append("■ ", ALLOCATED_STYLE)
    first.append(f"{memory.allocated_label} ", "dim")
    first.append(format_bytes(stats.allocated_bytes), "bold")
    first.append("   ")
    first.append("■ ", RESERVED_STYLE)
    first.append(f"{memory.reserved_label} ", "dim")
    first.append(format_bytes(stats.reserved_bytes), "bold")
    first.append("   peak " if memory.is_cuda else f"   peak {memory.allocated_label} ", "dim")
    first.append(format_bytes(memory.peak_allocated))
    if memory.is_cuda:
        first.append(" / ", "dim")
        first.append(format_bytes(memory.peak_reserved))
    return Text("\n", no_wrap=True, overflow="ellipsis").join([first, _second_line(memory)])


def _second_line(memory: DeviceMemory) -> Text:
    stats = memory.latest
    line = Text()
    if memory.is_cuda:
        # cache: reserved less allocated, what empty_cache() could partly hand back;
        # fragmented: free pieces of split segments (inactive_split_bytes).
        line.append("cache ", "dim")
        line.append(format_bytes(memory.cache))
        line.append("  fragmented ", "dim")
        line.append(format_bytes(memory.fragmented))
        line.append("  retries ", "dim")
        retries = stats.num_alloc_retries
        line.append(MISSING if retries is None else str(retries), "bold yellow" if retries else "")
        line.append("  OOMs ", "dim")
        ooms = memory.ooms
        line.append(MISSING if ooms is None else str(ooms), "bold red" if ooms else "")
        if stats.handled_ooms:
            line.append(f" +{stats.handled_ooms} handled", "dim")
        if stats.free_bytes is not None or stats.total_bytes is not None:
            used = None
            if stats.free_bytes is not None and stats.total_bytes is not None:
                used = stats.total_bytes - stats.free_bytes
            line.append("  device ", "dim")
            line.append(format_used_total(used, stats.total_bytes))
    elif stats.source == "cpu-tensors" and stats.total_bytes is not None:
        # ``torchtop run --memory-limit``: live tensor bytes against the emulated limit.
        line.append("emulated limit ", "dim")
        line.append(format_bytes(stats.total_bytes))
        line.append("   free ", "dim")
        line.append(format_bytes(stats.free_bytes))
        line.append("   OOMs ", "dim")
        ooms = stats.num_ooms
        line.append(MISSING if ooms is None else str(ooms), "bold red" if ooms else "")
    else:
        line.append(f"RSS {MINUS} {memory.allocated_label} ", "dim")
        line.append(format_bytes(memory.cache))
        line.append("   peak RSS ", "dim")
        line.append(format_bytes(memory.peak_reserved))
    return line


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
        series = [
            ChartSeries(memory.allocated_label, allocated, ALLOCATED_STYLE, fill=True),
            ChartSeries(memory.reserved_label, reserved, RESERVED_STYLE),
        ]
    spans = [ChartSpan(p.name, p.start, p.end) for p in state.phases_between(t_start, t_end)]
    marks = [ChartMark(m.t, m.name) for m in state.marks_between(t_start, t_end)]
    return series, spans, marks, t_start, t_end


class MemoryPanel(Vertical):
    """Allocated, reserved, peak, cache and fragmentation of the primary device, over their
    chart; the job's other devices in one line beneath."""

    DEFAULT_CSS = """
    MemoryPanel {
        height: auto;
    }
    MemoryPanel > #memory-figures {
        height: 2;
    }
    """

    def compose(self) -> ComposeResult:
        yield Static(id="memory-figures")
        yield TimeSeriesChart(id="memory-chart")

    def show_state(self, state: JobModel) -> None:
        """Redraw from ``state``."""
        device = state.primary_device
        self.border_title = f" Memory · {device} "
        self.border_subtitle = other_devices(state)
        self.query_one("#memory-figures", Static).update(memory_figures(state))
        series, spans, marks, t_start, t_end = chart_data(state)
        self.query_one(TimeSeriesChart).set_data(
            series, t_start=t_start, t_end=t_end, spans=spans, marks=marks
        )

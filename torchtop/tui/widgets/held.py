"""What holds the memory (``h``): per device, a stacked bar of its split over time, and the
module table of the latest memory window.

Each column of the chart is one slice of the memory chart's window: the sample with the most
memory in it, split by the model (:attr:`torchtop.model.memory.MemoryPoint.held`) into
parameters, gradients, optimizer state, everything else allocated, the cache and
fragmentation, stacked from the bottom in that order. Each cell carries its category's letter
(the one the memory panel's "held" bar uses), so the chart reads without colour. The drawing is
a pure function of the model (:func:`held_view`), tested without an app.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.events import Resize
from textual.widgets import Static

from torchtop.model.job import JobModel
from torchtop.model.memory import DeviceMemory, MemoryPoint, ModuleMemory
from torchtop.text import printable
from torchtop.tui.format import format_bytes_short, format_span, nice_ceiling
from torchtop.tui.widgets.chart import AXIS_WIDTH, ChartSpan, append_runs, phase_row
from torchtop.tui.widgets.memory import (
    chart_window,
    flow,
    holder_style,
    split_key,
    stack_cells,
)
from torchtop.tui.widgets.quiet import set_titles, update_if_changed

#: The fewest rows a device's stacked bars get; devices that would get fewer are listed, not drawn.
MIN_BAR_ROWS = 3
#: Rows of the module table at most.
MAX_MODULE_ROWS = 8
#: The module table's heading.
MODULES_TITLE = "Top modules by activation memory at the step's peak"
#: What the module table says before the job has sent a memory window.
NO_WINDOW = "no memory window yet"


def held_columns(
    points: Sequence[MemoryPoint], t_start: float, t_end: float, columns: int
) -> list[dict[str, int] | None]:
    """Per column of ``[t_start, t_end]``: the split of the sample with the most memory in that
    slice, held across empty slices between the first sample and the last (``None``: none)."""
    best: list[tuple[int, dict[str, int]] | None] = [None] * max(0, columns)
    span = t_end - t_start
    if columns <= 0 or span <= 0:
        return [None] * max(0, columns)
    for point in points:
        if point.t < t_start or point.t > t_end:
            continue
        split = point.held
        if split is None:
            continue
        col = min(columns - 1, int((point.t - t_start) / span * columns))
        total = sum(split.values())
        current = best[col]
        if current is None or total > current[0]:
            best[col] = (total, split)
    out: list[dict[str, int] | None] = [None if b is None else b[1] for b in best]
    filled = [i for i, split in enumerate(out) if split is not None]
    if filled:
        held: dict[str, int] | None = None
        for col in range(filled[0], filled[-1] + 1):
            if out[col] is None:
                out[col] = held
            held = out[col]
    return out


def stacked_rows(
    columns: Sequence[Mapping[str, int] | None], rows: int, top: float, axis: bool = True
) -> list[Text]:
    """The columns' splits stacked from the bottom (``stack_cells``), ``rows`` lines from the
    top down, each cell its category's letter in reverse colour, blank above the total; with
    the y axis's top and zero on the left when ``axis``."""
    stacks = [stack_cells(split, rows, top) if split is not None else [] for split in columns]
    lines = []
    for row in range(rows):
        level = rows - 1 - row  # cells from the bottom
        chars: list[str] = []
        styles: list[str] = []
        for stack in stacks:
            if level >= len(stack):
                chars.append(" ")
                styles.append("")
            else:
                letter, _, style = holder_style(stack[level])
                chars.append(letter)
                styles.append(f"reverse {style}".strip())
        line = Text(no_wrap=True, overflow="crop")
        if axis:
            label = format_bytes_short(top) if row == 0 and top > 0 else ""
            label = "0" if row == rows - 1 else label
            line.append(f"{label:>{AXIS_WIDTH - 1}}{'┤' if label else '│'}", "dim")
        append_runs(line, chars, styles)
        lines.append(line)
    return lines


#: Why a device's memory is not split (yet): no optimizer has stepped, or none ever will (a
#: job that only runs inference).
NOT_SPLIT = "not split: the holders are read once the job steps an optimizer"


def device_head(memory: DeviceMemory, width: int) -> list[Text]:
    """A device's name and its split now, with each category's name and bytes (two lines at
    most); and why it is not split, where it is not."""
    latest = memory.series[-1].held if memory.series else None
    now = memory.by_category or latest
    head = [Text(printable(memory.device, one_line=True), "bold")]
    if now:
        head.extend(split_key(now, names=True, cpu=not memory.is_cuda))
    else:
        head.append(Text("waiting for a sample with allocated memory", "dim"))
    out = flow(head, width, 2)
    if memory.by_category is None:
        out.append(Text(f"· {NOT_SPLIT}", "dim", no_wrap=True, overflow="ellipsis"))
    return out


def device_bars(
    state: JobModel,
    memory: DeviceMemory,
    width: int,
    rows: int,
    t_start: float,
    t_end: float,
) -> list[Text]:
    """A device's stacked bars over ``rows`` lines (on the CPU, of the heap), and the window
    and its phases beneath."""
    plot_width = max(0, width - AXIS_WIDTH)
    columns = held_columns(memory.series, t_start, t_end, plot_width)
    if not memory.is_cuda:
        # The CPU's "cache" is RSS above the heap: the interpreter, libraries and pages the
        # heap let go, hundreds of MiB beside a small model. The bars split the heap; the
        # first lines still give RSS above it.
        columns = [
            None if c is None else {k: v for k, v in c.items() if k != "cache"} for c in columns
        ]
    peak = max((sum(c.values()) for c in columns if c is not None), default=0)
    out = stacked_rows(columns, rows, nice_ceiling(peak))
    window = f"-{format_span(t_end - t_start)}" if t_end > t_start else ""
    phases = Text(f"{window:>{AXIS_WIDTH - 1}} ", "dim", no_wrap=True, overflow="crop")
    spans = [ChartSpan(p.name, p.start, p.end) for p in state.phases_between(t_start, t_end)]
    phases.append_text(phase_row(spans, [], t_start, t_end, plot_width))
    out.append(phases)
    return out


def module_block(modules: Sequence[ModuleMemory] | None, width: int, rows: int) -> list[Text]:
    """The module table: its heading, then one row per module (bytes, share, path), or why
    there is none."""
    out = [Text(MODULES_TITLE, "bold", no_wrap=True, overflow="ellipsis")]
    if modules is None:
        out.append(
            Text(
                f"  {NO_WINDOW}: the agent has sent no module split of a step",
                "dim",
                no_wrap=True,
                overflow="ellipsis",
            )
        )
        return out
    if not modules:
        out.append(Text("  the last memory window held no activations", "dim"))
        return out
    for module in modules[: max(0, rows - 1)]:
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(f"{format_bytes_short(module.bytes):>6} ", "bold")
        line.append(f"{module.share:>4.0%}  ", "dim")
        line.append(printable(module.path, one_line=True))
        line.truncate(width)
        out.append(line)
    return out


def held_view(
    state: JobModel,
    width: int,
    height: int,
    modules: Sequence[ModuleMemory] | None = None,
) -> Text:
    """The whole view in ``height`` lines at most: each device the job uses (as many as get
    :data:`MIN_BAR_ROWS` rows of bars; the others named on one line), then the module table."""
    devices = [state.memory[d] for d in state.used_devices if d in state.memory]
    if not devices:
        waiting = "waiting for the first sample…" if not state.lost else "no memory samples"
        return Text(waiting, "dim")
    t_start, t_end = chart_window(state)
    module_rows = 2 if not modules else min(MAX_MODULE_ROWS, len(modules)) + 1
    heads = [device_head(memory, width) for memory in devices]
    # Each device: its head, its bars and the phase row; a blank line before the modules.
    room = height - module_rows - 1
    shown = len(devices)
    while shown > 1:
        fixed = sum(len(h) + 1 for h in heads[:shown]) + (shown < len(devices))
        if (room - fixed) // shown >= MIN_BAR_ROWS:
            break
        shown -= 1
    fixed = sum(len(h) + 1 for h in heads[:shown]) + (shown < len(devices))
    rows = max(MIN_BAR_ROWS, (room - fixed) // shown)
    lines: list[Text] = []
    for memory, head in zip(devices[:shown], heads, strict=False):
        lines.extend(head)
        lines.extend(device_bars(state, memory, width, rows, t_start, t_end))
    if shown < len(devices):
        others = ", ".join(printable(d.device, one_line=True) for d in devices[shown:])
        lines.append(Text(f"also {others} (a taller terminal shows them)", "dim"))
    lines.append(Text())
    lines.extend(module_block(modules, width, module_rows))
    text = Text("\n", no_wrap=True, overflow="crop").join(lines[:height])
    return text


class HeldPanel(Vertical):
    """The view of what holds the memory, in place of the job screen's panels (``h``)."""

    can_focus = True

    DEFAULT_CSS = """
    HeldPanel > #held-view {
        height: 1fr;
    }
    """

    _state: JobModel | None = None
    _drawn_from: tuple[object, ...] | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="held-view")

    def show_state(self, state: JobModel) -> None:
        """Redraw from ``state`` (the job screen calls this while the view is shown)."""
        self._state = state
        t_start, t_end = chart_window(state)
        set_titles(
            self, Text(" What holds memory "), Text(f" last {format_span(t_end - t_start)} ")
        )
        self._draw()

    def _draw(self) -> None:
        state = self._state
        if state is None:
            return
        view = self.query_one("#held-view", Static)
        size = view.content_region.size
        key = (state.version, size)
        if key == self._drawn_from:
            return
        self._drawn_from = key
        update_if_changed(view, held_view(state, size.width, size.height, state.top_modules))

    @on(Resize)
    def _fit(self) -> None:
        self._drawn_from = None
        self._draw()

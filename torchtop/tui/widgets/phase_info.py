"""The phase panel: what the running phase does and why, beside the memory chart.

Shown only when the job sends phase descriptions (``torchtop.phase(name, description)``, as the
bundled demos do), so a training job without them looks as it always did. It explains the
latest running phase with a description; once that phase ends it stays on screen, marked as
ended, until the next described phase begins. The title says which (``▶ running · 3.2 s``,
``■ ended · took 4.1 s``), so every row below it goes to the phase's name and description.
Text that does not fit the panel ends in an ellipsis rather than being cut mid-line.
"""

from __future__ import annotations

from rich.console import RenderableType
from rich.text import Text
from textual.widget import Widget

from torchtop.model.job import JobModel, Phase
from torchtop.tui.format import format_duration

RUNNING_STYLE = "bold green"
ENDED_STYLE = "dim"
ELLIPSIS = "…"


def phase_heading(phase: Phase, now: float | None) -> Text:
    """``"▶ running · 3.2 s"`` or ``"■ ended · took 4.1 s"``."""
    if phase.running:
        elapsed = None if phase.start is None or now is None else max(0.0, now - phase.start)
        text = Text("▶ running", RUNNING_STYLE)
        if elapsed is not None:
            text.append(f" · {format_duration(elapsed)}", "dim")
        return text
    text = Text("■ ended", ENDED_STYLE)
    if phase.start is not None and phase.end is not None:
        text.append(f" · took {format_duration(max(0.0, phase.end - phase.start))}", "dim")
    return text


def phase_text(phase: Phase) -> Text:
    """The phase's name and its description, as one text to wrap."""
    text = Text()
    text.append(phase.name, "bold")
    text.append("\n")
    text.append(phase.description or "", "" if phase.running else "dim")
    return text


def phase_title(phase: Phase | None, now: float | None) -> Text:
    """The panel's title: ``Phase · ▶ running · 3.2 s``."""
    if phase is None:
        return Text(" Phase ")
    return Text.assemble(" Phase · ", phase_heading(phase, now), " ")


def fit_lines(text: Text, width: int, height: int) -> Text:
    """``text`` wrapped to ``width`` and cut to ``height`` lines, the last ending in an ellipsis
    when something was left out."""
    from rich.console import Console

    console = Console(width=max(1, width), color_system=None, legacy_windows=False)
    lines = text.wrap(console, max(1, width), overflow="fold")
    if height > 0 and len(lines) > height:
        kept = list(lines[:height])
        last = kept[-1]
        last.rstrip()
        if last.cell_len >= width:
            last.truncate(max(0, width - 1))
        last.append(ELLIPSIS, "dim")
        lines = type(lines)(kept)
    return Text("\n").join(lines)


class PhaseInfo(Widget):
    """The explained phase's name, state and description (see the module docstring)."""

    DEFAULT_CSS = """
    PhaseInfo {
        height: 1fr;
    }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.phase: Phase | None = None
        self._now: float | None = None
        self._shown: tuple[object, ...] | None = None
        self.border_title = phase_title(None, None)

    def show_state(self, state: JobModel) -> bool:
        """Take the phase to explain from ``state``; ``False`` when there is none to show."""
        phase = state.explained_phase
        self.phase = phase
        self._now = state.now
        if phase is None:
            return False
        # Redraw when what is shown changes: another phase, it ended, or a second went by.
        elapsed = int(state.now - phase.start) if state.now and phase.start else None
        key = (phase.id, phase.end, phase.description, elapsed if phase.running else None)
        if key != self._shown:
            self._shown = key
            self.border_title = phase_title(phase, state.now)
            self.refresh()
        return True

    def render(self) -> RenderableType:
        if self.phase is None:
            return Text()
        size = self.content_region.size
        return fit_lines(phase_text(self.phase), size.width, size.height)

    def on_resize(self) -> None:
        self.refresh()

"""A second recording (B) against the job shown (A): ``torchtop replay A --against B``, or the
palette's "Compare with a recording".

:class:`Against` holds B's model (for the step chart's overlay: B's step time and data wait
drawn at the times A took the same step numbers, so the two runs line up by step) and the
comparison ``torchtop compare`` makes (:mod:`torchtop.model.compare`, rendered as its JSON by
:mod:`torchtop.report.compare`): the :class:`ComparePanel` shows its verdict, the figures that
changed first. Nothing here computes a statistic of its own.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.text import Text
from textual.widgets import Static

from torchtop.model.compare import CompareError, StepSample, samples_with_ends, step_samples
from torchtop.model.job import JobModel
from torchtop.protocol import Message
from torchtop.report.compare import Side, change_cells, compare
from torchtop.report.run import is_multi_rank
from torchtop.streams.recording import RecordingError, read_recording
from torchtop.text import printable
from torchtop.tui.widgets.chart import ChartSeries
from torchtop.tui.widgets.quiet import update_if_changed

#: B's series on the step chart: step time and data wait, in colours A's do not use.
B_STEP_STYLE = "magenta"
B_WAIT_STYLE = "red"
#: Cells for a figure's verdict ("within noise" and a space).
VERDICT_WIDTH = 13
#: The figure shown first whatever changed: what a user compares two runs for.
HEADLINE_FIGURE = "step_time_median_s"


@dataclass
class Against:
    """Recording B: its model, and the comparison of A with it (``None``, with ``error``
    saying why, where the two cannot be compared)."""

    label: str
    model: JobModel
    report: dict[str, Any] | None
    error: str | None = None
    #: B's timed steps, numbered from its first (read once: B does not change).
    samples: list[StepSample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.samples = step_samples(self.model.training)


def fold_messages(messages: Sequence[Message]) -> JobModel:
    """A recording's model at its end."""
    model = JobModel(mode="replay")
    model.apply_all(messages)
    return model


def against(label: str, a: JobModel, b_messages: Sequence[Message], multi_rank: bool) -> Against:
    """B against A (A's model as far as known); a run of several ranks is said to need
    ``torchtop compare``."""
    b = fold_messages(b_messages)
    if multi_rank:
        return Against(label, b, None, "a run of several ranks: compare it with torchtop compare")
    try:
        report = compare(Side("A", False, [a]), Side(label, False, [b]))
    except CompareError as exc:
        return Against(label, b, None, str(exc))
    return Against(label, b, report)


def load_against(path: str | Path, a: JobModel) -> Against:
    """Recording ``path`` against ``a``; :class:`RecordingError` where it cannot be read."""
    contents = read_recording(path)
    return against(str(path), a, contents.messages, is_multi_rank(contents.sources))


def against_series(a: JobModel, b: Against, start: float, end: float) -> list[ChartSeries]:
    """B's step time and data wait on A's time axis: B's step N at the time A's step N ended
    (the runs aligned by step, as ``compare`` aligns them); B's steps beyond A's last are not
    drawn yet."""
    samples_a, ends_a = samples_with_ends(a.training)
    if not samples_a:
        return []
    indices = [s.index for s in samples_a]
    steps: list[tuple[float, float | None]] = []
    waits: list[tuple[float, float | None]] = []
    for sample in b.samples:
        i = bisect.bisect_left(indices, sample.index)
        if i >= len(indices):
            break
        t = ends_a[i]
        if start <= t <= end:
            steps.append((t, sample.duration))
            waits.append((t, sample.wait))
    return [
        ChartSeries("B wait", waits, B_WAIT_STYLE),
        ChartSeries("B step", steps, B_STEP_STYLE),
    ]


def compare_text(b: Against) -> Text:
    """The verdict, then each step figure with its change and verdict: the step time median
    first (the headline, kept in view however short the panel), then those that changed, then
    the rest; then energy per step where the runs have it."""
    if b.report is None:
        return Text(f"cannot compare: {b.error}", "yellow")
    report = b.report
    changed = report["changed"]
    text = Text(no_wrap=True, overflow="ellipsis")
    if changed:
        text.append("changed: " + ", ".join(changed), "bold yellow")
    else:
        text.append("no difference beyond noise", "bold green")
    # Which lines of the step chart are B's (its legend: the chart has none).
    text.append("\nstep chart: ", "dim")
    text.append("B step", B_STEP_STYLE)
    text.append(" ")
    text.append("B wait", B_WAIT_STYLE)
    figures = sorted(
        report["step_figures"], key=lambda c: (c["key"] != HEADLINE_FIGURE, not c["changed"])
    )
    energy = [e["energy_per_step_j"] for e in report.get("energy", [])]
    for c in [*figures, *energy]:
        # The verdict first: a narrow panel cuts the end of the line, never the verdict.
        _a, _b, change, _interval, verdict = change_cells(c)
        verdict.pad_right(VERDICT_WIDTH - len(verdict))
        text.append("\n")
        text.append_text(verdict)
        text.append(f"{c['label']} ")
        text.append(change or "n/a", "dim")
    return text


class ComparePanel(Static):
    """What changed from A to B, beside the memory chart while a recording is compared."""

    DEFAULT_CSS = """
    ComparePanel {
        height: 1fr;
    }
    """

    def show_against(self, b: Against | None) -> bool:
        """Show ``b``'s comparison; ``False`` (and nothing) without one."""
        if b is None:
            return False
        # A file's name: plain text, never markup.
        self.border_title = Text(printable(f" vs B · {Path(b.label).name} ", one_line=True))
        update_if_changed(self, compare_text(b))
        return True


__all__ = ["Against", "ComparePanel", "RecordingError", "against", "load_against"]

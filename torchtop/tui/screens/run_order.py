"""The run view at many ranks: the rows that matter first, the page shown, and every rank's step
time on one line.

Past :data:`FOLD_AFTER` ranks the table no longer holds every rank on one screen, so its rows
are ordered by what needs a look: lost and dead ranks, then the ranks a finding names, then the
slowest recent step first (:func:`ordered`). A line above the table says which rows are shown
and how to page (:func:`page_line`), and a heat strip gives every rank's recent step time at
once, in rank order, several ranks a cell where the screen is narrower than the run
(:func:`heat_strip`): a slow node or a slow rank stands out there whatever page is shown.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.text import Text

from torchtop.model.run_advice import died
from torchtop.tui.format import format_seconds_short

if TYPE_CHECKING:
    from torchtop.model import JobModel
    from torchtop.streams.runs import RunFold

#: More ranks than this: the table is ordered by what needs a look, and the strip shows.
FOLD_AFTER = 8
#: The heat strip's shades, from the run's quickest recent step to its slowest.
SHADES = " ░▒▓█"
#: A cell with a lost or dead rank.
GONE = "✕"


def recent_step(job: JobModel) -> float | None:
    return job.training.recent(job.now).mean_step_s


def _rank(job: JobModel) -> int:
    hello = job.hello
    return hello.rank if hello is not None and hello.rank is not None else 1 << 30


def gone(run: RunFold, stream: str, job: JobModel) -> bool:
    """Lost (its node or its series) or dead: what the table puts first."""
    return run.is_lost(stream) or died(job, run.model.advisor.launcher_exits)


def ordered(run: RunFold) -> list[str]:
    """The streams in the order the table shows them: lost and dead ranks, then the ranks a
    finding names, then the slowest recent step first; the rank breaks ties."""
    named = {f.rank for f in run.findings if f.rank is not None}

    def key(item: tuple[str, JobModel]) -> tuple[int, float, int]:
        stream, job = item
        step = recent_step(job)
        group = 0 if gone(run, stream, job) else 1 if _rank(job) in named else 2
        return (group, -(step or 0.0), _rank(job))

    return [stream for stream, _ in sorted(run.model.jobs.items(), key=key)]


def page_line(first: int, last: int, total: int) -> Text:
    """Which rows of ``total`` are shown (1-based), and how to see the others."""
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(f"ranks {first}-{last} of {total}", "bold")
    text.append(" · lost, named, slowest first · pgup/pgdn page", "dim")
    return text


def heat_strip(run: RunFold, width: int) -> Text:
    """Every rank's recent mean step on one line of ``width`` cells: in rank order, each cell
    the slowest of its ranks, shaded from the run's quickest to its slowest; ✕ where a rank of
    the cell is lost or dead."""
    jobs = sorted(run.model.jobs.items(), key=lambda item: _rank(item[1]))
    text = Text(no_wrap=True, overflow="crop")
    if not jobs:
        return text
    steps = [recent_step(job) for _, job in jobs]
    known = [s for s in steps if s is not None]
    low, high = (min(known), max(known)) if known else (0.0, 0.0)
    first, last = _rank(jobs[0][1]), _rank(jobs[-1][1])
    label = "step by rank "
    scale = f" r{first}-r{last} · {format_seconds_short(low)}-{format_seconds_short(high)}"
    cells = max(1, width - len(label) - len(scale) - 2)
    per = max(1, math.ceil(len(jobs) / cells))
    if per > 1:  # room for saying so
        cells = max(1, cells - len(f" · {len(jobs)} a cell"))
        per = max(1, math.ceil(len(jobs) / cells))
    text.append(label, "dim")
    text.append("▕", "dim")
    for start in range(0, len(jobs), per):
        text.append_text(
            _cell(run, jobs[start : start + per], steps[start : start + per], low, high)
        )
    text.append("▏", "dim")
    text.append(scale, "dim")
    if per > 1:
        text.append(f" · {per} a cell", "dim")
    return text


def _cell(
    run: RunFold,
    jobs: Sequence[tuple[str, JobModel]],
    steps: Sequence[float | None],
    low: float,
    high: float,
) -> Text:
    if any(gone(run, stream, job) for stream, job in jobs):
        return Text(GONE, "bold red")
    known = [s for s in steps if s is not None]
    if not known:
        return Text("·", "dim")
    top = len(SHADES) - 1
    level = 0 if high <= low else round((max(known) - low) / (high - low) * top)
    return Text(SHADES[level] if level else "▁", "yellow" if level == top else "")

"""The ranks' arrivals at their collectives in the run view: a lane per rank, its lateness at
each collective over time, every lane on one scale.

Each column is one collective every rank of a node entered (the run model's join on process
group and sequence id, :func:`torchtop.model.collectives.join`), oldest on the left, the newest
on the right; a rank's mark is its lateness after the first rank there, as a bar from ``▁``
(on time) to ``█`` (the latest arrival the lanes show). The rank the others waited for at a
collective has its mark bold: a straggler's lane is a row of high bold bars. The table of the
collectives themselves is :class:`torchtop.tui.screens.collectives.CollectivesScreen`.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widget import Widget

from torchtop.model.collectives import Joined
from torchtop.tui.format import format_seconds_short

__all__ = ["LANE_MARKS", "ArrivalLanes", "lane_ranks", "render_lanes"]

#: A rank's lateness at one collective, from on time to the scale's top.
LANE_MARKS = "▁▂▃▄▅▆▇█"
#: The label before each lane (``r12│``).
LABEL_WIDTH = 6
#: The quantile of the last arrivals' lateness the lanes' scale reaches.
SCALE_QUANTILE = 0.9
#: The style of the mark of the rank the others waited for, and of the others'.
LAST_STYLE = "bold yellow"
OTHER_STYLE = "cyan"


def lane_ranks(joined: Sequence[Joined], lanes: int) -> tuple[list[int], int]:
    """The ranks that get a lane (or a column) when only ``lanes`` fit: those that arrived
    last most often (the ones worth seeing), in rank order; and how many were left out."""
    last: dict[int, int] = {}
    for item in joined:
        for rank, _ in item.late_s:
            last.setdefault(rank, 0)
        last[item.last_rank] += 1
    if len(last) <= lanes:
        return sorted(last), 0
    chosen = sorted(last, key=lambda rank: (-last[rank], rank))[: max(0, lanes)]
    return sorted(chosen), len(last) - len(chosen)


def lane_scale(shown: Sequence[Joined]) -> float:
    """The lanes' top: the latest arrival at :data:`SCALE_QUANTILE` of the collectives shown,
    so that a job's first collectives (ranks ending their start-up apart, hundreds of ms)
    do not flatten the rest; a later arrival shows as the top mark."""
    lasts = sorted(item.last_s for item in shown)
    return lasts[min(len(lasts) - 1, int(SCALE_QUANTILE * len(lasts)))] if lasts else 0.0


def render_lanes(joined: Sequence[Joined], ranks: Sequence[int], width: int) -> tuple[Text, float]:
    """One line per rank of ``ranks``: its lateness at each of the last collectives that fit in
    ``width``, on one scale (:func:`lane_scale`); and that scale (seconds)."""
    text = Text(no_wrap=True, overflow="crop")
    cells = max(0, width - LABEL_WIDTH)
    shown = list(joined[-cells:]) if cells else []
    scale = lane_scale(shown)
    top = len(LANE_MARKS) - 1
    arrivals = [dict(item.late_s) for item in shown]
    for i, rank in enumerate(ranks):
        if i:
            text.append("\n")
        text.append(f"{'r' + str(rank):>{LABEL_WIDTH - 1}}", "bold")
        text.append("│", "dim")
        for item, by_rank in zip(shown, arrivals, strict=True):
            late = by_rank.get(rank)
            if late is None:
                text.append(" ")
                continue
            level = min(top, int(late / scale * top + 0.5)) if scale > 0 else 0
            last = item.last_rank == rank and scale > 0
            text.append(LANE_MARKS[level], LAST_STYLE if last else OTHER_STYLE)
    return text, scale


class ArrivalLanes(Widget):
    """The lanes of :func:`render_lanes`, with a title that says the scale. The screen shows
    it once a collective was joined (none without a flight recorder, or with a single
    rank)."""

    DEFAULT_CSS = """
    ArrivalLanes {
        height: auto;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.joined: Sequence[Joined] = ()
        #: The most lanes shown (the screen sets it from its height).
        self.lanes = 4

    def set_data(self, joined: Sequence[Joined]) -> None:
        self.joined = joined
        self._title()
        self.refresh(layout=True)

    def on_resize(self) -> None:
        self._title()

    def _cells(self) -> int:
        return max(0, (self.content_region.width or self.app.size.width) - LABEL_WIDTH)

    def _title(self) -> None:
        cells = self._cells()
        shown = self.joined[-cells:] if cells else ()
        scale = lane_scale(shown)
        self.border_title = (
            f"lateness per collective · 0 to {format_seconds_short(scale)} · bold: last "
            "to arrive · c: the table"
        )

    def _ranks(self) -> tuple[list[int], int]:
        """The ranks with a lane: those last most often among the collectives shown."""
        cells = self._cells()
        return lane_ranks(self.joined[-cells:] if cells else (), self.lanes)

    def get_content_height(self, container: object, viewport: object, width: int) -> int:
        ranks, left_out = self._ranks()
        return max(1, len(ranks) + (1 if left_out else 0))

    def render(self) -> Text:
        if not self.joined:
            return Text("no collectives joined yet", "dim")
        ranks, left_out = self._ranks()
        text, _ = render_lanes(self.joined, ranks, self.content_region.width)
        if left_out:
            text.append(f"\n{'':>{LABEL_WIDTH - 1}} {left_out} more ranks: c shows them", "dim")
        return text

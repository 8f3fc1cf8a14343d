"""The collectives of a run, one process group at a time (``c`` on the run view): each
collective's sequence id, op and sizes, every rank's lateness after the first arrival, and the
rank the others waited for.

It reads what the run model joined at its last evaluation
(:attr:`torchtop.model.run_advice.RankAdvisor.joined`), newest first, and redraws when that
changes. ``g`` goes to the next process group; ``escape`` or ``q`` goes back to the run. The op
and the group's name come from the job: shown as plain, printable text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import DataTable, Footer, Static

from torchtop.model.collectives import Joined
from torchtop.text import printable
from torchtop.tui.widgets.collectives import lane_ranks

if TYPE_CHECKING:
    from torchtop.streams.runs import RunFold

__all__ = ["MAX_RANK_COLUMNS", "MAX_ROWS", "CollectivesScreen", "collective_row", "sizes_text"]

#: The most collectives the table lists (the newest), and the most ranks it gives a column
#: (those that arrived last most often).
MAX_ROWS = 500
MAX_RANK_COLUMNS = 16
#: Seconds between two looks at what the run joined.
REFRESH_S = 1.0


def sizes_text(sizes: tuple[tuple[int, ...], ...]) -> str:
    """``[[1000], [16, 16]]`` as ``1000 16x16``."""
    return " ".join("x".join(map(str, shape)) or "scalar" for shape in sizes) or "-"


def collective_row(item: Joined, ranks: Sequence[int]) -> list[Text]:
    """One collective: its sequence id, op, sizes, each of ``ranks``' lateness in
    milliseconds (the last arrival's bold) and the last arrival."""
    late = dict(item.late_s)
    last = item.last_rank
    row = [
        Text(str(item.seq)),
        Text(printable(item.op, one_line=True)),
        Text(sizes_text(item.sizes)),
    ]
    for rank in ranks:
        value = late.get(rank)
        if value is None:
            row.append(Text("-", "dim"))
        else:
            row.append(Text(f"{1000 * value:.1f}", "bold yellow" if rank == last else ""))
    row.append(Text(f"r{last}", "bold"))
    return row


class CollectivesScreen(Screen[None]):
    """The run's joined collectives, one process group at a time, newest first."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q", "close", "back to the run"),
        Binding("g", "next_group", "next group"),
    ]
    CSS_PATH = "collectives.tcss"

    def __init__(self, run: RunFold) -> None:
        super().__init__()
        self.run_ = run
        #: The process group shown (``None``: the first there is).
        self.group: str | None = None
        self._shown: tuple[int, str | None, int] | None = None
        self._timer: Timer | None = None

    def compose(self) -> ComposeResult:
        yield Static("", id="collectives-head")
        yield DataTable[Text](id="collectives", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        self.redraw()
        self._timer = self.set_interval(REFRESH_S, self.look)

    def joined(self) -> list[Joined]:
        """Every run's joined collectives (a view shows one run: one list), oldest first."""
        lists = list(self.run_.model.advisor.joined.values())
        if len(lists) == 1:
            return lists[0]
        return sorted((j for one in lists for j in one), key=lambda j: j.first_ns)

    def groups(self, joined: Sequence[Joined]) -> list[str]:
        return sorted({item.pg for item in joined}, key=lambda pg: (len(pg), pg))

    def look(self) -> None:
        """What the feeds queued is folded (the run's own view waits under this one), and
        the table redrawn if the run joined more."""
        self.run_.drain()
        self.redraw()

    def redraw(self) -> None:
        joined = self.joined()
        groups = self.groups(joined)
        if self.group not in groups:
            self.group = groups[0] if groups else None
        key = (id(joined), self.group, len(joined))
        if key == self._shown:
            return
        self._shown = key
        rows = [item for item in joined if item.pg == self.group][-MAX_ROWS:]
        ranks, left_out = lane_ranks(rows, MAX_RANK_COLUMNS)
        table: DataTable[Text] = self.query_one("#collectives", DataTable)
        table.clear(columns=True)
        for column in ("seq", "op", "sizes", *(f"r{r} ms" for r in ranks), "last"):
            table.add_column(column, key=column)
        for item in reversed(rows):
            table.add_row(*collective_row(item, ranks))
        self.query_one("#collectives-head", Static).update(self._head(groups, rows, left_out))

    def _head(self, groups: list[str], rows: list[Joined], left_out: int) -> Text:
        text = Text()
        if self.group is None:
            text.append("no collectives joined yet", "dim")
            text.append(
                " (the ranks' flight recorders sent none: a single rank, or no recorder)", "dim"
            )
            return text
        text.append(f"process group {printable(self.group, one_line=True)}", "bold")
        text.append(f" · {len(rows)} collectives, newest first")
        if len(groups) > 1:
            text.append(f" · group {groups.index(self.group) + 1} of {len(groups)} (g: next)")
        text.append(" · lateness after the first rank of its node, ms")
        if left_out:
            text.append(f" · the {MAX_RANK_COLUMNS} ranks last most often; {left_out} more", "dim")
        return text

    def action_next_group(self) -> None:
        groups = self.groups(self.joined())
        if not groups:
            return
        at = groups.index(self.group) if self.group in groups else -1
        self.group = groups[(at + 1) % len(groups)]
        self.redraw()

    def action_close(self) -> None:
        if self._timer is not None:
            self._timer.stop()
        self.app.pop_screen()

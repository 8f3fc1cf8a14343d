"""The log panel: the job's own stdout and stderr, appended as they arrive."""

from __future__ import annotations

from itertools import islice

from rich.text import Text
from textual import on
from textual.events import Resize
from textual.geometry import Size
from textual.reactive import Reactive
from textual.widgets import RichLog

from torchtop.model.job import DEFAULT_LOG_LINES, JobModel, LogEntry
from torchtop.tui.widgets.quiet import set_titles

STDERR_STYLE = "yellow"


def log_line(entry: LogEntry) -> Text:
    """One line as shown: stderr in its own colour so warnings and tracebacks stand out."""
    return Text(entry.text, STDERR_STYLE if entry.stream == "stderr" else "")


class LogPanel(RichLog):
    """Appends only the lines it has not shown yet, and follows the end unless scrolled up."""

    #: Each line written makes the log longer; Textual would lay the whole screen out again
    #: for it (about 15 ms at 80x24, most of a chatty job's viewer CPU). The panel's own size
    #: is set by the layout, not by its lines: only its scrollbar follows them (below).
    virtual_size: Reactive[Size] = Reactive(Size(0, 0), layout=False)

    DEFAULT_CSS = """
    LogPanel {
        height: 1fr;
        background: $surface;
    }
    """

    def __init__(
        self,
        *,
        max_lines: int = DEFAULT_LOG_LINES,
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
    ) -> None:
        super().__init__(
            max_lines=max_lines,
            wrap=True,
            markup=False,
            highlight=False,
            auto_scroll=True,
            name=name,
            id=id,
            classes=classes,
        )
        #: ``state.log_total`` when this panel last caught up.
        self.shown_total = 0
        #: New lines scroll into view unless the reader scrolled up. Kept as a flag, not read
        #: from the scroll position when lines arrive: a change of height moves the end away
        #: from where the view is, without the reader having scrolled.
        self.following = True
        self.border_title = " Log "

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        # Only a move of the view itself says where the reader is: up, they read back; at the
        # end (by scrolling down, or held there as the panel grew), they follow again.
        self.following = new_value >= self.max_scroll_y

    def watch_virtual_size(self, size: Size) -> None:
        """Longer content moves the scrollbar; only a scrollbar that appears or goes changes
        the panel's layout."""
        shown = (self.show_vertical_scrollbar, self.show_horizontal_scrollbar)
        self._refresh_scrollbars()
        if (self.show_vertical_scrollbar, self.show_horizontal_scrollbar) != shown:
            self.refresh(layout=True)
        else:
            self._scroll_update(size)
            self.refresh()

    @on(Resize)
    def _keep_following(self) -> None:
        if self.following:
            self.scroll_end(animate=False, immediate=False)

    def show_state(self, state: JobModel) -> None:
        """Write the lines that arrived since the last call."""
        new = state.log_total - self.shown_total
        if new <= 0:
            return
        # Follow the end only if the reader has not scrolled up to read something.
        follow = self.following
        kept = len(state.logs)
        # One write for all of them (a write each cost a chatty job's viewer a millisecond a
        # frame), and the view moved to the end at once rather than after the next refresh,
        # which drew every frame twice.
        lines = [log_line(entry) for entry in islice(state.logs, max(0, kept - new), kept)]
        # At the panel's width: RichLog need not measure the lines first to find it.
        width = self.scrollable_content_region.width or None
        self.write(Text("\n").join(lines), width=width, scroll_end=False)
        if follow:
            self.scroll_end(animate=False, immediate=True, x_axis=False)
        self.shown_total = state.log_total
        set_titles(self, f" Log · {state.log_total} lines ")

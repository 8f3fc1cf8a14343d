"""The log panel: the job's own stdout and stderr, appended as they arrive."""

from __future__ import annotations

from itertools import islice

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import on
from textual.events import Resize
from textual.geometry import Region, Size
from textual.reactive import Reactive
from textual.scrollbar import ScrollBar, ScrollBarRender
from textual.strip import Strip
from textual.widgets import RichLog
from typing_extensions import Self

from torchtop.model.job import DEFAULT_LOG_LINES, JobModel, LogEntry
from torchtop.tui.widgets.quiet import set_titles

STDERR_STYLE = "yellow"
#: torchtop's own lines among the job's (where its output comes from).
NOTE_STYLE = "dim italic"
_STYLES = {"stderr": Style.parse(STDERR_STYLE), "torchtop": Style.parse(NOTE_STYLE)}
_PLAIN = Style()


def log_line(entry: LogEntry) -> Text:
    """One line as shown: stderr in its own colour so warnings and tracebacks stand out."""
    return Text(entry.text, _STYLES.get(entry.stream, _PLAIN))


class LogScrollBar(ScrollBar):
    """The log's scrollbar, repainted only when it would look different.

    Each frame of a chatty job makes the log longer and moves its end: Textual repaints the
    scrollbar for each (a tenth of a frame's cost), though a thumb of a few thousand lines is
    one cell at the bottom however many lines come."""

    _drawn: object = None
    #: A repaint was asked for and is checked once the log's size and scroll have settled.
    _check_asked = False

    def _look(self) -> object:
        """What the bar shows: its cells and its colours; ``None`` when it cannot be told."""
        if not self.is_mounted or self.parent is None:
            return None
        renderable = self.render()
        if not isinstance(renderable, ScrollBarRender):
            return None
        length, thickness = self.size.height, self.size.width
        if not self.vertical:
            length, thickness = thickness, length
        bar = renderable.render_bar(
            size=length,
            window_size=renderable.window_size,
            virtual_size=renderable.virtual_size,
            position=renderable.position,
            thickness=thickness,
            vertical=renderable.vertical,
        )
        return self.size, renderable.style, tuple(bar.segments)

    def refresh(
        self,
        *regions: Region,
        repaint: bool = True,
        layout: bool = False,
        recompose: bool = False,
    ) -> Self:
        if regions or layout or recompose or not self.is_mounted:
            self._drawn = None
            return super().refresh(*regions, repaint=repaint, layout=layout, recompose=recompose)
        # New lines move the end, then the view follows it: the bar is compared once both
        # are done (in between, its thumb stood a fraction higher).
        if not self._check_asked:
            self._check_asked = True
            self.call_next(self._repaint_if_changed)
        return self

    def _repaint_if_changed(self) -> None:
        self._check_asked = False
        look = self._look()
        if look is None or look != self._drawn:
            self._drawn = look
            super().refresh()


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

    @property
    def vertical_scrollbar(self) -> ScrollBar:
        """Textual's vertical scrollbar, made a :class:`LogScrollBar`."""
        if self._vertical_scrollbar is None:
            bar = LogScrollBar(
                vertical=True, name="vertical", thickness=self.scrollbar_size_vertical
            )
            bar.display = False
            self._vertical_scrollbar = bar
            self.app._start_widget(self, bar)
        return self._vertical_scrollbar

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

    def _append(self, entries: list[LogEntry], width: int) -> None:
        """Add ``entries`` at the end, as :meth:`RichLog.write` would draw them at ``width``.

        A line of printable ASCII that fits the width is one strip of one segment, made here:
        Rich's wrapping and rendering (what ``write`` does for every line) was most of a chatty
        job's drawing. Any other line (wider, tabs, wide or combining characters) goes through
        Rich as before."""
        strips: list[Strip] = []
        for entry in entries:
            text = entry.text
            style = _STYLES.get(entry.stream, _PLAIN)
            if len(text) <= width and text.isascii() and text.isprintable():
                strips.append(Strip([Segment(text, style)] if text else [], len(text)))
            else:
                strips.extend(self._rendered(log_line(entry), width))
        lines = self.lines
        lines.extend(strips)
        excess = len(lines) - self.max_lines if self.max_lines is not None else 0
        if excess > 0:
            self._start_line += excess
            del lines[:excess]
            self.refresh()
        widest = max(strip.cell_length for strip in strips) if strips else 0
        self._widest_line_width = max(self._widest_line_width, widest)
        self.virtual_size = Size(self._widest_line_width, len(lines))

    #: The panel's style while its lines are drawn (:meth:`render_lines`), else ``None``.
    _drawing_style: Style | None = None

    def render_lines(self, crop: Region) -> list[Strip]:
        """The lines in ``crop``, the panel's style worked out once for all of them: Textual
        works it out for each line (walking the panel's ancestors), a tenth of what a frame of
        a chatty job costs. It cannot change while the lines are drawn."""
        self._drawing_style = self.rich_style
        try:
            return super().render_lines(crop)
        finally:
            self._drawing_style = None

    def render_line(self, y: int) -> Strip:
        """Line ``y`` of the view, as :meth:`RichLog.render_line` draws it."""
        style = self._drawing_style or self.rich_style
        scroll_x, scroll_y = self.scroll_offset
        width = self.scrollable_content_region.width
        return self._line_at(scroll_y + y, scroll_x, width, style).apply_style(style)

    def _line_at(self, y: int, scroll_x: int, width: int, style: Style) -> Strip:
        """:meth:`RichLog._render_line` with the panel's ``style`` given."""
        lines = self.lines
        if y >= len(lines):
            return Strip.blank(width, style)
        key = (y + self._start_line, scroll_x, width, self._widest_line_width)
        cache = self._line_cache
        line = cache.get(key)
        if line is None:
            line = cache[key] = lines[y].crop_extend(scroll_x, scroll_x + width, style)
        return line

    def _rendered(self, line: Text, width: int) -> list[Strip]:
        """``line`` wrapped at ``width`` by Rich, as :meth:`RichLog.write` does it."""
        console = self.app.console
        options = console.options.update_width(width)
        segments = console.render(line, options)
        rendered = list(Segment.split_lines(segments))
        return Strip.from_lines(rendered) if rendered else [Strip.blank(width)]

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
        entries = list(islice(state.logs, max(0, kept - new), kept))
        # At the panel's width: RichLog need not measure the lines first to find it.
        width = self.scrollable_content_region.width
        if self._size_known and width > 0:
            self._append(entries, width)
        else:  # before the panel has a size RichLog keeps the lines for later
            lines = [log_line(entry) for entry in entries]
            self.write(Text("\n").join(lines), width=width or None, scroll_end=False)
        if follow:
            self.scroll_end(animate=False, immediate=True, x_axis=False)
        self.shown_total = state.log_total
        set_titles(self, f" Log · {state.log_total} lines ")

"""Redraw a widget only when what it shows changed, and lay the screen out only when its
height may have.

Textual redraws a ``Static`` on every ``update`` even with the same content, and by default
lays out the whole screen again (about 15 ms at 80x24, most of an idle viewer's CPU). The
panels build their Rich text (cheap) and hand it here, which compares it with what the widget
shows, updates the widget only when it differs, and asks for a layout only when the number of
lines changed (every panel here is as wide as the layout makes it; only heights follow content).
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

from rich.console import RenderableType
from rich.text import Text
from textual.widget import Widget
from textual.widgets import Static

#: What each widget shows, as the key it was last updated with.
_shown: WeakKeyDictionary[Widget, object] = WeakKeyDictionary()


def update_if_changed(
    widget: Static,
    content: RenderableType,
    *,
    key: object | None = None,
    lines: int | None = None,
) -> bool:
    """Show ``content`` in ``widget`` unless it shows the same already; ``key`` stands for the
    content when the content itself cannot be compared (a Rich ``Group``), ``lines`` for its
    height when that cannot be told from it (always the same for a fixed-height widget). True
    if updated."""
    key = content if key is None else key
    if widget in _shown and _shown[widget] == key:
        return False
    _shown[widget] = key
    height = _lines(content) if lines is None else lines
    layout = height is None or _heights.get(widget) != height
    if height is None:
        _heights.pop(widget, None)
    else:
        _heights[widget] = height
    widget.update(content, layout=layout)
    return True


#: The number of lines each widget shows, where known: the same number needs no new layout.
_heights: WeakKeyDictionary[Widget, int] = WeakKeyDictionary()


def _lines(content: RenderableType) -> int | None:
    """Lines ``content`` takes whatever the width, or ``None`` when that depends on it."""
    if isinstance(content, Text) and content.no_wrap:
        return content.plain.count("\n") + 1
    return None


def forget(widget: Widget) -> None:
    """Make the next update of ``widget`` redraw it (its size changed, say)."""
    _shown.pop(widget, None)
    _heights.pop(widget, None)


#: Each widget's border title and subtitle as last set here.
_titles: WeakKeyDictionary[Widget, tuple[Title | None, Title | None]] = WeakKeyDictionary()
#: A border title: Textual markup (``str``, torchtop's own words only) or ``Text``, which is
#: what a title holding a job's text (a device, a filter) must be.
Title = str | Text


def set_titles(widget: Widget, title: Title | None = None, subtitle: Title | None = None) -> bool:
    """Set the border title (and subtitle, when given) unless they are set so already:
    Textual redraws a widget whenever either is assigned. True if set."""
    shown_title, shown_subtitle = _titles.get(widget, (None, None))
    changed = False
    if title is not None and title != shown_title:
        widget.border_title = shown_title = title
        changed = True
    if subtitle is not None and subtitle != shown_subtitle:
        widget.border_subtitle = shown_subtitle = subtitle
        changed = True
    _titles[widget] = (shown_title, shown_subtitle)
    return changed

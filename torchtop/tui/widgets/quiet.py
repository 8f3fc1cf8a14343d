"""Redraw a widget only when what it shows changed.

Textual redraws (and re-lays out) a ``Static`` on every ``update`` even with the same content;
a frame that updated every panel cost the viewer most of its CPU. The panels build their Rich
text each frame (cheap) and hand it here, which compares it with what the widget shows and
updates the widget only when it differs.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

from rich.console import RenderableType
from textual.widget import Widget
from textual.widgets import Static

#: What each widget shows, as the key it was last updated with.
_shown: WeakKeyDictionary[Widget, object] = WeakKeyDictionary()


def update_if_changed(
    widget: Static, content: RenderableType, *, key: object | None = None
) -> bool:
    """Show ``content`` in ``widget`` unless it shows the same already; ``key`` stands for the
    content when the content itself cannot be compared (a Rich ``Group``). True if updated."""
    key = content if key is None else key
    if widget in _shown and _shown[widget] == key:
        return False
    _shown[widget] = key
    widget.update(content)
    return True


def forget(widget: Widget) -> None:
    """Make the next update of ``widget`` redraw it (its size changed, say)."""
    _shown.pop(widget, None)


#: Each widget's border title and subtitle as last set here.
_titles: WeakKeyDictionary[Widget, tuple[str | None, str | None]] = WeakKeyDictionary()


def set_titles(widget: Widget, title: str | None = None, subtitle: str | None = None) -> bool:
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

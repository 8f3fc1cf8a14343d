"""A compositor that draws, for a partial update, only the rows that changed.

Textual's compositor, asked to update a few rows (the log's, as a chatty job's lines come), has
every widget whose clip touches those rows draw its whole height: the screen, the body and the
rows of panels above the log drew all their lines at every frame, to have all but the log's
rows thrown away (a quarter of such a frame's cost). Here each widget draws the changed rows
only, at full width: the rows drawn are the same, line for line, so the screen is too. A full
update (a new layout, a resize, a snapshot) is Textual's own.
"""

from __future__ import annotations

from collections.abc import Iterable

from textual._compositor import Compositor
from textual.geometry import Region
from textual.strip import Strip


class RowsCompositor(Compositor):
    """:class:`Compositor` whose partial updates draw only the rows they update."""

    def _get_renders(
        self, crop: Region | None = None
    ) -> Iterable[tuple[Region, Region, list[Strip]]]:
        if crop is None:
            yield from super()._get_renders(crop)
            return
        # The rows of ``crop``, at the screen's full width: a narrower crop need not fall on
        # the edges where the rows are cut between widgets, rows always do.
        rows = Region(0, crop.y, max(self.size.width, crop.right), crop.height)
        intersection = Region.intersection
        for widget, (region, clip) in self.visible_widgets.items():
            clip = intersection(clip, rows)
            x, y, width, height = intersection(region, clip)
            if width and height:
                crop_in_widget = Region(x - region.x, y - region.y, width, height)
                yield region, clip, widget.render_lines(crop_in_widget)

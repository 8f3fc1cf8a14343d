"""The job screen's compositor draws a partial update's rows only, and writes to the terminal
exactly what Textual's own compositor writes for the same update."""

from __future__ import annotations

import asyncio

from textual._compositor import Compositor
from textual.app import App, ComposeResult
from textual.containers import Horizontal, Vertical
from textual.geometry import Region
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Footer, RichLog, Static

from torchtop.tui.compositor import RowsCompositor


class Panels(Screen[None]):
    """Rows of panels over a log, as the job screen has them."""

    def compose(self) -> ComposeResult:
        yield Static("header\nsecond line", id="header")
        with Vertical(id="body"):
            with Horizontal(id="top"):
                yield Static("memory " * 30, id="memory")
                yield Static("phase", id="phase")
            with Horizontal(id="panels"):
                yield Static("gpu\n" * 3, id="gpu")
                yield Static("host\n" * 3, id="host")
            yield RichLog(id="log")
        yield Footer()


class PanelsApp(App[None]):
    CSS = """
    #header { height: 2; }
    #top { height: 6; }
    #memory { width: 2fr; border: round $primary; }
    #phase { width: 1fr; }
    #panels { height: 5; }
    #gpu, #host { width: 1fr; border: solid $secondary; }
    #log { height: 1fr; border-top: solid $primary; }
    """

    def on_mount(self) -> None:
        self.push_screen(Panels())


def written(compositor: Compositor, screen: Screen[None], regions: list[Region]) -> str:
    compositor._dirty_regions.update(regions)
    update = compositor.render_partial_update()
    assert update is not None
    return update.render_segments(screen.app.console)


def test_a_partial_update_writes_what_textual_writes() -> None:
    async def run() -> None:
        app = PanelsApp()
        async with app.run_test(size=(70, 24)) as pilot:
            await pilot.pause()
            screen = app.screen
            log = screen.query_one(RichLog)
            for n in range(40):  # longer than the log: it scrolls, with its scrollbar
                log.write(f"line {n} " + "x" * (n % 50))
            await pilot.pause()
            ours, theirs = RowsCompositor(), Compositor()
            for compositor in (ours, theirs):
                compositor.reflow(screen, screen.size)
                compositor._dirty_regions.clear()  # the reflow's: the whole screen

            def region(widget_id: str) -> Region:
                widget: Widget = screen.query_one(f"#{widget_id}")
                return widget.region

            updates = [
                [region("log")],  # new lines
                [region("header"), region("log")],  # the header's uptime with them
                [region("memory"), region("host")],  # panels side by side, rows apart
                [Region(3, 15, 10, 2)],  # a region that falls on no widget's edges
                [log.region.intersection(Region(log.region.right - 1, 0, 1, 24))],  # scrollbar
            ]
            for regions in updates:
                assert written(ours, screen, regions) == written(theirs, screen, regions)

    asyncio.run(run())


def test_only_the_updated_rows_are_drawn() -> None:
    drawn: dict[str, int] = {}

    class Counted(Static):
        def render_lines(self, crop: Region) -> list:  # type: ignore[type-arg]
            drawn[self.id or ""] = drawn.get(self.id or "", 0) + crop.height
            return super().render_lines(crop)

    class Tall(Screen[None]):
        def compose(self) -> ComposeResult:
            yield Counted("\n".join(f"row {n}" for n in range(18)), id="tall")
            yield Counted("log", id="log")

    class TallApp(App[None]):
        CSS = "#tall { height: 18; } #log { height: 1fr; }"

        def on_mount(self) -> None:
            self.push_screen(Tall())

    async def run() -> None:
        app = TallApp()
        async with app.run_test(size=(40, 24)) as pilot:
            await pilot.pause()
            screen = app.screen
            compositor = RowsCompositor()
            compositor.reflow(screen, screen.size)
            compositor._dirty_regions.clear()
            drawn.clear()
            log = screen.query_one("#log")
            written(compositor, screen, [log.region])
            assert drawn == {"log": log.region.height}  # not the tall panel's 18 rows

    asyncio.run(run())

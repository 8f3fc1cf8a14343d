"""The loader panel: each DataLoader's settings and its live worker processes.

Per loader, up to three lines::

    0 SleepySet · batch 32 · first 1.21 s
      2 workers fork · pin · prefetch 2 · persistent
      ●● CPU 45% RSS 310 MiB

``first`` is the latest first-batch latency (worker start-up). A worker that has exited shows
as a dim ``○``: normal between epochs unless the workers persist.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from torchtop.model.job import JobModel
from torchtop.protocol import LoaderStats
from torchtop.tui.format import format_bytes, format_seconds
from torchtop.tui.widgets.quiet import set_titles, update_if_changed


def loader_lines(loader: LoaderStats) -> list[Text]:
    """A loader's name, batch and first-batch latency; its settings; its workers, if any."""
    head = Text()
    head.append(f"{loader.index} {loader.dataset}", "bold")
    head.append(" · batch ", "dim")
    head.append(str(loader.batch_size) if loader.batch_size is not None else "—")
    if loader.last_first_batch_s is not None:
        head.append(" · first ", "dim")
        head.append(format_seconds(loader.last_first_batch_s))
    settings = Text("  ")
    if loader.num_workers:
        settings.append(f"{loader.num_workers} workers")
        if loader.start_method:
            settings.append(f" {loader.start_method}")
    else:
        settings.append("main process")
    if loader.pin_memory:
        settings.append(" · pin", "dim")
    if loader.prefetch_factor is not None:
        settings.append(f" · prefetch {loader.prefetch_factor}", "dim")
    if loader.persistent_workers:
        settings.append(" · persistent", "dim")
    lines = [head, settings]
    if loader.num_workers:
        workers = Text("  ")
        alive = [w for w in loader.workers if w.alive]
        for worker in loader.workers:
            workers.append("●" if worker.alive else "○", "green" if worker.alive else "dim")
        if not loader.workers:
            workers.append("no workers running", "dim")
        elif len(alive) < len(loader.workers):
            workers.append(f" {len(alive)}/{len(loader.workers)} alive")
        cpu = [w.cpu_percent for w in alive if w.cpu_percent is not None]
        if cpu:
            workers.append(" CPU ", "dim")
            workers.append(f"{sum(cpu):.0f}%", "bold")
        rss = [w.rss_bytes for w in alive if w.rss_bytes is not None]
        if rss:
            workers.append(" RSS ", "dim")
            workers.append(format_bytes(sum(rss)))
        uss = [w.uss_bytes for w in alive if w.uss_bytes is not None]
        if uss:  # private pages: what copy-on-write of the dataset grows
            workers.append(" private ", "dim")
            workers.append(format_bytes(sum(uss)))
            if len(uss) > 1:  # what each worker holds of its own: the copied dataset
                workers.append(f" ({format_bytes(sum(uss) // len(uss))} each)", "dim")
        lines.append(workers)
    return lines


def loaders_text(state: JobModel) -> Text:
    """Every loader's lines, in the order the job first iterated them."""
    loaders = state.training.loaders
    if not loaders:
        return Text("no DataLoader iterated yet", "dim")
    lines = [line for loader in loaders for line in loader_lines(loader)]
    return Text("\n", no_wrap=True, overflow="ellipsis").join(lines)


class LoaderPanel(VerticalScroll):
    """The DataLoaders: settings and workers. Scrolls when there are more than fit."""

    DEFAULT_CSS = """
    LoaderPanel {
        height: 1fr;
        scrollbar-size-vertical: 1;
    }
    LoaderPanel > #loader-text {
        height: auto;
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    """

    def compose(self) -> ComposeResult:
        yield Static(id="loader-text")

    def show_state(self, state: JobModel) -> None:
        """Redraw from ``state``."""
        count = len(state.training.loaders)
        set_titles(self, "Loaders " if count < 2 else f"Loaders · {count} ")
        update_if_changed(self.query_one("#loader-text", Static), loaders_text(state))

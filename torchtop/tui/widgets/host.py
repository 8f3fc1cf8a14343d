"""The host panel: the training process (CPU, RSS, threads, children) and its machine's memory."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from torchtop.model.job import JobModel
from torchtop.tui.format import MISSING, format_bytes, format_percent, format_used_total
from torchtop.tui.widgets.quiet import update_if_changed


def host_text(state: JobModel) -> Text:
    """Three short lines: CPU and RSS; threads and children; system memory."""
    host = state.host
    if host is None:
        return Text("waiting for counters…", "dim")

    def count(n: int | None) -> str:
        return MISSING if n is None else str(n)

    first = Text.assemble(
        ("CPU ", "dim"),
        (format_percent(host.cpu_percent), "bold"),
        ("   RSS ", "dim"),
        (format_bytes(host.rss_bytes), "bold"),
    )
    second = Text.assemble(
        ("threads ", "dim"),
        count(host.threads),
        ("   children ", "dim"),
        count(host.children),
    )
    third = Text.assemble(
        ("system ", "dim"),
        format_used_total(host.system_used_bytes, host.system_total_bytes),
    )
    return Text("\n", no_wrap=True, overflow="ellipsis").join([first, second, third])


class HostPanel(Static):
    """The job's process and the machine it runs on, as psutil reads them."""

    #: A click focuses the panel (and the palette can maximize it).
    can_focus = True

    BORDER_TITLE = "Host "
    DEFAULT_CSS = """
    HostPanel {
        height: auto;
    }
    """

    def show_state(self, state: JobModel) -> None:
        """Redraw from ``state``."""
        update_if_changed(self, host_text(state))

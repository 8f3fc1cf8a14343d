"""The question ``q`` asks when torchtop started the job and it still runs: stop it, or leave
it running (detach)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static


class QuitScreen(ModalScreen[str | None]):
    """Asks whether quitting should stop the job torchtop started, or leave it running."""

    BINDINGS = [
        Binding("s", "choose('stop')", "Stop the job"),
        Binding("d", "choose('detach')", "Leave it running"),
        Binding("escape", "choose('')", "Cancel"),
    ]

    def compose(self) -> ComposeResult:
        with Vertical(id="quit-dialog"):
            yield Static("[b]The job is still running.[/b]", id="quit-title")
            yield Static(
                "[b]s[/b]    stop the job, then quit\n"
                "[b]d[/b]    leave it running and quit (detach)\n"
                "[b]esc[/b]  cancel",
                id="quit-choices",
            )

    def action_choose(self, choice: str) -> None:
        self.dismiss(choice or None)

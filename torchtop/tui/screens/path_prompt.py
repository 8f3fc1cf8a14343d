"""A one-line question for a file's path (the palette's "Compare with a recording")."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static


class PathPrompt(ModalScreen[str | None]):
    """Asks for a path: enter gives it, esc gives ``None``."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="path-dialog"):
            yield Static(self.question, markup=False)
            yield Input(placeholder="path/to/recording.ttr", id="path-input")
            yield Static("enter: open · esc: cancel", classes="dim")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)

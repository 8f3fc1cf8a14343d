"""The picker ``torchtop attach`` offers when several agents are running."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Header, OptionList
from textual.widgets.option_list import Option

from torchtop.text import printable
from torchtop.transport import AgentInfo, list_agents

if TYPE_CHECKING:
    from torchtop.streams.source import Source

#: Opens the chosen agent: its source and its screen's title. An error it raises is shown in
#: one line, and the picker stays.
AgentOpener = Callable[[AgentInfo], "tuple[Source, str]"]


def describe(agent: AgentInfo) -> str:
    """One line per agent: pid, start, and for a rank of a distributed run its rank and run
    (the job's own words with their escapes shown, on one line)."""
    started = time.strftime("%H:%M:%S", time.localtime(agent.started_at))
    rank = ""
    if agent.rank_label:
        run = f" of run {agent.run_label}" if agent.run_label else ""
        rank = f"  rank {agent.rank_label}{run}"
    return printable(f"{agent.pid:>8}  {started}{rank}  {agent.command}", one_line=True)


class PickerScreen(Screen[None]):
    """Lists the running agents; enter chooses the highlighted one (:attr:`chosen`): with
    ``open_agent``, its job screen takes the picker's place in the app; without, the app quits.
    q cancels."""

    TITLE = "torchtop: choose a job to attach to"
    BINDINGS = [
        Binding("q,escape", "cancel", "cancel"),
        # Textual's own: ctrl+c says how to quit (the job screen's ctrl+c is off here).
        Binding("ctrl+c", "app.help_quit", show=False, system=True),
    ]

    def __init__(self, open_agent: AgentOpener | None = None) -> None:
        super().__init__()
        self._open_agent = open_agent
        self.agents = list_agents()
        #: The agent chosen (``None``: none yet, or cancelled).
        self.chosen: AgentInfo | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        # Plain text: an option's string would be read as markup.
        options = [Option(Text(describe(a)), id=str(a.pid)) for a in self.agents]
        yield OptionList(*options)
        yield Footer()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        chosen = next(a for a in self.agents if str(a.pid) == event.option.id)
        if self._open_agent is None:
            self.chosen = chosen
            self.app.exit(0)
            return
        try:
            source, title = self._open_agent(chosen)
        except Exception as exc:  # one line, and the user may choose again or cancel
            self.app.notify(printable(str(exc)), severity="error", markup=False)
            return
        self.chosen = chosen
        self.post_message(self.Opened(source, title))

    class Opened(Message):
        """The chosen agent's source and title, for the app to show its job screen."""

        def __init__(self, source: Source, title: str) -> None:
            super().__init__()
            self.source = source
            self.title = title

    def action_cancel(self) -> None:
        self.app.exit(0)

"""The Advice panel (``a``): the advisor's findings, worst first, with evidence, fix and demo.

It reads :attr:`torchtop.model.JobModel.advice`, the findings the model's rules keep as the
job's messages arrive, and redraws when they change. Never imports torch.
"""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from torchtop.model.advice import Finding
from torchtop.model.job import JobModel

SEVERITY_STYLE = {"critical": "bold red", "warning": "bold yellow", "info": "bold cyan"}


def _since(state: JobModel, t: float) -> str:
    start = state.start
    return f"{t - start:.0f} s" if start is not None else f"{t:.0f}"


def finding_text(state: JobModel, finding: Finding, *, cleared: bool = False) -> Text:
    """One finding: severity and title, its evidence with the window, the fix, the demo."""
    text = Text()
    text.append(f"{finding.severity.upper()} ", SEVERITY_STYLE.get(finding.severity, "bold"))
    text.append(finding.title, "bold")
    if finding.rank is not None:
        text.append(f" (rank {finding.rank})")
    periods = finding.periods or ((finding.first_t, finding.last_t),)
    if cleared:
        span = f"{_since(state, finding.first_t)}-{_since(state, finding.last_t)}, cleared"
    else:
        span = f"since {_since(state, periods[-1][0])}"
    if len(periods) > 1:  # it cleared and came back: one finding, held several times
        span += f", held {len(periods)} times"
    text.append(f"  {span}", "dim")
    window = f"{_since(state, finding.window_start)}-{_since(state, finding.window_end)}"
    text.append(f"\n  evidence ({window}): ", "dim")
    text.append(finding.summary)
    text.append("\n  fix: ", "dim")
    text.append(finding.fix, "green")
    if finding.code:
        for line in finding.code.splitlines():
            text.append(f"\n      {line}", "green")
    if finding.demo_command:
        text.append("\n  see: ", "dim")
        text.append(finding.demo_command, "cyan")
    return text


def advice_renderable(state: JobModel) -> Group:
    """Holding findings, then the last few that cleared; a line saying so when there are none."""
    advisor = state.advice
    parts: list[Text] = []
    for finding in advisor.findings:
        parts.append(finding_text(state, finding))
    if not parts:
        parts.append(Text("No findings: nothing the rules look for holds now.", "green"))
    cleared = list(advisor.cleared)[-3:]
    if cleared:
        parts.append(Text("\nearlier", "bold dim"))
        parts.extend(finding_text(state, f, cleared=True) for f in reversed(cleared))
    spaced: list[Text] = []
    for part in parts:
        spaced += [part, Text("")]
    return Group(*spaced[:-1])


class AdviceScreen(ModalScreen[None]):
    """The findings of the advice rules, kept up to date while it is open."""

    BINDINGS = [Binding("escape,a,q", "close", "Close")]

    def __init__(self, state: JobModel) -> None:
        super().__init__()
        self.state = state

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="advice-dialog") as dialog:
            dialog.border_title = "advice"
            dialog.border_subtitle = "esc or a to close"
            yield Static(advice_renderable(self.state), id="advice-text")

    def refresh_from(self, state: JobModel) -> None:
        self.state = state
        self.query_one("#advice-text", Static).update(advice_renderable(state))

    def action_close(self) -> None:
        self.dismiss(None)

"""The torchtop viewer: one Textual app, its views screens (:mod:`torchtop.tui.screens`).

It starts on a job's screen (:class:`~torchtop.tui.screens.job.JobScreen`, one job: ``torchtop
run``, ``attach``, ``replay``), on a run's (:class:`~torchtop.tui.screens.run.RunScreen`, the
ranks of a multi-rank job; ``enter`` on a rank pushes that rank's job screen, whose ``q`` comes
back), or on the picker of running agents (``torchtop attach`` with several). The job screen's
keys are the app's bindings, handed to the job screen shown (:attr:`TorchtopApp.shown_job`), so
they act over the screens a job opens (the OOM screen, the help) as they always have, and are
off on the run's screen and the picker. Never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from textual.app import App
from textual.notifications import SeverityLevel
from textual.theme import Theme
from textual.widgets import Input

from torchtop.streams.source import Source
from torchtop.text import printable
from torchtop.tui.palette import Action, ViewerCommands, actions
from torchtop.tui.screens.job import JOB_ACTIONS, JOB_BINDINGS, JobScreen
from torchtop.tui.screens.picker import AgentOpener, PickerScreen
from torchtop.tui.screens.run import RankOpener, RunScreen
from torchtop.tui.settings import load_settings, save_setting
from torchtop.tui.widgets.ops import OpsPanel

if TYPE_CHECKING:
    from torchtop.streams.runs import RunFold
    from torchtop.transport import AgentInfo
    from torchtop.tui.widgets.compare import Against

#: A theme for low-vision users and washed-out screens: white on black, bright accents.
HIGH_CONTRAST = Theme(
    name="torchtop-high-contrast",
    primary="#FFD700",
    secondary="#00FFFF",
    accent="#FF66FF",
    foreground="#FFFFFF",
    background="#000000",
    surface="#000000",
    panel="#202020",
    success="#00FF00",
    warning="#FFFF00",
    error="#FF4040",
    dark=True,
)


class TorchtopApp(App[int]):
    """The viewer. ``TorchtopApp(source)`` shows one job; :meth:`for_run` a run's ranks;
    :meth:`picker` the running agents to choose from."""

    CSS_PATH = "app.tcss"
    TITLE = "torchtop"
    #: ctrl+p: the viewer's actions (:mod:`.palette`) beside Textual's (theme, keys, ...).
    COMMANDS = App.COMMANDS | {ViewerCommands}
    BINDINGS = JOB_BINDINGS
    #: The job screen the app starts on for a source (a subclass may measure it).
    JOB_SCREEN: type[JobScreen] = JobScreen

    def __init__(
        self,
        source: Source | None = None,
        *,
        title: str | None = None,
        run: RunFold | None = None,
        open_rank: RankOpener | None = None,
        pick: bool = False,
        open_agent: AgentOpener | None = None,
        against: Against | None = None,
    ) -> None:
        super().__init__()
        #: The screen the app starts on: a job's, a run's or the picker.
        self._first: JobScreen | RunScreen | PickerScreen
        self._picker: PickerScreen | None = None
        if run is not None:
            if open_rank is None:
                raise TypeError("a run's screen needs open_rank, to open a rank's screen")
            self._first = RunScreen(run, title or "", open_rank=open_rank)
        elif pick:
            self._first = self._picker = PickerScreen(open_agent)
            self.title = PickerScreen.TITLE
        elif source is not None:
            self._first = self.JOB_SCREEN(source, title=title, against=against)
            if title is not None:  # a job's command line, or a file's name: not ours
                self.title = printable(title, one_line=True)
        else:
            raise ValueError("TorchtopApp needs a source, a run or pick=True")
        self.register_theme(HIGH_CONTRAST)
        self._restore_theme()

    @classmethod
    def for_run(cls, run: RunFold, title: str, *, open_rank: RankOpener) -> TorchtopApp:
        """The app on a run's screen; ``open_rank(run, pid)`` gives a rank's source and title
        for the job screen ``enter`` opens (None: it cannot be reached)."""
        return cls(run=run, title=title, open_rank=open_rank)

    @classmethod
    def picker(cls, open_agent: AgentOpener | None = None) -> TorchtopApp:
        """The app on the picker of running agents; the one chosen is :attr:`picked`. With
        ``open_agent``, the chosen agent's job screen takes the picker's place in this app."""
        return cls(pick=True, open_agent=open_agent)

    async def on_mount(self) -> None:
        # Watched from here, not in __init__: restoring the saved theme does not write it back.
        self.watch(self, "theme", self._theme_changed, init=False)
        await self.push_screen(self._first)

    def show_run(self, run: RunFold, title: str, *, open_rank: RankOpener) -> None:
        """The run's screen in place of the job's, in this app: the job's processes have become
        the ranks of a run (``torch.multiprocessing.spawn``, Lightning's launcher). Screens the
        job had open over it (help, OOM) close first."""
        screen = RunScreen(run, title, open_rank=open_rank)
        while self.screen is not self._first and len(self.screen_stack) > 2:
            self.pop_screen()
        self._first = screen
        self.switch_screen(screen)

    def on_picker_screen_opened(self, event: PickerScreen.Opened) -> None:
        """The agent chosen in the picker: its job screen in the picker's place."""
        screen = self.JOB_SCREEN(event.source, title=event.title)
        self.title = printable(event.title, one_line=True)
        self._first = screen
        self.switch_screen(screen)

    @property
    def picked(self) -> AgentInfo | None:
        """The agent chosen in the picker (``None``: none, or cancelled)."""
        return self._picker.chosen if self._picker is not None else None

    @property
    def job(self) -> JobScreen:
        """The job screen the app started on."""
        if not isinstance(self._first, JobScreen):
            raise AttributeError("this app started on a run or the picker, not a job")
        return self._first

    @property
    def run_screen(self) -> RunScreen:
        """The run screen the app started on."""
        if not isinstance(self._first, RunScreen):
            raise AttributeError("this app started on a job or the picker, not a run")
        return self._first

    @property
    def shown_job(self) -> JobScreen | None:
        """The job screen the user is on: the top one, under the screens it opened (the OOM
        screen, the help); ``None`` on a run's screen or the picker."""
        for screen in reversed(self.screen_stack):
            if isinstance(screen, JobScreen):
                return screen
            if isinstance(screen, (RunScreen, PickerScreen)):
                return None
        return None

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool | None = None,
    ) -> None:
        """Show ``message`` in the one-line notification over the footer, in place of the one
        shown before (two at once would stack over the log's rows). Plain text unless
        ``markup``: a notification may quote the job (a snapshot's path, why ops are off).
        The run's screen and the picker keep Textual's toasts: they stack, and read markup
        unless told not to."""
        if self.shown_job is not None:
            self.clear_notifications()
            markup = bool(markup)
        elif markup is None:
            markup = True
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)

    # -- the job screen's keys ------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The job screen's keys act on the job screen shown, and are off where none is."""
        if action in JOB_ACTIONS:
            if action != "request_quit" and isinstance(self.focused, Input):
                # Typing (a path, an op filter): "-" and "+" are the text's, not the speed
                # keys'. ctrl+c still quits.
                return False
            job = self.shown_job
            return False if job is None else job.check_action(action, parameters)
        return True

    def _on_job(self, action: str) -> None:
        job = self.shown_job
        if job is not None:
            getattr(job, f"action_{action}")()

    def action_request_quit(self) -> None:
        self._on_job("request_quit")

    async def action_quit(self) -> None:
        """ctrl+q quits the same way as q (on a run's screen or the picker: at once)."""
        if self.shown_job is None:
            self.exit()
        else:
            self._on_job("request_quit")

    def action_help(self) -> None:
        self._on_job("help")

    def action_toggle_log(self) -> None:
        self._on_job("toggle_log")

    def action_toggle_pause(self) -> None:
        self._on_job("toggle_pause")

    def action_jump_to_end(self) -> None:
        self._on_job("jump_to_end")

    def action_faster(self) -> None:
        self._on_job("faster")

    def action_slower(self) -> None:
        self._on_job("slower")

    def action_show_oom(self) -> None:
        self._on_job("show_oom")

    def action_snapshot(self) -> None:
        self._on_job("snapshot")

    def action_toggle_ops(self) -> None:
        self._on_job("toggle_ops")

    def action_toggle_held(self) -> None:
        self._on_job("toggle_held")

    def action_profile(self) -> None:
        self._on_job("profile")

    def action_advice(self) -> None:
        self._on_job("advice")

    def action_clear_readings(self) -> None:
        self._on_job("clear_readings")

    # -- the command palette and the help (torchtop.tui.palette) --------------------------------

    def actions(self) -> list[Action]:
        """The job screen's keys and what they do."""
        return actions(self, self.BINDINGS)

    def ops_actions(self) -> list[Action]:
        """The ops panel's keys (they act while it is shown)."""
        return actions(self, OpsPanel.BINDINGS, prefix="Ops: ")

    def palette_commands(self) -> list[tuple[Action, Callable[[], object]]]:
        """What ``ctrl+p`` offers beside Textual's own: the job screen's (none elsewhere)."""
        job = self.shown_job
        if job is None:
            return []
        return job.palette_commands(self.actions(), self.ops_actions())

    # -- themes ------------------------------------------------------------------------------

    def _restore_theme(self) -> None:
        """The theme chosen last time (a theme since gone is ignored)."""
        saved = load_settings().get("theme")
        if isinstance(saved, str) and saved in self.available_themes:
            self.theme = saved

    def _theme_changed(self, theme: str) -> None:
        save_setting("theme", theme)

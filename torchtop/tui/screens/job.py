"""The job screen: one job's figures, fed by a :class:`Source`'s messages as they arrive.

The source feeds a thread-safe queue from its own thread and wakes the screen for a message
that may change it (a sample whose figures look the same waits, two seconds at most); the
screen then drains the queue into a :class:`JobModel` as soon as the last frame is the frame
gap old (:data:`FRAME_BUDGET`), and each widget redraws only when what it shows changed. So
new data reaches the screen without waiting for a fixed tick, a chatty job costs at most a few
frames a second, and a job with nothing new costs the viewer a frame every two seconds.
Never imports torch.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from functools import partial

from rich.text import Text
from textual import log
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.message import Message as TMessage
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Static

from torchtop.model.captures import CaptureEntry
from torchtop.model.job import JobModel
from torchtop.protocol import (
    REQUEST_PROFILE,
    REQUEST_RESUME,
    REQUEST_SNAPSHOT,
    Message,
    OpsWindow,
)
from torchtop.streams.heap import SettledHeap
from torchtop.streams.source import Source, SourceDisconnected
from torchtop.text import printable
from torchtop.tui.compositor import RowsCompositor
from torchtop.tui.palette import Action
from torchtop.tui.screens.advice import AdviceScreen
from torchtop.tui.screens.help import HelpScreen
from torchtop.tui.screens.oom import OomScreen
from torchtop.tui.screens.path_prompt import PathPrompt
from torchtop.tui.screens.quit import QuitScreen
from torchtop.tui.wake import WakeFilter
from torchtop.tui.widgets.chart import TimeSeriesChart
from torchtop.tui.widgets.compare import Against, ComparePanel, RecordingError, load_against
from torchtop.tui.widgets.device import DevicePanel
from torchtop.tui.widgets.header import JobHeader, Playback
from torchtop.tui.widgets.held import HeldPanel
from torchtop.tui.widgets.host import HostPanel
from torchtop.tui.widgets.loaders import LoaderPanel
from torchtop.tui.widgets.log import LogPanel
from torchtop.tui.widgets.memory import MemoryPanel
from torchtop.tui.widgets.ops import OpsPanel
from torchtop.tui.widgets.phase_info import PhaseInfo
from torchtop.tui.widgets.steps import StepPanel

#: The shortest time between two frames: new data is drawn as soon as it comes, but a job that
#: speaks all the time is drawn at most this often (10 frames a second is smooth to the eye).
MIN_FRAME_GAP_S = 0.1
#: The share of one core that drawing may take while a job speaks all the time: when frames
#: cost the app's thread X seconds each (a running average), each waits X / FRAME_BUDGET after
#: the last (at least MIN_FRAME_GAP_S, at most MAX_FRAME_GAP_S), so a costly screen is drawn
#: less often.
FRAME_BUDGET = 0.03
#: How much of the last frame's cost goes into the running average that sets the gap.
FRAME_COST_WEIGHT = 0.2
#: The longest a frame waits for the budget: new data still reaches the screen within a
#: quarter second (the time to the screen is this wait plus the way from the job, tens of ms).
MAX_FRAME_GAP_S = 0.2
#: Seconds of the job's time between two redraws of what moves without meaning more to the
#: eye when redrawn more often: the charts, the steps row (its counter and rates move at every
#: step, a hundred times a second for a fast job), the host and GPU figures (which change at
#: every sample) and the header (its uptime, advice and drop counts). The memory figures and
#: the log show every frame's data.
SLOW_REDRAW_S = 1.0
#: The most messages applied in one frame, so a burst (a replay's jump to the end) cannot
#: freeze the screen; the rest wait for the next frame.
MAX_MESSAGES_PER_FRAME = 50_000
#: Playback speeds that ``+`` and ``-`` step through.
SPEEDS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
#: Actions that only apply to a seekable source (a recording).
PLAYBACK_ACTIONS = frozenset({"toggle_pause", "jump_to_end", "faster", "slower"})
#: Keys that ask the job's agent for something: offered only while it is live.
REQUEST_ACTIONS = frozenset({"snapshot", "profile"})

#: The job screen's keys. They are the app's bindings (:class:`~torchtop.tui.app.TorchtopApp`),
#: acting on the job screen shown, so that they also work over the screens it opens (the OOM
#: screen, the help) as a job's keys always have. Each binding's tooltip is its line in the
#: help and the command palette (:mod:`torchtop.tui.palette`).
JOB_BINDINGS: list[BindingType] = [
    Binding(
        "q",
        "request_quit",
        "Quit",
        priority=True,
        tooltip="quit (asks first if torchtop started the job and it still runs)",
    ),
    # A monitor quits on ctrl+c like top does (Textual's default only hints at ctrl+q).
    Binding("ctrl+c", "request_quit", "Quit", show=False, priority=True),
    Binding("question_mark", "help", "Help", key_display="?", priority=True, tooltip="this help"),
    Binding(
        "l",
        "toggle_log",
        "Log",
        priority=True,
        tooltip="the log alone, full height; l again to go back",
    ),
    Binding("space", "toggle_pause", "Pause", priority=True, tooltip="recordings: play or pause"),
    Binding("e", "jump_to_end", "End", priority=True, tooltip="recordings: jump to the end"),
    Binding("end", "jump_to_end", "End", show=False, priority=True),
    # One hint for the two speed keys: a recording's footer fits 80 columns.
    Binding(
        "plus,equals_sign",
        "faster",
        "Speed",
        key_display="+/-",
        priority=True,
        tooltip="recordings: play faster",
    ),
    Binding(
        "minus",
        "slower",
        "Slower",
        key_display="-",
        show=False,
        priority=True,
        tooltip="recordings: slower",
    ),
    Binding(
        "o",
        "show_oom",
        "OOM",
        tooltip="the OOM screen: the last out-of-memory failure or snapshot (opens by itself)",
    ),
    Binding(
        "m",
        "snapshot",
        "Snapshot",
        tooltip="take a memory snapshot now: the same summary, and a file for memory_viz",
    ),
    Binding(
        "t",
        "toggle_ops",
        "Ops",
        tooltip="the ops panel alone, full height (op timings); t again to go back",
    ),
    # Off the footer: a recording's footer with its OOM key fills 80 columns already.
    Binding(
        "h",
        "toggle_held",
        "Held",
        show=False,
        tooltip="what holds memory: parameters, gradients, optimizer state, other, cache and "
        "fragmentation per device over time, and the top modules; h again to go back",
    ),
    Binding(
        "p",
        "profile",
        "Profile",
        tooltip="take an op-timing window now (its trace is kept for Perfetto)",
    ),
    Binding(
        "a",
        "advice",
        "Advice",
        tooltip="advice: what the rules found, with evidence, the fix and its demo",
    ),
    Binding(
        "escape",
        "clear_readings",
        "Clear chart readings",
        show=False,
        tooltip="take a chart's reading off (a click on a chart reads its values there)",
    ),
]
#: What the job screen's keys do: the app hands these to the job screen shown.
JOB_ACTIONS = frozenset(b.action for b in JOB_BINDINGS if isinstance(b, Binding))


class FrameWanted(TMessage):
    """New data is queued: draw a frame once the gap since the last one is over."""


class JobScreen(Screen[None]):
    """Header, memory with its chart, GPU and host, and the log, fed by one :class:`Source`.

    Its keys are the app's bindings (:data:`JOB_BINDINGS`), which act on the job screen shown
    (:attr:`TorchtopApp.shown_job <torchtop.tui.app.TorchtopApp.shown_job>`): so they work as
    well over the screens it opens (the OOM screen, the help), as they always have.
    ``opened_over``: it was opened over another screen (a rank's, over its run's), to which
    quitting it goes back."""

    def __init__(
        self,
        source: Source,
        *,
        title: str | None = None,
        opened_over: bool = False,
        against: Against | None = None,
    ) -> None:
        super().__init__()
        #: A second recording shown against this job (``replay --against``, the palette).
        self.against = against
        # A frame of new log lines draws the log's rows, not every panel's (:mod:`.compositor`).
        self._compositor = RowsCompositor()
        self.source = source
        self.opened_over = opened_over
        self.state = JobModel(mode=source.mode)
        if title is not None:  # a job's command line, or a file's name: not ours
            self.title = printable(title, one_line=True)
        # deque.append and popleft are atomic in CPython: the source's thread appends, the
        # app's timer pops, and neither needs a lock.
        self._pending: deque[Message] = deque()
        #: Which messages wake the app; the others wait for the next frame.
        self.wake_filter = WakeFilter()
        self._shown_version = -1
        self._shown_playback: Playback | None = None
        #: The job's time (``state.now``) when the charts and noisy figures were last redrawn;
        #: ``None``: redraw them at the next frame.
        self._slow_shown_at: float | None = None
        self._shown_connection = self.state.connection
        self._shown_offers: tuple[object, ...] = ()
        self._shown_silent_s: float | None = None
        #: Mounted: the source's thread may wake the app (before, on_mount drains what came).
        self._awake = False
        #: A frame is already asked for: messages that come meanwhile need no other wake-up.
        self._frame_asked = False
        #: When the last frame was drawn (``time.monotonic()``), for the gap between frames, and
        #: the app thread's CPU time then (``time.thread_time()``), for what the frame cost.
        self._last_frame = 0.0
        self._last_frame_cpu = time.thread_time()
        #: The gap before the next frame (:data:`FRAME_BUDGET`), from what the last frames
        #: cost the app's thread on average (seconds of CPU; ``None`` before the first).
        self.frame_gap_s = MIN_FRAME_GAP_S
        self._frame_cost: float | None = None
        self._leaving = False
        #: The garbage collector set for drawing, while the app runs (:mod:`.heap`).
        self._heap = SettledHeap()
        #: The frame asked for before the gap was over, due on the event loop's own clock.
        self._frame_due: asyncio.TimerHandle | None = None
        #: Frames drawn (drains that applied something or changed the playback), for tests and
        #: the benchmark.
        self.frames = 0
        #: ``state.captures.opened`` when last shown, and whether we asked for a snapshot.
        self._shown_captures = 0
        self._snapshot_asked = False
        #: ``state.ops`` when last shown, and whether we asked for an op window.
        self._shown_ops: OpsWindow | None = None
        self._profile_asked = False

    # -- layout --------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield JobHeader(id="header")
        with Vertical(id="body"):
            # The phase panel beside the chart shows only for phases with descriptions (demos).
            with Horizontal(id="memory-row"):
                yield MemoryPanel(id="memory")
                yield PhaseInfo(id="phase-info")
                yield ComparePanel(id="compare")
            with Horizontal(id="training"):  # steps and DataLoaders, once the job has any
                yield StepPanel(id="steps")
                yield LoaderPanel(id="loaders")
            with Horizontal(id="panels"):
                yield DevicePanel(id="device")
                yield HostPanel(id="host")
            yield LogPanel(id="log")
            yield OpsPanel(id="ops")  # `t`: in place of the rest
            yield HeldPanel(id="held")  # `h`: in place of the rest
        # ctrl+p is in the help: the footer has no room left for its hint at 80 columns.
        yield Footer(show_command_palette=False)

    def on_mount(self) -> None:
        self.query_one(StepPanel).against = self.against
        # The log has the focus at first, so the arrow keys scroll it; a click focuses a panel.
        self.query_one(LogPanel).focus()
        self._awake = True
        self._heap.settle()
        self._show()
        try:
            self.source.start(self.sink)
        except Exception as exc:  # a source that cannot start is shown, never a traceback
            self.sink(SourceDisconnected(time.time(), f"could not start: {exc}"))
        if self._pending:
            self._ask_frame()

    def on_unmount(self) -> None:
        self._heap.release()

    # -- feeding -------------------------------------------------------------------------------

    def sink(self, message: Message) -> None:
        """Queue a message and ask for a frame if none is asked for yet and the message may
        change what the screen shows (:mod:`.wake`); safe from any thread. (Two threads at once
        can at worst wake the app once too often or a second late.)"""
        self._pending.append(message)
        if self.wake_filter.wakes(message) and not self._frame_asked:
            self._ask_frame()

    def _ask_frame(self) -> None:
        """Wake the app's loop to draw a frame (from any thread). Two threads racing here ask
        twice, which costs one empty drain."""
        if not self._awake or self._leaving:
            return  # before mount: on_mount drains what came
        self._frame_asked = True
        self.post_message(FrameWanted())  # Textual hands it to the app's loop, thread-safely

    def on_frame_wanted(self, _message: FrameWanted) -> None:
        """On the app's loop: draw now, or once the last frame is ``frame_gap_s`` old."""
        if self._leaving:
            return
        wait = self._last_frame + self.frame_gap_s - time.monotonic()
        if wait <= 0:
            self.drain()
        elif self._frame_due is None:
            # A bare asyncio timer: a Textual one is a task and a message more per frame, each
            # a wake-up of the loop (a chatty job's frames are most of what the viewer costs).
            self._frame_due = asyncio.get_running_loop().call_later(wait, self._due_drain)

    def _due_drain(self) -> None:
        self._frame_due = None
        app = self.app
        if app._closing or app._closed or not self.is_attached:
            return
        try:
            self.drain()
        except Exception as error:  # shown and ended as Textual would for its own timer
            app._handle_exception(error)

    def drain(self) -> None:
        """Apply what arrived since the last frame and redraw what changed."""
        if self._leaving:
            return
        # Cleared first: a message that comes while this frame is drawn asks for the next one.
        self._frame_asked = False
        pending = self._pending
        for _ in range(min(len(pending), MAX_MESSAGES_PER_FRAME)):
            message = pending.popleft()
            try:
                self.state.apply(message)
            except Exception as exc:  # one odd message must not take the viewer down
                log.error(f"skipped {type(message).__name__}: {exc!r}")
        playback = self.playback
        if self.state.version != self._shown_version or playback != self._shown_playback:
            # Only a drawn frame sets the pace: a drain that changed nothing (a wake-up that
            # raced another) would otherwise start the gap again from its own small cost.
            self._last_frame = time.monotonic()
            self._pace()
            self.frames += 1
            self._show()
        if pending and not self._frame_asked:  # a burst longer than one frame takes: go on
            self._ask_frame()

    def _pace(self) -> None:
        """Set the gap before the next frame from what the app's thread spent since the last
        one began: that frame's drawing, Textual's compositing of it and whatever else the
        thread did meanwhile (drains that found nothing to draw, keys, the loop's wake-ups),
        so that a job that speaks all the time costs the thread :data:`FRAME_BUDGET` of a
        core."""
        cpu = time.thread_time()
        spent, self._last_frame_cpu = cpu - self._last_frame_cpu, cpu
        # Averaged over the last frames: the frame that redraws the charts once a second costs
        # a few others' worth, and its cost is spread over the gaps that follow it.
        cost = self._frame_cost
        cost = spent if cost is None else cost + FRAME_COST_WEIGHT * (spent - cost)
        self._frame_cost = cost
        self.frame_gap_s = min(MAX_FRAME_GAP_S, max(MIN_FRAME_GAP_S, cost / FRAME_BUDGET))

    @property
    def playback(self) -> Playback | None:
        """A recording's playback state; ``None`` for a live source."""
        if not self.source.seekable:
            return None
        return Playback(self.source.paused, self.source.speed)

    def _slow_due(self, state: JobModel, playback: Playback | None) -> bool:
        """Whether the charts, the header and the noisy figures are redrawn in this frame:
        once a second of the job's time, and at once when the connection, the playback or the
        job's silence changed (the last data before a pause or an end is always drawn, and the
        news that data flows again)."""
        now = state.now
        shown = self._slow_shown_at
        due = (
            shown is None
            or now is None
            or not 0 <= now - shown < SLOW_REDRAW_S
            or state.connection != self._shown_connection
            or playback != self._shown_playback
            or state.silent_s != self._shown_silent_s
        )
        if due:
            self._slow_shown_at = now
            self._shown_silent_s = state.silent_s
        return due

    def _show(self) -> None:
        state = self.state
        playback = self.playback
        slow = self._slow_due(state, playback)
        if slow:  # the header's uptime moves once a second
            self.query_one(JobHeader).show_state(state, playback)
        self.query_one(MemoryPanel).show_state(state, chart=slow)
        self._show_phase_info(state)
        self._show_training(state, slow)
        if slow:
            self.query_one(DevicePanel).show_state(state)
            self.query_one(HostPanel).show_state(state)
        self.query_one(LogPanel).show_state(state)
        self._shown_version = state.version
        self._shown_playback = playback
        if state.connection != self._shown_connection:
            self._shown_connection = state.connection
            self._announce_connection()
        self._show_captures(state)
        self._show_ops(state)
        if slow and self.query_one("#body").has_class("held-only"):
            self.query_one(HeldPanel).show_state(state)
        offers = self._offers()
        if offers != self._shown_offers:
            self._shown_offers = offers
            self.app.refresh_bindings()
        if isinstance(self.app.screen, AdviceScreen):
            self.app.screen.refresh_from(state)

    def _show_training(self, state: JobModel, slow: bool = True) -> None:
        """The step and loader row appears once the job has taken a step or iterated a loader,
        and is redrawn when ``slow`` figures are."""
        training = state.training
        if not training.has_data:
            return
        body = self.query_one("#body")
        if not body.has_class("has-training"):
            body.add_class("has-training")
            slow = True
        if slow:
            self.query_one(StepPanel).show_state(state)
            self.query_one(LoaderPanel).show_state(state)

    def _show_phase_info(self, state: JobModel) -> None:
        """The phase panel appears beside the memory chart once a phase has a description;
        the comparison's panel takes its place while a recording is compared."""
        row = self.query_one("#memory-row")
        comparing = self.query_one(ComparePanel).show_against(self.against)
        row.set_class(comparing, "has-compare")
        shown = not comparing and self.query_one(PhaseInfo).show_state(state)
        row.set_class(shown, "has-phase-info")

    def set_against(self, against: Against | None) -> None:
        """Show ``against`` beside this job (``None``: stop comparing)."""
        self.against = against
        self.query_one(StepPanel).against = against
        self._slow_shown_at = None  # the charts too, at once
        self._show()

    def _announce_connection(self) -> None:
        state = self.state
        screen = self.app.screen
        if state.connection in ("ended", "disconnected") and isinstance(screen, QuitScreen):
            screen.dismiss(None)  # nothing left to stop: q now simply quits
        if state.connection == "ended":
            code = state.exit_code
            ok = code == 0
            words = "exit status unknown" if code is None else f"exit code {code}"
            # One row, no title: the header says the same, and stays.
            self.app.notify(
                f"The job ended ({words}): q quits.",
                severity="information" if ok else "error",
                timeout=5,
            )
        elif state.connection == "disconnected" and state.mode != "replay":
            self.app.notify(
                "Connection lost, no exit status: data kept.", severity="error", timeout=6
            )

    # -- actions -------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Offer only the keys that apply: playback on a recording, a snapshot or an op window
        while the agent is live, the OOM screen once there is a failure or snapshot to show."""
        if action in PLAYBACK_ACTIONS:
            return self.source.seekable
        if action in REQUEST_ACTIONS:
            state = self.state
            live = state.connection == "live" and not state.job_ended
            return self.source.takes_requests and not self.source.seekable and live
        if action == "show_oom":
            return self.state.captures.latest is not None
        return True

    def _offers(self) -> tuple[object, ...]:
        """What the keys on offer depend on: the footer is redrawn when it changes."""
        state = self.state
        return (state.connection, state.job_ended, state.captures.latest is not None)

    # -- the command palette and the help (torchtop.tui.palette) --------------------------------

    def palette_commands(
        self, keys: list[Action], ops_keys: list[Action]
    ) -> list[tuple[Action, Callable[[], object]]]:
        """What ``ctrl+p`` offers: every action the keys have (``keys``, those that apply now),
        the ops panel's sort orders (``ops_keys``), and what has no key."""
        app = self.app
        commands: list[tuple[Action, Callable[[], object]]] = [
            (action, partial(app.run_action, action.action))
            for action in keys
            if self.check_action(action.action, ()) and action.action != "request_quit"
        ]
        for action in ops_keys:
            commands.append((action, partial(self._run_ops_action, action.action)))
        commands.append(
            (
                Action("q", "Quit", "quit the viewer (asks about a job torchtop started)", ""),
                self.action_request_quit,
            )
        )
        if self.source.owns_job and self.source.job_running():
            stop = Action("q s", "Stop the job and quit", "interrupt the job, then quit", "")
            detach = Action("q d", "Detach", "leave the job running and quit", "")
            commands.append((stop, partial(self._leave, stop_job=True)))
            commands.append((detach, partial(self._leave, stop_job=False)))
        window = self.state.ops
        if window is not None and window.trace_path:
            trace = Action(
                "", "Copy the trace's path", f"{window.trace_path} (open it in ui.perfetto.dev)", ""
            )
            commands.append((trace, partial(self._copy, window.trace_path, "the trace's path")))
        content = self.query_one(MemoryPanel).query_one("#memory-figures", Static).content
        figures = content.plain if isinstance(content, Text) else ""
        if figures:
            copy = Action("", "Copy the memory figures", figures.replace("\n", " · "), "")
            commands.append((copy, partial(self._copy, figures, "the memory figures")))
        compare = Action(
            "",
            "Compare with a recording",
            "open a second recording (B): its step time and data wait over this job's, aligned "
            "by step, and what changed beyond noise",
            "",
        )
        commands.append((compare, self._ask_against))
        if self.against is not None:
            stop = Action("", "Stop comparing", f"take {self.against.label} off the charts", "")
            commands.append((stop, partial(self.set_against, None)))
        return commands

    def _ask_against(self) -> None:
        self.app.push_screen(PathPrompt("Recording to compare with (B):"), self._open_against)

    def _open_against(self, path: str | None) -> None:
        """Recording ``path`` against this job as far as it has come; a file that cannot be
        read is said in one line."""
        if not path:
            return
        try:
            against = load_against(path, self.state)
        except RecordingError as exc:
            self.app.notify(str(exc), severity="error", timeout=8)
            return
        self.set_against(against)
        if against.error is not None:
            self.app.notify(f"Cannot compare: {against.error}", severity="warning", timeout=8)

    def _run_ops_action(self, action: str) -> None:
        """An ops panel action from the palette: the panel is shown first."""
        self._set_ops_shown(True)
        self.call_later(self.app.run_action, action, self.query_one(OpsPanel))

    def _copy(self, text: str, what: str) -> None:
        self.app.copy_to_clipboard(text)
        self.app.notify(
            f"Copied {what} (terminals that allow it put it on the clipboard).", timeout=3
        )

    def action_request_quit(self) -> None:
        """Quit; if torchtop started the job and it still runs, ask what to do with it."""
        if isinstance(self.app.screen, ModalScreen):
            return
        # Once the job's exit has arrived it is only tearing down: nothing is left to ask about.
        if self.source.owns_job and self.source.job_running() and not self.state.job_ended:
            self.app.push_screen(QuitScreen(), self._quit_chosen)
        else:
            self._leave(stop_job=False)

    def _quit_chosen(self, choice: str | None) -> None:
        if choice == "stop":
            self._leave(stop_job=True)
        elif choice == "detach":
            self._leave(stop_job=False)

    def _leave(self, *, stop_job: bool) -> None:
        """Stop the job or let it be; then quit, or, for a job screen opened over another
        screen (a rank's, over its run's), go back to that screen."""
        self._leaving = True
        app = self.app
        opened_over = self.opened_over and self in app.screen_stack
        try:
            if stop_job:
                self.source.stop_job()
            else:
                self.source.close()
        except Exception as exc:  # say what went wrong in one line, not a traceback
            if not opened_over:
                app.exit(1, return_code=1, message=f"torchtop: {exc}")
                return
            app.notify(f"torchtop: {exc}", severity="error")
        if not opened_over:
            app.exit(0, return_code=0)
            return
        while app.screen is not self:  # the OOM screen, the help: they go with it
            app.pop_screen()
        app.pop_screen()

    def action_help(self) -> None:
        if not isinstance(self.app.screen, HelpScreen):
            self.app.push_screen(HelpScreen())

    def action_advice(self) -> None:
        """The advice rules' findings, with evidence, fix and demo."""
        if not isinstance(self.app.screen, AdviceScreen):
            self.app.push_screen(AdviceScreen(self.state))

    def action_clear_readings(self) -> None:
        """Esc: the values a click read off a chart are taken off it."""
        for chart in self.query(TimeSeriesChart):
            chart.clear_reading()

    def action_toggle_log(self) -> None:
        self._set_ops_shown(False)
        self._set_held_shown(False)
        self.query_one("#body").toggle_class("log-only")

    # -- what holds memory (torchtop.tui.widgets.held) -------------------------------------------

    def _set_held_shown(self, shown: bool) -> None:
        body = self.query_one("#body")
        body.set_class(shown, "held-only")
        if shown:
            self._set_ops_shown(False)  # and the ops table's focus goes with it
            body.remove_class("log-only")
            self.query_one(HeldPanel).show_state(self.state)

    def action_toggle_held(self) -> None:
        """What holds memory, per device over time, in place of the panels; ``h`` again to
        go back."""
        self._set_held_shown(not self.query_one("#body").has_class("held-only"))

    def action_toggle_pause(self) -> None:
        self.source.set_paused(not self.source.paused)
        self.drain()

    def action_jump_to_end(self) -> None:
        self.source.jump_to_end()
        self.drain()

    def action_faster(self) -> None:
        faster = [s for s in SPEEDS if s > self.source.speed + 1e-9]
        if faster:
            self.source.set_speed(faster[0])
        self.drain()

    def action_slower(self) -> None:
        slower = [s for s in SPEEDS if s < self.source.speed - 1e-9]
        if slower:
            self.source.set_speed(slower[-1])
        self.drain()

    # -- out of memory and snapshots (torchtop.tui.oom_screen) ---------------------------------

    def _show_captures(self, state: JobModel) -> None:
        """Open the OOM screen on a new failure (or a snapshot this viewer asked for), and keep
        an open one up to date."""
        captures = state.captures
        screen = self.app.screen
        if captures.opened != self._shown_captures:
            self._shown_captures = captures.opened
            latest = captures.latest
            if latest is not None and (latest.is_oom or self._snapshot_asked):
                self._snapshot_asked = self._snapshot_asked and latest.is_oom
                self._open_capture(latest)
                return
            if latest is not None:
                where = latest.capture.snapshot_path or latest.capture.snapshot_error
                self.app.notify(f"Memory snapshot: {where}. Press o to see it.", timeout=8)
        if isinstance(screen, OomScreen):
            screen.refresh_from(state)

    def _open_capture(self, entry: CaptureEntry) -> None:
        screen = self.app.screen
        if isinstance(screen, OomScreen):
            screen.show_entry(entry)
            return
        self.app.push_screen(
            OomScreen(entry, self.state, on_close=self._capture_closed, on_resume=self._resume)
        )

    def _capture_closed(self, entry: CaptureEntry) -> None:
        """Closing the OOM screen dismisses the failure: a job held at one goes on."""
        held = self.state.captures.holding
        if held is not None:
            self._resume(held)

    def _resume(self, entry: CaptureEntry) -> None:
        """Let a job held at ``entry``'s failure go on (``--pause-on-oom``)."""
        if self.source.send_request(REQUEST_RESUME):
            self.app.notify("The job resumes: its OutOfMemoryError unwinds now.", timeout=6)
        else:
            self.app.notify("Cannot reach the agent to resume the job.", severity="warning")

    def action_show_oom(self) -> None:
        if isinstance(self.app.screen, OomScreen):
            return
        captures = self.state.captures
        shown = captures.holding or captures.latest  # the failure the job is held at, first
        if shown is None:
            self.app.notify("No out-of-memory failure or snapshot yet (m takes a snapshot).")
            return
        self._open_capture(shown)

    def action_snapshot(self) -> None:
        """Ask the agent for a memory snapshot now; the screen opens when it arrives."""
        if self.source.send_request(REQUEST_SNAPSHOT):
            self._snapshot_asked = True
            self.app.notify("Taking a memory snapshot…", timeout=4)
        else:
            self.app.notify(
                "Snapshots need a running agent (not a recording, and still connected).",
                severity="warning",
            )

    # -- op timings (torchtop.tui.widgets.ops) ---------------------------------------------------

    def _show_ops(self, state: JobModel) -> None:
        """Keep the ops panel up to date while it shows; open it when the window this viewer
        asked for comes."""
        panel = self.query_one(OpsPanel)
        if self.query_one("#body").has_class("ops-only"):
            panel.show_state(state)
        window = state.ops
        if window is not self._shown_ops:
            self._shown_ops = window
            if window is not None and window.requested and self._profile_asked:
                self._profile_asked = False
                self._set_ops_shown(True)
        if self.query_one("#body").has_class("ops-only") and self.focused is None:
            panel.focus_table()  # the table appears with the first window: its keys apply

    def _set_ops_shown(self, shown: bool) -> None:
        body = self.query_one("#body")
        body.set_class(shown, "ops-only")
        panel = self.query_one(OpsPanel)
        if shown:
            body.remove_class("log-only")
            body.remove_class("held-only")
            panel.show_state(self.state)
            panel.focus_table()
        elif panel.has_focus_within:
            self.set_focus(None)

    def action_toggle_ops(self) -> None:
        """The ops panel alone, full height; ``t`` again to go back."""
        self._set_ops_shown(not self.query_one("#body").has_class("ops-only"))

    def action_profile(self) -> None:
        """Ask the agent for an op-timing window now; the ops panel opens when it arrives."""
        if self.source.send_request(REQUEST_PROFILE):
            self._profile_asked = True
            unavailable = self.state.ops_unavailable
            if unavailable is not None:
                self.app.notify(f"Asked for an op window, but {unavailable}.", severity="warning")
            else:
                self.app.notify("Taking an op-timing window…", timeout=4)
        else:
            self.app.notify(
                "Op windows need a running agent (not a recording, and still connected).",
                severity="warning",
            )

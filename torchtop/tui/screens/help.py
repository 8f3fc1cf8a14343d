"""The help (``?``): the job screen's keys and what each of its panels means."""

from __future__ import annotations

from typing import Protocol, cast

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from torchtop import __version__
from torchtop.tui.palette import Action, help_rows


class KeyedApp(Protocol):
    """What the help reads of the app (:class:`~torchtop.tui.app.TorchtopApp`): its keys."""

    def actions(self) -> list[Action]: ...

    def ops_actions(self) -> list[Action]: ...


#: The help's line for Textual's command palette.
PALETTE_KEYS = ("^p", "the command palette: every action here, themes, copy a figure or a path")
#: The help's line for the log's own keys (Textual's scrolling keys, not the app's bindings).
LOG_KEYS = ("↑↓ PgUp PgDn", "scroll the log (or the mouse wheel); at its end it follows again")
HELP_PANELS = (
    (
        "Header",
        "command, pid, uptime; ● live, ◌ no data for N s (the job is stuck or stopped), "
        "■ ended · exit N or ✕ connection lost; the advice's findings (\"1 critical, 2 "
        'warnings"; a shows them)',
    ),
    (
        "Memory",
        "the GPUs the job uses (the others beneath), else the CPU. [cyan]allocated[/]: "
        "tensors; [magenta]reserved[/]: the caching allocator's hold; cache: reserved minus "
        "allocated; fragmented: free pieces of split segments; OOMs: failures the job saw "
        "(+ those torch handled). CPU: heap (or RSS) and RSS. The chart: the last 2 minutes "
        "(all once the job ends), phases and ◆ marks beneath; a click on it reads the values "
        "at that time (a second click or Esc takes them off).",
    ),
    (
        "Held",
        "h: what holds each device's memory over time, stacked from the bottom, one letter "
        "per cell: P parameters, G gradients, O optimizer state (read from the optimizers the "
        "job steps, each storage once), A everything else allocated (activations, "
        "temporaries, buffers, inputs, parameters under no optimizer), C cache (reserved "
        "less allocated), F fragmentation; · allocated, not split yet. Each category held "
        "gets a cell at least; on the CPU the bars split the heap (RSS above it is in the "
        "first lines). Beneath: the top modules by activation memory at a step's peak, from "
        "the latest memory window.",
    ),
    (
        "Phase",
        "beside the chart, only when the job's phases carry descriptions (the demos): the "
        "running phase, what it does and why; ■ ended once it is over",
    ),
    ("GPU", "from NVML: utilisation, memory, temperature, power, SM clock"),
    (
        "Steps",
        "shown once the job steps an optimizer (or calls torchtop.step()). Recent step time, "
        "steps/s, samples/s; [yellow]wait[/]: blocked on the next batch (first batches, "
        "worker start-up, in [magenta]magenta[/]); [green]compute[/]: the rest, with the "
        "[blue]optimizer[/] in it. Bars: the last steps; chart: step time over time. "
        "INPUT-BOUND: 30% or more of recent step time waits for data.",
    ),
    (
        "Loaders",
        "each DataLoader: batch size, workers and start method, pin, prefetch, persistent; "
        "its workers alive (● running, ○ exited), their CPU and RSS; the last first-batch latency",
    ),
    (
        "Ops",
        "op timings from short torch.profiler windows the agent takes now and then: per op "
        "its calls, total time (with the ops it called), self time (without), average per "
        "call, % of the window, and device self time when kernels ran. Above: the window's "
        "length, steps and cost, the next one, host-device sync points and copies per step, "
        "and its Chrome trace (open it in ui.perfetto.dev).",
    ),
    ("Host", "the job's CPU, RSS, threads, children (DataLoader workers); system RAM"),
    ("Log", "the job's output; stderr in yellow"),
)


def help_table(app: KeyedApp) -> Table:
    """Keys and panels in two columns, so long descriptions wrap under themselves. The keys
    come from the bindings (:mod:`.commands`), so the help lists exactly what the keys do."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    table.add_row("[b u]Keys[/]", "")
    for keys, what in help_rows([app.actions(), [], app.ops_actions()]):
        table.add_row(keys, what)
        if what == "this help":
            table.add_row(*PALETTE_KEYS)
            table.add_row(*LOG_KEYS)
    table.add_row("", "")
    table.add_row("[b u]Panels[/]", "")
    for panel, what in HELP_PANELS:
        table.add_row(panel, what)
    return table


class HelpScreen(ModalScreen[None]):
    """The keys and what each panel means."""

    BINDINGS = [
        Binding("escape,question_mark,q", "close", "Close"),
    ]

    def compose(self) -> ComposeResult:
        # At 80x24 the help is twice the screen's height: the box scrolls, and has the focus
        # so the arrow and page keys scroll it.
        with VerticalScroll(id="help-dialog", can_focus=True) as dialog:
            dialog.border_title = f"torchtop {__version__} help"
            dialog.border_subtitle = "↑↓ PgUp PgDn scroll · esc, ? or q close"
            yield Static(help_table(cast("KeyedApp", self.app)), id="help-text")

    def on_mount(self) -> None:
        self.query_one("#help-dialog").focus()

    def action_close(self) -> None:
        self.dismiss(None)

"""The job header: what runs, where, for how long, and whether the viewer still hears it."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from rich.text import Text
from textual import on
from textual.events import Resize
from textual.widgets import Static

from torchtop.model.job import JobModel
from torchtop.tui.format import format_clock
from torchtop.tui.widgets.quiet import update_if_changed


@dataclass(frozen=True)
class Playback:
    """A recording's playback, for the header: paused or playing, and how fast."""

    paused: bool
    speed: float


#: The multiplication sign, for speeds ("x2") and counts of identical GPUs ("4x H100").
TIMES = "\u00d7"


def _speed(speed: float) -> str:
    return f"{TIMES}{speed:g}"


def connection_badge(state: JobModel, playback: Playback | None = None) -> Text:
    """``● live``, ``◌ no data for 12 s``, ``■ ended · exit 0``, ``✕ connection lost``,
    ``⏸ replay paused x2``."""
    if state.connection == "ended":
        code = state.exit_code
        if code is None:
            return Text("■ ended · exit ?", "bold yellow")
        if code < 0:
            return Text(f"■ ended · killed (signal {-code})", "bold red")
        return Text(f"■ ended · exit {code}", "bold green" if code == 0 else "bold red")
    if state.connection == "disconnected":
        if state.mode == "replay":
            return Text("■ recording ends", "bold yellow")
        return Text("✕ connection lost", "bold red")
    if playback is not None:
        if playback.paused:
            return Text(f"⏸ replay paused {_speed(playback.speed)}", "bold yellow")
        return Text(f"▶ replay {_speed(playback.speed)}", "bold green")
    if state.connection == "connecting":
        return Text("◌ connecting", "bold yellow")
    if state.silent_s is not None:
        return Text(f"◌ no data for {state.silent_s:.0f} s", "bold yellow")
    return Text("● running" if state.mode == "run" else "● live", "bold green")


def connection_detail(state: JobModel) -> Text | None:
    """A second-row line that matters more than the job's versions: why the connection ended."""
    if state.connection == "disconnected":
        reason = state.disconnect_reason or "the connection closed"
        if state.mode == "replay":
            return Text(f"no exit status recorded ({reason})", "yellow")
        return Text(f"{reason}, no exit status: job killed?", "bold red")
    if state.connection == "ended" and state.exit_reason:
        return Text(state.exit_reason, "bold" if state.exit_code == 0 else "bold red")
    return None


def devices_summary(state: JobModel) -> str:
    """``cuda:0 NVIDIA H200``, ``4x NVIDIA H100``, or ``cpu``."""
    devices = [d for d in state.devices if d.id != "cpu"]
    if not devices:
        return "cpu"
    names = {d.name for d in devices}
    if len(devices) > 1 and len(names) == 1:
        return f"{len(devices)}{TIMES} {devices[0].name}"
    return ", ".join(f"{d.id} {d.name}" for d in devices)


def agent_cost(state: JobModel) -> str:
    """``torchtop 0.4% of step``, or ``torchtop 0.2% of a core`` while the job takes no step;
    empty before the agent has measured itself. The share measured by pausing the agent where
    there is one (it sees the GIL), its threads' CPU share of the step time where not."""
    stats = state.agent_stats
    if stats is None or state.job_ended:
        return ""
    if stats.measured_step_share is not None:
        return f"torchtop {max(0.0, stats.measured_step_share):.1%} of step"
    if stats.step_share is not None:
        return f"torchtop {stats.step_share:.1%} of step"
    if stats.cpu_share is not None:
        return f"torchtop {stats.cpu_share:.1%} of a core"
    return ""


def header_rows(state: JobModel, playback: Playback | None = None) -> list[tuple[Text, Text]]:
    """The header's two rows, each a left part (may be cut) and a right part (kept whole)."""
    hello = state.hello
    command = Text()
    command.append_text(connection_badge(state, playback))
    command.append("  ")
    if hello is not None:
        command.append(shlex.join(hello.argv) if hello.argv else "?", "bold")
    right = Text()
    if hello is not None:
        right.append("pid ", "dim")
        right.append(str(hello.pid))
        right.append("  up ", "dim")
        right.append(format_clock(state.uptime))

    about = Text()
    detail = connection_detail(state)
    if detail is not None:
        about.append_text(detail)
    elif hello is not None:
        about.append(devices_summary(state))
        about.append(" · torch ", "dim")
        if hello.torch:
            about.append(hello.torch)
        elif hello.python == "?":  # seen from outside the job: unknown
            about.append("?")
        else:  # the agent starts first; a new hello names the version once torch is imported
            going = state.connection in ("connecting", "live") and not state.job_ended
            about.append("not imported yet" if going else "not imported", "dim italic")
        about.append(" · python ", "dim")
        about.append(hello.python.split()[0] if hello.python else "—")
        if hello.hostname:
            about.append(" · ", "dim")
            about.append(hello.hostname)
    if state.status_text and state.connection == "connecting":
        if about:
            about.append(" · ", "dim")
        about.append(state.status_text, "italic")
    elif hello is None and state.connection == "connecting":
        about.append("waiting for the agent…", "dim italic")
    drops = Text()
    cost = agent_cost(state)
    if cost:
        drops.append(cost, "dim")
    advice = state.advice.summary()
    if advice:
        worst = state.advice.findings[0].severity
        if drops:
            drops.append("  ")
        drops.append(f"⚑ {advice} (a)", "bold red" if worst == "critical" else "bold yellow")
    if state.dropped > 0:
        if drops:
            drops.append("  ")
        drops.append(f"⚠ {state.dropped} dropped", "bold yellow")
    return [(command, right), (about, drops)]


def header_text(rows: list[tuple[Text, Text]], width: int) -> Text:
    """The rows fitted to ``width`` cells: each left part cut with an ellipsis where it would
    reach its row's right part, which stays whole. Plain text rather than a Rich table (which
    cost the viewer more to render than all its other panels)."""
    lines = []
    for left, right in rows:
        line = Text(" ", no_wrap=True)
        room = max(0, width - 1 - (right.cell_len + 1 if right else 0))
        part = left.copy()
        part.truncate(room, overflow="ellipsis", pad=bool(right))
        line.append_text(part)
        if right:
            line.append(" ")
            line.append_text(right)
        lines.append(line)
    return Text("\n", no_wrap=True).join(lines)


class JobHeader(Static):
    """Two rows: connection state and command, pid and uptime; devices, versions and drops."""

    DEFAULT_CSS = """
    JobHeader {
        height: 2;
        padding: 0 1;
        background: $panel;
    }
    """

    _rows: list[tuple[Text, Text]] | None = None

    def show_state(self, state: JobModel, playback: Playback | None = None) -> None:
        """Redraw from ``state`` and, for a recording, its playback."""
        self._rows = header_rows(state, playback)
        self._fit()

    @on(Resize)
    def _fit(self) -> None:
        width = self.content_region.width
        if self._rows is not None and width > 0:
            update_if_changed(self, header_text(self._rows, width))

"""The device panel: one compact line per NVIDIA GPU as NVML sees it, or why there is none."""

from __future__ import annotations

from rich.text import Text
from textual import on
from textual.events import Resize
from textual.widgets import Static

from torchtop.model.energy import gpu_key
from torchtop.model.job import JobModel
from torchtop.protocol import GpuStats
from torchtop.tui.format import MISSING, format_percent, format_used_total
from torchtop.tui.widgets.quiet import update_if_changed


def energy_cell(state: JobModel, gpu: GpuStats) -> Text | None:
    """``41.2 J/step`` (``153 J/step``) over the recent readings: NVML's energy counter over
    the steps between them; ``no energy counter`` for a GPU without one; ``None`` before two
    readings."""
    entry = state.energy.get(gpu_key(gpu))
    if entry is None or gpu.lost:
        return None
    if entry.supported is False:
        return Text("no energy counter", "dim")
    span = entry.recent(state.training)
    if span is None or span.per_step is None:
        return None
    joules = span.per_step
    return Text(f"{joules:.0f} J/step" if joules >= 100 else f"{joules:.3g} J/step")


def gpu_line(gpu: GpuStats, energy: Text | None = None) -> Text:
    """``GPU0  98%  60.1/80.0 GiB  65°C  410 W  41.2 J/step  1980 MHz``: utilisation first;
    units say the rest, so the line needs no column headings. Once the agent has matched GPUs
    to the job's CUDA devices, the job's say which (``GPU2 cuda:0``) and the others
    ``(other)``. ``energy`` (:func:`energy_cell`) follows the power."""
    line = Text(no_wrap=True, overflow="ellipsis")
    if gpu.mig_parent is not None:
        line.append(f"GPU{gpu.mig_parent}·MIG{gpu.index}", "bold")
    else:
        line.append(f"GPU{gpu.index:<2}", "bold")
    # Whose GPU: the job's CUDA device it is, or another job's (NVML sees the whole node).
    if gpu.cuda_device is not None:
        line.append(f" {gpu.cuda_device}", "green")
    elif gpu.in_job is False:
        line.append(" (other)", "dim")
    if gpu.lost:
        line.append(" lost: NVML reports the GPU gone", "bold red")
        return line
    util = gpu.util_gpu_percent
    util_style = "bold green" if util is not None and util >= 70 else ""
    line.append(f"{format_percent(util):>4}", util_style)
    line.append(f"  {format_used_total(gpu.memory_used_bytes, gpu.memory_total_bytes):>13}")
    temp = MISSING if gpu.temperature_c is None else f"{gpu.temperature_c:.0f}°C"
    hot = gpu.temperature_c is not None and gpu.temperature_c >= 85
    line.append(f"  {temp:>4}", "bold red" if hot else "")
    power = MISSING if gpu.power_w is None else f"{gpu.power_w:.0f} W"
    line.append(f"  {power:>5}")
    if energy is not None:  # beside the power, before the clock a narrow panel cuts first
        line.append("  ")
        line.append_text(energy)
    clock = MISSING if gpu.clock_sm_mhz is None else f"{gpu.clock_sm_mhz} MHz"
    line.append(f"  {clock:>8}", "dim")
    return line


def nvml_unavailable_line(detail: str) -> Text:
    """``no NVIDIA GPU: <reason>``, one row (the panel's title says NVML already)."""
    reason = detail.removeprefix("NVML not available: ")
    return Text.assemble(("no NVIDIA GPU: ", "bold yellow"), (reason, "yellow"))


def device_text(state: JobModel, width: int | None = None) -> Text:
    """The panel's lines: GPUs first, one row each (or one row saying there is none, and why),
    cut to ``width`` with an ellipsis; then any probe that is not available and why, whole."""
    rows: list[Text] = [gpu_line(gpu, energy_cell(state, gpu)) for gpu in state.gpu_rows]
    nvml = state.nvml
    if not rows:
        if nvml is not None and not nvml.available:
            rows.append(nvml_unavailable_line(nvml.detail))
        elif nvml is not None:
            rows.append(Text("NVML: waiting for the first reading…", "dim"))
        elif state.connection in ("connecting", "live"):
            rows.append(Text("GPU: no NVML reading yet", "dim"))
        else:
            rows.append(Text("GPU: no NVML readings", "dim"))
    if width:
        for row in rows:
            row.truncate(width, overflow="ellipsis")
    lines = list(rows)
    for name, status in state.probes.items():
        if status is nvml or status.available:
            continue
        lines.append(Text(f"{name}: {status.detail}", "dim"))
    return Text("\n").join(lines)


class DevicePanel(Static):
    """Utilisation, memory, temperature, power and clock of each GPU, one line each."""

    #: A click focuses the panel (and the palette can maximize it).
    can_focus = True

    BORDER_TITLE = " GPU · NVML "
    DEFAULT_CSS = """
    DevicePanel {
        height: auto;
    }
    """

    _state: JobModel | None = None

    def show_state(self, state: JobModel) -> None:
        """Redraw from ``state``."""
        self._state = state
        self._fit()

    @on(Resize)
    def _fit(self) -> None:
        """The rows are cut at the panel's width: drawn again when it changes."""
        if self._state is not None:
            update_if_changed(self, device_text(self._state, self.content_region.width))

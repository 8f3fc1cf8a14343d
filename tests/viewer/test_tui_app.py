"""The viewer driven by Pilot at 80x24 with a scripted source.

Each test drains the job screen's queue itself (``app.job.drain()``) instead of waiting for the
frame timer, then asserts on what the widgets hold and on the state, never on timing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import io
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import pytest
from fakes.source import FakeSource
from rich.console import Console
from textual.pilot import Pilot
from textual.widgets import Static

from torchtop.model.job import JobModel
from torchtop.protocol import (
    DeviceInfo,
    Dropped,
    GpuSample,
    GpuStats,
    Hello,
    HostStats,
    JobExited,
    LogLine,
    Marked,
    MemoryStats,
    Message,
    PhaseBegan,
    PhaseEnded,
    ProbeStatus,
    Sample,
)
from torchtop.streams.source import Sink, Source, SourceConnected, SourceDisconnected
from torchtop.tui.app import TorchtopApp
from torchtop.tui.screens.help import HelpScreen
from torchtop.tui.screens.quit import QuitScreen
from torchtop.tui.widgets.chart import TimeSeriesChart
from torchtop.tui.widgets.device import DevicePanel
from torchtop.tui.widgets.header import JobHeader
from torchtop.tui.widgets.host import HostPanel
from torchtop.tui.widgets.log import LogPanel
from torchtop.tui.widgets.memory import MemoryPanel

T0 = 1_700_000_000.0
GiB = 1 << 30
MiB = 1 << 20
SIZE = (80, 24)


# -- scripted jobs ------------------------------------------------------------------------------


def hello(*, cuda: bool) -> Hello:
    devices = [DeviceInfo("cpu", "cpu")]
    if cuda:
        devices.append(DeviceInfo("cuda:0", "NVIDIA H200", 141 * GiB))
    return Hello(
        protocol=1,
        pid=4242,
        argv=["python", "train.py", "--epochs", "3"],
        cwd="/work",
        started_at=T0 - 83,
        python="3.11.9",
        torch="2.4.0",
        devices=devices,
        interval_s=0.1,
    )


HOST = HostStats(3 * GiB, 104.0, 24, 4, 120 * GiB, 251 * GiB)


def cuda_job(seconds: int = 30) -> list[Message]:
    messages: list[Message] = [
        SourceConnected(T0, "/run/torchtop/4242.sock"),
        hello(cuda=True),
        ProbeStatus(T0, "nvml", True, "NVML 12.550"),
        PhaseBegan(T0, "repeat", 1),
    ]
    for i in range(seconds * 10):
        t = T0 + i / 10
        if i == seconds * 5:
            messages += [PhaseEnded(t, "repeat", 1), PhaseBegan(t, "broadcast", 2)]
        allocated = 4 * GiB if i == seconds * 10 - 1 else (2 + i % 3) * GiB
        memory = MemoryStats(
            "cuda:0",
            "cuda-allocator",
            allocated,
            6 * GiB,
            peak_allocated_bytes=5 * GiB,
            peak_reserved_bytes=6 * GiB,
            inactive_split_bytes=GiB // 2,
            num_alloc_retries=1,
            num_ooms=0,
            free_bytes=80 * GiB,
            total_bytes=141 * GiB,
        )
        messages.append(Sample(t, HOST, [memory]))
    messages += [
        Marked(T0 + 5, "checkpoint"),
        GpuSample(
            T0 + seconds,
            [
                GpuStats(
                    0,
                    "NVIDIA H200",
                    97.0,
                    60.0,
                    61 * GiB,
                    141 * GiB,
                    66.0,
                    412.0,
                    clock_sm_mhz=1980,
                )
            ],
        ),
        LogLine(T0 + 1, "stdout", "epoch 1 step 10 loss 2.3010"),
        LogLine(T0 + 2, "stderr", "UserWarning: TypedStorage is deprecated"),
    ]
    return messages


def cpu_job() -> list[Message]:
    messages: list[Message] = [
        hello(cuda=False),
        ProbeStatus(T0, "nvml", False, "libnvidia-ml.so.1: cannot open shared object file"),
    ]
    for i in range(50):
        memory = MemoryStats("cpu", "cpu-heap", 382 * MiB, 858 * MiB)
        messages.append(Sample(T0 + i / 10, HOST, [memory]))
    return messages


# -- helpers -------------------------------------------------------------------------------------


def pilot_test(scenario: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async Pilot scenario as a plain test (no pytest plugin needed); its arguments
    (``parametrize``) pass through."""

    @functools.wraps(scenario)
    def test(*args: Any, **kwargs: Any) -> None:
        asyncio.run(scenario(*args, **kwargs))

    return test


def static_text(widget: Static) -> str:
    """What a Static shows, as plain text at its own width."""
    console = Console(
        width=widget.content_region.width or SIZE[0], file=io.StringIO(), color_system=None
    )
    with console.capture() as capture:
        console.print(widget.content)
    return capture.get()


def header_text(app: TorchtopApp) -> str:
    return static_text(app.job.query_one(JobHeader))


def memory_text(app: TorchtopApp) -> str:
    panel = app.job.query_one(MemoryPanel)
    return static_text(panel.query_one("#memory-figures", Static))


def chart_text(app: TorchtopApp) -> str:
    return app.job.query_one(TimeSeriesChart).render_text().plain


def device_text(app: TorchtopApp) -> str:
    return static_text(app.job.query_one(DevicePanel))


def host_text(app: TorchtopApp) -> str:
    return static_text(app.job.query_one(HostPanel))


def log_text(app: TorchtopApp) -> list[str]:
    return [strip.text.rstrip() for strip in app.job.query_one(LogPanel).lines]


async def drained(pilot: Pilot[int]) -> None:
    """Apply everything the source delivered, and let the screen settle."""
    app = pilot.app
    assert isinstance(app, TorchtopApp)
    app.job.drain()
    await pilot.pause()


@asynccontextmanager
async def running(
    source: FakeSource | list[Message], *, size: tuple[int, int] = SIZE, notifications: bool = False
) -> AsyncIterator[tuple[TorchtopApp, Pilot[int]]]:
    """The viewer on ``source`` (or a fake source of these messages) at ``size``, with what
    the source delivered on start drawn."""
    app = TorchtopApp(source if isinstance(source, FakeSource) else FakeSource(source))
    async with app.run_test(size=size, notifications=notifications) as pilot:
        await drained(pilot)
        yield app, pilot


# -- what the panels show ------------------------------------------------------------------------


@pilot_test
async def test_header_names_the_job() -> None:
    app = TorchtopApp(FakeSource(cuda_job()))
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        header = header_text(app)
        assert "● live" in header
        assert "python train.py --epochs 3" in header
        assert "pid 4242" in header
        assert "up 0:01:53" in header  # from 83 s before T0 to the last message, at T0 + 30
        assert "cuda:0 NVIDIA H200" in header
        assert "dropped" not in header


def test_a_job_that_has_not_imported_torch_yet_says_so_in_the_header() -> None:
    """The agent starts before the script imports torch: its version is pending, not "—"."""
    from torchtop.model import JobModel
    from torchtop.tui.widgets.header import header_rows

    state = JobModel()
    state.apply_all([SourceConnected(T0, "x"), dataclasses.replace(hello(cuda=False), torch=None)])
    about = header_rows(state)[1][0].plain
    assert "torch not imported yet" in about and "—" not in about
    state.apply(dataclasses.replace(hello(cuda=False), torch="2.4.0"))
    assert "torch 2.4.0" in header_rows(state)[1][0].plain


@pilot_test
async def test_cuda_memory_figures_and_chart() -> None:
    app = TorchtopApp(FakeSource(cuda_job()))
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        figures = memory_text(app)
        assert "allocated 4.00 GiB" in figures
        assert "reserved 6.00 GiB" in figures
        assert "peak 5.00 GiB / 6.00 GiB" in figures
        assert "cache 2.00 GiB" in figures and "fragmented 512 MiB" in figures
        assert "retries 1" in figures
        assert "OOMs 0" in figures
        assert "device 61.0/141.0 GiB" in figures
        assert app.job.query_one(MemoryPanel).border_title == " Memory · cuda:0 "
        chart = chart_text(app)
        assert any(0x2800 < ord(c) < 0x2900 for c in chart), chart
        phase_row = chart.splitlines()[-1]
        assert "repeat" in phase_row and "broadcast" in phase_row and "◆" in phase_row
        assert app.job.state.primary_device == "cuda:0"


def screen_lines(widget: TimeSeriesChart) -> list[str]:
    """The chart's lines as they go to the terminal."""
    return [widget.render_line(y).text for y in range(widget.size.height)]


@pilot_test
async def test_a_click_on_the_chart_writes_its_reading_on_screen_and_a_second_clears_it() -> None:
    app = TorchtopApp(FakeSource(cuda_job()))
    async with app.run_test(size=(120, 40)) as pilot:
        await drained(pilot)
        chart = app.job.query_one(TimeSeriesChart)
        before = screen_lines(chart)
        assert len(before) == chart.size.height
        assert all(len(line) == chart.size.width for line in before)
        assert before == chart.render_text().plain.split("\n")
        assert not any("allocated" in line for line in before)
        await pilot.click(chart, offset=(chart.size.width - 3, 1))
        await pilot.pause()
        reading = screen_lines(chart)
        assert chart.cursor is not None
        assert "allocated 4.0G" in reading[0] and "reserved 6.0G" in reading[0], reading[0]
        await pilot.click(chart, offset=(chart.size.width - 3, 1))
        await pilot.pause()
        assert chart.cursor is None and screen_lines(chart) == before


@pilot_test
async def test_cpu_memory_is_labelled_heap_and_rss() -> None:
    app = TorchtopApp(FakeSource(cpu_job()))
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        figures = memory_text(app)
        assert "heap 382 MiB" in figures
        assert "RSS 858 MiB" in figures
        assert "allocated" not in figures and "retries" not in figures
        assert app.job.query_one(MemoryPanel).border_title == " Memory · cpu "


@pilot_test
async def test_device_panel_says_why_there_is_no_gpu() -> None:
    app = TorchtopApp(FakeSource(cpu_job()))
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        text = " ".join(device_text(app).split())
        assert "no NVIDIA GPU: libnvidia-ml.so.1: cannot open" in text


@pilot_test
async def test_device_panel_shows_a_line_per_gpu() -> None:
    app = TorchtopApp(FakeSource(cuda_job()))
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        text = device_text(app)
        assert "GPU0" in text and "97%" in text and "61.0/141.0 GiB" in text
        assert "66°C" in text and "412 W" in text and "1980 MHz" in text
        app.job.sink(GpuSample(T0 + 40, [GpuStats(0, "NVIDIA H200", lost=True)]))
        await drained(pilot)
        assert "lost" in device_text(app)
        # Matched to the job's CUDA devices: the job's first, saying which; the others marked.
        matched = [
            GpuStats(3, "NVIDIA H200", 88.0, cuda_device="cuda:0", in_job=True),
            GpuStats(0, "NVIDIA H200", 12.0, in_job=False),
        ]
        app.job.sink(GpuSample(T0 + 41, matched))
        await drained(pilot)
        first, second = [line for line in device_text(app).splitlines() if "GPU" in line][:2]
        assert first.split()[:3] == ["GPU3", "cuda:0", "88%"], first
        assert second.split()[:2] == ["GPU0", "(other)"], second


@pilot_test
async def test_host_panel() -> None:
    app = TorchtopApp(FakeSource(cuda_job()))
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        text = host_text(app)
        assert "CPU 104%" in text and "RSS 3.00 GiB" in text
        assert "threads 24" in text and "children 4" in text
        assert "system 120.0/251.0 GiB" in text


@pilot_test
async def test_log_lines_appear_once_each() -> None:
    source = FakeSource(cuda_job())
    app = TorchtopApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        assert log_text(app) == [
            "epoch 1 step 10 loss 2.3010",
            "UserWarning: TypedStorage is deprecated",
        ]
        source.deliver([LogLine(T0 + 3, "stdout", " 10%\r 50%\r100%")])
        await drained(pilot)
        await drained(pilot)  # a frame with nothing new writes nothing
        assert log_text(app)[-1] == "100%"
        assert len(log_text(app)) == 3
        assert app.job.query_one(LogPanel).border_title == " Log · 3 lines "


@pilot_test
async def test_drops_show_in_the_header() -> None:
    app = TorchtopApp(FakeSource([*cuda_job(), Dropped(T0 + 30, 17)]))
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        assert "17 dropped" in header_text(app)


@pilot_test
async def test_redraws_only_when_the_state_changed() -> None:
    source = FakeSource(cuda_job(), deliver_on_start=False)
    app = TorchtopApp(source)
    async with app.run_test(size=SIZE) as pilot:
        shown: list[int] = []
        panel = app.job.query_one(MemoryPanel)
        original = panel.show_state

        def counting_show_state(state: JobModel, **kwargs: bool) -> None:
            shown.append(state.version)
            original(state, **kwargs)

        panel.show_state = counting_show_state  # type: ignore[method-assign]
        app.job.drain()
        app.job.drain()
        assert shown == []
        source.deliver()
        app.job.drain()
        app.job.drain()
        assert shown == [app.job.state.version]
        await pilot.pause()


# -- the end of a job ----------------------------------------------------------------------------


@pilot_test
async def test_job_exit_keeps_the_viewer_open_with_the_exit_code() -> None:
    source = FakeSource(
        [*cuda_job(), JobExited(T0 + 31, 1, ""), SourceDisconnected(T0 + 31, "job exited")]
    )
    app = TorchtopApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        await pilot.pause()
        assert app.is_running
        assert app.job.state.job_ended and app.job.state.exit_code == 1
        assert "ended · exit 1" in header_text(app)
        # The final figures stay on screen.
        assert "allocated 4.00 GiB" in memory_text(app)
        assert not source.called("close")


@pilot_test
async def test_disconnect_without_exit_shows_lost_and_keeps_the_data() -> None:
    source = FakeSource([*cuda_job(), SourceDisconnected(T0 + 31, "connection reset by peer")])
    app = TorchtopApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        assert app.is_running
        header = header_text(app)
        assert "connection lost" in header
        assert "job killed?" in header
        assert "connection reset by peer" in header
        assert app.job.state.lost
        assert "allocated 4.00 GiB" in memory_text(app)
        assert len(log_text(app)) == 2


class BrokenSource(Source):
    def start(self, sink: Sink) -> None:
        raise OSError("no agent at /run/torchtop/1.sock")


@pilot_test
async def test_a_source_that_cannot_start_is_shown_not_raised() -> None:
    app = TorchtopApp(BrokenSource())
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        assert app.is_running
        assert "could not start: no agent at /run/torchtop/1.sock" in header_text(app)


# -- quitting ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("owned", "running", "keys", "asks", "stops"),
    [
        # A job torchtop only watches: q closes the source at once.
        (False, False, ("q",), False, False),
        # A running job torchtop runs: q asks; d detaches (the job runs on), s stops it.
        (True, True, ("q", "d"), True, False),
        (True, True, ("q", "s"), True, True),
        (True, True, ("ctrl+c", "d"), True, False),
        # A job torchtop ran that has ended: nothing to ask.
        (True, False, ("q",), False, False),
    ],
    ids=["watched", "q-detach", "q-stop", "ctrl+c-detach", "ended"],
)
@pilot_test
async def test_quitting(
    owned: bool, running: bool, keys: tuple[str, ...], asks: bool, stops: bool
) -> None:
    source = FakeSource(cuda_job(), mode="run" if owned else None, owns_job=owned, running=running)
    app = TorchtopApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        await pilot.press(keys[0])
        await pilot.pause()
        assert isinstance(app.screen, QuitScreen) == asks
        if asks:
            assert app.is_running
            await pilot.press(*keys[1:])
            await pilot.pause()
    # Stopping hands the job's end to the source; every other way out closes it.
    assert source.called("stop_job") == stops
    assert source.called("close") != stops
    assert app.return_value == 0 and app.return_code == 0


@pilot_test
async def test_escape_cancels_the_quit() -> None:
    source = FakeSource(cuda_job(), mode="run", owns_job=True, running=True)
    app = TorchtopApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        await pilot.press("q")
        await pilot.pause()
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, QuitScreen)
        assert app.is_running
        assert source.calls == [("start",)]
        await pilot.press("q", "d")
        await pilot.pause()


# -- help, log view, replay keys -----------------------------------------------------------------


@pilot_test
async def test_question_mark_opens_help() -> None:
    app = TorchtopApp(FakeSource(cuda_job()))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        help_text = static_text(app.screen.query_one("#help-text", Static))
        assert "fragmented" in help_text and "quit" in help_text
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, HelpScreen)


@pilot_test
async def test_l_toggles_the_full_height_log() -> None:
    app = TorchtopApp(FakeSource(cuda_job()))
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        log = app.job.query_one(LogPanel)
        normal_height = log.size.height
        await pilot.press("l")
        await pilot.pause()
        assert not app.job.query_one(MemoryPanel).display
        assert log.size.height > normal_height
        await pilot.press("l")
        await pilot.pause()
        assert app.job.query_one(MemoryPanel).display
        assert log.size.height == normal_height


@pilot_test
async def test_replay_keys_drive_a_seekable_source() -> None:
    source = FakeSource(cuda_job(), mode="replay", seekable=True)
    app = TorchtopApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        assert "▶ replay \u00d71" in header_text(app)
        await pilot.press("space")
        await pilot.press("plus")
        await pilot.pause()
        assert "⏸ replay paused \u00d72" in header_text(app)
        await pilot.press("space", "minus", "minus", "e", "end")
        await pilot.pause()
    assert source.calls[1:] == [
        ("set_paused", True),
        ("set_speed", 2.0),
        ("set_paused", False),
        ("set_speed", 1.0),
        ("set_speed", 0.5),
        ("jump_to_end",),
        ("jump_to_end",),
    ]


@pilot_test
async def test_replay_keys_do_nothing_on_a_live_source() -> None:
    source = FakeSource(cuda_job())
    app = TorchtopApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        await pilot.press("space", "plus", "minus", "e")
        await pilot.pause()
        assert source.calls == [("start",)]


@pilot_test
async def test_unreadable_values_show_as_dashes() -> None:
    messages: list[Message] = [
        Hello(1, 1, [], "/", T0, "", None, [DeviceInfo("cuda:0", "?")], 0.1),
        Sample(
            T0,
            HostStats(None, None, None, None, None, None),
            [MemoryStats("cuda:0", "cuda-allocator", None, None)],
        ),
        GpuSample(T0, [GpuStats(0, None)]),
    ]
    app = TorchtopApp(FakeSource(messages))
    async with app.run_test(size=SIZE) as pilot:
        await drained(pilot)
        assert "allocated —" in memory_text(app)
        assert "cache —" in memory_text(app) and "fragmented —" in memory_text(app)
        assert "GPU0" in device_text(app) and "—" in device_text(app)
        assert "CPU —" in host_text(app)
        assert "torch not imported yet" in header_text(app)  # pending: a later hello names it
        assert chart_text(app)

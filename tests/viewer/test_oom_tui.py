"""The OOM screen driven by Pilot at 80x24, with captures made by the agent's own flow."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import pytest
from fakes.allocator import fail_into_job
from fakes.source import RequestingSource
from rich.console import Console
from test_tui_app import SIZE, T0, cuda_job, drained, pilot_test, static_text
from textual.widgets import DataTable, Static

from torchtop.agent.core import AgentConfig
from torchtop.agent.oom import OomController
from torchtop.model.captures import MemoryCaptures
from torchtop.model.job import JobModel
from torchtop.protocol import (
    REQUEST_RESUME,
    REQUEST_SNAPSHOT,
    MemorySnapshotTaken,
    Message,
    OomResumed,
    OutOfMemory,
    PhaseBegan,
)
from torchtop.tui.app import TorchtopApp
from torchtop.tui.screens.help import HelpScreen
from torchtop.tui.screens.oom import OomScreen, banner_text, site_rows, stack_text
from torchtop.tui.widgets.chart import TimeSeriesChart

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GiB = 1 << 30


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> OutOfMemory:
    """The fragmented fixture through the agent's real flow, at the end of ``cuda_job()``."""
    data = json.loads((FIXTURES / "cuda_snapshot_fragmented.json").read_text())
    messages: list[Message] = []
    controller = OomController(
        AgentConfig(),
        messages.append,
        pid=4242,
        snapshot_dir=tmp_path_factory.mktemp("snapshots"),
    )
    controller.cuda_sources = {
        "snapshot": lambda: data["snapshot"],
        "stats": lambda device: data["memory_stats"],
        "grad_enabled": lambda: True,
    }
    o = data["observer"]
    # As torch does: the observer, then the error raised into the job's code.
    args = (o["device"], o["alloc"], o["device_total"], o["device_free"])
    fail_into_job(controller.observe_cuda_oom, args)
    (event,) = [m for m in messages if isinstance(m, OutOfMemory)]
    return dataclasses.replace(event, t=T0 + 29.5)


def plain(renderable: Any, width: int = 80) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    with console.capture() as capture:
        console.print(renderable)
    return capture.get()


def screen_of(app: TorchtopApp) -> OomScreen:
    screen = app.screen
    assert isinstance(screen, OomScreen), type(screen)
    return screen


def text_of(screen: OomScreen, selector: str) -> str:
    return static_text(screen.query_one(selector, Static))


def test_the_oom_screen_opens_by_itself_and_explains(captured: OutOfMemory) -> None:
    @pilot_test
    async def scenario() -> None:
        app = TorchtopApp(RequestingSource([*cuda_job(), captured]))
        async with app.run_test(size=SIZE) as pilot:
            await drained(pilot)
            screen = screen_of(app)
            banner = " ".join(text_of(screen, "#oom-banner").split())
            assert "OUT OF MEMORY cuda:0 at 0:01:52 · phase broadcast · autograd on" in banner
            assert "requested 2.00 GiB free 1.12 GiB / 79.2 GiB" in banner
            assert "reserved 77.0 GiB allocated 63.5 GiB" in banner
            assert "Fragmented: 14.6 GiB free, but the largest free block is 1.50 GiB" in banner
            assert "failed at forward (model.py:88)" in banner
            assert "4242-oom-1.pickle" in banner
            table = screen.query_one("#oom-sites", DataTable)
            assert table.row_count == 6
            assert [str(c) for c in table.get_row_at(0)] == [
                "27.0 GiB",
                "2",
                "train_step train.py:150",
            ]
            stack = text_of(screen, "#oom-stack")
            assert "adamw.py:119" in stack and "train.py:150" in stack
            advice = text_of(screen, "#oom-advice-pane #oom-advice")
            assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in advice
            assert "torchtop demo memory" in advice
            chart = screen.query_one(TimeSeriesChart).render_text().plain
            assert "◆" in chart.splitlines()[-1] and any(0x2800 < ord(c) < 0x2900 for c in chart)
            assert screen.query_one(TimeSeriesChart).marks[0].t == captured.t

    scenario()


def test_moving_through_sites_shows_each_stack_and_enter_widens_it(
    captured: OutOfMemory,
) -> None:
    @pilot_test
    async def scenario() -> None:
        app = TorchtopApp(RequestingSource([*cuda_job(), captured]))
        async with app.run_test(size=SIZE) as pilot:
            await drained(pilot)
            screen = screen_of(app)
            await pilot.press("down")
            await pilot.pause()
            stack = text_of(screen, "#oom-stack")
            assert "→ forward" in stack and "model.py:88" in stack and "linear.py:125" in stack
            await pilot.press("enter")
            await pilot.pause()
            assert screen.query_one("#oom-middle").has_class("-wide")
            assert "/home/alice/llm/model.py:88" in text_of(screen, "#oom-stack")
            await pilot.press("enter")
            await pilot.pause()
            assert not screen.query_one("#oom-middle").has_class("-wide")

    scenario()


def test_escape_closes_o_reopens_and_nothing_is_resumed(captured: OutOfMemory) -> None:
    @pilot_test
    async def scenario() -> None:
        source = RequestingSource([*cuda_job(), captured])
        app = TorchtopApp(source)
        async with app.run_test(size=SIZE) as pilot:
            await drained(pilot)
            screen_of(app)
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, OomScreen)
            await drained(pilot)  # the same capture does not open the screen again
            assert not isinstance(app.screen, OomScreen)
            await pilot.press("o")
            await pilot.pause()
            screen_of(app)
            await pilot.press("o")
            await pilot.pause()
            assert not isinstance(app.screen, OomScreen)
        assert source.requests() == []

    scenario()


def test_a_held_job_is_resumed_when_the_screen_closes(captured: OutOfMemory) -> None:
    held = dataclasses.replace(captured, paused=True, pause_timeout_s=300.0)

    @pilot_test
    async def scenario() -> None:
        source = RequestingSource([*cuda_job(), held])
        app = TorchtopApp(source)
        async with app.run_test(size=SIZE) as pilot:
            await drained(pilot)
            screen = screen_of(app)
            banner = text_of(screen, "#oom-banner")
            assert "THE JOB IS HELD AT THIS FAILURE" in banner and "esc resumes it" in banner
            assert screen.check_action("resume", ()) is True
            await pilot.press("escape")
            await pilot.pause()
            assert source.requests() == [REQUEST_RESUME]
            source.deliver([OomResumed(T0 + 31, held.id, "dismissed")])
            await drained(pilot)
            assert app.job.state.captures.holding is None
            await pilot.press("o")
            await pilot.pause()
            screen = screen_of(app)
            assert "the job went on (dismissed)" in text_of(screen, "#oom-banner")
            assert screen.check_action("resume", ()) is False
            await pilot.press("escape")
            await pilot.pause()
        assert source.requests() == [REQUEST_RESUME]  # once: it was no longer held

    scenario()


def test_m_takes_a_snapshot_that_opens_in_the_screen(captured: OutOfMemory) -> None:
    snapshot = MemorySnapshotTaken(
        **{
            f.name: getattr(captured, f.name)
            for f in dataclasses.fields(MemorySnapshotTaken)
            if f.name not in ("request_id", "requested_bytes", "fragmented", "requested_stack")
        },
        requested_bytes=None,
        fragmented=None,
        request_id=1,
    )

    @pilot_test
    async def scenario() -> None:
        source = RequestingSource(cuda_job())
        app = TorchtopApp(source)
        async with app.run_test(size=SIZE) as pilot:
            await drained(pilot)
            await pilot.press("m")
            await pilot.pause()
            assert source.requests() == [REQUEST_SNAPSHOT]
            source.deliver([snapshot])
            await drained(pilot)
            screen = screen_of(app)
            banner = text_of(screen, "#oom-banner")
            assert "MEMORY SNAPSHOT" in banner and "requested" not in banner
            assert "no verdict" in banner
            assert "Nothing failed here" in text_of(screen, "#oom-advice")

    scenario()


def test_a_snapshot_someone_else_asked_for_only_notifies(captured: OutOfMemory) -> None:
    other = MemorySnapshotTaken(
        **{
            f.name: getattr(captured, f.name)
            for f in dataclasses.fields(MemorySnapshotTaken)
            if f.name not in ("request_id",)
        },
        request_id=9,
    )

    @pilot_test
    async def scenario() -> None:
        app = TorchtopApp(RequestingSource([*cuda_job(), other]))
        async with app.run_test(size=SIZE) as pilot:
            await drained(pilot)
            assert not isinstance(app.screen, OomScreen)
            assert app.job.state.captures.latest is not None

    scenario()


def test_a_recording_cannot_resume_or_snapshot_but_shows_the_oom(captured: OutOfMemory) -> None:
    held = dataclasses.replace(captured, paused=True, pause_timeout_s=1.0)

    @pilot_test
    async def scenario() -> None:
        source = RequestingSource(
            [*cuda_job(), held], reachable=False, mode="replay", seekable=True
        )
        app = TorchtopApp(source)
        async with app.run_test(size=SIZE) as pilot:
            await drained(pilot)
            screen_of(app)
            await pilot.press("escape")
            await pilot.pause()
            await pilot.press("m")
            await pilot.pause()
            assert app.is_running and not isinstance(app.screen, OomScreen)
            await pilot.press("question_mark")
            await pilot.pause()
            assert isinstance(app.screen, HelpScreen)
            assert "memory snapshot now" in static_text(app.screen.query_one("#help-text", Static))

    scenario()


def test_eval_phase_with_grad_on_suggests_no_grad(captured: OutOfMemory) -> None:
    state = JobModel()
    state.apply_all([*cuda_job(), PhaseBegan(T0 + 29.0, "eval", 9), captured])
    (entry,) = state.captures.entries
    assert "phase eval" in plain(banner_text(entry, state))
    from torchtop.model.job import capture_evidence
    from torchtop.model.oom_advice import suggest

    assert [s.id for s in suggest(capture_evidence(state, captured))][:2] == [
        "expandable-segments",
        "no-grad",
    ]


def test_pure_parts(captured: OutOfMemory) -> None:
    rows = site_rows(captured)
    assert rows[1] == ("18.0 GiB", "8", "forward model.py:88")
    assert "no site" in plain(stack_text(None))
    captures = MemoryCaptures()
    assert captures.apply(captured) and not captures.apply(captured)  # a replayed history
    assert captures.opened == 1 and captures.ooms == 1
    assert not captures.apply(OomResumed(1.0, 999, "timeout"))


def test_a_snapshot_taken_while_held_keeps_the_hold_and_esc_resumes(
    captured: OutOfMemory,
) -> None:
    held = dataclasses.replace(captured, paused=True, pause_timeout_s=300.0)
    snapshot = MemorySnapshotTaken(
        **{
            f.name: getattr(captured, f.name)
            for f in dataclasses.fields(MemorySnapshotTaken)
            if f.name not in ("id", "request_id", "requested_bytes", "fragmented")
        },
        id=2,
        requested_bytes=None,
        fragmented=None,
        request_id=1,
    )

    @pilot_test
    async def scenario() -> None:
        source = RequestingSource([*cuda_job(), held])
        app = TorchtopApp(source)
        async with app.run_test(size=SIZE) as pilot:
            await drained(pilot)
            await pilot.press("m")
            source.deliver([snapshot])
            await drained(pilot)
            screen = screen_of(app)
            banner = text_of(screen, "#oom-banner")
            assert "MEMORY SNAPSHOT" in banner and "THE JOB IS HELD AT OOM #1" in banner
            await pilot.press("escape")
            await pilot.pause()
            assert source.requests() == [REQUEST_SNAPSHOT, REQUEST_RESUME]

    scenario()


def test_the_memory_panel_shows_the_emulated_limit() -> None:
    from torchtop.protocol import MemoryStats, Sample
    from torchtop.tui.widgets.memory import memory_figures

    MiB = 1 << 20
    state = JobModel()
    stats = MemoryStats(
        "cpu", "cpu-tensors", 130 * MiB, 746 * MiB, peak_allocated_bytes=225 * MiB,
        num_ooms=1, free_bytes=126 * MiB, total_bytes=256 * MiB,
    )  # fmt: skip
    state.apply(Sample(T0, None, [stats]))
    text = memory_figures(state).plain
    assert "allocated 130 MiB" in text and "RSS 746 MiB" in text
    assert "emulated limit 256 MiB   free 126 MiB   OOMs 1" in text

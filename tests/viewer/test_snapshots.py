"""The key screens as the user sees them, at 80x24 and 120x40, compared with SVG snapshots
reviewed by eye (``tests/viewer/__snapshots__/test_snapshots/``). Deterministic: every time on
screen comes from the messages (fixed ``T0``), nothing blinks, the theme is the default (the tests'
own config folder), and the OOM capture's files are named, not made.

After a change that is meant to alter a screen: ``pytest tests/viewer/test_snapshots.py
--snapshot-update``, then look at the new SVGs (``git diff``) before committing them."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

import pytest

pytest.importorskip("pytest_textual_snapshot")  # the dev extra

from fakes.source import FakeSource
from test_held_tui import _split_capture, held_job
from test_oom_tui import captured  # noqa: F401 (the fixture)
from test_ops_tui import ops_job, window
from test_steps_tui import training_job
from test_tui_app import T0, cpu_job, cuda_job, drained
from textual.pilot import Pilot

from torchtop.model.connection import SourceDisconnected
from torchtop.protocol import JobExited, Message, OutOfMemory
from torchtop.tui.app import TorchtopApp

SIZES = [pytest.param((80, 24), id="80x24"), pytest.param((120, 40), id="120x40")]

SnapCompare = Callable[..., bool]


async def settled(pilot: Pilot[int]) -> None:
    """Everything delivered is drawn."""
    await drained(pilot)
    await pilot.pause()


def app_of(messages: list[Message], **source: bool) -> TorchtopApp:
    return TorchtopApp(FakeSource(messages, **source))


def keys_then_settled(*keys: str) -> Callable[[Pilot[int]], Awaitable[None]]:
    async def run(pilot: Pilot[int]) -> None:
        await settled(pilot)
        await pilot.press(*keys)
        await settled(pilot)

    return run


@pytest.mark.parametrize("size", SIZES)
def test_main_screen_cuda_job(snap_compare: SnapCompare, size: tuple[int, int]) -> None:
    assert snap_compare(app_of(cuda_job()), terminal_size=size, run_before=settled)


@pytest.mark.parametrize("size", SIZES)
def test_main_screen_cpu_job(snap_compare: SnapCompare, size: tuple[int, int]) -> None:
    assert snap_compare(app_of(cpu_job()), terminal_size=size, run_before=settled)


@pytest.mark.parametrize("size", SIZES)
def test_steps_input_bound(snap_compare: SnapCompare, size: tuple[int, int]) -> None:
    app = app_of(training_job(wait=0.05))
    assert snap_compare(app, terminal_size=size, run_before=settled)


@pytest.mark.parametrize("size", SIZES)
def test_ops_table(snap_compare: SnapCompare, size: tuple[int, int]) -> None:
    app = app_of(ops_job(window(trace_path="/tmp/torchtop/4242-ops-1.json")))
    assert snap_compare(app, terminal_size=size, run_before=keys_then_settled("t"))


@pytest.mark.parametrize("size", SIZES)
def test_help(snap_compare: SnapCompare, size: tuple[int, int]) -> None:
    app = app_of(cuda_job())
    assert snap_compare(app, terminal_size=size, run_before=keys_then_settled("question_mark"))


@pytest.mark.parametrize("size", SIZES)
def test_replay_paused(snap_compare: SnapCompare, size: tuple[int, int]) -> None:
    app = app_of(cuda_job(), mode="replay", seekable=True)  # type: ignore[arg-type]
    assert snap_compare(app, terminal_size=size, run_before=keys_then_settled("space"))


async def settled_without_toasts(pilot: Pilot[int]) -> None:
    """Drawn, without the notification of the end: it times out after seconds, which a slow
    machine could reach before the screenshot (the header says the same, and stays)."""
    await settled(pilot)
    pilot.app.clear_notifications()
    await pilot.pause()


@pytest.mark.parametrize("size", SIZES)
def test_the_job_ended(snap_compare: SnapCompare, size: tuple[int, int]) -> None:
    end = [JobExited(T0 + 31, 0, ""), SourceDisconnected(T0 + 31, "job exited")]
    app = app_of([*cuda_job(), *end])
    assert snap_compare(app, terminal_size=size, run_before=settled_without_toasts)


@pytest.mark.parametrize("size", SIZES)
def test_the_job_lost(snap_compare: SnapCompare, size: tuple[int, int]) -> None:
    lost = [SourceDisconnected(T0 + 31, "the connection closed")]
    app = app_of([*cuda_job(), *lost])
    assert snap_compare(app, terminal_size=size, run_before=settled_without_toasts)


@pytest.mark.parametrize("size", SIZES)
def test_oom_screen(
    snap_compare: SnapCompare,
    size: tuple[int, int],
    captured: OutOfMemory,  # noqa: F811
) -> None:
    named = dataclasses.replace(captured, snapshot_path="/tmp/torchtop/4242-oom-1.pickle")
    assert snap_compare(app_of([*cuda_job(), named]), terminal_size=size, run_before=settled)


@pytest.mark.parametrize("size", SIZES)
def test_what_holds_memory(snap_compare: SnapCompare, size: tuple[int, int]) -> None:
    app = app_of(held_job())
    assert snap_compare(app, terminal_size=size, run_before=keys_then_settled("h"))


def test_oom_screen_with_the_split(snap_compare: SnapCompare) -> None:
    app = app_of([*cuda_job(), _split_capture()])
    assert snap_compare(app, terminal_size=(80, 24), run_before=settled)

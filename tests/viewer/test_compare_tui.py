"""A second recording against the one shown, under Pilot at 80x24: ``replay A --against B``
draws B's step time and data wait over A's, aligned by step, and the comparison's verdict beside
the memory chart; the palette opens one (the letters of its path are the path's, not keys) and
takes it off again."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_compare import T0, hello, step_frames
from test_tui_app import SIZE, drained, pilot_test
from test_viewer_idioms import palette_choose
from textual.widgets import Input

from torchtop.model.compare import compare_jobs
from torchtop.protocol import Message, StepStats, encode
from torchtop.streams.sources import RecordingSource
from torchtop.tui.app import TorchtopApp
from torchtop.tui.screens.path_prompt import PathPrompt
from torchtop.tui.widgets.compare import (
    ComparePanel,
    against,
    compare_text,
    fold_messages,
    load_against,
)
from torchtop.tui.widgets.steps import StepTimeChart


def recording(median: float, wait_share: float, seed: int, steps: int = 120) -> list[Message]:
    """A job's hello and its steps, ten to a frame, log-normal around ``median``, waiting
    ``wait_share`` of each for data."""
    rng = random.Random(seed)
    durations = [median * rng.lognormvariate(0, 0.1) for _ in range(steps)]
    return [hello(), *step_frames(durations, wait_share, t0=T0 + 1)]


def write(path: Path, messages: list[Message]) -> Path:
    path.write_bytes(b"".join(encode(m) for m in messages))
    return path


SLOW = recording(0.05, 0.4, seed=1)  # A: waits 40% of each step for data
FAST = recording(0.03, 0.05, seed=2)  # B: workers keep the batches coming


def panel_text(app: TorchtopApp) -> str:
    return compare_text(app.job.against).plain if app.job.against else ""


@pilot_test
async def test_replay_against_draws_b_by_step_and_the_verdict_beside_the_chart() -> None:
    b = against("fast.ttr", fold_messages(SLOW), FAST, multi_rank=False)
    app = TorchtopApp(RecordingSource(SLOW, speed=1.0), title="slow.ttr", against=b)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("e")  # to the end of A
        await drained(pilot)
        panel = app.job.query_one(ComparePanel)
        assert panel.display and panel.region.width >= 30 and panel.region.height >= 4
        assert "has-compare" in app.job.query_one("#memory-row").classes
        text = panel_text(app)
        first = text.splitlines()[0]
        assert first.startswith("changed: step time median"), text
        assert "data wait share" in first
        # The same verdict as torchtop compare's, from the one implementation.
        model = compare_jobs(fold_messages(SLOW), fold_messages(FAST))
        assert first == "changed: " + ", ".join(model.changed)
        assert "faster" in text and "lower" in text
        # B's step time and wait on A's time axis: B's step N at A's step N's end.
        chart = app.job.query_one(StepTimeChart)
        series = {s.label: s for s in chart.series}
        assert {"step", "wait", "B step", "B wait"} <= set(series)
        a_ends = [m.ends for m in SLOW if isinstance(m, StepStats)]
        b_durations = [d for m in FAST if isinstance(m, StepStats) for d in m.durations]
        a_times = [t for ends in a_ends for t in ends][1:]  # A's timed steps' ends
        assert [t for t, _ in series["B step"].points] == a_times
        assert [v for _, v in series["B step"].points] == b_durations[1:]
        assert text.splitlines()[1] == "step chart: B step B wait"


@pilot_test
async def test_the_palette_opens_a_recording_to_compare_and_takes_it_off(tmp_path: Path) -> None:
    # A path whose letters are keys of the viewer (l: log, e: end, t: ops, q: quit).
    path = write(tmp_path / "fast-equal-total.ttr", FAST)
    app = TorchtopApp(RecordingSource(SLOW, speed=1.0), title="slow.ttr")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("e")
        await drained(pilot)
        assert not app.job.query_one(ComparePanel).display
        await palette_choose(pilot, "Compare with a recording")
        assert isinstance(app.screen, PathPrompt)
        assert isinstance(app.focused, Input)
        await pilot.press(*str(path), "enter")
        await drained(pilot)
        assert app.job.against is not None and app.job.against.label == str(path)
        assert "log-only" not in app.job.query_one("#body").classes
        assert app.job.query_one(ComparePanel).display
        assert panel_text(app).startswith("changed: step time median")
        await palette_choose(pilot, "Stop comparing")
        await drained(pilot)
        assert app.job.against is None
        assert not app.job.query_one(ComparePanel).display
        labels = {s.label for s in app.job.query_one(StepTimeChart).series}
        assert "B step" not in labels


@pilot_test
async def test_a_file_that_is_not_a_recording_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("not a recording\n")
    app = TorchtopApp(RecordingSource(SLOW, speed=1.0), title="slow.ttr")
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await drained(pilot)
        app.job._open_against(str(bad))
        await pilot.pause()
        assert app.job.against is None
        (note,) = list(app._notifications)
        assert "is not a torchtop recording" in note.message and "\n" not in note.message


def test_the_step_time_median_comes_first_when_only_other_figures_changed() -> None:
    """A short panel (80x24) shows the first few figures: the step time median is one of them
    even where it is within noise and the figures that changed come before it in the report."""
    same_pace = recording(0.05, 0.05, seed=3)  # B: the same step time, far less data wait
    b = against("w4.ttr", fold_messages(SLOW), same_pace, multi_rank=False)
    assert b.report is not None
    median = next(c for c in b.report["step_figures"] if c["key"] == "step_time_median_s")
    assert not median["changed"] and "data wait share" in b.report["changed"]
    lines = compare_text(b).plain.splitlines()
    assert lines[0].startswith("changed: ") and "step time median" not in lines[0]
    assert "step time median" in lines[2], lines
    changed = [line for line in lines[3:] if line.startswith(("lower", "higher", "faster"))]
    assert changed and lines.index(changed[0]) == 3, lines


def test_a_recording_without_steps_is_shown_with_why_it_cannot_be_compared(
    tmp_path: Path,
) -> None:
    idle = write(tmp_path / "idle.ttr", SLOW[:1])
    b = load_against(idle, fold_messages(SLOW))
    assert b.report is None and b.error == "recording B has no timed steps to compare"
    assert compare_text(b).plain == "cannot compare: recording B has no timed steps to compare"


def test_replay_against_a_missing_recording_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchtop.commands import main

    a = write(tmp_path / "a.ttr", SLOW)
    assert main(["replay", str(a), "--against", str(tmp_path / "b.ttr")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("torchtop: no recording at") and str(tmp_path / "b.ttr") in err
    assert "\n" not in err

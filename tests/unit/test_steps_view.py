"""Steps and DataLoaders as the viewer and the report read them: from messages, without an app."""

from __future__ import annotations

import pytest

from torchtop.model.job import JobModel
from torchtop.model.training import StepPoint, TrainingState, weighted_quantile
from torchtop.protocol import (
    LoaderInfo,
    LoaderStats,
    PhaseBegan,
    PhaseEnded,
    StepStats,
    WorkerStats,
    decode,
    encode,
    step_detail_weights,
)
from torchtop.report.job import summarize
from torchtop.tui.format import format_seconds, format_seconds_short
from torchtop.tui.widgets.steps import (
    nice_seconds,
    render_step_bars,
    scale_top,
)

T0 = 1_700_000_000.0


def steps_frame(
    t: float,
    total: int,
    durations: list[float | None],
    *,
    wait: float = 0.0,
    startup: float = 0.0,
    optimizer: float = 0.001,
    samples: int = 32,
    skipped_total: int = 0,
    count: int | None = None,
) -> StepStats:
    """A frame whose listed steps end one after the other, ``duration`` apart, up to ``t``."""
    timed = [d for d in durations if d is not None]
    ends: list[float] = []
    end = t
    for d in reversed(durations):
        ends.append(end)
        end -= d or 0.0
    ends.reverse()
    n = len(durations)
    count = n if count is None else count
    return StepStats(
        t=t,
        total=total,
        skipped_total=skipped_total,
        count=count,
        skipped=0,
        timed=len(timed) * count // n,
        time_s=sum(timed) * count / n,
        wait_s=wait * len(timed) * count / n,
        startup_s=startup,
        optimizer_s=optimizer * len(timed) * count / n,
        samples=samples * len(timed) * count // n,
        ends=ends,
        durations=durations,
        waits=[wait] * n,
        startups=[0.0] * n,
        optimizer=[optimizer] * n,
        batch_samples=[samples] * n,
    )


def loaders_frame(t: float) -> LoaderInfo:
    return LoaderInfo(
        t,
        [
            LoaderStats(
                0,
                "loader 0",
                "ImageFolder",
                32,
                4,
                True,
                2,
                False,
                "fork",
                batches=100,
                samples=3200,
                wait_s=4.0,
                epochs=2,
                first_batch_s=2.5,
                last_first_batch_s=1.2,
                workers=[
                    WorkerStats(101, True, 95.0, 300 << 20),
                    WorkerStats(102, True, 97.0, 310 << 20),
                    WorkerStats(103, False),
                ],
            ),
            LoaderStats(1, "loader 1", "ValSet", 64, 0, False, None, False),
        ],
    )


# -- the wire ----------------------------------------------------------------------------------


def test_step_and_loader_frames_round_trip() -> None:
    for message in (steps_frame(T0, 3, [None, 0.1, 0.2]), loaders_frame(T0)):
        assert decode(encode(message)) == message


def test_detail_weights_add_up_to_the_count() -> None:
    assert step_detail_weights(5, 5) == [1] * 5
    weights = step_detail_weights(1000, 64)
    assert sum(weights) == 1000 and set(weights) <= {15, 16}
    assert step_detail_weights(3, 0) == []


# -- the viewer's state ------------------------------------------------------------------------


def test_training_state_sums_and_the_recent_window() -> None:
    state = JobModel()
    assert not state.training.has_data
    state.apply(steps_frame(T0, 1, [None]))
    for i in range(1, 31):  # 30 s of 10 steps/s, waiting 60% of the time at the end
        wait = 0.02 if i <= 20 else 0.06
        state.apply(steps_frame(T0 + i, 1 + 10 * i, [0.1] * 10, wait=wait))
    training = state.training
    assert training.has_data and training.total == 301
    assert training.run.steps == 300
    recent = training.recent(state.now)
    assert recent.steps == 110  # frames at T0+20..T0+30
    assert recent.steps_per_s == pytest.approx(10.0)
    assert recent.samples_per_s == pytest.approx(320.0)
    assert training.run.wait_fraction == pytest.approx((20 * 0.2 + 10 * 0.6) / 30)
    assert training.input_bound(state.now)
    assert not training.input_bound(T0 + 15)  # the fast part


def test_a_slow_job_has_at_least_five_recent_steps() -> None:
    training = TrainingState()
    for i in range(10):
        training.apply(steps_frame(T0 + 60 * i, i + 1, [60.0]))
    assert training.recent(T0 + 540).steps == 5


def test_sampled_frames_keep_exact_counts_and_weights() -> None:
    training = TrainingState()
    training.apply(steps_frame(T0, 640, [0.001] * 64, count=640))
    assert training.run.steps == 640
    assert sum(p.weight for p in training.points) == 640


def test_loaders_replace_and_only_change_the_state_when_different() -> None:
    state = JobModel()
    state.apply(loaders_frame(T0))
    version = state.version
    state.apply(loaders_frame(T0 + 1))
    assert state.version == version + 1  # the time moved on, the loaders did not
    assert [x.dataset for x in state.training.loaders] == ["ImageFolder", "ValSet"]


# -- drawing -----------------------------------------------------------------------------------


def test_seconds_in_words_and_on_an_axis() -> None:
    assert format_seconds(0.00085) == "850 µs"
    assert format_seconds(0.0123) == "12.3 ms"
    assert format_seconds(0.122) == "122 ms"
    assert format_seconds(1.234) == "1.23 s"
    assert format_seconds(None) == "—"
    assert format_seconds_short(0.2) == "200ms"
    assert format_seconds_short(0.05) == "50ms"
    assert format_seconds_short(2.0) == "2s"
    assert all(len(format_seconds_short(v)) <= 5 for v in (0.0004, 0.012, 0.5, 1.5, 30.0))
    assert nice_seconds(0.13) == pytest.approx(0.2)
    assert nice_seconds(0.0004) == pytest.approx(0.0005)
    assert scale_top([0.1] * 9 + [5.0]) == pytest.approx(0.5)  # one slow step does not rule


def point(duration: float | None, wait: float, optimizer: float = 0.0) -> StepPoint:
    return StepPoint(0.0, duration, wait, 0.0, optimizer, 32)


def test_step_bars_stack_wait_under_compute() -> None:
    points = [point(0.1, 0.05), point(0.1, 0.0), point(None, 0.0), point(0.05, 0.05)]
    text = render_step_bars(points, width=12, height=2)
    lines = text.plain.split("\n")
    assert len(lines) == 2 and all(len(line) == 12 for line in lines)
    assert lines[0].startswith("100ms┤") and lines[1].startswith("    0┤")
    # Three timed steps on the right (the one without a duration has no bar); the last one
    # only waited, half the axis: its bar stops at the lower row.
    assert lines[0][6:] == "   ██ "
    assert lines[1][6:] == "   ███"
    styles = [str(span.style) for span in text.spans]
    assert styles.count("yellow") == 2 and "green" in styles
    half = render_step_bars([point(0.1, 0.05)], width=12, height=1)
    assert half.plain.endswith("▄") and "yellow on green" in [str(s.style) for s in half.spans]
    assert render_step_bars([], width=10, height=2).plain.count("\n") == 1
    assert render_step_bars(points, width=0, height=2).plain == ""


# -- the report --------------------------------------------------------------------------------


def test_report_keys_and_per_phase_steps() -> None:
    messages = [
        PhaseBegan(T0 - 0.5, "train", 1),
        steps_frame(T0, 1, [None]),
        steps_frame(T0 + 1, 11, [0.1] * 10, wait=0.025),
        PhaseEnded(T0 + 1.05, "train", 1),
        PhaseBegan(T0 + 1.1, "eval", 2),
        steps_frame(T0 + 2, 13, [0.3, 0.5], wait=0.1, skipped_total=1),
        PhaseEnded(T0 + 2.1, "eval", 2),
        loaders_frame(T0 + 2),
    ]
    report = summarize(messages)
    assert report["steps"] == 13 and report["skipped_steps"] == 1
    assert report["step_time_s"]["median"] == pytest.approx(0.1)
    assert report["step_time_s"]["p90"] == pytest.approx(0.3)
    assert report["throughput"]["samples_per_s"] == pytest.approx(32 * 12 / 1.8, rel=1e-3)
    data = report["dataloader"]
    assert data["wait_s"] == pytest.approx(0.45)
    assert data["wait_fraction"] == pytest.approx(0.45 / 1.8, rel=1e-3)
    (train, val) = data["loaders"]
    assert train["num_workers"] == 4 and train["dataset"] == "ImageFolder"
    assert train["start_method"] == "fork" and train["workers_seen"] == 3
    assert val["num_workers"] == 0 and val["name"] == "loader 1"
    train_phase, eval_phase = report["phases"]
    assert (train_phase["steps"], train_phase["median_step_time_s"]) == (11, pytest.approx(0.1))
    assert (eval_phase["steps"], eval_phase["median_step_time_s"]) == (2, pytest.approx(0.3))


def test_report_without_steps_has_the_keys_with_nulls() -> None:
    report = summarize([])
    assert report["steps"] == 0
    assert report["step_time_s"]["median"] is None
    assert report["throughput"]["samples_per_s"] is None
    assert report["dataloader"]["wait_fraction"] is None
    assert report["dataloader"]["loaders"] == []


def test_weighted_quantiles() -> None:
    assert weighted_quantile([], 0.5) is None
    assert weighted_quantile([(1.0, 1), (2.0, 1), (3.0, 1)], 0.5) == 2.0
    assert weighted_quantile([(1.0, 9), (10.0, 1)], 0.9) == 1.0
    assert weighted_quantile([(1.0, 8), (10.0, 2)], 0.9) == 10.0


def test_an_older_loader_reading_never_replaces_a_newer_one() -> None:
    newer, older = loaders_frame(T0 + 2), loaders_frame(T0 + 1)
    older = LoaderInfo(older.t, [older.loaders[0]])
    report = summarize([newer, older])
    assert len(report["dataloader"]["loaders"]) == 2
    training = TrainingState()
    assert training.apply(newer) and not training.apply(older)
    assert len(training.loaders) == 2


def test_the_step_chart_draws_a_fast_jobs_folded_steps_as_it_would_draw_every_step() -> None:
    """A job stepping every 5 ms: the chart's series hold one point per tenth of a second (the
    longest step and the longest wait, each at its own time), a twentieth of the steps, and
    the chart drawn from them is the chart drawn from every step."""
    import math
    import random

    from torchtop.tui.widgets.chart import ChartSeries, render_chart
    from torchtop.tui.widgets.steps import history_data

    rng = random.Random(7)
    job = JobModel()
    t, total = T0, 0
    raw_steps: list[tuple[float, float | None]] = []
    raw_waits: list[tuple[float, float | None]] = []
    for _frame in range(300):  # 30 s: a frame every 0.1 s, 20 steps each
        spread = [rng.uniform(0.5, 1.5) ** 3 for _ in range(20)]
        durations: list[float | None] = [0.1 * x / sum(spread) for x in spread]
        waits = [0.002 * rng.random() ** 4 for _ in range(20)]
        t += 0.1
        total += 20
        frame = steps_frame(t, total, durations)
        frame = StepStats(**{**frame.__dict__, "waits": waits})
        job.apply(frame)
        raw_steps += zip(frame.ends, durations, strict=True)
        raw_waits += zip(frame.ends, waits, strict=True)
    job.now = t
    series, _spans, first, _end = history_data(job)
    assert len(series[1].points) <= 301 and len(raw_steps) == 6000
    # Columns half a second wide from a whole second on: each tenth of a second is in one.
    t_start = math.ceil(first) + 1.0
    t_end = t_start + 24.0
    width = 6 + 24  # 48 dot columns

    def drawn(chart: list[ChartSeries]) -> str:
        text = render_chart(chart, width=width, height=5, t_start=t_start, t_end=t_end, y_max=0.05)
        return text.plain

    raw = [ChartSeries("wait", raw_waits, "blue", fill=True), ChartSeries("step", raw_steps, "red")]
    assert drawn(series) == drawn(raw)
    assert drawn(series) != drawn([raw[0], ChartSeries("step", raw_steps[::20], "red")])

"""The model of a long job stays bounded: three hours of frames at 10 Hz, its size checked each
hour. Every bounded store is full after the first hour, so a size that still grows from the second
hour to the third is a leak. (``python -m benchmarks.model_fold --hours 24`` folds a whole day.)"""

from __future__ import annotations

from benchmarks.model_fold import HZ, deep_size, synthetic_job
from torchtop.model import JobModel

MiB = 1 << 20
SPAN_S = 3 * 3600.0
#: What a model may hold, whatever the job's length (measured: about 14 MiB).
LIMIT = 32 * MiB


def test_three_hours_at_10_hz_stay_bounded() -> None:
    model = JobModel()
    sizes: dict[int, int] = {}
    checkpoints = {int(h * 3600 * HZ) for h in (1, 2, 3)}
    ticks = 0
    for message in synthetic_job(SPAN_S):
        model.apply(message)
        if type(message).__name__ == "Sample":
            ticks += 1
            if ticks in checkpoints:
                sizes[ticks // (3600 * HZ)] = deep_size(model)
    assert ticks == SPAN_S * HZ
    assert set(sizes) == {1, 2, 3}
    # Full after the first hour; after that only the running values change.
    assert sizes[3] <= sizes[2] * 1.1 and sizes[2] <= sizes[1] * 1.5, sizes
    assert sizes[3] < LIMIT, sizes
    # The whole-run figures still cover the whole run.
    assert model.training.total == model.training.steps_between(None, None)
    assert model.training.history.halvings > 0
    assert model.training.step_time(0.5) is not None
    assert len(model.training.points) == model.training.max_points
    assert len(model.logs) == model.log_lines and model.log_total == SPAN_S


def test_a_rank_in_a_runs_view_keeps_its_last_minute_in_little_memory() -> None:
    from torchtop.streams.runs import rank_model

    model = rank_model()
    for message in synthetic_job(3600.0):
        model.apply(message)
    # 64 ranks in one view: under 128 MiB of models (a single job's screen holds ~14 MiB).
    assert deep_size(model) < 2 * MiB
    # What the run's view shows of a rank: a minute of steps for its strip (the view's chart
    # window) and of samples, the latest figures, and the whole run's median step for the
    # hang rule.
    points = model.training.points
    assert points[-1].t - points[0].t >= 60.0
    assert len(model.rss_series) >= 60 * HZ
    assert model.training.step_time(0.5) is not None
    assert model.training.total == 3600 * 30

"""The model of a day-long job stays bounded: a day of frames at 10 Hz, and its size checked."""

from __future__ import annotations

from benchmarks.model_fold import HZ, deep_size, synthetic_job
from torchtop.model import JobModel

MiB = 1 << 20
DAY_S = 24 * 3600.0
#: What a model may hold, whatever the job's length (measured: about 14 MiB).
LIMIT = 32 * MiB


def test_a_day_at_10_hz_stays_bounded() -> None:
    model = JobModel()
    sizes: dict[int, int] = {}
    checkpoints = {int(h * 3600 * HZ) for h in (1, 6, 24)}
    ticks = 0
    for message in synthetic_job(DAY_S):
        model.apply(message)
        if type(message).__name__ == "Sample":
            ticks += 1
            if ticks in checkpoints:
                sizes[ticks // (3600 * HZ)] = deep_size(model)
    assert ticks == DAY_S * HZ
    assert set(sizes) == {1, 6, 24}
    # Full after the first hour; after that only the running values change.
    assert sizes[24] <= sizes[6] * 1.1 and sizes[6] <= sizes[1] * 1.5, sizes
    assert sizes[24] < LIMIT, sizes
    # The whole-run figures still cover the whole day.
    assert model.training.total == model.training.steps_between(None, None)
    assert model.training.history.halvings > 0
    assert model.training.step_time(0.5) is not None
    assert len(model.training.points) == model.training.max_points
    assert len(model.logs) == model.log_lines and model.log_total == DAY_S
